"""The plan cache: an automatic plan is chosen once per graph, machine and setting, and reused.

An entry is keyed by the graph's code, its input shapes, strides and dtypes, the options, the
hardware profile's key, the device budget, the allocator's settings, the world size, and the
versions of torch, protrain and the cost model (:func:`key`). It records the knobs, the prediction
and the outcome of the runs that used it: a plan that ran out of memory or gave a non-finite loss is
never served again, and a plan whose predicted peak is over the budget asked for now is refused
(:func:`usable`). So is a plan whose run measured a reserved peak over its prediction because the
caching allocator kept more reserved but free than the plan budgeted: the next plan of the graph
budgets the bytes measured (:func:`allocator_gap`). Entries are JSON files under the cache
directory, written atomically.
``PROTRAIN_PLAN_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from protrain_fx import config
from protrain_fx._version import __version__
from protrain_fx.graph import sizes
from protrain_fx.machine import profile
from protrain_fx.options import Options, format_bytes
from protrain_fx.runtime import distributed

log = logging.getLogger("protrain_fx")

# bump when the profile or the cost model changes meaning: old cache entries miss
COST_MODEL_VERSION = 34  # 22: oversized gradients down in their own dtype, staging priced as held;
# 23: compute slowed by the clock under sustained load (Hardware.clock_slowdown)
# 24: the transfer_copies knob (a cached plan's knobs include it)
# 25: the CPU step priced per kind (with or without the transfer copy), as measured in steps where
# it was (machine/step_rates.py); the plan without copies chosen where it is faster
# 26: the CPU step no faster than the triad allows before steps measured it; device steps priced
# against host memory as measured; CPU steps after backward where the loop steps them at opt.step()
# 27: the CPU step's in-step rate includes the worker's waits between chunk steps (32/37 bytes a
# parameter at the triad before it is measured)
# 28: before it is measured, the faster of the triad's price and the alone rate slowed as inside
# backward (in_step_alone_slowdown): a triad measured low no longer prices the step slow
# 29: the clock under sustained load as busy steps on the machine measured it (step_rates.COMPUTE)
# 30: a resident tied table's dense gradient at the end of backward (StepProfile.tied_row_tables);
# gradients a loop keeps between steps counted through the step (Hardware.grads_held)
# 31: a loop that drops the model's output peaks no lower than the end of forward
# (timeline.output_dropped_peak)
# 32: with several ranks, chunks sharded on the devices priced and searched (plan/ranks_cost.py;
# the n_shard knob in a cached plan)
# 33: no host staging of packed gradients where later ones are summed on the device
# (runtime/grad_add.py)
# 34: an offloaded chunk's forward no faster than the profiled host queued it
# (StepProfile.block_fwd_host_s, ChunkProfile.host_fwd_s)
# a reserved peak measured this far over the prediction, with more reserved but free than the plan
# budgeted, is the allocator's overhead the next plan budgets as measured (allocator_gap)
RESERVED_TOLERANCE = 0.02
ALLOCATED_TOLERANCE = 0.05  # the H200 rows that overran: allocated within +0.5% of the prediction
KNOBS = (
    "chunk_size",
    "n_persist",
    "n_buffer",
    "n_swap",
    "n_checkpoint",
    "device_steps",
    "transfer_copies",
    "n_shard",
)


def key(
    gm,
    example_inputs,
    opts: Options,
    hw_key: str,
    budget: int | None,
    allocator_key: str,
    regions: bool = False,
) -> str:
    """A plan's key; with ``budget`` None, the key of the graph's profile (:func:`profile_path`),
    which every budget shares."""
    shapes = [
        (tuple(t.shape), str(t.dtype), tuple(t.stride()))
        if isinstance(t, torch.Tensor)
        else repr(t)
        for t in example_inputs
    ]
    given = {k: getattr(opts, k) for k in KNOBS}
    autocast = {
        d: str(torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)
    }
    blob = json.dumps(
        [
            COST_MODEL_VERSION,
            __version__,
            torch.__version__,
            allocator_key,
            gm.code,
            shapes,
            given,
            hw_key,
            "profile" if budget is None else budget >> 26,
            distributed.world().size,
            str(opts.param_dtype),
            autocast,
            opts.optimizer is not None,
            regions,  # compiled in regions: chunks never span two (another layout)
            # PROTRAIN_DEVICE_STEPS=0 rules out plans that step chunks on the device (a plan made
            # with them was served to a run that had turned them off: H200, oom_sweep run 6)
            budget is None or config.settings().device_steps,
            sizes.planned_key(),  # a dynamic graph planned at a larger call's sizes: those
        ],
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def path_of(key: str) -> str:
    return os.path.join(profile.cache_root(), "plans", f"{key}.json")


def profile_path(key: str) -> str:
    """Where a graph's profiled step is kept (:func:`key` with no budget): a plan for another budget
    (another cap, a re-plan after running out of memory) searches again from it without compiling
    and running the profiling plan again."""
    return os.path.splitext(path_of(key))[0] + ".profile"


def read_profile(path: str) -> dict | None:
    """A profile entry written by :func:`save_profile` (``{"version", "graph", "step", "static",
    "transfer_elem"}``), or None (none, another cost model version, or the cache off)."""
    return read(path)


def save_profile(path: str, entry: dict) -> None:
    """Keep a graph's profile (with the cache on; atomically)."""
    if config.settings().plan_cache:
        save_entry(path, dict(entry, version=COST_MODEL_VERSION))


