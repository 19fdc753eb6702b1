"""Does the GPU slow down under sustained load, and by how much (issue 21; GPU).

The profiler times blocks in short runs at the device's boost clock; a plan that keeps the device
busy for the whole step draws more power, and at the board's power limit the SM clock drops (the
1B shape at batch 8 x 2048: profiled at 1967 MHz, stepped at 1690 MHz, 680 W; its forward and
backward took 5-8% longer than profiled). This probe measures the same effect on dense bf16 matrix
multiplies: after a second idle, the time of single products at the boost clock, then products
back to back for ``--seconds``, in windows of 100 ms, each with its SM clock and power from NVML.

    python benchmarks/power_probe.py --out $OUT/power_probe_h200

writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_io import write_json, write_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--n", type=int, default=8192)
    args = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3
    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    flop = 2 * args.n**3
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    time.sleep(1.0)  # idle: the clock back at boost, the board cool
    single = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        single.append(e0.elapsed_time(e1) / 1e3)
        time.sleep(0.05)
    windows = []
    t_end = time.perf_counter() + args.seconds
    while time.perf_counter() < t_end:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        k = 0
        e0.record()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            for _ in range(8):
                a @ b
            k += 8
            torch.cuda.current_stream().synchronize() if k % 64 == 0 else None
        e1.record()
        torch.cuda.synchronize()
        s = e0.elapsed_time(e1) / 1e3
        windows.append(
            {
                "t_s": round(time.perf_counter() - (t_end - args.seconds), 2),
                "gemm_ms": round(s / k * 1e3, 4),
                "tflops": round(flop * k / s / 1e12, 1),
                "sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "watts": round(pynvml.nvmlDeviceGetPowerUsage(h) / 1e3, 1),
            }
        )
    boost = min(single)
    late = [w["gemm_ms"] / 1e3 for w in windows[len(windows) // 2 :]]
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "power_limit_w": limit_w,
        "n": args.n,
        "single_gemm_ms": [round(x * 1e3, 4) for x in single],
        "sustained_gemm_ms": round(statistics.median(late) * 1e3, 4),
        "sustained_over_boost": round(statistics.median(late) / boost, 4),
        "windows": windows,
    }
    write_json(args.out, out)
    lines = [
        f"# Sustained load: dense bf16 products ({out['device']}, torch {out['torch']}, "
        f"power limit {limit_w:.0f} W)",
        "",
        f"`python benchmarks/power_probe.py --out OUT`: {args.n}^3 products; single after 1 s "
        f"idle {min(single) * 1e3:.3f} ms, back to back (median of the last half) "
        f"{out['sustained_gemm_ms']:.3f} ms: **{out['sustained_over_boost']:.3f}x**.",
        "",
        "| t (s) | ms per product | TFLOP/s | SM MHz | W |",
        "|---|---|---|---|---|",
    ] + [
        f"| {w['t_s']} | {w['gemm_ms']} | {w['tflops']} | {w['sm_mhz']} | {w['watts']} |"
        for w in windows[:: max(1, len(windows) // 20)]
    ]
    write_table(args.out, lines, echo=3)


if __name__ == "__main__":
    main()
