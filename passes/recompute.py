"""recompute: tag the nodes the partitioner must recompute in backward instead of saving.

Tags every ``protrain::gather`` and everything that only views, casts or copies out its parameters (the
per-parameter slices, views, upcasts and ``protrain::vectors``) with ``CheckpointPolicy.MUST_RECOMPUTE``. Untagged, the partitioner saves the
gathered chunk from forward to backward, which keeps every offloaded chunk alive on the device; tagged,
backward re-gathers each chunk just before its first backward use (the chunk-schedule pass then prefetches
it). A saved view of a chunk buffer would also be wrong: the buffer is reused for other chunks.
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx import ops
from protrain_fx.passes._fx import cast_dtype, is_view_op
from protrain_fx.plan import Plan

# one id for all: recompute regions are not split at gather boundaries
AC_GRAPH_ID = 100_000


def recompute(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Tag gathers and their views/casts MUST_RECOMPUTE (see module docstring)."""
    stack = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.GATHER]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = AC_GRAPH_ID
        for user in node.users:
            if user.op == "call_function" and (is_view_op(user.target) or cast_dtype(user) is not None
                                               or user.target in (ops.VECTORS, operator.getitem)):
                stack.append(user)
    return gm
