"""chunk_gather: read offloaded parameters from chunks gathered on the device, not from their
shells.

Runs on the joint graph (training) and on inference graphs. For every offloaded chunk it inserts,
before the first node that uses any of the chunk's parameters, one ``protrain::gather`` (the whole
chunk, flat, in the transfer dtype, named by one of its parameters, the *anchor*, so the chunk is
found at run time from the parameters the graph is called with) and per parameter a ``slice`` +
``view`` back to the parameter's shape. Every use of the parameter's placeholder (forward and
backward uses alike) then reads that view; when the transfer dtype is lower than the parameter dtype
an upcast follows, so the graph computes exactly what it did, except that casts the graph already
had to the transfer dtype (autocast's) read the low-precision view directly. 1-D parameters (biases,
norm weights) in the parameter dtype come from ``protrain::vectors`` as tensors of their own instead
(see protrain_fx.runtime.ops).

Why in the joint graph: gradients keep flowing to the parameter placeholders as before (the backward
nodes are already there), so the optimizer-calls pass can collect them per chunk; and the recompute
pass can tag the gathers so the partitioner re-gathers in backward instead of keeping every chunk
alive.

The pass records, per chunk, which joint output carries each parameter's gradient and its
placeholder (``plan.grad_slots``, for passes/optimizer_calls.py; with several ranks also for
resident chunks, ``plan.resident_grad_slots``, for passes/resident_grads.py).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from protrain_fx.errors import ProtrainError
from protrain_fx.graph.annotation import META_KEY, NodeAnnotation, annotation_of
from protrain_fx.graph.fx import call, cast_dtype, node_positions
from protrain_fx.graph.inputs import joint_input_index, written_inputs
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import chunk_store, distributed, ops


def chunk_gather(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Replace offloaded parameter placeholders by views of gathered chunks (see module
    docstring)."""
    if not plan.input_entry:
        return gm
    graph = gm.graph
    pos = node_positions(graph)
    # (store, chunk) -> [(placeholder, entry index, primal ordinal)]
    members: dict[tuple[int, int], list[tuple[fx.Node, int, int]]] = defaultdict(list)
    resident: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    written = written_inputs(gm)
    primal_ordinal = 0
    for position, node in enumerate(placeholders):
        idx = joint_input_index(node, position)
        is_primal = not node.name.startswith("tangents")
        if idx is not None and idx in plan.input_entry:
            store_id, entry = plan.input_entry[idx]
            store = chunk_store.get_store(store_id)
            chunk = store.entries[entry].chunk
            if store.is_offloaded(chunk):
                if node in written:
                    _refuse_write(store.entries[entry].fqn, chunk)
                members[(store_id, chunk)].append((node, entry, primal_ordinal))
            elif plan.world_size > 1:
                resident[(store_id, chunk)].append((primal_ordinal, entry))
        primal_ordinal += is_primal
    plan.resident_grad_slots = dict(resident)
    if not members:
        return gm
    tagged = any("partitioner_tag" in n.meta for n in graph.nodes)
    grad_slots: dict[tuple[int, int], list[tuple[int, int, fx.Node]]] = {}
    for (store_id, chunk), params in sorted(members.items(), key=lambda kv: kv[0]):
        users = [u for ph, _, _ in params for u in ph.users]
        if not users:
            continue
        store = chunk_store.get_store(store_id)
        first_user = min(users, key=pos.__getitem__)
        ann = annotation_of(first_user)
        meta = {"partitioner_tag": "is_forward"} if tagged else {}
        anchor = min(params, key=lambda t: t[2])[0]
        # before the gather makes the anchor a user
        old_users = {ph: list(ph.users) for ph, _, _ in params}
        replaced_casts = []  # erased after every insertion: the insertion point may be one of them
        where = NodeAnnotation(
            "forward",
            ann.region if ann else "non_block",
            ann.block if ann else None,
            ann.block_name if ann else None,
            chunk=chunk,
        )
        with graph.inserting_before(first_user):
            if store.home_on_device(chunk):
                flat = _all_gathered(gm, store, chunk, anchor, meta, where)
            else:
                flat = call(
                    gm,
                    ops.GATHER,
                    ([], anchor, store.chunk_numel(chunk), store.param_dtype),
                    meta=dict(meta),
                )
            flat.meta[META_KEY] = where
            vector_params = [
                (ph, i)
                for ph, i, _ in params
                if len(store.entries[i].shape) <= 1 and store.param_dtype == ph.meta["val"].dtype
            ]
            vector_of = {}
            if vector_params:
                es = [store.entries[i] for _, i in vector_params]
                vecs = call(
                    gm,
                    ops.VECTORS,
                    (flat, [e.offset for e in es], [e.numel for e in es]),
                    meta=dict(meta),
                )
                vecs.meta[META_KEY] = flat.meta[META_KEY]
                for k, (ph, i) in enumerate(vector_params):
                    item = graph.call_function(operator.getitem, (vecs, k))
                    item.meta.update(meta)
                    item.meta["val"] = vecs.meta["val"][k]
                    item.meta[META_KEY] = flat.meta[META_KEY]
                    vector_of[ph] = call(
                        gm,
                        torch.ops.aten.view.default,
                        (item, list(store.entries[i].shape)),
                        meta=dict(meta),
                    )
                    vector_of[ph].meta[META_KEY] = flat.meta[META_KEY]
            for ph, entry_index, _ in params:
                e = store.entries[entry_index]
                if ph in vector_of:
                    new_nodes, value, low = (vector_of[ph],), vector_of[ph], None
                else:
                    sliced = call(
                        gm,
                        torch.ops.aten.slice.Tensor,
                        (flat, 0, e.offset, e.offset + e.numel),
                        meta=dict(meta),
                    )
                    low = call(
                        gm, torch.ops.aten.view.default, (sliced, list(e.shape)), meta=dict(meta)
                    )
                    value = low
                    if store.param_dtype != ph.meta["val"].dtype:
                        value = call(
                            gm,
                            torch.ops.prims.convert_element_type.default,
                            (low, ph.meta["val"].dtype),
                            meta=dict(meta),
                        )
                    new_nodes = (sliced, low, value)
                for n in new_nodes:
                    n.meta[META_KEY] = flat.meta[META_KEY]
                for user in old_users[ph]:
                    if low is not None and cast_dtype(user) == store.param_dtype:
                        # an existing cast to the transfer dtype: read it directly
                        user.replace_all_uses_with(low)
                        replaced_casts.append(user)
                    else:
                        user.replace_input_with(ph, value)
        for cast in replaced_casts:
            graph.erase_node(cast)
        grad_slots[(store_id, chunk)] = [
            (ordinal, entry_index, ph) for ph, entry_index, ordinal in params
        ]
    plan.grad_slots = grad_slots
    return gm


