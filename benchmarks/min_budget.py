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
import time

from hf_exactness import LLAMA_3B, build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from protrain_fx.errors import NoPlanFits

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
    except Exception as e:  # dynamo wraps the backend's error
        cause = e
        while cause is not None and not isinstance(cause, NoPlanFits):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        row["min_device_bytes"] = cause.min_device_bytes
        row["min_device_gib"] = round(cause.min_device_bytes / 2**30, 2)
        row["message"] = str(cause)[:600]
    row["seconds"] = round(time.perf_counter() - t0, 1)
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
    print(json.dumps(row))


if __name__ == "__main__":
    main()
