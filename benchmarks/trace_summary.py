"""Where a step's device time went, from a torch.profiler chrome trace (``dp_bench.py --trace``):
small JSON instead of a trace of tens of MB.

    python benchmarks/trace_summary.py TRACE.json [--out SUMMARY.json]

Reports, over the span from the first to the last device event:

* per stream: busy time (the union of its kernels' and copies' intervals) and event count;
* the compute streams' idle time (no non-collective kernel running on any stream) and its longest
  gaps, each with the kernels just before and after it;
* collectives (NCCL kernels): their busy time and how much of it overlaps compute kernels;
* kernels that ran both alongside a collective and alone: mean duration in each case (does a
  collective slow the compute it overlaps?);
* the kernels with the largest total time; copies by direction.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    """Intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _overlaps(a: float, b: float, union: list[tuple[float, float]], starts: list[float]) -> bool:
    k = bisect.bisect_right(starts, b) - 1
    while k >= 0 and union[k][1] > a:
        if union[k][0] < b:
            return True
        k -= 1
    return False


def summarize(events: list[dict], top: int = 15) -> dict:
    """The summary of one trace's device events (module docstring); times in ms."""
    dev = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not dev:
        return {"error": "no device events in the trace"}
    t0 = min(e["ts"] for e in dev)
    t1 = max(e["ts"] + e.get("dur", 0) for e in dev)
    ms = 1e-3  # trace times are microseconds

    def span(e):
        return (e["ts"], e["ts"] + e.get("dur", 0))

    streams: dict = defaultdict(list)
    for e in dev:
        streams[str(e.get("args", {}).get("stream", e.get("tid")))].append(e)
    is_coll = lambda e: e["cat"] == "kernel" and "nccl" in e["name"].lower()  # noqa: E731
    compute = [e for e in dev if e["cat"] == "kernel" and not is_coll(e)]
    coll = [e for e in dev if is_coll(e)]
    compute_u = _union([span(e) for e in compute])
    coll_u = _union([span(e) for e in coll])
    gaps = [(b0, a1, i) for i, ((_, b0), (a1, _)) in enumerate(zip(compute_u, compute_u[1:]))]
    gaps.sort(key=lambda g: g[1] - g[0], reverse=True)
    by_end = sorted(compute, key=lambda e: e["ts"] + e.get("dur", 0))
    by_start = sorted(compute, key=lambda e: e["ts"])

    def around(a: float, b: float) -> tuple[str, str]:
        before = [e for e in by_end if e["ts"] + e.get("dur", 0) <= a + 1e-3][-1:]
        after = [e for e in by_start if e["ts"] >= b - 1e-3][:1]
        return (before[0]["name"][:80] if before else "", after[0]["name"][:80] if after else "")

    coll_starts = [a for a, _ in coll_u]
    alone, beside = defaultdict(list), defaultdict(list)
    for e in compute:
        a, b = span(e)
        (beside if coll_u and _overlaps(a, b, coll_u, coll_starts) else alone)[e["name"]].append(
            e.get("dur", 0)
        )
    slowed = []
    for name in set(alone) & set(beside):
        x, y = alone[name], beside[name]
        tx, ty = sum(x) / len(x), sum(y) / len(y)
        slowed.append(
            {
                "kernel": name[:100],
                "n_alone": len(x),
                "n_beside": len(y),
                "mean_alone_us": round(tx, 2),
                "mean_beside_us": round(ty, 2),
                "beside_total_ms": round(sum(y) * ms, 3),
                "extra_ms": round((ty - tx) * len(y) * ms, 3),
            }
        )
    slowed.sort(key=lambda r: r["beside_total_ms"], reverse=True)
    totals = defaultdict(lambda: [0.0, 0])
    for e in dev:
        t = totals[(e["cat"], e["name"])]
        t[0] += e.get("dur", 0)
        t[1] += 1
    biggest = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    copies = defaultdict(lambda: [0.0, 0, 0])
    for e in dev:
        if e["cat"] == "gpu_memcpy":
            c = copies[e["name"].split("(")[0].strip()]
            c[0] += e.get("dur", 0)
            c[1] += 1
            c[2] += int(e.get("args", {}).get("bytes", 0) or 0)
    return {
        "span_ms": round((t1 - t0) * ms, 3),
        "streams": {
            s: {
                "busy_ms": round(_length(_union([span(e) for e in es])) * ms, 3),
                "events": len(es),
                "collective_kernels": sum(map(is_coll, es)),
            }
            for s, es in sorted(streams.items())
        },
        "compute_busy_ms": round(_length(compute_u) * ms, 3),
        "compute_idle_ms": round(((t1 - t0) - _length(compute_u)) * ms, 3),
        "compute_gaps": [
            {
                "at_ms": round((a - t0) * ms, 3),
                "gap_ms": round((b - a) * ms, 3),
                "after": around(a, b)[0],
                "before": around(a, b)[1],
            }
            for a, b, _ in gaps[:top]
        ],
        "collective_busy_ms": round(_length(coll_u) * ms, 3),
        "collective_overlapping_compute_ms": round(_length(_intersect(coll_u, compute_u)) * ms, 3),
        "collective_kernels": len(coll),
        "compute_beside_collectives": slowed[:top],
        "compute_extra_beside_collectives_ms": round(sum(r["extra_ms"] for r in slowed), 3),
        "top_kernels": [
            {"cat": c, "name": n[:100], "total_ms": round(t * ms, 3), "count": k}
            for (c, n), (t, k) in biggest
        ],
        "copies": {
            k: {"total_ms": round(t * ms, 3), "count": n, "bytes": b}
            for k, (t, n, b) in copies.items()
        },
    }


def trace_step(fn, path: str) -> dict:
    """Run ``fn()`` (one training step, synchronized) under torch.profiler, write its chrome trace
    gzipped to ``path`` + ``.json.gz`` and return the summary (without the per-kernel lists, which
    stay in the file's neighbour ``path`` + ``.summary.json``)."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    raw = path + ".json"
    prof.export_chrome_trace(raw)
    summary = summarize(_load(raw))
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(raw)
    with open(path + ".summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    keep = (
        "span_ms",
        "compute_busy_ms",
        "compute_idle_ms",
        "collective_busy_ms",
        "collective_overlapping_compute_ms",
        "compute_extra_beside_collectives_ms",
        "copies",
    )
    return dict({k: summary.get(k) for k in keep}, compute_gaps=summary.get("compute_gaps", [])[:5])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    summary = summarize(_load(args.trace), args.top)
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
