"""The ``protrain::`` custom ops the graph passes insert. Each is a thin call into the runtime
(:mod:`protrain_fx.chunks`), which owns all state; the ops take the store id and chunk id as ints.

Every op takes a list of *tokens*: tensors produced by the nodes it must follow (the passes choose them), so
the order survives Inductor's scheduling (Inductor reorders independent custom ops; a data dependency it
cannot break). Every op but ``gather`` returns a 0-element token tensor. Ops without consumers would be dead code, so they are registered as having
side effects (at import time, before any graph is compiled: Inductor's cache key does not see it).

* ``gather(tokens, store, chunk) -> flat``: the chunk's parameters on the compute device, in the transfer
  dtype (a view of one of the store's reusable chunk buffers; waits for its prefetch, or loads it now).
* ``vectors(flat, offsets, numels) -> [tensor]``: copies of the chunk's 1-D parameters (biases, norm weights)
  as tensors of their own. Read as views at an offset into the gathered chunk, Inductor's CUDA code got a
  bias wrong (GPT-style model, torch 2.11, H200); Inductor removes a plain ``clone`` as a no-op.
* ``offload(x, tokens, pool, key) -> host``: device-to-host copy of a saved activation of a swap block into its
  region of a pinned pool (:mod:`protrain_fx.swap_pool`); forward returns the host view instead of ``x``.
* ``reload_start(host, tokens, pool, key) -> token`` / ``reload_take(host, tokens, pool, key) -> x``: copy it
  back to the device one block ahead of use, and hand it to backward once the copy is done.
* ``prefetch(tokens, store, chunk) -> token``: start the host-to-device copy into a free chunk buffer.
* ``release(tokens, store, chunk) -> token``: the chunk's buffer may be reused once the work queued so far
  on the compute stream is done (a token is the output of the chunk's last use).
* ``chunk_grad(grads, tokens, store, chunk, members) -> token``: pack the gradients of the chunk's parameters
  (``members``: their store entries) into one of the store's device gradient buffers, copy it to the host on
  its own stream, and hand the chunk to the CPU optimizer worker. The store owns that buffer: a buffer of
  the graph's would be reused by Inductor while the copy is still reading it.
* ``resident_grads(grads, tokens, store, chunk, members) -> token``: data parallel only: start averaging a
  resident chunk's parameter gradients over the ranks, in place (one coalesced async all-reduce), now, in
  backward, so it overlaps the rest of backward. The graph still returns those gradients (so Inductor never
  reuses their memory while the collective runs).
* ``resident_grads_wait(tokens, store) -> token``: at the end of that backward graph, the compute stream
  waits for those all-reduces (:func:`protrain_fx.distributed.wait_resident_grads`) before autograd reads
  the gradients.
"""
from __future__ import annotations

from typing import List

import torch
import torch.fx
from torch.library import custom_op

from . import _compat, block_timer, chunks, distributed, swap_pool


def _token(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device)


@custom_op("protrain::gather", mutates_args=())
def gather(tokens: List[torch.Tensor], store: int, chunk: int) -> torch.Tensor:
    return chunks.get_store(store).gather(chunk)


@gather.register_fake
def _(tokens, store, chunk):
    s = chunks.get_store(store)
    return torch.empty(s.chunk_numel(chunk), dtype=s.param_dtype, device=s.device)


@custom_op("protrain::vectors", mutates_args=())
def vectors(flat: torch.Tensor, offsets: List[int], numels: List[int]) -> List[torch.Tensor]:
    return [flat[o:o + n].clone() for o, n in zip(offsets, numels)]


@vectors.register_fake
def _(flat, offsets, numels):
    return [flat.new_empty(n) for n in numels]


@custom_op("protrain::offload", mutates_args=())
def offload(x: torch.Tensor, tokens: List[torch.Tensor], pool: int, key: int) -> torch.Tensor:
    return swap_pool.get_pool(pool).offload(x, key)


@offload.register_fake
def _(x, tokens, pool, key):
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@custom_op("protrain::reload_start", mutates_args=())
def reload_start(host: torch.Tensor, tokens: List[torch.Tensor], pool: int, key: int) -> torch.Tensor:
    p = swap_pool.get_pool(pool)
    p.reload_start(host, key)
    return _token(p.device)


@reload_start.register_fake
def _(host, tokens, pool, key):
    return torch.empty(0, device=swap_pool.get_pool(pool).device)


@custom_op("protrain::reload_take", mutates_args=())
def reload_take(host: torch.Tensor, tokens: List[torch.Tensor], pool: int, key: int) -> torch.Tensor:
    return swap_pool.get_pool(pool).reload_take(key)


