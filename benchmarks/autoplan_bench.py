"""The automatic plan on the GPU: the cost model's predicted iteration time and peak against
measured, the profiling and search times, and a sweep of memory caps where the automatic plan must
never run out of memory.

    .venv/bin/python benchmarks/autoplan_bench.py --set gpt --out $OUT/autoplan_gpt
    .venv/bin/python benchmarks/autoplan_bench.py --set llama --out $OUT/autoplan_llama
    python benchmarks/autoplan_bench.py --merge a.json b.json --out benchmarks/results/autoplan_h200

Every case is one protrain run of benchmarks/run.py's child (``run.py --one protrain``: model built
under host_init, bf16 autocast, fused AdamW handed to protrain, warm-up steps, then timed steps each
followed by a synchronize; tokens/s from the median). Cases of a group start together and compile
side by side; the profiling step and the timed steps of each run alone (benchmarks/timeshare.py).
"auto" cases give protrain nothing but the optimizer (and the cap through
``set_per_process_memory_fraction``); "forced" cases fix every knob, so the search only prices that
plan. Predicted time is compared with the median step, predicted peak with ``max_memory_reserved``
over the timed steps (what the cap limits).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import timeshare  # noqa: E402

GPT = dict(
    n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024, tie_embeddings=False
)
LLAMA_3B = dict(
    n_layer=26,
    dim=3072,
    n_head=24,
    n_kv_head=24,
    ffn_dim=8192,
    vocab_size=32000,
    max_seq_len=1024,
    tie_embeddings=False,
)
KEEP = dict(n_buffer=2, n_swap=0, n_checkpoint=0)


def case(name, kind, cfg, batch, cap, knobs=None, sweep=False):
    return dict(
        name=name, kind=kind, cfg=cfg, batch=batch, cap_gib=cap, knobs=knobs or {}, sweep=sweep
    )


# groups run one after the other; the cases of a group share the device (caps sum under its memory)
SMALL = dict(GPT, n_layer=4, n_embd=512, n_head=8)
SETS = {
    "smoke": [
        [
            case("small gpt cap 8 auto", "gpt", SMALL, 4, 8, sweep=True),
            case(
                "small gpt cap 8 n_persist 1 recompute 2",
                "gpt",
                SMALL,
                4,
                8,
                dict(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2),
            ),
        ]
    ],
    "gpt": [
        [
            case("gpt cap 80 auto", "gpt", GPT, 8, 80, sweep=True),
            case("gpt cap 48 auto", "gpt", GPT, 8, 48, sweep=True),
        ],
        [
            case("gpt cap 64 auto", "gpt", GPT, 8, 64, sweep=True),
            case("gpt cap 32 auto", "gpt", GPT, 8, 32, sweep=True),
            case("gpt cap 24 auto", "gpt", GPT, 8, 24, sweep=True),
        ],
        [
            case("gpt cap 16 auto", "gpt", GPT, 8, 16, sweep=True),
            case("gpt cap 24 n_persist 5 keep", "gpt", GPT, 8, 24, dict(KEEP, n_persist=5)),
            case("gpt cap 24 n_persist 4 keep", "gpt", GPT, 8, 24, dict(KEEP, n_persist=4)),
            case(
                "gpt cap 40 all resident, recompute 12",
                "gpt",
                GPT,
                8,
                40,
                dict(n_persist=14, n_buffer=1, n_swap=0, n_checkpoint=12),
            ),
        ],
    ],
    # the second H200 call of 2026-11-30: the second model, the rest of the cap sweep
    "run2": [
        [
            case("llama3b cap 40 auto", "llama", LLAMA_3B, 4, 40),
            case("llama3b cap 24 auto", "llama", LLAMA_3B, 4, 24),
            case("gpt cap 16 auto", "gpt", GPT, 8, 16, sweep=True),
            case("gpt cap 32 auto", "gpt", GPT, 8, 32, sweep=True),
        ],
        [
            case("gpt cap 64 auto", "gpt", GPT, 8, 64, sweep=True),
            case("gpt cap 24 n_persist 5 keep", "gpt", GPT, 8, 24, dict(KEEP, n_persist=5)),
        ],
    ],
    # the final H200 call: every automatic plan whose choice the last changes can move, and the
    # second model
    "final": [
        [
            case("gpt cap 24 auto", "gpt", GPT, 8, 24, sweep=True),
            case("gpt cap 16 auto", "gpt", GPT, 8, 16, sweep=True),
            case("gpt cap 32 auto", "gpt", GPT, 8, 32, sweep=True),
            case("llama3b cap 40 auto", "llama", LLAMA_3B, 4, 40),
        ],
        [
            case("llama3b cap 24 auto", "llama", LLAMA_3B, 4, 24),
            case("gpt cap 24 n_persist 4 keep", "gpt", GPT, 8, 24, dict(KEEP, n_persist=4)),
            case("gpt cap 48 auto", "gpt", GPT, 8, 48, sweep=True),
        ],
    ],
    # the last minutes of the 2026-11-30 session: the GPT at 24 and 16 GiB measured with nothing
    # overlapping
    "clean": [
        [
            case("gpt cap 24 auto", "gpt", GPT, 8, 24, sweep=True),
            case("gpt cap 16 auto", "gpt", GPT, 8, 16, sweep=True),
            case("gpt cap 24 n_persist 4 keep", "gpt", GPT, 8, 24, dict(KEEP, n_persist=4)),
        ]
    ],
    # issue 5's acceptance, two device calls: the GPT's sweep with a forced plan, then the LLaMA at
    # two caps
    "accept-gpt": [
        [
            case("gpt cap 24 auto", "gpt", GPT, 8, 24, sweep=True),
            case("gpt cap 16 auto", "gpt", GPT, 8, 16, sweep=True),
            case("gpt cap 24 n_persist 4 keep", "gpt", GPT, 8, 24, dict(KEEP, n_persist=4)),
            case("gpt cap 40 auto", "gpt", GPT, 8, 40, sweep=True),
        ],
        [
            case("gpt cap 80 auto", "gpt", GPT, 8, 80, sweep=True),
            case("gpt cap 32 auto", "gpt", GPT, 8, 32, sweep=True),
        ],
        [
            case("gpt cap 64 auto", "gpt", GPT, 8, 64, sweep=True),
            case("gpt cap 48 auto", "gpt", GPT, 8, 48, sweep=True),
        ],
    ],
    "accept-llama": [
        [
            case("llama3b cap 40 auto", "llama", LLAMA_3B, 4, 40),
            case("llama3b cap 24 auto", "llama", LLAMA_3B, 4, 24),
        ],
        [
            case(
                "llama3b cap 40 n_persist 8 recompute 13",
                "llama",
                LLAMA_3B,
                4,
                40,
                dict(n_persist=8, n_buffer=2, n_swap=0, n_checkpoint=13),
            )
        ],
    ],
    # the cost model's casts and CPU contention (COST_MODEL_VERSION 7) re-measured in one call: both
    # models, caps 16-48
    "recheck": [
        [
            case("llama3b cap 40 auto", "llama", LLAMA_3B, 4, 40),
            case("gpt cap 24 auto", "gpt", GPT, 8, 24, sweep=True),
            case("gpt cap 16 auto", "gpt", GPT, 8, 16, sweep=True),
            case("gpt cap 40 auto", "gpt", GPT, 8, 40, sweep=True),
        ],
        [
            case("llama3b cap 24 auto", "llama", LLAMA_3B, 4, 24),
            case("gpt cap 24 n_persist 4 keep", "gpt", GPT, 8, 24, dict(KEEP, n_persist=4)),
            case("gpt cap 32 auto", "gpt", GPT, 8, 32, sweep=True),
            case("gpt cap 48 auto", "gpt", GPT, 8, 48, sweep=True),
        ],
    ],
    "llama": [
        [
            case("llama3b cap 40 auto", "llama", LLAMA_3B, 4, 40),
            case("llama3b cap 24 auto", "llama", LLAMA_3B, 4, 24),
        ],
        [
            case(
                "llama3b cap 40 n_persist 8 recompute 13",
                "llama",
                LLAMA_3B,
                4,
                40,
                dict(n_persist=8, n_buffer=2, n_swap=0, n_checkpoint=13),
            ),
            case(
                "llama3b cap 24 n_persist 2 recompute 26",
                "llama",
                LLAMA_3B,
                4,
                24,
                dict(n_persist=2, n_buffer=2, n_swap=0, n_checkpoint=26),
            ),
        ],
    ],
}


def child_argv(c: dict, args) -> list[str]:
    spec = dict(
        kind=c["kind"],
        cfg=c["cfg"],
        batch=c["batch"],
        seq=1024,
        cap_gib=c["cap_gib"],
        device="cuda",
        steps=args.steps,
        warmup=args.warmup,
        settle=True,
        protrain_options=c["knobs"],
        phase_times=True,
    )
    if args.trace and any(t in c["name"] for t in args.trace_only.split(",")):
        spec["trace"] = os.path.join(args.trace, re.sub(r"\W+", "_", c["name"]))
    return [
        sys.executable,
        os.path.join(HERE, "run.py"),
        "--one",
        "protrain",
        "--spec",
        json.dumps(spec),
    ]


def row_of(c: dict, code: int, out: str, err: str) -> dict:
    m = re.findall(r"^RESULT (.*)$", out, re.M)
    res = json.loads(m[-1]) if m else {"error": f"exit {code}: {err[-1500:]}"}
    row = {k: c[k] for k in ("name", "kind", "batch", "cap_gib", "knobs", "sweep")}
    row.update(res)
    pred = res.get("plan_predicted") or {}
    if "step_ms" in res and pred.get("iter_s"):
        row["predicted_ms"] = pred["iter_s"] * 1e3
        row["time_err"] = row["predicted_ms"] / res["step_ms"] - 1
    if res.get("peak_reserved_gib") and pred.get("peak_bytes"):
        row["predicted_gib"] = pred["peak_bytes"] / 2**30
        row["peak_err"] = row["predicted_gib"] / res["peak_reserved_gib"] - 1
    if res.get("peak_reserved_gib") is not None:
        row["within_cap"] = res["peak_reserved_gib"] <= c["cap_gib"]
    return row


def markdown(out: dict) -> str:
    rows = out["rows"]
    lines = [
        f"# Automatic plan on the {out.get('device', 'GPU')}: predicted against measured "
        f"({out['date']})",
        "",
        f"Command: `{out['command']}`. torch {out.get('torch')}. See "
        "benchmarks/autoplan_bench.py for the "
        "method (peak = max_memory_reserved over the timed steps; time = median step).",
        "",
        "| run | case | knobs (chunk MiB / n_persist of chunks / n_buffer / n_swap / "
        "n_checkpoint) | tokens/s | "
        "predicted ms | measured ms | time error | predicted GiB | measured GiB | peak error "
        "| profile s "
        "| search ms | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("plan_predicted") or {}
        knobs = (
            (
                f"{r['chunk_size'] / 2**20:.0f} / {r['n_persist']} of {r['n_chunks']} / "
                f"{r['n_buffer']} / "
                f"{r['n_swap']} / {r['n_checkpoint']}"
            )
            if "n_persist" in r
            else "-"
        )
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        lines.append(
            f"| {r.get('run', 1)} | {r['name']} | {knobs} | "
            f"{f(r.get('tokens_per_s'), ',.0f')} | {f(r.get('predicted_ms'), '.0f')} "
            f"| {f(r.get('step_ms'), '.0f')} | "
            f"{f(100 * r['time_err'] if 'time_err' in r else None, '+.1f')}% "
            f"| {f(r.get('predicted_gib'), '.2f')} | "
            f"{f(r.get('peak_reserved_gib'), '.2f')} "
            f"| {f(100 * r['peak_err'] if 'peak_err' in r else None, '+.1f')}% | "
            f"{f(p.get('profile_s'), '.1f')} "
            f"| {f(1e3 * p['search_s'] if p.get('search_s') is not None else None, '.0f')} "
            f"| {' '.join(str(r.get('error', '')).split())[:120].replace('|', '/')} |"
        )
    if out.get("notes"):
        lines += [""] + [f"- {n}" for n in out["notes"]]
    sweep = [r for r in rows if r.get("sweep")]
    if sweep:
        ok = sum(1 for r in sweep if r.get("within_cap") and "error" not in r)
        lines += [
            "",
            f"Cap sweep (automatic plan): {ok} of {len(sweep)} caps ran with measured "
            "peak <= cap, "
            f"{sum(1 for r in sweep if 'OOM' in str(r.get('error', '')))} OOMs.",
        ]
    timed = [r for r in rows if "time_err" in r and "peak_err" in r]
    if timed:
        lines += [
            f"Largest errors over {len(timed)} plans: time "
            f"{100 * max(abs(r['time_err']) for r in timed):.1f}%, "
            f"peak {100 * max(abs(r['peak_err']) for r in timed):.1f}%."
        ]
        for run in sorted({r.get("run", 1) for r in timed}):
            mine = [r for r in timed if r.get("run", 1) == run]
            lines.append(
                f"- run {run}: {len(mine)} plans, largest time error "
                f"{100 * max(abs(r['time_err']) for r in mine):.1f}%, peak "
                f"{100 * max(abs(r['peak_err']) for r in mine):.1f}%"
            )
    phased = [
        r for r in rows if r.get("phase_ms") and (r.get("plan_predicted") or {}).get("breakdown")
    ]
    if phased:
        lines += [
            "",
            "Phases (device time between CUDA events at the step's start, after forward, "
            "after "
            "`loss.backward()`, after the optimizer; median over the timed steps) against "
            "the cost model's "
            "terms: forward = `fwd_s`; backward + optimizer = the rest of the predicted step.",
            "",
            "| run | case | predicted fwd ms | measured fwd ms | predicted bwd+optim ms | "
            "measured bwd ms | "
            "measured optim ms | trace: compute idle ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in phased:
            p, ph = r["plan_predicted"], r["phase_ms"]
            fwd = p["breakdown"]["fwd_s"] * 1e3
            idle = (r.get("trace") or {}).get("compute_idle_ms")
            lines.append(
                f"| {r.get('run', 1)} | {r['name']} | {fwd:.1f} | {ph['forward']:.1f} | "
                f"{p['iter_s'] * 1e3 - fwd:.1f} | {ph['backward']:.1f} | "
                f"{ph['optimizer']:.1f} | "
                f"{'-' if idle is None else format(idle, '.1f')} |"
            )
    return "\n".join(lines) + "\n"


def write(out: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(path + ".md", "w") as f:
        f.write(markdown(out))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--set", choices=sorted(SETS), action="append", default=[])
    ap.add_argument("--only", default=None, help="comma-separated case names (substring match)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--merge", nargs="*", default=None)
    ap.add_argument(
        "--note", action="append", default=[], help="with --merge: a line for the table's notes"
    )
    ap.add_argument(
        "--keep-hardware",
        action="store_true",
        help="use the cached hardware profile instead of measuring it again (another "
        "stream measured it)",
    )
    ap.add_argument(
        "--fail-on-error", action="store_true", help="exit 1 when a case failed (a smoke check)"
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="folder: traced cases add one step under "
        "torch.profiler, "
        "its trace (gzipped) and summary written there, the summary also in the row",
    )
    ap.add_argument(
        "--trace-only",
        default="",
        help="comma-separated case names (substring) to trace; default all",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.merge is not None:
        parts = [json.load(open(p)) for p in args.merge]
        rows = [dict(r, run=r.get("run", i + 1)) for i, p in enumerate(parts) for r in p["rows"]]
        out = dict(
            parts[-1],
            rows=rows,
            runs=[{k: p.get(k) for k in ("date", "command", "hardware", "runs")} for p in parts],
            command=" ; ".join(p["command"] for p in parts),
            notes=args.note,
        )
        write(out, args.out)
        print(markdown(out))
        return
    import torch

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python benchmarks/autoplan_bench.py " + " ".join(sys.argv[1:]),
        "rows": [],
    }
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    deadline = time.monotonic() + args.timeout
    # the hardware profile (CPU Adam rate, copy bandwidths) is measured once per machine and cached:
    # measure it now, alone, not while the first cases compile next to it (--keep-hardware: it was,
    # by whoever ran first)
    hw = subprocess.run(
        [
            sys.executable,
            "-c",
            "from protrain_fx import hardware; "
            f"print(hardware.hardware_profile(refresh={not args.keep_hardware}).summary())",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out["hardware"] = (hw.stdout + hw.stderr[-500:]).strip()
    print(out["hardware"], flush=True)
    for name in args.set:
        for group in SETS[name]:
            group = [
                c
                for c in group
                if not args.only or any(o in c["name"] for o in args.only.split(","))
            ]
            left = deadline - time.monotonic()
            if not group:
                continue
            if left < 60:
                out["rows"] += [
                    dict(row_of(c, -1, "", ""), error="not run: deadline") for c in group
                ]
                continue
            t0 = time.monotonic()
            results = timeshare.run_together([child_argv(c, args) for c in group], env, left)
            for c, (code, so, se) in zip(group, results):
                r = row_of(c, code, so, se)
                r["group_s"] = time.monotonic() - t0
                out["rows"].append(r)
                print(
                    json.dumps(
                        {
                            k: r.get(k)
                            for k in (
                                "name",
                                "tokens_per_s",
                                "step_ms",
                                "predicted_ms",
                                "peak_reserved_gib",
                                "predicted_gib",
                                "error",
                            )
                        }
                    ),
                    flush=True,
                )
                if "error" in r:
                    print(se[-3000:], file=sys.stderr)
            write(out, args.out)
    write(out, args.out)  # with the rows of groups the deadline left out
    print(markdown(out))
    if args.fail_on_error and any("error" in r for r in out["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
