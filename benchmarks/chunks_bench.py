"""Chunk-based model states on the GPU: parity, throughput against FSDP2 CPU offload, and where the
time goes.

    python benchmarks/chunks_bench.py all --cap 24 --batch 8 --persist 4,5 --with-parity
    # CUDA parity with offloaded chunks
    python benchmarks/chunks_bench.py parity --out parity.json
    # one run, prints RESULT {json}
    python benchmarks/chunks_bench.py protrain --cap 24 --batch 8 --budget 24
    python benchmarks/chunks_bench.py fsdp2 --cap 24 --batch 8

``all`` runs every system in its own subprocess, in one invocation (compiling side by side, timed
one at a time: benchmarks/timeshare.py), and writes ``<out>.json`` and ``<out>.md``. The model is
examples/models.GPT configured like ../shared/ANCHORS.md's GPT (d 2048, 24 layers, 16 heads, vocab
50304, untied head: 1.42 B parameters), batch x 1024 tokens, bf16 autocast, AdamW.

A protrain run measures, per step, with CUDA events around forward and backward and host timers
around ``opt.step()``:
  phase "alone"   CPU steps deferred to opt.step() (no overlap): forward, backward and the CPU
  optimizer (the
                  deferred steps) each measured without the others running;
  phase "overlap" the normal mode (each offloaded chunk's CPU step runs inside backward): the step
  time, and
                  how long opt.step() still waited for the CPU worker (the part not hidden behind
                  backward).
Host-to-device and device-to-host copy times of one step's chunk traffic are measured alone
afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timeshare  # noqa: E402

timeshare.start_busy()  # a child of a side-by-side run: hold the lock shared until its timed part

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from models import GPT, GPTConfig, build  # noqa: E402

SEQ = 1024
ANCHOR = dict(
    n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=SEQ, tie_embeddings=False
)


def cap_memory(cap_gib: float) -> None:
    if cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)


def anchor_config(args) -> dict:
    return {**ANCHOR, "n_layer": args.layers, "n_embd": args.width, "n_head": args.width // 128}


def batch(args, vocab):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (args.batch, SEQ), generator=g).cuda()
    return x, torch.randint(0, vocab, (args.batch, SEQ), generator=g).cuda()


# --------------------------------------------------------------------------------------- protrain
def run_protrain(args) -> dict:
    import protrain_fx
    from protrain_fx.machine import cpu_adam
    from protrain_fx.runtime import chunk_store, hybrid_optim

    cap_memory(args.cap)
    cfg = anchor_config(args)
    torch.manual_seed(0)
    with protrain_fx.host_init("cuda"):  # the fp32 model never has to fit on the device
        model = GPT(GPTConfig(**cfg))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    options = {"optimizer": opt, "n_buffer": args.n_buffer}
    if args.n_persist is not None:
        options["n_persist"] = args.n_persist
    if args.budget:
        options["memory_budget"] = f"{args.budget}GiB"
    compiled = torch.compile(model, backend="protrain", options=options)
    x, y = batch(args, cfg["vocab_size"])

    def step(timing: dict | None):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        t0 = time.perf_counter()
        ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, y)
        ev[1].record()
        loss.backward()
        ev[2].record()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if timing is not None:
            timing.setdefault("fwd_ms", []).append(ev[0].elapsed_time(ev[1]))
            timing.setdefault("bwd_ms", []).append(ev[1].elapsed_time(ev[2]))
            timing.setdefault("step_call_ms", []).append((t2 - t1) * 1e3)
            timing.setdefault("step_ms", []).append((t3 - t0) * 1e3)
        return loss

    t_compile = time.perf_counter()
    step(None)  # compiles; the first optimizer step is always deferred (it learns the step pattern)
    t_compile = time.perf_counter() - t_compile
    step(None)
    h = hybrid_optim.handle_of(opt)
    store = chunk_store.store_of(next(model.parameters()))
    if h is None:
        raise RuntimeError(
            f"nothing was offloaded (n_persist {store.n_persist} of "
            f"{store.n_chunks} chunks): "
            "no CPU optimizer to measure; lower the cap or n_persist"
        )
    res = {
        "system": "protrain",
        "params": n_params,
        "cap_gib": args.cap,
        "batch": args.batch,
        "seq": SEQ,
        "n_persist": store.n_persist,
        "n_chunks": store.n_chunks,
        "n_buffer": store.n_buffer,
        "chunk_size": store.layout.chunk_size,
        "first_step_s": t_compile,
        "cpu_adam": "one-pass kernel"
        if cpu_adam.available()
        else f"torch fused + copy ({cpu_adam.build_error()})",
        "async_step": hybrid_optim.handle_of(opt).async_step
        if hybrid_optim.handle_of(opt)
        else None,
    }
    with timeshare.measuring():
        phases = measure_phases(args, step, h, store)
        transfers = transfer_alone(store, phases["overlap"])
    res["phases"] = phases
    o = phases["overlap"]
    res["tokens_per_s"] = args.batch * SEQ / (o["step_ms"] / 1e3)
    res["peak_gib"] = max(phases["alone"]["peak_gib"], o["peak_gib"])
    res["peak_reserved_gib"] = max(phases["alone"]["peak_reserved_gib"], o["peak_reserved_gib"])
    derive(res)
    res.update(transfers)
    return res


def measure_phases(args, step, h, store) -> dict:
    from protrain_fx.runtime import hybrid_optim

    phases = {}
    for phase, overlap in (("alone", False), ("overlap", True)):
        h.overlap = overlap
        step(None)  # settle into the mode
        h.timers = hybrid_optim.Timers()
        stats0 = dict(store.stats)
        torch.cuda.reset_peak_memory_stats()
        timing: dict = {}
        for _ in range(args.steps):
            loss = step(timing)
        t = h.timers
        n = args.steps
        med = {k: sorted(v)[len(v) // 2] for k, v in timing.items()}
        med.update(
            cpu_optim_deferred_ms=t.deferred_step_s / n * 1e3,
            cpu_worker_busy_ms=t.worker_busy_s / n * 1e3,
            cpu_worker_step_ms=t.worker_step_s / n * 1e3,
            one_pass_steps=t.one_pass_steps / n,
            async_steps=t.async_steps / n,
            forward_wait_ms=t.forward_wait_s / n * 1e3,
            whole_chunk_steps=t.whole_chunk_steps / n,
            step_wait_ms=t.step_wait_s / n * 1e3,
            in_backward_steps=t.in_backward_steps / n,
            h2d_bytes_per_step={
                k: (store.stats[k] - stats0[k]) / n
                for k in ("h2d_bytes", "h2d_copies", "slot_hits")
            },
            d2h_bytes_per_step=(store.stats["d2h_bytes"] - stats0["d2h_bytes"]) / n,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            loss=float(loss),
        )
        phases[phase] = med
    return phases


def transfer_alone(store, overlap_phase) -> dict:
    """Time this step's host-to-device and device-to-host chunk traffic with nothing else
    running."""
    torch.cuda.synchronize()
    offloaded = store.offloaded_chunks
    if not offloaded:
        return {"h2d_ms_alone": 0.0, "d2h_ms_alone": 0.0}
    n = max(store.chunk_numel(c) for c in offloaded)
    dev = torch.empty(n, dtype=store.param_dtype, device="cuda")
    host = torch.empty(n, dtype=store.param_dtype, pin_memory=True)
    src = store.transfer[offloaded[0]]

    def timed(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / reps

    h2d_ms = timed(lambda: dev[: src.numel()].copy_(src, non_blocking=True))
    d2h_ms = timed(lambda: host.copy_(dev, non_blocking=True))
    h2d_gbs = src.numel() * src.element_size() / h2d_ms / 1e6
    d2h_gbs = n * dev.element_size() / d2h_ms / 1e6
    h2d_bytes = overlap_phase["h2d_bytes_per_step"]["h2d_bytes"]
    d2h_bytes = overlap_phase["d2h_bytes_per_step"]
    return {
        "h2d_gb_s": h2d_gbs,
        "d2h_gb_s": d2h_gbs,
        "h2d_ms_alone": h2d_bytes / h2d_gbs / 1e6,
        "d2h_ms_alone": d2h_bytes / d2h_gbs / 1e6,
    }


# ------------------------------------------------------------------------------------------ fsdp2
def run_fsdp2(args) -> dict:
    """FSDP2 CPUOffloadPolicy with fused CPU AdamW, set up as the benchmark suite does
    (peers.fsdp2_offload)."""
    import peers
    import torch.distributed as dist

    cap_memory(args.cap)
    cfg = anchor_config(args)
    x, y = batch(args, cfg["vocab_size"])
    spec = {
        "kind": "gpt",
        "cfg": cfg,
        "device": "cuda",
        "batch": args.batch,
        "seq": SEQ,
        "cap_gib": args.cap,
    }
    step, n_params, _ = peers.fsdp2_offload(spec, x, y)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with timeshare.measuring():
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    dist.destroy_process_group()
    return {
        "system": "fsdp2_cpu_offload",
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "params": n_params,
        "cap_gib": args.cap,
        "batch": args.batch,
        "seq": SEQ,
        "step_ms": dt * 1e3,
        "tokens_per_s": args.batch * SEQ / dt,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "loss": float(loss),
    }


# ----------------------------------------------------------------------------------------- parity
def run_parity(args) -> dict:
    from protrain_fx.testing import compare_with_eager, random_batches

    rows = []
    for kind in ("gpt", "llama"):
        for dtype in (torch.float32, torch.bfloat16):
            for n_persist in (0, 2):
                torch._dynamo.reset()
                torch.manual_seed(0)
                if kind == "gpt":
                    base = build(
                        "gpt", n_layer=4, n_embd=512, n_head=8, block_size=256, vocab_size=4096
                    ).cuda()
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
                    ).cuda()
                data = random_batches(5, 8, 256, vocab=4096, device="cuda")
                kw = {"lr": 1e-3, "autocast_dtype": None if dtype == torch.float32 else dtype}
                r = compare_with_eager(
                    base,
                    data,
                    {"n_persist": n_persist, "chunk_size": "8MiB"},
                    give_optimizer=True,
                    **kw,
                )
                row = {
                    "model": kind,
                    "dtype": str(dtype).replace("torch.", ""),
                    "n_persist": n_persist,
                    "n_chunks": len(r.plan.chunks),
                    "max_loss_rel": r.max_loss_rel,
                    "max_param_abs": r.max_param_abs,
                    "max_param_update": r.max_param_update,
                    "losses": r.losses,
                    "ref_losses": r.ref_losses,
                }
                rows.append(row)
                print(
                    f"parity {kind:5s} {row['dtype']:8s} n_persist={n_persist} "
                    f"chunks={row['n_chunks']} "
                    f"loss rel {r.max_loss_rel:.2e} param abs {r.max_param_abs:.2e}",
                    flush=True,
                )
    return {"system": "parity", "rows": rows}


# ------------------------------------------------------------------------------------------- all
def run_all(args) -> dict:
    """Every system in its own subprocess, all started together (they compile side by side) and
    timed one at a time (benchmarks/timeshare.py)."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
    )
    common = [
        "--cap",
        str(args.cap),
        "--batch",
        str(args.batch),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--steps",
        str(args.steps),
        "--n-buffer",
        str(args.n_buffer),
    ]
    runs = [["parity"]] if args.with_parity else []
    # "5", or with a variant for comparison: "5/torch" (torch's fused CPU Adam + a
    for spec in args.persist:
        # copy instead of the one-pass kernel), "5/sync" (opt.step() waits for every CPU step)
        spec, _, variant = spec.partition("/")
        extra = ["--variant", variant] if variant else []
        # the planner's choice; a few GiB kept back for transients it does not model yet
        if spec == "budget":
            runs.append(
                ["protrain", *common, *extra, "--budget", str(max(1.0, args.cap - args.reserve))]
            )
        else:
            runs.append(["protrain", *common, *extra, "--n-persist", spec])
    t0 = time.perf_counter()
    done = timeshare.run_together(
        [[sys.executable, __file__, *argv] for argv in runs], env, args.timeout
    )
    # FSDP2 runs alone afterwards (nothing else alive on the machine), with the default CUDA
    # allocator and with expandable segments; the table shows both
    for conf in args.fsdp2_allocs.split(","):
        conf = "" if conf == "default" else conf
        runs.append(["fsdp2", *common])
        e = dict(env, PYTORCH_CUDA_ALLOC_CONF=conf)
        done += timeshare.run_together([[sys.executable, __file__, *runs[-1]]], e, args.timeout)
    wall = time.perf_counter() - t0
    results = []
    for argv, (code, so, se) in zip(runs, done):
        line = next((l for l in so.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            res = {"system": argv[0], "argv": argv, "error": f"exit {code}: " + (se or so)[-1500:]}
        else:
            res = json.loads(line[len("RESULT ") :])
        res["argv"] = argv
        results.append(res)
        print(summary_line(res), flush=True)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "argv": sys.argv[1:],
        "wall_s": wall,
        "results": results,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(out))
    return out


def derive(r: dict) -> dict:
    """The derived columns of a protrain row, from its measured phases."""
    a, o = r["phases"]["alone"], r["phases"]["overlap"]
    cpu_alone = a["cpu_optim_deferred_ms"]
    r["overlap_bound_ms"] = a["fwd_ms"] + max(a["bwd_ms"], cpu_alone)
    r["overlap_ratio"] = o["step_ms"] / r["overlap_bound_ms"]
    # what overlapping saved: the same step with the CPU optimizer deferred minus the overlapped
    # one, as a share of what could be hidden at most (the shorter of backward and the CPU
    # optimizer)
    r["cpu_optim_hidden_ms"] = a["step_ms"] - o["step_ms"]
    hideable = min(a["bwd_ms"], cpu_alone)
    r["cpu_optim_hidden_fraction"] = (
        max(0.0, r["cpu_optim_hidden_ms"] / hideable) if hideable else None
    )
    return r


def summary_line(r: dict) -> str:
    if "error" in r:
        return f"{r.get('system')}: ERROR {r['error'][-300:]}"
    if r.get("system") == "parity":
        return "parity: " + ", ".join(
            f"{x['model']}/{x['dtype']}/p{x['n_persist']}: {x['max_loss_rel']:.1e}"
            for x in r["rows"]
        )
    return f"{r['system']}: {r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_gib']:.1f} GiB" + (
        f", n_persist {r['n_persist']}/{r['n_chunks']}, overlap ratio {r['overlap_ratio']:.2f}"
        if "overlap_ratio" in r
        else ""
    )


def markdown(out: dict) -> str:
    lines = [
        f"# Chunk-based model states on {out['device']} (torch {out['torch']}, {out['date']})",
        "",
        f"Command: `python benchmarks/chunks_bench.py {' '.join(out['argv'])}`",
        "",
    ]
    rows = [r for r in out["results"] if r.get("system") not in ("parity",)]
    lines += [
        "| system | params | cap GiB | batch | n_persist / chunks | tokens/s | step ms | "
        "peak GiB | peak reserved GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['system']} | | | | | error: "
                f"{r['error'][:120].replace('|', '/').replace(chr(10), ' ')} | | | |"
            )
            continue
        step = r["phases"]["overlap"]["step_ms"] if "phases" in r else r["step_ms"]
        persist = f"{r['n_persist']} / {r['n_chunks']}" if "n_persist" in r else "-"
        system = r["system"] + (f" ({r['alloc_conf']})" if r.get("alloc_conf") else "")
        lines.append(
            f"| {system} | {r['params'] / 1e9:.2f} B | {r['cap_gib']} | {r['batch']} | "
            f"{persist} | "
            f"{r['tokens_per_s']:,.0f} | {step:.0f} | {r['peak_gib']:.1f} | "
            f"{r.get('peak_reserved_gib', 0):.1f} |"
        )
    pt = [r for r in rows if r.get("system") == "protrain" and "phases" in r]
    if pt:
        lines += [
            "",
            "Per step (medians; ms). alone = CPU optimizer deferred to opt.step(); "
            "overlap = normal mode.",
            "",
            "| n_persist | CPU Adam | fwd alone | bwd alone | CPU optim alone | "
            "fwd+max(bwd,CPU) | step (overlap) | ratio | "
            "step (deferred) | hidden ms | hidden / min(bwd,CPU) | H2D alone | D2H alone |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in pt:
            a, o = r["phases"]["alone"], r["phases"]["overlap"]
            adam = "one pass" if r.get("cpu_adam", "").startswith("one-pass") else "torch + copy"
            adam += "" if r.get("async_step", False) else ", sync step"
            lines.append(
                f"| {r['n_persist']} | {adam} | {a['fwd_ms']:.0f} | {a['bwd_ms']:.0f} | "
                f"{a['cpu_optim_deferred_ms']:.0f} | "
                f"{r['overlap_bound_ms']:.0f} | {o['step_ms']:.0f} | "
                f"{r['overlap_ratio']:.2f} | "
                f"{a['step_ms']:.0f} | {r['cpu_optim_hidden_ms']:.0f} | "
                f"{100 * (r['cpu_optim_hidden_fraction'] or 0):.0f}% | "
                f"{r['h2d_ms_alone']:.0f} | {r['d2h_ms_alone']:.0f} |"
            )
    par = next((r for r in out["results"] if r.get("system") == "parity" and "rows" in r), None)
    if par:
        lines += [
            "",
            "CUDA parity with offloaded chunks (5 AdamW steps, 4 blocks of width 512, vocab 4096):",
            "",
            "| model | dtype | n_persist / chunks | max loss rel | max param abs | max eager "
            "update |",
            "|---|---|---|---|---|---|",
        ]
        for x in par["rows"]:
            lines.append(
                f"| {x['model']} | {x['dtype']} | {x['n_persist']} / {x['n_chunks']} | "
                f"{x['max_loss_rel']:.2e} | "
                f"{x['max_param_abs']:.2e} | {x['max_param_update']:.2e} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("mode", choices=("all", "protrain", "fsdp2", "parity", "rederive"))
    ap.add_argument("--cap", type=float, default=24.0, help="GiB; 0 = uncapped")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--n-persist", type=int, default=None)
    ap.add_argument("--n-buffer", type=int, default=2)
    ap.add_argument(
        "--budget", type=float, default=0.0, help="memory_budget in GiB (chooses n_persist)"
    )
    ap.add_argument(
        "--persist", default="budget", help="for 'all': comma list of n_persist values or 'budget'"
    )
    ap.add_argument("--with-parity", action="store_true")
    ap.add_argument(
        "--variant",
        default="",
        help="'torch': torch's fused CPU Adam + a copy "
        "instead of the one-pass "
        "kernel; 'sync': opt.step() waits for every CPU step",
    )
    ap.add_argument(
        "--fsdp2-allocs",
        default="default,expandable_segments:True",
        help="for 'all': FSDP2 runs, one per PYTORCH_CUDA_ALLOC_CONF ('default': unset)",
    )
    ap.add_argument(
        "--reserve",
        type=float,
        default=3.0,
        help="GiB kept out of the budget for untracked transients",
    )
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "chunks_h200"))
    args = ap.parse_args()
    if args.mode == "all":
        args.persist = args.persist.split(",")
        run_all(args)
        return
    if args.mode == "rederive":  # recompute derived columns and the table of an existing <out>.json
        with open(args.out + ".json") as f:
            out = json.load(f)
        for r in out["results"]:
            if r.get("system") == "protrain" and "phases" in r:
                derive(r)
        with open(args.out + ".json", "w") as f:
            json.dump(out, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(out))
        return
    if args.variant == "torch":
        os.environ["PROTRAIN_CPU_ADAM"] = "torch"
    elif args.variant == "sync":
        os.environ["PROTRAIN_ASYNC_STEP"] = "0"
    elif args.variant:
        raise SystemExit(f"unknown variant {args.variant!r}")
    try:
        res = {"protrain": run_protrain, "fsdp2": run_fsdp2, "parity": run_parity}[args.mode](args)
    except Exception as e:  # the row shows the error instead of going missing
        import traceback

        traceback.print_exc()
        res = {"system": args.mode, "error": timeshare.error_text(e)}
    if args.mode == "parity" and args.out.endswith(".json"):
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
