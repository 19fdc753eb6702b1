"""One system on one model, in a process of its own (``run.py --one SYSTEM --spec JSON``): build it,
warm it up (compiling), then, holding the timing lock exclusive (benchmarks/timeshare.py), time
``steps`` steps with a device synchronize after each, and print the measured columns as one
``RESULT`` JSON line. Any failure becomes that line's ``error``, and the process leaves without
teardown, so that no row goes missing and nothing left behind can hang the exit.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import peers
import timeshare
import torch
import trace_summary
from peers import SYSTEMS

from .failures import error_result


def run_one(system: str, spec: dict) -> dict:
    """Build, warm up (compiles), time ``steps`` steps alone; the row's measured columns."""
    import resource

    sysdef = SYSTEMS[system]
    cuda = spec["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("needs CUDA: no CUDA device is visible")
    if sysdef.cuda_only and not cuda:
        raise RuntimeError(f"needs CUDA: {system} runs on a GPU only (device {spec['device']})")
    limit = spec["cap_gib"] or spec.get("soft_cap_gib")
    if cuda and limit:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit * 2**30 / total))
    g = torch.Generator().manual_seed(0)
    vocab = spec["cfg"]["vocab_size"]
    x = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g).to(spec["device"])
    y = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g).to(spec["device"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # the process before the model (libraries, the CUDA context): what a plan's host bytes are
    # measured above
    from protrain_fx.machine.pinned import resident_bytes

    rss = resident_bytes()[0]
    host_base_gib = rss / 2**30 if rss is not None else None

    def say(what: str) -> None:
        print(f"[{system}] {what}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    step, n_params, extra = sysdef.fn(spec, x, y)
    build_s = time.perf_counter() - t0
    say(f"built in {build_s:.1f} s")
    t0 = time.perf_counter()
    # the first compiles (and protrain learns the optimizer's step pattern)
    for i in range(spec["warmup"]):
        step()
        sync()
        say(f"warm-up step {i + 1} done at {time.perf_counter() - t0:.1f} s")
    warmup_s = time.perf_counter() - t0
    if cuda and spec.get("settle"):
        # hand cached blocks back while others run; one untimed step re-fills the cache
        torch.cuda.empty_cache()
    t_wait = time.perf_counter()
    with timeshare.measuring():
        wait_s = time.perf_counter() - t_wait
        if spec.get("settle"):
            step()
            sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        # spec["phase_times"] (peers._plain_step): the timed steps' only
        if hasattr(step, "phases"):
            step.phases.clear()
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
        # the allocator hit its limit (the cap) and freed its cache to retry: slower steps, part of
        # the result under a real cap, a reason to run again alone under a soft one
        # (scheduler.run_job)
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0 if cuda else None
        phases = peers.phase_ms(step) if cuda else None
        # one more step under torch.profiler: where its device time went
        # (benchmarks/trace_summary.py)
        trace = cuda and spec.get("trace")
        traced = trace_summary.trace_step(step, spec["trace"]) if trace else None
    med = statistics.median(times)
    res = {
        "params": n_params,
        "tokens_per_s": spec["batch"] * spec["seq"] / med,
        "peak_gib": peak,
        "peak_reserved_gib": reserved,
        "alloc_retries": retries,
        "step_ms": med * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        "step_ms_max": max(times) * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "loss": float(loss.detach().float()),
        "build_s": build_s,
        "warmup_s": warmup_s,
        "turn_wait_s": wait_s,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "host_base_gib": host_base_gib,
    }
    if phases:
        res["phase_ms"] = phases
    if traced:
        res["trace"] = traced
    res.update(extra())
    return res


def child_main(system: str, spec: dict) -> None:
    try:
        res = run_one(system, spec)
    except BaseException as e:  # the row shows the error instead of going missing
        import traceback

        traceback.print_exc()
        res = error_result(e)
    print("RESULT " + json.dumps(res, default=str), flush=True)
    sys.stderr.flush()
    # no teardown: worker threads or process groups left behind cannot hang or crash the exit
    os._exit(0)
