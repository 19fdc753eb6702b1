"""Never out of memory on real models: a sweep of Hugging Face models, caps, batches and allocators
(issue 21; GPU).

Each row is one process: a ``transformers`` causal LM built from its config (random init, seed 0, on
the host, so every system starts from the same weights), bf16 autocast, fused AdamW, ``labels=``
loss, ``--steps`` steps on fixed random tokens. protrain rows run its automatic plan under a device
cap (``torch.cuda.set_per_process_memory_fraction``), the model built under
``protrain_fx.host_init``, with the allocator as the user would have it: ``default``
(``PYTORCH_CUDA_ALLOC_CONF`` unset) or ``expandable`` (``expandable_segments:True`` set by the
user). A row either trains every step or stops before training with ``NoPlanFits`` (then its message
names the smallest budget). The reference rows (``compile``) run torch.compile uncapped on the same
init and data; a model whose states do not fit the device even so runs it with Hugging Face's
gradient checkpointing (the same arithmetic). Two rows run only when ``--only`` names them: issue
25's Qwen2.5-14B shape on the whole device (no reference fits), and issue 24's peer, FSDP2 offload
(``CPUOffloadPolicy``, fused CPU AdamW) under the 3B shape's 24 GiB cap.

Per row: the losses (against the reference: within bf16 tolerance?), predicted and measured reserved
peak (the measured one is the process's ``max_memory_reserved``, profiling included), predicted and
measured step time (the median of the steps after the third, synchronized), time to the first step,
and the plan. All rows share one Inductor cache directory, so a row whose graphs another row
compiled before finds them (its ``inductor_cache`` says which); the protrain cache too (the hardware
profile measured once; each row's plan its own, keyed by its budget and allocator setting; the
profile of a graph shared by the rows of one model and shape under one allocator setting: the first
of them profiles, ``profile_cached`` says which).

    python benchmarks/oom_sweep.py --out $OUT/oom_sweep --deadline 560 [--resume OLD.json]
        [--only ROW_ID,...] [--models llama3.2-1b,...] [--variant 'NAME:ENV=VALUE,...']

Rows run in the order ``--only`` lists them, else in the order of ``--models``. The script
writes ``OUT.json`` and ``OUT.md`` after every row, so a call cut by its time limit keeps what ran;
``--resume`` runs only the rows an earlier JSON lacks (rows that timed out run again);
``--merge A.json B.json`` joins runs. ``--list`` prints the row ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODELS = {
    "llama3.2-1b": dict(
        cls="llama", hidden=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=128256, tied=True
    ),
    "llama3.2-3b": dict(
        cls="llama", hidden=3072, layers=28, heads=24, kv=8, ffn=8192, vocab=128256, tied=True
    ),
    "llama3.1-8b": dict(
        cls="llama", hidden=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256, tied=False
    ),
    "mistral-7b": dict(
        cls="mistral", hidden=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=32000, tied=False
    ),
    "qwen2.5-7b": dict(
        cls="qwen2", hidden=3584, layers=28, heads=28, kv=4, ffn=18944, vocab=152064, tied=False
    ),
    "qwen2.5-14b": dict(
        cls="qwen2", hidden=5120, layers=48, heads=40, kv=8, ffn=13824, vocab=152064, tied=False
    ),
}
# (model, batch, seq, caps where the model needs offloading there)
GRID = [
    ("llama3.2-1b", 4, 1024, (16, 24)),
    ("llama3.2-1b", 8, 2048, (16, 24, 40)),
    ("llama3.2-3b", 4, 1024, (16, 24, 40)),
    ("llama3.2-3b", 1, 4096, (16, 24)),
    ("llama3.1-8b", 4, 1024, (24, 40, 80)),
    ("mistral-7b", 2, 2048, (24, 40, 80)),
    ("qwen2.5-7b", 2, 2048, (24, 40, 80)),
]
# issue 25's rows: a model at the scale of the whole machine (the device's 139 GiB and the host),
# run only when --only or --models names them: no torch.compile reference fits (14.8 B parameters
# need 220 GiB of model states), so their check is finite losses, the host's peak against the plan's
HOST_SCALE = [("qwen2.5-14b", 4, 1024, (139,))]
# issue 24's peer beside protrain: FSDP2 with CPUOffloadPolicy and fused CPU AdamW under the same
# cap, run only when --only names it (its rows are not the automatic plan the counts are about)
PEERS = [("llama3.2-3b", 4, 1024, 24)]
# the allocator as the user leaves it (protrain then turns expandable segments on, and says so) and
# as a user who turns them off has it (PyTorch's fixed segments, which protrain then budgets for)
ALLOCS = {"default": None, "segments": "expandable_segments:False"}
BF16_REL = 2**-6  # two bf16 runs that differ by rounding: a few bf16 ulps of the loss
STEPS = 20


def rows_of_grid() -> list[dict]:
    def row(model, batch, seq, system, tail, **more):
        shape = dict(model=model, batch=batch, seq=seq)
        return dict(id=f"{model}/b{batch}s{seq}/{tail}", **shape, system=system, **more)

    rows = []
    for model, batch, seq, caps in GRID + HOST_SCALE:
        host_scale = (model, batch, seq, caps) in HOST_SCALE
        if not host_scale:
            rows.append(row(model, batch, seq, "compile", "compile"))
        for cap in caps:
            for alloc in ALLOCS if not host_scale else ("default",):
                more = {"host_scale": True} if host_scale else {}
                rows.append(
                    row(
                        model,
                        batch,
                        seq,
                        "protrain",
                        f"cap{cap}/{alloc}",
                        cap_gib=cap,
                        alloc=alloc,
                        **more,
                    )
                )
    for model, batch, seq, cap in PEERS:
        rows.append(row(model, batch, seq, "fsdp2", f"cap{cap}/fsdp2", cap_gib=cap, peer=True))
    return rows


def config_of(spec: dict, seq: int):
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[spec["cls"]]
    cfg = cls[0](
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["ffn"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv"],
        max_position_embeddings=max(4096, seq),
        tie_word_embeddings=spec["tied"],
        attn_implementation="sdpa",
        use_cache=False,
    )
    return cls[1], cfg


def build(spec: dict, seq: int, checkpointing: bool = False, host: bool = False):
    """The model, initialized on the GPU from seed 0 (the same weights for every system: a CPU
    init of a 3B model took 56 s of each row, the GPU's takes a second or two). ``host``: the
    weights end in host memory under ``protrain_fx.host_init`` (built there without an init, then
    loaded from the GPU's copy), and the GPU's copy is freed; else the model stays on the GPU."""
    import torch

    cls, cfg = config_of(spec, seq)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg)
    if host:
        import protrain_fx

        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # an older transformers
            from transformers.modeling_utils import no_init_weights
        state, n_params = model.state_dict(), len(list(model.parameters()))
        with protrain_fx.host_init("cuda"):
            with no_init_weights():
                model = cls(cfg)
            model.tie_weights()  # no_init_weights skips it with the init (transformers 5)
            assert len(list(model.parameters())) == n_params, "tied weights differ"
            model.load_state_dict(state)
        del state
        torch.cuda.empty_cache()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


class Clocks(logging.Handler):
    """The device's SM clock and power, sampled every 100 ms through NVML on a thread, summarized
    over two windows: protrain's profiled runs (between its ``profiling one step`` and
    ``searching`` progress lines) and the timed steps. Tells whether the steps ran at a lower clock
    than the profile was measured at (a power or thermal limit) when a plan's GPU phases take longer
    than predicted."""

    def __init__(self, index: int = 0):
        super().__init__()
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.samples: list[tuple[float, int, float]] = []
        self.marks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.wait(0.1):
            try:
                sm = nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM)
                watts = nv.nvmlDeviceGetPowerUsage(self._handle) / 1e3
            except nv.NVMLError:
                return
            self.samples.append((time.perf_counter(), sm, watts))

    def emit(self, record) -> None:
        msg = record.getMessage()
        if "profiling one step" in msg:
            self.marks["profile_start"] = time.perf_counter()
        elif "searching the plans" in msg:
            self.marks.setdefault("profile_end", time.perf_counter())

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def summary(self) -> dict:
        self._stop.set()
        self._thread.join()
        out = {}
        for name, a, b in (
            ("profiling", "profile_start", "profile_end"),
            ("steps", "steps_start", "steps_end"),
        ):
            if a in self.marks and b in self.marks:
                window = [s for s in self.samples if self.marks[a] <= s[0] <= self.marks[b]]
                if window:
                    clocks = [s[1] for s in window]
                    out[name] = {
                        "samples": len(window),
                        "sm_mhz_mean": round(statistics.mean(clocks)),
                        "sm_mhz_min": min(clocks),
                        "sm_mhz_max": max(clocks),
                        "watts_mean": round(statistics.mean(s[2] for s in window), 1),
                    }
        return out


def rss_gib() -> float:
    """This process's resident set now (pinned host memory included: it is resident)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_rss_gib() -> float:
    """This process's largest resident set so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_row(row: dict, steps: int) -> dict:
    """One row in this process."""
    import torch

    try:
        clocks = Clocks(torch.cuda.current_device())
        logging.getLogger("protrain_fx").addHandler(clocks)
        logging.getLogger("protrain_fx").setLevel(logging.INFO)
    except Exception as e:  # no NVML here: the row goes on without clocks
        print(f"no clock samples: {e}", file=sys.stderr)
        clocks = None
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    spec = MODELS[row["model"]]
    torch.zeros(1, device=dev)  # the CUDA context: part of the baseline, not of the row
    out = {"steps_asked": steps, "rss_base_gib": round(rss_gib(), 3)}
    # SWEEP_CLIP (from a --variant): the loop clips gradients to this norm, as HF Trainer does
    clip = float(os.environ.get("SWEEP_CLIP") or 0)
    out["clip"] = clip or None
    # SWEEP_MICRO: micro-steps per optimizer step (the batch again, the loss divided: the same
    # gradient), gradients accumulated as a loop does; SWEEP_KEEP_OUTPUT: the loop keeps the model's
    # output (its logits) through backward, as ``out = model(...); out.loss.backward()`` does;
    # SWEEP_DECLARE: the micro-steps are declared (protrain_fx.set_grad_accumulation) before the
    # first step, so the first plan counts the kept gradients (undeclared, a re-plan does)
    micro = int(os.environ.get("SWEEP_MICRO") or 1)
    keep_output = bool(os.environ.get("SWEEP_KEEP_OUTPUT"))
    declare = bool(os.environ.get("SWEEP_DECLARE"))
    out["micro_steps"], out["keep_output"] = micro, keep_output
    out["micro_steps_declared"] = declare and micro > 1
    hybrid = None
    if row["system"] == "protrain":
        import protrain_fx
        import protrain_fx.backend
        from protrain_fx.machine import allocator

        # SWEEP_TRIM_AT: when step boundaries give the allocator's free pages back (an A/B of
        # allocator.TRIM_AT; PROTRAIN_TRIM_HOLES=0: never)
        if os.environ.get("SWEEP_TRIM_AT"):
            allocator.TRIM_AT = float(os.environ["SWEEP_TRIM_AT"])
        model = build(spec, row["seq"], host=True)
        torch.cuda.reset_peak_memory_stats(dev)  # the GPU init is not part of the row
        torch.cuda.set_per_process_memory_fraction(
            row["cap_gib"] * 2**30 / torch.cuda.get_device_properties(dev).total_memory
        )
        if "protrain" not in torch._dynamo.list_backends(exclude_tags=()):
            torch._dynamo.register_backend(protrain_fx.backend.protrain_backend, name="protrain")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        if declare and micro > 1:
            protrain_fx.set_grad_accumulation(opt, micro)
        # SWEEP_OPTIONS (JSON, from a --variant): more protrain options, e.g. a forced
        # device_steps share for an A/B against the automatic plan
        extra = json.loads(os.environ.get("SWEEP_OPTIONS") or "{}")
        out["options"] = extra
        compiled = torch.compile(model, backend="protrain", options={"optimizer": opt, **extra})
    elif row["system"] == "fsdp2":
        import peers  # FSDP2 as the suite runs it, per decoder layer (the setup)

        model = build(spec, row["seq"]).cpu()
        model = compiled = peers.fsdp2_shard_offloaded(model, model.model.layers)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)  # the GPU init is not part of the row
        torch.cuda.set_per_process_memory_fraction(
            row["cap_gib"] * 2**30 / torch.cuda.get_device_properties(dev).total_memory
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # on the CPU
    else:
        n = sum(p.numel() for p in build_meta(spec, row["seq"]).parameters())
        # fp32 weights, gradients and two moments: 16 B a parameter, plus activations
        checkpointing = n * 16 > 0.6 * torch.cuda.get_device_properties(dev).total_memory
        out["gradient_checkpointing"] = checkpointing
        model = build(spec, row["seq"], checkpointing)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        compiled = torch.compile(model)
    out["build_s"] = round(time.perf_counter() - t0, 2)
    g = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, spec["vocab"], (row["batch"], row["seq"]), generator=g)
        for _ in range(steps)
    ]
    history = row.get("memory_history")
    losses, times, per_step = [], [], []
    for i, x in enumerate(data):
        if clocks is not None and i == 3:
            clocks.mark("steps_start")
        if history and i == 3:
            torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        ts = time.perf_counter()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        timers0 = _timers(hybrid)
        ev[0].record()
        x = x.to(dev)
        for m in range(micro):  # ev[1]: after the first forward
            with torch.autocast("cuda", dtype=torch.bfloat16):
                output = compiled(input_ids=x, labels=x)
            loss = output.loss
            if not keep_output:
                del output
            if m == 0:
                ev[1].record()
            (loss / micro if micro > 1 else loss).backward()
            output = None
        ev[2].record()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - ts)
        hybrid = hybrid or getattr(opt, "_protrain_hybrid", None)
        timers1 = _timers(hybrid)
        stats = torch.cuda.memory_stats(dev)
        per_step.append(
            {
                "s": round(times[-1], 4),
                "fwd_ms": round(ev[0].elapsed_time(ev[1]), 2),
                "bwd_ms": round(ev[1].elapsed_time(ev[2]), 2),
                "step_ms": round(ev[2].elapsed_time(ev[3]), 2),
                # clipping: the norm before it (under max_norm: a multiply by one)
                "grad_norm": None if norm is None else round(float(norm), 4),
                "cpu_adam_in_bwd_ms": round((timers1[0] - timers0[0]) * 1e3, 2),
                "opt_wait_ms": round((timers1[1] - timers0[1]) * 1e3, 2),
                # the C kernel alone (the rest of cpu_adam_in_bwd_ms is Python and the GIL)
                "cpu_kernel_ms": round((timers1[2] - timers0[2]) * 1e3, 2),
                "cpu_kernel_gparams_s": round(
                    (timers1[3] - timers0[3]) / max(timers1[2] - timers0[2], 1e-9) / 1e9, 3
                ),
                # offloaded parameters stepped on the device (runtime/device_steps.py)
                "device_step_params": timers1[4] - timers0[4],
                "peak_alloc_gib": round(
                    stats["allocated_bytes.all.peak"] / 2**30, 3
                ),  # since step 0
                "reserved_gib": round(stats["reserved_bytes.all.current"] / 2**30, 3),
                "peak_reserved_gib": round(stats["reserved_bytes.all.peak"] / 2**30, 3),
                "alloc_retries": stats.get("num_alloc_retries", 0),
            }
        )
        if i == 0:
            out["first_step_s"] = round(time.perf_counter() - t0, 2)
            out["first_step_peak_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30
            out["first_step_peak_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            torch.cuda.reset_peak_memory_stats(dev)
        if history and i == 5:
            out["memory_history"] = summarize_snapshot(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        print(
            f"step {i}: loss {losses[-1]:.4f} ({times[-1]:.3f} s) {per_step[-1]}",
            file=sys.stderr,
            flush=True,
        )
    if clocks is not None:
        clocks.mark("steps_end")
        out["clocks"] = clocks.summary()
    if row.get("trace"):  # one more step under torch.profiler: where its device time went
        import tempfile

        import trace_summary

        def one_step():
            x = data[0].to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        # SWEEP_TRACE_DIR: where the chrome trace stays (named by the row), else a temporary folder
        where = os.environ.get("SWEEP_TRACE_DIR") or tempfile.mkdtemp(prefix="oom_sweep_trace-")
        name = row["id"].replace("/", "_")
        out["trace"] = trace_summary.trace_step(one_step, os.path.join(where, name))
    steady = times[3:] or times[1:]
    later = per_step[1:] or per_step
    # host memory: the process's peak resident set (building the model on the host, profiling,
    # the plan's buffers) and its resident set after the steps, both above the baseline
    out["rss_steps_gib"] = round(rss_gib(), 3)
    out["peak_rss_gib"] = round(peak_rss_gib(), 3)
    out.update(
        losses=losses,
        per_step=per_step,
        measured_step_s=statistics.median(steady),
        tokens_per_s=row["batch"] * row["seq"] / statistics.median(steady),
        steady_peak_reserved_gib=max(s["peak_reserved_gib"] for s in later),
        steady_peak_allocated_gib=max(s["peak_alloc_gib"] for s in later),
        alloc_retries=per_step[-1]["alloc_retries"],
    )
    out["peak_reserved_gib"] = max(
        out["first_step_peak_reserved_gib"], out["steady_peak_reserved_gib"]
    )
    out["peak_allocated_gib"] = max(
        out["first_step_peak_allocated_gib"], out["steady_peak_allocated_gib"]
    )
    if row["system"] == "protrain":
        plan = protrain_fx.get_plan(compiled)
        out["trims"] = plan.trims  # step boundaries that gave free pages back
        d = plan.to_dict()
        pred = plan.predicted or {}
        from protrain_fx.plan_cache import KNOBS  # the knobs a plan records

        out["plan"] = {k: d.get(k, 0) for k in KNOBS}
        out["plan"]["chunks"] = len(d["chunks"])
        out["predicted_peak_reserved_gib"] = pred.get("peak_bytes", 0) / 2**30 or None
        # the plan's peak keeps the logits a model returns beside its loss through backward; this
        # loop drops the output first unless SWEEP_KEEP_OUTPUT: the plan's prediction for that
        dropped = pred.get("peak_bytes_output_dropped")
        if dropped is not None and not out.get("keep_output"):
            out["predicted_peak_reserved_gib"] = dropped / 2**30
            out["predicted_peak_kept_output_gib"] = pred.get("peak_bytes", 0) / 2**30
        if pred.get("peak_allocated_bytes"):
            out["predicted_peak_allocated_gib"] = pred["peak_allocated_bytes"] / 2**30
        out["predicted_step_s"] = pred.get("iter_s")
        if pred.get("host_bytes") is not None:
            out["predicted_host_gib"] = pred["host_bytes"] / 2**30
        out["predicted_detail"] = {
            "breakdown": pred.get("breakdown"),
            "host_bytes": pred.get("host_bytes"),
            "budget_bytes": pred.get("budget_bytes"),
            "profiled": {k: v for k, v in (pred.get("profiled") or {}).items() if k != "timeline"},
        }
        out["plan_from_cache"] = pred.get("from_cache")
        out["profile_cached"] = any("profile from the profile cache" in n for n in plan.notes)
        out["notes"] = list(plan.notes)
        out["summary"] = plan.summary()
    return out


def _timers(hybrid) -> tuple[float, float, float, int, int]:
    """(CPU Adam seconds inside backward, seconds opt.step() waited for the host worker, seconds
    inside the one-pass C kernel, parameters it stepped, parameters stepped on the device) so
    far."""
    if hybrid is None:
        return (0.0, 0.0, 0.0, 0, 0)
    t = hybrid.timers
    return (t.worker_step_s, t.step_wait_s, t.kernel_s, t.kernel_params, t.device_step_params)


def _trims(row: dict) -> str:
    """The retries column's note of the step boundaries that gave free pages back."""
    return f" ({row['trims']} trims)" if row.get("trims") else ""


def summarize_snapshot(snap: dict, top: int = 25) -> dict:
    """What a memory snapshot of steps 4-6 says about reserved over allocated: each stream's
    segments (reserved, allocated, free, the largest free block), the events that grew reserved
    memory with the request behind each, and the largest live blocks at the allocated peak with
    where they were allocated."""

    def where(frames):
        keep = [
            f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
            for f in frames
            if "torch/_" not in f["filename"] and "torch/nn" not in f["filename"]
        ]
        return keep[:4] or [
            f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:3]
        ]

    streams: dict = {}
    for seg in snap["segments"]:
        st = streams.setdefault(
            str(seg.get("stream")),
            {"segments": 0, "reserved": 0, "allocated": 0, "largest_free": 0, "free_blocks": 0},
        )
        st["segments"] += 1
        st["reserved"] += seg["total_size"]
        st["allocated"] += seg["allocated_size"]
        for blk in seg["blocks"]:
            if blk["state"] == "inactive":
                st["free_blocks"] += 1
                st["largest_free"] = max(st["largest_free"], blk["size"])
    for st in streams.values():
        for k in ("reserved", "allocated", "largest_free"):
            st[k + "_gib"] = round(st.pop(k) / 2**30, 3)
    trace = snap["device_traces"][0] if snap.get("device_traces") else []
    growth, live, cur, peak, peak_live = [], {}, 0, 0, []
    pending_growth, peak_at, freed_at = None, 0, {}
    for k, e in enumerate(trace):
        act = e["action"]
        if act in ("segment_map", "segment_alloc"):
            pending_growth = {"action": act, "gib": round(e["size"] / 2**30, 3)}
        elif act == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []), e.get("stream"), k)
            cur += e["size"]
            if pending_growth is not None:
                pending_growth.update(
                    request_mib=round(e["size"] / 2**20, 1),
                    stream=str(e.get("stream")),
                    where=where(e.get("frames", [])),
                )
                growth.append(pending_growth)
                pending_growth = None
            if cur > peak:
                peak, peak_at = cur, k
                peak_live = sorted(live.values(), key=lambda v: -v[0])[:top]
        elif act in ("free_completed",):
            v = live.pop(e["addr"], None)
            if v is not None:
                cur -= v[0]
                freed_at[v[3]] = k
    return {
        "streams": streams,
        "growth_events": growth[:200],
        "traced_peak_gib_above_start": round(peak / 2**30, 3),
        # event indices: when each block was allocated and freed, against the peak's
        "traced_peak_event": peak_at,
        "largest_at_traced_peak": [
            {
                "mib": round(sz / 2**20, 1),
                "stream": str(stream),
                "where": where(frames),
                "frames": [
                    f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']}:{f['name']}"
                    for f in frames[:14]
                ],
                "alloc_event": at,
                "free_event": freed_at.get(at),
            }
            for sz, frames, stream, at in peak_live
        ],
        # the allocations and frees of 64 MiB or more around the peak
        "large_events_near_peak": [
            {
                "event": k,
                "action": e["action"],
                "mib": round(e["size"] / 2**20, 1),
                "where": where(e.get("frames", []))[:2],
            }
            for k, e in enumerate(trace)
            if abs(k - peak_at) <= 4000
            and e["action"] in ("alloc", "free_completed")
            and e["size"] >= 64 << 20
        ][-120:],
    }