def read(path: str) -> dict | None:
    if not config.settings().plan_cache:
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
        return entry if entry.get("version") == COST_MODEL_VERSION else None
    except (OSError, ValueError):
        return None


def usable(
    entry: dict | None, budget: int, host_budget: int | None = None
) -> tuple[dict | None, list[int], str | None]:
    """``(entry to serve or None, predicted peaks of plans that failed, why the entry is not
    served)``. A plan that ran out of memory or gave a non-finite loss is never served again; nor
    one whose predicted peak exceeds the budget asked for now, or whose host bytes exceed what the
    host may pin now (``host_budget``)."""
    if entry is None:
        return None, [], None
    failed = [int(x) for x in entry.get("failed_peaks", [])]
    outcome = (entry.get("outcome") or {}).get("status")
    if outcome in ("oom", "nonfinite"):
        what = "ran out of device memory" if outcome == "oom" else "gave a non-finite loss"
        return (
            None,
            failed,
            f"the cached plan for this graph {what} before: not served again; planned anew",
        )
    if over := _reserved_overrun(entry):
        return (
            None,
            failed,
            f"the cached plan's reserved peak measured {format_bytes(over[0])}, over the "
            f"{format_bytes(over[1])} it predicted: the allocator kept {format_bytes(over[2])} "
            "reserved but free at the peak; planned anew with that budgeted",
        )
    at_step = steps_at_opt_step(entry)
    if bool(at_step) != bool((entry.get("predicted") or {}).get("cpu_steps_at_opt_step")):
        priced, ran = (
            ("beside", f"at opt.step() ({at_step})") if at_step else ("after", "beside it")
        )
        return (
            None,
            failed,
            f"the cached plan priced the offloaded chunks' CPU steps {priced} backward, but the "
            f"training loop ran them {ran}: planned anew for that",
        )
    peak = (entry.get("predicted") or {}).get("peak_bytes")
    if peak is None or peak > budget:
        return (
            None,
            failed,
            (
                f"the cached plan needs {format_bytes(peak)}, more than the budget "
                f"({format_bytes(budget)}): planned anew"
            ),
        )
    host = (entry.get("predicted") or {}).get("host_bytes") or 0
    if host_budget is not None and host > host_budget:
        why = (
            f"the cached plan needs {format_bytes(host)} of host memory, more than protrain may "
            f"pin now ({format_bytes(max(0, host_budget))}): planned anew"
        )
        return None, failed, why
    return entry, failed, None


def grads_held(entry: dict | None, optimizer, seen: str | None) -> str | None:
    """Why the training loop keeps gradients from one backward to the next forward, so that the
    plan counts resident gradients through the whole step (``Hardware.grads_held``): ``seen`` at a
    forward of this process (compiled_graph.ProtrainGraph), declared micro-steps
    (``protrain_fx.set_grad_accumulation``), or as the graph's cached plan priced it; None
    otherwise."""
    micro = getattr(optimizer, "_protrain_micro_steps", 1) if optimizer is not None else 1
    return (
        seen
        or (
            f"the loop keeps gradients between steps ({micro} micro-steps declared)"
            if micro > 1
            else None
        )
        or ((entry or {}).get("predicted") or {}).get("grads_held")
        or ((entry or {}).get("measured") or {}).get("grads_held")
    )


