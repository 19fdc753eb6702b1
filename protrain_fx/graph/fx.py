"""FX helpers shared by the passes, the profiler and the planner: new nodes with fake values,
aliases, positions, chunk gradients, copies of graph modules and what a partitioned forward saves
for backward. Importing it marks protrain's ordering ops as side effects for FX's dead-code
elimination.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from protrain_fx.runtime import ops

# dead-code elimination must keep them (they order copies and steps)
for _op in ops.SIDE_EFFECT_OPS:
    fx.node.has_side_effect(_op)


def example_value(node):
    """The value a node stands for while tracing: dynamo's ``example_value`` (a graph as dynamo
    gives it), else the fake ``val`` (a graph aot_autograd or a pass made); None for what is not a
    node or has neither."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def fake_mode_of(gm: fx.GraphModule):
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return None


def _fake(x, mode):
    if isinstance(x, fx.Node):
        return x.meta["val"]
    if isinstance(x, (list, tuple)):
        return type(x)(_fake(a, mode) for a in x)
    return x


def call(gm: fx.GraphModule, target, args, kwargs=None, *, meta: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's current insertion point and give it a
    fake value."""
    kwargs = kwargs or {}
    node = gm.graph.call_function(target, tuple(args), kwargs)
    if meta:
        node.meta.update(meta)
    mode = fake_mode_of(gm)
    if mode is not None:
        from protrain_fx.runtime import ops

        with mode:
            if target in ops.ALL_OPS:
                node.meta["val"] = ops.fake_value(target, args)
            else:
                node.meta["val"] = target(*_fake(list(args), mode), **_fake(kwargs, mode))
    return node


def is_view_op(target) -> bool:
    """True for aten ops whose output aliases their first input (slice, view, permute, t, ...)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


CAST_OPS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def cast_dtype(node: fx.Node):
    """The dtype a pure dtype-cast node converts to, or None if it is not one."""
    if node.op != "call_function" or node.target not in CAST_OPS:
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]
    extra = {k for k in node.kwargs if k not in ("dtype",)}
    if extra - {"layout", "device", "memory_format"}:
        return None
    return node.kwargs.get("dtype")


def alias_closure(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node that views it, transitively."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(u for u in n.users if u.op == "call_function" and is_view_op(u.target))
    return out


def token_node(node: fx.Node) -> fx.Node:
    """A node producing a tensor that is available once ``node`` has run (its first tensor
    output)."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return node
    getitems = sorted(
        (u for u in node.users if isinstance(u.meta.get("val"), torch.Tensor)), key=_order_key
    )
    if getitems:
        return getitems[0]
    return node


def _order_key(node: fx.Node) -> int:
    return node_positions(node.graph)[node]


def node_positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def take_chunk_grads(
    gm: fx.GraphModule, slots_by_chunk: dict, target, keep_outputs: bool = False
) -> list[fx.Node]:
    """Backward graph: for each ``(store id, chunk) -> [(output index, store entry)]``, insert
    ``target(grads, [], store id, chunk, entries)`` right after the last of those gradients is
    computed and return ``None`` in their places (the op owns them now), or, with ``keep_outputs``,
    still return them. Returns the inserted nodes."""
    from protrain_fx.graph.annotation import META_KEY, NodeAnnotation

    graph = gm.graph
    out = output_node(gm)
    outputs = list(out.args[0])
    pos = node_positions(graph)
    inserted = []
    for (store_id, chunk), slots in sorted(slots_by_chunk.items()):
        grads = [
            (o, outputs[o], entry)
            for o, entry in slots
            if o < len(outputs) and isinstance(outputs[o], fx.Node)
        ]
        if not grads:
            continue
        last = max((g for _, g, _ in grads), key=pos.__getitem__)
        with graph.inserting_before(last.next):
            node = call(
                gm,
                target,
                ([g for _, g, _ in grads], [], store_id, chunk, [e for _, _, e in grads]),
            )
        node.meta[META_KEY] = NodeAnnotation("backward", "non_block", chunk=chunk)
        inserted.append(node)
        if not keep_outputs:
            for o, _, _ in grads:
                outputs[o] = None
    out.args = (tuple(outputs),)
    return inserted


def saved_activation_bytes(joint, partition=None) -> int:
    """Device bytes forward keeps for backward in a joint graph (parameters and inputs excluded).

    With ``partition`` (a callable running the partitioner on a copy of ``joint``): what the
    partitioner really saves. Without: every forward value a backward node reads (what a plain
    partition would save, an upper bound of the min-cut's choice)."""
    if partition is not None:
        fw, bw = partition(copy_graph_module(joint))
        return sum(tensor_bytes(n) for n in saved_values(fw, bw) if n.op != "placeholder")
    from protrain_fx.graph.annotation import node_phases

    phases = node_phases(joint)
    return sum(
        tensor_bytes(node)
        for node in joint.graph.nodes
        if node.op == "call_function"
        and phases[node] == "forward"
        and any(phases[u] == "backward" for u in node.users)
    )


def saved_names(bw) -> list[str]:
    """Backward's leading placeholders: the values forward saves for it, in forward's output order
    (tangents and the RNG seed/offset inputs excluded)."""
    return [
        n.name
        for n in bw.graph.nodes
        if n.op == "placeholder"
        and not n.name.startswith(("tangents", "bwd_seed", "bwd_base_offset"))
    ]


def saved_values(fw, bw) -> list:
    """The forward graph's output nodes that backward receives as saved values."""
    outputs = list(next(n for n in fw.graph.nodes if n.op == "output").args[0])
    return [
        n for n in outputs[len(outputs) - len(saved_names(bw)) :] if isinstance(n, torch.fx.Node)
    ]


def tensor_bytes(node) -> int:
    """Bytes of a node's tensor value (at the hint sizes when its shape is symbolic)."""
    from protrain_fx.graph import sizes

    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return sizes.numel_hint(val) * val.element_size()
    return 0


def copy_graph_module(gm):
    """A copy of ``gm`` whose nodes have their own (shallow-copied) meta dicts: the partitioner
    writes tags."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def fake_mode_for(examples):
    """A fake mode for a re-plan's compile of real example inputs (dynamo's is gone by then)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return torch._guards.detect_fake_mode(examples) or FakeTensorMode()
