"""Clipping's multiply of offloaded gradients, kept pending instead of run through host memory.

``clip_grad_norm_`` (or any ``mul_`` by one scalar) multiplies every gradient in place. An
offloaded parameter's ``.grad`` is a device view of its host accumulator
(protrain_fx/runtime/mapped.py), so that multiply reads and writes every offloaded gradient over the
link (15 GB a step for the Llama-3.2-3B shape at 24 GiB, 1.9 B offloaded parameters; with the
norm's read about 400 ms of the 1.2 s step on an H100 host,
``benchmarks/results/oom_sweep_h100_run46.md``), while the chunks then step at ``opt.step()``,
after backward. Instead the factor is kept per parameter (:meth:`GradScales.scale_grads_later`)
and applied where the gradient is read next: the CPU Adam kernel's pass over the chunk multiplies
each gradient as it reads it (``cpu_adam.adam_step(grad_scale=)``: no extra pass, the accumulator
not written, the factor still pending); anything else that reads the gradient (a torch function on
``param.grad``, another backward adding to it, a step that cannot take the factor) applies it to
the accumulator first (:meth:`GradScales.settle_grad_scale`), and a gradient zeroed or replaced
drops it. ``g * c`` rounded once in float32 either way, which is what eager's ``mul_`` computes on
the device: the same values, bit for bit.

:class:`GradScales` is inherited by :class:`protrain_fx.runtime.chunk_store.ChunkStore`;
:func:`install` hands mapped.HostGrad the two callbacks.
"""

from __future__ import annotations

import torch

from protrain_fx.runtime import mapped


def install() -> None:
    """Route mapped.HostGrad's multiplies and reads to the stores of the gradients."""
    mapped.HostGrad.defer_scale, mapped.HostGrad.settle = _defer_scale, _settle
    mapped.HostGrad.on_alias = _aliased


class PendingScales(dict):
    """entry -> its pending float32 factor; ``aliased``: entries whose gradient memory a plain
    tensor shares (``p.grad.detach()``, ``.data``, a view), until the gradient is replaced: their
    multiplies are not kept pending, so that such a tensor sees them as eager's would."""

    def __init__(self):
        super().__init__()
        self.aliased: set[int] = set()


def owners(grads) -> dict:
    """Live chunk store -> its entries among these gradient views (views of a store that is gone
    are left out)."""
    from protrain_fx.runtime.chunk_store import _STORES

    out: dict = {}
    for g in grads:
        owner = getattr(g, "_protrain_owner", None)
        store = _STORES.get(owner[0]) if owner is not None else None
        if store is not None:
            out.setdefault(store, []).append(owner[1])
    return out


def _defer_scale(grads, scale: float) -> bool:
    """mapped.HostGrad's callback: keep ``mul_(scale)`` of these gradients pending (not for
    sharded stores, whose gradients are not in ``param.grad``, non-float32 masters, or a gradient
    a plain tensor shares)."""
    by_store = owners(grads)
    if sum(map(len, by_store.values())) != len(grads) or any(
        s.world.sharded
        or s.master_dtype != torch.float32
        or not s._grad_scale.aliased.isdisjoint(entries)
        for s, entries in by_store.items()
    ):
        return False
    for store, entries in by_store.items():
        store.scale_grads_later(entries, scale)
    return True


def _aliased(grad) -> None:
    """mapped.HostGrad's callback: a plain tensor now shares this gradient's memory."""
    for store, entries in owners([grad]).items():
        store._grad_scale.aliased.update(entries)


def _settle(grads, drop: bool) -> None:
    """mapped.HostGrad's callback: a function is about to read (or zero: ``drop``) these."""
    for store, entries in owners(grads).items():
        if store._grad_scale:
            store.settle_grad_scale(entries, drop)


class GradScales:
    """The pending factors of a chunk store's gradients (``_grad_scale``, a
    :class:`PendingScales`)."""

    def scale_grads_later(self, indices: list[int], scale: float) -> None:
        """``param.grad.mul_(scale)`` of these offloaded parameters (clipping), kept as a pending
        float32 factor instead of a pass through device views of host memory: applied to the
        accumulator before anything reads the gradient (:meth:`settle_grad_scale`, from
        mapped.HostGrad), or by the CPU kernel's pass over the chunk, which multiplies each gradient
        as it reads it (:meth:`chunk_grad_scale`). ``g * scale`` rounded once either way: eager's
        ``mul_``."""
        for i in indices:
            self.settle_grad_scale([i])  # a second multiply rounds after the first, as eager's
            self._grad_scale[i] = scale
            torch.autograd.graph.increment_version(self._grad_plain[i])  # as the write would

    def settle_grad_scale(self, indices, drop: bool = False) -> None:
        """Apply the pending factors of these entries to the accumulator (``drop``: forget them,
        their gradient is about to be zeroed or replaced)."""
        synced = False
        for i in indices:
            scale = self._grad_scale.pop(i, None)
            acc = None if scale is None or drop else self.grad.get(self.entries[i].chunk)
            if acc is None:
                continue
            if self.is_cuda and not synced:
                # kernels queued earlier may still read the gradient through its device view,
                # which the multiply on the device would have followed
                torch.cuda.synchronize(self.device)
                synced = True
            e = self.entries[i]
            with torch.no_grad():
                acc[e.offset : e.offset + e.numel].mul_(scale)

    def chunk_grad_scale(self, chunk: int) -> float:
        """The one factor pending on every parameter of the chunk, which the CPU kernel applies as
        it reads the gradients (they stay pending: the accumulator is not written); 1.0 where none
        is, after applying any mix of them."""
        entries = self._chunk_entries[chunk]
        scales = {self._grad_scale.get(i) for i in entries}
        if len(scales) == 1 and None not in scales:
            return scales.pop()
        self.settle_grad_scale(entries)
        return 1.0
