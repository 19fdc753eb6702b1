"""optimizer_calls: hand each offloaded chunk's gradient to the CPU optimizer as soon as it is complete.

Runs on the backward graph. The backward graph returns one gradient per forward input; for the parameters
of an offloaded chunk (``plan.grad_slots``) it inserts, right after the last of them is computed, the
chunk's flat gradient in the chunk layout and transfer dtype (``cat`` of the casts, zero-padded where the
layout has gaps) and ``protrain::chunk_grad``, which copies it to the host on its own stream and queues that
chunk's CPU AdamW step. The graph then returns ``None`` for those parameters: their gradients live on the
host, and autograd leaves ``param.grad`` alone.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from protrain_fx import chunks, ops
from protrain_fx.passes._fx import call, node_positions, output_node
from protrain_fx.passes.annotate import META_KEY, NodeAnnotation
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
        store = chunks.get_store(store_id)
        grads = [(outputs[o], entry) for o, entry in slots if o < len(outputs) and isinstance(outputs[o], fx.Node)]
        if not grads:
            continue
        last = max((g for g, _ in grads), key=pos.__getitem__)
        by_offset = sorted(grads, key=lambda ge: store.entries[ge[1]].offset)
        dtype, device = store.param_dtype, store.device
        with graph.inserting_before(last.next):
            pieces, cursor = [], 0
            for g, entry in by_offset:
                e = store.entries[entry]
                if e.offset > cursor:
                    pieces.append(call(gm, torch.ops.aten.full.default, ([e.offset - cursor], 0.0),
                                       {"dtype": dtype, "device": device}))
                flat_g = call(gm, torch.ops.aten.reshape.default, (g, [-1]))
                if g.meta["val"].dtype != dtype:
                    flat_g = call(gm, torch.ops.prims.convert_element_type.default, (flat_g, dtype))
                pieces.append(flat_g)
                cursor = e.offset + e.numel
            total = store.chunk_numel(chunk)
            if total > cursor:
                pieces.append(call(gm, torch.ops.aten.full.default, ([total - cursor], 0.0),
                                   {"dtype": dtype, "device": device}))
            flat = call(gm, torch.ops.aten.cat.default, (pieces,))
            members = [entry for _, entry in grads]
            done = call(gm, ops.CHUNK_GRAD, (flat, [], store_id, chunk, members))
        for n in (*pieces, flat, done):
            n.meta[META_KEY] = NodeAnnotation("backward", "non_block", chunk=chunk)
        for o, _ in slots:
            if o < len(outputs):
                outputs[o] = None
    out.args = (tuple(outputs),)
    return gm
