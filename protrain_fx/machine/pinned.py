"""Pinned host memory: the host tensors that chunks, gradients and swapped activations live in.

Long-lived chunk memory is exact-size (torch's pinned allocator told not to round large blocks up to
a power of two, or, where it cannot be told, page-aligned anonymous memory registered with CUDA);
short-lived copies (swapped activations) come from torch's caching host allocator, which reuses a
block once the copies that used it are done. On a machine without CUDA the same calls give ordinary
host tensors.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import weakref

import torch

from protrain_fx import config
from protrain_fx.errors import ProtrainError

log = logging.getLogger(__name__)


def release_cached_pinned_memory() -> None:
    """Hand the pinned blocks torch's caching host allocator keeps after they are freed back to the
    OS (it would otherwise hold them, pinned, for the life of the process, and a new block of
    another size does not reuse them). Without CUDA, or before it is initialized, nothing is cached:
    no-op."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    # private; in torch 2.11 and 2.13
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if host_empty_cache is not None:
        try:
            host_empty_cache()
        except RuntimeError as e:  # pragma: no cover - best effort
            log.debug("protrain: _host_emptyCache failed: %s", e)


PINNED_EXACT_ABOVE_MB = 64

# whether large pinned blocks are exact-size and uncached (checked once)
_pinned_exact: bool | None = None


def exact_pinned_blocks() -> bool:
    """Make torch's pinned-memory allocator give blocks over 64 MiB their exact size and free them
    when released, instead of rounding each up to a power of two (a 1.2 GiB chunk would pin 2 GiB)
    and caching it. Set once per process through the allocator settings
    (``pinned_max_round_threshold_mb`` and ``pinned_max_cached_size_mb``) unless the user's
    ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF`` names them, and checked by allocating one
    such block. Returns whether large blocks are exact-size; False also where this torch has no such
    settings (its pinned blocks are then rounded up)."""
    global _pinned_exact
    if _pinned_exact is not None:
        return _pinned_exact
    _pinned_exact = False
    mb = PINNED_EXACT_ABOVE_MB
    try:
        user = config.settings().pytorch_alloc_conf
        if "pinned_max_round_threshold" not in user:
            torch._C._accelerator_setAllocatorSettings(  # private; in torch 2.11 and 2.13
                f"pinned_max_round_threshold_mb:{mb},pinned_max_cached_size_mb:{mb}"
            )
        n = (mb + 1) << 20  # rounded up, this would take 128 MiB
        before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
        probe = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        grew = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
        del probe
        _pinned_exact = 0 < grew < 2 * n - (4 << 20)
    # torch 2.11: "Unrecognized key"
    except (AttributeError, RuntimeError, KeyError, ValueError) as e:
        log.debug("protrain: could not check the pinned allocator's rounding: %s", e)
    if not _pinned_exact:
        log.info(
            "protrain: this torch's pinned allocator rounds blocks up to a power of two; "
            "blocks over %d MiB "
            "are pinned in place instead (registered_host_empty)",
            mb,
        )
    return _pinned_exact


class _RegisteredHostMemory(mmap.mmap):
    """Anonymous host memory page-locked with ``cudaHostRegister`` (exact size, outside torch's
    caching host allocator): unregistered, after the device has finished with it, when the last
    tensor over it is freed, then unmapped."""

    registered = False

    def __del__(self):
        if self.registered:
            try:
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()  # no copy may still be reading or writing it
                _host_unregister(self.address)
            except Exception as e:  # pragma: no cover - interpreter shutdown
                log.debug("protrain: cudaHostUnregister failed: %s", e)


def _host_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise ProtrainError(
            f"protrain: cudaHostRegister of {nbytes / 2**20:.0f} MiB of host "
            "memory failed "
            f"(CUDA error {int(err)}): the host's page-locked memory limit may be "
            "too low"
        )


def _host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


# fault a block's pages in with torch's CPU threads (a parallel ``zero_``) before registering it:
# registration faults them in one thread otherwise (benchmarks/pinning_probe.py measures both)
PREFAULT = True


