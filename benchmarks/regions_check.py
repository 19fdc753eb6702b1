"""Regions on the GPU (issue 23): a model compiled in regions against the same model compiled whole
and against torch.compile, on the same init and data, one process each.

A Hugging Face ``LlamaForCausalLM`` (random init, tied vocabulary, GQA, ``labels=`` loss, bf16
autocast, fused AdamW) trains ``--steps`` steps under a device cap that forces offloading:

* ``compile``: torch.compile uncapped (the reference losses);
* ``regions-given``: protrain in regions with knobs given by hand (offloaded chunks, a partly
  resident block, a swapped block, recomputed blocks): the paths the automatic plan may not take;
* ``regions-auto`` / ``whole-auto``: protrain's automatic plan in regions, and compiled whole
  (``PROTRAIN_REGIONS=0``).

Per row: seconds to the first step, tokens/s of the steps after the third, the largest relative loss
difference to torch.compile's, the reserved peak, and protrain's plan and compile notes.

    python benchmarks/regions_check.py --out benchmarks/results/regions_check_h200

writes ``OUT.json`` and ``OUT.md``. ``--run SYSTEM`` (internal) is one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

T0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPE = dict(hidden=1024, layers=12, heads=16, kv=4, ffn=2816, vocab=32000, batch=4, seq=512)
CAP_GIB = 3.0
SYSTEMS = {
    "compile": dict(env={}, options=None),
    "regions-given": dict(
        env={"PROTRAIN_REGIONS": "1"},
        options={"n_persist": 5, "n_swap": 1, "n_checkpoint": 4, "n_buffer": 2},
    ),
    "regions-auto": dict(env={"PROTRAIN_REGIONS": "1"}, options={}),
    "whole-auto": dict(env={"PROTRAIN_REGIONS": "0"}, options={}),
}


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["ffn"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv"],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg)


def run_one(system: str, steps: int) -> dict:
    import torch

    spec = SYSTEMS[system]
    dev = torch.device("cuda")
    protrain = spec["options"] is not None
    if protrain:
        torch.cuda.set_per_process_memory_fraction(
            CAP_GIB * 2**30 / torch.cuda.get_device_properties(dev).total_memory
        )
    t0 = time.perf_counter()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if protrain:
        compiled = torch.compile(
            model, backend="protrain", options=dict(spec["options"], optimizer=opt)
        )
    else:
        compiled = torch.compile(model)
    g = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"]), generator=g)
        for _ in range(steps)
    ]
    losses, times, first = [], [], None
    for x in data:
        ts = time.perf_counter()
        x = x.to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - ts)
        if first is None:
            first = time.perf_counter() - t0
    steady = times[3:]
    row = {
        "system": system,
        "first_step_s": round(first, 2),
        "tokens_per_s": round(SHAPE["batch"] * SHAPE["seq"] * len(steady) / sum(steady), 1),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / 2**30, 3),
        "losses": losses,
    }
    if protrain:
        import protrain_fx

        plan = protrain_fx.get_plan(compiled)
        d = plan.to_dict()
        row["plan"] = {k: d[k] for k in ("chunk_size", "n_persist", "n_buffer", "n_swap")}
        row["plan"]["n_checkpoint"] = d["n_checkpoint"]
        row["predicted"] = {k: (plan.predicted or {}).get(k) for k in ("iter_s", "peak_bytes")}
        row["measured"] = {k: (plan.measured or {}).get(k) for k in ("iter_s", "peak_bytes")}
        row["notes"] = [n for n in plan.notes if n.startswith(("compiled in", "automatic"))]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "regions_check_h200"))
    ap.add_argument("--run")
    args = ap.parse_args()
    if args.run:
        print("RESULT " + json.dumps(run_one(args.run, args.steps)), flush=True)
        return
    rows = []
    for system in args.systems.split(","):
        env = dict(os.environ, **SYSTEMS[system]["env"])
        cmd = [sys.executable, os.path.abspath(__file__), "--run", system]
        cmd += ["--steps", str(args.steps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        found = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        row = found[0] if found else {"system": system, "error": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    ref = next((r for r in rows if r["system"] == "compile" and "losses" in r), None)
    for r in rows:
        if ref is not None and "losses" in r and r is not ref:
            r["loss_rel_vs_compile"] = max(
                abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])
            )
    meta = {"command": "python benchmarks/regions_check.py " + " ".join(sys.argv[1:])}
    meta.update(shape=SHAPE, cap_gib=CAP_GIB, steps=args.steps)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Regions on the GPU (`{meta['command']}`)",
        "",
        f"HF LlamaForCausalLM {SHAPE}, bf16, protrain under a {CAP_GIB:g} GiB cap, torch.compile "
        "uncapped.",
        "",
        "| system | first step (s) | tokens/s | loss rel. vs compile | reserved peak GiB | plan |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | error: {r['error'][-200:]!r} | | | | |")
            continue
        rel = r.get("loss_rel_vs_compile")
        lines.append(
            f"| {r['system']} | {r['first_step_s']} | {r['tokens_per_s']} | "
            f"{'-' if rel is None else f'{rel:.2e}'} | {r['peak_reserved_gib']} | "
            f"{r.get('plan', '')} |"
        )
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
