"""What training steps measured on this machine: the CPU optimizer's seconds per parameter inside
backward, so that later plans price it as it runs instead of as it runs alone.

The hardware profile times the offloaded chunks' CPU Adam step alone (machine/measure.py). Inside a
training step the same step runs beside backward: the main thread launching kernels, the gathers'
and gradients' copies through host memory. How much slower that makes it is a property of the host
more than of the model, and it varies more between hosts of one kind than a constant can price (H200
hosts: 1.12-1.33x over eight plans of runs 4-7, 1.30-1.40x on the host of
benchmarks/results/oom_sweep_h200_run13b.md). So the runtime measures it: between optimizer steps
:data:`FROM_STEP` and each of :data:`AT_STEPS`, the host worker's seconds per parameter stepped on
the CPU inside backward, its waits between the steps included (:class:`WorkerSpan`;
runtime/hybrid_optim.py), are recorded here, per kind (``copies``: the
kernel also writes the bf16 transfer copy; ``masters``: it does not; ``*_at_step``: inside
``opt.step()``, where a loop that clips steps them, main thread), and the next plans on this
machine price the CPU step at the median of the last :data:`KEEP` observations of their kind
(``plan.profiles.Hardware.cpu_s_per_param``). The file sits next to the hardware profile
(``<profile>.steps.json``); an observation belongs to the profile measured at the time, so a
re-measured profile starts over. Recorded and used for CUDA devices only (:data:`DEVICES`): on the
CPU the optimizer shares the cores that compute, which the cost model prices otherwise.

The same file keeps how much slower than profiled forward and backward ran in the steps of a plan
that keeps the device busy (:func:`compute_slowdown`, observed by profiling/step_meter.py): blocks
are profiled in short runs, at the boost clock, and a busy step holds the board at its power limit.
The hardware profile's probe (dense products kept back to back) reads 1.01-1.06x on the H200, where
the model's steps ran 1.07-1.20x with the SM clock 7-15% low (products run near 1500 MHz even
below the limit: benchmarks/results/power_probe_h200.md, oom_sweep_h200_runs4to21.md); later plans
on the machine price the median observation in place of the probe's
(``plan.profiles.Hardware.sustained_slowdown``).

And the rate offloaded chunks went up at inside steps, per kind (``upload_copies``: bf16 transfer
copies; ``upload_masters``: fp32 masters through the staging and a cast), from the chunk buffers'
copies timed on the copy stream (:func:`observe_upload`): on an H100 host the profile's copies ran
at 51.2 GB/s and the steps' at 41.1 (copies) and 37.9-39.0 (masters)
(benchmarks/results/oom_sweep_h100_run70.md); later plans price the gathers at it
(``plan.profiles.Hardware.upload_bytes_per_s``).
"""

from __future__ import annotations

import json
import logging
import statistics

from protrain_fx.machine.profile import HardwareProfile, cache_path, cached, write_json

log = logging.getLogger("protrain_fx")

FROM_STEP = 3  # optimizer steps before measuring (the first ones step at opt.step())
AT_STEPS = (8, 20)  # the steps at which an observation is recorded
KEEP = 8  # observations kept per kind
# inside backward, and inside opt.step() (a loop that clips: Hardware.steps_at_opt_step)
KINDS = ("copies", "masters", "copies_at_step", "masters_at_step")
# bytes per second offloaded chunks went up inside steps (observe_upload), with and without copies
UPLOADS = ("upload_copies", "upload_masters")
UPLOAD_LEAST_BYTES = 1 << 28  # an observation moved at least this much
SPANS = "waits_included"  # observations of WorkerSpan (older files counted the steps alone)
DEVICES = ("cuda",)  # device types whose runs record and whose plans read (tests add "cpu")
COMPUTE = "compute"  # observations of compute_slowdown
# a plan keeps the device busy where its first gradient and CPU steps fit in this share of backward
# (predicted): the H200's GPU-bound rows (the 1B shape at 8 x 2048) predicted 0.98-0.996 of it and
# measured theirs inside backward (oom_sweep_h200_run17.md, run20.md); their forward alone ran
# 1.075x its prediction, the compute's slowdown the probe missed
COMPUTE_HIDDEN = 1.0
COMPUTE_INTERVALS = 16  # measured steps before the observation
COMPUTE_RANGE = (1.0, 1.5)  # an observation is clamped into it
COPY_WAITS = 0.01  # a plan whose forward and backward wait longer for copies says nothing of it


