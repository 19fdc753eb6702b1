"""The benchmark suite: protrain against the systems a user would pick instead, every system in its
own subprocess, one JSON + one markdown table + one PNG bar chart per run.

    bash scripts/bootstrap.sh             # on the GPU machine: .venv reusing its torch
    .venv/bin/python benchmarks/run.py    # every scenario and system (an hour or more on an H200)
    .venv/bin/python benchmarks/run.py --scenarios gpt1.4b,gpt1.4b-cap24 --deadline 540 \\
        --out $OUT/suite_gpt
    .venv/bin/python benchmarks/run.py --scenarios maxmodel --systems protrain,compile \\
        --out $OUT/suite_max
    # one table of several runs
    python benchmarks/run.py --merge a.json b.json --out benchmarks/results/suite_h200
    # CPU smoke (CI): tiny GPT, 1 + 1 steps per system
    python benchmarks/run.py --smoke --out /tmp/smoke

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``; the JSON and table are rewritten after every
row (the chart at most every 20 s, and at the end), so a run cut short leaves what it measured
(``--merge`` on its JSON redraws everything). One row per scenario and system: ``{scenario, system,
model, params, cap_gib, batch, seq, tokens_per_s, tflops, peak_gib, ratio_to_ceiling, error, ...}``;
a system that fails, crashes, times out or is not started (a predicted OOM, the run's deadline) is a
row whose ``error`` says why, never a missing row.

Systems (benchmarks/peers.py): protrain (automatic plan; its options are set in one place there),
compile (torch.compile Inductor, everything on the device: the ceiling), eager, fsdp2_offload (FSDP2
CPUOffloadPolicy, fused CPU AdamW), ds_zero2_offload, ds_zero3_offload (DeepSpeed ZeRO-2 optimizer
offload; ZeRO-3 parameter + optimizer offload), torchao_offload (torchao CPUOffloadOptimizer),
compile_ac (torch.compile with activation_memory_budget).

Scenarios (--scenarios, comma separated, or ``all``, the default):
  gpt1.4b        ../shared/ANCHORS.md's GPT (d 2048, 24 layers, 16 heads, vocab 50304, untied:
                 1.42 B), batch 8 x 1024, bf16, uncapped
  gpt1.4b-cap24  the same at a 24 GiB cap (torch.cuda.set_per_process_memory_fraction)
  llama          LLaMA-style (LLaMA-2-7B's width 4096, 32 heads, SwiGLU 11008, vocab 32000) at
                 --llama-layers (default 28: 5.93 B, the depth whose offloaded model states, up to
                 18 B/param, fit a 128 GiB host with room to spare; 32 gives the 6.74 B original),
                 batch 2 x 1024, uncapped, torch.compile only: the ceiling of the next scenario
  llama-cap40    the same at a 40 GiB cap, all systems
  maxmodel       per system, the largest GPT of width --search-width (4096) it trains on the whole
                 device, batch 4 x 1024: depth doubles from --search-start (8) until the first
                 failure; --search-refine bisects after it

Timing: every system runs --warmup steps (compilation included), then --steps timed steps, each
followed by a device synchronize; tokens/s is batch x seq over the *median* step time. Sizes that
certainly do not fit (model states alone over the cap or the host's memory, by the lower bounds in
peers.py) are rows marked ``(predicted, not run)`` (--no-predict runs them).

Side by side (--jobs, default 3 on CUDA): systems build, compile and warm up concurrently, admitted
by claimed device and host memory, but a timed step never overlaps anything, and the systems that
keep model states in host memory are alive one at a time (benchmarks/timeshare.py). An uncapped
system sharing the device is capped at its claim; one that fails for memory next to others (or
under that claim), or whose allocator had to free its cache to retry under it, runs again alone.
--jobs 1: one at a time.

DeepSpeed and torchao come from .whl/ (benchmarks/fetch_peer_wheels.sh fetches them; carry .whl to
the GPU machine): on CUDA, when the folder exists, they are installed into /tmp/site (once per
machine, in the background while other systems compile) and /tmp/site is put on those systems'
PYTHONPATH only.
"""

# This file is the command line: options and dispatch. The suite itself is benchmarks/suite/ (its
# __init__ names the modules); children are ``run.py --one SYSTEM --spec JSON`` (suite/child.py).
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--one" in sys.argv:  # a child: take its lock turn before torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import timeshare

    timeshare.start_busy()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peers import SYSTEMS  # noqa: E402