@reload_take.register_fake
def _(host, tokens, pool, key):
    return torch.empty(host.shape, dtype=host.dtype, device=swap_pool.get_pool(pool).device)


@custom_op("protrain::prefetch", mutates_args=())
def prefetch(tokens: List[torch.Tensor], store: int, chunk: int) -> torch.Tensor:
    s = chunks.get_store(store)
    s.prefetch(chunk)
    return _token(s.device)


@custom_op("protrain::release", mutates_args=())
def release(tokens: List[torch.Tensor], store: int, chunk: int) -> torch.Tensor:
    s = chunks.get_store(store)
    s.release(chunk)
    return _token(s.device)


def _grad_op(name: str, method: str):
    """A ``(grads, tokens, store, chunk, members) -> token`` op that hands a chunk's gradients to
    ``ChunkStore.<method>``."""

    @custom_op(f"protrain::{name}", mutates_args=())
    def op(grads: List[torch.Tensor], tokens: List[torch.Tensor], store: int, chunk: int, members: List[int]
           ) -> torch.Tensor:
        s = chunks.get_store(store)
        getattr(s, method)(chunk, grads, list(members))
        return _token(s.device)

    @op.register_fake
    def _(grads, tokens, store, chunk, members):
        return torch.empty(0, device=chunks.get_store(store).device)

    return op


chunk_grad = _grad_op("chunk_grad", "grad_ready")
resident_grads = _grad_op("resident_grads", "resident_grads_ready")


@custom_op("protrain::resident_grads_wait", mutates_args=())
def resident_grads_wait(tokens: List[torch.Tensor], store: int) -> torch.Tensor:
    distributed.wait_resident_grads()
    return _token(chunks.get_store(store).device)


@resident_grads_wait.register_fake
def _(tokens, store):
    return torch.empty(0, device=chunks.get_store(store).device)


def _fake_token(tokens, store, chunk):
    return torch.empty(0, device=chunks.get_store(store).device)


for _op in (prefetch, release):
    _op.register_fake(_fake_token)

GATHER = torch.ops.protrain.gather.default
VECTORS = torch.ops.protrain.vectors.default
OFFLOAD = torch.ops.protrain.offload.default
RELOAD_START = torch.ops.protrain.reload_start.default
RELOAD_TAKE = torch.ops.protrain.reload_take.default
PREFETCH = torch.ops.protrain.prefetch.default
RELEASE = torch.ops.protrain.release.default
CHUNK_GRAD = torch.ops.protrain.chunk_grad.default
RESIDENT_GRADS = torch.ops.protrain.resident_grads.default
RESIDENT_GRADS_WAIT = torch.ops.protrain.resident_grads_wait.default
GRAD_OPS = (CHUNK_GRAD, RESIDENT_GRADS)
TOKEN_OPS = (PREFETCH, RELEASE, CHUNK_GRAD, RESIDENT_GRADS, RESIDENT_GRADS_WAIT, RELOAD_START)
ALL_OPS = (GATHER, *TOKEN_OPS)

for _target in TOKEN_OPS:
    torch.fx.node.has_side_effect(_target)
torch.fx.node.has_side_effect(OFFLOAD)
_compat.lower_without_buffer_reuse(GATHER)
_compat.lower_without_buffer_reuse(OFFLOAD)  # its output is a view of the pinned pool


def fake_value(target, args):
    """The value a protrain op would return, built with the caller's (fake) tensor mode: ops whose only
    tensor arguments may be empty lists cannot be traced through the fake mode itself."""
    if target is GATHER:
        s = chunks.get_store(args[1])
        return torch.empty(s.chunk_numel(args[2]), dtype=s.param_dtype, device=s.device)
    if target is RELOAD_START:
        return torch.empty(0, device=swap_pool.get_pool(args[2]).device)
    if target is RESIDENT_GRADS_WAIT:
        return torch.empty(0, device=chunks.get_store(args[1]).device)
    store = args[2] if target in GRAD_OPS else args[1]
    return torch.empty(0, device=chunks.get_store(store).device)


# ------------------------------------------------------------------------------------ block profiling
_BACKWARD_OF = {block_timer.FWD_EXIT: block_timer.BWD_ENTER, block_timer.FWD_ENTER: block_timer.BWD_EXIT}


@custom_op("protrain::mark", mutates_args=())
def mark(x: torch.Tensor, block: int, where: int) -> torch.Tensor:
    """Identity (a copy, so that what follows depends on it) that records a block boundary; its gradient
    records the matching backward boundary (passes/block_marks.py)."""
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
