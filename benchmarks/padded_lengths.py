"""Batches padded to their own longest sequence (GPU): a new shape every few steps, as a loop with
dynamic padding (``DataCollatorWithPadding``) feeds a model.

HF ``LlamaForCausalLM`` with Llama-3.2-1B's shape (oom_sweep.MODELS), built from seed 0, bf16
autocast, ``labels=`` loss, fused AdamW, ``--batch`` sequences per step whose length goes through
``LENGTHS`` (dynamo traces the second length with dynamic sizes: one more graph, planned beside the
first graph's placement, its resident chunks kept, and profiled beside them). Rows, each its own
process (``--only``):

- ``reference``: plain PyTorch on the whole device (eager).
- ``compile``: plain ``torch.compile(model)`` on the whole device: the graphs dynamo compiles for
  these lengths without protrain.
- ``protrain``: ``torch.compile(model, backend="protrain")`` under ``--cap`` GiB
  (``set_per_process_memory_fraction``), the same init, data and loop.

``--lengths`` replaces ``LENGTHS``: a longer length after the dynamic graph's (the second) is one
its plan was not made for (profiling/longer_inputs.py re-plans at it where the plan has no room).

Per row: the losses (against the reference's, bf16 tolerance), the reserved peak against the cap,
the plans (graphs and their resident chunks), the wall time. Writes ``OUT.json`` and ``OUT.md``.

    python benchmarks/padded_lengths.py --out $OUT/padded_lengths_h100 [--cap 12 --batch 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from results_io import rows_main  # noqa: E402

ROWS = ["reference", "compile", "protrain"]
BF16_REL = 2**-6  # oom_sweep.BF16_REL
LENGTHS = [1024, 768, 896, 640, 1024, 512, 1000, 832]


def run_row(name: str, args) -> dict:
    import torch
    from min_budget import bf16_step
    from oom_sweep import MODELS, build

    spec = MODELS[args.model]
    g = torch.Generator().manual_seed(1)
    lengths = lengths_of(args)
    data = [
        torch.randint(0, spec["vocab"], (args.batch, n), generator=g).cuda()
        for n in lengths * args.rounds
    ]
    row = {"row": name, "lengths": [x.shape[1] for x in data]}
    t0 = time.perf_counter()
    model = build(spec, max(lengths), host=name == "protrain")
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    run = model
    if name == "compile":
        run = torch.compile(model)
    if name == "protrain":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap * 2**30 / total)
        row["cap_gib"] = args.cap
        run = torch.compile(model, backend="protrain")
    row["losses"] = []
    try:
        for x in data:
            row["losses"].append(bf16_step(run, opt, x))
    except Exception as e:  # the steps taken stay in the row
        row["error"] = f"step {len(row['losses'])}: {type(e).__name__}: {str(e)[:600]}"
    row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    row["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if name == "protrain":
        import protrain_fx
        from protrain_fx.plan.plan import training_plans

        row["package"] = os.path.dirname(protrain_fx.__file__)  # which protrain_fx ran

        plans = [p for p, _ in training_plans()]
        row["plans"] = [
            f"{p.graph_name}: {p.n_persist} of {len(p.chunks)} chunks resident, predicted peak "
            f"{(p.predicted or {}).get('peak_bytes', 0) / 2**30:.2f} GiB"
            + "".join(f"; {n[:200]}" for n in p.notes if n.startswith(("re-planned", "inputs of")))
            for p in plans
        ]
    return row


def lengths_of(args) -> list[int]:
    return [int(n) for n in args.lengths.split(",")] if args.lengths else LENGTHS


def evaluate(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["row"] == "reference" and r.get("losses")), None)
    for r in rows:
        if ref is None or r is ref or not r.get("losses"):
            continue
        pairs = list(zip(r["losses"], ref["losses"]))
        r["max_loss_rel_vs_reference"] = max(abs(a - b) / abs(b) for a, b in pairs)
        r["within_bf16_tolerance"] = r["max_loss_rel_vs_reference"] <= BF16_REL


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Padded lengths under a cap ({meta['device']}, torch {meta['torch']}, {meta['date']})",
        "",
        f"`{meta['command']}`: {meta['model']} shape, batch {meta['batch']}, sequence lengths "
        f"{meta['lengths'] or ', '.join(map(str, LENGTHS))} (x{meta['rounds']}), bf16 autocast, "
        "`labels=` loss, "
        f"fused AdamW; losses against plain PyTorch on the whole device (tolerance "
        f"{BF16_REL:.4f} relative).",
        "",
        "| row | cap GiB | steps | graphs | losses rel vs reference | reserved peak GiB | wall s "
        "| error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = r.get("max_loss_rel_vs_reference")
        lines.append(
            f"| {r['row']} | {r.get('cap_gib', '-')} | {len(r.get('losses', []))} | "
            f"{r.get('graphs', '-')} | "
            f"{'-' if rel is None else f'{rel:.1e}'} | {r.get('peak_reserved_gib', '-')} | "
            f"{r.get('wall_s', '-')} | {r.get('error', '')} |"
        )
    lines.append("")
    for r in rows:
        for p in r.get("plans", []):
            lines.append(f"- {r['row']} plan {p}")
        if r.get("losses"):
            lines.append(f"- {r['row']} losses: {', '.join(f'{v:.4f}' for v in r['losses'])}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--cap", type=float, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--lengths", default="", help="comma-separated (default: LENGTHS)")
    rows_main(__file__, ap, ROWS, run_row, evaluate, table, ("model", "rounds", "lengths"))


if __name__ == "__main__":
    main()
