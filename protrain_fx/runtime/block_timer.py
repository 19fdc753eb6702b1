"""Runtime side of the block profiler: what ``protrain::mark`` and the profiled step record, in
stream order.

A mark records a timing point (a CUDA event on the current stream, or ``perf_counter`` on the CPU),
the bytes allocated, and the peak since the previous mark (the peak counter is reset at every mark,
so each interval's transient peak is its own). ``where`` for a block: 0 forward enters it, 1 forward
leaves it, 2 backward enters it (its output's gradient arrives), 3 backward leaves it. Block -1
holds the step's own marks (:data:`STEP_START`, :data:`FWD_END`, :data:`STEP_END`) and the brackets
of every chunk copy the profiled step makes on the compute stream (:data:`COPY_START`,
:data:`COPY_END`): copies are serialized with compute there, and :func:`block_timings` subtracts
them, so the times are those of the compiled kernels.

Host stalls: CUDA events time the device, but a device that waits for the host to queue the next
kernel times the host. While :attr:`BlockRecorder.lead_s` is set (the profiled step on CUDA), every
block and step mark first queues a spin kernel of that length (``torch.cuda._sleep``), bracketed
like a copy so it is subtracted too: the host queues the interval's kernels while the device spins,
and the interval measures the kernels back to back, however slowly the host ran (a loaded host
measured some blocks of a GPT up to 2.2x slower than the kernels run). What the host took is
measured beside it (``*_host_ms``: each mark's ``perf_counter`` when called and when done, the
marks' and copies' own work left out): where a block's kernels are short, the training step waits
for the host's queueing, not the device, and the cost model takes the longer of the two.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

FWD_ENTER, FWD_EXIT, BWD_ENTER, BWD_EXIT = range(4)
STEP_START, FWD_END, STEP_END, COPY_START, COPY_END = range(10, 15)
STEP = -1  # the block index of step and copy marks


@dataclass
class Mark:
    block: int
    where: int
    point: object  # torch.cuda.Event or a perf_counter float
    allocated: int
    peak: int  # highest allocation since the previous mark
    # perf_counter when record() was called and when it returned: the host's side of the interval
    # (what it took the host to queue the kernels between two marks, the marks' own work left out)
    host: float = 0.0
    host_end: float = 0.0


_SPIN_CYCLES_PER_S: float | None = None


def _spin_cycles_per_s() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per second on this device (measured once)."""
    global _SPIN_CYCLES_PER_S
    if _SPIN_CYCLES_PER_S is None:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # first launch
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        _SPIN_CYCLES_PER_S = cycles / max(a.elapsed_time(b) / 1e3, 1e-6)
    return _SPIN_CYCLES_PER_S


class BlockRecorder:
    def __init__(self):
        self.marks: list[Mark] = []
        # > 0: a block or step mark on CUDA first queues a spin this long (module docstring)
        self.lead_s = 0.0

    def record(self, block: int, where: int, device: torch.device) -> None:
        host = time.perf_counter()
        if device.type == "cuda" and self.lead_s > 0 and where not in (COPY_START, COPY_END):
            self.record(STEP, COPY_START, device)
            torch.cuda._sleep(int(self.lead_s * _spin_cycles_per_s()))
            self.record(STEP, COPY_END, device)
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            alloc, peak = (
                torch.cuda.memory_allocated(device),
                torch.cuda.max_memory_allocated(device),
            )
            torch.cuda.reset_peak_memory_stats(device)
            self.marks.append(Mark(block, where, ev, alloc, peak, host))
        else:
            self.marks.append(Mark(block, where, time.perf_counter(), 0, 0, host))
        self.marks[-1].host_end = time.perf_counter()

    def clear(self) -> None:
        self.marks.clear()


RECORDER = BlockRecorder()


def _ms(a, b) -> float:
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)


def _interval_ms(marks: list[Mark], first: int, last: int) -> float:
    """Milliseconds from mark ``first`` to mark ``last`` less the chunk copies bracketed in
    between."""
    total = _ms(marks[first].point, marks[last].point)
    start = None
    for m in marks[first + 1 : last]:
        if m.block == STEP and m.where == COPY_START:
            start = m
        elif m.block == STEP and m.where == COPY_END and start is not None:
            total -= _ms(start.point, m.point)
            start = None
    return max(total, 0.0)


