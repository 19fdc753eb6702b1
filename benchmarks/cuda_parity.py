"""Compiled (backend="protrain") against eager PyTorch on CUDA: losses and parameters after several
AdamW steps, fp32 and bf16 autocast, GPT-2-style and LLaMA-style models. Writes one JSON file.

    python benchmarks/cuda_parity.py --out benchmarks/results/cuda_parity.json

The bf16 rows also measure eager AMP against itself (two identical eager runs), the noise floor that
the design's contract uses as the bf16 tolerance.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from models import build  # noqa: E402

from protrain_fx.testing import compare_with_eager, random_batches, train_steps  # noqa: E402


def eager_vs_eager(base, data, **kw) -> dict:
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    la, lb = train_steps(a, a, data, **kw), train_steps(b, b, data, **kw)
    return {
        "max_loss_rel": max(abs(x - y) / abs(y) for x, y in zip(la, lb)),
        "max_param_abs": max(
            (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for kind in ("gpt", "llama"):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            if kind == "gpt":
                base = build(
                    "gpt", n_layer=4, n_embd=512, n_head=8, block_size=256, vocab_size=4096
                ).to(dev)
            else:
                base = build(
                    "llama",
                    n_layer=4,
                    dim=512,
                    n_head=8,
                    n_kv_head=4,
                    ffn_dim=1376,
                    max_seq_len=256,
                    vocab_size=4096,
                ).to(dev)
            data = random_batches(args.steps, batch=8, seq=256, vocab=4096, device=dev)
            kw = {"lr": 1e-3, "autocast_dtype": None if dtype == torch.float32 else dtype}
            torch._dynamo.reset()
            t0 = time.perf_counter()
            r = compare_with_eager(base, data, {}, **kw)
            row = {
                "model": kind,
                "dtype": str(dtype).replace("torch.", ""),
                "steps": args.steps,
                "params": sum(p.numel() for p in base.parameters()),
                "losses_compiled": r.losses,
                "losses_eager": r.ref_losses,
                "max_loss_rel": r.max_loss_rel,
                "max_param_abs": r.max_param_abs,
                "max_param_update": r.max_param_update,
                "seconds": time.perf_counter() - t0,
                "blocks": [b.name for b in r.plan.blocks],
                "n_chunks": len(r.plan.chunks),
                "eager_vs_eager": eager_vs_eager(base, data, **kw),
            }
            rows.append(row)
            print(
                f"{kind:5s} {row['dtype']:8s} loss rel {row['max_loss_rel']:.2e} param abs "
                f"{row['max_param_abs']:.2e} "
                f"(eager vs eager: {row['eager_vs_eager']['max_loss_rel']:.2e} / "
                f"{row['eager_vs_eager']['max_param_abs']:.2e})",
                flush=True,
            )
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
