"""Why the CPU optimizer runs slower inside a training step than alone (issues 21 and 24; GPU host).

The hardware profile times protrain's one-pass CPU AdamW kernel (protrain_fx/machine/cpu_adam.py)
alone, on 33 M parameters of fresh pageable memory. Inside the H200 steps the same kernel ran
1.15-1.57x slower. This probe times the kernel the way the runtime runs it (chunk after chunk over
pinned host memory much larger than the caches) under the conditions a step adds one at a time:

* the working set: 33 M parameters (the profile's), then 0.25, 1 and 2 G parameters in chunks of
  24 M (a 96 MiB chunk), pinned as the runtime pins them (``pinned.pinned_empty``), pageable, and
  pinned without transparent huge pages;
* thread counts: all cores, one and two fewer (a core taken by the thread that launches the
  step's kernels);
* host-to-device and device-to-host copies running all the while on their own streams (a step's
  gathers and gradients), and only device-to-host (backward's gradients);
* a second Python thread spinning (the main thread launching backward's kernels).

Each case reports the kernel's rate (G params/s) and the bytes it moves per second (30 per
parameter) against the host's STREAM triad; the copy cases also report the copies' bytes/s.

    python benchmarks/host_adam_probe.py --out $OUT/host_adam_probe_h200

writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import threading
import time

import torch
from results_io import write_json, write_table

G = 1e9
CHUNK = 24 * 2**20  # parameters per chunk (96 MiB of fp32)
BYTES_PER_PARAM = 30


def _sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout
    except Exception as e:  # noqa: BLE001 - a probe: say what failed
        return f"{type(e).__name__}: {e}"


def machine_facts() -> dict:
    return {
        "lscpu": _sh("lscpu"),
        "numa": _sh("numactl -H 2>/dev/null || ls /sys/devices/system/node"),
        "thp_enabled": _sh("cat /sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _sh("cat /sys/kernel/mm/transparent_hugepage/defrag"),
        "meminfo": _sh("grep -E 'MemTotal|MemAvailable|Huge|AnonHuge' /proc/meminfo"),
        "torch_threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
    }


_KEEP: list = []


def _registered_no_thp(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Pinned like ``pinned.registered_host_empty`` but without MADV_HUGEPAGE."""
    nbytes = numel * dtype.itemsize
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mem.madvise(mmap.MADV_NOHUGEPAGE)
    out = torch.frombuffer(mem, dtype=dtype, count=numel)
    err = torch.cuda.cudart().cudaHostRegister(out.data_ptr(), nbytes, 0)
    assert int(err) == 0, f"cudaHostRegister failed: {int(err)}"
    _KEEP.append(mem)  # never unmapped while registered: kept for the life of the probe
    return out


