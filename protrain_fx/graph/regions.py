"""Regions: a model's graph cut at its block boundaries, so that each distinct block is compiled
once and its code run for every block like it.

A dynamo graph of a whole transformer holds its N blocks one after another, node for node the same
computation on other parameters. Compiled as one graph, every block is traced, partitioned and
lowered by Inductor again: minutes for a 28-layer model, twice under the automatic plan (the
profiling plan, then the chosen one). :func:`split` cuts the graph (``torch.fx``'s
``split_module``, as dynamo's DDPOptimizer does for its buckets) into one region of code before the
first block (embedding, rotary tables, masks), one region per block, and one after the last block
(final norm, head, loss). Every region is a graph of its own whose placeholders are what it reads:
parameters (placeholders of the dynamo graph too) and the values other regions computed (the
residual stream). A region's :attr:`Region.signature` says what it computes (the ops, their
arguments as positions inside the region, the shapes, dtypes and strides of its inputs; not the
parameters' names): regions of equal signature run the same compiled code
(protrain_fx/region_program.py), each on its own parameters, which the runtime binds at every call
(protrain_fx/runtime/binding.py).

Only graphs with at least two blocks that run one after another are cut; a node outside every block
between two blocks goes with the block before it. A parameter belongs to the first region that
reads it (a tied head's weight to the embedding's), whose chunk store holds it: chunks never span
two regions (:meth:`RegionSplit.ordered_params`, ``groups`` in protrain_fx/plan/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from protrain_fx.graph.blocks import Block, BlockStructure
from protrain_fx.graph.fx import example_value
from protrain_fx.graph.inputs import GraphInput
from protrain_fx.graph.shorten import _node_key, _value_key

PRE, POST = "pre", "post"


@dataclass
class Region:
    index: int  # position in the step, forward order
    name: str  # "pre", the block's module name ("model.layers.3"), or "post"
    block: int | None  # the block's index among the graph's blocks; None outside them
    gm: fx.GraphModule  # its graph
    # per placeholder of gm: the dynamo graph's placeholder index it is, or None (a value another
    # region computed)
    top_inputs: list[int | None]
    # per placeholder of gm: whether a value computed by another region needs its gradient
    grad_inputs: list[bool]
    signature: tuple
    structure: BlockStructure  # its one block, or none
    returns_tuple: bool  # whether it returns a tuple (else one value)
    submod: str  # the top graph's submodule name that calls it

    @property
    def kind(self) -> str:
        return self.name if self.block is None else "block"

    def graph_inputs(self, top: list[GraphInput]) -> list[GraphInput]:
        """Its placeholders as :class:`GraphInput` rows: the dynamo graph's rows (re-indexed) for
        parameters, buffers and user inputs; for values of other regions ``"activation"`` rows
        (needing gradients: the residual stream) or ``"shared"`` ones (rotary tables, masks)."""
        out = []
        nodes = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for k, (node, t) in enumerate(zip(nodes, self.top_inputs)):
            if t is not None:
                gi = top[t]
                out.append(
                    GraphInput(
                        k, node.name, gi.kind, gi.fqn, gi.source, gi.shape, gi.dtype, gi.nbytes
                    )
                )
                continue
            val = example_value(node)
            is_tensor = isinstance(val, torch.Tensor)
            static = is_tensor and all(isinstance(s, int) for s in val.shape)
            out.append(
                GraphInput(
                    k,
                    node.name,
                    "activation" if self.grad_inputs[k] else "shared",
                    None,
                    None,
                    tuple(val.shape) if static else None,
                    val.dtype if is_tensor else None,
                    val.numel() * val.element_size() if static else 0,
                )
            )
        return out


@dataclass
class RegionSplit:
    top: fx.GraphModule  # calls the regions (its submodules ``submod_k``) in order
    regions: list[Region]

    def ordered_params(self, inputs: list[GraphInput]) -> tuple[list[GraphInput], list[int]]:
        """The dynamo graph's parameter rows in the order their regions' stores chunk them (by
        owning region, then as the region reads them), and each one's region (``pack``'s
        ``groups``)."""
        out, groups, seen = [], [], set()
        for r in self.regions:
            for t in r.top_inputs:
                if t is None or t in seen or not inputs[t].is_param:
                    continue
                seen.add(t)
                out.append(inputs[t])
                groups.append(r.index)
        return out, groups

    def describe(self) -> str:
        kinds = {}
        for r in self.regions:
            kinds.setdefault(r.signature, []).append(r.name)
        return (
            f"{len(self.regions)} regions (code before the blocks, {len(self.block_regions)} "
            f"blocks, code after them) of {len(kinds)} distinct computations"
        )

    @property
    def block_regions(self) -> list[Region]:
        return [r for r in self.regions if r.block is not None]


def _partition_ids(gm: fx.GraphModule, structure: BlockStructure) -> tuple[dict | None, str]:
    """Node -> region number (0: before the blocks, b + 1: block b, N + 1: after them)."""
    n = len(structure.blocks)
    index = {b.name: i for i, b in enumerate(structure.blocks)}
    nodes = [x for x in gm.graph.nodes if x.op not in ("placeholder", "output")]
    last_of = {}
    for pos, node in enumerate(nodes):
        b = structure.block_of_node(node)
        if b is not None:
            last_of[index[b.name]] = pos
    if len(last_of) != n:
        return None, "a block has no nodes of its own in the graph"
    out, current = {}, 0
    for pos, node in enumerate(nodes):
        b = structure.block_of_node(node)
        if b is not None:
            pid = index[b.name] + 1
            if pid < current:
                return None, f"blocks {pid - 1} and {current - 1} interleave"
            current = pid
        elif current == n and pos > last_of[n - 1]:
            current = n + 1  # after the last block's last node
        out[node] = current
    if n + 1 not in out.values():
        return None, "nothing runs after the last block"
    return out, ""


def _signature(gm: fx.GraphModule) -> tuple:
    """What a region computes (module docstring): its nodes with arguments as positions."""
    nodes = list(gm.graph.nodes)
    local = {x: i for i, x in enumerate(nodes)}
    return tuple(
        ("placeholder", _value_key(example_value(x)))
        if x.op == "placeholder"  # named after the parameter it is: blocks differ by name only
        else _node_key(x, local)
        for x in nodes
    )


def split(gm: fx.GraphModule, structure: BlockStructure) -> tuple[RegionSplit | None, str]:
    """The regions of the dynamo graph ``gm`` (module docstring), or None and why it stays
    whole."""
    from torch.fx.passes.split_module import split_module

    n = len(structure.blocks)
    if n < 2:
        return None, f"{n} block(s): nothing to compile once for several"
    parts, why = _partition_ids(gm, structure)
    if parts is None:
        return None, why
    top_index = {x.name: i for i, x in enumerate(gm.graph.find_nodes(op="placeholder"))}
    top = split_module(gm, None, lambda node: parts[node], keep_original_order=True)
    regions = []
    for call in top.graph.find_nodes(op="call_module"):
        sub = getattr(top, call.target)
        pid = int(call.target.rsplit("_", 1)[-1])
        block = pid - 1 if 1 <= pid <= n else None
        name = PRE if pid == 0 else POST if pid == n + 1 else structure.blocks[block].name
        placeholders = list(sub.graph.find_nodes(op="placeholder"))
        top_inputs = [top_index.get(p.name) for p in call.args if isinstance(p, fx.Node)]
        if len(top_inputs) != len(placeholders):
            return None, f"region {name} reads values other than nodes"
        grads = []
        for p, t in zip(placeholders, top_inputs):
            val = example_value(p)
            grads.append(t is None and isinstance(val, torch.Tensor) and val.requires_grad)
        out = next(iter(sub.graph.find_nodes(op="output")))
        returns_tuple = isinstance(out.args[0], (tuple, list))
        sub_structure = (
            BlockStructure(None, [], reason=f"code {'before' if pid == 0 else 'after'} the blocks")
            if block is None
            else BlockStructure(
                structure.container,
                [Block(0, structure.blocks[block].name, structure.blocks[block].module_class)],
            )
        )
        regions.append(
            Region(
                index=len(regions),
                name=name,
                block=block,
                gm=sub,
                top_inputs=top_inputs,
                grad_inputs=grads,
                signature=(block is None and name, _signature(sub)),
                structure=sub_structure,
                returns_tuple=returns_tuple,
                submod=call.target,
            )
        )
    return RegionSplit(top, regions), ""


def tuple_output(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` returning a tuple (aot_autograd's compilers want one), changed in place."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    if not isinstance(out.args[0], (tuple, list)):
        out.args = ((out.args[0],),)
        gm.recompile()
    return gm
