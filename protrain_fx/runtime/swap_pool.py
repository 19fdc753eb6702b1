"""Swapping saved activations: their copies to host memory in forward and back in backward.

Every call of a forward graph gets its own host memory for what it swaps (``protrain::offload``
allocates it, pinned on CUDA, from torch's caching host allocator, which reuses it once freed and
once the copies that used it are done), so two forwards before one backward, or one block graph
called for every block, never overwrite each other. The host tensor is what forward saves for
backward; its data pointer names the copy in flight. On CUDA the copies run on the device's copy
streams (protrain_fx/runtime/chunk_buffers.py):

* ``offload(x)``: copy ``x`` on the compute stream into device memory of protrain's own (a fast
  on-device copy), then from there to the host on the device-to-host stream. The copy must not read
  memory that Inductor owns: Inductor gives a buffer to later kernels once its last reader has been
  *called*, and it may hand the op a private copy of ``x`` made only for it (on CUDA, where its
  buffers have padded strides and the op wants eager's), which no later op keeps alive; an H200 run
  read such reused memory and trained with NaN losses. The staged copy is released to torch's
  allocator only once the transfer is done (``record_stream``). ``offload_wait`` later makes the
  compute stream wait for the copies of a block (two blocks on), which bounds how far they may lag
  (in a model compiled in regions, a block's graph ends with its wait: the swapper keeps it until
  the region two on begins, :meth:`Swapper.region_begins`);
* ``reload_start(host)``: one block ahead of use, copy it into a new device tensor on the
  host-to-device stream; ``reload_take(host)`` makes the compute stream wait for that copy and
  returns the tensor.

On a CPU compute device the copies are real and synchronous. ``PROTRAIN_DEBUG_DEFER_OFFLOAD=1``
makes them as late as a CUDA copy could be: each offload copies only at its ``offload_wait``, so a
graph that let a copy read memory it does not own computes wrong gradients on the CPU as it would on
the GPU.
"""

from __future__ import annotations

import torch

from protrain_fx import config
from protrain_fx.machine import pinned
from protrain_fx.runtime.chunk_buffers import streams_of

DEFER = config.settings().debug_defer_offload
# debugging aid: PROTRAIN_DEBUG_SYNC=1 synchronizes the device after every copy (no overlap, no
# race); =offload or =reload after those copies only (which side a race is on)
SYNC_OFFLOAD, SYNC_RELOAD = config.settings().sync_offload, config.settings().sync_reload


