"""Gradients a training loop kept across ``zero_grad()``: they keep their values, as in eager.

Eager autograd gives a parameter's gradient new memory after ``param.grad = None`` (what
``zero_grad()`` does by default): a tensor the loop kept of the last gradient (``g = p.grad``, the
list of gradients a monitor compares with the next step's, ``p.grad.detach()``, a view) keeps its
values. An offloaded parameter's gradient is a view of its chunk's host accumulator
(protrain_fx/runtime/mapped.py), which the next backward writes again. So before a new gradient is
written there (:func:`move_out`), the values of one the loop kept are copied to host memory of
their own and every tensor it kept is pointed at the copy (``Tensor.set_``); the parameter gets a
new view. Whether the loop kept the view itself is told by its reference count (otherwise only the
store, and ``param.grad`` while set, hold it); plain tensors sharing its memory are known from
mapped.HostGrad's alias callback, held weakly. A clip's multiply still pending on a kept gradient
is applied, not dropped, when the gradient is zeroed (:func:`held`, from
``GradScales.settle_grad_scale``). Nothing is copied when the loop kept nothing.
"""

from __future__ import annotations

import sys
import weakref

import torch

from protrain_fx.machine import pinned
from protrain_fx.runtime import mapped
from protrain_fx.runtime.worker import WORKER


def note_plain(store, entry: int, tensor: torch.Tensor) -> None:
    """A plain tensor now shares entry ``entry``'s gradient memory."""
    store._grad_scale.plain.setdefault(entry, []).append(weakref.ref(tensor))


def held(store, entry: int) -> list[torch.Tensor]:
    """The tensors outside protrain that hold entry ``entry``'s gradient memory: its view, where
    referenced beyond the store and ``param.grad``, and the live plain tensors sharing it."""
    out = []
    view = store._grad_alias.get(entry)
    if view is not None:
        p = store._params[entry]()
        # the store's dict, this frame's name, getrefcount's argument, and param.grad if set
        expected = 3 + (p is not None and p.grad is view)
        if sys.getrefcount(view) > expected:
            out.append(view)
    for ref in store._grad_scale.plain.get(entry, ()):
        t = ref()
        if t is not None:
            out.append(t)
    return out


def move_out(store, entry: int) -> None:
    """A new gradient is about to be written into entry ``entry``'s memory: tensors the loop kept
    of the last one get a copy of its values, and the parameter a new view."""
    kept = held(store, entry)
    store._grad_scale.plain.pop(entry, None)
    if not kept:  # the usual case, every fresh gradient of every backward: nothing more to look up
        return
    e = store.entries[entry]
    acc = store.grad.get(e.chunk)
    if acc is None:
        return
    WORKER.wait_chunk((store.id, e.chunk))
    store.settle_grad_scale([entry])  # the values the kept tensors would read now
    copy = pinned.host_empty(e.numel, acc.dtype, store.is_cuda)
    with torch.no_grad():
        copy.copy_(acc[e.offset : e.offset + e.numel])
    storage = mapped.device_view(copy, 0, (e.numel,), store.device).untyped_storage()
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for t in kept:
            t.set_(storage, t.storage_offset(), t.size(), t.stride())
    old = store._grad_alias.pop(entry, None)
    store._grad_plain.pop(entry, None)
    if old is not None:
        old._protrain_owner = None  # no longer this parameter's gradient: no callbacks route it
