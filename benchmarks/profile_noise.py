"""Does a loaded host change what the profiler measures? Profiles of one GPT, each in a fresh process, on an
idle host and next to ``--load`` busy processes, with the profiler's spin lead off (``PROTRAIN_PROFILE_SPIN_S=0``)
and at its default (protrain_fx/block_timer.py: host stalls).

    .venv/bin/python benchmarks/profile_noise.py --out $OUT/profile_noise

Every case is ``run.py --one protrain`` (plan cache off, one warm-up and one timed step, uncapped): what is
compared is the profile the automatic plan was made from (``plan_profiled``: per-block forward and backward
milliseconds, the non-block parts), its host load average and the device's SM clock at the end. The compile
caches of the first case make the later ones faster; the first case is repeated last to show the order
does not matter.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GPT = dict(n_layer=8, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024, tie_embeddings=False)


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def run_case(spin: str | None, load: int, timeout: float) -> dict:
    spec = dict(kind="gpt", cfg=GPT, batch=8, seq=1024, cap_gib=None, device="cuda", steps=1, warmup=1)
    env = dict(os.environ, PROTRAIN_PLAN_CACHE="0", PYTHONUNBUFFERED="1",
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    env.pop("PROTRAIN_BENCH_LOCK", None)
    if spin is not None:
        env["PROTRAIN_PROFILE_SPIN_S"] = spin
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
    for p in spinners:
        p.start()
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--one", "protrain", "--spec", json.dumps(spec)],
                           env=env, capture_output=True, text=True, timeout=timeout)
        out, err, code = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = e.stdout or "", (e.stderr or "") + "\ntimeout", -9
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
    row = {"spin_s": spin if spin is not None else "default", "load_procs": load, "wall_s": time.monotonic() - t0}
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        row["error"] = f"exit {code}: {err[-800:]}"
        return row
    res = json.loads(lines[-1][len("RESULT "):])
    prof = res.get("plan_profiled") or {}
    fwd, bwd = prof.get("block_fwd_ms") or [0], prof.get("block_bwd_ms") or [0]
    row.update(block_fwd_ms_median=statistics.median(fwd), block_fwd_ms_max=max(fwd),
               block_bwd_ms_median=statistics.median(bwd), block_bwd_ms_max=max(bwd),
               nonblock_fwd_ms=prof.get("nonblock_fwd_ms"), nonblock_bwd_ms=prof.get("nonblock_bwd_ms"),
               conditions=prof.get("conditions"), profile_s=(res.get("plan_predicted") or {}).get("profile_s"),
               step_ms=res.get("step_ms"))
    return row


def markdown(out: dict) -> str:
    lines = [f"# Profiler under host load ({out['date']}, {out['device']}, torch {out['torch']})", "",
             f"Command: `{out['command']}`. See benchmarks/profile_noise.py.", "",
             "| spin lead s | busy processes | block fwd ms (median / max) | block bwd ms (median / max) | "
             "non-block fwd / bwd ms | load avg after | SM MHz | profile s | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        c = r.get("conditions") or {}
        if "error" in r:
            lines.append(f"| {r['spin_s']} | {r['load_procs']} | - | - | - | - | - | - | {r['error'][:150]} |")
            continue
        lines.append(f"| {r['spin_s']} | {r['load_procs']} | {r['block_fwd_ms_median']:.2f} / {r['block_fwd_ms_max']:.2f} | "
                     f"{r['block_bwd_ms_median']:.2f} / {r['block_bwd_ms_max']:.2f} | "
                     f"{r['nonblock_fwd_ms']:.1f} / {r['nonblock_bwd_ms']:.1f} | {c.get('loadavg_after', '-')} | "
                     f"{c.get('sm_clock_mhz', '-')} | {r.get('profile_s') or 0:.1f} | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 4, help="busy processes for the loaded cases")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for all cases")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "command": "python benchmarks/profile_noise.py " + " ".join(sys.argv[1:]), "rows": []}
    deadline = time.monotonic() + args.timeout
    for spin, load in (("0", 0), ("0", args.load), (None, args.load), (None, 0), ("0", 0)):
        left = deadline - time.monotonic()
        if left < 20:
            out["rows"].append({"spin_s": spin or "default", "load_procs": load, "error": "not run: deadline"})
            continue
        row = run_case(spin, load, left)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out + ".json", "w") as f:
            json.dump(out, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
