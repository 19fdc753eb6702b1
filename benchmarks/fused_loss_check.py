"""The fused head and loss (``protrain::linear_cross_entropy``, issue 24 deliverable 2) against
eager's ``F.cross_entropy((hidden @ weight.T).float())`` on the GPU, at the shapes of Llama-3.2's
heads: its gradients, the device memory its backward adds, and its time.

For each shape (tokens x width x vocabulary; bf16 projection as autocast runs it, fp32 loss as
Hugging Face's ``ForCausalLMLoss`` computes it, a tenth of the targets ``ignore_index``), one
forward + backward of each of:

* ``eager``: the projection and the loss as the model computes them (logits, their fp32 copy and
  their gradient whole);
* ``fused``: protrain's op, over chunks of rows in forward and slices of the vocabulary in
  backward (``PROTRAIN_LOSS_CHUNK_BYTES``, default 128 MiB of fp32 logits per chunk).

Reported per shape and system: the peak device memory above the inputs (forward + backward,
``max_memory_allocated``), the median time of forward + backward over 5 runs after 2 warm-ups
(synchronized), and for ``fused`` the loss's relative difference from eager's and the largest
difference of each gradient relative to the gradient's largest element (fp32 rounding: about
1e-7; bf16 gradients: one bf16 rounding, about 4e-3).

    python benchmarks/fused_loss_check.py --out $OUT/fused_loss_check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from results_io import cuda_results, title, write_json, write_table

SHAPES = [  # (name, tokens, width, vocabulary)
    ("llama3.2-1b 4x1024", 4096, 2048, 128256),
    ("llama3.2-1b 8x2048", 16384, 2048, 128256),
    ("llama3.2-3b 4x1024", 4096, 3072, 128256),
]


def inputs(tokens, width, vocab, device):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, width, device=device, generator=g, dtype=torch.bfloat16)
    weight = torch.randn(vocab, width, device=device, generator=g) * 0.02
    target = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    target[::10] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), target


def run(system, hidden, weight, target):
    hidden.grad = weight.grad = None
    w = weight.to(torch.bfloat16)  # autocast's cast, as in the graph
    if system == "eager":
        loss = F.cross_entropy((hidden @ w.t()).float(), target)
    else:
        from protrain_fx import config

        rows = max(1, config.settings().loss_chunk_bytes // (weight.shape[0] * 4))
        loss = torch.ops.protrain.linear_cross_entropy(
            hidden, w, target, -100, "mean", rows, torch.bfloat16
        )[0]
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def measure(system, hidden, weight, target, dev):
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out = run(system, hidden, weight, target)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    times = []
    for i in range(7):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        run(system, hidden, weight, target)
        torch.cuda.synchronize(dev)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return out, peak, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import protrain_fx.runtime.loss_ops  # noqa: F401  (registers the ops)

    dev = torch.device("cuda")
    rows = []
    for name, tokens, width, vocab in SHAPES:
        hidden, weight, target = inputs(tokens, width, vocab, dev)
        ref, ref_peak, ref_s = measure("eager", hidden, weight, target, dev)
        ref = tuple(t.clone() for t in ref)
        got, peak, s = measure("fused", hidden, weight, target, dev)
        row = {
            "shape": name,
            "tokens": tokens,
            "width": width,
            "vocab": vocab,
            "eager_peak_gib": ref_peak / 2**30,
            "fused_peak_gib": peak / 2**30,
            "eager_ms": ref_s * 1e3,
            "fused_ms": s * 1e3,
            "loss_rel": (abs(got[0] - ref[0]) / abs(ref[0])).item(),
            "dhidden_rel_to_max": ((got[1] - ref[1]).abs().max() / ref[1].abs().max()).item(),
            "dweight_rel_to_max": ((got[2] - ref[2]).abs().max() / ref[2].abs().max()).item(),
            "dweight_bitwise_equal_share": (got[2] == ref[2]).float().mean().item(),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del hidden, weight, target, ref, got
        torch.cuda.empty_cache()
    out = cuda_results(rows)
    write_json(args.out, out)
    lines = [
        title("The fused head and loss against eager", out),
        "",
        "| shape | peak above inputs GiB eager / fused | fwd+bwd ms eager / fused | loss rel | "
        "d hidden (rel to max) | d weight (rel to max) | d weight bitwise equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['eager_peak_gib']:.2f} / {r['fused_peak_gib']:.2f} | "
            f"{r['eager_ms']:.1f} / {r['fused_ms']:.1f} | {r['loss_rel']:.1e} | "
            f"{r['dhidden_rel_to_max']:.1e} | {r['dweight_rel_to_max']:.1e} | "
            f"{r['dweight_bitwise_equal_share']:.3f} |"
        )
    write_table(args.out, lines)


if __name__ == "__main__":
    main()
