"""Clipping's two passes over offloaded gradients, its norm and its multiply, kept off the link.

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

The norm before it read every offloaded gradient over the link too (``clip_grad_norm_`` takes
``torch.linalg.vector_norm`` of each gradient: a HostGrad is not a type torch's foreach norm
accepts). Once a loop has asked for such a norm, backward computes it for every offloaded gradient
that arrives whole (the chunk's first gradient since it was zeroed, copied straight into the
accumulator) from the device gradient buffer it leaves from, with the same function on the same
values at the same alignment: the value the view would give, bit for bit
(:meth:`GradScales.note_grad_norms`). It is served while the gradient is unchanged (its view's
version, no factor pending, no plain tensor sharing its memory) and forgotten when anything adds to,
multiplies or replaces it.

:class:`GradScales` is inherited by :class:`protrain_fx.runtime.chunk_store.ChunkStore`;
:func:`install` hands mapped.HostGrad its callbacks.
"""

from __future__ import annotations

import torch

from protrain_fx.runtime import kept_grads, mapped


def install() -> None:
    """Route mapped.HostGrad's multiplies and reads to the stores of the gradients."""
    mapped.HostGrad.defer_scale, mapped.HostGrad.settle = _defer_scale, _settle
    mapped.HostGrad.on_alias, mapped.HostGrad.cached_norm = _aliased, _cached_norm
    mapped.HostGrad.forget_norms = _forget_norms


class _Norms:
    """Whether a loop has asked for the 2-norm of an offloaded gradient (from then on backward
    computes them as gradients leave the device)."""

    wanted = False


class PendingScales(dict):
    """entry -> its pending float32 factor; ``aliased``: entries whose gradient memory a plain
    tensor shares (``p.grad.detach()``, ``.data``, a view), until the gradient is replaced: their
    multiplies are not kept pending, so that such a tensor sees them as eager's would; ``norms``:
    entry -> (its gradient's 2-norm computed in backward, the accumulator, the view's version
    then, the event after which it may be read or None)."""

    def __init__(self):
        super().__init__()
        self.aliased: set[int] = set()
        self.norms: dict[int, tuple] = {}
        self.plain: dict[int, list] = {}  # entry -> weak references to those tensors (kept_grads)


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


def _aliased(grad, tensor) -> None:
    """mapped.HostGrad's callback: the plain ``tensor`` now shares this gradient's memory."""
    for store, entries in owners([grad]).items():
        store._grad_scale.aliased.update(entries)
        for entry in entries:
            kept_grads.note_plain(store, entry, tensor)


def _cached_norm(args, kwargs):
    """mapped.HostGrad's callback for ``torch.linalg.vector_norm``: the norm backward computed, for
    the 2-norm of a whole gradient (as ``clip_grad_norm_`` asks), or None."""
    grad = args[0] if args else kwargs.get("x")
    if len(args) > 2 or not isinstance(grad, mapped.HostGrad):
        return None
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if any(k not in ("x", "ord") for k in kwargs) or isinstance(order, bool) or order != 2:
        return None
    _Norms.wanted = True
    for store, (entry,) in owners([grad]).items():
        return store.cached_grad_norm(entry, grad)
    return None


def _forget_norms(grads) -> None:
    """mapped.HostGrad's callback: a function is about to write these gradients."""
    for store, entries in owners(grads).items():
        store.forget_grad_norms(entries)


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
        self.forget_grad_norms(indices)
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
            if drop or scale is not None:  # the gradient changes: its norm from backward goes
                self.forget_grad_norms([i])
            # a gradient the loop kept across zero_grad() keeps its multiply (kept_grads.py)
            keep = scale is not None and drop and kept_grads.held(self, i)
            acc = (
                None if scale is None or drop and not keep else self.grad.get(self.entries[i].chunk)
            )
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

    def note_grad_norms(self, chunk: int, buf: torch.Tensor, members: list[int]) -> None:
        """Backward: the chunk's device gradient buffer ``buf`` (chunk layout, master dtype) is
        about to be copied straight into its accumulator, the whole gradient of ``members`` (a first
        gradient, or the sum with the last one: grad_add.py). Once a
        loop has asked for gradient norms, compute each one's 2-norm from it, where the view's
        memory and the buffer have the same alignment (the reduction's split of the work depends on
        it): the value ``torch.linalg.vector_norm`` of the view will give, without reading host
        memory."""
        acc = self.grad.get(chunk)
        if not _Norms.wanted or not self.aliased or acc is None:
            return
        if acc.data_ptr() % 16 != buf.data_ptr() % 16:
            return
        with torch.no_grad():
            for i in members:
                e = self.entries[i]
                if i in self._grad_scale.aliased:
                    continue
                self.grad_alias(i)  # the view, whose version tells of writes through it
                norm = torch.linalg.vector_norm(buf[e.offset : e.offset + e.numel].view(e.shape), 2)
                self._grad_scale.norms[i] = (norm, acc, self._grad_plain[i]._version, None)

    def cached_grad_norm(self, i: int, grad: torch.Tensor):
        """The 2-norm of entry ``i``'s gradient (``grad``, its view) that backward computed, while
        that gradient is unchanged; else None."""
        cached = self._grad_scale.norms.get(i)
        if (
            cached is None
            or grad is not self._grad_alias.get(i)
            or i in self._grad_scale
            or i in self._grad_scale.aliased
            or cached[1] is not self.grad.get(self.entries[i].chunk)
            or cached[2] != self._grad_plain[i]._version
        ):
            return None
        self._stats["grad_norms_served"] += 1
        if cached[3] is not None:  # computed on the copy stream (grad_add.py)
            torch.cuda.current_stream(cached[0].device).wait_event(cached[3])
        return cached[0].clone()

    def forget_grad_norms(self, indices) -> None:
        """These gradients are about to change (added to, multiplied, replaced, zeroed)."""
        for i in indices:
            self._grad_scale.norms.pop(i, None)
