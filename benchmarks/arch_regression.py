"""Steady tokens/s of two protrain installs side by side (a refactor must not slow training down).

Runs the suite's 1.42 B GPT (width 2048, 24 layers, 16 heads, vocab 50304, untied; batch 8 x 1024,
bf16 autocast, fused AdamW, built under ``protrain_fx.host_init``) at a 24 GiB cap under two plans
given in full (no profiling compile, ``PROTRAIN_AUTOPLAN=0``): ``resident``, the knobs the automatic
plan chose for this case (benchmarks/results/suite_h200.md: 14 chunks all resident, 18 blocks
recomputed), and ``offloaded`` (6 of 14 chunks offloaded, 2 device buffers, 24 blocks recomputed).
Each (install, plan) is one child process; the installs alternate so that neither gets a warmer
machine.

    python benchmarks/arch_regression.py --installs before=/tmp/old,after=/tmp/new --out OUT

``--installs`` names folders made by ``pip install --no-deps --target DIR <source>``; each child
runs with its folder first on PYTHONPATH. Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from results_io import cuda_results, title, write_json, write_table

HERE = os.path.dirname(os.path.abspath(__file__))
PLANS = {
    "resident": {"chunk_size": 412090368, "n_persist": 14, "n_swap": 0, "n_checkpoint": 18},
    "offloaded": {
        "chunk_size": 412090368,
        "n_persist": 8,
        "n_buffer": 2,
        "n_swap": 0,
        "n_checkpoint": 24,
    },
}
CAP_GIB, BATCH, SEQ, WARMUP, STEPS = 24, 8, 1024, 3, 8


def child(plan: str) -> dict:
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from models import GPT, GPTConfig

    import protrain_fx
    import protrain_fx.backend

    if "protrain" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(protrain_fx.backend.protrain_backend, name="protrain")
    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total)
    cfg = GPTConfig(
        n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=SEQ, tie_embeddings=False
    )
    torch.manual_seed(0)
    with protrain_fx.host_init("cuda"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(model, backend="protrain", options={"optimizer": opt, **PLANS[plan]})
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g).to(dev)
    y = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g).to(dev)
    times, losses = [], []
    t0 = time.perf_counter()
    first = None
    for i in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        s = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        if first is None:
            first = time.perf_counter() - t0
        if i >= WARMUP:
            times.append(time.perf_counter() - s)
    step = statistics.median(times)
    p = protrain_fx.get_plan(compiled)
    return {
        "plan": plan,
        "tokens_per_s": BATCH * SEQ / step,
        "step_s": step,
        "steps_s": times,
        "losses": losses,
        "first_step_s": first,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30,
        "chunks": len(p.chunks),
        "n_persist": p.n_persist,
        "n_buffer": p.n_buffer,
        "offloaded": sum(c.placement == "host" for c in p.chunks),
        "protrain": os.path.dirname(protrain_fx.__file__),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--installs", help="NAME=DIR,NAME=DIR")
    ap.add_argument("--plans", default="resident,offloaded")
    ap.add_argument("--out")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return
    installs = [tuple(x.split("=", 1)) for x in args.installs.split(",")]
    rows = []
    for plan in args.plans.split(","):
        for name, folder in installs:
            env = dict(os.environ, PROTRAIN_AUTOPLAN="0", PROTRAIN_PLAN_CACHE="0")
            env["PYTHONPATH"] = folder + os.pathsep + env.get("PYTHONPATH", "")
            t0 = time.perf_counter()
            p = subprocess.run(
                [sys.executable, __file__, "--child", plan],
                env=env,
                text=True,
                capture_output=True,
                cwd="/tmp",
            )
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"plan": plan, "error": p.stderr[-2000:]}
            row.update(install=name, wall_s=time.perf_counter() - t0)
            rows.append(row)
            print(
                json.dumps({k: v for k, v in row.items() if k not in ("steps_s", "losses")}),
                flush=True,
            )
    out = cuda_results(rows)
    write_json(args.out, out)
    lines = [
        title("protrain before and after, side by side", out),
        "",
        f"1.42 B GPT, batch {BATCH} x {SEQ}, {CAP_GIB} GiB cap, plans given in full; median "
        "of "
        f"{STEPS} steps after {WARMUP}.",
        "",
        "| plan | install | tokens/s | vs first install | step s | first step s | "
        "peak reserved GiB | offloaded chunks | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next((x for x in rows if x["plan"] == r["plan"] and x.get("tokens_per_s")), None)
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base['tokens_per_s']:.3f}" if tps and base else "-"
        lines.append(
            f"| {r['plan']} | {r['install']} | {tps or 0:,.0f} | {ratio} | "
            f"{r.get('step_s', 0):.4f} | {r.get('first_step_s', 0):.0f} | "
            f"{r.get('peak_reserved_gib', 0):.2f} | {r.get('offloaded', '-')} | "
            f"{(r.get('error') or '')[-200:]} |"
        )
    write_table(args.out, lines)


if __name__ == "__main__":
    main()
