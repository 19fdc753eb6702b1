"""chunk_schedule: prefetch each offloaded chunk ahead of its gather, release its buffer after its last
use, and pin the order of protrain ops with data-dependency tokens.

Runs on forward, backward and inference graphs, after the gathers exist (chunk_gather in the joint graph;
the partitioner re-gathers in backward). Walking the graph in order with ``n_buffer`` device chunk
buffers, it inserts

* ``release(tokens=[last reader], chunk)`` right after the last node that reads the chunk's buffer
  (through views; a cast is a reader), so the buffer can be refilled;
* ``prefetch(tokens=[release that freed a buffer], chunk)`` for the next gather as soon as a buffer is
  free: at the graph's start for the first ``n_buffer`` gathers, then right after each release;
* tokens on each gather: its own prefetch, and every prefetch, release, chunk_grad and resident_grads
  placed since the previous gather. Inductor may not move a protrain op past the next gather (and the
  compute that needs it), so copies are issued early and gradients leave as soon as they are complete.

The runtime skips the copy when a buffer still holds the chunk (backward's first chunks are forward's
last). The pass also computes how many chunks are in use at once; ``n_buffer`` below that cannot work
(error naming the minimum), and the automatic default is raised to it.
"""
from __future__ import annotations

import torch.fx as fx
from protrain_fx.passes._fx import alias_closure, call, node_positions, token_node
from protrain_fx.passes.annotate import META_KEY, NodeAnnotation

from protrain_fx import _compat, chunks, ops
from protrain_fx.options import OptionsError
from protrain_fx.plan import Plan


def _last_reader(gather: fx.Node, pos: dict) -> fx.Node:
    readers = [u for a in alias_closure(gather) for u in a.users if u.op != "output"]
    views = set(alias_closure(gather))
    readers = [r for r in readers if r not in views] or list(views)
    return max(readers, key=pos.__getitem__)


def chunk_buffers_needed(gm: fx.GraphModule) -> int:
    """The largest number of gathered chunks in use at the same time in ``gm``."""
    pos = node_positions(gm.graph)
    events = []
    for g in (n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.GATHER):
        events += [(pos[g], 1), (pos[_last_reader(g, pos)], -1)]
    live = best = 0
    for _, delta in sorted(events):  # at one node a release (-1) counts before a gather (+1)
        live += delta
        best = max(best, live)
    return best


def chunk_schedule(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Insert prefetch/release ops and ordering tokens around the gathers (see module docstring)."""
    graph = gm.graph
    gathers = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.GATHER]
    if not gathers:
        return gm
    needed = chunk_buffers_needed(gm)
    n_buffer = plan.n_buffer
    if needed > n_buffer:
        if plan.n_buffer_given:
            raise OptionsError(
                f"n_buffer={n_buffer} is too small for graph {plan.graph_name}: {needed} offloaded chunks are in "
                f"use at the same time there; the smallest n_buffer that works is {needed}"
            )
        n_buffer = plan.n_buffer = needed
    with _compat.real_tensor_mode():  # compile callbacks run under aot_autograd's fake mode
        for store_id in {g.args[1] for g in gathers}:
            chunks.get_store(store_id).ensure_buffers(n_buffer)

    pos = node_positions(graph)
    last_reader = {g: _last_reader(g, pos) for g in gathers}
    # walk in order: (position, kind, gather)
    GATHER_AT, RELEASE_AT = 0, 1
    events = sorted([(pos[g], GATHER_AT, g) for g in gathers] + [(pos[last_reader[g]], RELEASE_AT, g) for g in gathers],
                    key=lambda e: (e[0], e[1]))
    to_prefetch = list(gathers)
    prefetched: dict[fx.Node, fx.Node] = {}
    pending_tokens: list[fx.Node] = []  # ops to pin before the next gather
    in_use = 0

    def ann(chunk):
        return {META_KEY: NodeAnnotation("forward", "non_block", chunk=chunk)}

    def issue_prefetches(after: fx.Node | None, deps: list[fx.Node]):
        nonlocal in_use
        while to_prefetch and in_use < n_buffer:
            g = to_prefetch.pop(0)
            where = graph.inserting_before(after.next if after is not None else first_compute)
            with where:
                p = call(gm, ops.PREFETCH, (list(deps), g.args[1], g.args[2]), meta=ann(g.args[2]))
            if after is not None:
                after = p
            prefetched[g] = p
            pending_tokens.append(p)
            in_use += 1

    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    issue_prefetches(None, [])
    for _, kind, g in events:
        if kind == GATHER_AT:
            if g not in prefetched:  # no buffer was free earlier: fetch right here
                if to_prefetch and to_prefetch[0] is g:
                    to_prefetch.pop(0)
                with graph.inserting_before(g):
                    p = call(gm, ops.PREFETCH, ([], g.args[1], g.args[2]), meta=ann(g.args[2]))
                prefetched[g] = p
                pending_tokens.append(p)
                in_use += 1
            deps = list(dict.fromkeys(pending_tokens + [prefetched[g]]))
            pending_tokens.clear()
            g.update_arg(0, deps)
        else:  # after the last reader: release, then prefetch into the freed buffer
            reader = token_node(last_reader[g])
            with graph.inserting_after(reader):
                r = call(gm, ops.RELEASE, ([reader], g.args[1], g.args[2]), meta=ann(g.args[2]))
            in_use -= 1
            pending_tokens.append(r)
            issue_prefetches(r, [r])
    # chunk_grad and resident_grads ops: pin each before the next gather that follows it
    pos = node_positions(graph)
    gathers_in_order = sorted(gathers, key=pos.__getitem__)
    for cg in (n for n in graph.nodes if n.op == "call_function" and n.target in ops.GRAD_OPS):
        nxt = next((g for g in gathers_in_order if pos[g] > pos[cg]), None)
        if nxt is not None:
            nxt.update_arg(0, list(nxt.args[0] or []) + [cg])
    return gm
