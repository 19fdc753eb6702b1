"""Does the GPU slow down under sustained load, and by how much (issue 21; GPU).

The profiler times blocks in short runs at the device's boost clock; a plan that keeps the device
busy for the whole step draws more power, and at the board's power limit the SM clock drops (the
1B shape at batch 8 x 2048: profiled at 1967 MHz, stepped at 1690 MHz, 680 W; its forward and
backward took 5-8% longer than profiled). This probe measures the same effect on dense bf16 matrix
multiplies (what the hardware profile times, ``gpu_sustained_slowdown``) and on a Llama-like
block's forward and backward (hidden 2048, 32 heads, FFN 8192, 4 x 2048 tokens, eager): after a
second idle, the time of single runs at the boost clock, then runs back to
back for ``--seconds``, in windows of 100 ms, each with its SM clock and power from NVML.

    python benchmarks/power_probe.py --out $OUT/power_probe_h200

writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from results_io import write_json, write_table

# the block: hidden, heads (of HIDDEN // HEADS), FFN width, sequences x tokens
HIDDEN, HEADS, FFN, BATCH, SEQ = 2048, 32, 8192, 4, 2048
PRODUCT_N = 8192  # the fallback: n x n bf16 products
SINGLES = 5  # single runs after the idle second, the fastest kept


def transformer_block(dev: torch.device) -> tuple[Callable[[], None], float]:
    """One forward and backward of a Llama-like block on ``dev``, and its FLOPs."""
    t, h, f = BATCH * SEQ, HIDDEN, FFN

    def weight(*shape):
        return (
            torch.randn(*shape, device=dev, dtype=torch.bfloat16) * shape[0] ** -0.5
        ).requires_grad_()

    w_qkv, w_o, w_gu, w_down = weight(h, 3 * h), weight(h, h), weight(h, 2 * f), weight(f, h)
    n1, n2 = (torch.ones(h, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    params = (x, w_qkv, w_o, w_gu, w_down, n1, n2)

    def rms(v, w):
        v32 = v.float()
        return (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(v.dtype) * w

    def heads(v):
        return v.view(BATCH, SEQ, HEADS, h // HEADS).transpose(1, 2)

    def run() -> None:
        with torch.enable_grad():
            q, k, v = (rms(x, n1) @ w_qkv).split(h, dim=-1)
            a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            y = x + a.transpose(1, 2).reshape(t, h) @ w_o
            g, u = (rms(y, n2) @ w_gu).split(f, dim=-1)
            out = y + (F.silu(g) * u) @ w_down
            torch.autograd.grad(out, params, grad_out)

    per_token = 2 * h * (3 * h + h + 2 * f + f) + 4 * SEQ * h // 2  # products, causal attention
    return run, 3.0 * per_token * t


def products(dev: torch.device, n: int = PRODUCT_N) -> tuple[Callable[[], None], float]:
    """One n x n bf16 product on ``dev``, and its FLOPs."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def run() -> None:
        a @ b

    return run, 2.0 * n**3


def timed(dev: torch.device, work: Callable[[], None], k: int) -> float:
    """Seconds per run of ``k`` runs of ``work`` back to back, by device events."""
    with torch.cuda.device(dev):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            work()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1e3 / k


def single_after_idle(dev: torch.device, work: Callable[[], None]) -> float:
    """The fastest of :data:`SINGLES` runs after an idle second (the clock back at its boost)."""
    for _ in range(3):
        work()  # warm-up: kernels chosen, memory cached
    torch.cuda.synchronize(dev)
    time.sleep(1.0)
    single = []
    for _ in range(SINGLES):
        single.append(timed(dev, work, 1))
        time.sleep(0.05)
    return min(single)


def probe(h, dev, work, flop: float, seconds: float) -> dict:
    """``work`` once at a time after an idle second, then back to back for ``seconds`` in windows
    of about 100 ms, each with its SM clock and power."""
    import pynvml

    single = single_after_idle(dev, work)
    k = max(1, round(0.1 / single))
    windows = []
    t_start = time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        s = timed(dev, work, k)
        windows.append(
            {
                "t_s": round(time.perf_counter() - t_start, 2),
                "ms": round(s * 1e3, 4),
                "tflops": round(flop / s / 1e12, 1),
                "sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "watts": round(pynvml.nvmlDeviceGetPowerUsage(h) / 1e3, 1),
            }
        )
    late = windows[len(windows) // 2 :]
    return {
        "single_ms": round(single * 1e3, 4),
        "sustained_ms": round(statistics.median(w["ms"] for w in late), 4),
        "sustained_over_boost": round(statistics.median(w["ms"] for w in late) / (single * 1e3), 4),
        "sustained_sm_mhz": statistics.median(w["sm_mhz"] for w in late),
        "sustained_watts": statistics.median(w["watts"] for w in late),
        "windows": windows,
    }


WORKS = {"products": products, "block": transformer_block}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--works", default="products,block")
    args = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    dev = torch.device("cuda", torch.cuda.current_device())
    h = pynvml.nvmlDeviceGetHandleByIndex(dev.index)
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "power_limit_w": limit_w,
        "block": dict(hidden=HIDDEN, heads=HEADS, ffn=FFN, batch=BATCH, seq=SEQ),
        "product_n": PRODUCT_N,
        "probes": {},
    }
    for name in args.works.split(","):
        work, flop = WORKS[name](dev)
        out["probes"][name] = probe(h, dev, work, flop, args.seconds)
        del work
        torch.cuda.empty_cache()
    write_json(args.out, out)
    lines = [
        f"# Sustained load ({out['device']}, torch {out['torch']}, power limit {limit_w:.0f} W)",
        "",
        f"`python benchmarks/power_probe.py --out OUT`: each work once at a time after an idle "
        f"second, then back to back for {args.seconds:g} s (median of the last half).",
        "",
        "| work | single ms | sustained ms | sustained / single | SM MHz (late) | W (late) |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in out["probes"].items():
        lines.append(
            f"| {name} | {p['single_ms']} | {p['sustained_ms']} | {p['sustained_over_boost']} | "
            f"{p['sustained_sm_mhz']} | {p['sustained_watts']} |"
        )
    for name, p in out["probes"].items():
        lines += [
            "",
            f"{name}:",
            "",
            "| t (s) | ms | TFLOP/s | SM MHz | W |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {w['t_s']} | {w['ms']} | {w['tflops']} | {w['sm_mhz']} | {w['watts']} |"
            for w in p["windows"][:: max(1, len(p["windows"]) // 20)]
        ]
    write_table(args.out, lines, echo=3)


if __name__ == "__main__":
    main()
