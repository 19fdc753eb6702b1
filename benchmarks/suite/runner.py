"""One call of the suite from start to end: the jobs asked for (scenario x system), one thread each,
with admission (benchmarks/timeshare.py) deciding which children are alive at once; the run's facts
and rows written after every row (the chart at most every 20 s); rows kept from an earlier call
(--resume) not run again; SIGTERM and SIGINT ending the children and leaving rows that say so.
:func:`dry_run` lists what a call would start, with its memory claims, and what it would not, and
why, running nothing.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import shutil
import signal
import time

import peers
import torch

from . import machine
from .admission import HEAVY_HOST_GIB, claims, predicted_failure
from .outputs import fmt_error, fmt_num, fmt_params, write_outputs
from .resume import resumed_rows, searches_to_continue
from .scenarios import FLOPS_FORMULA, SEQ, base_row, llama_cfg, model_label, model_stats, search_cfg
from .scheduler import Ctx, kill_group, run_job
from .size_search import search


def run_suite(
    ctx: Ctx,
    names: list[str],
    systems: list[str],
    all_sc: dict,
    device: str,
    host: str,
    argv: list[str],
) -> None:
    """Run ``systems`` on the scenarios ``names`` (of ``all_sc``) and write ``--out``; ``device``
    and ``host``: the outputs' descriptions of the machine; ``argv``: the command's arguments."""
    args = ctx.args
    peer_install: dict = {}
    todo = [(n, s) for n in names for s in systems if s in all_sc[n]["systems"]]
    if args.device == "cuda" and any(peers.SYSTEMS[s].wheels for _, s in todo):
        ctx.peer_site = concurrent.futures.ThreadPoolExecutor(1).submit(
            machine.install_peer_wheels, ctx.lock_path, peer_install
        )
    shown = {**peers.PROTRAIN_OPTIONS, **args.protrain_options}
    llama = llama_cfg(args.llama_layers)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": device,
        "device_gib": round(ctx.device_total_gib, 1),
        "torch": torch.__version__,
        "argv": argv,
        "host": host,
        "host_gib_for_checks": ctx.host_avail_gib,
        "flops_formula": FLOPS_FORMULA,
        "ac_budget": args.ac_budget,
        "protrain_options_shown": {k: v for k, v in shown.items() if v is not None},
        "protrain_defaults": {"PROTRAIN_OPTIONS": peers.PROTRAIN_OPTIONS},
        "warmup": args.warmup,
        "steps": args.steps,
        "jobs": args.jobs,
        "timeout_s": args.timeout,
        "deadline_s": args.deadline,
        "peer_install": peer_install,
        "llama": (
            f"{model_label('llama', llama)} "
            f"({fmt_params(model_stats('llama', llama, SEQ)[0])}: LLaMA-2-7B's width, "
            f"heads, FFN and vocab at {args.llama_layers} of its 32 layers), "
            f"batch {args.llama_batch} x {SEQ}, at 40 GiB (all systems) and uncapped "
            "(torch.compile only, the ceiling)"
        ),
        "search": {
            k: getattr(args, "search_" + k)
            for k in ("width", "start", "max_layers", "batch", "steps", "warmup", "refine")
        },
        "rows": [],
    }

    def report(row: dict, what: str) -> None:
        status = (
            f"ERROR {fmt_error(row['error'], 300)}"
            if row["error"]
            else f"{row['tokens_per_s']:,.0f} tokens/s, peak {fmt_num(row['peak_gib'], '.1f')} GiB"
        )
        print(f"[{what}] {row['system']}: {status} ({row['wall_s']:.0f} s)", flush=True)

    rows: dict[int, dict] = {}
    # maxmodel searches an earlier call's deadline stopped: go on from their attempts
    cut: dict[int, dict] = {}
    last_chart = [0.0]
    if args.resume:  # keep what an earlier run of this suite measured (or saw fail); run the rest
        rows.update(resumed_rows(args.resume, todo, args.search_refine, args.rerun_attempt))
        cut = searches_to_continue(args.resume, todo, args.search_refine, args.rerun_attempt)
        out["resumed_from"] = {"path": args.resume, "kept": len(rows)}
        out["rows"] = [rows[k] for k in sorted(rows)]
        print(f"resuming {args.resume}: {len(rows)} of {len(todo)} rows kept", flush=True)

    def one(i: int) -> None:
        name, system = todo[i]
        if name == "maxmodel":
            row = search(system, all_sc[name], ctx, report, priority=i, earlier=cut.get(i))
        else:
            row = run_job(name, system, all_sc[name], ctx, priority=i)
            report(row, name)
        with ctx.lock:
            rows[i] = row
            out["rows"] = [rows[k] for k in sorted(rows)]
            out["wall_s"] = round(time.monotonic() - ctx.t_start, 1)
            # the chart at most every 20 s (and at the end)
            chart = time.monotonic() - last_chart[0] > 20
            write_outputs(out, args.out, chart)
            if chart:
                last_chart[0] = time.monotonic()

    def stop(signum, frame):  # noqa: ARG001
        ctx.stopping = True
        with ctx.lock:
            for p in list(ctx.procs):
                kill_group(p)

    if not todo:
        print(f"nothing to run: scenarios {names} have none of the systems {systems}", flush=True)
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:  # one thread per task; timeshare.Slots decides which children run at once
        with concurrent.futures.ThreadPoolExecutor(max(1, len(todo))) as pool:
            for f in [pool.submit(one, i) for i in range(len(todo)) if i not in rows]:
                f.result()
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    out["wall_s"] = round(time.monotonic() - ctx.t_start, 1)
    write_outputs(out, args.out)
    # never a lock named in the environment (its folder is someone else's: /tmp)
    if ctx.own_lock_dir:
        shutil.rmtree(ctx.own_lock_dir, ignore_errors=True)
    print(
        f"wrote {args.out}.json, .md, .png ({len(out['rows'])} rows, {out['wall_s']:.0f} s)",
        flush=True,
    )


def dry_run(names: list[str], systems: list[str], all_sc: dict, ctx: Ctx, device: str) -> None:
    """What a run would start, and with which claims; what it would not start, and why. Nothing
    runs."""
    args = ctx.args
    host = f"{ctx.host_avail_gib:.0f} GiB" if ctx.host_avail_gib else "unchecked"
    print(
        f"dry run: {device} ({ctx.device_total_gib:.1f} GiB), host memory {host}, "
        f"--jobs {args.jobs}"
    )
    depths = itertools.takewhile(
        lambda n: n <= args.search_max_layers, (args.search_start * 2**i for i in range(20))
    )
    search_cfgs = [search_cfg(args, n) for n in depths]
    for name in names:
        sc = all_sc[name]
        for system in systems:
            if system not in sc["systems"]:
                continue
            cfgs = [sc["cfg"]] if name != "maxmodel" else search_cfgs
            for cfg in cfgs:
                s = dict(sc, cfg=cfg)
                row = base_row(name, system, s)
                why = predicted_failure(system, row, ctx)
                dev, hostc, soft = claims(system, row, s, ctx)
                what = (
                    f"NOT RUN: {why}"
                    if why
                    else (
                        f"claims {dev:.0f} GiB device, {hostc:.0f} GiB host"
                        + (" (host-heavy)" if hostc > HEAVY_HOST_GIB else "")
                        + (f", soft cap {soft:.0f} GiB" if soft else "")
                    )
                )
                print(
                    f"  {name:14s} {system:17s} {row['model']:32s} "
                    f"{fmt_params(row['params']):>9s}  {what}"
                )
