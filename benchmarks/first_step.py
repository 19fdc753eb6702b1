"""Time to the first step, cold and warm, protrain against torch.compile (issue 23; GPU).

Per model, four processes in a row: protrain with empty caches (Inductor's and protrain's plan
cache; the hardware profile is measured once beforehand and copied in, as on any machine protrain
ran on before), protrain again with those caches warm, then torch.compile cold and warm likewise.
Each process builds the model on the device (random init, seed 0), makes a fused AdamW, compiles,
and trains ``--steps`` steps on fixed random tokens under bf16 autocast; it reports the seconds from
before the model is built to the end of the first step (``first_step_s``), protrain's progress
breakdown (its ``ready after`` line: tracing, profiling compile, profiling, search, compile,
backward compile), the steady tokens/s at the median step after the third, and the losses
(protrain's against torch.compile's: same init and data). protrain runs under ``--cap-gib``;
torch.compile uncapped.

    python benchmarks/first_step.py --models llama3.2-3b,gpt-1.42b \\
        --out benchmarks/results/first_step_h200

``--device cpu`` runs the same comparison on the CPU (fp32, protrain under ``--budget-mib`` of
``memory_budget`` instead of a cap), for the small models (``llama-small``: an 8-layer HF Llama of
width 256).

writes ``OUT.json`` and ``OUT.md``; ``--only MODEL:SYSTEM:CACHE`` runs some rows, ``--merge`` adds
rows to an existing ``OUT.json``. ``--run`` (internal) is one process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

T_START = time.perf_counter()

from hf_exactness import LLAMA_3B  # noqa: E402  (stdlib imports only)
from hf_exactness import build as build_hf_llama  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODELS = {
    # Llama-3.2-3B's shape through transformers (hf_exactness.LLAMA_3B: tied 128k vocabulary),
    # batch 4 x 1024
    "llama3.2-3b": dict(
        {
            k: LLAMA_3B[k]
            for k in ("hidden", "layers", "heads", "kv", "ffn", "vocab", "batch", "seq")
        },
        kind="hf_llama",
    ),
    # the suite's 1.42 B GPT (benchmarks/suite/scenarios.py GPT_1_4B, read in the child), batch
    # 4 x 1024
    "gpt-1.42b": dict(kind="gpt", vocab=50304, batch=4, seq=1024),
    # for --device cpu: an 8-layer Hugging Face Llama (tied 4096 vocabulary, GQA), batch 2 x 128
    "llama-small": dict(
        hidden=256, layers=8, heads=4, kv=2, ffn=688, vocab=4096, batch=2, seq=128, kind="hf_llama"
    ),
}
# protrain: compiled in regions, each distinct block once (protrain_fx/graph/regions.py);
# protrain-whole: the graph compiled whole (PROTRAIN_REGIONS=0; profiled on a short copy with three
# blocks), cold only: the comparison of time and of the steady tokens/s and losses that regions
# must leave unchanged
SYSTEMS = ("protrain", "protrain-whole", "torch.compile")
CACHES = {
    "protrain": ("cold", "warm"),
    "protrain-whole": ("cold",),
    "torch.compile": ("cold", "warm"),
}


def build(spec: dict, device: str):
    import torch

    if spec["kind"] == "hf_llama":
        model = build_hf_llama(spec, device)  # seed 0, on the device

        def loss_of(m, x):
            return m(input_ids=x, labels=x).loss

        return model, loss_of
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from models import build as build_own
    from suite.scenarios import GPT_1_4B

    assert GPT_1_4B["vocab_size"] == spec["vocab"]
    torch.manual_seed(0)
    with torch.device(device):
        model = build_own("gpt", **GPT_1_4B)

    def loss_of(m, x):
        return m(x[:, :-1], x[:, 1:])

    return model, loss_of


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())
        print(record.getMessage(), file=sys.stderr, flush=True)


class _CacheMessages(logging.Handler):
    """What torch's caches said about this process's graphs (aot_autograd's cache bypassed or
    missed, Inductor's FX graph cache bypassed): why a warm run compiled a code again (run 41's GPT
    compiled its 4 codes again where the 3B shape's were served)."""

    LOGGERS = ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache")
    WORDS = ("bypass", "fail", "error")  # a miss is counted, not kept

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(self)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)

    def emit(self, record):
        msg = record.getMessage()
        if any(w in msg.lower() for w in self.WORDS) and len(self.lines) < 40:
            self.lines.append(msg[:600])

    def report(self) -> dict:
        """torch's cache counters (aot_autograd's and Inductor's) and the messages kept."""
        from torch._dynamo.utils import counters

        keep = ("autograd_cache", "fxgraph_cache")
        return {
            "counters": {
                f"{group}.{k}": v
                for group in ("aot_autograd", "inductor")
                for k, v in counters[group].items()
                if any(w in k for w in keep)
            },
            "messages": self.lines,
        }


