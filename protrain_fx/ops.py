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
* ``prefetch(tokens, store, chunk) -> token``: start the host-to-device copy into a free chunk buffer.
* ``release(tokens, store, chunk) -> token``: the chunk's buffer may be reused once the work queued so far
  on the compute stream is done (a token is the output of the chunk's last use).
* ``chunk_grad(grads, tokens, store, chunk, members) -> token``: pack the gradients of the chunk's parameters
  (``members``: their store entries) into one of the store's device gradient buffers, copy it to the host on
  its own stream, and hand the chunk to the CPU optimizer worker. The store owns that buffer: a buffer of
  the graph's would be reused by Inductor while the copy is still reading it.
"""
from __future__ import annotations

from typing import List

import torch
import torch.fx
from torch.library import custom_op

from . import _compat, chunks


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


@custom_op("protrain::chunk_grad", mutates_args=())
def chunk_grad(
    grads: List[torch.Tensor], tokens: List[torch.Tensor], store: int, chunk: int, members: List[int]
) -> torch.Tensor:
    s = chunks.get_store(store)
    s.grad_ready(chunk, grads, list(members))
    return _token(s.device)


@chunk_grad.register_fake
def _(grads, tokens, store, chunk, members):
    return torch.empty(0, device=chunks.get_store(store).device)


def _fake_token(tokens, store, chunk):
    return torch.empty(0, device=chunks.get_store(store).device)


for _op in (prefetch, release):
    _op.register_fake(_fake_token)

GATHER = torch.ops.protrain.gather.default
VECTORS = torch.ops.protrain.vectors.default
PREFETCH = torch.ops.protrain.prefetch.default
RELEASE = torch.ops.protrain.release.default
CHUNK_GRAD = torch.ops.protrain.chunk_grad.default
TOKEN_OPS = (PREFETCH, RELEASE, CHUNK_GRAD)
ALL_OPS = (GATHER, *TOKEN_OPS)

for _target in TOKEN_OPS:
    torch.fx.node.has_side_effect(_target)
_compat.lower_without_buffer_reuse(GATHER)


def fake_value(target, args):
    """The value a protrain op would return, built with the caller's (fake) tensor mode: ops whose only
    tensor arguments may be empty lists cannot be traced through the fake mode itself."""
    if target is GATHER:
        s = chunks.get_store(args[1])
        return torch.empty(s.chunk_numel(args[2]), dtype=s.param_dtype, device=s.device)
    store = args[2] if target is CHUNK_GRAD else args[1]
    return torch.empty(0, device=chunks.get_store(store).device)