class WorkerSpan:
    """The host worker's wall time from its first CPU step inside a backward to its last, summed
    over optimizer steps: the steps and the waits between them (a chunk's gradient still on its
    way down, folding it), which a CPU-bound backward takes beyond its first gradient. The steps
    alone missed 20-110 ms a step of that on the H200 (benchmarks/results/oom_sweep_h200_run17.md:
    backward outlasted the worker's steps by 43-165 ms where the first gradient came after
    16-66 ms), and plans priced by them ran up to 11% over. A backward whose worker was busy less
    than :data:`BUSY_SHARE` of its span waited on the device, not on itself: its steps alone count.
    Marked from the worker thread; read on the main thread after the worker is done."""

    BUSY_SHARE = 0.85

    def __init__(self):
        self.cycle, self.start, self.end, self.busy, self.done_s = -1, 0.0, 0.0, 0.0, 0.0

    def mark(self, cycle: int, start: float, end: float) -> None:
        """One CPU step inside backward of optimizer step ``cycle``, from ``start`` to ``end``."""
        if cycle != self.cycle:
            self.done_s += self._seconds()
            self.cycle, self.start, self.busy = cycle, start, 0.0
        self.end, self.busy = end, self.busy + (end - start)

    def _seconds(self) -> float:
        span = self.end - self.start
        return span if self.busy >= self.BUSY_SHARE * span else self.busy

    def total(self, cycle: int) -> float:
        """Seconds of the optimizer steps before ``cycle``."""
        return self.done_s + (self._seconds() if self.cycle < cycle else 0.0)


def path_of(profile: HardwareProfile) -> str:
    return cache_path(profile.key).removesuffix(".json") + ".steps.json"


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def read(profile: HardwareProfile, device_type: str) -> dict[str, float]:
    """kind -> seconds per parameter of the CPU step inside backward (the median of this profile's
    observations); empty for another device type or none seen."""
    if device_type not in DEVICES:
        return {}
    data = _load(path_of(profile))
    if data.get("measured_at") != profile.measured_at or not data.get(SPANS):
        return {}
    out = {}
    for kind in KINDS:
        seen = [float(x["s_per_param"]) for x in data.get(kind, []) if x.get("s_per_param", 0) > 0]
        if seen:
            out[kind] = statistics.median(seen)
    if seen := [float(x["slowdown"]) for x in data.get(COMPUTE, []) if x.get("slowdown", 0) > 0]:
        out[COMPUTE] = statistics.median(seen)
    for kind in UPLOADS:
        if seen := [float(x["bytes_per_s"]) for x in data.get(kind, []) if x.get("bytes_per_s")]:
            out[kind] = statistics.median(seen)
    return out


def _append(profile: HardwareProfile, key: str, entry: dict) -> None:
    path = path_of(profile)
    data = _load(path)
    if data.get("measured_at") != profile.measured_at or not data.get(SPANS):
        data = {
            "measured_at": profile.measured_at,
            "alone_params_per_s": profile.cpu_adam_params_per_s,
            SPANS: True,
        }
    data[key] = (data.get(key, []) + [entry])[-KEEP:]
    write_json(path, data, "what training steps measured")


def record(profile: HardwareProfile, kind: str, seconds: float, params: int) -> None:
    """Add one observation: ``params`` parameters stepped in ``seconds`` of the worker inside
    backward (a folder that cannot be written is a warning: the plans keep the constant)."""
    if kind not in KINDS or params <= 0 or not seconds > 0:
        return
    _append(profile, kind, {"s_per_param": seconds / params, "params": params})


def observe(
    device, copies: bool, now: tuple[float, int], then: tuple[float, int], at_step: bool = False
) -> None:
    """The runtime's report: the cumulative (seconds, parameters) of CPU steps inside backward (the
    worker's), or with ``at_step`` inside ``opt.step()``, now and at :data:`FROM_STEP`. Recorded
    against the cached hardware profile of ``device`` (nothing without one: a plan given by hand
    never measured it), with a line saying the rate against the alone one."""
    seconds, params = now[0] - then[0], now[1] - then[1]
    profile = cached(device) if device.type in DEVICES and params > 0 and seconds > 0 else None
    if profile is None:
        return
    kind = ("copies" if copies else "masters") + ("_at_step" if at_step else "")
    record(profile, kind, seconds, params)
    log.info(
        "protrain: the CPU optimizer stepped %.2f G params/s %s (%s; alone %.2f): "
        "later plans on this machine price it so",
        params / seconds / 1e9,
        "inside opt.step()" if at_step else "inside backward",
        kind,
        profile.cpu_adam_params_per_s / 1e9,
    )


