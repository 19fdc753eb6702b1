"""annotate: label every node of a joint (or inference) graph with what ProTrain's later passes
read.

Inserts no nodes. It sets ``node.meta["protrain"]`` to a :class:`NodeAnnotation`:

* ``phase``: "forward" or "backward": the node's autograd origin (AOTAutograd's partitioner tag;
  without one, whether the node depends on a tangent). After partitioning a few backward-origin
  nodes that need only forward values may sit in the forward graph, and recomputed forward nodes in
  the backward graph,
* ``block`` / ``block_name``: the transformer block the node computes, from ``nn_module_stack``
  (forward) or ``fwd_nn_module_stack`` (backward), None for non-block regions (embeddings, head,
  loss) and for the few backward nodes that carry no module metadata,
* ``region``: "block" or "non_block",
* ``param`` / ``chunk``: for parameter placeholders, the parameter's FQN and its chunk id.

The partitioner copies node metadata into the forward and backward graphs, so the labels survive
partitioning, and the chunk, swap and recompute passes select nodes by them. The dumps'
annotations.tsv is written from them.
"""

from __future__ import annotations

import torch.fx as fx

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation, node_phases
from protrain_fx.graph.inputs import joint_input_index
from protrain_fx.plan.plan import Plan


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
            gi = (
                plan.graph_inputs[idx] if idx is not None and idx < len(plan.graph_inputs) else None
            )
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
                param=(gi.fqn or gi.node_name) if gi.kind in ("param", "buffer") else None,
                chunk=chunk,
                input_kind=gi.kind,
            )
            continue
        phase = phases[node]
        b = (
            structure.block_of_node(node)
            if structure is not None and node.op == "call_function"
            else None
        )
        node.meta[META_KEY] = NodeAnnotation(
            phase=phase,
            region="block" if b is not None else "non_block",
            block=b.index if b is not None else None,
            block_name=b.name if b is not None else None,
        )
    return gm
