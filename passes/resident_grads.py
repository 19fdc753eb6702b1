"""resident_grads: data parallel only: start each resident chunk's gradient all-reduce inside backward.

Runs on the backward graph when the plan has several ranks (``plan.world_size > 1``). Resident chunks are
replicated, so their gradients must be averaged over the ranks. A compiled backward returns every gradient
at its very end, so averaging them from autograd's hooks leaves the whole all-reduce exposed after backward
(about 24 ms of a 180 ms step for the 1.4B GPT on two H200s). For every resident chunk
(``plan.resident_grad_slots``) the pass inserts, right after the last of its gradients is computed,
``protrain::resident_grads(grads)``: the runtime copies them into a flat buffer and starts one async
all-reduce of it, which runs while backward goes on with the earlier blocks. The graph then returns
``None`` for those parameters; the runtime writes the averaged values into ``param.grad`` (or adds them)
before anything reads it: the optimizer's step, clipping, the next graph call
(:func:`protrain_fx.distributed.wait_resident_grads`).
"""
from __future__ import annotations

import torch.fx as fx
from protrain_fx.passes._fx import take_chunk_grads

from protrain_fx import ops
from protrain_fx.plan import Plan


def resident_grads(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """All-reduce resident chunks' gradients from inside backward (see module docstring)."""
    if plan.world_size > 1 and plan.resident_grad_slots:
        take_chunk_grads(gm, plan.resident_grad_slots, ops.RESIDENT_GRADS)
    return gm

