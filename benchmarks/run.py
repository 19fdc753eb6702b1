"""The benchmark suite: protrain against the systems a user would pick instead, every system in its own
subprocess, one JSON + one markdown table + one PNG bar chart per run.

    bash scripts/bootstrap.sh                       # on the GPU machine: .venv reusing its torch
    .venv/bin/python benchmarks/run.py              # every scenario and system (an hour or more on an H200)
    .venv/bin/python benchmarks/run.py --scenarios gpt1.4b,gpt1.4b-cap24 --deadline 540 --out $OUT/suite_gpt
    .venv/bin/python benchmarks/run.py --scenarios maxmodel --systems protrain,compile --out $OUT/suite_max
    python benchmarks/run.py --merge a.json b.json --out benchmarks/results/suite_h200   # one table of several runs
    python benchmarks/run.py --smoke --out /tmp/smoke   # CPU smoke (CI): tiny GPT, 1 + 1 steps per system

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``; the JSON and table are rewritten after every row (the
chart at most every 20 s, and at the end), so a run cut short leaves what it measured (``--merge`` on its
JSON redraws everything). One row per scenario and system: ``{scenario, system, model, params, cap_gib,
batch, seq, tokens_per_s, tflops, peak_gib, ratio_to_ceiling, error, ...}``; a system that fails, crashes,
times out or is not started (a predicted OOM, the run's deadline) is a row whose ``error`` says why, never a
missing row.

Systems (benchmarks/peers.py): protrain (automatic plan; its options are set in one place there), compile
(torch.compile Inductor, everything on the device: the ceiling), eager, fsdp2_offload (FSDP2
CPUOffloadPolicy, fused CPU AdamW), ds_zero2_offload, ds_zero3_offload (DeepSpeed ZeRO-2 optimizer offload;
ZeRO-3 parameter + optimizer offload), torchao_offload (torchao CPUOffloadOptimizer), compile_ac
(torch.compile with activation_memory_budget).

Scenarios (--scenarios, comma separated, or ``all``, the default):
  gpt1.4b        ../shared/ANCHORS.md's GPT (d 2048, 24 layers, 16 heads, vocab 50304, untied: 1.42 B), batch
                 8 x 1024, bf16, uncapped
  gpt1.4b-cap24  the same at a 24 GiB cap (torch.cuda.set_per_process_memory_fraction)
  llama          LLaMA-style (LLaMA-2-7B's width 4096, 32 heads, SwiGLU 11008, vocab 32000) at --llama-layers
                 (default 28: 5.93 B, the depth whose offloaded model states, up to 18 B/param, fit a 128 GiB
                 host with room to spare; 32 gives the 6.74 B original), batch 2 x 1024, uncapped,
                 torch.compile only: the ceiling of the next scenario
  llama-cap40    the same at a 40 GiB cap, all systems
  maxmodel       per system, the largest GPT of width --search-width (4096) it trains on the whole device,
                 batch 4 x 1024: depth doubles from --search-start (8) until the first failure;
                 --search-refine bisects after it

Timing: every system runs --warmup steps (compilation included), then --steps timed steps, each followed by a
device synchronize; tokens/s is batch x seq over the *median* step time. Sizes that certainly do not fit (model
states alone over the cap or the host's memory, by the lower bounds in peers.py) are rows marked
``(predicted, not run)`` (--no-predict runs them).

Side by side (--jobs, default 3 on CUDA): systems build, compile and warm up concurrently, admitted by claimed
device and host memory, but a timed step never overlaps anything, and the systems that keep model states in
host memory are alive one at a time (benchmarks/timeshare.py). An uncapped
system sharing the device is capped at its claim; one that fails for memory next to others (or under that
claim), or whose allocator had to free its cache to retry under it, runs again alone. --jobs 1: one at a time.

DeepSpeed and torchao come from .whl/ (benchmarks/fetch_peer_wheels.sh fetches them; carry .whl to the GPU
machine): on CUDA, when the folder exists, they are installed into /tmp/site (once per machine, in the
background while other systems compile) and /tmp/site is put on those systems' PYTHONPATH only.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--one" in sys.argv:  # a child: queue for the shared lock before importing torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import timeshare

    timeshare.start_busy()

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import glob  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import peers  # noqa: E402
import timeshare  # noqa: E402
import trace_summary  # noqa: E402
from peers import SYSTEMS, build  # noqa: E402

PEER_SITE = "/tmp/site"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FLOPS_FORMULA = ("6 * N + 12 * L * d * seq FLOPs per token (N: parameters outside embedding tables, L layers, "
                 "width d; PaLM's model-FLOPs formula without causal halving; recomputation not counted)")
ROW_KEYS = ("scenario", "system", "model", "params", "cap_gib", "batch", "seq", "tokens_per_s", "tflops",
            "peak_gib", "ratio_to_ceiling", "error")
CONTEXT_GIB = 1.5  # device memory of one process outside PyTorch's allocator (CUDA context, NCCL, cuBLAS)
HOST_MARGIN_GIB = 8.0  # host memory admission keeps free
HEAVY_HOST_GIB = 10.0  # a child claiming more host memory than this is host-heavy: one at a time (timeshare.py)
SEQ = 1024
GPT_1_4B = dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=SEQ, tie_embeddings=False)
TINY_GPT = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32, tie_embeddings=False)
OOM_WORDS = ("out of memory", "outofmemory", "alloc_failed", "cudaerrormemoryallocation", "killed by sigkill")


def llama_cfg(n_layer: int) -> dict:
    return dict(n_layer=n_layer, dim=4096, n_head=32, n_kv_head=32, ffn_dim=11008, vocab_size=32000,
                max_seq_len=SEQ, tie_embeddings=False)


def search_cfg(args, n_layer: int) -> dict:
    w = args.search_width
    return dict(GPT_1_4B, n_layer=n_layer, n_embd=w, n_head=max(1, w // 128))


def scenarios(args) -> dict[str, dict]:
    """name -> {kind, cfg, batch, seq, cap_gib, systems}. ``maxmodel`` (cfg None) is run by :func:`search`."""
    every = tuple(SYSTEMS)
    if args.smoke:
        return {"smoke": dict(kind="gpt", cfg=TINY_GPT, batch=2, seq=TINY_GPT["block_size"], cap_gib=0.0,
                              systems=every)}
    llama = llama_cfg(args.llama_layers)
    return {
        "gpt1.4b": dict(kind="gpt", cfg=GPT_1_4B, batch=8, seq=SEQ, cap_gib=0.0, systems=every),
        "gpt1.4b-cap24": dict(kind="gpt", cfg=GPT_1_4B, batch=8, seq=SEQ, cap_gib=24.0, systems=every),
        "llama": dict(kind="llama", cfg=llama, batch=args.llama_batch, seq=SEQ, cap_gib=0.0, systems=("compile",)),
        "llama-cap40": dict(kind="llama", cfg=llama, batch=args.llama_batch, seq=SEQ, cap_gib=40.0, systems=every),
        "maxmodel": dict(kind="gpt", cfg=None, batch=args.search_batch, seq=SEQ, cap_gib=0.0, systems=every,
                         steps=args.search_steps, warmup=args.search_warmup),
    }


# ------------------------------------------------------------------------------------------ model facts
def model_label(kind: str, cfg: dict) -> str:
    if kind == "gpt":
        return f"GPT d{cfg['n_embd']} L{cfg['n_layer']} v{cfg['vocab_size']}"
    return f"LLaMA d{cfg['dim']} L{cfg['n_layer']} ffn{cfg['ffn_dim']} v{cfg['vocab_size']}"


_STATS: dict = {}


def model_stats(kind: str, cfg: dict, seq: int) -> tuple[int, float]:
    """(parameters, model FLOPs per token: FLOPS_FORMULA), from the model built on the meta device."""
    key = (kind, json.dumps(cfg, sort_keys=True), seq)
    if key not in _STATS:
        with torch.device("meta"):
            m = build(kind, **cfg)
        n = sum(p.numel() for p in m.parameters())
        matmul = {id(mod.weight) for mod in m.modules() if isinstance(mod, torch.nn.Linear)}
        emb = sum(mod.weight.numel() for mod in m.modules()
                  if isinstance(mod, torch.nn.Embedding) and id(mod.weight) not in matmul)
        d = cfg.get("n_embd", cfg.get("dim"))
        _STATS[key] = (n, 6.0 * (n - emb) + 12.0 * cfg["n_layer"] * d * seq)
    return _STATS[key]


def activation_gib(kind: str, cfg: dict, batch: int, seq: int) -> float:
    """A rough size of one step's saved activations in bf16 (34 bytes per token, width and layer for a GPT
    block without attention scores, 50 for a LLaMA block with SwiGLU) plus the logits and their gradient;
    only for admission (benchmarks/timeshare.py), never for a row."""
    d = cfg.get("n_embd", cfg.get("dim"))
    per = 34 if kind == "gpt" else 50
    return batch * seq * (per * d * cfg["n_layer"] + 10 * cfg["vocab_size"]) / 2**30


# ------------------------------------------------------------------------------- one system (child side)
def run_one(system: str, spec: dict) -> dict:
    """Build, warm up (compiles), time ``steps`` steps alone; the row's measured columns."""
    import resource

    sysdef = SYSTEMS[system]
    cuda = spec["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("needs CUDA: no CUDA device is visible")
    if sysdef.cuda_only and not cuda:
        raise RuntimeError(f"needs CUDA: {system} runs on a GPU only (device {spec['device']})")
    limit = spec["cap_gib"] or spec.get("soft_cap_gib")
    if cuda and limit:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit * 2**30 / total))
    g = torch.Generator().manual_seed(0)
    vocab = spec["cfg"]["vocab_size"]
    x = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g).to(spec["device"])
    y = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g).to(spec["device"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def say(what: str) -> None:
        print(f"[{system}] {what}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    step, n_params, extra = sysdef.fn(spec, x, y)
    build_s = time.perf_counter() - t0
    say(f"built in {build_s:.1f} s")
    t0 = time.perf_counter()
    for i in range(spec["warmup"]):  # the first compiles (and protrain learns the optimizer's step pattern)
        step()
        sync()
        say(f"warm-up step {i + 1} done at {time.perf_counter() - t0:.1f} s")
    warmup_s = time.perf_counter() - t0
    if cuda and spec.get("settle"):
        torch.cuda.empty_cache()  # hand cached blocks back while others run; one untimed step re-fills the cache
    t_wait = time.perf_counter()
    with timeshare.measuring():
        wait_s = time.perf_counter() - t_wait
        if spec.get("settle"):
            step()
            sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        if hasattr(step, "phases"):  # spec["phase_times"] (peers._plain_step): the timed steps' only
            step.phases.clear()
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
        # the allocator hit its limit (the cap) and freed its cache to retry: slower steps, part of the result
        # under a real cap, a reason to run again alone under a soft one (run_job)
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0 if cuda else None
        phases = peers.phase_ms(step) if cuda else None
        # one more step under torch.profiler: where its device time went (benchmarks/trace_summary.py)
        traced = trace_summary.trace_step(step, spec["trace"]) if cuda and spec.get("trace") else None
    med = statistics.median(times)
    res = {"params": n_params, "tokens_per_s": spec["batch"] * spec["seq"] / med, "peak_gib": peak,
           "peak_reserved_gib": reserved, "alloc_retries": retries, "step_ms": med * 1e3,
           "step_ms_mean": statistics.fmean(times) * 1e3,
           "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3, "step_ms_all": [t * 1e3 for t in times], "loss": float(loss.detach().float()),
           "build_s": build_s, "warmup_s": warmup_s, "turn_wait_s": wait_s,
           "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if phases:
        res["phase_ms"] = phases
    if traced:
        res["trace"] = traced
    res.update(extra())
    return res


def child_main(system: str, spec: dict) -> None:
    try:
        res = run_one(system, spec)
    except BaseException as e:  # the row shows the error instead of going missing
        import traceback

        traceback.print_exc()
        msg = str(e) or repr(e)
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower()
        res = {"error": f"{'OOM' if oom else type(e).__name__}: {msg}"[:2000],
               "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(res, default=str), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no teardown: worker threads or process groups left behind cannot hang or crash the exit


# ------------------------------------------------------------------------------ one system (parent side)
class Ctx:
    """What the parent's task threads share."""

    def __init__(self, args, device_total_gib: float, host_avail_gib: float | None):
        self.args = args
        self.device_total_gib = device_total_gib
        self.host_avail_gib = host_avail_gib
        self.t_start = time.monotonic()
        self.deadline_at = None if args.deadline is None else self.t_start + args.deadline
        cap_host = (host_avail_gib - HOST_MARGIN_GIB) if host_avail_gib else float("inf")
        self.slots = timeshare.Slots(args.jobs, device_total_gib or float("inf"), cap_host, HEAVY_HOST_GIB)
        self.lock_path = None
        self.own_lock_dir = None  # the folder this run made for its lock (removed at the end)
        if args.jobs > 1:
            # a lock named in the environment is shared with another benchmark parent (on the other GPU)
            self.lock_path = os.environ.get(timeshare.LOCK_ENV)
            if not self.lock_path:
                self.own_lock_dir = tempfile.mkdtemp(prefix="protrain_bench_")
                self.lock_path = os.path.join(self.own_lock_dir, "turns.lock")
        self.peer_site: concurrent.futures.Future | None = None
        self.procs: set = set()
        self.stopping = False
        self.lock = threading.Lock()


def base_row(scenario: str, system: str, sc: dict) -> dict:
    params, flops = model_stats(sc["kind"], sc["cfg"], sc["seq"])
    row = dict.fromkeys(ROW_KEYS)
    row.update(scenario=scenario, system=system, model=model_label(sc["kind"], sc["cfg"]), params=params,
               cap_gib=sc["cap_gib"], batch=sc["batch"], seq=sc["seq"], flops_per_token=flops)
    return row


def predicted_failure(system: str, row: dict, ctx: Ctx) -> str | None:
    """Why ``system`` certainly cannot run this size, from lower bounds of what it must hold (peers.py), or None."""
    args = ctx.args
    if SYSTEMS[system].cuda_only and args.device != "cuda":
        return f"needs CUDA: {system} runs on a GPU only (device {args.device})"
    if args.no_predict or args.device != "cuda":
        return None
    n = row["params"]
    limit = row["cap_gib"] or ctx.device_total_gib
    per = peers.DEVICE_BYTES_LOWER_BOUND.get(system, 0)
    if limit and per * n / 2**30 > limit:
        where = f"the {limit:g} GiB cap" if row["cap_gib"] else f"the device's {limit:.0f} GiB"
        return (f"OOM (predicted, not run): its model states alone need {per * n / 2**30:.0f} GiB on the device "
                f"({per} B/param: see peers.DEVICE_BYTES_LOWER_BOUND), more than {where}")
    if ctx.host_avail_gib and system in peers.HOST_BYTES_PER_PARAM:
        need = peers.HOST_BYTES_PER_PARAM[system] * offloaded_params(system, row, ctx) / 2**30
        if need > ctx.host_avail_gib:
            return (f"host OOM (predicted, not run): its offloaded model states alone need {need:.0f} GiB of host "
                    f"memory ({peers.HOST_BYTES_PER_PARAM[system]} B/param), more than the {ctx.host_avail_gib:.0f} "
                    "GiB available at start")
    return None


def offloaded_params(system: str, row: dict, ctx: Ctx) -> float:
    """At least how many parameters have their model states on the host: all, except for protrain, which
    keeps what the device can hold resident (at 16 B/param, activations aside)."""
    n = row["params"]
    if system == "protrain":
        return max(0.0, n - (row["cap_gib"] or ctx.device_total_gib) * 2**30 / 16)
    return n


def claims(system: str, row: dict, sc: dict, ctx: Ctx) -> tuple[float, float, float | None]:
    """(device GiB, host GiB, soft cap GiB or None) this child claims for admission (benchmarks/timeshare.py):
    generous estimates (peers.py), which only decide what runs side by side. An uncapped child that shares the
    device is capped at its claim; if that (or a neighbour) makes it fail for memory, it runs again alone
    (:func:`run_job`), so a wrong estimate costs time, never a wrong row."""
    n = row["params"]
    host = peers.HOST_OVERHEAD_GIB
    if ctx.args.device != "cuda":
        return 0.0, host + 16 * n / 2**30, None
    # as if everything were offloaded, except uncapped protrain, which offloads only what the device cannot hold
    offloaded = offloaded_params(system, row, ctx) if system == "protrain" and not row["cap_gib"] else n
    host += peers.HOST_BYTES_PER_PARAM.get(system, 0) * offloaded / 2**30
    if row["cap_gib"]:
        return row["cap_gib"] + CONTEXT_GIB, host, None
    est = (peers.DEVICE_BYTES_ESTIMATE.get(system, 16) * n / 2**30
           + activation_gib(sc["kind"], sc["cfg"], sc["batch"], sc["seq"]))
    soft = 1.3 * est + 4.0
    if ctx.args.jobs <= 1 or soft + CONTEXT_GIB >= ctx.device_total_gib:
        return ctx.device_total_gib, host, None  # the whole device: runs alone on it
    return soft + CONTEXT_GIB, host, soft


def memory_failure(err: str | None) -> bool:
    low = (err or "").lower()
    return any(w in low for w in OOM_WORDS)


_SIZE = r"([\d.]+) (bytes|KiB|MiB|GiB|TiB)"


def _gib(num: str, unit: str) -> float:
    return float(num) * 2.0 ** {"bytes": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}[unit] / 2**30


def own_limit_hit(err: str) -> bool:
    """A PyTorch CUDA OOM raised while the device still had room for the allocation: the process's own cap
    (or fragmentation) stopped it, not what other processes held."""
    want = re.search(r"Tried to allocate " + _SIZE, err)
    free = re.search(r"of which " + _SIZE + " is free", err)
    return bool(want and free and _gib(*free.groups()) >= _gib(*want.groups()) + 1.0)


def rerun_reason(res: dict, soft_cap: float | None, shared: bool) -> str | None:
    """Why a result obtained next to other systems (or under a soft cap) does not stand, or None: a memory
    failure that may be theirs (or the soft cap's) doing, or steps slowed by the soft cap (allocator retries)."""
    where = ("capped at its claim of " + format(soft_cap, ".0f") + " GiB" if soft_cap else "") + (
        (", " if soft_cap else "") + "next to other systems" if shared else "")
    err = res.get("error")
    if err:
        if memory_failure(err) and (soft_cap is not None or (shared and not own_limit_hit(err))):
            return f"{where}, it failed: {err[:600]}"
        return None
    if soft_cap is not None and res.get("alloc_retries"):
        return f"{where}, its allocator freed its cache to retry {res['alloc_retries']} times in the timed steps"
    return None


def run_child(argv: list[str], env: dict, timeout: float, ctx: Ctx | None = None) -> dict:
    """Run ``run.py --one ...``; its RESULT, or an error made from how it ended."""
    # its own process group, so that a timeout ends its children too (ninja builds, compile workers); not a new
    # session, so that whoever ends this process's session (a device run at its time limit) ends the child too
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **group)
    if ctx is not None:
        with ctx.lock:
            ctx.procs.add(p)
    try:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            _kill(p)
            out, err = p.communicate()
            return {"error": f"timed out after {timeout:.0f} s; last output: {_tail(err, out)}"}
    finally:
        if ctx is not None:
            with ctx.lock:
                ctx.procs.discard(p)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[len("RESULT "):])
    if ctx is not None and ctx.stopping:
        return {"error": f"stopped: the suite was interrupted; last output: {_tail(err, out)}"}
    if p.returncode < 0:
        name = signal.Signals(-p.returncode).name
        hint = " (the host's OOM killer?)" if p.returncode == -signal.SIGKILL else ""
        return {"error": f"killed by {name}{hint}; last output: {_tail(err, out)}"}
    return {"error": f"exited with code {p.returncode} and no RESULT; last output: {_tail(err, out)}"}


def _tail(err: str | None, out: str | None, n: int = 1500) -> str:
    return (err or out or "")[-n:]


def _kill(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remaining(ctx: Ctx) -> float:
    return float("inf") if ctx.deadline_at is None else ctx.deadline_at - time.monotonic()


def run_job(scenario: str, system: str, sc: dict, ctx: Ctx, priority: float = 0) -> dict:
    """One system on one model: a row (measured, or with the error)."""
    args = ctx.args
    row = base_row(scenario, system, sc)
    t0 = time.monotonic()
    row["error"] = predicted_failure(system, row, ctx)
    if row["error"] is None and SYSTEMS[system].wheels and ctx.peer_site is not None:
        ctx.peer_site.result()  # DeepSpeed / torchao installed (in the background, while others compile)
    dev, host, soft = claims(system, row, sc, ctx)
    alone = False
    while row["error"] is None:
        if ctx.stopping:
            row["error"] = "stopped: the suite was interrupted before this system ran"
            break
        if _remaining(ctx) < 30:
            row["error"] = f"not run: the run's --deadline ({args.deadline:g} s) was reached"
            break
        with ctx.slots.claim(dev, host, exclusive=alone, priority=priority, label=f"{system}@{row['model']}") as claim:
            left = _remaining(ctx)
            if ctx.stopping:
                row["error"] = "stopped: the suite was interrupted before this system ran"
                break
            if left < 30:
                row["error"] = f"not run: the run's --deadline ({args.deadline:g} s) was reached"
                break
            soft_cap = None if alone else soft
            # another parent on the machine: one host-heavy child alive on it, taken before the child starts
            heavy_lock = os.environ.get(timeshare.HEAVY_LOCK_ENV) if host > HEAVY_HOST_GIB else None
            with timeshare.host_heavy_turn(heavy_lock, None if ctx.deadline_at is None else ctx.deadline_at - 30) as turn:
                left = _remaining(ctx)
                if not turn or ctx.stopping or left < 30:
                    row["error"] = ("stopped: the suite was interrupted before this system ran" if ctx.stopping else
                                    f"not run: the run's --deadline ({args.deadline:g} s) was reached while "
                                    "waiting for the host-heavy turn (another parent's offloading system)")
                    break
                timeout = min(args.timeout, left - 5)
                res = run_child(child_argv(system, sc, ctx, soft_cap), child_env(system, ctx), timeout, ctx)
            shared, neighbours = claim.shared, sorted(claim.neighbours)
        if timeout < args.timeout and (res.get("error") or "").startswith("timed out"):
            res["error"] = (f"not run to the end: the run's --deadline ({args.deadline:g} s) stopped it after "
                            f"{timeout:.0f} s; {res['error']}")
        why = None if alone or ctx.stopping else rerun_reason(res, soft_cap, shared)
        if why:
            row["first_try_error"] = why
            alone = True  # its neighbours or its soft cap may be the cause: run it again with the machine to itself
            continue
        if res.get("params") is None:
            res.pop("params", None)
        row.update(res)
        row["ran_alone"] = not shared
        row["alive_next_to_it"] = neighbours  # other children alive at some point of its run (never measuring)
        break
    row["wall_s"] = round(time.monotonic() - t0, 1)
    if row["tokens_per_s"]:
        row["tflops"] = row["tokens_per_s"] * row["flops_per_token"] / 1e12
    return row


def child_argv(system: str, sc: dict, ctx: Ctx, soft_cap: float | None) -> list[str]:
    args = ctx.args
    spec = {k: sc[k] for k in ("kind", "cfg", "batch", "seq", "cap_gib")}
    spec.update(device=args.device, steps=sc.get("steps", args.steps), warmup=sc.get("warmup", args.warmup),
                settle=args.jobs > 1 and args.device == "cuda", ac_budget=args.ac_budget,
                protrain_options=args.protrain_options, soft_cap_gib=soft_cap)
    return [sys.executable, os.path.abspath(__file__), "--one", system, "--spec", json.dumps(spec)]


def child_env(system: str, ctx: Ctx) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop(timeshare.HEAVY_LOCK_ENV, None)  # the parent holds it for the child (run_job)
    if ctx.lock_path:
        env[timeshare.LOCK_ENV] = ctx.lock_path
    if ctx.lock_path and ctx.args.device == "cuda":
        # side-by-side compiles share the cores (and fewer compile workers means less host memory)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // ctx.args.jobs)))
    if SYSTEMS[system].wheels and ctx.peer_site is not None and ctx.peer_site.result():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ctx.peer_site.result(), env.get("PYTHONPATH")]))
    return env


def search(system: str, sc: dict, ctx: Ctx, report, priority: float = 0, earlier: dict | None = None) -> dict:
    """The largest depth (GPT of width --search-width) ``system`` trains: double from --search-start until the
    first failure, then --search-refine bisection steps. The row is that of the largest that trained (or of
    the first attempt when none did), with every attempt under ``search``. ``earlier``: the row of a search
    that a deadline cut short (--resume): its attempts are kept and the search goes on from them."""
    args = ctx.args
    attempts: dict[int, dict] = {k: r for k, r in earlier_attempts(earlier).items() if not not_run(r)}
    stopped = "first failure"

    def attempt(n_layer: int) -> str:
        if n_layer in attempts:  # measured by an earlier call (--resume)
            row = attempts[n_layer]
        else:
            row = run_job("maxmodel", system, dict(sc, cfg=search_cfg(args, n_layer)), ctx, priority)
            attempts[n_layer] = row
            report(row, f"maxmodel L{n_layer}")
        if row["error"] is None:
            return "ok"
        return "not run" if not_run(row) else "failed"

    ok = bad = None
    n = args.search_start
    while True:
        if n > args.search_max_layers:
            stopped = f"--search-max-layers {args.search_max_layers}"
            break
        r = attempt(n)
        if r == "ok":
            ok, n = n, n * 2
            continue
        if r == "failed":
            bad = n
        else:
            stopped = "deadline or interrupt"
        break
    for _ in range(args.search_refine):
        if ok is None or bad is None or bad - ok <= 1:
            break
        mid = (ok + bad) // 2
        r = attempt(mid)
        if r == "ok":
            ok = mid
        elif r == "failed":
            bad = mid
        else:
            stopped = "deadline or interrupt"
            break
    row = dict(attempts[ok if ok is not None else min(attempts)])
    row["layers"] = ok if ok is not None else min(attempts)
    row["search"] = [{"layers": k, "params": r["params"], "tokens_per_s": r["tokens_per_s"],
                      "peak_gib": r["peak_gib"], "error": (r["error"] or None) and r["error"][:300],
                      "wall_s": r.get("wall_s")} for k, r in sorted(attempts.items())]
    row["first_failure"] = None if bad is None else {"layers": bad, "params": attempts[bad]["params"],
                                                      "error": attempts[bad]["error"][:500]}
    row["search_stopped"] = stopped
    if earlier and earlier.get("replaced_attempts"):  # what --rerun-attempt measured again, as it was before
        row["replaced_attempts"] = earlier["replaced_attempts"]
    row["search_wall_s"] = round(sum(r.get("wall_s") or 0 for r in attempts.values()), 1)
    return row


def earlier_attempts(row: dict | None) -> dict[int, dict]:
    """The attempts of an earlier search row by depth: the row itself for the depth it reports (every field),
    the others from its ``search`` list (what that keeps: params, tokens/s, peak, error)."""
    if not row:
        return {}
    best = row.get("layers")  # rows written before it was recorded: the largest attempt that trained
    if best is None:
        best = max((a["layers"] for a in row.get("search") or [] if a["error"] is None), default=None)
    out = {}
    for a in row.get("search") or []:
        if a["layers"] == best:
            full = {k: v for k, v in row.items() if k not in ("search", "first_failure", "search_stopped",
                                                              "search_wall_s", "resumed")}
            out[a["layers"]] = full
        else:
            out[a["layers"]] = dict(a, wall_s=a.get("wall_s") or 0, error=a["error"])
    return out


def ratios(rows: list[dict]) -> None:
    """tokens/s over the torch.compile uncapped row of the same model, batch and seq."""
    ceil = {(r["model"], r["batch"], r["seq"]): r["tokens_per_s"] for r in rows
            if r["system"] == "compile" and not r["cap_gib"] and r["tokens_per_s"]}
    for r in rows:
        c = ceil.get((r["model"], r["batch"], r["seq"]))
        r["ratio_to_ceiling"] = r["tokens_per_s"] / c if c and r["tokens_per_s"] else None


# ------------------------------------------------------------------------------------------- outputs
def short_error(err: str | None) -> str:
    if not err:
        return ""
    low = err.lower()
    if "(predicted, not run)" in low:
        return "host OOM*" if low.startswith("host") else "OOM*"
    if low.startswith("not run") and "deadline" in low:
        return "deadline"
    if low.startswith("stopped:"):
        return "stopped"
    if low.startswith("not run"):
        return "not run"
    if "out of memory" in low or low.startswith("oom"):
        return "OOM"
    for key, word in (("needs cuda", "needs CUDA"), ("timed out", "timeout"), ("killed by", "killed"),
                      ("no module named", "not installed")):
        if key in low:
            return word
    return "error"


def _params(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _err(e, n: int = 160) -> str:
    if not e:
        return ""
    e = " ".join(str(e).split()).replace("|", "/")
    return e if len(e) <= n else e[: n - 3] + "..."


def _notes(r: dict) -> str:
    bits = ["measured by an earlier device call of this command (--resume)"] if r.get("resumed") else []
    if r.get("n_chunks"):
        bits.append(f"plan: {r['n_persist']}/{r['n_chunks']} chunks resident, chunk {r['chunk_size'] / 2**20:.0f} MiB, "
                    f"n_buffer {r['n_buffer']}, {r.get('offloaded_gib') or 0:.2f} GiB of fp32 parameters on the host")
    planned_host = (r.get("plan_predicted") or {}).get("host_bytes")
    if planned_host is not None and r.get("host_peak_gib") is not None:
        bits.append(f"host memory: plan {planned_host / 2**30:.1f} GiB pinned, process peak {r['host_peak_gib']:.1f} GiB")
    for a in r.get("replaced_attempts") or []:
        bits.append(f"L{a['layers']} measured again (--rerun-attempt); before: "
                    + (_err(a["error"], 100) if a["error"] else f"{a['tokens_per_s']:,.0f} tokens/s"))
    if r.get("first_try_error"):
        bits.append("ran again alone: " + _err(r["first_try_error"], 120))
    if r.get("deepspeed"):
        bits.append(f"deepspeed {r['deepspeed']}")
    if r.get("torchao"):
        bits.append(f"torchao {r['torchao']}")
    return "; ".join(bits)


def row_host_gib(r: dict, out: dict) -> float | None:
    """The host memory (GiB, MemAvailable at start or --host-gib) of the machine the row ran on."""
    return r.get("host_gib") if r.get("host_gib") is not None else out.get("host_gib_for_checks")


def hosts_line(out: dict) -> str:
    """'Host: ...', or, for runs merged from machines that differ, each host with the runs made on it."""
    hosts: dict[str, list[str]] = {}
    for m in out.get("merged_from") or []:
        if m.get("host"):  # one machine whatever was available at the start of each run (host_description)
            machine = re.sub(r" \([^)]*available at start\)", "", m["host"])
            hosts.setdefault(machine, []).append(os.path.basename(m["path"]))
    if len(hosts) <= 1:
        return f"Host: {next(iter(hosts), out['host'])}."
    return ("Hosts (rows carry theirs: `host` in the JSON, host GiB in the largest-model table): "
            + "; ".join(f"{h} ({', '.join(runs)})" for h, runs in hosts.items()) + ".")


def markdown(out: dict) -> str:
    rows = out["rows"]
    lines = [f"# protrain-fx benchmark suite: {out['device']}, torch {out['torch']}, {out['date']}", "",
             f"Command: `python benchmarks/run.py {' '.join(out['argv'])}`", "", hosts_line(out), ""]
    thr = [r for r in rows if r["scenario"] != "maxmodel"]
    if thr:
        lines += ["| scenario | system | model | params | cap GiB | batch x seq | tokens/s | TFLOP/s | peak GiB | "
                  "ratio to ceiling | error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in thr:
            lines.append(f"| {r['scenario']} | {r['system']} | {r['model']} | {_params(r['params'])} | "
                         f"{r['cap_gib'] or '-'} | {r['batch']} x {r['seq']} | {_num(r['tokens_per_s'], ',.0f')} | "
                         f"{_num(r['tflops'], '.1f')} | {_num(r['peak_gib'], '.1f')} | "
                         f"{_num(r['ratio_to_ceiling'], '.2f')} | {_err(r['error'])} |")
    mx = [r for r in rows if r["scenario"] == "maxmodel"]
    if mx:
        lines += [""] if thr else []
        lines += ["Largest model each system trains on the whole device (GPT, depth doubling until the first "
                  "failure; * = predicted from lower bounds, not run):", "",
                  "| system | largest trained | params | batch x seq | tokens/s there | peak GiB | host GiB | "
                  "first failure | attempts |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mx:
            ok = r["error"] is None
            ff = r.get("first_failure")
            fail = (f"L{ff['layers']} ({_params(ff['params'])}): {_err(ff['error'], 90)}" if ff else
                    f"none (stopped: {r.get('search_stopped', '?')})")
            tried = ", ".join(f"L{a['layers']} {'ok' if a['error'] is None else short_error(a['error'])}"
                              for a in r.get("search", []))
            lines.append(f"| {r['system']} | {r['model'] if ok else 'none'} | {_params(r['params']) if ok else '-'} | "
                         f"{r['batch']} x {r['seq']} | {_num(r['tokens_per_s'], ',.0f')} | "
                         f"{_num(r['peak_gib'], '.1f')} | {_num(row_host_gib(r, out), '.0f')} | "
                         f"{fail if ok else _err(r['error'], 90)} | {tried} |")
    measured = [r for r in rows if r.get("step_ms")]
    if measured:
        lines += ["", "Details (step times over the timed steps; build and warm-up in seconds):", "",
                  "| scenario | system | step ms median (min-max) | peak reserved GiB | build s | warm-up s | wall s | "
                  "notes |", "|---|---|---|---|---|---|---|---|"]
        for r in measured:
            lines.append(f"| {r['scenario']} | {r['system']} | {r['step_ms']:.0f} ({r['step_ms_min']:.0f}-"
                         f"{r['step_ms_max']:.0f}) | {_num(r.get('peak_reserved_gib'), '.1f')} | "
                         f"{_num(r.get('build_s'), '.0f')} | {_num(r.get('warmup_s'), '.0f')} | "
                         f"{_num(r.get('wall_s'), '.0f')} | {_notes(r)} |")
    lines += ["", "Notes:", "",
              f"- Every system runs in its own process: {out['warmup']} warm-up steps (compilation included), then "
              f"{out['steps']} timed steps, each followed by a device synchronize; tokens/s = batch x seq / the "
              "median step time (maxmodel attempts: --search-warmup and --search-steps). bf16 compute, fp32 master "
              "weights, AdamW (lr 1e-4, weight decay 0.1).",
              "- cap = `torch.cuda.set_per_process_memory_fraction(cap / device memory)`; '-' = uncapped. peak = "
              "`torch.cuda.max_memory_allocated()` over the timed steps.",
              "- ratio to ceiling = tokens/s over the torch.compile (Inductor) uncapped row of the same model, batch "
              "and seq (empty when that row is absent or failed).",
              f"- TFLOP/s = tokens/s x {FLOPS_FORMULA}.",
              "- protrain: `options=" + json.dumps(out.get("protrain_options_shown", {})) + "` plus the "
              "optimizer: the automatic plan (profiled once, searched under the memory the process may use, the "
              "cap, less protrain's reserve); model built under `protrain_fx.host_init`.",
              "- compile_ac: torch.compile with `torch._functorch.config.activation_memory_budget = "
              f"{out['ac_budget']:g}`.",
              *(["- LLaMA scenarios: " + out["llama"] + "."] if any(r["scenario"].startswith("llama") for r in rows)
                else []),
              *([f"- maxmodel: GPT of width {out['search']['width']}, depth doubling from {out['search']['start']}, "
                 f"batch {out['search']['batch']} x {SEQ}, {out['search']['warmup']} warm-up + "
                 f"{out['search']['steps']} timed steps per attempt; 'trains' = those steps ran without an error."]
                if mx and out.get("search") else []),
              "- Rows marked `(predicted, not run)` were not started: the system's model states alone exceed the "
              "limit by lower bounds (device: 16 B/param for on-device AdamW, 8 for torchao, 2 for ZeRO-2; host: "
              "16-18 B/param offloaded, against MemAvailable at start; see benchmarks/peers.py). `--no-predict` "
              "runs them anyway."]
    if out.get("jobs", 1) > 1:
        lines.append(f"- Up to {out['jobs']} systems built and compiled side by side (--jobs); timed steps never "
                     "overlapped anything (benchmarks/timeshare.py): each system measured with no other one building, "
                     "compiling or measuring, and no two systems holding model states in host memory alive at once "
                     "(an offloading system is never measured next to another one's pinned memory). One untimed "
                     "step after the wait re-fills the allocator's cache. An "
                     "uncapped system sharing the device was capped at its memory claim; one that failed for memory "
                     "next to others or under that claim, or whose allocator had to retry under it, ran again alone "
                     "(`ran again alone` in the details). A system kept on the device may have been timed while one "
                     "offloading system idled next to it (`alive_next_to_it` in the JSON); `--jobs 1` times every "
                     "system with nothing else alive.")
    lines += [f"- {n}" for n in out.get("run_notes") or []]
    if out.get("plot_error"):
        lines.append(f"- The chart was not drawn: {out['plot_error']}")
    if out.get("merged_from"):
        srcs = [f"`{m['path']}` ({m['date']}, {m.get('device', '?')}, torch {m.get('torch', '?')}: "
                f"`python benchmarks/run.py {' '.join(m['argv'])}`)" for m in out["merged_from"]]
        lines.append("- Merged from: " + "; ".join(srcs) + ". Ratios recomputed over the merged rows.")
    return "\n".join(lines) + "\n"


def plot(out: dict, path: str) -> None:
    """Bars of tokens/s per system per scenario (errors named at the foot of their slot); the largest-model
    search, if present, as a second panel of parameters per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    thr = [r for r in rows if r["scenario"] != "maxmodel"]
    mx = [r for r in rows if r["scenario"] == "maxmodel"]
    panels = [p for p in (thr, mx) if p] or [[]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4.8 * len(panels)), squeeze=False)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(systems)}
    for ax, panel in zip(axes[:, 0], panels):
        if panel is thr:
            scen = list(dict.fromkeys(r["scenario"] for r in thr))
            width = 0.8 / max(1, len(systems))
            top = max([r["tokens_per_s"] or 0 for r in thr] + [1])
            for j, s in enumerate(systems):
                for i, sc in enumerate(scen):
                    r = next((r for r in thr if r["system"] == s and r["scenario"] == sc), None)
                    if r is None:
                        continue
                    xpos = i + (j - (len(systems) - 1) / 2) * width
                    ax.bar(xpos, r["tokens_per_s"] or 0, width, color=colors[s],
                           label=s if s not in ax.get_legend_handles_labels()[1] else None)
                    if r["error"]:
                        ax.text(xpos, top * 0.01, short_error(r["error"]), rotation=90, ha="center", va="bottom",
                                fontsize=7)
                    else:
                        t = r["tokens_per_s"]
                        label = f"{t / 1e3:.1f}k" if t >= 1e3 else f"{t:.0f}"
                        if r["ratio_to_ceiling"]:
                            label += f" ({r['ratio_to_ceiling']:.2f})"
                        ax.text(xpos, r["tokens_per_s"], label, rotation=90, ha="center", va="bottom", fontsize=6)
            ax.set_xticks(range(len(scen)), [f"{sc}\n{next(r['model'] for r in thr if r['scenario'] == sc)}"
                                             for sc in scen], fontsize=8)
            ax.set_ylim(0, top * 1.3)
            ax.set_ylabel("tokens/s (ratio to the ceiling)")
            ax.set_title(f"Training throughput, {out['device']}, torch {out['torch']}, {out['date']}")
            ax.legend(fontsize=7, ncol=4, loc="upper right")
        elif panel is mx:
            top = max([(r["params"] or 0) / 1e9 for r in mx if r["error"] is None] + [1])
            for i, r in enumerate(mx):
                ok = r["error"] is None
                ax.bar(i, r["params"] / 1e9 if ok else 0, color=colors[r["system"]])
                cut = "\n(search cut short: a larger\nsize was not tried to the end)" if cut_search(r) else ""
                ax.text(i, r["params"] / 1e9 if ok else top * 0.01,
                        f"{_params(r['params'])}\n{r['model']}{cut}" if ok else short_error(r["error"]),
                        rotation=0 if ok else 90, ha="center", va="bottom", fontsize=7)
            host = [row_host_gib(r, out) for r in mx]
            several = len(set(host)) > 1  # rows from machines with different host memory: say which
            ax.set_xticks(range(len(mx)), [r["system"] + (f"\nhost {h:.0f} GiB" if several and h else "")
                                           for r, h in zip(mx, host)], fontsize=8)
            ax.set_ylim(0, top * 1.2)
            ax.set_ylabel("largest model trained (B params)")
            ax.set_title(f"Largest GPT each system trains on the device (batch {mx[0]['batch']} x {mx[0]['seq']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(out: dict, path: str, chart: bool = True) -> None:
    """<path>.json, .md and (``chart``) .png; a chart that cannot be drawn leaves ``plot_error`` in the JSON
    and the table."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ratios(out["rows"])
    if chart:
        out.pop("plot_error", None)
        try:
            plot(out, path + ".png")
        except Exception as e:  # noqa: BLE001 - the table and JSON still stand
            out["plot_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"plot failed: {out['plot_error']}", flush=True)
    for ext, text in ((".json", json.dumps(out, indent=2, default=str)), (".md", markdown(out))):
        with open(path + ext + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ext + ".tmp", path + ext)


# ------------------------------------------------------------------------------------------ set-up
def install_peer_wheels(lock_path: str | None, log: dict) -> str | None:
    """Install .whl/ (DeepSpeed sdist + wheels, torchao) into PEER_SITE once per machine; PEER_SITE, or None
    when there is nothing to install. As ../shared/reference/run_peers.sh: wheels with --no-deps, DeepSpeed's
    sdist with --no-build-isolation (its ops are JIT-built at first use). Never raises: what failed goes to
    ``log`` (the run's ``peer_install``) and the systems' own rows."""
    try:
        whl = os.path.join(ROOT, ".whl")
        wheels = sorted(glob.glob(os.path.join(whl, "*.whl")))
        sdists = sorted(glob.glob(os.path.join(whl, "*.tar.gz")))
        log["files"] = [os.path.basename(p) for p in wheels + sdists]
        if not wheels and not sdists:
            log["status"] = "no .whl/ folder: peers imported from the environment as it is"
            return None
        stamp = os.path.join(PEER_SITE, ".installed-from-whl")
        listing = "\n".join(log["files"])
        if os.path.exists(stamp) and open(stamp).read() == listing:
            log["status"] = f"already installed in {PEER_SITE}"
            return PEER_SITE
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", PEER_SITE]
        t0, errors = time.perf_counter(), []
        steps = ([pip + wheels] if wheels else []) + [pip + ["--no-build-isolation", s] for s in sdists]
        with timeshare.busy(lock_path):  # nobody measures while pip runs
            for cmd in steps:
                p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DS_BUILD_OPS="0"),
                                   check=False)
                if p.returncode:
                    errors.append(f"{os.path.basename(cmd[-1])}: {(p.stderr or p.stdout)[-800:]}")
        if not errors:
            with open(stamp, "w") as f:
                f.write(listing)
        log.update(status="installed" if not errors else "installed with errors", errors=errors,
                   seconds=round(time.perf_counter() - t0, 1))
        print(f"peer wheels: {log['status']} into {PEER_SITE} ({log['seconds']:.0f} s){' ' if errors else ''}"
              f"{' | '.join(errors)}", flush=True)
        return PEER_SITE
    except Exception as e:  # noqa: BLE001 - the peers' rows will say what is missing
        log["status"] = f"failed: {type(e).__name__}: {e}"
        print(f"peer wheels: {log['status']}", flush=True)
        return None


def gpu_info() -> tuple[str, float]:
    """(name, GiB) of GPU 0 through NVML, so that the parent process makes no CUDA context of its own."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return (name.decode() if isinstance(name, bytes) else name), pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
    except Exception:  # noqa: BLE001
        return torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 2**30


def host_description(avail: float | None, total: float | None) -> str:
    mem = f", {total:.0f} GiB memory ({avail:.0f} GiB available at start)" if total and avail else ""
    return f"{os.cpu_count()} CPU cores{mem}, Python {platform.python_version()}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="all",
                    help="comma list (gpt1.4b, gpt1.4b-cap24, llama, llama-cap40, maxmodel) or 'all' (default)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    ap.add_argument("--smoke", action="store_true", help="CPU smoke: tiny GPT, 1 warm-up + 1 timed step per system")
    ap.add_argument("--device", default=None, help="cuda (default when present; --smoke: cpu) or cpu")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 4; --smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps, compiling included (default 3; --smoke 1)")
    ap.add_argument("--jobs", type=int, default=None, help="systems built and compiled at once; timed steps are "
                    "always alone (benchmarks/timeshare.py). Default 3; --smoke on the CPU 2")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per system run (build, compile, steps)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run (default: none): "
                    "systems still running then are stopped and later ones get rows saying they were not run (set "
                    "it below a device command's limit; 0 or less: nothing starts, every row says so)")
    ap.add_argument("--out", default=None, help="output path without extension (default benchmarks/results/suite; "
                    "--smoke: /tmp/protrain_smoke)")
    ap.add_argument("--ac-budget", type=float, default=0.5, help="compile_ac's activation_memory_budget")
    ap.add_argument("--protrain-options", type=json.loads, default={},
                    help="JSON object merged into protrain's options (after peers.PROTRAIN_OPTIONS); null drops a key")
    ap.add_argument("--llama-layers", type=int, default=28, help="LLaMA depth (28: 5.93 B; 32: 6.74 B)")
    ap.add_argument("--llama-batch", type=int, default=2)
    ap.add_argument("--host-gib", type=float, default=None,
                    help="host memory for the offloading systems (default: MemAvailable at start; 0: no host checks)")
    ap.add_argument("--no-predict", action="store_true", help="run sizes whose OOM is predicted from lower bounds")
    ap.add_argument("--search-width", type=int, default=4096)
    ap.add_argument("--search-start", type=int, default=8, help="first depth of the doubling search")
    ap.add_argument("--search-max-layers", type=int, default=256)
    ap.add_argument("--search-batch", type=int, default=4)
    ap.add_argument("--search-steps", type=int, default=2)
    ap.add_argument("--search-warmup", type=int, default=1)
    ap.add_argument("--search-refine", type=int, default=0, help="bisection steps after the first failure")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, with its memory claims, and what "
                    "would not (predicted failures); run nothing. Without a GPU it assumes an H200 (139.8 GiB)")
    ap.add_argument("--resume", default=None, help="a JSON this command wrote before (a run the device call's time "
                    "cut short): its rows that ran, failures included, are kept and only the rest run, so the same "
                    "command repeated over several device calls completes the suite")
    ap.add_argument("--rerun-attempt", action="append", default=[], metavar="SYSTEM@LAYERS",
                    help="with --resume: measure this maxmodel attempt again (its search goes on from the others), "
                    "e.g. after a fix of the system; repeatable")
    ap.add_argument("--merge", nargs="+", default=None, help="JSON files of earlier runs to combine into --out")
    ap.add_argument("--note", action="append", default=[], help="with --merge: a line for the table's notes")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.smoke or not (torch.cuda.is_available() or args.dry_run) else "cuda"
    if args.steps is None:
        args.steps = 1 if args.smoke else 4
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    if args.jobs is None:
        args.jobs = 2 if args.smoke and args.device == "cpu" else 3
    rerun: dict[str, set[int]] = {}
    for spec in args.rerun_attempt:
        system, _, layers = spec.partition("@")
        if system not in SYSTEMS or not layers.isdigit():
            ap.error(f"--rerun-attempt {spec!r}: SYSTEM@LAYERS with SYSTEM one of {', '.join(SYSTEMS)}")
        rerun.setdefault(system, set()).add(int(layers))
    if rerun and not args.resume:
        ap.error("--rerun-attempt goes with --resume (the run whose attempt to measure again)")
    args.rerun_attempt = rerun
    if args.out is None:
        args.out = "/tmp/protrain_smoke" if args.smoke else os.path.join(HERE, "results", "suite")
    return args


def dry_run(names: list[str], systems: list[str], all_sc: dict, ctx: Ctx, device: str) -> None:
    """What a run would start, and with which claims; what it would not start, and why. Nothing runs."""
    args = ctx.args
    host = f"{ctx.host_avail_gib:.0f} GiB" if ctx.host_avail_gib else "unchecked"
    print(f"dry run: {device} ({ctx.device_total_gib:.1f} GiB), host memory {host}, --jobs {args.jobs}")
    for name in names:
        sc = all_sc[name]
        for system in systems:
            if system not in sc["systems"]:
                continue
            cfgs = [sc["cfg"]] if name != "maxmodel" else [
                search_cfg(args, n) for n in itertools.takewhile(lambda n: n <= args.search_max_layers,
                                                                 (args.search_start * 2**i for i in range(20)))]
            for cfg in cfgs:
                s = dict(sc, cfg=cfg)
                row = base_row(name, system, s)
                why = predicted_failure(system, row, ctx)
                dev, hostc, soft = claims(system, row, s, ctx)
                what = f"NOT RUN: {why}" if why else (f"claims {dev:.0f} GiB device, {hostc:.0f} GiB host"
                                                     + (" (host-heavy)" if hostc > HEAVY_HOST_GIB else "")
                                                     + (f", soft cap {soft:.0f} GiB" if soft else ""))
                print(f"  {name:14s} {system:17s} {row['model']:32s} {_params(row['params']):>9s}  {what}")


def not_run(row: dict) -> bool:
    return (row.get("error") or "").startswith(("not run", "stopped:"))


def resumed_rows(path: str, todo: list[tuple[str, str]], refine: int = 0,
                 rerun: dict[str, set[int]] | None = None) -> dict[int, dict]:
    """The rows of an earlier run (``path``) to keep, by index in ``todo``: every (scenario, system) that ran,
    whether it measured or failed, and is still asked for; not those the deadline or an interrupt left
    unrun, those that failed to import their system (ModuleNotFoundError: the peers' wheels were not there),
    nor maxmodel searches to go on with (:func:`search_to_go_on`, ``rerun``). A missing file keeps nothing
    (the first call of a resumed suite)."""
    earlier = {key: r for key, r in _earlier_rows(path, rerun).items()
               if not run_again(r) and not search_to_go_on(r, refine)}
    return {i: dict(earlier[key], resumed=True) for i, key in enumerate(todo) if key in earlier}


def _earlier_rows(path: str, rerun: dict[str, set[int]] | None) -> dict[tuple[str, str], dict]:
    """An earlier run's rows by (scenario, system), with the maxmodel attempts named in ``rerun`` (system ->
    depths; --rerun-attempt) taken out of their searches, which makes those searches go on
    (:func:`forget_attempts`)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = {(r["scenario"], r["system"]): r for r in json.load(f)["rows"]}
    for system, depths in (rerun or {}).items():
        if ("maxmodel", system) in rows:
            kept = forget_attempts(rows["maxmodel", system], depths)
            if kept is None:
                del rows["maxmodel", system]
            else:
                rows["maxmodel", system] = kept
    return rows


def forget_attempts(row: dict, depths: set[int]) -> dict | None:
    """A maxmodel search row without its attempts at ``depths``, marked to go on (:func:`cut_search`), so that
    --resume measures them again: for an attempt whose failure a later fix of the system may have removed
    (protrain's 96-layer attempt, stopped by the host's OOM killer before 02e323c). The row's other attempts
    stay as measured. None (the search starts over) if the depth the row reports is among them: only that
    attempt's fields are whole in the row."""
    tried = [a for a in row.get("search") or [] if a["layers"] not in depths]
    if len(tried) == len(row.get("search") or []):
        return row
    if row.get("layers") in depths:
        return None
    replaced = [a for a in row["search"] if a["layers"] in depths]
    return dict(row, search=tried, search_stopped="deadline or interrupt",
                replaced_attempts=(row.get("replaced_attempts") or []) + replaced)


def run_again(row: dict) -> bool:
    """A row --resume runs again: not run (deadline, interrupt), or its system could not even be imported."""
    return not_run(row) or "ModuleNotFoundError" in (row.get("error") or "")


def cut_search(row: dict) -> bool:
    """A maxmodel search that a deadline or an interrupt stopped before its first failure."""
    return row.get("search_stopped") == "deadline or interrupt"


def search_to_go_on(row: dict, refine: int = 0) -> bool:
    """A maxmodel search cut short (:func:`cut_search`), or one that found its first failure but took fewer
    bisection steps towards it than ``refine`` asks for while a gap is left (the search replays what it
    measured and runs only the new steps)."""
    if cut_search(row):
        return True
    fail, ok, tried = row.get("first_failure"), row.get("layers"), row.get("search") or []
    if not refine or not fail or ok is None or fail["layers"] - ok <= 1 or not tried:
        return False
    start = min(a["layers"] for a in tried)
    doubling = {start << k for k in range(32)}
    return sum(a["layers"] not in doubling for a in tried) < refine


def searches_to_continue(path: str, todo: list[tuple[str, str]], refine: int = 0,
                         rerun: dict[str, set[int]] | None = None) -> dict[int, dict]:
    """The maxmodel rows of an earlier run (``path``) to go on with (:func:`search_to_go_on`; ``rerun``:
    :func:`forget_attempts`), by index in ``todo``."""
    earlier = {key: r for key, r in _earlier_rows(path, rerun).items() if search_to_go_on(r, refine)}
    return {i: earlier[key] for i, key in enumerate(todo) if key in earlier}


def merge(args) -> None:
    rows, merged, out = {}, [], None
    for path in args.merge:
        with open(path) as f:
            data = json.load(f)
        merged.append({"path": path, **{k: data.get(k) for k in ("date", "device", "torch", "argv", "host")}})
        for r in data["rows"]:
            key = (r["scenario"], r["system"])
            # the machine each row ran on: runs on machines with different host memory are merged, and the
            # offloading systems' limits are host memory
            r.setdefault("host", data.get("host"))
            r.setdefault("host_gib", data.get("host_gib_for_checks"))
            if key in rows and not_run(r) and not run_again(rows[key]):
                continue  # a row that was not run (deadline, interrupt) never replaces one that ran
            rows[key] = r  # otherwise a later file's row replaces an earlier one's
        out = data
    for key, row in missing_rows(rows, out).items():
        rows[key] = row
    out = dict(out, rows=list(rows.values()), merged_from=merged, argv=["--merge", *args.merge, "--out", args.out],
               run_notes=list(args.note))
    write_outputs(out, args.out)
    print(f"wrote {args.out}.json, .md, .png ({len(rows)} rows)")


def missing_rows(rows: dict, last: dict) -> dict:
    """Rows for the (scenario, system) pairs of the merged scenarios that none of the merged runs has (a run
    cut short before it wrote them, or one whose --systems left them out): a device OOM certain from lower
    bounds (on the merged runs' device) says so, as that run would have; any other says no run reached it.
    The table never silently lacks a system."""
    gpu = bool(last.get("device_gib")) and last.get("device") != "cpu"
    args = parse_args(["--search-start", str((last.get("search") or {}).get("start") or 8), "--device",
                       "cuda" if gpu else "cpu"])
    ctx = SimpleNamespace(args=args, device_total_gib=last.get("device_gib") or 0.0, host_avail_gib=None)
    all_sc = scenarios(args)
    out = {}
    for name in dict.fromkeys(k[0] for k in rows):
        sc = all_sc.get(name)
        for system in (sc or {}).get("systems", ()):
            if (name, system) in rows:
                continue
            cfg = search_cfg(args, args.search_start) if name == "maxmodel" else sc["cfg"]
            row = base_row(name, system, dict(sc, cfg=cfg))
            row.update(error=predicted_failure(system, row, ctx) or "not run: none of the merged runs reached it",
                       wall_s=0.0)
            if name == "maxmodel":
                row.update(layers=args.search_start, search=[], search_stopped="deadline or interrupt")
            out[(name, system)] = row
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        child_main(args.one, json.loads(args.spec))
        return
    if args.merge:
        merge(args)
        return
    all_sc = scenarios(args)
    names = list(all_sc) if args.smoke or args.scenarios == "all" else args.scenarios.split(",")
    systems = args.systems.split(",")
    unknown = [n for n in names if n not in all_sc] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown scenario/system {unknown}; scenarios: {', '.join(all_sc)}; "
                         f"systems: {', '.join(SYSTEMS)}")
    if args.device != "cuda":
        device, total = f"CPU ({platform.machine()})", 0.0
    elif args.dry_run and not torch.cuda.is_available():
        device, total = "an assumed H200 (--dry-run without a GPU)", 139.8
    else:
        device, total = gpu_info()
    from protrain_fx.hardware import host_memory  # MemAvailable, capped by the cgroup; $PROTRAIN_HOST_MEMORY

    avail, host_total = (b / 2**30 for b in host_memory())
    host = avail if args.host_gib is None else (args.host_gib or None)
    ctx = Ctx(args, total, host)
    if args.dry_run:
        dry_run(names, systems, all_sc, ctx, device)
        return
    peer_install: dict = {}
    todo = [(n, s) for n in names for s in systems if s in all_sc[n]["systems"]]
    if args.device == "cuda" and any(SYSTEMS[s].wheels for _, s in todo):
        ctx.peer_site = concurrent.futures.ThreadPoolExecutor(1).submit(install_peer_wheels, ctx.lock_path,
                                                                        peer_install)
    shown = {**peers.PROTRAIN_OPTIONS, **args.protrain_options}
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "device_gib": round(total, 1),
           "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else list(argv),
           "host": host_description(avail, host_total), "host_gib_for_checks": host, "flops_formula": FLOPS_FORMULA,
           "ac_budget": args.ac_budget,
           "protrain_options_shown": {k: v for k, v in shown.items() if v is not None},
           "protrain_defaults": {"PROTRAIN_OPTIONS": peers.PROTRAIN_OPTIONS},
           "warmup": args.warmup, "steps": args.steps, "jobs": args.jobs, "timeout_s": args.timeout,
           "deadline_s": args.deadline, "peer_install": peer_install,
           "llama": (f"{model_label('llama', llama_cfg(args.llama_layers))} "
                     f"({_params(model_stats('llama', llama_cfg(args.llama_layers), SEQ)[0])}: LLaMA-2-7B's width, "
                     f"heads, FFN and vocab at {args.llama_layers} of its 32 layers), "
                     f"batch {args.llama_batch} x {SEQ}, at 40 GiB (all systems) and uncapped (torch.compile only, "
                     "the ceiling)"),
           "search": {k: getattr(args, "search_" + k) for k in ("width", "start", "max_layers", "batch", "steps",
                                                                   "warmup", "refine")},
           "rows": []}

    def report(row: dict, what: str) -> None:
        status = (f"ERROR {_err(row['error'], 300)}" if row["error"] else
                  f"{row['tokens_per_s']:,.0f} tokens/s, peak {_num(row['peak_gib'], '.1f')} GiB")
        print(f"[{what}] {row['system']}: {status} ({row['wall_s']:.0f} s)", flush=True)

    rows: dict[int, dict] = {}
    cut: dict[int, dict] = {}  # maxmodel searches an earlier call's deadline stopped: go on from their attempts
    last_chart = [0.0]
    if args.resume:  # keep what an earlier run of this suite measured (or saw fail); run the rest
        rows.update(resumed_rows(args.resume, todo, args.search_refine, args.rerun_attempt))
        cut = searches_to_continue(args.resume, todo, args.search_refine, args.rerun_attempt)
        out["resumed_from"] = {"path": args.resume, "kept": len(rows)}
        out["rows"] = [rows[k] for k in sorted(rows)]
        print(f"resuming {args.resume}: {len(rows)} of {len(todo)} rows kept", flush=True)

    def one(i: int) -> None:
        name, system = todo[i]
        if name == "maxmodel":
            row = search(system, all_sc[name], ctx, report, priority=i, earlier=cut.get(i))
        else:
            row = run_job(name, system, all_sc[name], ctx, priority=i)
            report(row, name)
        with ctx.lock:
            rows[i] = row
            out["rows"] = [rows[k] for k in sorted(rows)]
            out["wall_s"] = round(time.monotonic() - ctx.t_start, 1)
            chart = time.monotonic() - last_chart[0] > 20  # the chart at most every 20 s (and at the end)
            write_outputs(out, args.out, chart)
            if chart:
                last_chart[0] = time.monotonic()

    def stop(signum, frame):  # noqa: ARG001
        ctx.stopping = True
        with ctx.lock:
            for p in list(ctx.procs):
                _kill(p)

    if not todo:
        print(f"nothing to run: scenarios {names} have none of the systems {systems}", flush=True)
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:  # one thread per task; timeshare.Slots decides which children run at once
        with concurrent.futures.ThreadPoolExecutor(max(1, len(todo))) as pool:
            for f in [pool.submit(one, i) for i in range(len(todo)) if i not in rows]:
                f.result()
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    out["wall_s"] = round(time.monotonic() - ctx.t_start, 1)
    write_outputs(out, args.out)
    if ctx.own_lock_dir:  # never a lock named in the environment (its folder is someone else's: /tmp)
        shutil.rmtree(ctx.own_lock_dir, ignore_errors=True)
    print(f"wrote {args.out}.json, .md, .png ({len(out['rows'])} rows, {out['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