def _profile_top(prof, n: int = 40) -> dict:
    """The ``n`` functions with the most cumulative and the most own time in a cProfile run, as
    ``[seconds, calls, "file:line(function)"]`` rows: where the first step's seconds went."""
    import pstats

    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

    def where(key):
        path, line, name = key
        return f"{'/'.join(path.split('/')[-3:])}:{line}({name})"

    def top(index):
        best = sorted(stats.items(), key=lambda kv: -kv[1][index])[:n]
        return [[round(v[index], 3), v[1], where(k)] for k, v in best]

    # who calls the functions that took the warm H200 run's seconds (first_step_h200_pyprof.md:
    # fake tensors made from real ones, 14-16 s over ~500 calls against ~1 ms each on the CPU;
    # pinning; custom-op registration): their callers by cumulative time, three levels up
    def callers(key, depth=3):
        rows = sorted(stats[key][4].items(), key=lambda kv: -kv[1][3])[:6]
        return [
            [round(ct, 3), nc, where(k)] + ([callers(k, depth - 1)] if depth > 1 else [])
            for k, (_, nc, _, ct) in rows
            if k in stats
        ]

    # ... and what they call (where the seconds inside them go), two levels down
    calls: dict = {}
    for callee, (*_, by) in stats.items():
        for caller, (_, nc, _, ct) in by.items():
            calls.setdefault(caller, []).append((ct, nc, callee))

    def callees(key, depth=2):
        rows = sorted(calls.get(key, []), key=lambda r: -r[0])[:8]
        return [
            [round(ct, 3), nc, where(k)] + ([callees(k, depth - 1)] if depth > 1 else [])
            for ct, nc, k in rows
        ]

    watched = ("from_real_tensor", "cudaHostRegister", "_register_to_dispatcher", "meta_tensor")
    hot = [k for k in sorted(stats, key=lambda k: -stats[k][3]) if any(w in k[2] for w in watched)]
    return {
        "cumulative": top(3),
        "own": top(2),
        "callers": {where(k): callers(k) for k in hot},
        "callees": {where(k): callees(k) for k in hot},
    }


def run_one(
    model_name: str,
    system: str,
    steps: int,
    cap_gib: float,
    py_profile: bool = False,
    device: str = "cuda",
    budget_mib: float = 16.0,
) -> dict:
    import cProfile

    import torch

    prof = cProfile.Profile() if py_profile else None

    t_imported = time.perf_counter()
    spec = MODELS[model_name]
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if system.startswith("protrain") and cap_gib and cuda:
        torch.cuda.set_per_process_memory_fraction(
            cap_gib * 2**30 / torch.cuda.get_device_properties(dev).total_memory
        )
    lines = _Lines()
    logging.getLogger("protrain_fx").addHandler(lines)
    logging.getLogger("protrain_fx").setLevel(logging.INFO)
    torch_cache = _CacheMessages()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    model, loss_of = build(spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    build_s = time.perf_counter() - t0
    if system.startswith("protrain"):
        import protrain_fx.backend

        if "protrain" not in torch._dynamo.list_backends(exclude_tags=()):
            torch._dynamo.register_backend(protrain_fx.backend.protrain_backend, name="protrain")
        options = {"optimizer": opt}
        if not cuda:  # on the CPU the budget is the option (no device memory to cap)
            options["memory_budget"] = int(budget_mib * 2**20)
        compiled = torch.compile(model, backend="protrain", options=options)
    else:
        compiled = torch.compile(model)
    g = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
        for _ in range(steps)
    ]
    losses, times, first = [], [], None
    for x in data:
        ts = time.perf_counter()
        x = x.to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_of(compiled, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - ts)
        if first is None:
            first = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            print(f"first step after {first:.1f} s", file=sys.stderr, flush=True)
    steady = times[3:] or times[1:]
    tokens = spec["batch"] * spec["seq"]
    row = {
        "model": model_name,
        "system": system,
        "cap_gib": cap_gib if system.startswith("protrain") and cuda else None,
        "budget_mib": budget_mib if system.startswith("protrain") and not cuda else None,
        "import_s": round(t_imported - T_START, 2),
        "build_s": round(build_s, 2),
        "first_step_s": round(first, 2),
        # the median step: one slow step (the host's page cache, a late compile) moves the mean
        # of a few steps by percents (run 41: processes of one plan 7-15% apart)
        "tokens_per_s": round(tokens / statistics.median(steady), 1),
        "step_s": [round(t, 4) for t in times],
        "losses": losses,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / 2**30, 2)
        if cuda
        else None,
        "progress": lines.lines,
        "torch_caches": torch_cache.report(),
    }
    if prof is not None:  # seconds under the profiler: about 1.3x the plain run's
        row["py_profile"] = _profile_top(prof)
    ready = [line for line in lines.lines if "ready after" in line]
    row["ready_line"] = ready[-1] if ready else None
    if system.startswith("protrain"):
        import protrain_fx

        plan = protrain_fx.get_plan(compiled)
        d = plan.to_dict()
        row["plan"] = {
            k: d[k] for k in ("chunk_size", "n_persist", "n_buffer", "n_swap", "n_checkpoint")
        }
        pred = plan.predicted or {}
        row["predicted"] = {
            "iter_s": pred.get("iter_s"),
            "peak_gib": pred.get("peak_bytes") and round(pred["peak_bytes"] / 2**30, 2),
            "profile_compile_s": pred.get("profile_compile_s"),
            "from_cache": pred.get("from_cache"),
        }
        row["notes"] = list(plan.notes)
    return row


