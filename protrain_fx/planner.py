"""Builds the :class:`~protrain_fx.plan.Plan` of one dynamo graph from its inputs, its blocks and the options
(whose knobs the automatic plan, protrain_fx/autoplan.py, has filled in when it ran): the chunk layout, the
block policies, and what the backend and the profiler read of the partitioned graphs (saved values).
"""
from __future__ import annotations

import os

import torch

from . import distributed
from .blocks import BlockStructure
from .chunk_layout import choose_chunk_size, pack
from .graph_inputs import GraphInput
from .options import Options, ProtrainError
from .plan import BlockPlan, ChunkPlan, Plan


def block_policy(index: int, n_swap: int, n_checkpoint: int) -> str:
    """ProTrain's interleaved layout: the first n_swap blocks swap (their copies have the most later compute
    to hide behind), the next n_checkpoint recompute, the rest keep their activations."""
    if index < n_swap:
        return "swap"
    if index < n_swap + n_checkpoint:
        return "recompute"
    return "keep"


def block_knobs(options: Options, n_blocks: int, notes: list[str]) -> tuple[int, int]:
    """``n_swap`` / ``n_checkpoint`` for a graph with ``n_blocks`` blocks. The options are the whole
    torch.compile call's: a model split by graph breaks has graphs with fewer blocks (or none), which take
    as many as they have, in the interleaved order."""
    n_swap, n_checkpoint = options.n_swap or 0, options.n_checkpoint or 0
    if n_swap + n_checkpoint > n_blocks:
        asked = (n_swap, n_checkpoint)
        n_swap = min(n_swap, n_blocks)
        n_checkpoint = min(n_checkpoint, n_blocks - n_swap)
        notes.append(f"n_swap={asked[0]} / n_checkpoint={asked[1]} asked for more blocks than the {n_blocks} "
                     f"detected in this graph: it swaps {n_swap} and recomputes {n_checkpoint}")
    return n_swap, n_checkpoint


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
    n_swap, n_checkpoint = block_knobs(options, len(structure.blocks), notes)
    return Plan(
        chunk_size=chunk_size,
        n_persist=len(chunks),
        n_buffer=0,
        n_swap=n_swap,
        n_checkpoint=n_checkpoint,
        chunks=chunks,
        blocks=[BlockPlan(b.name, block_policy(i, n_swap, n_checkpoint)) for i, b in enumerate(structure.blocks)],
        graph_name=graph_name,
        block_container=structure.container,
        notes=notes,
        param_chunk=chunk_of,
        param_block=param_block,
        input_param=input_param,
        graph_inputs=list(inputs),
        block_structure=structure,
        layout=layout,
        profile_blocks=os.environ.get("PROTRAIN_PROFILE_BLOCKS", "0") == "1",
        world_size=distributed.world().size,
    )


# ------------------------------------------------------------------------------ chunk placement


def saved_activation_bytes(joint, partition=None) -> int:
    """Device bytes forward keeps for backward in a joint graph (parameters and inputs excluded).

    With ``partition`` (a callable running the partitioner on a copy of ``joint``): what the partitioner
    really saves. Without: every forward value a backward node reads (what a plain partition would save,
    an upper bound of the min-cut's choice)."""
    if partition is not None:
        fw, bw = partition(_copy_graph_module(joint))
        return sum(_tensor_bytes(n) for n in saved_values(fw, bw) if n.op != "placeholder")
    from protrain_fx.passes.annotate import node_phases

    phases = node_phases(joint)
    return sum(_tensor_bytes(node) for node in joint.graph.nodes
               if node.op == "call_function" and phases[node] == "forward"
               and any(phases[u] == "backward" for u in node.users))


def saved_names(bw) -> list[str]:
    """Backward's leading placeholders: the values forward saves for it, in forward's output order (tangents
    and the RNG seed/offset inputs excluded)."""
    return [n.name for n in bw.graph.nodes if n.op == "placeholder"
            and not n.name.startswith(("tangents", "bwd_seed", "bwd_base_offset"))]


def saved_values(fw, bw) -> list:
    """The forward graph's output nodes that backward receives as saved values."""
    outputs = list(next(n for n in fw.graph.nodes if n.op == "output").args[0])
    return [n for n in outputs[len(outputs) - len(saved_names(bw)):] if isinstance(n, torch.fx.Node)]


def _tensor_bytes(node) -> int:
    """Bytes of a node's tensor value (at the hint sizes when its shape is symbolic)."""
    from . import _compat

    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _compat.numel_hint(val) * val.element_size()
    return 0


def _copy_graph_module(gm):
    """A copy of ``gm`` whose nodes have their own (shallow-copied) meta dicts: the partitioner writes tags."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def estimate_device_bytes(chunk_bytes: list[int], n_persist: int, n_buffer: int, transfer_elem: int,
                          master_elem: int, activation_bytes: int, optimizer_states: int) -> dict[str, int]:
    """Device memory of a placement, by component (before the fragmentation factor)."""
    resident = sum(chunk_bytes[:n_persist])
    largest_offloaded = max(chunk_bytes[n_persist:], default=0) // master_elem * transfer_elem
    return {
        "resident_params": resident,
        "resident_grads": resident,
        "resident_optimizer": resident * optimizer_states,
        "chunk_buffers": n_buffer * largest_offloaded,
        "grad_buffers": 2 * max(chunk_bytes[n_persist:], default=0),  # device gradient buffers, master dtype
        "activations": activation_bytes,
    }
