"""Hardware profile: what the machine can move and compute, for the cost model and the plan search.

Measured (quickly: about 0.6 s on a 2-core CPU box; meant to stay under ~3 s on an H200 machine):

- **copy bandwidth** between pinned host memory and the device: host->device alone, device->host alone, and
  both at once (total bytes over the time until both are done). On CUDA: ``COPY_BYTES`` (256 MiB) uint8
  buffers, pinned with ``torch.empty(..., pin_memory=True)`` (the allocator the chunk store and swap pool
  use), one warm-up, the median of a few timed repetitions, timed with CUDA events on two dedicated streams
  so the duplex copies really run concurrently (each on its own copy engine). On a CPU device the same copies are
  real host memcpys (duplex: two threads).
- **AdamW throughput** in parameters per second over one flat fp32 tensor with fp32 gradients and moments:
  on the CPU the step ``optim.py`` runs for an offloaded chunk (``cpu_adam``'s one pass that also writes the
  bf16 transfer copy, or torch's fused AdamW and a copy where the kernel does not build; timed with
  ``perf_counter``), on the device torch's fused AdamW (``torch.optim.adam.adam(..., fused=True)``, what
  resident chunks pay, timed with events; on a CPU device the CPU number).
- **memory**: device total and free (``torch.cuda.mem_get_info``, cross-checked against pynvml when it
  loads), host total and available (``/proc/meminfo`` ``MemAvailable``, capped by the process's cgroup
  memory limit), and ``RLIMIT_MEMLOCK``.

Why cached: bandwidths and optimizer rates belong to the machine, not the model, and re-measuring them on
every compile would cost seconds and disturb a device that may already be busy. The profile is stored as
JSON, one file per key (device name, torch version, host name, CPU model, usable cores, torch threads),
under ``cache_dir``, else ``$PROTRAIN_CACHE_DIR/hardware``, else ``~/.cache/protrain_fx/hardware``
(``$XDG_CACHE_HOME`` respected). ``refresh=True`` or ``PROTRAIN_REFRESH_HARDWARE=1`` re-measures; a corrupt
file, another schema or another key is re-measured and overwritten, never an error. Writes are atomic
(temporary file + ``os.replace``) and, where ``fcntl`` exists, processes measuring the same key take turns
(a second rank waits and then reads the first one's file instead of measuring while the first one copies).

The memory numbers in a profile are a snapshot of when it was measured, kept for information only: budgets
must use :func:`current_memory`, which reads live values and is never cached.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import mmap
import os
import platform
import re
import socket
import statistics
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from .options import ProtrainError, parse_bytes

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: the CPU rate is that of the step optim.py runs (one-pass kernel or torch + copy)
MiB = 1 << 20

# measurement sizes (scaled down when memory is short)
COPY_BYTES = 256 * MiB          # per copy on CUDA
CPU_COPY_BYTES = 64 * MiB       # per copy on a CPU device
GPU_ADAM_NUMEL = 64 * MiB       # 64 M parameters: 1 GiB of param + grad + 2 moments
CPU_ADAM_NUMEL_MANY = 32 * MiB  # >= 8 usable cores
CPU_ADAM_NUMEL_FEW = 16 * MiB
COPY_REPS = 3
GPU_ADAM_BATCHES, GPU_ADAM_STEPS = 3, 5
GPU_SLEEP_CYCLES = 10_000_000  # a few milliseconds of device-side sleep ahead of each timed Adam batch
CPU_ADAM_TARGET_S = 0.3         # time the timed CPU Adam steps may take, at least 3 and at most 10 steps

ENV_CACHE_DIR = "PROTRAIN_CACHE_DIR"
ENV_REFRESH = "PROTRAIN_REFRESH_HARDWARE"

_UNLIMITED = 1 << 60            # cgroup "no limit" values are near 2**63


@dataclass(frozen=True)
class HardwareProfile:
    """One machine's measured rates and memory (see the module docstring). Rates are per second; bytes are
    bytes. Fields after ``measured_at`` are extras with defaults, so a synthetic profile (cost-model tests)
    needs only the first ones.

    ``pinned_limit_bytes`` is a cap on pinned host memory beyond host RAM, None when there is none known (so
    far always: torch pins through the CUDA driver, which does not charge ``RLIMIT_MEMLOCK``; the rlimit is
    kept in ``memlock_limit_bytes`` for information). Host RAM, live, comes from :func:`current_memory`."""

    key: str
    device: str
    device_name: str
    torch_version: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    cpu_adam_params_per_s: float
    gpu_adam_params_per_s: float
    device_total_bytes: int
    device_free_bytes: int
    host_total_bytes: int
    host_available_bytes: int
    pinned_limit_bytes: int | None
    measured_at: str
    # extras
    hostname: str = ""
    cpu_model: str = ""
    cpu_cores: int = 0                      # usable cores (sched_getaffinity)
    cpu_threads: int = 0                    # torch.get_num_threads() when measured
    memlock_limit_bytes: int | None = None  # RLIMIT_MEMLOCK soft limit if finite (informative, see below)
    nvml_total_bytes: int | None = None     # pynvml's view of the device, None without pynvml / on CPU
    nvml_free_bytes: int | None = None
    copy_bytes: int = 0                     # bytes per copy in the bandwidth measurement
    cpu_adam_numel: int = 0
    gpu_adam_numel: int = 0
    measure_seconds: float = 0.0
    cpu_adam_kind: str = ""  # which CPU step cpu_adam_params_per_s timed

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["schema"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d) -> HardwareProfile:
        """Inverse of :meth:`to_dict`. Raises ``ValueError`` on another schema, a missing field, a value of
        the wrong type or a rate that is not positive and finite; unknown keys are ignored."""
        if not isinstance(d, dict):
            raise ValueError(f"hardware profile must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"hardware profile schema {d.get('schema')!r}, expected {SCHEMA_VERSION}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"hardware profile lacks {f.name!r}")
                continue
            kwargs[f.name] = _coerce(f.name, f.type, d[f.name])
        profile = cls(**kwargs)
        profile._validate()
        return profile

    def _validate(self) -> None:
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_bytes_per_s", "cpu_adam_params_per_s",
                     "gpu_adam_params_per_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"hardware profile {name}={v!r} is not a positive finite rate")
        for name in ("device_total_bytes", "device_free_bytes", "host_total_bytes", "host_available_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware profile {name} is negative")

    def summary(self) -> str:
        G = 1e9
        return (f"{self.device} ({self.device_name}), torch {self.torch_version}: "
                f"h2d {self.h2d_bytes_per_s / G:.1f} GB/s, d2h {self.d2h_bytes_per_s / G:.1f} GB/s, "
                f"both {self.duplex_bytes_per_s / G:.1f} GB/s; AdamW cpu {self.cpu_adam_params_per_s / G:.2f} "
                f"G params/s, device {self.gpu_adam_params_per_s / G:.2f} G params/s; device "
                f"{self.device_free_bytes / 2**30:.1f}/{self.device_total_bytes / 2**30:.1f} GiB free, host "
                f"{self.host_available_bytes / 2**30:.1f}/{self.host_total_bytes / 2**30:.1f} GiB available")


def _coerce(name: str, annotation: str, value):
    kind = str(annotation).replace(" ", "")
    if value is None and kind.endswith("|None"):
        return None
    if kind.startswith("str"):
        if not isinstance(value, str):
            raise ValueError(f"hardware profile {name} must be a string")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"hardware profile {name} must be a number, got {value!r}")
    if kind.startswith("int"):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"hardware profile {name} must be an integer, got {value!r}")
        return int(value)
    return float(value)


# ------------------------------------------------------------------------------------ public entry points
def hardware_profile(device: str | torch.device | None = None, *, refresh: bool = False,
                     cache_dir: str | None = None) -> HardwareProfile:
    """The hardware profile of ``device`` (default: the current CUDA device, else the CPU), from the cache
    when there is a valid one, else measured (:func:`measure_hardware`) and stored."""
    dev = resolve_device(device)
    key = profile_key(dev)
    path = cache_path(key, cache_dir)
    refresh = refresh or os.environ.get(ENV_REFRESH, "").strip().lower() not in ("", "0", "false", "no")
    if not refresh:
        cached = _load(path, key)
        if cached is not None:
            return _for_device(cached, dev)
    with _key_lock(path):
        if not refresh:  # another process may have measured while we waited for the lock
            cached = _load(path, key)
            if cached is not None:
                return _for_device(cached, dev)
        log.info("protrain: measuring the hardware profile of %s (cache: %s)", dev, path)
        profile = measure_hardware(dev)
        _store(path, profile)
    log.info("protrain: %s", profile.summary())
    return profile


def current_memory(device: str | torch.device | None = None, *, include_allocator_cache: bool = False
                   ) -> tuple[int, int, int, int]:
    """Live ``(device_free, device_total, host_available, host_total)`` in bytes, never cached.

    ``device_free`` is the driver's free memory (``torch.cuda.mem_get_info``); memory that this process's
    caching allocator reserved but does not use counts as used, unless ``include_allocator_cache`` adds it
    (``memory_reserved - memory_allocated``: reusable by this process, though maybe fragmented). On a CPU
    device the device numbers are the host's."""
    dev = resolve_device(device)
    host_available, host_total = host_memory()
    if dev.type != "cuda":
        return host_available, host_total, host_available, host_total
    free, total = torch.cuda.mem_get_info(dev)
    if include_allocator_cache:
        free += max(0, torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    return int(free), int(total), host_available, host_total


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None`` -> the current CUDA device if there is one, else the CPU; ``"cuda"`` -> ``cuda:<current>``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ProtrainError(f"protrain hardware profile: unsupported device {dev} (cuda or cpu)")
    if not torch.cuda.is_available():
        raise ProtrainError(f"protrain hardware profile: {dev} requested but CUDA is not available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    return torch.device("cuda", index)


def profile_key(device: str | torch.device | None = None) -> str:
    """The cache key: device name, torch version, host name, CPU model, usable cores and torch threads
    (the CPU Adam rate depends on the last two). Devices of the same name on one host share a profile."""
    dev = resolve_device(device)
    return (f"device={dev.type}:{_device_name(dev)}|torch={torch.__version__}|host={socket.gethostname()}"
            f"|cpu={_cpu_model()}|cores={_usable_cores()}|threads={torch.get_num_threads()}")


def cache_root() -> str:
    """Where protrain keeps what it measures or builds per machine (this profile, the CPU Adam kernel)."""
    root = os.environ.get(ENV_CACHE_DIR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "protrain_fx")
    return root


def cache_dir_default() -> str:
    return os.path.join(cache_root(), "hardware")


def cache_path(key: str, cache_dir: str | None = None) -> str:
    """``<dir>/<readable part of the key>-<hash of the key>.json``."""
    name = key.split("|")[0].removeprefix("device=")
    torch_part = next((p for p in key.split("|") if p.startswith("torch=")), "")
    slug = re.sub(r"[^A-Za-z0-9.+]+", "_", f"{name}-{torch_part.removeprefix('torch=')}").strip("_")[:80]
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir or cache_dir_default(), f"{slug}-{digest}.json")


# ------------------------------------------------------------------------------------------- measurement
def measure_hardware(device: str | torch.device | None = None) -> HardwareProfile:
    """Measure everything now (no cache). Runs outside any fake/functional tensor mode, so it may be called
    from inside the backend."""
    dev = resolve_device(device)
    t0 = time.perf_counter()
    with _no_dispatch_modes(), torch.no_grad():
        host_available, host_total = host_memory()
        nvml_total = nvml_free = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            dev_free, dev_total = (int(x) for x in torch.cuda.mem_get_info(dev))
            nvml_total, nvml_free = _nvml_memory(dev, dev_total)
            (h2d, d2h, duplex, copy_bytes), (gpu_adam, gpu_numel) = _measure_cuda(dev, dev_free, host_available)
        else:
            dev_free, dev_total = host_available, host_total
            copy_bytes = _fit(CPU_COPY_BYTES, host_available // 8, MiB)
            h2d, d2h, duplex = _measure_cpu_copies(copy_bytes)
            gpu_adam = gpu_numel = None
        cpu_numel = _fit(CPU_ADAM_NUMEL_MANY if _usable_cores() >= 8 else CPU_ADAM_NUMEL_FEW,
                         host_available // (4 * 4 * 4), MiB)  # at most a quarter of the available RAM
        cpu_adam = _measure_cpu_adam(cpu_numel)
    memlock = _memlock_limit()
    profile = HardwareProfile(
        key=profile_key(dev),
        device=str(dev),
        device_name=_device_name(dev),
        torch_version=torch.__version__,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        duplex_bytes_per_s=duplex,
        cpu_adam_params_per_s=cpu_adam,
        gpu_adam_params_per_s=cpu_adam if gpu_adam is None else gpu_adam,
        device_total_bytes=dev_total,
        device_free_bytes=dev_free,
        host_total_bytes=host_total,
        host_available_bytes=host_available,
        # torch's pinned memory (cudaHostAlloc) is pinned by the NVIDIA driver, which does not charge it to
        # RLIMIT_MEMLOCK (a 64 KiB docker default would otherwise forbid any offload): no known cap beyond
        # host RAM, so None; the rlimit itself is kept in memlock_limit_bytes
        pinned_limit_bytes=None,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hostname=socket.gethostname(),
        cpu_model=_cpu_model(),
        cpu_cores=_usable_cores(),
        cpu_threads=torch.get_num_threads(),
        memlock_limit_bytes=memlock,
        nvml_total_bytes=nvml_total,
        nvml_free_bytes=nvml_free,
        copy_bytes=copy_bytes,
        cpu_adam_numel=cpu_numel,
        cpu_adam_kind=cpu_adam_kind(),
        gpu_adam_numel=cpu_numel if gpu_numel is None else gpu_numel,
        measure_seconds=round(time.perf_counter() - t0, 3),
    )
    profile._validate()
    return profile


def _fit(target: int, limit: int, floor: int) -> int:
    """``target`` scaled down to ``limit`` (never below ``floor``), a multiple of ``floor``."""
    return max(floor, min(target, limit) // floor * floor)


def _measure_cuda(dev: torch.device, free: int, host_available: int):
    """Copies and device Adam, sized to a quarter of the free device (and available host) memory at most; on
    an out-of-memory error (memory taken meanwhile) retried once at an eighth of the size."""
    copy_bytes = _fit(COPY_BYTES, min(free, host_available) // 8, MiB)  # two device and two pinned buffers
    numel = _fit(GPU_ADAM_NUMEL, free // (4 * 4 * 4), MiB)  # four fp32 tensors
    for attempt in range(2):
        try:
            return _measure_cuda_copies(dev, copy_bytes), (_measure_gpu_adam(dev, numel), numel)
        except torch.cuda.OutOfMemoryError:
            if attempt:
                raise
            log.warning("protrain hardware profile: out of device memory, measuring with smaller buffers")
            copy_bytes, numel = _fit(copy_bytes // 8, copy_bytes, MiB), _fit(numel // 8, numel, MiB)
        finally:
            _release_cuda_memory(dev)


def _measure_cuda_copies(dev: torch.device, nbytes: int) -> tuple[float, float, float, int]:
    """h2d, d2h (each alone) and duplex (both at once, total) bytes/s between pinned host and ``dev``.

    Every copy runs on a dedicated stream: h2d on ``up``, d2h on ``down``. Each timed copy is bracketed by
    events on its own stream; for the duplex case both streams wait for one start event (recorded on the
    current stream after everything before it is done) and the time runs to the later of the two end events
    (events on different streams of one device can be compared)."""
    with torch.cuda.device(dev):
        host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dev_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        host_src.fill_(1)
        dev_src.fill_(2)
        up, down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        current = torch.cuda.current_stream(dev)
        up.wait_stream(current)  # the fills above ran on the current stream
        down.wait_stream(current)

        def h2d(stream):
            with torch.cuda.stream(stream):
                dev_dst.copy_(host_src, non_blocking=True)

        def d2h(stream):
            with torch.cuda.stream(stream):
                host_dst.copy_(dev_src, non_blocking=True)

        def alone(copy, stream) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            copy(stream)
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        def both() -> float:
            start = torch.cuda.Event(enable_timing=True)
            ends = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            start.record(current)
            for copy, stream, end in ((h2d, up, ends[0]), (d2h, down, ends[1])):
                stream.wait_event(start)
                copy(stream)
                end.record(stream)
            for end in ends:
                end.synchronize()
            return max(start.elapsed_time(end) for end in ends) / 1e3

        alone(h2d, up)  # warm-up: first-touch mappings, copy-engine start
        alone(d2h, down)
        both()
        t_h2d = statistics.median(alone(h2d, up) for _ in range(COPY_REPS))
        t_d2h = statistics.median(alone(d2h, down) for _ in range(COPY_REPS))
        t_both = statistics.median(both() for _ in range(COPY_REPS))
        torch.cuda.synchronize(dev)  # nothing in flight when the buffers go (on return; then released)
    tiny = 1e-9
    return nbytes / max(t_h2d, tiny), nbytes / max(t_d2h, tiny), 2 * nbytes / max(t_both, tiny), nbytes


def _adam_tensors(numel: int, device) -> tuple[list, list, list, list, list]:
    # initialized values (no denormals or NaNs from uninitialized memory, which can slow a CPU down)
    p = torch.full((numel,), 0.5, dtype=torch.float32, device=device)
    g = torch.full((numel,), 1e-3, dtype=torch.float32, device=device)
    m = torch.zeros(numel, dtype=torch.float32, device=device)
    v = torch.zeros(numel, dtype=torch.float32, device=device)
    step = torch.zeros((), dtype=torch.float32, device=device)  # fused Adam keeps steps on the params' device
    return [p], [g], [m], [v], [step]


def _adam_step(tensors) -> None:
    from torch.optim.adam import adam

    params, grads, m, v, steps = tensors
    adam(params, grads, m, v, [], steps, foreach=False, fused=True, decoupled_weight_decay=True,
         amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-4, weight_decay=0.01, eps=1e-8, maximize=False)


def cpu_adam_kind() -> str:
    from . import cpu_adam

    return "one-pass kernel + bf16 copy" if cpu_adam.available() else "torch fused + bf16 copy"


def _measure_cpu_adam(numel: int) -> float:
    """The CPU step of an offloaded chunk as optim.py runs it: AdamW over the flat chunk and its bf16
    transfer copy (protrain_fx.cpu_adam's one pass where it builds, else torch's fused Adam then a copy)."""
    from . import cpu_adam

    tensors = _adam_tensors(numel, "cpu")
    out = torch.empty(numel, dtype=torch.bfloat16)
    if cpu_adam.available():
        def step():
            (p,), (g,), (m,), (v,), _ = tensors
            cpu_adam.adam_step(p, g, m, v, out, 1.0, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                               decoupled=True, maximize=False)
    else:
        def step():
            _adam_step(tensors)
            out.copy_(tensors[0][0])
    t0 = time.perf_counter()
    step()  # warm-up
    warm = time.perf_counter() - t0
    reps = max(3, min(10, int(CPU_ADAM_TARGET_S / max(warm, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    # the fastest repetition: what the host can do; a busy moment (another process compiling) only slows some
    return numel / max(min(times), 1e-9)


def _measure_gpu_adam(dev: torch.device, numel: int) -> float:
    """Batches of ``GPU_ADAM_STEPS`` steps between two events, median over batches. Each batch is queued
    behind a short device-side sleep, so the steps run back to back however slowly the host launches them
    (a step of 64 M parameters is about half a millisecond on an H200)."""
    sleep = getattr(torch.cuda, "_sleep", None)  # private (torch's own tests use it); optional
    with torch.cuda.device(dev):
        tensors = _adam_tensors(numel, dev)
        stream = torch.cuda.current_stream(dev)
        _adam_step(tensors)  # warm-up
        _adam_step(tensors)
        times = []
        for _ in range(GPU_ADAM_BATCHES):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep is not None:
                sleep(GPU_SLEEP_CYCLES)
            start.record(stream)
            for _ in range(GPU_ADAM_STEPS):
                _adam_step(tensors)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / GPU_ADAM_STEPS)
        torch.cuda.synchronize(dev)
    return numel / max(statistics.median(times), 1e-9)


def _measure_cpu_copies(nbytes: int) -> tuple[float, float, float]:
    """On a CPU device "host" and "device" are both host memory: real copies; duplex runs the two copies in
    two threads at once (``copy_`` releases the GIL)."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    c = torch.ones(nbytes, dtype=torch.uint8)
    d = torch.zeros(nbytes, dtype=torch.uint8)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def both() -> float:
        barrier = threading.Barrier(2)

        def other():
            barrier.wait()
            d.copy_(c)

        worker = threading.Thread(target=other, daemon=True)
        worker.start()
        barrier.wait()
        t0 = time.perf_counter()
        b.copy_(a)
        worker.join()
        return time.perf_counter() - t0

    timed(lambda: b.copy_(a))  # warm-up (first touch of the destinations)
    timed(lambda: d.copy_(c))
    t_h2d = statistics.median(timed(lambda: b.copy_(a)) for _ in range(COPY_REPS))
    t_d2h = statistics.median(timed(lambda: d.copy_(c)) for _ in range(COPY_REPS))
    t_both = statistics.median(both() for _ in range(COPY_REPS))
    tiny = 1e-9
    return nbytes / max(t_h2d, tiny), nbytes / max(t_d2h, tiny), 2 * nbytes / max(t_both, tiny)


def _release_cuda_memory(dev: torch.device) -> None:
    """Give the measurement's buffers back: device blocks to the driver (``empty_cache`` frees only unused
    cached blocks) and pinned blocks to the OS (torch's caching host allocator would otherwise keep them
    pinned for the life of the process)."""
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    release_cached_pinned_memory()


def release_cached_pinned_memory() -> None:
    """Hand the pinned blocks torch's caching host allocator keeps after they are freed back to the OS (it
    would otherwise hold them, pinned, for the life of the process, and a new block of another size does not
    reuse them). Without CUDA, or before it is initialized, nothing is cached: no-op."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # private; in torch 2.11 and 2.13
    if host_empty_cache is not None:
        try:
            host_empty_cache()
        except RuntimeError as e:  # pragma: no cover - best effort
            log.debug("protrain: _host_emptyCache failed: %s", e)


PINNED_EXACT_ABOVE_MB = 64
_pinned_exact: bool | None = None  # whether large pinned blocks are exact-size and uncached (checked once)


def exact_pinned_blocks() -> bool:
    """Make torch's pinned-memory allocator give blocks over 64 MiB their exact size and free them when
    released, instead of rounding each up to a power of two (a 1.2 GiB chunk would pin 2 GiB) and caching it.
    Set once per process through the allocator settings (``pinned_max_round_threshold_mb`` and
    ``pinned_max_cached_size_mb``) unless the user's ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF``
    names them, and checked by allocating one such block. Returns whether large blocks are exact-size; False
    also where this torch has no such settings (its pinned blocks are then rounded up)."""
    global _pinned_exact
    if _pinned_exact is not None:
        return _pinned_exact
    _pinned_exact = False
    mb = PINNED_EXACT_ABOVE_MB
    try:
        user = os.environ.get("PYTORCH_ALLOC_CONF", "") + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "pinned_max_round_threshold" not in user:
            torch._C._accelerator_setAllocatorSettings(  # private; in torch 2.11 and 2.13
                f"pinned_max_round_threshold_mb:{mb},pinned_max_cached_size_mb:{mb}")
        n = (mb + 1) << 20  # rounded up, this would take 128 MiB
        before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
        probe = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        grew = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
        del probe
        _pinned_exact = 0 < grew < 2 * n - (4 << 20)
    except (AttributeError, RuntimeError, KeyError, ValueError) as e:  # torch 2.11: "Unrecognized key"
        log.debug("protrain: could not check the pinned allocator's rounding: %s", e)
    if not _pinned_exact:
        log.info("protrain: this torch's pinned allocator rounds blocks up to a power of two; blocks over %d MiB "
                 "are pinned in place instead (registered_host_empty)", mb)
    return _pinned_exact


class _RegisteredHostMemory(mmap.mmap):
    """Anonymous host memory page-locked with ``cudaHostRegister`` (exact size, outside torch's caching host
    allocator): unregistered, after the device has finished with it, when the last tensor over it is freed,
    then unmapped."""

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
        raise ProtrainError(f"protrain: cudaHostRegister of {nbytes / 2**20:.0f} MiB of host memory failed "
                            f"(CUDA error {int(err)}): the host's page-locked memory limit may be too low")


def _host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def registered_host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized pinned host tensor of exactly ``numel`` elements: anonymous memory page-locked with
    ``cudaHostRegister``. For chunk-sized blocks where torch's pinned allocator cannot be made exact-size
    (:func:`exact_pinned_blocks`; torch 2.11 has no such setting): it would pin a 1025 MiB chunk as 2 GiB.
    The tensor owns the memory (through the buffer it was made from): freed, unregistered and unmapped with
    its last view."""
    if not numel:
        return torch.empty(0, dtype=dtype)
    nbytes = numel * dtype.itemsize
    mem = _RegisteredHostMemory(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages: the registration faults them in faster (on the
        # 2-core dev VM a first touch took 1.1-1.4 s per 2 GiB with them, 2.0-2.8 s without)
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(mem, dtype=dtype, count=numel)
    mem.address = out.data_ptr()
    _host_register(mem.address, nbytes)
    mem.registered = True
    return out


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor of ``numel`` elements, pinned when ``pin`` (:func:`pinned_empty`). Every buffer protrain
    keeps in host memory comes from here."""
    return pinned_empty(numel, dtype) if pin else torch.empty(numel, dtype=dtype)


def cached_host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor for short-lived copies (swapped activations): from torch's caching host allocator when
    ``pin``, which reuses a freed block once the copies that used it are done."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A pinned host tensor of ``numel`` elements that takes its size in host memory, not the next power of
    two: torch's allocator where :func:`exact_pinned_blocks` makes it exact (or the block is small), else
    :func:`registered_host_empty`."""
    if exact_pinned_blocks() or numel * dtype.itemsize <= PINNED_EXACT_ABOVE_MB << 20:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    return registered_host_empty(numel, dtype)


@contextlib.contextmanager
def _no_dispatch_modes():
    """Real tensors even when called under a fake/functional/proxy mode (e.g. from the backend)."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes  # private; 2.11 and 2.13
    except ImportError:  # pragma: no cover
        yield
        return
    with _disable_current_modes():
        yield


# ------------------------------------------------------------------------------------------ machine facts
def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return _cpu_model()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        for field in ("model name", "Model", "Hardware", "cpu model", "CPU part"):
            m = re.search(rf"^{field}\s*:\s*(.+)$", info, re.MULTILINE)
            if m and m.group(1).strip():
                return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _memlock_limit() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, AttributeError, ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def host_memory() -> tuple[int, int]:
    """Live ``(available, total)`` host RAM in bytes: ``/proc/meminfo`` ``MemAvailable``/``MemTotal``, capped
    by the memory limits of this process's cgroup and its ancestors (a container's limit is what pinned
    pools run into); elsewhere ``psutil`` if it is installed, else ``sysconf``.

    ``$PROTRAIN_HOST_MEMORY`` (bytes, or with a unit: ``240GiB``, ``256GB``) states the total instead, for
    virtual machines whose ``MemTotal`` starts small and grows as memory is touched (a ballooned guest);
    available is then that total less what is in use now."""
    meminfo = _read_meminfo()
    if meminfo is not None:
        available, total = meminfo
    else:
        available, total = _portable_host_memory()
    stated = os.environ.get("PROTRAIN_HOST_MEMORY")
    if stated:
        in_use = max(0, total - available)
        total = parse_bytes(stated.strip(), what="PROTRAIN_HOST_MEMORY")
        available = max(0, total - in_use)
    cg = _cgroup_memory()
    if cg is not None:
        cg_available, cg_limit = cg
        total = min(total, cg_limit)
        available = min(available, cg_available)
    return max(0, int(available)), max(0, int(total))


def _read_meminfo() -> tuple[int, int] | None:
    try:
        with open("/proc/meminfo") as f:
            fields = {}
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except (OSError, ValueError):
        return None
    if "MemTotal" not in fields:
        return None
    available = fields.get("MemAvailable")
    if available is None:  # kernels before 3.14
        available = fields.get("MemFree", 0) + fields.get("Buffers", 0) + fields.get("Cached", 0)
    return available, fields["MemTotal"]


def _portable_host_memory() -> tuple[int, int]:
    try:
        import psutil  # optional, not a dependency

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        try:
            available = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            available = total
        return available, total
    except (ValueError, OSError, AttributeError):
        return 0, 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: str, names: tuple[str, ...]) -> int:
    try:
        with open(path) as f:
            stats = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
    except (OSError, ValueError):
        return 0
    for name in names:
        if name in stats:
            try:
                return int(stats[name])
            except ValueError:
                return 0
    return 0


def _cgroup_memory() -> tuple[int, int] | None:
    """``(available, limit)`` under the tightest finite cgroup memory limit on the way from this process's
    cgroup to the root (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); available = limit - (usage -
    inactive file cache, which the kernel reclaims). None when no finite limit is found."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []  # (folder, limit file, usage file, stat names)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2
            candidates.append(("/sys/fs/cgroup", rel, "memory.max", "memory.current", ("inactive_file",)))
        elif "memory" in controllers.split(","):  # v1
            candidates.append(("/sys/fs/cgroup/memory", rel, "memory.limit_in_bytes", "memory.usage_in_bytes",
                               ("total_inactive_file", "inactive_file")))
    best = None
    seen = set()
    for mount, rel, limit_file, usage_file, stat_names in candidates:
        rel = rel.strip("/")
        while True:  # the process's cgroup, then its ancestors (only the ones visible in this namespace)
            folder = os.path.join(mount, rel) if rel else mount
            if folder not in seen:
                seen.add(folder)
                limit = _read_int(os.path.join(folder, limit_file))
                if limit is not None and 0 < limit < _UNLIMITED:
                    usage = _read_int(os.path.join(folder, usage_file)) or 0
                    inactive = _read_stat(os.path.join(folder, "memory.stat"), stat_names)
                    available = max(0, limit - max(0, usage - inactive))
                    best = (available, limit) if best is None else (min(best[0], available), min(best[1], limit))
            if not rel:
                break
            rel = os.path.dirname(rel)
    return best


@contextlib.contextmanager
def nvml_device(dev: torch.device):
    """Yields ``(pynvml, handle)`` for ``dev`` (matched by UUID, so ``CUDA_VISIBLE_DEVICES`` and
    ``CUDA_DEVICE_ORDER`` cannot pick another GPU; else torch's own index mapping when the names agree), or
    ``None`` when pynvml, the driver library or the match is missing; NVML is shut down afterwards."""
    try:
        import pynvml
    except Exception:  # noqa: BLE001 - any import problem just means no NVML
        yield None
        return
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - pynvml raises its own NVMLError subclasses
        log.debug("protrain: pynvml unavailable: %s", e)
        yield None
        return
    try:
        handle = None
        candidates = _uuid_candidates(getattr(torch.cuda.get_device_properties(dev), "uuid", None))
        for candidate in candidates:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(candidate)
                break
            except Exception:  # noqa: BLE001
                continue
        if handle is None:  # torch's own index mapping (honours CUDA_VISIBLE_DEVICES), if the names agree
            with contextlib.suppress(Exception):
                h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(dev))  # private
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else name
                if name == torch.cuda.get_device_name(dev):
                    handle = h
        if handle is None:
            log.debug("protrain: no NVML device matches %s (UUIDs tried: %s)", dev, candidates)
        yield None if handle is None else (pynvml, handle)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_memory(dev: torch.device, torch_total: int) -> tuple[int | None, int | None]:
    """``(total, free)`` of ``dev`` according to pynvml (:func:`nvml_device`), or ``(None, None)``. Logs a
    warning when the totals disagree by more than 5%."""
    with nvml_device(dev) as found:
        if found is None:
            return None, None
        pynvml, handle = found
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception as e:  # noqa: BLE001
            log.debug("protrain hardware profile: pynvml query failed: %s", e)
            return None, None
    total, free = int(info.total), int(info.free)
    if torch_total and abs(total - torch_total) > 0.05 * torch_total:
        log.warning("protrain hardware profile: NVML reports %d bytes on %s, torch %d", total, dev, torch_total)
    return total, free


def _uuid_candidates(u) -> list[str]:
    """NVML spells a UUID ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``; torch's ``_CUuuid`` prints the hex
    part (and has ``bytes``): try every spelling."""
    if u is None:
        return []
    out = []
    raw = getattr(u, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        h = raw.hex()
        out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    text = str(u).strip()
    if text:
        out += [text] if text.startswith(("GPU-", "MIG-")) else [f"GPU-{text}", text, f"MIG-{text}"]
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------------ cache
def _for_device(profile: HardwareProfile, dev: torch.device) -> HardwareProfile:
    """A cached profile serves every device of the same name on the host: report the one asked for."""
    return profile if profile.device == str(dev) else dataclasses.replace(profile, device=str(dev))


def _load(path: str, key: str) -> HardwareProfile | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning("protrain: unreadable hardware profile %s (%s): measuring again", path, e)
        return None
    try:
        profile = HardwareProfile.from_dict(data)
    except (ValueError, TypeError, KeyError) as e:
        log.warning("protrain: invalid hardware profile %s (%s): measuring again", path, e)
        return None
    if profile.key != key:
        log.warning("protrain: hardware profile %s is for %r, not %r: measuring again", path, profile.key, key)
        return None
    return profile


def _store(path: str, profile: HardwareProfile) -> None:
    """Atomic write (temporary file in the same folder + ``os.replace``); a folder we cannot write is a
    warning, not an error: the profile is still returned, just measured again next time."""
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(profile.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("protrain: could not cache the hardware profile at %s: %s", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def _key_lock(path: str):
    """An exclusive ``flock`` on ``<path>.lock`` while measuring, so that processes on one host (ranks)
    neither measure at the same time (they would share the host's memory bandwidth) nor twice; nothing
    where ``fcntl`` is missing or the folder cannot be written."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. a file system without locks
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock
