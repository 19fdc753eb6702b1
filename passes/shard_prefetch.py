"""shard_prefetch (forward, backward and inference graphs): start each chunk sharded on the devices'
all-gather one chunk ahead, and wait for each one's gradient reduce-scatter as late as the next
chunk's.

A chunk sharded on the devices (``n_shard``; docs/design.md, section 9) is gathered by the graph
itself (passes/chunk_gather.py: ``protrain::shard_values``, a functional all-gather, its wait) and
its gradient reduce-scattered by it (passes/optimizer_calls.py: ``protrain::pack_grads``, a
functional reduce-scatter, its wait, ``protrain::shard_grad``). As inserted, each collective is
waited for right after it starts. This pass moves the start of gather ``i + 1`` (its shard and its
all-gather) to just before the wait of gather ``i``, so that the collective runs while the compute
that reads chunk ``i`` does (the partitioner's re-gathers in backward likewise), and the wait of
reduce-scatter ``i`` (with the ``shard_grad`` that reads it) to just before the packing of the next
chunk's gradients, so that it runs beside the backward in between. One extra gathered chunk is
alive at a time, which the chunk buffers the cost model counts for the chunks after the resident
ones cover. Nothing moves with one rank (no such chunks).
"""

from __future__ import annotations

import torch.fx as fx

from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import ops


def _wait_of(node: fx.Node) -> fx.Node | None:
    return next((u for u in node.users if u.target is ops.WAIT_TENSOR), None)


def shard_prefetch(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Move the sharded chunks' collectives' starts earlier and their waits later (see module
    docstring)."""
    if plan.world_size <= 1:
        return gm
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    gathers = [
        n for n in nodes if n.target is ops.ALL_GATHER and n.args[0].target is ops.SHARD_VALUES
    ]
    waits = [_wait_of(g) for g in gathers]
    for i in range(1, len(gathers)):
        if waits[i - 1] is None:
            continue
        waits[i - 1].prepend(gathers[i].args[0])  # the shard, then its all-gather
        waits[i - 1].prepend(gathers[i])
    packs = [n for n in nodes if n.target is ops.PACK_GRADS]
    for i, pack in enumerate(packs[:-1]):
        reduce = next((u for u in pack.users if u.target is ops.REDUCE_SCATTER), None)
        wait = _wait_of(reduce) if reduce is not None else None
        done = [u for u in wait.users if u.target is ops.SHARD_GRAD] if wait is not None else []
        if wait is None or len(done) != 1 or len(wait.users) != 1:
            continue
        packs[i + 1].prepend(wait)
        packs[i + 1].prepend(done[0])  # after the wait, just before the next packing
    gm.graph.lint()
    return gm
