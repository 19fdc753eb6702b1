"""StepMeter: the measured side of a plan. Wraps a compiled graph and, without synchronizing the device,
measures the time between successive calls (one training micro-step each) and the device's peak memory, into
``plan.measured``; the plan cache entry (plan.json) is rewritten with them now and then.

On CUDA each call records an event; an interval is read only once its closing event has completed
(``Event.query``), so the meter never waits. The first calls (compilation, the optimizer learning the
accumulation count) are skipped; the peak counters are reset at the first measured call. With
``PROTRAIN_PROFILE_BLOCKS=1`` the block marks of a recent step also give ``plan.measured["timeline"]`` (what
:func:`protrain_fx.plot_memory` draws against the prediction).
"""
from __future__ import annotations

import functools
import statistics
import time

import torch

from . import block_timer

SKIP = 2  # calls before measuring
WINDOW = 20  # intervals kept
SAVE_AT = (5, 20, 100, 1000)


class StepMeter:
    def __init__(self, plan, device: torch.device, save=None):
        self.plan, self.device, self.save = plan, device, save
        self.calls = 0
        self.points: list = []  # (call index, event or perf_counter) not yet turned into intervals
        self.intervals: list[float] = []
        self.timeline: list = []  # the memory timeline of a recent step, when blocks are profiled

    def wrap(self, compiled):
        @functools.wraps(compiled)
        def run(*args):
            self.tick()
            return compiled(*args)

        return run

    def _now(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def tick(self) -> None:
        self.calls += 1
        if self.plan.profile_blocks:  # PROTRAIN_PROFILE_BLOCKS=1: the last step's marks are its memory timeline
            self._take_timeline()
        if self.calls <= SKIP:
            return
        if self.calls == SKIP + 1 and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.points.append(self._now())
        while len(self.points) >= 2:
            a, b = self.points[0], self.points[1]
            if isinstance(a, float):
                dt = b - a
            elif b.query():
                dt = a.elapsed_time(b) / 1e3
            else:
                break
            self.points.pop(0)
            self.intervals = (self.intervals + [dt])[-WINDOW:]
        if self.intervals:
            self._update()
        if self.calls in SAVE_AT and self.save is not None:
            self.save(self.plan)

    def _take_timeline(self) -> None:
        marks = list(block_timer.RECORDER.marks)
        block_timer.RECORDER.clear()  # one step's marks at a time, however long the run
        if self.calls > SKIP + 1 and marks:
            self.timeline = block_timer.memory_timeline(marks)  # synchronizes the device (profiling only)

    def _update(self) -> None:
        measured = {"iter_s": statistics.median(self.intervals), "steps_measured": len(self.intervals)}
        if self.timeline:
            measured["timeline"] = self.timeline
        if self.device.type == "cuda":
            measured["peak_bytes"] = torch.cuda.max_memory_reserved(self.device)
            measured["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        self.plan.measured = measured