def micro_steps(entry: dict | None, optimizer) -> tuple[int, str | None]:
    """Backward passes per optimizer step that the next plan of this graph prices
    (``Hardware.micro_steps``), and where the count comes from: declared
    (``protrain_fx.set_grad_accumulation``), else as the plan's last run measured (profiling/
    step_meter.py), else as the cached plan priced it, and at least what this run has seen before
    its first ``opt.step()`` (a forward found the last backward's gradients, not zeroed:
    compiled_graph.ProtrainGraph._kept_grads); ``(1, None)`` where nothing says more."""
    declared = getattr(optimizer, "_protrain_micro_steps", None) if optimizer is not None else None
    if declared:
        return int(declared), "declared"
    measured, predicted = (entry or {}).get("measured") or {}, (entry or {}).get("predicted") or {}
    if measured.get("iter_s") is not None:  # the plan's last run tells
        k = int(measured.get("micro_steps") or 1)
        return k, ("as the loop's last run counted" if k > 1 else None)
    k = int((predicted.get("breakdown") or {}).get("micro_steps") or 1)
    seen = int(getattr(optimizer, "_protrain_micro_steps_seen", 0) or 0) if optimizer else 0
    if seen > k:
        return seen, (
            "at least: a forward found the last backward's gradients, not zeroed, before any "
            "opt.step(); the step meter counts them"
        )
    return k, ("as an earlier run counted" if k > 1 else None)


def unfit(cached: dict, grads_held: str | None, micro: tuple, placement: tuple | None):
    """Why a usable cached plan is not served after all (None where it is): it did not price what
    the loop does (kept gradients; ``micro``: the micro-steps per optimizer step and where that
    count comes from, :func:`micro_steps`), or its knobs cannot run on the chunk placement the graph
    already has (``placement``: chunk size, the n_persist fixed or None where resident chunks may
    move to the host, the chunks resident now; None for a first plan): its chunk size, and at most
    the chunks resident now (they move to the host, never back), or exactly those if fixed."""
    predicted, knobs = cached["predicted"], cached["knobs"]
    if grads_held and not predicted.get("grads_held"):
        return f"{grads_held}, which the cached plan did not price: planned anew"
    priced = (predicted.get("breakdown") or {}).get("micro_steps") or 1
    if micro[0] != priced:
        return f"{micro[0]} micro-steps a step ({micro[1]}), which the cached plan did not price"
    if placement is not None:
        size, fixed, resident = placement
        n = knobs.get("n_persist", 0)
        if knobs.get("chunk_size") != size or (n > resident if fixed is None else n != fixed):
            return (
                f"the cached plan keeps {n} chunks of {knobs.get('chunk_size')} bytes resident, "
                f"which this graph's placement ({resident} resident, chunks of {size} bytes) "
                "cannot take on: planned anew"
            )
    return None


def steps_at_opt_step(entry: dict | None) -> str | None:
    """Why the training loop of the graph whose entry this is steps the offloaded chunks at
    ``opt.step()`` (it clips gradients or sets hyperparameters between backward and step, as the
    plan's last run measured: profiling/step_meter.py), which the next plan prices after backward
    (``Hardware.steps_at_opt_step``); None where they ran beside backward."""
    measured, predicted = (entry or {}).get("measured") or {}, (entry or {}).get("predicted") or {}
    if measured.get("iter_s") is not None:  # the plan's last run tells
        return measured.get("cpu_steps_at_opt_step")
    return "as an earlier run measured" if predicted.get("cpu_steps_at_opt_step") else None