def observe_upload(device, copies: bool, now: tuple[float, int], then: tuple[float, int]) -> None:
    """The runtime's report of its chunk buffers' cumulative (seconds, bytes) of host-to-device
    copies on the copy stream (each copy's own duration, its casts and waits inside it included:
    runtime/chunk_buffers.py), now and at :data:`FROM_STEP`: the rate later plans on this machine
    price the gathers of that kind at (``Hardware.upload_bytes_per_s``)."""
    seconds, nbytes = now[0] - then[0], now[1] - then[1]
    ok = device.type in DEVICES and nbytes >= UPLOAD_LEAST_BYTES and seconds > 0
    profile = cached(device) if ok else None
    if profile is None:
        return
    kind = UPLOADS[0] if copies else UPLOADS[1]
    _append(profile, kind, {"bytes_per_s": nbytes / seconds, "bytes": nbytes})
    log.info(
        "protrain: offloaded chunks went up at %.1f GB/s inside steps (%s; the profile's copies "
        "%.1f): later plans on this machine price it so",
        nbytes / seconds / 1e9,
        kind,
        profile.h2d_bytes_per_s / 1e9,
    )


def compute_slowdown(
    predicted: dict, iter_s: float, cpu_span_s: float | None = None
) -> float | None:
    """How much slower than profiled a plan's forward and backward ran, from its prediction and
    its measured step (seconds between calls): the step less the device optimizer, over forward and
    backward as profiled (the prediction's, less the clock slowdown it priced), in
    :data:`COMPUTE_RANGE`. Only for a plan that kept the device busy, where the step is forward and
    backward: no device steps, swaps, collectives or chunk copies exposed (:data:`COPY_WAITS`),
    and its first gradient and CPU steps within :data:`COMPUTE_HIDDEN` of backward. With
    ``cpu_span_s``, the worker's measured seconds of CPU steps inside a backward, that is judged
    as the step ran: the first gradient and the measured span within backward, both slowed as
    found (a plan predicted a hair CPU-bound whose device in fact ran 11% slow, the H100's 1B row
    at 8 x 2048, said nothing before); else as predicted. None otherwise."""
    b = (predicted or {}).get("breakdown") or {}
    need = ("fwd_s", "bwd_s", "cpu_optim_s", "first_grad_s", "gpu_optim_s", "clock_slowdown")
    if not all(isinstance(b.get(k), (int, float)) for k in need) or not iter_s > 0:
        return None
    if b.get("device_step_share") or b.get("swap_exposed_s") or b.get("allreduce_exposed_s"):
        return None
    # a step that waits for chunk copies runs at the link's rate, not the clock's (an H100's 1B row
    # without transfer copies recorded 1.11 from uploads slower than priced: oom_sweep_h100_run67)
    if b.get("copy_waits_s", 0.0) > COPY_WAITS * (b["fwd_s"] + b["bwd_s"]):
        return None
    if (b.get("micro_steps") or 1) > 1:  # several forwards and backwards: not this formula's
        return None
    priced = b["clock_slowdown"] or 1.0
    profiled = (b["fwd_s"] + b["bwd_s"]) / priced
    if not profiled > 0:
        return None
    lo, hi = COMPUTE_RANGE
    slowdown = min(hi, max(lo, (iter_s - b["gpu_optim_s"]) / profiled))
    if cpu_span_s is None:  # as predicted
        if b["first_grad_s"] + b["cpu_optim_s"] > COMPUTE_HIDDEN * b["bwd_s"]:
            return None
    else:  # as measured: a CPU-bound step's excess would read as a slowdown its span outlasts
        scale = slowdown / priced
        if b["first_grad_s"] * scale + cpu_span_s > COMPUTE_HIDDEN * b["bwd_s"] * scale:
            return None
    return slowdown


def observe_compute(device, slowdown: float) -> None:
    """The step meter's report of :func:`compute_slowdown`: recorded against the cached hardware
    profile of ``device`` (nothing without one), with a line saying so."""
    profile = cached(device) if device.type in DEVICES else None
    if profile is None or not slowdown > 0:
        return
    _append(profile, COMPUTE, {"slowdown": slowdown})
    log.info(
        "protrain: forward and backward ran %.3fx their profiled time in a step that kept the "
        "device busy (the clock under sustained load; the hardware profile's probe %.3fx): later "
        "plans on this machine price it so",
        slowdown,
        profile.gpu_sustained_slowdown,
    )
