"""How fast host memory gets pinned: what protrain's chunk stores pay when they are bound (on the
H200 host the warm first step of the Llama-3.2-3B shape spent 7.2 s in ``cudaHostRegister``,
``results/first_step_h200_pyprof2.md``). GPU.

Pins ``--total-gib`` of host memory in blocks of each ``--block-mib`` size, four ways, alternating,
``--repeat`` times, each block freed before the next case:

* ``register``: anonymous memory registered with ``cudaHostRegister``, which faults the pages in
  from one thread (``pinned.registered_host_empty(prefault=False)``, protrain before);
* ``prefault+register``: the same after a parallel ``zero_`` with torch's intra-op threads has
  faulted them in (``prefault=True``, protrain's default now);
* ``torch pin_memory``: ``torch.empty(..., pin_memory=True)`` (cudaHostAlloc through torch's caching
  host allocator; protrain's blocks up to 64 MiB);
* ``prefault only``: the parallel first touch alone (what the registration is left with).

    python benchmarks/pinning_probe.py --out $OUT/pinning_probe_h200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-gib", type=float, default=8.0)
    ap.add_argument("--block-mib", default="64,96,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--md-only", action="store_true", help="rewrite OUT.md from OUT.json")
    args = ap.parse_args()
    if args.md_only:
        with open(args.out + ".json") as f:
            d = json.load(f)
        write_md(args.out, d, d["rows"], d.get("repeat", args.repeat))
        return
    import torch

    from protrain_fx.machine import pinned

    torch.cuda.init()

    cases = {
        "register": lambda n: pinned.registered_host_empty(n, torch.float32, prefault=False),
        "prefault+register": lambda n: pinned.registered_host_empty(n, torch.float32, True),
        "torch pin_memory": lambda n: torch.empty(n, dtype=torch.float32, pin_memory=True),
        "prefault only": lambda n: pinned.anonymous_host_empty(n, torch.float32, True)[0],
    }
    rows = []
    for mib in [int(x) for x in args.block_mib.split(",")]:
        numel = mib * 2**20 // 4
        blocks = max(1, int(args.total_gib * 1024 // mib))
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeat):
            for name, make in cases.items():
                t0 = time.perf_counter()
                held = [make(numel) for _ in range(blocks)]
                times[name].append(time.perf_counter() - t0)
                del held
                pinned.release_cached_pinned_memory()
        for name, ts in times.items():
            gib = blocks * mib / 1024
            rows.append(
                {
                    "case": name,
                    "block_mib": mib,
                    "blocks": blocks,
                    "gib": gib,
                    "median_s": round(statistics.median(ts), 3),
                    "gib_per_s": round(gib / statistics.median(ts), 2),
                    "all_s": [round(t, 3) for t in ts],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeat": args.repeat,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    write_md(args.out, meta, rows, args.repeat)


def write_md(out: str, meta: dict, rows: list, repeat: int) -> None:
    with open(out + ".md", "w") as f:
        f.write(
            f"# Pinning host memory (`python benchmarks/pinning_probe.py`)\n\n{meta['device']}, "
            f"torch {meta['torch']}, {meta['threads']} intra-op threads; median of "
            f"{repeat}.\n\n| case | block MiB | blocks | GiB | s | GiB/s |\n"
            "|---|---|---|---|---|---|\n"
        )
        for r in rows:
            f.write(
                f"| {r['case']} | {r['block_mib']} | {r['blocks']} | {r['gib']:.1f} | "
                f"{r['median_s']} | {r['gib_per_s']} |\n"
            )


if __name__ == "__main__":
    main()