def child(model_name: str, system: str, cache: str, dirs: dict, args) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = dirs[(model_name, system, "inductor")]
    env["PROTRAIN_CACHE_DIR"] = dirs[(model_name, system, "protrain")]
    if system == "protrain-whole":
        env["PROTRAIN_REGIONS"] = "0"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--run",
        model_name,
        system,
        "--steps",
        str(args.steps),
        "--cap-gib",
        str(args.cap_gib),
        "--device",
        args.device,
        "--budget-mib",
        str(args.budget_mib),
    ] + (["--py-profile"] if args.py_profile else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    sys.stderr.write(proc.stderr[-4000:])
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    row = (
        rows[0]
        if rows
        else {
            "model": model_name,
            "system": system,
            "error": proc.stderr[-1500:] or f"exit {proc.returncode}",
        }
    )
    row["cache"] = cache
    row["process_s"] = round(time.perf_counter() - t0, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3.2-3b,gpt-1.42b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument(
        "--only", default="", help="MODEL:SYSTEM:CACHE,... (a warm row needs its cold row first)"
    )
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--label", default="", help="a name for this run's rows (shown in the table)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "first_step_h200"))
    ap.add_argument("--run", nargs=2, metavar=("MODEL", "SYSTEM"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--budget-mib", type=float, default=16.0, help="protrain's memory_budget on the CPU"
    )
    ap.add_argument(
        "--py-profile",
        action="store_true",
        help="run each process's build, compile and first step under cProfile and keep the top "
        "functions by cumulative and own time in its row (py_profile), with the callers and "
        "callees of fake-tensor conversion, host pinning and custom-op registration",
    )
    args = ap.parse_args()
    if args.run:
        row = run_one(
            args.run[0],
            args.run[1],
            args.steps,
            args.cap_gib,
            args.py_profile,
            args.device,
            args.budget_mib,
        )
        print("RESULT " + json.dumps(row), flush=True)
        return
    work = tempfile.mkdtemp(prefix="first_step_")
    hardware = os.path.join(work, "hardware_base")
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from protrain_fx.machine import measure; "
            f"measure.hardware_profile(torch.device('{args.device}'))",
        ],
        env=dict(os.environ, PROTRAIN_CACHE_DIR=hardware),
        check=True,
        cwd=ROOT,
    )
    # the hardware profile every protrain row plans with (host triad bandwidth, CPU Adam rate)
    hardware_profile = {}
    for root, _, files in os.walk(hardware):
        for f in files:
            if f.endswith(".json"):
                hardware_profile = json.load(open(os.path.join(root, f)))
    args.hardware_profile = hardware_profile
    wanted = [w for w in args.only.split(",") if w]
    rows = []
    if args.merge and os.path.exists(args.out + ".json"):
        rows = json.load(open(args.out + ".json"))["rows"]
    dirs: dict = {}
    for model_name in args.models.split(","):
        for system in SYSTEMS:
            for kind in ("inductor", "protrain"):
                d = os.path.join(work, f"{model_name}-{system}-{kind}")
                if kind == "protrain":
                    shutil.copytree(hardware, d)
                dirs[(model_name, system, kind)] = d
            for cache in CACHES[system]:
                if wanted and f"{model_name}:{system}:{cache}" not in wanted:
                    continue
                row = child(model_name, system, cache, dirs, args)
                row["label"] = args.label
                rows = [
                    r
                    for r in rows
                    if (r["model"], r["system"], r.get("cache"), r.get("label", ""))
                    != (model_name, system, cache, args.label)
                ]
                rows.append(row)
                print(
                    json.dumps({k: v for k, v in row.items() if k not in ("progress", "losses")}),
                    flush=True,
                )
                _write(args.out, rows, args)
    _write(args.out, rows, args)


def _loss_diff(rows, row) -> float | None:
    ref = next(
        (
            r
            for r in rows
            if r["model"] == row["model"] and r["system"] == "torch.compile" and r.get("losses")
        ),
        None,
    )
    if ref is None or not row.get("losses") or row is ref:
        return None
    n = min(len(ref["losses"]), len(row["losses"]))
    return max(abs(a - b) / abs(b) for a, b in zip(row["losses"][:n], ref["losses"][:n]))


def _aot_cache_counts(row) -> str:
    """aot_autograd's cache hits, misses and bypasses in a row's process (blank before run 42)."""
    counts = (row.get("torch_caches") or {}).get("counters")
    if counts is None:
        return ""
    return " / ".join(
        str(counts.get(f"aot_autograd.autograd_cache_{k}", 0)) for k in ("hit", "miss", "bypass")
    )


def _write(out: str, rows: list, args) -> None:
    for r in rows:
        r["loss_rel_vs_torch_compile"] = _loss_diff(rows, r)
    meta = {
        "command": "python benchmarks/first_step.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "cap_gib": args.cap_gib,
        "hardware_profile": getattr(args, "hardware_profile", None),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["device"] = (
            torch.cuda.get_device_name(0)
            if args.device == "cuda"
            else f"CPU ({os.cpu_count()} cores)"
        )
    except Exception:
        pass
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Time to the first step (`{meta['command']}`)",
        "",
        f"{meta.get('device', '?')}, torch {meta.get('torch', '?')}; protrain under a "
        + (
            f"{args.cap_gib:g} GiB cap"
            if args.device == "cuda"
            else f"memory_budget of {args.budget_mib:g} MiB (fp32)"
        )
        + ", torch.compile uncapped; seconds from before the model is built "
        "to the end of the first step; tokens/s at the median step after the third.",
        "",
        "| model | system | caches | first step (s) | protrain's phases | tokens/s "
        "| peak reserved (GiB) | loss rel. vs torch.compile | aot_autograd's cache: hit / miss / "
        "bypass | plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['model']} | {r['system']} | {r.get('cache')} "
                f"| error: {r['error'][-200:]!r} | | | | | | |"
            )
            continue
        phases = (
            (r.get("ready_line") or "").split("(", 1)[-1].rstrip(")") if r.get("ready_line") else ""
        )
        rel = r.get("loss_rel_vs_torch_compile")
        lines.append(
            f"| {r['model']} | {r['system']}{' (' + r['label'] + ')' if r.get('label') else ''} "
            f"| {r['cache']} | {r['first_step_s']} | {phases} | "
            f"{r['tokens_per_s']} | {r['peak_reserved_gib']} | "
            f"{'' if rel is None else f'{rel:.2e}'} | {_aot_cache_counts(r)} | "
            + (
                ", ".join(f"{k} {v}" for k, v in r["plan"].items() if k != "chunk_size")
                if r.get("plan")
                else ""
            )
            + " |"
        )
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
