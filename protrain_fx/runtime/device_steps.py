"""Adam steps of offloaded chunks run on the compute device, streamed up and back.

When the CPU optimizer bounds the step and the host-device link has room, some offloaded chunks
are stepped on the compute device instead of the CPU (issue 24): their fp32 master, gradient and
two moments are copied up into a scratch slot (16 bytes per parameter), torch's fused Adam/AdamW
steps them there, and master, moments and the bf16 transfer copy go back (14 bytes), all on a
stream of their own. The host worker only queues this and goes on with the next chunk's CPU step,
so CPU and link work side by side; the event that ends the copies back is registered with the
worker (``Worker.pending``), and everything that waits for the chunk's host values waits for it
too. The chunk's state stays in host memory between steps, exactly where a CPU-stepped chunk's is,
so provisional steps, their inverse, clipping, checkpoints and state dicts are unchanged. Which
chunks: :func:`pick`, evenly spread among a store's offloaded chunks (a fraction the cost model
chooses, protrain_fx/plan/cost_model.py), so that the link and the CPU are busy together while
gradients arrive.

On a CPU compute device the "device" is the host: the copies are real copies into scratch and the
step is the implementation the CPU path would use, so tests check the data flow exactly.
"""

from __future__ import annotations

import threading

import torch

# chunks in flight (one copied up or stepped while the other goes back); the bytes per parameter a
# slot holds and moves are the cost model's DEVICE_STEP_* (protrain_fx/plan/profiles.py)
from protrain_fx.plan.profiles import DEVICE_STEP_SLOTS as SLOTS

_ORDINAL = [0]  # offloaded chunks handed to pick() so far, over every store


def pick(offloaded: list[int], fraction: float, start: int | None = None) -> set[int]:
    """The chunks of ``offloaded`` to step on the device: ``fraction`` of them, evenly spread, as
    the positions ``start, start + 1, ...`` of one sequence over every store (by default, where the
    last call left off): a model compiled in regions has a store of a few chunks per block, and
    rounding each store's share on its own would step 2 of 4 chunks in every store for a share of
    0.41. Over consecutive calls, the chunks picked are ``floor(fraction * positions)``."""
    f = max(0.0, min(1.0, fraction))
    if start is None:
        start, _ORDINAL[0] = _ORDINAL[0], _ORDINAL[0] + len(offloaded)
    eps = 1e-9  # a share k / n times n is k, not k - 1 ulp
    return {
        c
        for i, c in enumerate(offloaded)
        if int((start + i + 1) * f + eps) > int((start + i) * f + eps)
    }


def assign(store, fraction: float) -> None:
    """Step ``fraction`` of ``store``'s offloaded chunks on the compute device, evenly spread:
    chunks of the layout's size only (an oversized one, a large vocabulary's embedding, would need
    a scratch of its size), one rank only. Their device scratch is allocated now."""
    packed = [c for c in store.offloaded_chunks if not store.grad_goes_as_is(c)]
    ok = fraction > 0 and not store.world.sharded and store.master_dtype == torch.float32
    store.device_step_share = fraction if ok else 0.0
    store.device_step_chunks = pick(packed, fraction) if ok else set()
    if store.device_step_chunks:
        transfer = store.transfer[next(iter(store.device_step_chunks))]
        scratch(
            store.device,
            store.chunk_capacity,
            None if transfer.dtype == store.master_dtype else transfer.dtype,
        )


class Scratch:
    """``SLOTS`` device slots of ``numel`` parameters each and the stream the steps run on."""

    def __init__(self, device: torch.device, numel: int, transfer_dtype: torch.dtype | None):
        self.device, self.numel = device, numel
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots = [
            (
                torch.empty(4 * numel, dtype=torch.float32, device=device),
                None
                if transfer_dtype is None
                else torch.empty(numel, dtype=transfer_dtype, device=device),
            )
            for _ in range(SLOTS)
        ]
        self.events: list = [None] * SLOTS
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        """A slot whose last step's copies are done (waits for them)."""
        with self._lock:
            k, self._next = self._next, (self._next + 1) % SLOTS
        ev, self.events[k] = self.events[k], None
        if ev is not None:
            ev.synchronize()
        return k

    def step(self, k: int, master, grad, exp_avg, exp_avg_sq, transfer, adam) -> object:
        """Copy the chunk's state into slot ``k``, run ``adam(p, g, m, v)`` there, copy master,
        moments and (``transfer`` not None) the transfer copy back; returns the event that ends the
        copies back (None on the CPU, where all of it is done on return)."""
        flat, low = self.slots[k]
        n = master.numel()
        p, g, m, v = (flat[i * self.numel : i * self.numel + n] for i in range(4))
        if not self.cuda:
            self._run(p, g, m, v, low, master, grad, exp_avg, exp_avg_sq, transfer, adam)
            return None
        s = self.stream
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            self._run(p, g, m, v, low, master, grad, exp_avg, exp_avg_sq, transfer, adam)
            ev = torch.cuda.Event()
            ev.record(s)
        self.events[k] = ev
        return ev

    @staticmethod
    def _run(p, g, m, v, low, master, grad, exp_avg, exp_avg_sq, transfer, adam) -> None:
        with torch.no_grad():
            for dst, src in ((p, master), (g, grad), (m, exp_avg), (v, exp_avg_sq)):
                dst.copy_(src, non_blocking=True)
            adam(p, g, m, v)
            for dst, src in ((master, p), (exp_avg, m), (exp_avg_sq, v)):
                dst.copy_(src, non_blocking=True)
            if transfer is not None:
                out = low[: p.numel()]
                out.copy_(p)  # rounds like Tensor.to, as the CPU path's transfer copy does
                transfer.copy_(out, non_blocking=True)


_SCRATCH: dict = {}
_SCRATCH_LOCK = threading.Lock()


def scratch(device: torch.device, numel: int, transfer_dtype: torch.dtype | None) -> Scratch:
    """One scratch per device, transfer dtype and slot size, shared by the stores that step chunks
    on the device (a model compiled in regions has a store per region)."""
    key = (str(device), transfer_dtype)
    with _SCRATCH_LOCK:
        s = _SCRATCH.get(key)
        if s is None or s.numel < numel:
            if s is not None:
                for ev in s.events:
                    if ev is not None:
                        ev.synchronize()
            s = _SCRATCH[key] = Scratch(device, numel, transfer_dtype)
        return s


def release_all() -> None:
    """Free every scratch (the last store that steps on the device is gone)."""
    with _SCRATCH_LOCK:
        for s in _SCRATCH.values():
            for ev in s.events:
                if ev is not None:
                    ev.synchronize()
        _SCRATCH.clear()
