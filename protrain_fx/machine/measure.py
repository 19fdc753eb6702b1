"""Measuring the machine: copy bandwidths between pinned host memory and the device (each way and
both at once), the AdamW rate of the CPU step protrain runs for offloaded chunks and of the device's
fused step, and the host's memory bandwidth (a STREAM triad). protrain_fx/machine/profile.py says
what is measured, how, and why it is cached.
"""

from __future__ import annotations

import datetime
import logging
import socket
import statistics
import threading
import time

import torch

from protrain_fx import config
from protrain_fx.machine.memory import (
    cpu_model,
    device_name,
    host_memory,
    memlock_limit,
    nvml_memory,
    resolve_device,
    usable_cores,
)
from protrain_fx.machine.pinned import no_dispatch_modes, release_cached_pinned_memory
from protrain_fx.machine.profile import (
    HardwareProfile,
    _for_device,
    _key_lock,
    _load,
    _store,
    cache_path,
    profile_key,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
GPU_ADAM_BATCHES, GPU_ADAM_STEPS = 3, 5

# measurement sizes (scaled down when memory is short)
COPY_BYTES = 256 * MiB  # per copy on CUDA

CPU_COPY_BYTES = 64 * MiB  # per copy on a CPU device

GPU_ADAM_NUMEL = 64 * MiB  # 64 M parameters: 1 GiB of param + grad + 2 moments

CPU_ADAM_NUMEL_MANY = 32 * MiB  # >= 8 usable cores

CPU_ADAM_NUMEL_FEW = 16 * MiB

COPY_REPS = 3

# a few milliseconds of device-side sleep ahead of each timed Adam batch
GPU_SLEEP_CYCLES = 10_000_000
# the sustained-compute measurement: n x n bf16 products, batches of SUSTAIN_BATCH for SUSTAIN_S
# seconds (an H200 reaches its power limit after about one)
SUSTAIN_N, SUSTAIN_BATCH, SUSTAIN_S = 8192, 32, 3.0

# time the timed CPU Adam steps may take, at least 3 and at most 10 steps
CPU_ADAM_TARGET_S = 0.3


# -------------------------------------------------------------------------------------------
# measurement
def measure_hardware(device: str | torch.device | None = None) -> HardwareProfile:
    """Measure everything now (no cache). Runs outside any fake/functional tensor mode, so it may be
    called from inside the backend."""
    dev = resolve_device(device)
    t0 = time.perf_counter()
    with no_dispatch_modes(), torch.no_grad():
        host_available, host_total = host_memory()
        nvml_total = nvml_free = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            dev_free, dev_total = (int(x) for x in torch.cuda.mem_get_info(dev))
            nvml_total, nvml_free = nvml_memory(dev, dev_total)
            (h2d, d2h, duplex, copy_bytes), (gpu_adam, gpu_numel) = _measure_cuda(
                dev, dev_free, host_available
            )
        else:
            dev_free, dev_total = host_available, host_total
            copy_bytes = _fit(CPU_COPY_BYTES, host_available // 8, MiB)
            h2d, d2h, duplex = _measure_cpu_copies(copy_bytes)
            gpu_adam = gpu_numel = None
        cpu_numel = _fit(
            CPU_ADAM_NUMEL_MANY if usable_cores() >= 8 else CPU_ADAM_NUMEL_FEW,
            # at most a quarter of the available RAM
            host_available // (4 * 4 * 4),
            MiB,
        )
        sustained = 1.0
        if dev.type == "cuda":
            sustained = _measure_sustained_compute(dev)
            _release_cuda_memory(dev)
        cpu_adam, cpu_adam_masters = _measure_cpu_adam(cpu_numel)
        triad = _measure_host_triad(cpu_numel)
    memlock = memlock_limit()
    profile = HardwareProfile(
        key=profile_key(dev),
        device=str(dev),
        device_name=device_name(dev),
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
        # torch's pinned memory (cudaHostAlloc) is pinned by the NVIDIA driver, which does not
        # charge it to RLIMIT_MEMLOCK (a 64 KiB docker default would otherwise forbid any offload):
        # no known cap beyond host RAM, so None; the rlimit itself is kept in memlock_limit_bytes
        pinned_limit_bytes=None,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hostname=socket.gethostname(),
        cpu_model=cpu_model(),
        cpu_cores=usable_cores(),
        cpu_threads=torch.get_num_threads(),
        memlock_limit_bytes=memlock,
        nvml_total_bytes=nvml_total,
        nvml_free_bytes=nvml_free,
        copy_bytes=copy_bytes,
        cpu_adam_numel=cpu_numel,
        cpu_adam_kind=cpu_adam_kind(),
        host_triad_bytes_per_s=triad,
        gpu_adam_numel=cpu_numel if gpu_numel is None else gpu_numel,
        gpu_sustained_slowdown=sustained,
        cpu_adam_masters_params_per_s=cpu_adam_masters,
        measure_seconds=round(time.perf_counter() - t0, 3),
    )
    profile._validate()
    return profile


def _fit(target: int, limit: int, floor: int) -> int:
    """``target`` scaled down to ``limit`` (never below ``floor``), a multiple of ``floor``."""
    return max(floor, min(target, limit) // floor * floor)


def _measure_cuda(dev: torch.device, free: int, host_available: int):
    """Copies and device Adam, sized to a quarter of the free device (and available host) memory at
    most; on an out-of-memory error (memory taken meanwhile) retried once at an eighth of the size.
    """
    # two device and two pinned buffers
    copy_bytes = _fit(COPY_BYTES, min(free, host_available) // 8, MiB)
    numel = _fit(GPU_ADAM_NUMEL, free // (4 * 4 * 4), MiB)  # four fp32 tensors
    for attempt in range(2):
        try:
            return _measure_cuda_copies(dev, copy_bytes), (_measure_gpu_adam(dev, numel), numel)
        except torch.cuda.OutOfMemoryError:
            if attempt:
                raise
            log.warning(
                "protrain hardware profile: out of device memory, measuring with smaller buffers"
            )
            copy_bytes, numel = _fit(copy_bytes // 8, copy_bytes, MiB), _fit(numel // 8, numel, MiB)
        finally:
            _release_cuda_memory(dev)


def _measure_cuda_copies(dev: torch.device, nbytes: int) -> tuple[float, float, float, int]:
    """h2d, d2h (each alone) and duplex (both at once, total) bytes/s between pinned host and
    ``dev``.

    Every copy runs on a dedicated stream: h2d on ``up``, d2h on ``down``. Each timed copy is
    bracketed by events on its own stream; for the duplex case both streams wait for one start event
    (recorded on the current stream after everything before it is done) and the time runs to the
    later of the two end events (events on different streams of one device can be compared)."""
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
        # nothing in flight when the buffers go (on return; then released)
        torch.cuda.synchronize(dev)
    tiny = 1e-9
    return (
        nbytes / max(t_h2d, tiny),
        nbytes / max(t_d2h, tiny),
        2 * nbytes / max(t_both, tiny),
        nbytes,
    )


def _adam_tensors(numel: int, device) -> tuple[list, list, list, list, list]:
    # initialized values (no denormals or NaNs from uninitialized memory, which can slow a CPU down)
    p = torch.full((numel,), 0.5, dtype=torch.float32, device=device)
    g = torch.full((numel,), 1e-3, dtype=torch.float32, device=device)
    m = torch.zeros(numel, dtype=torch.float32, device=device)
    v = torch.zeros(numel, dtype=torch.float32, device=device)
    # fused Adam keeps steps on the params' device
    step = torch.zeros((), dtype=torch.float32, device=device)
    return [p], [g], [m], [v], [step]


def _adam_step(tensors) -> None:
    from torch.optim.adam import adam

    params, grads, m, v, steps = tensors
    adam(
        params,
        grads,
        m,
        v,
        [],
        steps,
        foreach=False,
        fused=True,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=0.9,
        beta2=0.999,
        lr=1e-4,
        weight_decay=0.01,
        eps=1e-8,
        maximize=False,
    )


def cpu_adam_kind() -> str:
    from protrain_fx.machine import cpu_adam

    return "one-pass kernel + bf16 copy" if cpu_adam.available() else "torch fused + bf16 copy"


def one_pass_step(p, g, m, v, out, step: float = 1.0) -> None:
    """One AdamW step of the one-pass kernel (protrain_fx/machine/cpu_adam.py) with the
    hyperparameters the hardware profile times it at (benchmarks/host_adam_probe.py times it
    too)."""
    from protrain_fx.machine import cpu_adam

    cpu_adam.adam_step(
        p,
        g,
        m,
        v,
        out,
        step,
        lr=1e-4,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        decoupled=True,
        maximize=False,
    )


def _measure_cpu_adam(numel: int) -> tuple[float, float]:
    """The CPU step of an offloaded chunk as runtime/hybrid_optim.py runs it: AdamW over the flat
    chunk and its bf16 transfer copy (protrain_fx.machine.cpu_adam's one pass where it builds, else
    torch's fused Adam then a copy); and the same step without the copy (a chunk with no transfer
    copy): the kernel writing none, which can be much faster than 2 bytes fewer per parameter say
    (2-core CI box: 1.6x; H200 host inside steps: 1.22x,
    benchmarks/results/oom_sweep_h200_run13a.md)."""
    from protrain_fx.machine import cpu_adam

    tensors = _adam_tensors(numel, "cpu")
    out = torch.empty(numel, dtype=torch.bfloat16)
    if cpu_adam.available():

        def step(copy: bool):
            (p,), (g,), (m,), (v,), _ = tensors
            one_pass_step(p, g, m, v, out if copy else None)
    else:

        def step(copy: bool):
            _adam_step(tensors)
            if copy:
                out.copy_(tensors[0][0])

    def rate(copy: bool) -> float:
        t0 = time.perf_counter()
        step(copy)  # warm-up
        warm = time.perf_counter() - t0
        reps = max(3, min(10, int(CPU_ADAM_TARGET_S / max(warm, 1e-6))))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step(copy)
            times.append(time.perf_counter() - t0)
        # the fastest repetition: what the host can do; a busy moment (another process compiling)
        # only slows some
        return numel / max(min(times), 1e-9)

    return rate(True), rate(False)


def _measure_host_triad(numel: int) -> float:
    """The host's memory bandwidth as STREAM's triad measures it (``a = b + s * c`` over float32
    arrays far larger than the caches; 12 bytes per element), the fastest of a few repetitions:
    what the CPU optimizer step, which is memory-bound, can at best reach. Built and threaded like
    the one-pass Adam kernel where it builds (torch.add otherwise, which reached about half of that
    on the 2-core CI machine)."""
    from protrain_fx.machine import cpu_adam

    # a generator of its own: measuring must not move the user's random numbers
    gen = torch.Generator().manual_seed(0)
    b, c = torch.rand(numel, generator=gen), torch.rand(numel, generator=gen)
    a = torch.empty(numel)

    def run():
        if cpu_adam.available():
            cpu_adam.triad(a, b, c, 0.5)
        else:
            torch.add(b, c, alpha=0.5, out=a)

    run()  # warm-up (pages touched)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 12 * numel / max(min(times), 1e-9)


def _measure_sustained_compute(dev: torch.device) -> float:
    """How much slower dense bf16 products run kept back to back for :data:`SUSTAIN_S` seconds
    than one at a time after an idle second: the profiler times blocks in short runs, at the boost
    clock; a plan that keeps the device busy draws the board to its power limit, where the clock
    drops (H200, 700 W: products 1.05x slower, benchmarks/results/power_probe_h200.md; the 1B
    shape's steps at 1690 MHz against 1967 profiled, oom_sweep_h200_run10.md). The median batch of
    the second half over the fastest single product, at least 1."""
    n = SUSTAIN_N
    with torch.cuda.device(dev):
        try:
            a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
            b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        except torch.cuda.OutOfMemoryError:
            return 1.0
        for _ in range(3):
            a @ b
        torch.cuda.synchronize(dev)
        time.sleep(1.0)  # idle: the clock back at its boost

        def timed(k: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                a @ b
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / k

        single = []
        for _ in range(5):
            single.append(timed(1))
            time.sleep(0.05)
        batches, t_end = [], time.perf_counter() + SUSTAIN_S
        while time.perf_counter() < t_end:
            batches.append(timed(SUSTAIN_BATCH))
    late = batches[len(batches) // 2 :]
    return max(1.0, statistics.median(late) / min(single)) if late else 1.0


def _measure_gpu_adam(dev: torch.device, numel: int) -> float:
    """Batches of ``GPU_ADAM_STEPS`` steps between two events, median over batches. Each batch is
    queued behind a short device-side sleep, so the steps run back to back however slowly the host
    launches them (a step of 64 M parameters is about half a millisecond on an H200)."""
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
    """On a CPU device "host" and "device" are both host memory: real copies; duplex runs the two
    copies in two threads at once (``copy_`` releases the GIL)."""
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
    """Give the measurement's buffers back: device blocks to the driver (``empty_cache`` frees only
    unused cached blocks) and pinned blocks to the OS (torch's caching host allocator would
    otherwise keep them pinned for the life of the process)."""
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    release_cached_pinned_memory()


def hardware_profile(
    device: str | torch.device | None = None, *, refresh: bool = False, cache_dir: str | None = None
) -> HardwareProfile:
    """The hardware profile of ``device`` (default: the current CUDA device, else the CPU), from the
    cache when there is a valid one, else measured (:func:`measure_hardware`) and stored."""
    dev = resolve_device(device)
    key = profile_key(dev)
    path = cache_path(key, cache_dir)
    refresh = refresh or config.settings().refresh_hardware
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
