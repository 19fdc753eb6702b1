"""The smallest device budget the automatic plan accepts for a model (issue 24: the 8-layer
variant of Llama-3.2-3B's shape, once 10.79 GiB; goal <= 5 GiB). GPU.

Builds HF ``LlamaForCausalLM`` with Llama-3.2-3B's shape (hf_exactness.LLAMA_3B) and ``--layers``
layers on the device, a fused AdamW, and compiles it with protrain under a ``memory_budget`` far
too small (1 GiB); the first step (bf16 autocast, batch 4 x 1024, ``labels=``) stops with
``NoPlanFits``, which names the smallest budget that works. Writes ``OUT.json`` and ``OUT.md``.

    python benchmarks/min_budget.py --layers 8 --out $OUT/min_budget_h200
"""

from __future__ import annotations

import argparse
import json
import os
import time

from hf_exactness import LLAMA_3B, build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="then train this many steps under the budget NoPlanFits named (its peaks recorded)",
    )
    ap.add_argument(
        "--memory-history",
        action="store_true",
        help="with --train-steps: record the allocator's history of the second and third steps "
        "(summarized by oom_sweep.summarize_snapshot)",
    )
    args = ap.parse_args()
    import torch

    spec = dict(LLAMA_3B, layers=args.layers)
    model = build(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(
        model, backend="protrain", options={"optimizer": opt, "memory_budget": "1GiB"}
    )
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), device="cuda")
    t0 = time.perf_counter()
    row = {"layers": args.layers, "params": sum(p.numel() for p in model.parameters())}
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(input_ids=x, labels=x).loss.backward()
        row["error"] = "no NoPlanFits under a 1 GiB budget"
    except Exception as e:
        cause = no_plan_fits_of(e)
        row["min_device_bytes"] = cause.min_device_bytes
        row["min_device_gib"] = round(cause.min_device_bytes / 2**30, 2)
        row["message"] = str(cause)[:600]
    row["seconds"] = round(time.perf_counter() - t0, 1)
    if args.train_steps and "min_device_bytes" in row:
        row["at_min"] = train_at(
            model, opt, x, row["min_device_bytes"], args.train_steps, args.memory_history
        )
    row["device"] = torch.cuda.get_device_name(0)
    row["torch"] = torch.__version__
    with open(args.out + ".json", "w") as f:
        json.dump(row, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(
            f"# Smallest budget of the automatic plan (`python benchmarks/min_budget.py "
            f"--layers {args.layers}`)\n\n{row['device']}, torch {row['torch']}; HF "
            f"LlamaForCausalLM, Llama-3.2-3B's shape with {args.layers} layers "
            f"({row['params'] / 1e9:.2f} B parameters), batch 4 x 1024, bf16 autocast, fused "
            f"AdamW.\n\n| layers | smallest budget (GiB) | bytes |\n|---|---|---|\n"
            f"| {args.layers} | {row.get('min_device_gib')} | {row.get('min_device_bytes')} |\n\n"
            f"{row.get('message', row.get('error'))}\n"
        )
        if "at_min" in row:
            short = {k: v for k, v in row["at_min"].items() if k != "memory_history"}
            f.write(f"\nTrained at that budget: `{json.dumps(short)}`\n")
    print(json.dumps(row))


def no_plan_fits_of(e: BaseException):
    """The NoPlanFits that ``e`` (dynamo's wrapper of the backend's error) was raised from;
    ``e`` itself raised again when it was not."""
    from protrain_fx.errors import NoPlanFits

    cause = e
    while cause is not None and not isinstance(cause, NoPlanFits):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        raise e
    return cause


def bf16_step(call, opt, x) -> float:
    """One training step as the benchmarks' loops take it: bf16 autocast, HF's own loss on ``x``,
    backward, ``opt.step()``, ``zero_grad()``; the loss."""
    import torch

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = call(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train_at(model, opt, x, budget: int, steps: int, history: bool = False) -> dict:
    """Train ``steps`` steps under the budget NoPlanFits named: that the number is one a plan
    really trains in (losses, the device's reserved and allocated peaks against it)."""
    import torch
    import torch._dynamo

    import protrain_fx
    from protrain_fx.machine import allocator

    if os.environ.get("SWEEP_TRIM_AT"):  # as oom_sweep.py: an A/B of allocator.TRIM_AT
        allocator.TRIM_AT = float(os.environ["SWEEP_TRIM_AT"])
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="protrain", options={"optimizer": opt, "memory_budget": budget}
    )
    out = {
        "budget_bytes": budget,
        "losses": [],
        "step_peak_reserved_bytes": [],
        "step_peak_allocated_bytes": [],
        # allocated at each step's start, against the plan's timeline start (allocator.trimmed)
        "step_start_allocated_bytes": [],
    }
    try:
        for i in range(steps):
            if history and i == 1:
                torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
            torch.cuda.reset_peak_memory_stats()
            out["step_start_allocated_bytes"].append(torch.cuda.memory_allocated())
            out["losses"].append(bf16_step(compiled, opt, x))
            out["step_peak_reserved_bytes"].append(torch.cuda.max_memory_reserved())
            out["step_peak_allocated_bytes"].append(torch.cuda.max_memory_allocated())
            if history and i == 2:
                from oom_sweep import summarize_snapshot

                out["memory_history"] = summarize_snapshot(torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
        plan = protrain_fx.get_plan(compiled)
        out["trims"] = plan.trims
        predicted = plan.predicted or {}
        out["plan_start_bytes"] = (predicted.get("timeline") or [[0, None]])[0][1]
        out["plan_peak_bytes"] = predicted.get("peak_bytes")
        out["trim_at"] = allocator.TRIM_AT
        out["finite"] = all(v == v and abs(v) != float("inf") for v in out["losses"])
        # steps after the first (which binds, profiles nothing, and moves parameters to the host)
        later = out["step_peak_reserved_bytes"][1:] or out["step_peak_reserved_bytes"]
        out["peak_reserved_over_budget"] = round(max(later) / budget - 1, 4)
    except Exception as e:  # reported in the row, not raised: the budget search's number stays
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return out


if __name__ == "__main__":
    main()