def build_meta(spec, seq):
    import torch

    cls, cfg = config_of(spec, seq)
    with torch.device("meta"):
        return cls(cfg)


def child(row: dict, args, dirs: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if ALLOCS.get(row.get("alloc")):
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCS[row["alloc"]]
    env.update(row.get("env") or {})
    env["TORCHINDUCTOR_CACHE_DIR"] = dirs["inductor"]
    # one protrain cache for the sweep: the hardware profile measured once; each row's plan is its
    # own (the key holds the budget and the allocator's setting), while rows of one model and shape
    # under one allocator setting share the graph's profile (the first of them profiles)
    env["PROTRAIN_CACHE_DIR"] = dirs["hardware"]
    result = os.path.join(dirs["root"], "row.json")
    cached = os.listdir(dirs["inductor"]) != []
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--run",
                json.dumps(row),
                "--result",
                result,
                "--steps",
                str(args.steps),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return dict(row, outcome="timeout", error=tail, wall_s=round(time.perf_counter() - t0, 1))
    out = dict(
        row, wall_s=round(time.perf_counter() - t0, 1), inductor_cache="warm" if cached else "cold"
    )
    if p.returncode == 0:
        with open(result) as f:
            out.update(json.load(f))
        os.remove(result)
        out["outcome"] = "trained"
        seen = step_observations(dirs["hardware"])
        out["compute_observed"] = seen.pop("compute")
        out["upload_observed_gbs"] = seen
    else:
        err = p.stderr[-4000:]
        out["error"] = err
        if "NoPlanFits" in err:
            out["outcome"] = "no_plan_fits"
        elif "OutOfMemoryError" in err or "out of memory" in err:
            out["outcome"] = "oom"
        else:
            out["outcome"] = "error"
    return out


def step_observations(hardware_dir: str) -> dict:
    """What busy steps of the sweep's rows have recorded so far, oldest first
    (machine/step_rates.py's file next to the hardware profile): compute slowdowns (a row's own,
    if it recorded one, is the last; the next row's plan prices their median) and the GB/s chunks
    went up at inside steps, per kind."""
    for base, _, files in os.walk(hardware_dir):
        for name in files:
            if name.endswith(".steps.json"):
                with open(os.path.join(base, name)) as f:
                    data = json.load(f)
                out = {"compute": [round(e["slowdown"], 4) for e in data.get("compute", [])]}
                for k in ("upload_copies", "upload_masters"):
                    out[k] = [round(e["bytes_per_s"] / 1e9, 2) for e in data.get(k, [])]
                return out
    return {"compute": [], "upload_copies": [], "upload_masters": []}


def evaluate(rows: list[dict]) -> dict:
    """Each row against its reference, and the counts the issue asks for."""
    refs = {(r["model"], r["batch"], r["seq"]): r for r in rows if r["system"] == "compile"}
    for r in rows:
        if r["system"] not in ("protrain", "fsdp2") or not r.get("losses"):
            continue
        r["finite"] = all(x == x and abs(x) != float("inf") for x in r["losses"])
        ref = refs.get((r["model"], r["batch"], r["seq"]))
        if ref and ref.get("losses") and not r.get("clip"):  # the references do not clip
            rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])]
            r["max_loss_rel_vs_compile"] = max(rel) if r["finite"] else float("nan")
            r["within_bf16_tolerance"] = r["finite"] and max(rel) <= BF16_REL
        if r.get("predicted_peak_reserved_gib"):
            p, m = r["predicted_peak_reserved_gib"], r["peak_reserved_gib"]
            r["peak_err"] = (m - p) / p
        if r.get("predicted_step_s"):
            p, m = r["predicted_step_s"], r["measured_step_s"]
            r["time_err"] = (m - p) / p
    # a row id with a fifth part (``.../cpu``, ``.../ds40``, ``.../nocopies``) is a variant: a
    # knob or a habit set by hand for an A/B, not the automatic plan the counts are about
    every = [r for r in rows if r["system"] == "protrain"]
    pt = [r for r in every if r["id"].count("/") <= 3]
    return {
        "variants": len(every) - len(pt),
        "protrain_rows": len(pt),
        "trained": sum(r.get("outcome") == "trained" for r in pt),
        "no_plan_fits": sum(r.get("outcome") == "no_plan_fits" for r in pt),
        "oom": sum(r.get("outcome") == "oom" for r in pt),
        "error": sum(r.get("outcome") in ("error", "timeout") for r in pt),
        "non_finite": sum(r.get("finite") is False for r in pt),
        "outside_bf16_tolerance": sum(r.get("within_bf16_tolerance") is False for r in pt),
        "peak_err_over_5pct": sum(abs(r.get("peak_err", 0)) > 0.05 for r in pt),
        "time_err_over_5pct": sum(abs(r.get("time_err", 0)) > 0.05 for r in pt),
    }


