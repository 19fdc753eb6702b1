"""optimizer_calls: hand each offloaded chunk's gradient to the host as soon as it is complete.

Runs on the joint graph, after chunk_gather. The joint graph returns one gradient per primal input,
after the forward outputs; for the parameters of an offloaded chunk (``plan.grad_slots``) the pass
inserts, right after the last of them is computed, ``protrain::chunk_grad(grads, params)``, which
packs them into a device gradient buffer in the chunk layout (master dtype), copies that to the host
on the copy stream and lets the host worker accumulate it and maybe step the chunk
(protrain_fx/runtime/chunk_store.py). The joint graph then returns ``None`` for those parameters:
their gradients live on the host, and autograd leaves ``param.grad`` to the runtime. Because the op
takes the parameters themselves, the partitioner keeps them as inputs of the backward graph, so the
runtime finds the chunk from the parameters each call was made with.

A chunk larger than the chunk size holds one parameter (a large vocabulary's embedding or head),
whose gradient goes to the host as it is, not through a gradient buffer (runtime/chunk_grads.py,
``grad_goes_as_is``). Under autocast that gradient is the upcast of the low-precision matmul's
(the backward of the weight's cast): the op then takes the low-precision gradient and the host
upcasts it into the accumulator (exact), so no master-dtype table of the vocabulary's size is made
on the device.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation
from protrain_fx.graph.fx import call, node_positions, output_node
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import chunk_store, distributed, ops

_UPCASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _before_upcast(grad: fx.Node, out: fx.Node) -> fx.Node:
    """The low-precision gradient ``grad`` upcasts (the backward of autocast's cast of the weight),
    when ``grad`` is such an upcast that only the graph's output reads; else ``grad``."""
    if grad.op != "call_function" or grad.target not in _UPCASTS or set(grad.users) != {out}:
        return grad
    src = grad.args[0]
    val, low = grad.meta.get("val"), getattr(src, "meta", {}).get("val")
    if not (isinstance(val, torch.Tensor) and isinstance(low, torch.Tensor)):
        return grad
    kw = dict(grad.kwargs)
    if grad.target is torch.ops.aten._to_copy.default and (
        set(kw) - {"dtype", "layout", "device"}
        or kw.get("layout", torch.strided) != torch.strided
        or torch.device(kw.get("device", low.device)) != low.device
    ):
        return grad  # a layout, device or memory format change too
    if not (
        low.dtype.is_floating_point
        and low.dtype.itemsize < val.dtype.itemsize
        and low.shape == val.shape
    ):
        return grad
    return src


def _oversized(ph: fx.Node, plan: Plan) -> bool:
    """The parameter fills a chunk larger than the chunk size on its own (a gradient that goes to
    the host as it is; with several ranks every chunk's gradient is packed)."""
    val = ph.meta.get("val")
    return (
        plan.world_size == 1
        and isinstance(val, torch.Tensor)
        and val.numel() * val.element_size() > plan.chunk_size
    )


def optimizer_calls(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Collect offloaded chunks' gradients into ``protrain::chunk_grad`` (see module docstring)."""
    if not plan.grad_slots:
        return gm
    graph = gm.graph
    out = output_node(gm)
    outputs = list(out.args[0])
    n_primals = sum(
        1 for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")
    )
    first_grad = len(outputs) - n_primals
    pos = node_positions(graph)
    for (store_id, chunk), slots in sorted(plan.grad_slots.items(), key=lambda kv: kv[0]):
        grads = [
            (first_grad + ordinal, outputs[first_grad + ordinal], ph)
            for ordinal, _, ph in slots
            if isinstance(outputs[first_grad + ordinal], fx.Node)
        ]
        if not grads:
            continue  # frozen parameters: no gradients
        if len(slots) == 1 and _oversized(grads[0][2], plan):
            o, g, ph = grads[0]
            grads = [(o, _before_upcast(g, out), ph)]
        last = max((g for _, g, _ in grads), key=pos.__getitem__)
        meta = {"partitioner_tag": "is_backward"} if "partitioner_tag" in last.meta else {}
        store = chunk_store.get_store(store_id)
        values, params = [g for _, g, _ in grads], [ph for _, _, ph in grads]
        with graph.inserting_before(last.next):
            if store.home_on_device(chunk):
                nodes = _reduce_scattered(gm, store, chunk, values, params, meta)
            else:
                nodes = [call(gm, ops.CHUNK_GRAD, (values, params, []), meta=dict(meta))]
        for node in nodes:
            node.meta[META_KEY] = NodeAnnotation("backward", "non_block")
        for o, _, _ in grads:
            outputs[o] = None
    out.args = (tuple(outputs),)
    return gm


def _reduce_scattered(gm, store, chunk: int, grads, params, meta: dict) -> list:
    """A chunk sharded on the devices: its gradients packed in the chunk layout
    (``protrain::pack_grads``), a functional reduce-scatter (sum) and its wait, which Inductor
    schedules like its other kernels (passes/shard_prefetch.py waits for it as late as the next
    chunk's), then ``protrain::shard_grad`` adds this rank's shard, divided by the ranks, into the
    chunk's gradient on the device."""
    packed = call(
        gm,
        ops.PACK_GRADS,
        (grads, params, store.chunk_numel(chunk), store.master_dtype),
        meta=dict(meta),
    )
    reduced = call(
        gm,
        ops.REDUCE_SCATTER,
        (packed, "sum", store.world.size, distributed.group_name()),
        meta=dict(meta),
    )
    waited = call(gm, ops.WAIT_TENSOR, (reduced,), meta=dict(meta))
    done = call(gm, ops.SHARD_GRAD, (waited, params, []), meta=dict(meta))
    return [packed, reduced, waited, done]
