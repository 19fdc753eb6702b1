"""The ``protrain::`` custom ops the graph passes insert. Each is a thin call into the runtime,
which owns all state. Ops name their chunk by a parameter tensor of it (the *anchor*), resolved at
run time (:func:`protrain_fx.runtime.chunk_store.bound_chunk`): a graph serves whichever parameters
it is called with.

Every op takes a list of *tokens*: tensors produced by the nodes it must follow (the passes choose
them), so the order survives Inductor's scheduling (Inductor reorders independent custom ops; a data
dependency it cannot break). Ops that only order things return a 0-element token tensor; having no
consumers, they are registered as having side effects (``SIDE_EFFECT_OPS``, by
protrain_fx/graph/fx.py when the passes are imported, before any graph is compiled: Inductor's cache
key does not see it).

* ``gather(tokens, anchor, numel, dtype) -> flat``: the anchor's chunk on the compute device in the
  transfer dtype, as a fresh tensor the graph owns (copied out of the device chunk buffer its
  prefetch filled, or loaded now): Inductor frees it after its last reader, so no later copy can
  overwrite what it still reads.
* ``vectors(flat, offsets, numels) -> [tensor]``: copies of the chunk's 1-D parameters (biases, norm
  weights) as tensors of their own. Read as views at an offset into the gathered chunk, Inductor's
  CUDA code got a bias wrong (GPT-style model, torch 2.11, H200); Inductor removes a plain ``clone``
  as a no-op.
* ``prefetch(tokens, anchor) -> token``: start the host-to-device copy of the anchor's chunk into a
  device chunk buffer.
* ``chunk_grad(grads, params, tokens, rows=None, indices=None) -> token``: the gradients of
  ``params`` (parameters of one offloaded chunk): pack, copy to the host, accumulate, maybe step
  (:meth:`protrain_fx.runtime.chunk_store.ChunkStore.grad_ready`); with ``rows`` (an embedding's
  lookup gradient, passes/sparse_embedding_grads.py), the one parameter's gradient is ``grads``
  (its dense part, or none) plus ``rows[k]`` added to its row ``indices[k]`` on the host.
* ``offload(x, tokens) -> host``: device-to-host copy of a swap block's saved activation into new
  (pinned) host memory, started when ``x`` exists, from a copy of ``x`` of protrain's own
  (protrain_fx/runtime/swap_pool.py); forward returns ``host`` instead of ``x``.
* ``offload_wait(hosts, tokens, device) -> token``: the compute stream waits for those copies.
* ``reload_start(host, tokens, device) -> token`` / ``reload_take(host, tokens, device) -> x``: copy
  it back one block ahead of use, and hand it to backward once the copy is done.
* ``resident_grads(grads, tokens, store, chunk, members) -> token``: data parallel only: start
  averaging a resident chunk's parameter gradients over the ranks, in place (one coalesced async
  all-reduce), now, in backward, so it overlaps the rest of backward. The graph still returns those
  gradients (so Inductor never reuses their memory while the collective runs).
* ``resident_grads_wait(tokens, store) -> token``: at the end of that backward graph, the compute
  stream waits for those all-reduces (:func:`protrain_fx.runtime.distributed.wait_resident_grads`)
  before autograd reads the gradients.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.library import custom_op

from protrain_fx.runtime import block_timer, chunk_store, distributed, swap_pool


def _token(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device)


@custom_op("protrain::gather", mutates_args=())
def gather(
    tokens: List[torch.Tensor], anchor: torch.Tensor, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    store, chunk = chunk_store.bound_chunk(anchor)
    return store.gather(chunk)


@gather.register_fake
def _(tokens, anchor, numel, dtype):
    return torch.empty(numel, dtype=dtype, device=anchor.device)


@custom_op("protrain::vectors", mutates_args=())
def vectors(flat: torch.Tensor, offsets: List[int], numels: List[int]) -> List[torch.Tensor]:
    return [flat[o : o + n].clone() for o, n in zip(offsets, numels)]


@vectors.register_fake
def _(flat, offsets, numels):
    return [flat.new_empty(n) for n in numels]


@custom_op("protrain::prefetch", mutates_args=())
def prefetch(tokens: List[torch.Tensor], anchor: torch.Tensor) -> torch.Tensor:
    store, chunk = chunk_store.bound_chunk(anchor)
    store.prefetch(chunk)
    return _token(anchor.device)


@prefetch.register_fake
def _(tokens, anchor):
    return torch.empty(0, device=anchor.device)


@custom_op("protrain::chunk_grad", mutates_args=())
def chunk_grad(
    grads: List[torch.Tensor],
    params: List[torch.Tensor],
    tokens: List[torch.Tensor],
    rows: Optional[torch.Tensor] = None,
    indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    store, chunk = chunk_store.bound_chunk(params[0])
    store.grad_ready(chunk, grads, [store.entry_index(p) for p in params], rows, indices)
    return _token(params[0].device)


@chunk_grad.register_fake
def _(grads, params, tokens, rows=None, indices=None):
    return torch.empty(0, device=params[0].device)


# ------------------------------------ chunks sharded on the devices, gathered by the graph itself
@custom_op("protrain::shard_values", mutates_args=())
def shard_values(anchor: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    store, chunk = chunk_store.bound_chunk(anchor)
    return store.shard_values(chunk, dtype)


@shard_values.register_fake
def _(anchor, numel, dtype):
    return torch.empty(numel, dtype=dtype, device=anchor.device)


@custom_op("protrain::pack_grads", mutates_args=())
def pack_grads(
    grads: List[torch.Tensor], params: List[torch.Tensor], numel: int, dtype: torch.dtype
) -> torch.Tensor:
    store, chunk = chunk_store.bound_chunk(params[0])
    return store.pack_grads(chunk, grads, [store.entry_index(p) for p in params])


@pack_grads.register_fake
def _(grads, params, numel, dtype):
    return torch.empty(numel, dtype=dtype, device=params[0].device)


@custom_op("protrain::shard_grad", mutates_args=())
def shard_grad(
    reduced: torch.Tensor, params: List[torch.Tensor], tokens: List[torch.Tensor]
) -> torch.Tensor:
    store, chunk = chunk_store.bound_chunk(params[0])
    store.grad_ready(chunk, [], [store.entry_index(p) for p in params], reduced=reduced)
    return _token(params[0].device)


@shard_grad.register_fake
def _(reduced, params, tokens):
    return torch.empty(0, device=params[0].device)


@custom_op("protrain::offload", mutates_args=())
def offload(x: torch.Tensor, tokens: List[torch.Tensor]) -> torch.Tensor:
    return swap_pool.swapper(x.device).offload(x)


@offload.register_fake
def _(x, tokens):
    return torch.empty_strided(x.shape, swap_pool.swapped_strides(x), dtype=x.dtype, device="cpu")


@custom_op("protrain::offload_wait", mutates_args=())
def offload_wait(
    hosts: List[torch.Tensor], tokens: List[torch.Tensor], device: torch.device
) -> torch.Tensor:
    swap_pool.swapper(device).offload_wait(hosts)
    return _token(device)


@offload_wait.register_fake
def _(hosts, tokens, device):
    return torch.empty(0, device=device)


@custom_op("protrain::reload_start", mutates_args=())
def reload_start(
    host: torch.Tensor, tokens: List[torch.Tensor], device: torch.device
) -> torch.Tensor:
    swap_pool.swapper(device).reload_start(host)
    return _token(device)


@reload_start.register_fake
def _(host, tokens, device):
    return torch.empty(0, device=device)


@custom_op("protrain::reload_take", mutates_args=())
def reload_take(
    host: torch.Tensor, tokens: List[torch.Tensor], device: torch.device
) -> torch.Tensor:
    return swap_pool.swapper(device).reload_take(host)


@reload_take.register_fake
def _(host, tokens, device):
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@custom_op("protrain::resident_grads", mutates_args=())
def resident_grads(
    grads: List[torch.Tensor],
    tokens: List[torch.Tensor],
    store: int,
    chunk: int,
    members: List[int],
) -> torch.Tensor:
    s = chunk_store.get_store(store)
    s.resident_grads_ready(chunk, grads, list(members))
    return _token(s.device)


@resident_grads.register_fake
def _(grads, tokens, store, chunk, members):
    return torch.empty(0, device=chunk_store.get_store(store).device)


@custom_op("protrain::resident_grads_wait", mutates_args=())
def resident_grads_wait(tokens: List[torch.Tensor], store: int) -> torch.Tensor:
    distributed.wait_resident_grads()
    return _token(chunk_store.get_store(store).device)


@resident_grads_wait.register_fake
def _(tokens, store):
    return torch.empty(0, device=chunk_store.get_store(store).device)


GATHER = torch.ops.protrain.gather.default
VECTORS = torch.ops.protrain.vectors.default
OFFLOAD = torch.ops.protrain.offload.default
OFFLOAD_WAIT = torch.ops.protrain.offload_wait.default
RELOAD_START = torch.ops.protrain.reload_start.default
RELOAD_TAKE = torch.ops.protrain.reload_take.default
PREFETCH = torch.ops.protrain.prefetch.default
CHUNK_GRAD = torch.ops.protrain.chunk_grad.default
SHARD_VALUES = torch.ops.protrain.shard_values.default
PACK_GRADS = torch.ops.protrain.pack_grads.default
SHARD_GRAD = torch.ops.protrain.shard_grad.default
RESIDENT_GRADS = torch.ops.protrain.resident_grads.default
RESIDENT_GRADS_WAIT = torch.ops.protrain.resident_grads_wait.default
# the functional collectives a graph runs for chunks sharded on the devices (passes/chunk_gather.py,
# optimizer_calls.py, shard_prefetch.py)
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
GRAD_OPS = (CHUNK_GRAD, RESIDENT_GRADS, SHARD_GRAD)
TOKEN_OPS = (
    PREFETCH,
    CHUNK_GRAD,
    RESIDENT_GRADS,
    RESIDENT_GRADS_WAIT,
    RELOAD_START,
    OFFLOAD_WAIT,
    SHARD_GRAD,
)
ALL_OPS = (GATHER, *TOKEN_OPS)
# where each op keeps its token list (argument index)
TOKEN_ARG = {
    GATHER: 0,
    PREFETCH: 0,
    CHUNK_GRAD: 2,
    SHARD_GRAD: 2,
    RESIDENT_GRADS: 1,
    RESIDENT_GRADS_WAIT: 0,
    RELOAD_START: 1,
    RELOAD_TAKE: 1,
    OFFLOAD: 1,
    OFFLOAD_WAIT: 1,
}
# FX's dead-code elimination keeps the token ops and offload although nothing may read their
# outputs: protrain_fx/graph/fx.py registers them (the runtime does not import torch.fx)
SIDE_EFFECT_OPS = (*TOKEN_OPS, OFFLOAD)


def fake_value(target, args):
    """The value a protrain op would return, built with the caller's (fake) tensor mode: ops whose
    only tensor arguments may be empty lists cannot be traced through the fake mode itself."""
    if target is GATHER:
        _, anchor, numel, dtype = args
        return torch.empty(numel, dtype=dtype, device=anchor.meta["val"].device)
    if target is PREFETCH:
        return torch.empty(0, device=args[1].meta["val"].device)
    if target in (CHUNK_GRAD, SHARD_GRAD):
        return torch.empty(0, device=args[1][0].meta["val"].device)
    if target is OFFLOAD_WAIT:
        return torch.empty(0, device=args[2])
    if target is RELOAD_START:
        return torch.empty(0, device=args[2])
    if target is RESIDENT_GRADS_WAIT:
        return torch.empty(0, device=chunk_store.get_store(args[1]).device)
    if target is RESIDENT_GRADS:
        return torch.empty(0, device=chunk_store.get_store(args[2]).device)
    raise KeyError(target)


# ------------------------------------------------------------------------------------ block
# profiling
_BACKWARD_OF = {
    block_timer.FWD_EXIT: block_timer.BWD_ENTER,
    block_timer.FWD_ENTER: block_timer.BWD_EXIT,
}


@custom_op("protrain::mark", mutates_args=())
def mark(x: torch.Tensor, block: int, where: int) -> torch.Tensor:
    """Identity (a copy, so that what follows depends on it) that records a block boundary; its
    gradient records the matching backward boundary (passes/block_marks.py)."""
    block_timer.RECORDER.record(block, where, x.device)
    return x.clone()


@mark.register_fake
def _(x, block, where):
    return torch.empty_like(x)


def _mark_setup(ctx, inputs, output):
    ctx.block, ctx.where = inputs[1], inputs[2]


def _mark_backward(ctx, grad):
    return torch.ops.protrain.mark(grad, ctx.block, _BACKWARD_OF[ctx.where]), None, None


mark.register_autograd(_mark_backward, setup_context=_mark_setup)
MARK = torch.ops.protrain.mark.default