def registered_host_empty(
    numel: int, dtype: torch.dtype, prefault: bool | None = None
) -> torch.Tensor:
    """A pinned host tensor of exactly ``numel`` elements (zeros where ``prefault``, else
    uninitialized): anonymous memory page-locked with ``cudaHostRegister``. For chunk-sized blocks
    where torch's pinned allocator cannot be made exact-size (:func:`exact_pinned_blocks`; torch
    2.11 has no such setting): it would pin a 1025 MiB chunk as 2 GiB. The tensor owns the memory
    (through the buffer it was made from): freed, unregistered and unmapped with its last view.
    ``prefault`` (default :data:`PREFAULT`) touches its pages with every intra-op thread first, so
    that the registration finds them present."""
    if not numel:
        return torch.empty(0, dtype=dtype)
    out, mem = anonymous_host_empty(numel, dtype, PREFAULT if prefault is None else prefault)
    _host_register(mem.address, numel * dtype.itemsize)
    mem.registered = True
    return out


def anonymous_host_empty(numel: int, dtype: torch.dtype, prefault: bool):
    """``(tensor, memory)``: ``numel`` elements of anonymous host memory on 2 MiB pages, not yet
    registered (:func:`registered_host_empty` registers it); its pages faulted in by a parallel
    ``zero_`` where ``prefault``."""
    mem = _RegisteredHostMemory(
        -1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    # 2 MiB pages: the registration faults them in faster (on the
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # 2-core dev VM a first touch took 1.1-1.4 s per 2 GiB with them, 2.0-2.8 s without)
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(mem, dtype=dtype, count=numel)
    mem.address = out.data_ptr()
    if prefault:
        out.view(torch.uint8).zero_()
    return out, mem


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor of ``numel`` elements, pinned when ``pin`` (:func:`pinned_empty`). Every buffer
    protrain keeps in host memory comes from here, and is counted (:func:`held_bytes`) until the
    tensor returned is freed."""
    return _counted(pinned_empty(numel, dtype) if pin else torch.empty(numel, dtype=dtype))


# bytes of the host buffers from host_empty alive now, the most alive at once, and all ever
# allocated (process-wide); the worker thread allocates gradient accumulators too
_HELD = [0, 0, 0]
_HELD_LOCK = threading.Lock()


def _counted(t: torch.Tensor) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    if nbytes:
        with _HELD_LOCK:
            _HELD[0] += nbytes
            _HELD[1] = max(_HELD[1], _HELD[0])
            _HELD[2] += nbytes
        weakref.finalize(t, _release_held, nbytes)
    return t


def _release_held(nbytes: int) -> None:
    with _HELD_LOCK:
        _HELD[0] -= nbytes


def held_bytes() -> tuple[int, int]:
    """``(now, peak)``: bytes of the host buffers protrain holds (every :func:`host_empty` tensor
    alive) in this process, and the most it has held at once: the measured side of the plan's
    predicted host bytes."""
    with _HELD_LOCK:
        return _HELD[0], _HELD[1]


def allocated_bytes() -> int:
    """Bytes of host buffers protrain has allocated in this process so far, never lowered by a
    free: two readings differ by what was allocated in between, whatever other buffers (a collected
    graph's) were freed meanwhile."""
    with _HELD_LOCK:
        return _HELD[2]


def reset_held_peak() -> None:
    """Start :func:`held_bytes`' peak again from what is held now."""
    with _HELD_LOCK:
        _HELD[1] = _HELD[0]


def resident_bytes() -> tuple[int | None, int | None]:
    """``(now, peak)`` of this process's resident memory (``VmRSS``, ``VmHWM``), or ``None`` where
    /proc does not say (not Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024  # kB
    except OSError:
        pass
    return out.get("VmRSS"), out.get("VmHWM")


def cached_host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor for short-lived copies (swapped activations): from torch's caching host
    allocator when ``pin``, which reuses a freed block once the copies that used it are done.
    Counted (:func:`held_bytes`) while alive."""
    return _counted(torch.empty(shape, dtype=dtype, pin_memory=pin))


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A pinned host tensor of ``numel`` elements that takes its size in host memory, not the next
    power of two: torch's allocator where :func:`exact_pinned_blocks` makes it exact (or the block
    is small), else :func:`registered_host_empty`."""
    if exact_pinned_blocks() or numel * dtype.itemsize <= PINNED_EXACT_ABOVE_MB << 20:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    return registered_host_empty(numel, dtype)


@contextlib.contextmanager
def no_dispatch_modes():
    """Real tensors even when called under a fake/functional/proxy mode (e.g. from the backend)."""
    try:
        from torch.utils._python_dispatch import (
            _disable_current_modes,  # private; 2.11 and 2.13
        )
    except ImportError:  # pragma: no cover
        yield
        return
    with _disable_current_modes():
        yield
