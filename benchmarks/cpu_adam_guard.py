"""The cost of the guard on protrain's one-pass CPU AdamW kernel (protrain_fx/machine/cpu_adam.py).

A step taken inside backward is provisional and may have to be taken back; since a gradient that is
not finite (a NaN loss back-propagated, then skipped) would leave NaN state no inverse can undo, the
kernel runs such steps guarded: per 16384-element block it first checks the gradient (read again
from the cache) and leaves a block with a non-finite value as it was. This times the kernel with and
without the guard, alternating, over chunks of 24 M parameters (fp32 parameter, gradient, moments
and a bf16 transfer copy, as the runtime steps them), and once with a NaN in one block per chunk.

    python benchmarks/cpu_adam_guard.py --out $OUT/cpu_adam_guard

writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_io import run_meta, write_json, write_table

from protrain_fx.machine import cpu_adam

CHUNK = 24 * 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", type=float, default=0.5e9, help="parameters in all")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if not cpu_adam.available():
        raise SystemExit(f"the kernel was not built: {cpu_adam.build_error()}")
    n_chunks = max(1, int(args.params) // CHUNK)
    chunks = []
    for _ in range(n_chunks):
        p, g = torch.randn(CHUNK), torch.randn(CHUNK) * 1e-3
        m, v = torch.zeros(CHUNK), torch.zeros(CHUNK)
        chunks.append((p, g, m, v, torch.empty(CHUNK, dtype=torch.bfloat16)))
    kw = dict(lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
    kw["maximize"] = False

    def one_pass(guard: bool) -> tuple[float, int]:
        skipped, t0 = 0, time.perf_counter()
        for k, (p, g, m, v, out) in enumerate(chunks):
            skipped += cpu_adam.adam_step(p, g, m, v, out, float(k + 1), guard=guard, **kw)
        return n_chunks * CHUNK / (time.perf_counter() - t0) / 1e9, skipped

    one_pass(False)  # warm-up: first touch of every page
    rates: dict[str, list[float]] = {"unguarded": [], "guarded": []}
    for _ in range(args.rounds):
        rates["unguarded"].append(one_pass(False)[0])
        rates["guarded"].append(one_pass(True)[0])
    for _, g, *_ in chunks:
        g[CHUNK // 2] = float("nan")
    nan_rate, nan_skipped = one_pass(True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    meta = run_meta if torch.cuda.is_available() else lambda s, **kw: {"device": "cpu", **kw}
    out = meta("cpu_adam_guard.py", threads=torch.get_num_threads())
    out.update(
        params=n_chunks * CHUNK,
        rates_gparams_s=rates,
        median_gparams_s=med,
        guarded_over_unguarded=med["guarded"] / med["unguarded"],
        with_nan={"gparams_s": nan_rate, "blocks_skipped": nan_skipped, "chunks": n_chunks},
    )
    write_json(args.out, out)
    lines = [
        f"# The guarded CPU Adam kernel (`python benchmarks/cpu_adam_guard.py --out {args.out}`)",
        "",
        f"{out['device']}'s host; {n_chunks} chunks of {CHUNK} parameters, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds alternating; G parameters/s.",
        "",
        "| kernel | median | rounds |",
        "|---|---|---|",
    ]
    for k, v in rates.items():
        lines.append(f"| {k} | {med[k]:.3f} | {', '.join(f'{x:.3f}' for x in v)} |")
    lines.append(
        f"| guarded, a NaN in one block a chunk | {nan_rate:.3f} | {nan_skipped} skipped |"
    )
    lines += ["", f"Guarded over unguarded: {out['guarded_over_unguarded']:.3f}."]
    write_table(args.out, lines)


if __name__ == "__main__":
    main()
