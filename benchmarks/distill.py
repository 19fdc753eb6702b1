"""Distillation on one device (GPU): a frozen teacher and the student it teaches, both under
protrain with no ``memory_budget``, so that they share what the process may use.

HF ``LlamaForCausalLM``: the teacher with Llama-3.2-3B's shape (12.0 GiB of fp32 parameters), frozen
(``requires_grad_(False)``, eval mode), the student with Llama-3.2-1B's (the same 128k vocabulary),
trained with fused AdamW; both built from seed 0 in host memory under ``protrain_fx.host_init``
(oom_sweep.build), bf16 autocast, batch ``--batch`` x ``--seq`` of fixed random tokens; the loss
is the student's own (``labels=``) plus the KL divergence of its logits to the teacher's. Rows,
each its own process (``--row``):

- ``reference``: plain PyTorch on the whole device (eager).
- ``teacher_first``: protrain under ``--cap`` GiB (``set_per_process_memory_fraction``), the
  teacher's forward before the student's in each step: it is placed first, whole where it fits,
  and the student's training plan takes that placement back (inference_placement.py).
- ``student_first``: the student's forward first, then the teacher's, then the backward: the teacher
  is placed beside the student's step.
- ``own_loss_reference`` / ``own_loss``: the student alone (no teacher), its loss computed by the
  loop from the returned logits in fp32 (``F.cross_entropy(out.logits.float(), ...)``, no
  ``labels=``): plain PyTorch on the whole device, and protrain under ``--cap``. Both distillation
  orders and this one allocate gigabytes of their own between the forward and the backward, which
  protrain measures in the first step and budgets (profiling/loop_memory.py).
- ``twins_reference`` / ``twins``: two students of the same shape, each with its AdamW (learning
  rates 1e-4 and 3e-4), stepped in turn with ``labels=``: dynamo runs the first's graph for the
  second, which gets a graph of its own (protrain_fx/model_instances.py), planned beside the first
  (protrain_fx/trained_peers.py). Both twins' losses are compared.
- ``regional``: the student alone compiled block by block (``layer.compile(backend="protrain")``),
  HF's own loss (``labels=``, the same cross-entropy as ``own_loss``'s, against its reference): the
  embedding, head and loss run outside the compiled blocks.

Per row: the losses (against the reference's, bf16 tolerance), the step time (median of the steps
after the second), the reserved peak against the cap, the time to the first step, the student's
plan (resident chunks, budget) and the teacher's placement, and protrain's warnings (re-plans).
Writes ``OUT.json`` and ``OUT.md``.

    python benchmarks/distill.py --out $OUT/distill_h100 [--cap 24 --steps 8]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from results_io import rows_main  # noqa: E402

ROWS = [
    "reference",
    "teacher_first",
    "student_first",
    "own_loss_reference",
    "own_loss",
    "regional",
    "twins_reference",
    "twins",
]
BF16_REL = 2**-6  # oom_sweep.BF16_REL


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage()[:300])


def run_row(name: str, args) -> dict:
    import torch
    import torch.nn.functional as F
    from oom_sweep import MODELS, build

    said = _Warnings()
    logging.getLogger("protrain_fx").addHandler(said)
    g = torch.Generator().manual_seed(1)
    vocab = MODELS[args.student]["vocab"]
    data = [torch.randint(0, vocab, (args.batch, args.seq), generator=g).cuda() for _ in range(2)]
    row = {"row": name}
    t0 = time.perf_counter()
    host = not name.endswith("reference")
    alone = name.startswith("own_loss") or name == "regional"  # no teacher
    twins = name.startswith("twins")  # a second student of the same shape, trained beside
    t_model = (
        None
        if alone
        else build(MODELS[args.student if twins else args.teacher], args.seq, host=host)
    )
    if t_model is not None and not twins:
        t_model = t_model.eval().requires_grad_(False)
    s_model = build(MODELS[args.student], args.seq, host=host)
    opt = torch.optim.AdamW(s_model.parameters(), lr=1e-4, fused=True)
    # the twin: its own AdamW, another learning rate
    opt2 = torch.optim.AdamW(t_model.parameters(), lr=3e-4, fused=True) if twins else None
    if host:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap * 2**30 / total)
        row["cap_gib"] = args.cap
        teacher = None if alone else torch.compile(t_model, backend="protrain")
        student = torch.compile(s_model, backend="protrain")
        if name == "regional":
            for layer in s_model.model.layers:
                layer.compile(backend="protrain")
            student = s_model
    else:
        teacher, student = t_model, s_model
    row["build_s"] = round(time.perf_counter() - t0, 1)

    def step(x) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "regional":
                return _finish(student(input_ids=x, labels=x).loss)
            if twins:  # each twin's step in turn; the first's loss reported, the second's kept
                first = _finish(student(input_ids=x, labels=x).loss)
                row.setdefault("twin_losses", []).append(
                    _finish(teacher(input_ids=x, labels=x).loss, opt2)
                )
                return first
            if alone:
                logits = student(input_ids=x).logits.float()
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
                return _finish(loss)
            if name == "student_first":
                out = student(input_ids=x, labels=x)
            with torch.no_grad():
                target = F.softmax(teacher(input_ids=x).logits.float(), -1)
            if name != "student_first":
                out = student(input_ids=x, labels=x)
            log_p = F.log_softmax(out.logits.float(), -1)
            loss = out.loss + F.kl_div(log_p, target, reduction="batchmean")
        return _finish(loss)

    def _finish(loss, optimizer=opt) -> float:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses, times = [], []
    row["losses"] = losses
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            losses.append(step(data[i % 2]))
        except Exception as e:  # where it failed: protrain's code or the loop's own
            frames = traceback.extract_tb(e.__traceback__)
            where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.line}" for f in frames[-4:]]
            row["error"] = f"step {i + 1}: {type(e).__name__}: {str(e)[:300]} at {where}"
            row["allocated_gib_at_error"] = round(torch.cuda.memory_allocated() / 2**30, 3)
            break
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if i == 0:
            row["first_step_s"] = round(time.perf_counter() - t0, 1)
    if "error" not in row:
        _timings(row, times, args)
    if host:
        # compiled in regions: the first block's plan (each block plans its share alike)
        _plans(row, s_model.model.layers[0] if name == "regional" else student, teacher)
    row["warnings"] = said.messages
    return row


def _timings(row: dict, times: list, args) -> None:
    import torch

    row["step_s"] = round(statistics.median(times[2:]), 4)
    row["tokens_per_s"] = round(args.batch * args.seq / row["step_s"])
    row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)


def _plans(row: dict, student, teacher) -> None:
    import protrain_fx

    try:
        s_plan = protrain_fx.get_plan(student)
        t_plan = protrain_fx.get_plan(teacher) if teacher is not None else None
    except Exception as e:  # a failure before both were planned
        row["plans"] = f"{type(e).__name__}: {e}"[:300]
        return
    pred = s_plan.predicted or {}
    row["student_plan"] = (
        f"{s_plan.n_persist} of {len(s_plan.chunks)} chunks resident, predicted peak "
        f"{(pred.get('peak_bytes') or 0) / 2**30:.2f} GiB"
    )
    row["student_budget"] = pred.get("budget")
    row["student_notes"] = [n for n in s_plan.notes if "frozen model" in n or "loop" in n]
    # what the loop held of its own between the student's forward and backward (loop_memory.py)
    row["loop_gib"] = round(((s_plan.measured or {}).get("loop_bytes") or 0) / 2**30, 3)
    row["loop_budgeted_gib"] = round((pred.get("loop_excess_bytes") or 0) / 2**30, 3)
    if t_plan is not None:
        row["teacher_plan"] = f"{t_plan.n_persist} of {len(t_plan.chunks)} chunks resident"
        row["teacher_note"] = next((n for n in t_plan.notes if n.startswith("inference")), None)


def evaluate(rows: list[dict]) -> None:
    refs = {r["row"]: r for r in rows if r["row"].endswith("reference") and "losses" in r}
    for r in rows:
        own = r["row"] in ("own_loss", "regional")
        ref = refs.get(
            "own_loss_reference"
            if own
            else "twins_reference"
            if r["row"] == "twins"
            else "reference"
        )
        if ref is None or "cap_gib" not in r or not r.get("losses") or "error" in r:
            continue
        pairs = list(zip(r["losses"], ref["losses"]))
        pairs += list(zip(r.get("twin_losses", []), ref.get("twin_losses", [])))
        r["max_loss_rel_vs_reference"] = max(abs(a - b) / abs(b) for a, b in pairs)
        r["within_bf16_tolerance"] = r["max_loss_rel_vs_reference"] <= BF16_REL
        r["within_cap"] = r["peak_reserved_gib"] <= r["cap_gib"]


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Distillation on one device ({meta['device']}, torch {meta['torch']}, {meta['date']})",
        "",
        f"`{meta['command']}`: teacher {meta['teacher']} shape (frozen), student {meta['student']} "
        f"shape (AdamW), batch {meta['batch']} x {meta['seq']}, bf16 autocast, `labels=` loss + KL "
        f"to the teacher (own_loss: the student alone, the loop's fp32 cross-entropy on its "
        f"logits); losses against plain PyTorch on the whole device (tolerance "
        f"{BF16_REL:.4f} relative); loop GiB: what the loop held of its own between the "
        f"student's forward and backward (measured), budgeted: what the plan took out of its "
        f"budget for it.",
        "",
        "| row | cap GiB | reserved peak GiB | losses rel vs reference | step s | tokens/s | "
        "first step s | loop GiB (budgeted) | student's plan | teacher's placement | warnings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "losses" not in r or "error" in r:
            plans = f"{r.get('student_plan', '-')} | {r.get('teacher_plan', '-')}"
            lines.append(
                f"| {r['row']} | {r.get('cap_gib', '-')} | error (below) | - | - | - | - | "
                f"{_loop(r)} | {plans} | {len(r.get('warnings', []))} |"
            )
            continue
        rel = r.get("max_loss_rel_vs_reference")
        lines.append(
            f"| {r['row']} | {r.get('cap_gib', '-')} | {r['peak_reserved_gib']} | "
            f"{'-' if rel is None else f'{rel:.1e}'} | {r['step_s']} | {r['tokens_per_s']} | "
            f"{r['first_step_s']} | {_loop(r)} | {r.get('student_plan', '-')} | "
            f"{r.get('teacher_plan', '-')} | "
            f"{len(r.get('warnings', []))} |"
        )
    lines.append("")
    for r in rows:
        for key in ("student_budget", "student_notes", "teacher_note", "warnings", "error"):
            if r.get(key):
                lines.append(f"- {r['row']}, {key.replace('_', ' ')}: {r[key]}")
    return "\n".join(lines) + "\n"


def _loop(r: dict) -> str:
    return f"{r['loop_gib']} ({r['loop_budgeted_gib']})" if "loop_gib" in r else "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="llama3.2-3b")
    ap.add_argument("--student", default="llama3.2-1b")
    ap.add_argument("--cap", type=float, default=24)
    ap.add_argument("--steps", type=int, default=8)
    rows_main(__file__, ap, ROWS, run_row, evaluate, table, ("teacher", "student"))


if __name__ == "__main__":
    main()