def _refuse_write(fqn: str, chunk: int) -> None:
    """An offloaded parameter the call writes in place (graph/inputs.written_inputs): the write
    would land in the gathered device copy and be lost, or bump the version of a parameter the
    backward reads."""
    raise ProtrainError(
        f"protrain: the compiled graph writes parameter {fqn!r} in place (under no_grad in "
        "forward: a weight clamped or normalized there; nn.Embedding(max_norm=...) "
        "renormalizes its weight in every forward), and its chunk is offloaded to the host, "
        "where protrain cannot write it from inside the graph. Do the write outside the "
        "compiled call (before it, under torch.no_grad(); for the embedding: max_norm=None and "
        "torch.embedding_renorm_(weight, ids, max_norm, 2.0) on the batch's ids), or keep its "
        f"chunk on the device by hand: options n_persist >= {chunk + 1} (chunks in order of first "
        "use; the automatic plan profiles with every chunk offloaded)"
    )


def _all_gathered(gm, store, chunk: int, anchor, meta: dict, where) -> fx.Node:
    """A chunk sharded on the devices, gathered by the graph itself: this rank's shard in the
    transfer dtype (``protrain::shard_values``), a functional all-gather of every rank's and its
    wait, which Inductor schedules like its other kernels (passes/shard_prefetch.py issues it one
    chunk ahead). The flat result has the chunk's layout: the ranks' shards in rank order."""
    shard = call(
        gm,
        ops.SHARD_VALUES,
        (anchor, store.host_numel(chunk), store.param_dtype),
        meta=dict(meta),
    )
    gathered = call(
        gm,
        ops.ALL_GATHER,
        (shard, store.world.size, distributed.group_name()),
        meta=dict(meta),
    )
    for n in (shard, gathered):
        n.meta[META_KEY] = where
    return call(gm, ops.WAIT_TENSOR, (gathered,), meta=dict(meta))
