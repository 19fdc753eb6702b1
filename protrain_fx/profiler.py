"""Profiler, static part: what forward keeps for backward, per block, under each policy, without running.

The partitioner decides what forward saves, so the exact bytes come from partitioning: a copy of the joint
graph as it is (every block keeps) and a copy with every block tagged for recomputation (what a checkpointed
block keeps: the values the next region needs to restart from), each partitioned with the same partitioner
the real compile uses. A saved value counts for the block that produced it, except under recomputation,
where a block's input (produced by the block before it) counts for the block that restarts from it. Values
produced outside blocks count as non-block.

The timed part (per-block compute of the compiled kernels, transient peaks) is measured on the device by a
run under the most frugal plan (docs/design.md, "Next"); it is not here yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .passes.annotate import annotation_of
from .passes.recompute import tag_blocks_for_recompute
from .planner import _copy_graph_module, _tensor_bytes, saved_values


def _saved(fw: fx.GraphModule, bw: fx.GraphModule) -> list[fx.Node]:
    return [n for n in saved_values(fw, bw) if n.op != "placeholder"]


@dataclass
class SavedBytes:
    """Bytes forward keeps on the device for backward, by block (index) and outside blocks."""

    keep: list[int] = field(default_factory=list)  # every block keeps its activations
    recompute: list[int] = field(default_factory=list)  # every block recomputes (what it restarts from)
    nonblock_keep: int = 0
    nonblock_recompute: int = 0


def _attribute(nodes: list[fx.Node], n_blocks: int, restart: bool) -> tuple[list[int], int]:
    per_block, nonblock = [0] * n_blocks, 0
    for node in nodes:
        nbytes = _tensor_bytes(node)
        ann = annotation_of(node)
        block = ann.block if ann is not None and ann.phase == "forward" else None
        if restart:
            # a block's input is produced by the region before it: it counts for the first later block that
            # reads it in forward
            readers = [annotation_of(u) for u in node.users]
            later = sorted(a.block for a in readers if a is not None and a.phase == "forward" and a.block is not None
                           and (block is None or a.block > block))
            if later:
                block = later[0]
        if block is None or not 0 <= block < n_blocks:
            nonblock += nbytes
        else:
            per_block[block] += nbytes
    return per_block, nonblock


def saved_bytes_by_block(joint: fx.GraphModule, n_blocks: int, partition) -> SavedBytes:
    """Partition two copies of ``joint`` (annotated by passes/annotate.py; ``partition(gm) -> (fw, bw)``)."""
    fw, bw = partition(_copy_graph_module(joint))
    keep, nonblock_keep = _attribute(_saved(fw, bw), n_blocks, restart=False)
    tagged = _copy_graph_module(joint)
    tag_blocks_for_recompute(tagged, set(range(n_blocks)))
    fw, bw = partition(tagged)
    recompute, nonblock_recompute = _attribute(_saved(fw, bw), n_blocks, restart=True)
    return SavedBytes(keep, recompute, nonblock_keep, nonblock_recompute)
