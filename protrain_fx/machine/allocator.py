"""The CUDA caching allocator as a plan sees it: protrain turns expandable segments on, or budgets
for their absence.

A plan's peak must hold as *reserved* device memory (what a per-process cap or the device's size
bounds), not as allocated memory. PyTorch's default allocator carves requests out of fixed segments;
protrain's chunk buffers, gradient buffers and swap slots (1.5 GiB each for a Llama-3.2-3B-shaped
model) come and go and split those segments, and a later large request fails with gigabytes reserved
but unallocated (the 3B shape at a 24 GiB cap: out of memory allocating 1.47 GiB with 4.07 GiB
reserved and free). With expandable segments the allocator maps pages into one growing range per
stream, so freed memory serves requests of any size: reserved stayed within 1-3% of allocated on the
H200 (benchmarks/results/autoplan_h200.md).

So, before a CUDA graph's plan allocates anything, :func:`prepare` turns expandable segments on
(through torch's allocator settings; segments made from then on are expandable) unless the user's
``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` names ``expandable_segments`` (their choice is
kept) or the backend is ``cudaMallocAsync``. :func:`fragmentation` is the reserved-over-allocated
factor the cost model then budgets, and :func:`describe` what the plan summary says about it.

Expandable segments keep holes mapped until a request finds no room under the process's limit;
only then does the allocator unmap its free pages and retry. Holding the limit at the budget during
a plan's calls (so that holes are unmapped before reserved memory grows into the reserve) was tried
and reverted: the 3B shape at 16 GiB stayed at 15.00 GiB reserved, but with 53 retries in 20 steps
against 5 and a slower step, and the 1B shape, whose allocated peak reaches its budget, ran out of
memory in its backward (benchmarks/results/oom_sweep_h200_run23.md). The holes are budgeted
instead: once measured, through ``measured_gap``.

What a plan does not budget, it gives back: holes grow reserved memory step after step (the 8-layer
3B shape at its smallest budget, 4.57 GiB: 4.89 GB reserved in its first step, then 5.40, 5.58,
5.88 GB, with the allocated peak 3.99 GB in each, `benchmarks/results/min_budget_h200_run4.md`),
while the first step, from an empty cache, held. So :func:`trimmed` wraps an automatic plan's
compiled graph: at the start of a training call (a step boundary, where only the states and buffers
are allocated), where the allocator holds more than the plan's predicted reserved peak, its free
pages are given back (``torch.cuda.empty_cache``), and the step starts as the first did; the
smallest plan (every chunk offloaded, predicted at its budget: :data:`TIGHT`) does so at every
boundary, since there one step's growth is already over the budget. Said once in the log;
counted in the plan (``Plan.trims``); stopped for the graph where the step after a trim reserves
as much again (its holes form within a step: trims would only cost time) or a trim gives back
little (the excess is someone else's tensors, not holes).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from protrain_fx import config
from protrain_fx.options import format_bytes

log = logging.getLogger("protrain_fx")

# reserved over allocated peak, budgeted by the cost model:
# expandable segments: 1.003-1.03 measured on the H200 without swapping
EXPANDABLE_FRAGMENTATION = 1.02
# fixed segments, before the profiled step says more: the 3B shape at 24 GiB failed at ~1.2 with
# 1.5 GiB chunks (18.47 GiB allocated + 4.07 reserved free + the 1.47 GiB request, against a plan
# of 22.98 GiB at 1.02); the margin covers that and more
SEGMENT_FRAGMENTATION = 1.25
# ... and once the profiled step measured its own ratio (its warm-up run starts from an empty
# cache), fixed segments are budgeted as allocated bytes times SEGMENT_BASE plus an overhead of
# their own: the profiled step's reserved-but-unallocated bytes (its ratio with a margin, times its
# allocated peak). What fragments is what comes and goes (chunk and gradient buffers, activations,
# logits), not the resident states a plan allocates once: the profiled step's ratio applied to the
# whole plan (1.269 for the 3B shape) over-predicted plans with many resident chunks by 8.5-17%
# (H200, benchmarks/results/oom_sweep_h200_run2-5.md: the 3B shape at 24 and 40 GiB, Mistral-7B's at
# 80 GiB, the 1B shape at 16 GiB); as bytes, the same rows come within -2.6..+1.0%, and the 3B shape
# at 16 GiB (4.0 GiB reserved but free where the profiled step left 2.0) within +8%
SEGMENT_MARGIN = 1.02
SEGMENT_BASE = 1.02
ASYNC_FRAGMENTATION = 1.05  # cudaMallocAsync: the driver's pool, no fixed segments
# where a plan's run measured its reserved peak over the prediction (plan_cache.allocator_gap), the
# graph's next plan budgets allocated bytes plus the reserved-but-free bytes measured, with this
# margin, in place of the factors above. With expandable segments the range keeps holes that later
# requests do not fit: reserved minus allocated at the peak measured 0.02-1.57 GiB on the H200 rows
# of 16-80 GiB (benchmarks/results/oom_sweep_h200_runs4to21.md), near 1 GiB, the size of the bf16
# logits of a 128k vocabulary at 4 x 1024 tokens, in most: 1.02x allocated under-budgets tight caps
MEASURED_GAP_MARGIN = 1.10
# a step boundary gives free pages back where reserved memory is over this share of the plan's
# predicted reserved peak
TRIM_AT = 1.0
# a trim that gives back less than this share of the predicted peak stops trimming for the graph
TRIM_MIN_SHARE = 0.01
# a plan with every chunk offloaded predicted to peak at this share of its budget or more (the
# smallest budget a model trains in) gives free pages back at every step boundary after its first:
# each step starts as the first did (the 8-layer 3B shape at its smallest budget: reserved within
# +1.45% of the budget over eight steps, against +25% trimmed only after an overrun,
# benchmarks/results/min_budget_h200_run5.md). Not a plan that filled its budget with resident
# chunks (most automatic plans peak within 1% of their budget): a trim at every boundary cost the
# 1B shape's 0.17 s steps 10% (oom_sweep_h200_run38.md)
TIGHT = 0.99
# a call is a step boundary where at most the plan's start plus this share of its peak is allocated
BOUNDARY_SLACK = 0.05


@dataclass(frozen=True)
class AllocatorState:
    backend: str  # "native", "cudaMallocAsync" or "cpu"
    expandable: bool
    set_by_protrain: bool

    @property
    def key(self) -> str:
        """What a plan cache key records of the allocator."""
        return f"{self.backend}:{'expandable' if self.expandable else 'segments'}"


CPU = AllocatorState("cpu", False, False)
_state: AllocatorState | None = None  # decided once per process, at the first CUDA graph


def user_settings() -> str:
    return config.settings().pytorch_alloc_conf


def decide(user: str, backend: str) -> tuple[bool, bool]:
    """``(expandable, protrain_turns_it_on)`` for the user's allocator settings and torch's
    backend."""
    if backend != "native":
        return False, False
    named = [
        kv.split(":", 1)
        for kv in user.replace(" ", "").split(",")
        if kv.startswith("expandable_segments")
    ]
    if named:
        return named[-1][-1].lower() in ("true", "1"), False
    return True, True


def prepare(device: torch.device) -> AllocatorState:
    """Turn expandable segments on where the user left them unset (see the module docstring); the
    state of the allocator the plan runs under."""
    global _state
    if device.type != "cuda":
        return CPU
    if _state is None:
        backend = torch.cuda.get_allocator_backend()
        expandable, turn_on = decide(user_settings(), backend)
        if turn_on:
            try:
                # private; 2.11, 2.13
                torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
            except (AttributeError, RuntimeError) as e:  # a build without the driver API
                log.info(
                    "protrain: could not turn on expandable segments (%s); the plan budgets "
                    "fragmentation",
                    e,
                )
                expandable, turn_on = False, False
            else:
                log.info(
                    "protrain: turned on the CUDA allocator's expandable segments (so that "
                    "chunk buffers do "
                    "not fragment memory); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False "
                    "keeps it off"
                )
        _state = AllocatorState(backend, expandable, turn_on)
    return _state


def fragmentation(
    state: AllocatorState,
    profiled_ratio: float | None = None,
    profiled_peak: int = 0,
    measured_gap: int = 0,
) -> tuple[float, int] | None:
    """What to budget for the allocator, as ``(factor, extra_bytes)``: reserved = allocated *
    factor + extra_bytes; None on the CPU (the cost model's own factor). ``profiled_ratio`` and
    ``profiled_peak``: what the profiled step measured (reserved over allocated peak, from an empty
    cache, and its allocated peak), which calibrate fixed segments (see the constants);
    ``measured_gap``: the reserved-but-free bytes a run of this graph measured at its peak where its
    reserved peak overran the prediction (plan_cache.allocator_gap), budgeted in their place."""
    if state.backend == "cpu":
        return None
    if measured_gap > 0:
        return 1.0, int(measured_gap * MEASURED_GAP_MARGIN)
    if state.backend != "native":
        return ASYNC_FRAGMENTATION, 0
    if state.expandable:
        # not calibrated: with expandable segments the all-offloaded, all-recomputed profiled
        # step's ratio says little of the plan's (an HF LLaMA profiled 1.10, its plan ran at 1.03)
        return EXPANDABLE_FRAGMENTATION, 0
    if profiled_ratio is None or profiled_peak <= 0:
        return SEGMENT_FRAGMENTATION, 0
    extra = max(0.0, profiled_ratio * SEGMENT_MARGIN - 1.0) * profiled_peak
    return SEGMENT_BASE, int(extra)


def describe(state: AllocatorState, budgeted: tuple[float, int] | None = None) -> str:
    """What the plan summary says of the allocator; ``budgeted``: the ``(factor, extra_bytes)``
    budgeted (default: the uncalibrated one)."""
    if state.backend == "cpu":
        return "CPU (no caching allocator)"
    factor, extra = fragmentation(state) if budgeted is None else budgeted
    if factor == 1.0 and extra:  # fragmentation(measured_gap=...)
        how_much = (
            f"reserved budgeted at allocated + {extra / 2**30:.2f} GiB (the reserved but free "
            f"bytes a run of this graph measured at its peak, +{MEASURED_GAP_MARGIN - 1:.0%})"
        )
    else:
        how_much = f"reserved budgeted at {factor:.2f}x allocated" + (
            f" + {extra / 2**30:.2f} GiB (the profiled step's reserved but free bytes)"
            if extra
            else ""
        )
    if state.backend != "native":
        return f"{state.backend} ({how_much})"
    if state.expandable:
        how = (
            "turned on by protrain" if state.set_by_protrain else "as PYTORCH_CUDA_ALLOC_CONF says"
        )
        return f"expandable segments ({how}; {how_much})"
    return f"fixed segments (expandable_segments off as PYTORCH_CUDA_ALLOC_CONF says; {how_much})"


def trimmed(compiled, plan, device: torch.device):
    """``compiled`` that, at each training call of an automatic plan on CUDA, gives the allocator's
    free pages back where it holds more than the plan's predicted reserved peak (module docstring);
    ``compiled`` itself elsewhere."""
    if device is None or device.type != "cuda" or plan.inference:
        return compiled
    if not config.settings().trim_holes:
        return compiled
    trimmer = _Trimmer(plan, device)

    @functools.wraps(compiled)
    def run(*args):
        if trimmer.on and torch.is_grad_enabled():
            trimmer.at_step_boundary()
        return compiled(*args)

    return run


class _Trimmer:
    """One graph's trims. Pages stay mapped until a trim, so the reserved memory at a boundary
    after a trimmed step is that step's reserved peak: where it is back near what the trim gave
    back, the holes form within a step and trimming only costs time (the 1B shape at 4 x 1024
    under 16 GiB: 15.16 GiB reserved in every step, trimmed or not, +10% step time over 18 trims,
    `benchmarks/results/oom_sweep_h200_run38.md`); trimming stops there, as it does where a trim
    gives little back (the excess is the user's tensors). A call is a step boundary only where no
    more is allocated than the plan's timeline has at its start. A plan at its budget with nothing
    resident (:data:`TIGHT`) trims at every step boundary: one step's growth is over the budget."""

    def __init__(self, plan, device: torch.device):
        self.plan, self.device = plan, device
        self.on, self.said = True, False
        self.trimmed_from: int | None = None  # reserved bytes before the last step's trim
        self.calls = 0

    def at_step_boundary(self) -> None:
        self.calls += 1
        predicted = self.plan.predicted or {}
        peak, timeline = predicted.get("peak_bytes"), predicted.get("timeline")
        if not peak or not timeline:
            return
        # a boundary of the whole step only where nothing but what the plan holds at its start is
        # allocated: not a call of one block of the user's regional compilation, or of one graph
        # of several (a graph break), whose other graphs' tensors are live (trimming there would
        # synchronize the device in the middle of a step)
        if torch.cuda.memory_allocated(self.device) > timeline[0][1] + BOUNDARY_SLACK * peak:
            return
        tight = peak >= TIGHT * predicted.get("budget_bytes", float("inf"))
        if tight and self.plan.n_persist == 0:
            if self.calls > 1:  # the first call binds and places: nothing to give back yet
                torch.cuda.empty_cache()
                self.plan.trims += 1
                self._say("its plan is predicted at its budget", peak)
            return
        now = torch.cuda.memory_reserved(self.device)
        if self.trimmed_from is not None:
            if now > self.trimmed_from - TRIM_MIN_SHARE * peak:
                return self._stop(
                    f"the step after a trim reserved {format_bytes(now)} again (the holes form "
                    "within a step)"
                )
            self.trimmed_from = None
        if now <= peak * TRIM_AT:
            return
        torch.cuda.empty_cache()
        freed = now - torch.cuda.memory_reserved(self.device)
        self.plan.trims += 1
        if freed < TRIM_MIN_SHARE * peak:
            return self._stop(
                f"{format_bytes(now)} reserved, and giving free pages back freed "
                f"{format_bytes(freed)} (not the allocator's holes)"
            )
        self.trimmed_from = now
        self._say(f"the allocator held {format_bytes(now)}, over the plan's predicted peak", peak)

    def _say(self, why: str, peak: int) -> None:
        if not self.said:
            self.said = True
            log.info(
                "protrain: graph %s: %s (%s): giving the allocator's free pages back at step "
                "boundaries, so that holes it keeps mapped between steps do not grow its reserved "
                "memory (PROTRAIN_TRIM_HOLES=0: never)",
                self.plan.graph_name,
                why,
                format_bytes(peak),
            )

    def _stop(self, why: str) -> None:
        self.on = False
        self.plan.trims_stopped = why
        log.info(
            "protrain: graph %s: %s; no longer giving free pages back at step boundaries "
            "(PROTRAIN_TRIM_HOLES)",
            self.plan.graph_name,
            why,
        )
