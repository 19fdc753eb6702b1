"""Data-parallel protrain on several GPUs against protrain on one GPU (same per-GPU batch) and FSDP2
``CPUOffloadPolicy`` on the same GPUs, in one run (on the 2-GPU machine):

    .venv/bin/python benchmarks/dp_bench.py --gpus 2 --cap 24 --out $OUT/dp_h200
    # CPU (gloo)
    python benchmarks/dp_bench.py --device cpu --tiny --gpus 2 --steps 2 --out /tmp/dp_smoke
    # one table
    python benchmarks/dp_bench.py --merge run1.json run2.json --out benchmarks/results/dp_h200

The parent launches, one after another, ``torchrun --nproc-per-node=N benchmarks/dp_bench.py --child
SYSTEM`` for protrain with 1 and N processes and FSDP2 with N. Each child caps every GPU at
``--cap`` GiB (``set_per_process_memory_fraction``), builds ../shared/ANCHORS.md's 1.42 B GPT
(``--tiny``: a 2-layer one), trains ``--batch`` x 1024 tokens per rank under bf16 autocast with
fused AdamW, runs ``--warmup`` steps and then ``--steps`` timed steps, each ended by a device
synchronize and a barrier; tokens/s counts every rank's tokens over the median step. Rank 0 prints
the row, with its median forward / backward / optimizer device times (``phase_ms_rank0``, CUDA
events), the allocator's retries and (``--trace``) a profiler trace of one more step. Writes
``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
GPT = dict(
    n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024, tie_embeddings=False
)
TINY = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32, tie_embeddings=False)
NO_MULTICAST = dict(
    NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
)


def child(args) -> None:
    import peers
    import torch
    import torch.distributed as dist
    import trace_summary

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
        if args.cap:
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, args.cap * 2**30 / torch.cuda.get_device_properties(device).total_memory)
            )
    if world > 1 or args.child == "fsdp2":  # FSDP2 needs a process group even alone
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    cfg = TINY if args.tiny else GPT
    seq = cfg["block_size"]
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batch
    x = torch.randint(0, cfg["vocab_size"], (args.batch, seq), generator=g).to(device)
    y = torch.randint(0, cfg["vocab_size"], (args.batch, seq), generator=g).to(device)
    spec = {
        "kind": "gpt",
        "cfg": cfg,
        "device": args.device,
        "batch": args.batch,
        "seq": seq,
        "cap_gib": args.cap,
        "phase_times": True,
    }
    if args.child == "protrain":
        build = peers.protrain
    else:
        build = peers.fsdp2_offload
    # bf16: autocast (protrain) or MixedPrecisionPolicy (FSDP2)
    step, n_params, extra = build(spec, x, y)

    def run():
        loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.barrier()
        return loss

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        run()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        retries0 = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    if hasattr(step, "phases"):  # protrain's step (peers._plain_step): the timed steps' phases only
        step.phases.clear()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = run()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    # the peaks and the allocator's retries (it hit the cap, freed its cache and synchronized) over
    # the timed steps, the largest over the ranks
    peak = torch.tensor(
        [
            torch.cuda.max_memory_reserved(device) / 2**30 if cuda else 0.0,
            torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
            torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries0 if cuda else 0.0,
        ],
        device=device,
    )
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    peak, peak_allocated, alloc_retries = peak.tolist()
    phases = peers.phase_ms(step)  # this rank's (rank 0 prints the row)
    traced = None
    # one more step on every rank (collectives), rank 0's under torch.profiler
    if args.trace and cuda:
        if rank == 0:
            traced = trace_summary.trace_step(run, f"{args.trace}_{args.child}_{world}")
        else:
            run()
    row = {
        "system": args.child,
        "gpus": world,
        "params": n_params,
        "cap_gib": args.cap,
        "batch_per_gpu": args.batch,
        "seq": seq,
        "step_ms": med * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "tokens_per_s": args.batch * seq * world / med,
        "peak_reserved_gib_max": peak,
        "peak_allocated_gib_max": peak_allocated,
        "alloc_retries_max": int(alloc_retries),
        "phase_ms_rank0": phases,
        "trace_rank0": traced,
        "loss": float(loss.detach().float()),
        "warmup_s": warmup_s,
    }
    row.update(
        {
            k: v
            for k, v in extra().items()
            if k
            in (
                "n_persist",
                "n_chunks",
                "n_buffer",
                "n_swap",
                "n_checkpoint",
                "plan_predicted",
                "plan_profiled",
                "optimizer_timers",
                "chunk_stats",
            )
        }
    )
    if rank == 0:
        print("RESULT " + json.dumps(row, default=str), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(system: str, nproc: int, args, timeout: float) -> dict:
    argv = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            os.path.abspath(__file__),
            "--child",
            system,
            "--device",
            args.device,
            "--batch",
            str(args.batch),
            "--cap",
            str(args.cap),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        + (["--tiny"] if args.tiny else [])
        + (["--trace", args.trace] if args.trace else [])
    )
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
        **NO_MULTICAST,
        **dict(kv.split("=", 1) for kv in args.env),
    )
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        out, err, code = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = (
            (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
            "timeout",
            -9,
        )
    found = re.findall(r"^RESULT (.*)$", out, re.M)
    row = (
        json.loads(found[-1])
        if found
        else {
            "system": system,
            "gpus": nproc,
            "error": f"exit {code}: {' '.join(err.split())[-1500:]}",
        }
    )
    row["wall_s"] = time.monotonic() - t0
    return row


def markdown(out: dict) -> str:
    rows = out["rows"]
    lines = [
        f"# Data-parallel protrain on {out['device']} ({out['date']})",
        "",
        f"Command: `{out['command']}`. torch {out['torch']}. See benchmarks/dp_bench.py.",
        "",
        "| run | system | GPUs | tokens/s | step ms | peak reserved GiB (max over GPUs) | "
        "plan | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan = (
            f"n_persist {r['n_persist']}/{r['n_chunks']}, swap {r['n_swap']}, recompute "
            f"{r['n_checkpoint']}"
            if "n_persist" in r
            else "-"
        )
        tok = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"
        ms = f"{r['step_ms']:.0f}" if "step_ms" in r else "-"
        peak = f"{r['peak_reserved_gib_max']:.1f}" if "peak_reserved_gib_max" in r else "-"
        err = " ".join(str(r.get("error", "")).split())[:160].replace("|", "/")
        lines.append(
            f"| {r.get('run', 1)} | {r['system']} | {r['gpus']} | {tok} | {ms} | {peak} | "
            f"{plan} | {err} |"
        )
    detailed = [r for r in rows if r.get("phase_ms_rank0") or r.get("trace_rank0")]
    if detailed:
        lines += [
            "",
            "Where the step went (rank 0): the cost model's prediction; forward / "
            "backward / optimizer device "
            "times (CUDA events, median of the timed steps); the allocator's retries over "
            "the timed steps; "
            "from a profiler trace of one more step (benchmarks/trace_summary.py): time no "
            "compute kernel ran, "
            "collective kernels' busy time, how much of it overlapped compute, and the "
            "compute kernels' extra "
            "time beside collectives against the same kernels alone.",
            "",
            "| run | system | GPUs | predicted ms | measured ms | fwd / bwd / optim ms | "
            "retries | compute idle ms "
            "| collectives ms (overlapping compute) | compute extra beside collectives ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        for r in detailed:
            pred = (r.get("plan_predicted") or {}).get("iter_s")
            ph, t = r.get("phase_ms_rank0"), r.get("trace_rank0") or {}
            phases = (
                f"{ph['forward']:.1f} / {ph['backward']:.1f} / {ph['optimizer']:.1f}" if ph else "-"
            )
            coll = (
                f"{t['collective_busy_ms']:.1f} ({t['collective_overlapping_compute_ms']:.1f})"
                if t.get("collective_busy_ms") is not None
                else "-"
            )
            lines.append(
                f"| {r.get('run', 1)} | {r['system']} | {r['gpus']} | "
                f"{f(pred * 1e3 if pred else None, '.1f')} | "
                f"{f(r.get('step_ms'), '.1f')} | {phases} | "
                f"{f(r.get('alloc_retries_max'), 'd')} | "
                f"{f(t.get('compute_idle_ms'), '.1f')} | {coll} | "
                f"{f(t.get('compute_extra_beside_collectives_ms'), '.1f')} |"
            )
    for run, ratios in (out.get("run_ratios") or {"1": out.get("ratios", {})}).items():
        for k, v in ratios.items():
            lines.append(f"\nrun {run}: {k}: {v:.2f}x" if v is not None else f"\nrun {run}: {k}: -")
    lines += [""] + [f"- {n}" for n in out.get("notes") or []]
    return "\n".join(lines) + "\n"


def merge(paths: list[str], notes: list[str], out_path: str) -> None:
    """Several runs' JSON in one table: rows numbered by run, each run's own ratios (same-run
    rows only)."""
    parts = [json.load(open(p)) for p in paths]
    rows = [dict(r, run=i + 1) for i, p in enumerate(parts) for r in p["rows"]]
    out = dict(
        parts[-1],
        rows=rows,
        notes=notes,
        command=" ; ".join(p["command"] for p in parts),
        run_ratios={str(i + 1): p.get("ratios", {}) for i, p in enumerate(parts)},
        runs=[{k: p.get(k) for k in ("date", "command", "torch", "device")} for p in parts],
    )
    with open(out_path + ".json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(out_path + ".md", "w") as f:
        f.write(markdown(out))
    print(markdown(out))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--child", choices=("protrain", "fsdp2"), default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--cap", type=float, default=24.0, help="GiB per GPU (0: uncapped)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--trace",
        default=None,
        help="path prefix: rank 0 of each run writes a "
        "torch.profiler chrome "
        "trace of one more step to "
        "PREFIX_SYSTEM_GPUS.json",
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every run (e.g. NCCL_MAX_NCHANNELS=8: fewer "
        "SMs for NCCL's "
        "kernels next to backward's); recorded in the output",
    )
    ap.add_argument(
        "--systems", default="protrain1,protrain,fsdp2", help="protrain1 = protrain on one GPU"
    )
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--merge", nargs="+", default=None, help="JSON files of earlier runs to combine into --out"
    )
    ap.add_argument(
        "--note", action="append", default=[], help="with --merge: a line for the table's notes"
    )
    args = ap.parse_args()
    bad = [kv for kv in args.env if "=" not in kv or kv.startswith("=")]
    if bad:
        ap.error(f"--env takes KEY=VALUE, got {bad}")
    if args.child:
        child(args)
        return
    if args.merge:
        merge(args.merge, args.note, args.out)
        return
    import torch

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "command": "python benchmarks/dp_bench.py " + " ".join(sys.argv[1:]),
        "env": args.env,
        "rows": [],
    }
    deadline = time.monotonic() + args.timeout
    for name in args.systems.split(","):
        system, nproc = ("protrain", 1) if name == "protrain1" else (name, args.gpus)
        left = deadline - time.monotonic()
        out["rows"].append(
            launch(system, nproc, args, left)
            if left > 30
            else {"system": system, "gpus": nproc, "error": "not run: deadline"}
        )
        print(
            json.dumps(
                {k: out["rows"][-1].get(k) for k in ("system", "gpus", "tokens_per_s", "error")}
            ),
            flush=True,
        )
        text = write(out, args)  # after every row: a run cut short keeps what it measured
    print(text)


def write(out: dict, args) -> str:
    tok = {(r["system"], r["gpus"]): r.get("tokens_per_s") for r in out["rows"]}
    one, many, fsdp = (
        tok.get(("protrain", 1)),
        tok.get(("protrain", args.gpus)),
        tok.get(("fsdp2", args.gpus)),
    )
    out["ratios"] = {
        f"protrain {args.gpus} GPUs / protrain 1 GPU": many / one if one and many else None,
        f"protrain {args.gpus} GPUs / FSDP2 offload {args.gpus} GPUs": many / fsdp
        if fsdp and many
        else None,
    }
    text = markdown(out)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(out, f, indent=1, default=str)
        with open(args.out + ".md", "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