def alloc(numel: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    from protrain_fx.machine import pinned

    if kind == "pinned":
        return pinned.pinned_empty(numel, dtype)
    if kind == "pinned_no_thp":
        return _registered_no_thp(numel, dtype)
    return torch.empty(numel, dtype=dtype)


class Chunks:
    """Flat fp32 parameter, gradient and moments and the bf16 copy, per chunk, like a store's."""

    def __init__(self, total: int, kind: str, chunk: int = CHUNK):
        self.chunks = []
        left = total
        while left > 0:
            n = min(chunk, left)
            left -= n
            t = [alloc(n, torch.float32, kind) for _ in range(4)] + [alloc(n, torch.bfloat16, kind)]
            t[0].fill_(0.5)
            t[1].fill_(1e-3)
            t[2].zero_()
            t[3].zero_()
            t[4].zero_()
            self.chunks.append(t)
        self.numel = total

    def step(self, threads: int | None = None) -> float:
        from protrain_fx.machine import measure

        old = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        for p, g, m, v, out in self.chunks:
            measure.one_pass_step(p, g, m, v, out, 2.0)
        dt = time.perf_counter() - t0
        torch.set_num_threads(old)
        return dt


def rate(chunks: Chunks, reps: int, threads: int | None = None) -> dict:
    chunks.step(threads)  # warm-up
    times = sorted(chunks.step(threads) for _ in range(reps))
    best, med = times[0], times[len(times) // 2]
    return {
        "params": chunks.numel,
        "best_gparams_s": round(chunks.numel / best / G, 3),
        "median_gparams_s": round(chunks.numel / med / G, 3),
        "median_gb_s": round(chunks.numel * BYTES_PER_PARAM / med / G, 1),
    }


class Copies:
    """Host-to-device (bf16 chunks from pinned memory) and device-to-host (fp32 gradients into
    pinned memory) copies on two streams, issued continuously by a thread of their own that waits
    by polling (no spinning core)."""

    def __init__(self, up: bool, down: bool, nbytes: int = 256 << 20):
        dev = torch.device("cuda")
        self.up, self.down = up, down
        self.h_src = alloc(nbytes // 2, torch.bfloat16, "pinned")
        self.h_src.fill_(1)
        self.h_dst = alloc(nbytes // 4, torch.float32, "pinned")
        self.d_dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        self.d_src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        self.s_up, self.s_down = torch.cuda.Stream(), torch.cuda.Stream()
        self.nbytes = nbytes
        self.stop = threading.Event()
        self.moved = 0
        self.seconds = 0.0

    def _run(self):
        t0 = time.perf_counter()
        while not self.stop.is_set():
            evs = []
            if self.up:
                with torch.cuda.stream(self.s_up):
                    self.d_dst.copy_(self.h_src, non_blocking=True)
                    e = torch.cuda.Event()
                    e.record(self.s_up)
                    evs.append(e)
            if self.down:
                with torch.cuda.stream(self.s_down):
                    self.h_dst.copy_(self.d_src, non_blocking=True)
                    e = torch.cuda.Event()
                    e.record(self.s_down)
                    evs.append(e)
            for e in evs:
                while not e.query():
                    time.sleep(0.0002)
            self.moved += self.nbytes * len(evs)
        self.seconds = time.perf_counter() - t0

    def __enter__(self):
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def gb_s(self) -> float:
        return round(self.moved / max(self.seconds, 1e-9) / G, 1)


class Spinner:
    """A Python thread that keeps one core busy (as the main thread launching kernels does)."""

    def __enter__(self):
        self.stop = threading.Event()

        def spin():
            x = 0
            while not self.stop.is_set():
                x += 1

        self.thread = threading.Thread(target=spin, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class Launcher:
    """A Python thread launching small device kernels back to back (as backward's launcher does:
    Python between the launches, the GIL let go inside each op)."""

    def __enter__(self):
        self.stop = threading.Event()
        x = torch.ones(1 << 20, device="cuda")

        def launch():
            while not self.stop.is_set():
                x.mul_(1.0)

        self.thread = threading.Thread(target=launch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        torch.cuda.synchronize()


def gil_cases(chunks: Chunks, reps: int, cores: int, row) -> None:
    """The kernel beside a busy Python thread, at Python's switch interval and at protrain's."""
    import sys

    before = sys.getswitchinterval()
    try:
        for interval in (0.005, 0.001, 0.0002, 0.00005):
            sys.setswitchinterval(interval)
            with Spinner():
                row(
                    f"{chunks.numel / G:g}G pinned, a core spinning, switch {interval}",
                    rate(chunks, reps),
                    switch=interval,
                )
                row(
                    f"{chunks.numel / G:g}G pinned, a core spinning, switch {interval}, "
                    f"{cores - 1} threads",
                    rate(chunks, reps, cores - 1),
                    switch=interval,
                )
            with Launcher():
                row(
                    f"{chunks.numel / G:g}G pinned, a thread launching kernels, switch {interval}",
                    rate(chunks, reps),
                    switch=interval,
                )
            with Copies(True, True) as cp, Launcher():
                r = rate(chunks, reps)
            row(
                f"{chunks.numel / G:g}G pinned, h2d+d2h copies and a thread launching kernels, "
                f"switch {interval}",
                r,
                switch=interval,
                copies_gb_s=cp.gb_s(),
            )
    finally:
        sys.setswitchinterval(before)


def triad(numel: int) -> float:
    from protrain_fx.machine import cpu_adam

    assert cpu_adam.available(), cpu_adam.build_error()
    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)
    cpu_adam.triad(a, b, c, 0.5)
    best = min(
        (lambda t0: (cpu_adam.triad(a, b, c, 0.5), time.perf_counter() - t0)[1])(
            time.perf_counter()
        )
        for _ in range(5)
    )
    return round(12 * numel / best / G, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--big", type=float, default=2.0, help="largest working set, G parameters")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gil-only", action="store_true", help="only the switch-interval cases")
    args = ap.parse_args()
    from protrain_fx.machine import cpu_adam

    assert cpu_adam.available(), cpu_adam.build_error()
    torch.cuda.init()
    cores = torch.get_num_threads()
    res = {"facts": machine_facts(), "cores": cores, "rows": []}

    def row(name, r, **kw):
        r = dict(case=name, **r, **kw)
        res["rows"].append(r)
        print(json.dumps(r), flush=True)

    if args.gil_only:
        c = Chunks(int(args.big * G), "pinned")
        gil_cases(c, args.reps, cores, row)
        res["triad_gb_s_33m"] = res["triad_gb_s_1g"] = "-"
        return finish(args, res, cores)
    res["triad_gb_s_33m"] = triad(33 * 2**20)
    res["triad_gb_s_1g"] = triad(2**30 // 4 * 4)
    print("triad", res["triad_gb_s_33m"], res["triad_gb_s_1g"], flush=True)
    # the hardware profile's case: 33 M parameters, pageable, one call
    small = Chunks(33 * 2**20, "pageable", chunk=33 * 2**20)
    row("profile's case: 33M pageable, one call", rate(small, args.reps))
    del small
    for total in (0.25, 1.0):
        for kind in ("pinned", "pageable", "pinned_no_thp"):
            c = Chunks(int(total * G), kind)
            row(f"{total}G {kind}, chunks of 24M", rate(c, args.reps), kind=kind)
            del c
    big = Chunks(int(args.big * G), "pinned")
    row(f"{args.big}G pinned", rate(big, args.reps), kind="pinned")
    for threads in (cores - 1, cores - 2, cores // 2):
        row(f"{args.big}G pinned, {threads} threads", rate(big, args.reps, threads))
    with Spinner():
        row(f"{args.big}G pinned, one core spinning", rate(big, args.reps))
        row(
            f"{args.big}G pinned, one core spinning, {cores - 1} threads",
            rate(big, args.reps, cores - 1),
        )
    for up, down in ((False, True), (True, False), (True, True)):
        name = {(False, True): "d2h", (True, False): "h2d", (True, True): "h2d+d2h"}[(up, down)]
        with Copies(up, down) as cp:
            r = rate(big, args.reps)
        row(f"{args.big}G pinned, {name} copies beside", r, copies_gb_s=cp.gb_s())
        with Copies(up, down) as cp:
            time.sleep(1.0)
        row(f"{name} copies alone", {}, copies_gb_s=cp.gb_s())
    with Copies(True, True) as cp, Spinner():
        r = rate(big, args.reps)
    row(f"{args.big}G pinned, h2d+d2h copies and a core spinning", r, copies_gb_s=cp.gb_s())
    finish(args, res, cores)


def finish(args, res: dict, cores: int) -> None:
    write_json(args.out, res)
    lines = [
        "# The CPU AdamW kernel on the GPU machine's host: alone and beside a step's traffic",
        "",
        f"STREAM triad: {res['triad_gb_s_33m']} GB/s (33 M floats), {res['triad_gb_s_1g']} GB/s "
        f"(1 G floats); {cores} threads. Kernel bytes: {BYTES_PER_PARAM} per parameter.",
        "",
        "| case | params | best G/s | median G/s | median GB/s | copies GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['case']} | {r.get('params', '-')} | {r.get('best_gparams_s', '-')} | "
            f"{r.get('median_gparams_s', '-')} | {r.get('median_gb_s', '-')} | "
            f"{r.get('copies_gb_s', '-')} |"
        )
    write_table(args.out, lines)


if __name__ == "__main__":
    main()
