"""recompute: tag the nodes the partitioner must recompute in backward instead of saving.

* Every ``protrain::gather`` and everything that only views, casts or copies out its parameters
  (slices, views, upcasts, ``protrain::vectors``). Untagged, the partitioner saves the gathered
  chunk from forward to backward, keeping every offloaded chunk alive on the device; tagged,
  backward re-gathers each chunk just before its first backward use (chunk_schedule prefetches it).
  A saved view of a chunk buffer would also be wrong: the buffer is reused for other chunks.
  Likewise a chunk sharded on the devices: ``protrain::shard_values``, the functional all-gather
  and its wait (the partitioner recomputes collectives only when they are tagged so).
* Every forward node of the blocks whose policy is "recompute", one ``ac_graph_id`` per block: the
  semantics of ``torch.utils.checkpoint`` per block. The partitioner saves what each block needs
  from outside (its input, which the previous block's region must save: the partitioner stashes a
  tagged node used by a later region) and recomputes the rest in backward. Random ops are recomputed
  too: the partitioner threads their RNG state from forward to backward, so dropout masks equal
  forward's. A node that reads a graph input the graph writes in place (a buffer updated in
  forward: a BatchNorm's running statistics, a step counter, read directly or through views) is
  saved instead: recomputed in backward it would read the input as written, and the block's
  gradients would be those of another function than the forward ran.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.graph.annotation import annotation_of
from protrain_fx.graph.fx import cast_dtype, is_view_op
from protrain_fx.graph.inputs import written_inputs
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import ops

# a chunk sharded on the devices is gathered by the graph's functional all-gather and its wait
_GATHERED = (ops.ALL_GATHER, ops.WAIT_TENSOR)
# Gathers share one id above every block's: the partitioner turns a tagged node into MUST_SAVE when
# a tagged user has a *larger* id, which must never happen to a gathered view (block ids are
# 0..n-1).
AC_GRAPH_ID = 100_000
aten = torch.ops.aten


def tag_blocks_for_recompute(gm: fx.GraphModule, blocks) -> None:
    """Tag the forward nodes of ``blocks`` (indices) MUST_RECOMPUTE, one ``ac_graph_id`` per
    block; those that read an input the graph writes MUST_SAVE."""
    reads_written = reads_of_written_inputs(gm)
    for node in gm.graph.nodes:
        ann = annotation_of(node)
        if (
            node.op == "call_function"
            and ann is not None
            and ann.phase == "forward"
            and ann.block in blocks
            and ann.chunk is None
        ):
            if node in reads_written and isinstance(node.meta.get("val"), (tuple, list)):
                continue  # several outputs (a batch norm's): its getitems are saved
            saved = node in reads_written or (
                node.target is operator.getitem and node.args[0] in reads_written
            )
            node.meta["recompute"] = (
                CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.MUST_RECOMPUTE
            )
            node.meta["ac_graph_id"] = ann.block


def reads_of_written_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes that read, directly or through views, a graph input that the call writes in
    place (graph/inputs.written_inputs: a buffer or parameter updated in forward)."""
    reads, stack, seen = set(), list(written_inputs(gm)), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op != "call_function" or (
                user.target is aten.copy_.default and user.args[0] is node
            ):
                continue
            if is_view_op(user.target):  # an alias of the input: its readers read the input
                stack.append(user)
            elif not _only_updates(user):
                reads.add(user)
    return reads


def _only_updates(node: fx.Node) -> bool:
    """A training-mode batch norm: it reads its running statistics only to compute their update
    (written back by ``copy_``); its output does not depend on them, so it is recomputed exactly
    (saving it kept every recomputed block's normalized activation)."""
    return node.target is aten._native_batch_norm_legit_functional.default and bool(
        node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
    )


def untag_blocks(gm: fx.GraphModule) -> None:
    """Drop the block recompute tags (gathers keep theirs): the joint graph as if every block
    kept."""
    for node in gm.graph.nodes:
        if node.meta.get("ac_graph_id") is not None and node.meta["ac_graph_id"] != AC_GRAPH_ID:
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)


def recompute(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Tag gathers (and their views/casts) and checkpointed blocks MUST_RECOMPUTE (see module
    docstring)."""
    checkpointed = {i for i, b in enumerate(plan.blocks) if b.policy == "recompute"}
    if checkpointed:
        tag_blocks_for_recompute(gm, checkpointed)
    gathers = (ops.GATHER, ops.SHARD_VALUES)
    stack = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in gathers]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = AC_GRAPH_ID
        for user in node.users:
            if user.op == "call_function" and (
                is_view_op(user.target)
                or cast_dtype(user) is not None
                or user.target in (ops.VECTORS, operator.getitem, *_GATHERED)
            ):
                stack.append(user)
    return gm
