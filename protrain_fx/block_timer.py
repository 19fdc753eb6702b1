"""Runtime side of the block profiler: what ``protrain::mark`` records at each block boundary.

A mark records, in the order the device runs them, a timing point (a CUDA event on the current stream, or
``perf_counter`` on the CPU), the bytes allocated and the peak since the previous mark (the peak counter is
reset at every mark, so each interval's transient peak is its own). ``where``: 0 forward enters the block,
1 forward leaves it, 2 backward enters it (its output's gradient arrives), 3 backward leaves it.
:func:`block_timings` turns the records of one step into per-block times and peaks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

FWD_ENTER, FWD_EXIT, BWD_ENTER, BWD_EXIT = range(4)


@dataclass
class Mark:
    block: int
    where: int
    point: object  # torch.cuda.Event or a perf_counter float
    allocated: int
    peak: int  # highest allocation since the previous mark


class BlockRecorder:
    def __init__(self):
        self.marks: list[Mark] = []

    def record(self, block: int, where: int, device: torch.device) -> None:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            alloc, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.marks.append(Mark(block, where, ev, alloc, peak))
        else:
            self.marks.append(Mark(block, where, time.perf_counter(), 0, 0))

    def clear(self) -> None:
        self.marks.clear()


RECORDER = BlockRecorder()


def _ms(a, b) -> float:
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)


def block_timings(marks: list[Mark] | None = None) -> dict[int, dict[str, float]]:
    """Per block: forward and backward milliseconds (first enter to last leave, in that phase) and the peak
    allocation inside each (after synchronizing the device when the points are CUDA events)."""
    marks = RECORDER.marks if marks is None else marks
    if any(not isinstance(m.point, float) for m in marks):
        torch.cuda.synchronize()
    out: dict[int, dict[str, float]] = {}
    for phase, (enter, leave) in (("fwd", (FWD_ENTER, FWD_EXIT)), ("bwd", (BWD_ENTER, BWD_EXIT))):
        by_block: dict[int, list[int]] = {}
        for i, m in enumerate(marks):
            if m.where in (enter, leave):
                by_block.setdefault(m.block, []).append(i)
        for block, idx in by_block.items():
            first = next((i for i in idx if marks[i].where == enter), None)
            last = next((i for i in reversed(idx) if marks[i].where == leave), None)
            if first is None or last is None or last < first:
                continue
            row = out.setdefault(block, {})
            row[f"{phase}_ms"] = _ms(marks[first].point, marks[last].point)
            row[f"{phase}_peak_bytes"] = max(m.peak for m in marks[first + 1:last + 1])
            row[f"{phase}_start_allocated"] = marks[first].allocated
    return out
