"""Builds the :class:`~protrain_fx.plan.Plan` of one dynamo graph from its inputs, its blocks and the options.

In this version every chunk is resident on the device and every block keeps its activations; the chunk
layout is real (it is what the offloading runtime will move) and the knobs the user may set are checked.
"""
from __future__ import annotations

from .blocks import BlockStructure
from .chunk_layout import choose_chunk_size, pack
from .graph_inputs import GraphInput
from .options import Options
from .plan import BlockPlan, ChunkPlan, Plan


def make_plan(graph_name: str, inputs: list[GraphInput], structure: BlockStructure, options: Options) -> Plan:
    params = [(gi.fqn or gi.node_name, gi.nbytes) for gi in inputs if gi.is_param]
    chunk_size = options.chunk_size or choose_chunk_size(params)
    layout = pack(params, chunk_size)
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
            f"no transformer blocks detected ({structure.reason}); the model trains as one non-block "
            "region, so activation swapping and recomputation have nothing to act on"
        )
    if not params:
        notes.append("this graph uses no parameters (nothing to chunk)")
    return Plan(
        chunk_size=chunk_size,
        n_persist=len(chunks),
        n_buffer=0,
        n_swap=0,
        n_checkpoint=0,
        chunks=chunks,
        blocks=[BlockPlan(b.name, "keep") for b in structure.blocks],
        graph_name=graph_name,
        block_container=structure.container,
        notes=notes,
        param_chunk=chunk_of,
        param_block=param_block,
        input_param=input_param,
        graph_inputs=list(inputs),
        block_structure=structure,
        layout=layout,
    )