class Swapper:
    """The activation copies of one compute device (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.streams = streams_of(device)
        self._offloading: dict[int, tuple] = {}  # host data_ptr -> (event or deferred source)
        self._reloading: dict[int, tuple[torch.Tensor, object]] = {}
        self.stats = {"offloaded_bytes": 0, "reloaded_bytes": 0}
        # a model compiled in regions (protrain_fx/region_program.py) runs one block per graph:
        # a block's offload_wait is kept and done when the block two regions on begins
        self._region = None  # the region running now, while a program runs its forward
        self._deferred: list[tuple[int, list]] = []  # (region, its copies to wait for)

    def offload(self, x: torch.Tensor) -> torch.Tensor:
        flat = pinned.cached_host_empty((x.numel(),), x.dtype, pin=self.is_cuda)
        host = flat.as_strided(x.shape, swapped_strides(x))
        self.stats["offloaded_bytes"] += host.numel() * host.element_size()
        if not self.is_cuda:
            if DEFER:  # a late copy must read memory of its own, as on the GPU
                self._offloading[host.data_ptr()] = (
                    host,
                    x.clone(memory_format=torch.contiguous_format),
                )
            else:
                host.copy_(x)
            return host
        compute = torch.cuda.current_stream(self.device)
        staged = torch.empty_strided(x.shape, host.stride(), dtype=x.dtype, device=x.device)
        staged.copy_(x)  # on the compute stream, right behind x's producer
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(self.streams.d2h):
            self.streams.d2h.wait_event(ready)
            host.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.streams.d2h)
        staged.record_stream(self.streams.d2h)  # freed now, reused only after the transfer
        self._offloading[host.data_ptr()] = (done,)
        if SYNC_OFFLOAD:
            torch.cuda.synchronize(self.device)
        return host

    def offload_wait(self, hosts: list[torch.Tensor]) -> None:
        items = [self._offloading.pop(h.data_ptr(), None) for h in hosts]
        items = [i for i in items if i is not None]
        if self._region is not None:  # at a region's end: two regions on
            self._deferred.append((self._region, items))
            return
        self._wait(items)

    def _wait(self, items: list) -> None:
        compute = torch.cuda.current_stream(self.device) if self.is_cuda else None
        for item in items:
            if self.is_cuda:
                compute.wait_event(item[0])
            # a deferred copy (PROTRAIN_DEBUG_DEFER_OFFLOAD): now, as late as the GPU could do it
            # (after its graph returned, in regions: autograd has saved the host tensor, whose
            # version the copy must not bump)
            else:
                item[0].data.copy_(item[1])

    def region_begins(self, index: int | None) -> None:
        """A program's forward enters region ``index`` (None: it is done): the compute stream waits
        for the copies of blocks that ended two regions before (all of them when done)."""
        keep = []
        for region, items in self._deferred:
            if index is None or region <= index - 2:
                self._wait(items)
            else:
                keep.append((region, items))
        self._deferred = keep
        self._region = index

    def reload_start(self, host: torch.Tensor) -> None:
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        self.stats["reloaded_bytes"] += out.numel() * out.element_size()
        pending = self._offloading.pop(host.data_ptr(), None)
        if not self.is_cuda:
            if pending is not None and len(pending) == 2:
                pending[0].copy_(pending[1])
            out.copy_(host)
            self._reloading[host.data_ptr()] = (out, None)
            return
        # ``out`` was allocated on the compute stream, whose queued work may still use that memory,
        # so the copy waits for everything queued there so far (the compute stream already waited
        # for forward's copy of ``host``, offload_wait). The compute stream is named before the copy
        # stream becomes the current one: inside ``torch.cuda.stream(h2d)`` the current stream *is*
        # h2d, and waiting for it is no wait at all (the H200 race of issue 19 item 7: reloads wrote
        # into memory that queued backward kernels still used)
        compute = torch.cuda.current_stream(self.device)
        self.streams.h2d.wait_stream(compute)
        with torch.cuda.stream(self.streams.h2d):
            if pending is not None:
                self.streams.h2d.wait_event(pending[0])
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.streams.h2d)
        out.record_stream(self.streams.h2d)
        self._reloading[host.data_ptr()] = (out, done)
        if SYNC_RELOAD:
            torch.cuda.synchronize(self.device)

    def reload_take(self, host: torch.Tensor) -> torch.Tensor:
        item = self._reloading.pop(host.data_ptr(), None)
        if item is None:  # reload_start did not run (a graph called by hand): copy now
            self.reload_start(host)
            item = self._reloading.pop(host.data_ptr())
        out, done = item
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return out

    def reset(self) -> None:
        """After an exception inside a compiled graph: forget the copies of the failed call."""
        if self.is_cuda:
            self.streams.d2h.synchronize()
            self.streams.h2d.synchronize()
        self._offloading.clear()
        self._reloading.clear()
        self._deferred.clear()
        self._region = None


_SWAPPERS: dict[torch.device, Swapper] = {}


def swapper(device: torch.device) -> Swapper:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SWAPPERS:
        _SWAPPERS[device] = Swapper(device)
    return _SWAPPERS[device]


def region_begins(index: int | None) -> None:
    """See :meth:`Swapper.region_begins` (every device's swapper)."""
    for s in _SWAPPERS.values():
        s.region_begins(index)


def reset_all() -> None:
    for s in _SWAPPERS.values():
        s.reset()


def swapped_strides(x) -> tuple:
    """The strides a swapped copy of ``x`` keeps (on the host and back): ``x``'s own where its
    elements fill its extent densely (a transposed or permuted saved activation, whose backward may
    view it as only those strides allow), else contiguous ones."""
    shape, stride = tuple(x.shape), tuple(x.stride())
    contiguous, n = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        contiguous[d] = n
        n *= shape[d] if isinstance(shape[d], int) else 1
    if not all(isinstance(v, int) for v in shape + stride):  # symbolic: no guards on them
        return tuple(contiguous)
    expect = 1  # dense: the dimensions, by stride, each spanning what the smaller ones fill
    for d in sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: stride[d]):
        if stride[d] != expect:
            return tuple(contiguous)
        expect *= shape[d]
    return stride