from suite import child, machine, merging, runner  # noqa: E402
from suite.scenarios import scenarios  # noqa: E402
from suite.scheduler import Ctx  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--scenarios",
        default="all",
        help="comma list (gpt1.4b, gpt1.4b-cap24, llama, llama-cap40, maxmodel) or 'all' (default)",
    )
    ap.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS)
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU smoke: tiny GPT, 1 warm-up + 1 timed step per system",
    )
    ap.add_argument(
        "--device", default=None, help="cuda (default when present; --smoke: cpu) or cpu"
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 4; --smoke 1)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up steps, compiling included (default 3; --smoke 1)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="systems built and compiled at once; timed steps are always alone "
        "(benchmarks/timeshare.py). Default 3; --smoke on the CPU 2",
    )
    ap.add_argument(
        "--timeout", type=float, default=600, help="seconds per system run (build, compile, steps)"
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole run (default: none): systems still running then "
        "are stopped and later ones get rows saying they were not run (set it below a "
        "device command's limit; 0 or less: nothing starts, every row says so)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="output path without extension (default "
        "benchmarks/results/suite; --smoke: /tmp/protrain_smoke)",
    )
    ap.add_argument(
        "--ac-budget", type=float, default=0.5, help="compile_ac's activation_memory_budget"
    )
    ap.add_argument(
        "--protrain-options",
        type=json.loads,
        default={},
        help="JSON object merged into protrain's options (after "
        "peers.PROTRAIN_OPTIONS); null drops a key",
    )
    ap.add_argument(
        "--llama-layers", type=int, default=28, help="LLaMA depth (28: 5.93 B; 32: 6.74 B)"
    )
    ap.add_argument("--llama-batch", type=int, default=2)
    ap.add_argument(
        "--host-gib",
        type=float,
        default=None,
        help="host memory for the offloading systems (default: MemAvailable at start; "
        "0: no host checks)",
    )
    ap.add_argument(
        "--no-predict",
        action="store_true",
        help="run sizes whose OOM is predicted from lower bounds",
    )
    ap.add_argument("--search-width", type=int, default=4096)
    ap.add_argument(
        "--search-start", type=int, default=8, help="first depth of the doubling search"
    )
    ap.add_argument("--search-max-layers", type=int, default=256)
    ap.add_argument("--search-batch", type=int, default=4)
    ap.add_argument("--search-steps", type=int, default=2)
    ap.add_argument("--search-warmup", type=int, default=1)
    ap.add_argument(
        "--search-refine", type=int, default=0, help="bisection steps after the first failure"
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run, with its memory claims, and what would not "
        "(predicted failures); run nothing. Without a GPU it assumes an H200 "
        "(139.8 GiB)",
    )
    ap.add_argument(
        "--resume",
        default=None,
        help="a JSON this command wrote before (a run the device call's time cut "
        "short): its rows that ran, failures included, are kept and only the rest run, "
        "so the same command repeated over several device calls completes the suite",
    )
    ap.add_argument(
        "--rerun-attempt",
        action="append",
        default=[],
        metavar="SYSTEM@LAYERS",
        help="with --resume: measure this maxmodel attempt again (its search goes on "
        "from the others), e.g. after a fix of the system; repeatable",
    )
    ap.add_argument(
        "--merge", nargs="+", default=None, help="JSON files of earlier runs to combine into --out"
    )
    ap.add_argument(
        "--note", action="append", default=[], help="with --merge: a line for the table's notes"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        cuda = torch.cuda.is_available() or args.dry_run
        args.device = "cpu" if args.smoke or not cuda else "cuda"
    if args.steps is None:
        args.steps = 1 if args.smoke else 4
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    if args.jobs is None:
        args.jobs = 2 if args.smoke and args.device == "cpu" else 3
    rerun: dict[str, set[int]] = {}
    for spec in args.rerun_attempt:
        system, _, layers = spec.partition("@")
        if system not in SYSTEMS or not layers.isdigit():
            ap.error(
                f"--rerun-attempt {spec!r}: SYSTEM@LAYERS with SYSTEM one of {', '.join(SYSTEMS)}"
            )
        rerun.setdefault(system, set()).add(int(layers))
    if rerun and not args.resume:
        ap.error("--rerun-attempt goes with --resume (the run whose attempt to measure again)")
    args.rerun_attempt = rerun
    if args.out is None:
        args.out = "/tmp/protrain_smoke" if args.smoke else os.path.join(HERE, "results", "suite")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        child.child_main(args.one, json.loads(args.spec))
        return
    if args.merge:
        merging.merge(args, parse_args)
        return
    all_sc = scenarios(args)
    names = list(all_sc) if args.smoke or args.scenarios == "all" else args.scenarios.split(",")
    systems = args.systems.split(",")
    unknown = [n for n in names if n not in all_sc] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(
            f"unknown scenario/system {unknown}; scenarios: {', '.join(all_sc)}; "
            f"systems: {', '.join(SYSTEMS)}"
        )
    if args.device != "cuda":
        device, total = f"CPU ({platform.machine()})", 0.0
    elif args.dry_run and not torch.cuda.is_available():
        device, total = "an assumed H200 (--dry-run without a GPU)", 139.8
    else:
        device, total = machine.gpu_info()
    # MemAvailable, capped by the cgroup; $PROTRAIN_HOST_MEMORY
    from protrain_fx.machine.memory import host_memory

    avail, host_total = (b / 2**30 for b in host_memory())
    host = avail if args.host_gib is None else (args.host_gib or None)
    ctx = Ctx(args, total, host)
    if args.dry_run:
        runner.dry_run(names, systems, all_sc, ctx, device)
        return
    host_line = machine.host_description(avail, host_total)
    runner.run_suite(
        ctx, names, systems, all_sc, device, host_line, sys.argv[1:] if argv is None else list(argv)
    )


if __name__ == "__main__":
    main()
