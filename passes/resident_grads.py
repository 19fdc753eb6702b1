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
from protrain_fx.passes._fx import call, node_positions, output_node
from protrain_fx.passes.annotate import META_KEY, NodeAnnotation

from protrain_fx import ops
from protrain_fx.plan import Plan


def resident_grads(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """All-reduce resident chunks' gradients from inside backward (see module docstring)."""
    if plan.world_size <= 1 or not plan.resident_grad_slots:
        return gm
    graph = gm.graph
    out = output_node(gm)
    outputs = list(out.args[0])
    pos = node_positions(graph)
    for (store_id, chunk), slots in sorted(plan.resident_grad_slots.items()):
        grads = [(o, outputs[o], entry) for o, entry in slots if o < len(outputs) and isinstance(outputs[o], fx.Node)]
        if not grads:
            continue
        last = max((g for _, g, _ in grads), key=pos.__getitem__)
        with graph.inserting_before(last.next):
            args = ([g for _, g, _ in grads], [], store_id, chunk, [e for _, _, e in grads])
            done = call(gm, ops.RESIDENT_GRADS, args)
        done.meta[META_KEY] = NodeAnnotation("backward", "non_block", chunk=chunk)
        for o, _, _ in grads:
            outputs[o] = None
    out.args = (tuple(outputs),)
    return gm
