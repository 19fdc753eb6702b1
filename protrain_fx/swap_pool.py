"""SwapPool: pinned host memory for the saved activations of "swap" blocks, and their copies.

One pool per compiled forward/backward pair, sized once when the forward graph is compiled (the sum of the
swapped tensors' bytes, each at a 64-byte aligned offset). In forward, ``protrain::offload`` copies a saved
activation into its region on a device-to-host stream once the compute stream has produced it; the graph
returns the host view instead of the device tensor, whose memory goes back to the allocator when the copy
is done (``record_stream``). In backward, ``protrain::reload_start`` copies it back into a new device tensor
on a host-to-device stream one block ahead of use, and ``protrain::reload_take`` hands that tensor to the
graph after the compute stream has waited for the copy. On a CPU compute device the copies are real and
synchronous.
"""
from __future__ import annotations

import itertools

import torch

from . import hardware
from .options import ProtrainError

_POOLS: dict[int, "SwapPool"] = {}
_POOL_IDS = itertools.count()
ALIGN = 64


def get_pool(pool_id: int) -> "SwapPool":
    try:
        return _POOLS[pool_id]
    except KeyError:
        raise ProtrainError(f"protrain swap pool {pool_id} does not exist") from None


class SwapPool:
    def __init__(self, device: torch.device):
        self.id = next(_POOL_IDS)
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.regions: dict[int, tuple[int, torch.Size, torch.dtype]] = {}  # key -> (byte offset, shape, dtype)
        self.nbytes = 0
        self.buffer: torch.Tensor | None = None
        self._reloading: dict[int, tuple[torch.Tensor, object]] = {}
        self._offload_done: dict[int, object] = {}
        self.d2h_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.h2d_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.stats = {"offloaded_bytes": 0, "reloaded_bytes": 0}
        _POOLS[self.id] = self

    def add_region(self, shape, dtype: torch.dtype) -> int:
        """Reserve room for one swapped tensor (at compile time); returns its key."""
        key = len(self.regions)
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        self.regions[key] = (self.nbytes, torch.Size(shape), dtype)
        self.nbytes += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        return key

    def allocate(self) -> None:
        """Pin the whole pool once (after every region of the graph is known)."""
        if self.buffer is None and self.nbytes:
            self.buffer = hardware.host_empty(self.nbytes, torch.uint8, self.is_cuda)  # pinned at its exact size

    def host_view(self, key: int) -> torch.Tensor:
        offset, shape, dtype = self.regions[key]
        n = int(shape.numel()) * torch.empty(0, dtype=dtype).element_size()
        return self.buffer[offset:offset + n].view(dtype).view(shape)

    def offload(self, x: torch.Tensor, key: int) -> torch.Tensor:
        dst = self.host_view(key)
        self.stats["offloaded_bytes"] += dst.numel() * dst.element_size()
        if not self.is_cuda:
            dst.copy_(x)
            return dst
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            dst.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        x.record_stream(self.d2h_stream)  # the device memory is reused only after the copy
        self._offload_done[key] = done
        return dst

    def reload_start(self, host: torch.Tensor, key: int) -> None:
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.stats["reloaded_bytes"] += out.numel() * out.element_size()
        if not self.is_cuda:
            out.copy_(host)
            self._reloading[key] = (out, None)
            return
        with torch.cuda.stream(self.h2d_stream):
            # ``out`` was allocated on the compute stream, whose queued work may still use that memory;
            # the host region must hold forward's copy
            self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
            if key in self._offload_done:
                self.h2d_stream.wait_event(self._offload_done[key])
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        out.record_stream(self.h2d_stream)
        self._reloading[key] = (out, done)

    def reload_take(self, key: int) -> torch.Tensor:
        out, done = self._reloading.pop(key)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return out
