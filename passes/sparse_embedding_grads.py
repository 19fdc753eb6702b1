"""sparse_embedding_grads: an offloaded embedding's gradient leaves the device as rows, never as a
table of the vocabulary's size.

The gradient of an embedding lookup is zero but for the rows of the tokens the batch holds, yet
backward builds it whole on the device (``embedding_dense_backward``, or what Inductor's
decompositions make of it: a zero table and ``_unsafe_masked_index_put_accumulate``, or in other
versions an accumulating ``_unsafe_index_put`` / ``index_put`` of rows masked beforehand): for
Llama-3.2-3B 128256 x 3072 fp32, 1.47 GiB, plus the tied head's gradient added to it, all of which
``chunk_grad`` then copies to the host. For an offloaded chunk whose one parameter is such a table
(a large vocabulary's embedding, tied to the head or not) this pass hands ``chunk_grad`` the rows
instead: the lookup's output gradient (tokens x hidden) and the token ids, and the dense rest of the
gradient (the tied head's), if any. The runtime copies the rows to the host and adds each into the
chunk's host gradient (protrain_fx/runtime/chunk_grads.py, ``_rows_to_host``). The host sums each
token's rows in their order, then adds the sum once, as eager's table would be added: bit for bit on
the CPU, except a tied weight under gradient accumulation (the earlier micro-steps' gradient plus
the head's, then the rows, where eager adds head and rows first). Rows of a padding index are masked
as eager masks them. Not rewritten: ``scale_grad_by_freq`` lookups, several ranks (a sharded chunk's
gradient is reduce-scattered whole), a chunk of several parameters.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation
from protrain_fx.graph.fx import call, cast_dtype
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import ops

aten = torch.ops.aten
_ZERO_FILLS = (
    aten.full.default,
    aten.zeros.default,
    aten.new_zeros.default,
    aten.zeros_like.default,
)
_MASKED_PUT = getattr(aten, "_unsafe_masked_index_put_accumulate", None)
# the accumulating index puts other decompositions of ``embedding_dense_backward`` build the table
# with (older torch: the rows masked beforehand, ``_unsafe_index_put(zeros, [ids], rows, True)``)
_ACCUMULATING_PUTS = tuple(
    op.default
    for op in (getattr(aten, "_unsafe_index_put", None), aten.index_put)
    if op is not None
)


def _is_zero_table(node) -> bool:
    if not isinstance(node, fx.Node) or node.target not in _ZERO_FILLS:
        return False
    if node.target is aten.full.default:
        return node.args[1] == 0
    return True


def _lookup_rows(node) -> tuple[list, fx.Node] | None:
    """``(how to build the rows, token ids)`` when ``node`` is an embedding's dense gradient built
    from its lookup's rows; the first element is ``[rows, mask or None, padding_idx or None]``."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.embedding_dense_backward.default:
        grad_out, ids, _, padding_idx, scale = (list(node.args) + [None] * 5)[:5]
        if scale:
            return None
        return [
            grad_out,
            None,
            padding_idx if padding_idx is not None and padding_idx >= 0 else None,
        ], ids
    if _MASKED_PUT is not None and node.target is _MASKED_PUT.default:
        base, mask, index, values = node.args
        if not _is_zero_table(base) or len(index) != 1:
            return None
        return [values, mask, None], index[0]
    if node.target in _ACCUMULATING_PUTS:
        base, index, values = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if not accumulate or not _is_zero_table(base) or len(index) != 1 or index[0] is None:
            return None
        table, ids, rows = (
            x.meta.get("val") if isinstance(x, fx.Node) else None for x in (base, index[0], values)
        )
        if table is None or ids is None or rows is None or table.dim() != 2:
            return None
        if tuple(rows.shape) != tuple(ids.shape) + tuple(table.shape[1:]):
            return None  # a broadcast value: not one row per token
        return [values, None, None], index[0]
    return None


def _table_of(node) -> fx.Node | None:
    """The zero table an accumulating put of :func:`_lookup_rows` wrote into, or None."""
    if _MASKED_PUT is not None and node.target is _MASKED_PUT.default:
        return node.args[0]
    return node.args[0] if node.target in _ACCUMULATING_PUTS else None


def _split(grad: fx.Node):
    """``(dense part or None, rows recipe, ids, nodes to drop)`` of a chunk's one gradient that is
    an embedding's (plus, for a tied weight, the head's), or None."""
    drop = []
    node = grad
    while cast_dtype(node) is not None and node.args[0].meta["val"].dtype == node.meta["val"].dtype:
        drop.append(node)
        node = node.args[0]
    found = _lookup_rows(node)
    if found is not None:
        return None, *found, drop + [node]
    if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        for side in (0, 1):
            found = _lookup_rows(node.args[side])
            other = node.args[1 - side]
            if found is not None and isinstance(other, fx.Node):
                return other, *found, drop + [node, node.args[side]]
    return None


def sparse_embedding_grads(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Hand offloaded embedding tables' gradients to ``chunk_grad`` as rows (module docstring)."""
    if plan.world_size > 1:
        return gm
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not ops.CHUNK_GRAD:
            continue
        grads, params = node.args[0], node.args[1]
        if len(grads) != 1 or len(params) != 1 or len(node.args) > 3 or node.kwargs:
            continue
        split = _split(grads[0])
        if split is None:
            continue
        dense, (rows, mask, padding_idx), ids, drop = split
        if any(len(n.users) > 1 for n in drop):
            continue  # the table is read elsewhere too: it stays
        meta = {META_KEY: NodeAnnotation("backward", "non_block")}
        if "partitioner_tag" in node.meta:
            meta["partitioner_tag"] = "is_backward"
        with graph.inserting_before(node):
            if padding_idx is not None:
                keep = call(gm, aten.ne.Scalar, (ids, padding_idx), meta=dict(meta))
                mask = call(gm, aten.unsqueeze.default, (keep, -1), meta=dict(meta))
            if mask is not None:
                rows = call(gm, aten.where.ScalarOther, (mask, rows, 0.0), meta=dict(meta))
        node.args = ([dense] if dense is not None else [], params, node.args[2], rows, ids)
        for n in drop:  # outermost first: each is unused once the one before it is gone
            table = _table_of(n)
            if not n.users:
                graph.erase_node(n)
            if isinstance(table, fx.Node) and not table.users:
                graph.erase_node(table)
        rewritten += 1
    if rewritten:
        plan.notes.append(
            f"{rewritten} embedding gradient(s) leave the device as the lookup's rows, added into "
            "the table on the host: no table of the vocabulary's size on the device"
        )
    return gm
