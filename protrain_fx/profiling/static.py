"""The static part of the profile: what the partitions of a graph say, without running it.

From two partitions of copies of the joint graph, with the partitioner the real compile uses, what
forward keeps for backward per block under each policy: one where every block keeps (block
recompute tags dropped) and one where every block recomputes (what a checkpointed block keeps: the
values it restarts from). A saved value counts for the block that produced it, except under
recomputation, where a block's input (produced by the block before it) counts for the block that
restarts from it; values produced outside blocks count as non-block (a block's backward node the
partitioner moved into forward is the block's). In a region's graph (protrain_fx/graph/regions.py)
the values other regions computed are its inputs: those it keeps count for the block that reads
them. Also per block, the share of its forward FLOPs that the all-recompute backward recomputes (the
partitioner saves some outputs, e.g. attention's, and never recomputes what only feeds saved
values), and a signature of its compute (blocks with equal signatures take the same time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
import torch.utils._pytree as pytree

from protrain_fx.graph import sizes
from protrain_fx.graph.annotation import annotation_of
from protrain_fx.graph.fx import (
    cast_dtype,
    copy_graph_module,
    is_view_op,
    saved_values,
    tensor_bytes,
)
from protrain_fx.passes.recompute import tag_blocks_for_recompute, untag_blocks
from protrain_fx.runtime import ops


def _unmarked(node: fx.Node) -> fx.Node:
    """The value a profiling mark (passes/block_marks.py, a copy) stands for: without marks it is
    saved."""
    while node.op == "call_function" and node.target is ops.MARK:
        node = node.args[0]
    return node


def _readers(node: fx.Node) -> list[fx.Node]:
    """Who reads ``node``, looking through profiling marks."""
    out = []
    for u in node.users:
        out += _readers(u) if u.op == "call_function" and u.target is ops.MARK else [u]
    return out


def _input_kind(node: fx.Node) -> str | None:
    """For a placeholder of a region's graph that another region computed (protrain_fx/graph/
    regions.py; kept for backward, it is memory the whole graph's partition would have saved):
    "activation" (the residual stream, one region's output) or "shared" (read by many regions and
    needing no gradient: rotary tables, masks); else None."""
    ann = annotation_of(node)
    if node.op != "placeholder" or ann is None or ann.input_kind not in ("activation", "shared"):
        return None
    return ann.input_kind


def _is_activation_input(node: fx.Node) -> bool:
    return _input_kind(node) is not None


def _of_an_input(node: fx.Node) -> bool:
    """A view of an input of the graph that is not another region's activation (no memory of its
    own), or a parameter's compute-dtype cast: a parameter is a placeholder only where its chunk
    is resident (an earlier graph's placement; offloaded ones are gathered), and the cost model
    prices a resident chunk's values and casts itself (``resident_cast_elem``), never as a block's
    activations."""
    cast = False
    while node.op == "call_function" and (is_view_op(node.target) or cast_dtype(node) is not None):
        cast, node = cast or cast_dtype(node) is not None, node.args[0]
    ann = annotation_of(node)
    param = ann is not None and ann.input_kind == "param"
    return node.op == "placeholder" and not _is_activation_input(node) and (param or not cast)


def _saved(fw: fx.GraphModule, bw: fx.GraphModule) -> list[fx.Node]:
    """What forward saves for backward, as the graph without profiling marks would save it
    (inputs of the graph only where they are another region's activations)."""
    seen, out = set(), []
    for n in saved_values(fw, bw):
        n = _unmarked(n)
        if not _of_an_input(n) and n not in seen:
            seen.add(n)
            out.append(n)
    return out


@dataclass
class SavedBytes:
    """Bytes forward keeps on the device for backward, by block (index) and outside blocks."""

    keep: list[int] = field(default_factory=list)  # every block keeps its activations
    # every block recomputes (what it restarts from)
    recompute: list[int] = field(default_factory=list)
    nonblock_keep: int = 0
    nonblock_recompute: int = 0
    # a region's graph: what it keeps of the inputs it shares with other regions (the same tensors
    # in each: counted once for the whole graph)
    shared_keep: int = 0
    shared_recompute: int = 0


def _attribute(nodes: list[fx.Node], n_blocks: int, restart: bool) -> tuple[list[int], int, int]:
    """Bytes per block, outside blocks, and of shared inputs (see :class:`SavedBytes`)."""
    per_block, nonblock, shared = [0] * n_blocks, 0, 0
    for node in nodes:
        nbytes = tensor_bytes(node)
        if _input_kind(node) == "shared":
            shared += nbytes
            continue
        ann = annotation_of(node)
        # a value of a block's backward that the partitioner computes in forward (a view of a
        # saved activation) is that block's too: its backward frees it
        block = ann.block if ann is not None else None
        if restart or _is_activation_input(node):
            # a block's input is produced by the region before it: it counts for the first later
            # block that reads it in forward (another region's value: the block that reads it)
            readers = [annotation_of(u) for u in _readers(node)]
            later = sorted(
                a.block
                for a in readers
                if a is not None
                and a.phase == "forward"
                and a.block is not None
                and (block is None or a.block > block)
            )
            if later:
                block = later[0]
        if block is None or not 0 <= block < n_blocks:
            nonblock += nbytes
        else:
            per_block[block] += nbytes
    return per_block, nonblock, shared


def saved_bytes_by_block(joint: fx.GraphModule, n_blocks: int, partition) -> SavedBytes:
    """Partition two copies of ``joint`` (annotated by passes/annotate.py; ``partition(gm) ->
    (fw, bw)``)."""
    kept = copy_graph_module(joint)
    untag_blocks(kept)
    fw, bw = partition(kept)
    keep, nonblock_keep, shared_keep = _attribute(_saved(fw, bw), n_blocks, restart=False)
    tagged = copy_graph_module(joint)
    tag_blocks_for_recompute(tagged, set(range(n_blocks)))
    fw, bw = partition(tagged)
    recompute, nonblock_recompute, shared_recompute = _attribute(
        _saved(fw, bw), n_blocks, restart=True
    )
    return SavedBytes(
        keep, recompute, nonblock_keep, nonblock_recompute, shared_keep, shared_recompute
    )


def node_flops(node: fx.Node) -> int:
    """FLOPs of one aten node by torch's FLOP counter formulas (matmuls, attention, convolutions;
    0 else)."""
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map_only(
        fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
    )
    try:  # at the sizes' hints: int() on a symbolic count would specialize the graph to one shape
        return sizes.size_hint(formula(*args, **kwargs, out_val=node.meta.get("val")), fallback=0)
    except Exception:  # noqa: BLE001  (a formula that cannot read missing shapes: count none)
        return 0


def recomputed_share(fw: fx.GraphModule, bw: fx.GraphModule, n_blocks: int) -> list[float]:
    """Per block, the FLOPs of its forward nodes that ``bw`` recomputes over those ``fw`` runs (1.0
    for a block without FLOP-counted nodes)."""

    def by_block(gm):
        out = [0] * n_blocks
        for n in gm.graph.nodes:
            ann = annotation_of(n)
            if (
                n.op == "call_function"
                and ann is not None
                and ann.phase == "forward"
                and ann.block is not None
                and 0 <= ann.block < n_blocks
            ):
                out[ann.block] += node_flops(n)
        return out

    fwd, rc = by_block(fw), by_block(bw)
    return [min(1.0, r / f) if f else 1.0 for f, r in zip(fwd, rc)]


def block_signatures(fw: fx.GraphModule, bw: fx.GraphModule, n_blocks: int) -> list[tuple]:
    """Per block, what its compute is made of: the FLOPs and the counts of each op of its forward
    nodes in ``fw`` and of its backward (recomputation included) in ``bw``. Blocks with equal
    signatures run the same kernels on the same shapes (the layers of a transformer), so they take
    the same time."""
    ops_of = [dict() for _ in range(n_blocks)]
    flops = [[0, 0] for _ in range(n_blocks)]
    for side, gm in enumerate((fw, bw)):
        for n in gm.graph.nodes:
            ann = annotation_of(n)
            if (
                n.op != "call_function"
                or ann is None
                or ann.block is None
                or not 0 <= ann.block < n_blocks
            ):
                continue
            key = (side, ann.phase, str(n.target))
            ops_of[ann.block][key] = ops_of[ann.block].get(key, 0) + 1
            flops[ann.block][side] += node_flops(n)
    return [(tuple(flops[b]), tuple(sorted(ops_of[b].items()))) for b in range(n_blocks)]


@dataclass
class StaticProfile:
    """What the partitions of the profiling plan (every block recomputed) say: saved bytes per
    policy, the share of each block's forward FLOPs its recomputation repeats, and each block's
    signature (:func:`block_signatures`; empty: unknown)."""

    saved: SavedBytes
    recomputed_share: list[float]
    signatures: list = field(default_factory=list)
