"""How long the automatic plan's search takes (pure Python, so a CPU benchmark): the search of an HF
Llama-3.2-3B-shaped profile, priced with the H200 host's measured rates, at several budgets.

The profile is built, not profiled: 28 blocks of 100.7 M parameters (the 3B shape's decoder layer)
at 2-4 ms of compute each, the tied 128256 x 3072 embedding as an oversized chunk of its own, and
the three chunk sizes the automatic plan profiles (protrain_fx/autoplan.py: the default, 1.5x and
2x; the default here half a block, or ``--chunk-bytes``). The rates are the H200 host's hardware
profile recorded in ``benchmarks/results/oom_sweep_h200_run30.json``, with device steps allowed
(one rank, as autoplan sets them on a GPU). ``--ranks N`` prices N data-parallel ranks instead,
over a bus of ``--bus-gb-s`` (the search then also prices chunks sharded on the devices,
plan/ranks_cost.py). On the H200 host the search of the real 3B profile took 8.8 s of the cold
first step (benchmarks/results/first_step_h200_pyprof.md).

To compare two versions of the code in one run, give each a checkout with ``--code NAME=PATH``: each
runs in a subprocess that imports ``protrain_fx`` from ``PATH``, alternately, ``--repeat`` times.

    python benchmarks/search_time.py --code before=/tmp/base --code after=. \\
        --out benchmarks/results/search_time_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGETS_GIB = (16, 24, 40)
MiB, GiB = 2**20, 2**30


def _one_run(ranks: int = 1, bus_gb_s: float = 150.0, chunk_bytes: int = 0) -> dict:
    """Search once per budget with the protrain_fx on ``sys.path``; the seconds and the plan."""
    import dataclasses
    import time

    from protrain_fx.machine.profile import HardwareProfile
    from protrain_fx.plan.profiles import BlockProfile, ChunkProfile, GraphProfile, Hardware
    from protrain_fx.plan.search import search

    with open(os.path.join(HERE, "results", "oom_sweep_h200_run30.json")) as f:
        hw_profile = HardwareProfile.from_dict(json.load(f)["hardware_profile"])
    hw = dataclasses.replace(Hardware.of(hw_profile), device_steps=ranks == 1)
    if ranks > 1:
        hw = dataclasses.replace(hw, world_size=ranks, collective_bytes_per_s=bus_gb_s * 1e9)
    n_blocks, block_numel, vocab_numel = 28, 100_700_000, 128_256 * 3072
    blocks = tuple(
        BlockProfile(fwd_s=2e-3, bwd_s=4e-3, keep_bytes=600 * MiB, input_bytes=24 * MiB)
        for _ in range(n_blocks)
    )
    default = chunk_bytes or block_numel * 4 // 2
    profiles = []
    for chunk_size in (default, default * 3 // 2, default * 2):
        per_chunk = chunk_size // 4
        n_chunks = -(-n_blocks * block_numel // per_chunk)
        chunks = [ChunkProfile(vocab_numel, 1e-3, 2e-3, blocks=())]
        for c in range(n_chunks):
            owned = tuple(b for b in range(n_blocks) if b * n_chunks // n_blocks == c)
            chunks.append(
                ChunkProfile(per_chunk, 6e-3 / n_chunks * 28, 1.2e-2 / n_chunks * 28, owned)
            )
        profiles.append(
            GraphProfile(
                chunk_size=chunk_size,
                chunks=tuple(chunks),
                blocks=blocks,
                nonblock_fwd_s=2e-3,
                nonblock_bwd_s=4e-3,
                head_bwd_s=2e-3,
                nonblock_saved_bytes=500 * MiB,
                transient_bytes=2 * GiB,
                tail_bytes=GiB,
                resident_cast_elem=2,
                fragmentation=1.05,
            )
        )
    out = {}
    for budget in BUDGETS_GIB:
        t0 = time.perf_counter()
        result = search(profiles, hw, budget * GiB, 100 * GiB)
        seconds = time.perf_counter() - t0
        k = result.best.knobs
        out[str(budget)] = {
            "seconds": seconds,
            "evaluated": result.evaluated,
            "plan": [k.chunk_size, k.n_persist, k.n_buffer, k.n_swap, k.n_checkpoint]
            + [getattr(k, "n_shard", 0)],
            "time_s": result.best.time_s,
            "peak_bytes": result.best.peak_bytes,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--code", action="append", default=[], help="NAME=PATH of a checkout")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="path stem for .json and .md")
    ap.add_argument("--ranks", type=int, default=1, help="data-parallel ranks to price")
    ap.add_argument("--bus-gb-s", type=float, default=150.0, help="their collectives' rate")
    ap.add_argument("--chunk-bytes", type=int, default=0, help="default chunk size (half a block)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one measurement with the checkout given
        sys.path.insert(0, args.child)
        print(json.dumps(_one_run(args.ranks, args.bus_gb_s, args.chunk_bytes)))
        return
    codes = [c.split("=", 1) for c in args.code] or [["this", os.path.join(HERE, "..")]]
    runs: dict[str, list] = {name: [] for name, _ in codes}
    for _ in range(args.repeat):
        for name, path in codes:  # alternately, so that a busy spell hits both
            proc = subprocess.run(
                [sys.executable, __file__, "--child", os.path.abspath(path)]
                + ["--ranks", str(args.ranks), "--bus-gb-s", str(args.bus_gb_s)]
                + ["--chunk-bytes", str(args.chunk_bytes)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": ""},
            )
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    for name, path in codes:
        commit = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        for budget in BUDGETS_GIB:
            got = [r[str(budget)] for r in runs[name]]
            rows.append(
                {
                    "code": name,
                    "commit": commit,
                    "budget_gib": budget,
                    "median_s": statistics.median(g["seconds"] for g in got),
                    "runs_s": [g["seconds"] for g in got],
                    "evaluated": got[0]["evaluated"],
                    "plan": got[0]["plan"],
                    "time_s": got[0]["time_s"],
                    "peak_bytes": got[0]["peak_bytes"],
                }
            )
    report = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        lines = [
            f"# Plan search time (`{report['command']}`)",
            "",
            f"{report['machine']}, Python {report['python']}; the Llama-3.2-3B-shaped profile "
            "and H200 host rates of benchmarks/search_time.py; median of the runs; "
            + (
                f"{args.ranks} ranks over {args.bus_gb_s:g} GB/s."
                if args.ranks > 1
                else "one rank."
            ),
            "",
            "| code | commit | budget | search (s) | runs (s) | plans priced | plan (chunk, "
            "n_persist, n_buffer, n_swap, n_checkpoint, n_shard) | predicted step (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['code']} | {r['commit']} | {r['budget_gib']} GiB | {r['median_s']:.2f} | "
                + ", ".join(f"{s:.2f}" for s in r["runs_s"])
                + f" | {r['evaluated']} | {tuple(r['plan'])} | {r['time_s']:.4f} |"
            )
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