def table(out: dict) -> str:
    c = out["counts"]
    asked = sorted(
        {r.get("steps_asked", STEPS) for r in out["rows"] if r["system"] == "protrain"}
    ) or [STEPS]
    lines = [
        f"# Never out of memory: Hugging Face models under caps ({out['device']}, torch "
        f"{out['torch']}, {out['date']})",
        "",
        f"{c['protrain_rows']} protrain rows: {c['trained']} trained "
        f"{' or '.join(map(str, asked))} steps (the steps asked), "
        f"{c['no_plan_fits']} stopped with NoPlanFits, {c['oom']} out of memory, "
        f"{c['error']} other errors or timeouts; {c['non_finite']} with non-finite losses, "
        f"{c['outside_bf16_tolerance']} outside bf16 tolerance of torch.compile "
        f"({BF16_REL:.4f} relative per step), {c['peak_err_over_5pct']} with the reserved peak "
        f"more than 5% off the prediction, {c['time_err_over_5pct']} with the step time more than "
        "5% off."
        + (
            f" Not counted: {c['variants']} variant rows (an id with a fifth part: a knob or a "
            "habit set by hand for an A/B, not the automatic plan)."
            if c.get("variants")
            else ""
        ),
        "",
        "Peaks: the process's `max_memory_reserved` (profiling and the first step included); "
        "predicted: the plan's peak for this loop, which drops the model's output before "
        "backward (`peak_bytes_output_dropped`, which plans report from run 32 on; before, and in "
        "the allocated column, the plan's own peak, which keeps the logits returned beside the "
        "loss through backward, as a loop that holds the output does). Step time: median of "
        "the steps after the third (4-20 of 20), synchronized. Errors: (measured - predicted) / "
        "predicted. "
        "Host: the pinned buffers the plan predicts, and the process's resident set after the "
        "steps and at its peak (building the model on the host included), both above its "
        "resident set before the model was built (libraries, the CUDA context).",
        "",
        "| row | outcome | loss rel vs compile | reserved peak GiB pred / meas (err) | "
        "allocated peak GiB pred / meas | allocator retries | "
        "step s pred / meas (err) | tokens/s | first step s (Inductor cache) | "
        "host GiB: plan's buffers / resident after the steps / peak resident (err) | plan | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        plan = r.get("plan")
        plan_s = (
            f"{plan['chunks']} x {plan['chunk_size'] / 2**20:.0f} MiB, "
            f"persist {plan['n_persist']}, buffer {plan['n_buffer']}, "
            f"swap {plan['n_swap']}, ckpt {plan['n_checkpoint']}"
            + (f", device steps {plan['device_steps']:.2f}" if plan.get("device_steps") else "")
            if plan
            else ("gradient checkpointing" if r.get("gradient_checkpointing") else "")
        )
        lines_of_error = (r.get("error") or "").strip().splitlines()
        err = [x for x in lines_of_error if "Error" in x or "NoPlanFits" in x][-1:] or [""]
        base = r.get("rss_base_gib")
        host_s = (
            " / ".join(
                [
                    f"{r['predicted_host_gib']:.2f}"
                    if r.get("predicted_host_gib") is not None
                    else "-"
                ]
                + [f"{r[k] - base:.2f}" for k in ("rss_steps_gib", "peak_rss_gib")]
            )
            if base is not None and r.get("peak_rss_gib") is not None
            else "-"
        )
        if host_s != "-" and r.get("predicted_host_gib"):
            pred = r["predicted_host_gib"]
            host_s += f" ({(r['peak_rss_gib'] - base - pred) / pred:+.1%})"
        clk = r.get("clocks") or {}
        if not err[0] and "profiling" in clk and "steps" in clk:
            err = [
                f"SM clock profiled {clk['profiling']['sm_mhz_mean']} MHz, steps "
                f"{clk['steps']['sm_mhz_mean']} MHz ({clk['steps']['watts_mean']:.0f} W)"
            ]
        if not err[0] and r.get("compute_observed"):
            err = [
                "busy steps' compute slowdowns so far " + ", ".join(map(str, r["compute_observed"]))
            ]
        elif r.get("compute_observed"):
            err = [
                err[0] + "; compute slowdowns so far " + ", ".join(map(str, r["compute_observed"]))
            ]
        rel = r.get("max_loss_rel_vs_compile")
        pa, ma = r.get("predicted_peak_allocated_gib"), r.get("peak_allocated_gib")
        alloc_s = f"{pa:.2f} / {ma:.2f}" if pa and ma else (f"{ma:.2f}" if ma else "-")

        def pe(p, m, e, fmt):
            if r.get(m) is None:
                return "-"
            if r.get(p) is None:
                return fmt.format(r[m])
            return f"{fmt.format(r[p])} / {fmt.format(r[m])} ({r[e] * 100:+.1f}%)"

        lines.append(
            f"| {r['id']} | {r.get('outcome', '-')} | {'-' if rel is None else f'{rel:.1e}'} | "
            f"{pe('predicted_peak_reserved_gib', 'peak_reserved_gib', 'peak_err', '{:.2f}')} | "
            f"{alloc_s} | {r.get('alloc_retries', '-')}{_trims(r)} | "
            f"{pe('predicted_step_s', 'measured_step_s', 'time_err', '{:.3f}')} | "
            f"{r.get('tokens_per_s') and round(r['tokens_per_s']) or '-'} | "
            f"{r.get('first_step_s', '-')} ({r.get('inductor_cache', '-')}) | {host_s} | "
            f"{plan_s} | "
            f"{err[0][:240]} |"
        )
    return "\n".join(lines) + "\n"


def write(path: str, rows: list[dict], meta: dict) -> None:
    out = dict(meta, counts=evaluate(rows), rows=rows)
    with open(path + ".json", "w") as f:
        json.dump(out, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(table(out))


def selected(grid: list[dict], have: set, only: list[str], models: list[str]) -> list[dict]:
    """The rows to run, in order: those ``only`` names (in its order), else those of ``models``
    (in its order), else the grid; never one ``have`` holds. Issue 25's host-scale rows run when
    ``only`` or ``models`` names them, the peers' rows only when ``only`` does. A row id ``only``
    names that the grid lacks is an error (run 97 asked for a cap the grid has not and ran nothing
    of it, saying nothing)."""
    ids = {r["id"] for r in grid}
    if unknown := [x for x in only if x not in ids]:
        raise SystemExit(f"oom_sweep: no such row: {', '.join(unknown)} (see the grid's ids)")
    todo = [
        r
        for r in grid
        if r["id"] not in have
        and (not only or r["id"] in only)
        and (not models or r["model"] in models)
        and (only or models or not r.get("host_scale"))
        and (only or not r.get("peer"))
    ]
    if only:
        todo.sort(key=lambda r: only.index(r["id"]))
    elif models:
        todo.sort(key=lambda r: models.index(r["model"]))
    return todo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds for the whole call")
    ap.add_argument("--resume", help="an earlier OUT.json: keep its rows, run the rest")
    ap.add_argument("--only", default="", help="comma-separated row ids")
    ap.add_argument(
        "--models", default="", help="comma-separated models, in the order to run (default: all)"
    )
    ap.add_argument("--merge", nargs="+")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument(
        "--memory-history",
        default="",
        help="comma-separated row ids whose steps 4-6 record the allocator's history (summarized)",
    )
    ap.add_argument(
        "--trace",
        default="",
        help="comma-separated row ids that trace one more step after theirs (torch.profiler, "
        "summarized by trace_summary.py into the row: compute busy and idle, the longest gaps)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:KEY=VALUE[,KEY=VALUE]: each selected row also runs with that environment, as "
        "row id + /NAME (an A/B of one setting in one call)",
    )
    ap.add_argument("--run")
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.run:
        out = run_row(json.loads(args.run), args.steps)
        with open(args.result, "w") as f:
            json.dump(out, f)
        return
    grid = rows_of_grid()
    if args.list:
        print("\n".join(r["id"] for r in grid))
        return
    meta = {"date": time.strftime("%Y-%m-%d"), "device": "merged", "torch": "-"}
    done: list[dict] = []
    for path in (args.merge or []) + ([args.resume] if args.resume else []):
        with open(path) as f:
            old = json.load(f)
        meta.update({k: old[k] for k in ("device", "torch") if k in old})
        # a row cut by a deadline does not replace a measurement of it
        rows = [
            x
            for x in old["rows"]
            if x.get("outcome") != "timeout" or x["id"] not in {r["id"] for r in done}
        ]
        done = [r for r in done if r["id"] not in {x["id"] for x in rows}] + rows
    if args.merge:
        write(args.out, done, meta)
        print(table(dict(meta, counts=evaluate(done), rows=done)))
        return
    import torch

    meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    keep = [r for r in done if r.get("outcome") != "timeout"]
    have = {r["id"] for r in keep}
    only = [x for x in args.only.split(",") if x]  # also the order the rows run in
    models = [x for x in args.models.split(",") if x]  # also the order the rows run in
    todo = selected(grid, have, only, models)
    for spec in args.variant:
        name, _, assigns = spec.partition(":")
        # a comma starts the next assignment only before NAME= (a JSON value keeps its commas)
        env = dict(a.split("=", 1) for a in re.split(r",(?=[A-Z_][A-Z0-9_]*=)", assigns) if a)
        todo = [
            x
            for r in todo
            for x in (
                [r]
                if r["system"] != "protrain" or "env" in r or f"{r['id']}/{name}" in have
                else [r, dict(r, id=f"{r['id']}/{name}", env=env)]
            )
        ]
    # a cap over what the card has (the grid's 80 GiB rows on an 80 GB H100) is not a row here
    total = torch.cuda.get_device_properties(0).total_memory
    over = [r["id"] for r in todo if (r.get("cap_gib") or 0) * 2**30 > total]
    if over:
        print(f"skipped, their cap over the card's {total / 2**30:.1f} GiB: {', '.join(over)}")
        todo = [r for r in todo if r["id"] not in over]
    for r in todo:
        if r["id"] in args.memory_history.split(","):
            r["memory_history"] = True
        if r["id"] in args.trace.split(","):
            r["trace"] = True
    t_end = time.perf_counter() + args.deadline
    root = tempfile.mkdtemp(prefix="oom_sweep-")
    dirs = {
        "root": root,
        "inductor": os.path.join(root, "inductor"),
        "hardware": os.path.join(root, "hw"),
    }
    os.makedirs(dirs["inductor"])
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from protrain_fx.machine import measure; "
            "measure.hardware_profile(torch.device('cuda'))",
        ],
        env=dict(os.environ, PROTRAIN_CACHE_DIR=dirs["hardware"]),
        check=True,
        cwd=ROOT,
    )
    for base, _, files in os.walk(dirs["hardware"]):
        for name in files:
            if name.endswith(".json"):
                with open(os.path.join(base, name)) as f:
                    meta["hardware_profile"] = json.load(f)
    rows = list(keep)
    for row in todo:
        left = t_end - time.perf_counter()
        if left < 60:
            break
        r = child(row, args, dirs, left)
        rows.append(r)
        print(
            json.dumps({k: v for k, v in r.items() if k not in ("summary", "notes", "error")})[
                :1500
            ],
            flush=True,
        )
        if r.get("error"):
            print(r["error"][-800:], flush=True)
        write(args.out, rows, meta)
    write(args.out, rows, meta)
    print(table(dict(meta, counts=evaluate(rows), rows=rows)))


if __name__ == "__main__":
    main()
