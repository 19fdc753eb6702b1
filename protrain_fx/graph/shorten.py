"""A short copy of a model's graph for profiling: three blocks stand for all of them.

The automatic plan profiles one step of the graph under its most frugal plan, and that copy has to
be compiled first: for a 28-layer model that was a second compile of the whole model before the
first step. But the layers of a transformer are one structure repeated, and the cost model needs
one measurement per kind of block: the first block (its input comes from the embedding), a middle
block (input from a block, output to a block) and the last block (output to the final norm and the
head). So :func:`shorten` cuts blocks ``3 .. N-1`` out of a copy of the dynamo graph and feeds what
the last block gave the code after the blocks (final norm, head, loss, outputs) from block 2, its
node at the same place, instead. The copy is a valid three-layer model on the same inputs: the
same pre-block and post-block code, the same per-block kernels, on the same shapes. Its
parameters are the same placeholders; those of the blocks cut out are simply not read.

Only a graph whose blocks ``1 .. N-1`` are the same computation node for node (the same ops on the
same shapes and dtypes, :func:`block_signature`) is shortened, and only if what the code after
the blocks reads of the cut blocks comes from the last block; anything else is profiled whole, and
the reason is returned. :data:`KEPT` blocks are kept; ``expand`` maps every block of the full graph
to the one of the short graph that stands for it (``0 -> 0``, ``1 .. N-2 -> 1``, ``N-1 -> 2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from protrain_fx.graph.blocks import BlockStructure
from protrain_fx.graph.fx import copy_graph_module, example_value

KEPT = 3  # the first, a middle and the last block


@dataclass
class ShortGraph:
    gm: fx.GraphModule  # the copy with blocks KEPT .. N-1 cut out
    structure: BlockStructure  # its blocks: the full graph's first KEPT
    expand: list[int]  # full block index -> short block index


def _dims(sizes) -> tuple:
    return tuple(d if type(d) is int else str(d) for d in sizes)


def _value_key(v) -> tuple:
    if isinstance(v, torch.Tensor):
        # symbolic sizes as text: comparing them would add guards to the graph
        strides = _dims(v.stride()) if v.layout == torch.strided else ()
        return ("t", _dims(v.shape), v.dtype, strides)
    if isinstance(v, (list, tuple)):
        return ("s", tuple(_value_key(x) for x in v))
    if isinstance(v, (int, float, bool, str, type(None))):
        return ("c", v)
    return ("o", type(v).__name__)


def _node_key(node: fx.Node, local: dict[fx.Node, int]) -> tuple:
    """What ``node`` computes, with its arguments as positions inside the block (``local``) or as
    the shapes of values from outside it."""

    def arg(a):
        if isinstance(a, fx.Node):
            if a in local:
                return ("local", local[a])
            return ("outside", a.op, _value_key(example_value(a)))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, arg(v)) for k, v in a.items())))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return a
        return type(a).__name__

    target = (
        node.target
        if isinstance(node.target, str)
        else getattr(node.target, "__qualname__", repr(node.target))
    )
    return (
        node.op,
        str(target),
        arg(node.args),
        arg(node.kwargs),
        _value_key(example_value(node)),
    )


def block_signature(nodes: list[fx.Node]) -> tuple:
    """A block's computation, node by node (see module docstring)."""
    local = {n: i for i, n in enumerate(nodes)}
    return tuple(_node_key(n, local) for n in nodes)


def shorten(gm: fx.GraphModule, structure: BlockStructure) -> tuple[ShortGraph | None, str]:
    """A copy of the dynamo graph ``gm`` with :data:`KEPT` of its blocks, or ``None`` and why it
    is profiled whole (see module docstring)."""
    n = len(structure.blocks)
    if n < KEPT + 2:
        return None, f"{n} blocks: the whole graph is as short"
    copy = copy_graph_module(gm)
    nodes = list(copy.graph.nodes)
    pos = {node: i for i, node in enumerate(nodes)}
    members: list[list[fx.Node]] = [[] for _ in range(n)]
    block_at: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        b = structure.block_of_node(node)
        if b is not None and 0 <= b.index < n:
            members[b.index].append(node)
            block_at[node] = b.index
    if any(not m for m in members):
        return None, "a block has no nodes of its own in the graph"
    for b in range(n - 1):  # blocks run one after another
        if pos[members[b][-1]] > pos[members[b + 1][0]]:
            return None, f"blocks {b} and {b + 1} interleave"
    reference = block_signature(members[1])
    for b in range(2, n):
        if block_signature(members[b]) != reference:
            return None, (
                f"block {b} ({structure.blocks[b].name}) computes differently from block 1 "
                f"({structure.blocks[1].name})"
            )
    cut_from, cut_to = pos[members[KEPT][0]], pos[members[n - 1][-1]]
    cut: set[fx.Node] = set()
    for node in nodes[cut_from : cut_to + 1]:
        if block_at.get(node, -1) >= KEPT or (
            node.op in ("call_function", "call_method", "call_module")
            and any(a in cut for a in node.all_input_nodes)
        ):
            cut.add(node)
    expand = [0] + [1] * (n - 2) + [KEPT - 1]
    # a cut block's node -> the node at the same place in the block that stands for it
    stand_in = {
        node: members[expand[b]][i] for b in range(KEPT, n) for i, node in enumerate(members[b])
    }
    for node in nodes[cut_to + 1 :]:  # (a refusal leaves a half-edited copy: it is dropped)
        for a in list(node.all_input_nodes):
            if a in cut and a not in stand_in:
                return None, (
                    f"{node.name} after the blocks reads {a.name}, which is not a block's"
                )
            if a in cut:
                node.replace_input_with(a, stand_in[a])
    for node in reversed(nodes[cut_from : cut_to + 1]):
        if node in cut:
            if node.users:
                return None, f"{node.name} of a cut block is still read by {list(node.users)}"
            copy.graph.erase_node(node)
        elif (
            node.op in ("call_function", "call_method") and not node.users and not node.is_impure()
        ):
            copy.graph.erase_node(node)  # code between cut blocks that fed only them
    copy.graph.lint()
    copy.recompile()
    short = BlockStructure(structure.container, list(structure.blocks[:KEPT]), structure.reason)
    return ShortGraph(copy, short, expand), ""
