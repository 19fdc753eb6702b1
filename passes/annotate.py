"""annotate: label every node of a joint (or inference) graph with what ProTrain's later passes read.

Inserts no nodes. It sets ``node.meta["protrain"]`` to a :class:`NodeAnnotation`:

* ``phase``: "forward" or "backward": the node's autograd origin (AOTAutograd's partitioner tag; without
  one, whether the node depends on a tangent). After partitioning a few backward-origin nodes that need only
  forward values may sit in the forward graph, and recomputed forward nodes in the backward graph,
* ``block`` / ``block_name``: the transformer block the node computes, from ``nn_module_stack`` (forward)
  or ``fwd_nn_module_stack`` (backward), None for non-block regions (embeddings, head, loss) and for the
  few backward nodes that carry no module metadata,
* ``region``: "block" or "non_block",
* ``param`` / ``chunk``: for parameter placeholders, the parameter's FQN and its chunk id.

The partitioner copies node metadata into the forward and backward graphs, so the labels survive
partitioning, and the chunk, swap and recompute passes select nodes by them. The dumps' annotations.tsv
is written from them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from protrain_fx.graph_inputs import joint_input_index
from protrain_fx.plan import Plan

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
    input_kind: str | None = None  # placeholders: "param" | "buffer" | "input" | "tangent"


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
    """"forward" or "backward" for every node of a joint (or inference) graph."""
    tagged = any("partitioner_tag" in n.meta for n in gm.graph.nodes)
    if tagged:
        return {n: "backward" if n.meta.get("partitioner_tag") in _BACKWARD_TAGS or n.name.startswith("tangents")
                else "forward" for n in gm.graph.nodes}
    backward = _backward_nodes_by_tangents(gm)
    return {n: "backward" if n in backward else "forward" for n in gm.graph.nodes}


def annotate(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Set ``node.meta["protrain"]`` on every node of ``gm`` (see the module docstring)."""
    structure = plan.block_structure
    phases = node_phases(gm)
    position = 0
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            idx = joint_input_index(node, position)
            position += 1
            gi = plan.graph_inputs[idx] if idx is not None and idx < len(plan.graph_inputs) else None
            if gi is None:
                kind = "tangent" if node.name.startswith("tangents") else "input"
                phase = "backward" if kind == "tangent" else "forward"
                node.meta[META_KEY] = NodeAnnotation(phase, "non_block", input_kind=kind)
                continue
            chunk, block = plan.input_param.get(idx, (None, None))
            node.meta[META_KEY] = NodeAnnotation(
                phase="forward",
                region="block" if block is not None else "non_block",
                block=block,
                block_name=structure.blocks[block].name if block is not None else None,
                param=(gi.fqn or gi.node_name) if gi.kind != "input" else None,
                chunk=chunk,
                input_kind=gi.kind,
            )
            continue
        phase = phases[node]
        b = structure.block_of_node(node) if structure is not None and node.op == "call_function" else None
        node.meta[META_KEY] = NodeAnnotation(
            phase=phase,
            region="block" if b is not None else "non_block",
            block=b.index if b is not None else None,
            block_name=b.name if b is not None else None,
        )
    return gm
