"""Inference graphs under a cap (GPU): a model evaluated before it trains, and a frozen teacher.

HF ``LlamaForCausalLM`` with Llama-3.2-3B's shape (oom_sweep.MODELS, 12.0 GiB of fp32 parameters),
built from seed 0 and kept in host memory under ``protrain_fx.host_init``, bf16 autocast,
``labels=`` loss, batch ``--batch`` x ``--seq`` of fixed random tokens. Rows, each its own
process (``--row``):

- ``reference``: plain PyTorch on the whole device (eager, fused AdamW): the evaluation loss of the
  evaluation batch, ``--steps`` training steps, the evaluation loss again.
- ``eval_first``: protrain under ``--cap`` GiB (``set_per_process_memory_fraction``), the loop
  evaluating under ``torch.no_grad()`` (``--grad-mode inference_mode``: under
  ``torch.inference_mode()``, as PyTorch Lightning validates, before training by default) before
  its first training step, then training, then evaluating again. Before the inference placement
  the evaluation graph kept every chunk resident: 12 GiB of parameters in a 12 GiB cap.
- ``teacher``: the same model frozen (``requires_grad_(False)``, eval mode), as a distillation
  teacher or a DPO reference model is, under ``--teacher-cap`` GiB: two forwards under no_grad.
- ``teacher_min``: the frozen model with ``memory_budget="1GiB"``: the NoPlanFits that names the
  smallest budget, then the forwards under that budget.

Per row: the losses (against the reference's, bf16 tolerance), the plan's predicted peak and the
reserved peak measured over the evaluation, the plan's note. Writes ``OUT.json`` and ``OUT.md``.

    python benchmarks/eval_first.py --out $OUT/eval_first_h100 [--cap 12 --teacher-cap 6]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from results_io import rows_main  # noqa: E402

ROWS = ["reference", "eval_first", "teacher", "teacher_min"]
BF16_REL = 2**-6  # oom_sweep.BF16_REL


def _data(spec, batch, seq):
    import torch

    g = torch.Generator().manual_seed(1)
    train = torch.randint(0, spec["vocab"], (batch, seq), generator=g).cuda()
    held_out = torch.randint(0, spec["vocab"], (batch, seq), generator=g).cuda()
    return train, held_out


GRAD_MODE = "no_grad"  # --grad-mode: what every evaluation runs under


def _eval(model, x) -> tuple[float, float]:
    """(loss, reserved peak GiB over the call)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with getattr(torch, GRAD_MODE)(), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss.item()
    return loss, torch.cuda.max_memory_reserved() / 2**30


