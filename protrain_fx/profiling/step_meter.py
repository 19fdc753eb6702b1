"""StepMeter: the measured side of a plan. Wraps a compiled graph and, without synchronizing the
device, measures the time between successive calls (one training micro-step each; an optimizer
step of ``k`` micro-steps, as the optimizer learned them, is ``k`` successive intervals, and
``micro_steps`` is recorded for later plans to price) and the device's peak memory, into
``plan.measured``; the plan cache entry (plan.json) is rewritten with them now and
then. A non-finite loss marks the entry (a plan that gave one is never served from the cache again).

On CUDA each call records an event; an interval is read only once its closing event has completed
(``Event.query``), so the meter never waits. The first calls (compilation, the optimizer learning
the accumulation count) are skipped; the peak counters are reset at the first measured call. With
``PROTRAIN_PROFILE_BLOCKS=1`` the block marks of a recent step also give
``plan.measured["timeline"]`` (what :func:`protrain_fx.plot_memory` draws against the prediction).
It also records when the user's optimizer stepped the offloaded chunks at ``opt.step()`` rather than
inside backward (a loop that clips gradients): the plan was priced otherwise, the next is not; and,
once, how much slower than profiled forward and backward ran where the plan keeps the device busy
(``machine.step_rates.compute_slowdown``: the clock under sustained load, for later plans on the
machine). Its first call says how long the first step's parts ran (first_step.py, which
synchronizes the device in that step only, and only where progress lines are shown).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from protrain_fx import progress
from protrain_fx.machine import pinned, step_rates
from protrain_fx.profiling import first_step
from protrain_fx.runtime import block_timer, hybrid_optim

SKIP = 2  # calls before measuring
WINDOW = 20  # intervals kept
SAVE_AT = (5, 20, 100, 1000)


class StepMeter:
    def __init__(self, plan, device: torch.device, save=None, optimizer=None):
        self.plan, self.device, self.save = plan, device, save
        self.optimizer = optimizer  # a weak reference to the user's optimizer, or None
        self.calls = 0
        self.points: list = []  # (call index, event or perf_counter) not yet turned into intervals
        self.intervals: list[float] = []
        self.timeline: list = []  # the memory timeline of a recent step, when blocks are profiled
        self.flags: list = []  # (event, pinned finite flag, pinned loss) of recent calls on CUDA
        self.free_flags: list = []  # (flag, loss) pairs whose copies are done
        self.nonfinite = False
        self.compute_observed = False
        # the first step's lines (first_step.py), said once where progress lines are shown
        self.first = first_step.watch(progress.current(), device, optimizer)

    def wrap(self, compiled):
        @functools.wraps(compiled)
        def run(*args):
            self.tick()
            first = self.first
            if first is not None and first.done:  # its lines said: its hook goes
                first.close()
                self.first = first = None
            started = time.perf_counter()
            out = compiled(*args)
            self._watch_loss(out)
            if first is not None and not first.called:
                first.call_ran(out, started)
            return out

        return run

    def _watch_loss(self, out) -> None:
        """The graph's first scalar floating output (the loss, where the graph computes it) checked
        for being finite without synchronizing: on CUDA the flag is copied to pinned memory and read
        once its event has completed. A non-finite loss marks the plan in the plan cache (never
        served again) and is said once; training is not changed (eager may give the same)."""
        if self.nonfinite:
            return
        loss = next(
            (
                t
                for t in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()
            ),
            None,
        )
        if loss is None:
            return
        if loss.device.type != "cuda":
            if not bool(torch.isfinite(loss.detach())):
                self._nonfinite(float(loss.detach()))
            return
        while self.flags and self.flags[0][0].query():
            _, flag, value = self.flags.pop(0)
            if not bool(flag):
                return self._nonfinite(float(value))
            self.free_flags.append((flag, value))  # pinned pairs reused, not allocated per call
        if len(self.flags) < 4:
            flag, value = (
                self.free_flags.pop()
                if self.free_flags
                else (pinned.pinned_empty(1, torch.bool), pinned.pinned_empty(1, torch.float32))
            )
            flag.copy_(torch.isfinite(loss.detach()), non_blocking=True)
            value.copy_(loss.detach(), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.flags.append((ev, flag, value))

    def _nonfinite(self, value: float) -> None:
        import logging

        self.nonfinite = True
        logging.getLogger("protrain_fx").warning(
            "protrain: graph %s gave a non-finite loss (%s) at call %d; its plan will not be "
            "served from the plan "
            "cache again (if eager PyTorch gives a finite loss on the same step, please report it)",
            self.plan.graph_name,
            value,
            self.calls,
        )
        if self.save is not None:
            self.save(
                self.plan, {"status": "nonfinite", "detail": f"loss {value} at call {self.calls}"}
            )

    def _now(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def tick(self) -> None:
        self.calls += 1
        # PROTRAIN_PROFILE_BLOCKS=1: the last step's marks are its memory timeline
        if self.plan.profile_blocks:
            self._take_timeline()
        if self.calls <= SKIP:
            return
        if self.calls == SKIP + 1:
            pinned.reset_held_peak()
            if self.device.type == "cuda":
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
            # synchronizes the device (profiling only)
            self.timeline = block_timer.memory_timeline(marks)

    def _update(self) -> None:
        # an optimizer step of k micro-steps (calls) is any k successive intervals (accumulation)
        opt = self.optimizer() if self.optimizer is not None else None
        handle = hybrid_optim.handle_of(opt) if opt is not None else None
        # (not seen where no chunk is offloaded, nothing counts arrivals: as the plan priced it)
        priced = ((self.plan.predicted or {}).get("breakdown") or {}).get("micro_steps")
        k = (handle.micro_steps() if handle is not None else None) or priced or 1
        iv = self.intervals
        steps = [sum(iv[i : i + k]) for i in range(len(iv) - k + 1)] if len(iv) >= k else iv
        measured = {"iter_s": statistics.median(steps), "steps_measured": len(steps)}
        if k > 1:
            measured["micro_steps"] = k
        if self.timeline:
            measured["timeline"] = self.timeline
        if self.device.type == "cuda":
            measured["peak_bytes"] = torch.cuda.max_memory_reserved(self.device)
            measured["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        # host memory, process-wide: protrain's own buffers (the plan predicts these) and everything
        measured["host_bytes"], measured["host_peak_bytes"] = pinned.held_bytes()
        measured["rss_bytes"], measured["peak_rss_bytes"] = pinned.resident_bytes()
        # the loop clips gradients or sets hyperparameters between backward() and opt.step(): the
        # offloaded chunks' CPU steps run at opt.step() (the cache entry keeps why: later plans of
        # the graph price it, plan_cache.steps_at_opt_step)
        if handle is not None and handle.serial_why:
            measured["cpu_steps_at_opt_step"] = handle.serial_why
        for seen in ("grads_held", "loop_bytes"):  # seen by the graph, kept for the cache
            if (self.plan.measured or {}).get(seen):
                measured[seen] = self.plan.measured[seen]
        self.plan.measured = measured
        if not self.compute_observed and len(self.intervals) >= step_rates.COMPUTE_INTERVALS:
            self.compute_observed = True
            slowdown = None
            busy_training = not (self.plan.profiling or self.plan.inference)
            if "cpu_steps_at_opt_step" not in measured and busy_training and k == 1:
                span = handle.cpu_span_per_step() if handle is not None else None
                slowdown = step_rates.compute_slowdown(
                    self.plan.predicted, measured["iter_s"], span
                )
            if slowdown is not None:
                step_rates.observe_compute(self.device, slowdown)
