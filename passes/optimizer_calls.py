"""optimizer_calls: hand each offloaded chunk's gradient to the CPU optimizer as soon as it is complete.

Runs on the backward graph. The backward graph returns one gradient per forward input; for the parameters
of an offloaded chunk (``plan.grad_slots``) it inserts, right after the last of them is computed,
``protrain::chunk_grad(grads)``, which packs them into the chunk's device gradient buffer in the chunk
layout (master dtype), copies that to the host on its own stream and queues the chunk's CPU AdamW step.
The graph then returns ``None`` for those parameters: their gradients live on the host, and autograd leaves
``param.grad`` alone.
"""
from __future__ import annotations

import torch.fx as fx
from protrain_fx.passes._fx import take_chunk_grads

from protrain_fx import ops
from protrain_fx.plan import Plan


def optimizer_calls(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Collect offloaded chunks' gradients into flat buffers and queue their CPU step (see docstring)."""
    if plan.grad_slots:
        take_chunk_grads(gm, plan.grad_slots, ops.CHUNK_GRAD)
    return gm