def run_row(name: str, args) -> dict:
    import torch
    from min_budget import bf16_step, no_plan_fits_of
    from oom_sweep import MODELS, build

    import protrain_fx

    spec = MODELS[args.model]
    train, held_out = _data(spec, args.batch, args.seq)
    global GRAD_MODE
    GRAD_MODE = args.grad_mode
    row = {"row": name, "grad_mode": args.grad_mode}
    t0 = time.perf_counter()
    model = build(spec, args.seq, host=name != "reference")
    cap = {"eval_first": args.cap, "teacher": args.teacher_cap}.get(name)
    total = torch.cuda.get_device_properties(0).total_memory
    if cap:
        torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
        row["cap_gib"] = cap
    if name.startswith("teacher"):
        model.eval().requires_grad_(False)
    opt = None if name.startswith("teacher") else torch.optim.AdamW(model.parameters(), fused=True)
    if name == "reference":
        run = model
    else:
        options = {"memory_budget": "1GiB"} if name == "teacher_min" else {}
        run = torch.compile(model, backend="protrain", options=options)
    if name == "teacher_min":
        try:
            _eval(run, held_out)
            row["error"] = "no NoPlanFits under a 1 GiB budget"
            return row
        except Exception as e:
            cause = no_plan_fits_of(e)
            row["min_device_gib"] = round(cause.min_device_bytes / 2**30, 3)
            row["no_plan_fits"] = str(cause)[:700]
        import torch._dynamo

        torch._dynamo.reset()
        budget = cause.min_device_bytes
        run = torch.compile(model, backend="protrain", options={"memory_budget": budget})
    loss, peak = _eval(run, held_out)
    row["eval_losses"], row["eval_peak_reserved_gib"] = [loss], [round(peak, 3)]
    row["first_eval_s"] = round(time.perf_counter() - t0, 1)
    plan = protrain_fx.get_plan(run) if name != "reference" else None
    if plan is not None:
        row["predicted_peak_gib"] = round((plan.predicted or {}).get("peak_bytes", 0) / 2**30, 3)
        row["note"] = next((n for n in plan.notes if n.startswith("inference graph")), None)
        row["eval_plan"] = f"{plan.n_persist} of {len(plan.chunks)} chunks resident"
    row["train_losses"] = []
    try:
        for _ in range(args.steps if opt is not None else 0):
            row["train_losses"].append(bf16_step(run, opt, train))
    except Exception as e:  # the evaluation's numbers stay in the row
        row["error"] = f"training: {type(e).__name__}: {str(e)[:600]}"
        return row
    if opt is not None and plan is not None:
        trained = protrain_fx.get_plan(run)
        row["train_plan"] = f"{trained.n_persist} of {len(trained.chunks)} chunks resident"
    loss, peak = _eval(run, held_out)
    row["eval_losses"].append(loss)
    row["eval_peak_reserved_gib"].append(round(peak, 3))
    row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def evaluate(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["row"] == "reference" and "eval_losses" in r), None)
    for r in rows:
        if ref is None or r is ref or "eval_losses" not in r:
            continue
        pairs = [(r["eval_losses"][0], ref["eval_losses"][0])]
        if r.get("train_losses") and len(r["eval_losses"]) > 1:
            pairs += list(zip(r["train_losses"], ref["train_losses"]))
            pairs.append((r["eval_losses"][1], ref["eval_losses"][1]))
        elif r["row"].startswith("teacher") and len(r["eval_losses"]) > 1:
            pairs.append((r["eval_losses"][1], ref["eval_losses"][0]))
        r["max_loss_rel_vs_reference"] = max(abs(a - b) / abs(b) for a, b in pairs)
        r["within_bf16_tolerance"] = r["max_loss_rel_vs_reference"] <= BF16_REL
        if r.get("predicted_peak_gib"):
            r["eval_peak_err"] = round(
                r["eval_peak_reserved_gib"][0] / r["predicted_peak_gib"] - 1, 4
            )


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Inference graphs under a cap ({meta['device']}, torch {meta['torch']}, {meta['date']})",
        "",
        f"`{meta['command']}`: {meta['model']} shape, batch {meta['batch']} x {meta['seq']}, bf16 "
        "autocast, `labels=` loss, evaluations under "
        f"`torch.{meta.get('grad_mode', 'no_grad')}()`; losses against plain PyTorch on the whole "
        f"device (tolerance {BF16_REL:.4f} relative).",
        "",
        "| row | cap GiB | first evaluation: plan | predicted peak GiB | reserved peak GiB "
        "(err) | losses rel vs reference | after training: plan | eval loss before / after | "
        "first evaluation s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r and "eval_losses" not in r:
            lines.append(f"| {r['row']} | {r.get('cap_gib', '-')} | error: {r['error']} |")
            continue
        err = f" ({r['eval_peak_err']:+.1%})" if "eval_peak_err" in r else ""
        peaks = r.get("eval_peak_reserved_gib") or ["-"]
        rel = r.get("max_loss_rel_vs_reference")
        evals = " / ".join(f"{v:.4f}" for v in r.get("eval_losses", []))
        cap = r.get("cap_gib") or (
            f"{r['min_device_gib']} (NoPlanFits' minimum)" if "min_device_gib" in r else "-"
        )
        lines.append(
            f"| {r['row']} | {cap} | {r.get('eval_plan', '-')} | "
            f"{r.get('predicted_peak_gib', '-')} | {peaks[0]}{err} | "
            f"{'-' if rel is None else f'{rel:.1e}'} | {r.get('train_plan', '-')} | {evals} | "
            f"{r.get('first_eval_s', '-')} |"
        )
    lines.append("")
    for r in rows:
        for key in ("note", "no_plan_fits", "error"):
            if r.get(key):
                lines.append(f"- {r['row']}, {key.replace('_', ' ')}: {r[key]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3.2-3b")
    ap.add_argument("--cap", type=float, default=12)
    ap.add_argument("--teacher-cap", type=float, default=6)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--grad-mode", choices=["no_grad", "inference_mode"], default="no_grad")
    rows_main(__file__, ap, ROWS, run_row, evaluate, table, ("model", "grad_mode"))


if __name__ == "__main__":
    main()
