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
from protrain_fx.passes._fx import call, node_positions, output_node
from protrain_fx.passes.annotate import META_KEY, NodeAnnotation

from protrain_fx import ops
from protrain_fx.plan import Plan


def optimizer_calls(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Collect offloaded chunks' gradients into flat buffers and queue their CPU step (see docstring)."""
    if not plan.grad_slots:
        return gm
    graph = gm.graph
    out = output_node(gm)
    outputs = list(out.args[0])
    pos = node_positions(graph)
    for (store_id, chunk), slots in sorted(plan.grad_slots.items()):
        grads = [(outputs[o], entry) for o, entry in slots if o < len(outputs) and isinstance(outputs[o], fx.Node)]
        if not grads:
            continue
        last = max((g for g, _ in grads), key=pos.__getitem__)
        with graph.inserting_before(last.next):
            done = call(gm, ops.CHUNK_GRAD, ([g for g, _ in grads], [], store_id, chunk, [e for _, e in grads]))
        done.meta[META_KEY] = NodeAnnotation("backward", "non_block", chunk=chunk)
        for o, _ in slots:
            if o < len(outputs):
                outputs[o] = None
    out.args = (tuple(outputs),)
    return gm
