"""What an automatic plan records of the search's choice as ``plan.predicted``: the chosen knobs'
predicted time, reserved and allocated peaks, host bytes, breakdown and memory timeline (the cost
model's), the budget it was chosen under and why, and the profile it was priced from; what the plan
summary shows against the measured side and the plan cache keeps."""

from __future__ import annotations

import dataclasses

from protrain_fx.machine import allocator
from protrain_fx.plan.cost_model import LayoutCosts
from protrain_fx.plan.timeline import output_dropped_peak


def prediction(
    res,
    profiles,
    hw,
    budget: int,
    budget_why: str,
    compile_s: float,
    step,
    static,
    alloc: allocator.AllocatorState,
) -> tuple[dict, dict]:
    """The chosen knobs and what plan.predicted records of them."""
    best = res.best
    prof = next(p for p in profiles if p.chunk_size == best.knobs.chunk_size)
    lc = LayoutCosts(prof, hw, best.knobs.n_buffer, best.knobs.n_swap, best.knobs.n_checkpoint)
    predicted = {
        "iter_s": best.time_s,
        "peak_bytes": best.peak_bytes,  # reserved: what the cap bounds
        # for a loop that drops the logits the profiled step (and peak_bytes) held (timeline.py)
        "peak_bytes_output_dropped": output_dropped_peak(lc, best.knobs, step),
        "peak_allocated_bytes": int((best.peak_bytes - lc.fragmentation_bytes) / lc.fragmentation),
        "allocator": allocator.describe(alloc, (prof.fragmentation, prof.fragmentation_bytes)),
        "host_bytes": best.host_bytes,
        "budget_bytes": budget,
        "budget": budget_why,
        "breakdown": best.breakdown,
        "cpu_optim_rate": hw.cpu_step_rate_note(best.knobs.transfer_copies),
        "cpu_steps_at_opt_step": hw.steps_at_opt_step,
        "timeline": lc.timeline(best.knobs.n_persist, best.knobs.n_shard),
        "profile_compile_s": compile_s,
        "profile_s": step.seconds,
        "search_s": res.seconds,
        "plans_evaluated": res.evaluated,
        "from_cache": False,
        "world_size": hw.world_size,
        "collective_gb_s": None if hw.world_size == 1 else hw.collective_bytes_per_s / 1e9,
        "profiled": {
            **step.times_ms(),
            "peak_bytes": step.peak_bytes,
            "transient_bytes": prof.transient_bytes,
            "tail_bytes": prof.tail_bytes,
            "reserved_ratio": step.reserved_ratio,
            "fragmentation": prof.fragmentation,
            "fragmentation_bytes": prof.fragmentation_bytes,
            "saved_keep": static.saved.keep,
            "saved_recompute": static.saved.recompute,
            "saved_nonblock_keep": static.saved.nonblock_keep,
            "saved_nonblock_recompute": static.saved.nonblock_recompute,
            "recomputed_share": static.recomputed_share,
            "timeline": step.timeline,
            "conditions": step.conditions,
        },
    }
    return dataclasses.asdict(best.knobs), predicted
