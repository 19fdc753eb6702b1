"""What protrain knows of each FX node: its :class:`NodeAnnotation` under ``node.meta["protrain"]``
(phase, block, region, parameter and chunk), and how a joint graph's nodes split into forward and
backward.

The ``annotate`` pass (passes/annotate.py) writes the annotations; passes, the profiler and the
dumps read them here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

META_KEY = "protrain"


_BACKWARD_TAGS = ("is_backward", "must_be_in_backward")


@dataclass(frozen=True)
class NodeAnnotation:
    phase: str  # "forward" | "backward"
    region: str  # "block" | "non_block"
    block: int | None = None
    block_name: str | None = None
    param: str | None = None
    chunk: int | None = None
    # placeholders: "param" | "buffer" | "input" | "activation" / "shared" (another region's
    # value, protrain_fx/graph/regions.py) | "tangent"
    input_kind: str | None = None


def annotation_of(node: fx.Node) -> NodeAnnotation | None:
    return node.meta.get(META_KEY)


def _backward_nodes_by_tangents(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that (transitively) depend on a tangent input: the backward part of a joint graph."""
    backward: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                backward.add(node)
        elif any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def node_phases(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """ "forward" or "backward" for every node of a joint (or inference) graph."""
    tagged = any("partitioner_tag" in n.meta for n in gm.graph.nodes)
    if tagged:
        return {
            n: "backward"
            if n.meta.get("partitioner_tag") in _BACKWARD_TAGS or n.name.startswith("tangents")
            else "forward"
            for n in gm.graph.nodes
        }
    backward = _backward_nodes_by_tangents(gm)
    return {n: "backward" if n in backward else "forward" for n in gm.graph.nodes}
