"""Small FX helpers shared by the passes: new nodes with fake values, aliases, positions, chunk gradients."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor


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
    """Insert ``target(*args, **kwargs)`` at the graph's current insertion point and give it a fake value."""
    kwargs = kwargs or {}
    node = gm.graph.call_function(target, tuple(args), kwargs)
    if meta:
        node.meta.update(meta)
    mode = fake_mode_of(gm)
    if mode is not None:
        from protrain_fx import ops

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
    """A node producing a tensor that is available once ``node`` has run (its first tensor output)."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return node
    getitems = sorted((u for u in node.users if isinstance(u.meta.get("val"), torch.Tensor)), key=_order_key)
    if getitems:
        return getitems[0]
    return node


def _order_key(node: fx.Node) -> int:
    return node_positions(node.graph)[node]


def node_positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def take_chunk_grads(gm: fx.GraphModule, slots_by_chunk: dict, target, keep_outputs: bool = False) -> list[fx.Node]:
    """Backward graph: for each ``(store id, chunk) -> [(output index, store entry)]``, insert
    ``target(grads, [], store id, chunk, entries)`` right after the last of those gradients is computed and
    return ``None`` in their places (the op owns them now), or, with ``keep_outputs``, still return them.
    Returns the inserted nodes."""
    from protrain_fx.passes.annotate import META_KEY, NodeAnnotation

    graph = gm.graph
    out = output_node(gm)
    outputs = list(out.args[0])
    pos = node_positions(graph)
    inserted = []
    for (store_id, chunk), slots in sorted(slots_by_chunk.items()):
        grads = [(o, outputs[o], entry) for o, entry in slots if o < len(outputs) and isinstance(outputs[o], fx.Node)]
        if not grads:
            continue
        last = max((g for _, g, _ in grads), key=pos.__getitem__)
        with graph.inserting_before(last.next):
            node = call(gm, target, ([g for _, g, _ in grads], [], store_id, chunk, [e for _, _, e in grads]))
        node.meta[META_KEY] = NodeAnnotation("backward", "non_block", chunk=chunk)
        inserted.append(node)
        if not keep_outputs:
            for o, _, _ in grads:
                outputs[o] = None
    out.args = (tuple(outputs),)
    return inserted
