"""chunk_schedule: prefetch each offloaded chunk ahead of its gather, and pin the order of protrain
ops with data-dependency tokens.

Runs on forward, backward and inference graphs, after the gathers exist (chunk_gather in the joint
graph; the partitioner re-gathers in backward). ``protrain::gather`` copies its chunk out of a
device chunk buffer into a tensor the graph owns, so a buffer is free again right after its gather;
with ``n_buffer`` buffers the pass inserts

* ``prefetch(anchor)`` for the first ``n_buffer`` gathers at the graph's start, and for gather ``i +
  n_buffer`` right after gather ``i`` (whose buffer it refills), depending on that gather's output;
* tokens on each gather: its own prefetch, and every prefetch and chunk_grad / resident_grads placed
  since the previous gather. Inductor may not move a protrain op past the next gather (and the
  compute that needs it), so copies are issued early and gradients leave as soon as they are
  complete.

The runtime skips the copy when a buffer still holds the chunk (backward's first chunks are
forward's last). The pass records how many gathered chunks are alive at once
(``plan.chunks_in_use``: device memory the cost model counts beside the buffers). It allocates
nothing: the ``n_buffer`` device buffers the prefetches fill are allocated by the runtime once the
passes are done (protrain_fx/placement.py).
"""

from __future__ import annotations

import torch.fx as fx

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation
from protrain_fx.graph.fx import alias_closure, call, node_positions
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import ops


def _last_reader(gather: fx.Node, pos: dict) -> fx.Node:
    readers = [u for a in alias_closure(gather) for u in a.users if u.op != "output"]
    views = set(alias_closure(gather))
    readers = [r for r in readers if r not in views] or list(views)
    return max(readers, key=pos.__getitem__)


def chunks_in_use(gm: fx.GraphModule) -> int:
    """The largest number of gathered chunks alive at the same time in ``gm`` (from each gather to
    its last reader, in graph order)."""
    pos = node_positions(gm.graph)
    events = []
    for g in (n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.GATHER):
        events += [(pos[g], 1), (pos[_last_reader(g, pos)], -1)]
    live = best = 0
    for _, delta in sorted(events):  # at one node a last read (-1) counts before a gather (+1)
        live += delta
        best = max(best, live)
    return best


def _anchor(gather: fx.Node) -> fx.Node:
    return gather.args[1]


def chunk_schedule(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Insert prefetch ops and ordering tokens around the gathers (see module docstring)."""
    graph = gm.graph
    gathers = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.GATHER]
    if not gathers:
        return gm
    plan.chunks_in_use = max(plan.chunks_in_use, chunks_in_use(gm))
    # the device buffers themselves: placement.allocate_buffers, after the passes
    n_buffer = max(1, plan.n_buffer)

    def ann(g):
        a = g.meta.get(META_KEY)
        return {
            META_KEY: NodeAnnotation(
                "forward", "non_block", chunk=a.chunk if a is not None else None
            )
        }

    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    prefetch_of: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first_compute):
        for g in gathers[:n_buffer]:
            prefetch_of[g] = call(gm, ops.PREFETCH, ([], _anchor(g)), meta=ann(g))
    for i, g in enumerate(gathers):
        nxt = i + n_buffer
        if nxt < len(gathers):
            with graph.inserting_after(g):
                prefetch_of[gathers[nxt]] = call(
                    gm, ops.PREFETCH, ([g], _anchor(gathers[nxt])), meta=ann(gathers[nxt])
                )
    # tokens: each gather after its prefetch and after every prefetch / gradient op placed since the
    # previous
    pos = node_positions(graph)
    pinned = [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target in (ops.PREFETCH, *ops.GRAD_OPS)
    ]
    order = sorted(gathers, key=pos.__getitem__)
    k = 0
    for g in order:
        deps = []
        while k < len(pinned) and pos[pinned[k]] < pos[g]:
            deps.append(pinned[k])
            k += 1
        deps = list(dict.fromkeys(deps + [prefetch_of[g]]))
        g.update_arg(0, deps)
    return gm
