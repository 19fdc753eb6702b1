"""Running the children side by side: :class:`Ctx` is what the parent's task threads share (the
run's deadline, the admission slots, the timing lock, the children alive); :func:`run_job` turns one
system on one model into a row, waiting for admission by its memory claims
(benchmarks/timeshare.py), for the host-heavy turn an offloading system takes across parents, and
for its time limit out of what the deadline leaves, then running the child and, when a result
obtained next to others or under a soft cap does not stand, running it again alone;
:func:`run_child` starts one ``run.py --one`` process in its own process group and returns its
RESULT, or an error made from how it ended.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import timeshare
from peers import SYSTEMS

from .admission import HEAVY_HOST_GIB, HOST_MARGIN_GIB, claims, predicted_failure
from .failures import exit_error, rerun_reason, tail
from .scenarios import base_row

RUN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run.py")
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class Ctx:
    """What the parent's task threads share."""

    def __init__(self, args, device_total_gib: float, host_avail_gib: float | None):
        self.args = args
        self.device_total_gib = device_total_gib
        self.host_avail_gib = host_avail_gib
        self.t_start = time.monotonic()
        self.deadline_at = None if args.deadline is None else self.t_start + args.deadline
        cap_host = (host_avail_gib - HOST_MARGIN_GIB) if host_avail_gib else float("inf")
        self.slots = timeshare.Slots(
            args.jobs, device_total_gib or float("inf"), cap_host, HEAVY_HOST_GIB
        )
        self.lock_path = None
        self.own_lock_dir = None  # the folder this run made for its lock (removed at the end)
        if args.jobs > 1:
            # a lock named in the environment is shared with another benchmark parent (on the other
            # GPU)
            self.lock_path = os.environ.get(timeshare.LOCK_ENV)
            if not self.lock_path:
                self.own_lock_dir = tempfile.mkdtemp(prefix="protrain_bench_")
                self.lock_path = os.path.join(self.own_lock_dir, "turns.lock")
        self.peer_site: concurrent.futures.Future | None = None
        self.procs: set = set()
        self.stopping = False
        self.lock = threading.Lock()


def run_child(argv: list[str], env: dict, timeout: float, ctx: Ctx | None = None) -> dict:
    """Run ``run.py --one ...``; its RESULT, or an error made from how it ended."""
    # its own process group, so that a timeout ends its children too (ninja builds, compile
    # workers); not a new session, so that whoever ends this process's session (a device run at its
    # time limit) ends the child too
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **group
    )
    if ctx is not None:
        with ctx.lock:
            ctx.procs.add(p)
    try:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            kill_group(p)
            out, err = p.communicate()
            return {"error": f"timed out after {timeout:.0f} s; last output: {tail(err, out)}"}
    finally:
        if ctx is not None:
            with ctx.lock:
                ctx.procs.discard(p)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[len("RESULT ") :])
    return exit_error(p.returncode, out, err, ctx is not None and ctx.stopping)


def kill_group(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def time_left(ctx: Ctx) -> float:
    return float("inf") if ctx.deadline_at is None else ctx.deadline_at - time.monotonic()


def run_job(scenario: str, system: str, sc: dict, ctx: Ctx, priority: float = 0) -> dict:
    """One system on one model: a row (measured, or with the error)."""
    args = ctx.args
    row = base_row(scenario, system, sc)
    t0 = time.monotonic()
    row["error"] = predicted_failure(system, row, ctx)
    if row["error"] is None and SYSTEMS[system].wheels and ctx.peer_site is not None:
        # DeepSpeed / torchao installed (in the background, while others compile)
        ctx.peer_site.result()
    dev, host, soft = claims(system, row, sc, ctx)
    alone = False
    while row["error"] is None:
        if ctx.stopping:
            row["error"] = "stopped: the suite was interrupted before this system ran"
            break
        if time_left(ctx) < 30:
            row["error"] = f"not run: the run's --deadline ({args.deadline:g} s) was reached"
            break
        with ctx.slots.claim(
            dev, host, exclusive=alone, priority=priority, label=f"{system}@{row['model']}"
        ) as claim:
            left = time_left(ctx)
            if ctx.stopping:
                row["error"] = "stopped: the suite was interrupted before this system ran"
                break
            if left < 30:
                row["error"] = f"not run: the run's --deadline ({args.deadline:g} s) was reached"
                break
            soft_cap = None if alone else soft
            # another parent on the machine: one host-heavy child alive on it, taken before the
            # child starts
            heavy_lock = os.environ.get(timeshare.HEAVY_LOCK_ENV) if host > HEAVY_HOST_GIB else None
            turn_until = None if ctx.deadline_at is None else ctx.deadline_at - 30
            with timeshare.host_heavy_turn(heavy_lock, turn_until) as turn:
                left = time_left(ctx)
                if not turn or ctx.stopping or left < 30:
                    row["error"] = (
                        "stopped: the suite was interrupted before this system ran"
                        if ctx.stopping
                        else f"not run: the run's --deadline ({args.deadline:g} s) was reached "
                        "while waiting for the host-heavy turn (another parent's offloading "
                        "system)"
                    )
                    break
                timeout = min(args.timeout, left - 5)
                res = run_child(
                    child_argv(system, sc, ctx, soft_cap), child_env(system, ctx), timeout, ctx
                )
            shared, neighbours = claim.shared, sorted(claim.neighbours)
        if timeout < args.timeout and (res.get("error") or "").startswith("timed out"):
            res["error"] = (
                f"not run to the end: the run's --deadline ({args.deadline:g} s) "
                f"stopped it after {timeout:.0f} s; {res['error']}"
            )
        why = None if alone or ctx.stopping else rerun_reason(res, soft_cap, shared)
        if why:
            row["first_try_error"] = why
            # its neighbours or its soft cap may be the cause: run it again with the machine to
            # itself
            alone = True
            continue
        if res.get("params") is None:
            res.pop("params", None)
        row.update(res)
        row["ran_alone"] = not shared
        # other children alive at some point of its run (never measuring)
        row["alive_next_to_it"] = neighbours
        break
    row["wall_s"] = round(time.monotonic() - t0, 1)
    if row["tokens_per_s"]:
        row["tflops"] = row["tokens_per_s"] * row["flops_per_token"] / 1e12
    return row


def child_argv(system: str, sc: dict, ctx: Ctx, soft_cap: float | None) -> list[str]:
    args = ctx.args
    spec = {k: sc[k] for k in ("kind", "cfg", "batch", "seq", "cap_gib")}
    spec.update(
        device=args.device,
        steps=sc.get("steps", args.steps),
        warmup=sc.get("warmup", args.warmup),
        settle=args.jobs > 1 and args.device == "cuda",
        ac_budget=args.ac_budget,
        protrain_options=args.protrain_options,
        soft_cap_gib=soft_cap,
    )
    return [sys.executable, RUN_PY, "--one", system, "--spec", json.dumps(spec)]


def child_env(system: str, ctx: Ctx) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop(timeshare.HEAVY_LOCK_ENV, None)  # the parent holds it for the child (run_job)
    if ctx.lock_path:
        env[timeshare.LOCK_ENV] = ctx.lock_path
    if ctx.lock_path and ctx.args.device == "cuda":
        # side-by-side compiles share the cores (and fewer compile workers means less host memory)
        threads = max(1, (os.cpu_count() or 1) // ctx.args.jobs)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    if SYSTEMS[system].wheels and ctx.peer_site is not None and ctx.peer_site.result():
        paths = [ctx.peer_site.result(), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env
