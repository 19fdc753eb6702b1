"""Builds the :class:`~protrain_fx.plan.plan.Plan` of one dynamo graph from its inputs, its blocks
and the options (whose knobs the automatic plan, protrain_fx/autoplan.py, has filled in when it
ran): the chunk layout, the block policies, and what the backend and the profiler read of the
partitioned graphs (saved values).
"""

from __future__ import annotations

from protrain_fx import config
from protrain_fx.graph.blocks import BlockStructure
from protrain_fx.graph.inputs import GraphInput
from protrain_fx.graph.regions import RegionSplit
from protrain_fx.options import Options
from protrain_fx.plan.layout import choose_chunk_size, pack
from protrain_fx.plan.plan import BlockPlan, ChunkPlan, Plan
from protrain_fx.plan.profiles import block_policy
from protrain_fx.runtime import distributed


def block_knobs(options: Options, n_blocks: int, notes: list[str]) -> tuple[int, int]:
    """``n_swap`` / ``n_checkpoint`` for a graph with ``n_blocks`` blocks. The options are the whole
    torch.compile call's: a model split by graph breaks has graphs with fewer blocks (or none),
    which take as many as they have, in the interleaved order."""
    n_swap, n_checkpoint = options.n_swap or 0, options.n_checkpoint or 0
    if n_swap + n_checkpoint > n_blocks:
        asked = (n_swap, n_checkpoint)
        n_swap = min(n_swap, n_blocks)
        n_checkpoint = min(n_checkpoint, n_blocks - n_swap)
        notes.append(
            f"n_swap={asked[0]} / n_checkpoint={asked[1]} asked for more blocks than the "
            f"{n_blocks} "
            f"detected in this graph: it swaps {n_swap} and recomputes {n_checkpoint}"
        )
    return n_swap, n_checkpoint


def default_chunk_size(
    params: list[tuple[str, int]], structure: BlockStructure, groups: list | None = None
) -> int:
    """The chunk size sized for the blocks' parameters (``(fqn, nbytes)``; larger parameters
    outside them get chunks of their own: protrain_fx/plan/layout.py). ``groups``: ``pack``'s."""
    in_blocks = [(f, b) for f, b in params if structure.block_of_param(f) is not None]
    return choose_chunk_size(params, block_params=in_blocks, groups=groups)


def chunked_params(
    inputs: list[GraphInput], regions: RegionSplit | None = None
) -> tuple[list[tuple[str, int]], list | None]:
    """``(fqn, nbytes)`` of the graph's parameters in the order they are chunked, and their
    groups: placeholder order for a graph compiled whole, by region for one compiled in regions
    (protrain_fx/graph/regions.py)."""
    if regions is None:
        return [(gi.fqn or gi.node_name, gi.nbytes) for gi in inputs if gi.is_param], None
    ordered, groups = regions.ordered_params(inputs)
    return [(gi.fqn or gi.node_name, gi.nbytes) for gi in ordered], groups


def make_plan(
    graph_name: str,
    inputs: list[GraphInput],
    structure: BlockStructure,
    options: Options,
    regions: RegionSplit | None = None,
) -> Plan:
    params, groups = chunked_params(inputs, regions)
    chunk_size = options.chunk_size or default_chunk_size(params, structure, groups)
    layout = pack(params, chunk_size, groups)
    chunks = [
        ChunkPlan(
            id=c,
            bytes=layout.used_bytes(c),
            params=[s.fqn for s in layout.params_of(c)],
            placement="device",
        )
        for c in range(layout.n_chunks)
    ]
    param_block, input_param = {}, {}
    chunk_of = {s.fqn: s.chunk for s in layout.slots}
    for gi in inputs:
        if gi.is_param:
            fqn = gi.fqn or gi.node_name
            block = structure.block_of_param(fqn)
            param_block[fqn] = block.name if block is not None else None
            input_param[gi.index] = (chunk_of[fqn], block.index if block is not None else None)
    notes = []
    if not structure.blocks:
        notes.append(
            f"no transformer blocks detected ({structure.reason}); the model trains as one "
            "non-block "
            "region, so activation swapping and recomputation have nothing to act on"
        )
    if not params:
        notes.append("this graph uses no parameters (nothing to chunk)")
    n_swap, n_checkpoint = block_knobs(options, len(structure.blocks), notes)
    return Plan(
        chunk_size=chunk_size,
        n_persist=len(chunks),
        n_buffer=0,
        n_swap=n_swap,
        n_checkpoint=n_checkpoint,
        chunks=chunks,
        blocks=[
            BlockPlan(b.name, block_policy(i, n_swap, n_checkpoint))
            for i, b in enumerate(structure.blocks)
        ],
        graph_name=graph_name,
        block_container=structure.container,
        notes=notes,
        param_chunk=chunk_of,
        param_block=param_block,
        input_param=input_param,
        graph_inputs=list(inputs),
        block_structure=structure,
        layout=layout,
        profile_blocks=config.settings().profile_blocks,
        world_size=distributed.world().size,
    )


# ------------------------------------------------------------------------------ chunk placement