def _host_interval_ms(marks: list[Mark], first: int, last: int) -> float:
    """Milliseconds the host spent from mark ``first``'s return to mark ``last``'s call, less what
    the marks and the copies bracketed in between took it (a copy's issue and a spin's, and the
    marks' own work): the host's time to queue the interval's kernels and protrain's ops."""
    lo, hi = marks[first].host_end, marks[last].host
    spans, start = [], None
    for m in marks[first + 1 : last + 1]:
        if m.block == STEP and m.where == COPY_START:
            start = m
            continue
        spans.append(
            (start.host if m.where == COPY_END and start is not None else m.host, m.host_end)
        )
        if m.where == COPY_END:
            start = None
    # a block mark's span holds the spin it queued: the union, not the sum, is left out
    total, reach = hi - lo, lo
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total, reach = total - (b - a), b
    return max(total, 0.0) * 1e3


def block_timings(marks: list[Mark] | None = None) -> dict[int, dict[str, float]]:
    """Per block: forward and backward milliseconds (first enter to last leave, in that phase, less
    chunk copies) and the peak allocation inside each (after synchronizing the device when the
    points are CUDA events). With the step's marks present, block -1 holds the whole forward and
    backward ("fwd_ms", "bwd_ms"; the host's time to queue them, "fwd_host_ms", "bwd_host_ms", as
    for every block; "head_bwd_ms": backward before the first block's, all of it
    without blocks), the step's peak ("peak_bytes"), what was allocated at its start
    ("start_allocated") and the peak after the last block's backward above that start
    ("tail_bytes": a large embedding's dense gradient, a tied head's gradient held since backward
    began, their sum; 0 without blocks)."""
    marks = RECORDER.marks if marks is None else marks
    if any(not isinstance(m.point, float) for m in marks):
        torch.cuda.synchronize()
    out: dict[int, dict[str, float]] = {}
    for phase, (enter, leave) in (("fwd", (FWD_ENTER, FWD_EXIT)), ("bwd", (BWD_ENTER, BWD_EXIT))):
        by_block: dict[int, list[int]] = {}
        for i, m in enumerate(marks):
            if m.block != STEP and m.where in (enter, leave):
                by_block.setdefault(m.block, []).append(i)
        for block, idx in by_block.items():
            first = next((i for i in idx if marks[i].where == enter), None)
            last = next((i for i in reversed(idx) if marks[i].where == leave), None)
            if first is None or last is None or last < first:
                continue
            row = out.setdefault(block, {})
            row[f"{phase}_ms"] = _interval_ms(marks, first, last)
            row[f"{phase}_host_ms"] = _host_interval_ms(marks, first, last)
            row[f"{phase}_peak_bytes"] = max(m.peak for m in marks[first + 1 : last + 1])
            row[f"{phase}_start_allocated"] = marks[first].allocated
    where = {
        m.where: i
        for i, m in enumerate(marks)
        if m.block == STEP and m.where in (STEP_START, FWD_END, STEP_END)
    }
    if len(where) == 3:
        s, f, e = where[STEP_START], where[FWD_END], where[STEP_END]
        last_block = max(
            (i for i, m in enumerate(marks) if m.block != STEP and m.where == BWD_EXIT and i < e),
            default=None,
        )
        first_block = next(
            (i for i in range(f + 1, e) if marks[i].block != STEP and marks[i].where == BWD_ENTER),
            e,
        )
        out[STEP] = {
            "fwd_ms": _interval_ms(marks, s, f),
            "bwd_ms": _interval_ms(marks, f, e),
            "fwd_host_ms": _host_interval_ms(marks, s, f),
            "bwd_host_ms": _host_interval_ms(marks, f, e),
            # backward before the blocks' (the code after them: the head, the loss)
            "head_bwd_ms": _interval_ms(marks, f, first_block),
            "peak_bytes": max(m.peak for m in marks[s + 1 : e + 1]),
            "start_allocated": marks[s].allocated,
            "tail_bytes": 0
            if last_block is None
            else max(0, max(m.peak for m in marks[last_block + 1 : e + 1]) - marks[s].allocated),
        }
    return out


def memory_timeline(marks: list[Mark] | None = None) -> list[list]:
    """``[t_s, allocated bytes, label]`` at every block mark of the step (copies included in the
    time)."""
    marks = RECORDER.marks if marks is None else marks
    if not marks:
        return []
    if any(not isinstance(m.point, float) for m in marks):
        torch.cuda.synchronize()
    names = {
        FWD_ENTER: "fwd enter",
        FWD_EXIT: "fwd exit",
        BWD_ENTER: "bwd enter",
        BWD_EXIT: "bwd exit",
        STEP_START: "step start",
        FWD_END: "backward starts",
        STEP_END: "step end",
    }
    out = []
    for m in marks:
        if m.where in (COPY_START, COPY_END):
            continue
        label = names[m.where] if m.block == STEP else f"{names[m.where]} block {m.block}"
        t = _ms(marks[0].point, m.point) / 1e3
        out.append([t, max(m.peak, m.allocated), label])
    return out