def _reserved_overrun(entry: dict | None) -> tuple[int, int, int] | None:
    """``(measured reserved peak, predicted, measured reserved-but-free bytes)`` where the plan's
    last run (profiling/step_meter.py: steps after the first, on CUDA) measured a reserved peak over
    the prediction by more than :data:`RESERVED_TOLERANCE` with more reserved but free than the
    plan budgeted (the allocator's doing, not a larger allocated peak); None otherwise, and None
    where the process allocated more than :data:`ALLOCATED_TOLERANCE` over the plan's allocated
    peak (the peaks are the process's: the gap is not this plan's to budget). The bytes are the
    reserved peak over the larger of the measured and the predicted allocated peak: where the plan
    over-predicted what it allocates, the allocator's extra reserve filled room the prediction held
    anyway (H100, loop_at_scale_h100_run58a: 23.21 GiB reserved, 19.78 allocated against 22.26
    predicted; budgeting the 3.39 GiB between the measured peaks on top of the next prediction kept
    8 chunks fewer resident, and its reserved peak came 2 GiB under the prediction, run 58b)."""
    measured, predicted = (entry or {}).get("measured") or {}, (entry or {}).get("predicted") or {}
    reserved, allocated = measured.get("peak_bytes"), measured.get("peak_allocated_bytes")
    peak, peak_allocated = predicted.get("peak_bytes"), predicted.get("peak_allocated_bytes")
    if not (reserved and allocated and peak and peak_allocated):
        return None
    # the process held more than this plan (other graphs, regional blocks, the user's tensors)
    if allocated > peak_allocated * (1 + ALLOCATED_TOLERANCE):
        return None
    gap = reserved - max(allocated, peak_allocated)
    if reserved > peak * (1 + RESERVED_TOLERANCE) and gap > peak - peak_allocated:
        return int(reserved), int(peak), int(gap)
    return None


def allocator_gap(entry: dict | None) -> int:
    """The reserved-but-free bytes the next plan of this graph budgets over its allocated peak: what
    the last run measured where its reserved peak overran the prediction, or what the plan it ran
    budgeted so already (``predicted["allocator_gap_bytes"]``), the larger; 0 where none was
    measured (the allocator's constants then: machine/allocator.py)."""
    over = _reserved_overrun(entry)
    kept = ((entry or {}).get("predicted") or {}).get("allocator_gap_bytes") or 0
    return max(int(kept), over[2] if over else 0)


def save_entry(path: str, entry: dict) -> None:
    """Write a plan cache entry (plan.json: knobs, predicted and measured, outcome), atomically; a
    read-only cache must not stop training (a warning)."""
    profile.write_json(path, entry, "the plan cache entry")


def entry(
    graph: str,
    knobs: dict,
    predicted: dict,
    measured: dict | None,
    chunks: list | None = None,
    failed_peaks: list | None = None,
    outcome: dict | None = None,
) -> dict:
    """plan.json: the knobs, predicted and measured time and peak (and the chunk table once
    compiled), the predicted peaks of earlier plans for this graph that ran out of memory, and this
    plan's outcome (None while it trains fine; ``{"status": "oom" | "nonfinite", "detail": ...}``
    once it did not)."""
    return {
        "version": COST_MODEL_VERSION,
        "graph": graph,
        "knobs": knobs,
        "predicted": predicted,
        "measured": measured,
        "chunks": chunks,
        "failed_peaks": list(failed_peaks or []),
        "outcome": outcome,
    }


def _knobs_of(plan) -> dict:
    """The knobs a cache entry keeps for ``plan``: the ones it was decided with (the placement
    normalizes some: a plan with every chunk resident runs with n_buffer 0 whatever was searched).
    Kept as normalized, the next run compiled from other options than the run that filled the
    compile cache, whose keys then missed (run 41: the 1.42 B GPT's warm run compiled its 4 codes
    again, searched with n_buffer 1 and cached with 0)."""
    decided = getattr(plan, "decided_knobs", None)
    if decided and set(decided) == set(KNOBS):
        return dict(decided)
    return {k: getattr(plan, k) for k in KNOBS}


def save_plan(path: str, plan, outcome: dict | None = None) -> None:
    """Rewrite a cache entry from a compiled plan (its measured side filled by the step meter). An
    outcome once recorded stays; one that ran out of memory adds its predicted peak to
    ``failed_peaks``."""
    old = read(path) or {}
    failed = list(old.get("failed_peaks", []))
    outcome = outcome or old.get("outcome")
    peak = (plan.predicted or {}).get("peak_bytes")
    if outcome and outcome.get("status") == "oom" and peak is not None and peak not in failed:
        failed.append(peak)
    save_entry(
        path,
        entry(
            plan.graph_name,
            _knobs_of(plan),
            plan.predicted,
            plan.measured,
            [c.to_dict() for c in plan.chunks],
            failed,
            outcome,
        ),
    )
