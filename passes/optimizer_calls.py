"""optimizer_calls: hand each offloaded chunk's gradient to the host as soon as it is complete.

Runs on the joint graph, after chunk_gather. The joint graph returns one gradient per primal input,
after the forward outputs; for the parameters of an offloaded chunk (``plan.grad_slots``) the pass
inserts, right after the last of them is computed, ``protrain::chunk_grad(grads, params)``, which
packs them into a device gradient buffer in the chunk layout (master dtype), copies that to the host
on the copy stream and lets the host worker accumulate it and maybe step the chunk
(protrain_fx/runtime/chunk_store.py). The joint graph then returns ``None`` for those parameters:
their gradients live on the host, and autograd leaves ``param.grad`` to the runtime. Because the op
takes the parameters themselves, the partitioner keeps them as inputs of the backward graph, so the
runtime finds the chunk from the parameters each call was made with.
"""

from __future__ import annotations

import torch.fx as fx

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation
from protrain_fx.graph.fx import call, node_positions, output_node
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import ops


def optimizer_calls(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Collect offloaded chunks' gradients into ``protrain::chunk_grad`` (see module docstring)."""
    if not plan.grad_slots:
        return gm
    graph = gm.graph
    out = output_node(gm)
    outputs = list(out.args[0])
    n_primals = sum(
        1 for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")
    )
    first_grad = len(outputs) - n_primals
    pos = node_positions(graph)
    for _, slots in sorted(plan.grad_slots.items(), key=lambda kv: kv[0]):
        grads = [
            (first_grad + ordinal, outputs[first_grad + ordinal], ph)
            for ordinal, _, ph in slots
            if isinstance(outputs[first_grad + ordinal], fx.Node)
        ]
        if not grads:
            continue  # frozen parameters: no gradients
        last = max((g for _, g, _ in grads), key=pos.__getitem__)
        with graph.inserting_after(last):
            node = call(
                gm,
                ops.CHUNK_GRAD,
                ([g for _, g, _ in grads], [ph for _, _, ph in grads], []),
                meta={"partitioner_tag": "is_backward"} if "partitioner_tag" in last.meta else None,
            )
        node.meta[META_KEY] = NodeAnnotation("backward", "non_block")
        for o, _, _ in grads:
            outputs[o] = None
    out.args = (tuple(outputs),)
    return gm
