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
gradient checkpointing (the same arithmetic).

Per row: the losses (against the reference: within bf16 tolerance?), predicted and measured reserved
peak (the measured one is the process's ``max_memory_reserved``, profiling included), predicted and
measured step time (the median of the steps after the third, synchronized), time to the first step,
and the plan. All rows share one Inductor cache directory, so a row whose graphs another row
compiled before finds them (its ``inductor_cache`` says which); the plan cache is per row (a plan
from another allocator setting is never reused).

    python benchmarks/oom_sweep.py --out $OUT/oom_sweep --deadline 560 [--resume OLD.json]
        [--only ROW_ID,...] [--models llama3.2-1b,...]

writes ``OUT.json`` and ``OUT.md`` after every row, so a call cut by its time limit keeps what ran;
``--resume`` runs only the rows an earlier JSON lacks (rows that timed out run again);
``--merge A.json B.json`` joins runs. ``--list`` prints the row ids.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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
}
# (model, batch, seq, caps where the model needs offloading there)
GRID = [
    ("llama3.2-1b", 4, 1024, (16, 24)),
    ("llama3.2-1b", 8, 2048, (16, 24, 40)),
    ("llama3.2-3b", 4, 1024, (16, 24, 40)),
    ("llama3.2-3b", 1, 4096, (16, 24)),
    ("llama3.1-8b", 4, 1024, (24, 40, 80)),
    ("mistral-7b", 2, 2048, (24, 40, 80)),
]
ALLOCS = {"default": None, "expandable": "expandable_segments:True"}
BF16_REL = 2**-6  # two bf16 runs that differ by rounding: a few bf16 ulps of the loss
STEPS = 20


def rows_of_grid() -> list[dict]:
    rows = []
    for model, batch, seq, caps in GRID:
        shape = f"{model}/b{batch}s{seq}"
        rows.append(
            dict(id=f"{shape}/compile", model=model, batch=batch, seq=seq, system="compile")
        )
        for cap in caps:
            for alloc in ALLOCS:
                rows.append(
                    dict(
                        id=f"{shape}/cap{cap}/{alloc}",
                        model=model,
                        batch=batch,
                        seq=seq,
                        system="protrain",
                        cap_gib=cap,
                        alloc=alloc,
                    )
                )
    return rows


def build(spec: dict, seq: int, checkpointing: bool = False):
    """The model on the host (seed 0): the same weights for every system."""
    import torch
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
    torch.manual_seed(0)
    model = cls[1](cfg)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def run_row(row: dict, steps: int) -> dict:
    """One row in this process."""
    import torch

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    spec = MODELS[row["model"]]
    out = {"steps_asked": steps}
    if row["system"] == "protrain":
        import protrain_fx
        import protrain_fx.backend

        torch.cuda.set_per_process_memory_fraction(
            row["cap_gib"] * 2**30 / torch.cuda.get_device_properties(dev).total_memory
        )
        if "protrain" not in torch._dynamo.list_backends(exclude_tags=()):
            torch._dynamo.register_backend(protrain_fx.backend.protrain_backend, name="protrain")
        with protrain_fx.host_init("cuda"):
            model = build(spec, row["seq"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        compiled = torch.compile(model, backend="protrain", options={"optimizer": opt})
    else:
        n = sum(p.numel() for p in build_meta(spec, row["seq"]).parameters())
        # fp32 weights, gradients and two moments: 16 B a parameter, plus activations
        checkpointing = n * 16 > 0.6 * torch.cuda.get_device_properties(dev).total_memory
        out["gradient_checkpointing"] = checkpointing
        model = build(spec, row["seq"], checkpointing).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        compiled = torch.compile(model)
    out["build_s"] = round(time.perf_counter() - t0, 2)
    g = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, spec["vocab"], (row["batch"], row["seq"]), generator=g)
        for _ in range(steps)
    ]
    losses, times = [], []
    for i, x in enumerate(data):
        ts = time.perf_counter()
        x = x.to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - ts)
        if i == 0:
            out["first_step_s"] = round(time.perf_counter() - t0, 2)
            out["first_step_peak_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30
            torch.cuda.reset_peak_memory_stats(dev)
        print(f"step {i}: loss {losses[-1]:.4f} ({times[-1]:.3f} s)", file=sys.stderr, flush=True)
    steady = times[3:] or times[1:]
    out.update(
        losses=losses,
        measured_step_s=statistics.median(steady),
        tokens_per_s=row["batch"] * row["seq"] / statistics.median(steady),
        steady_peak_reserved_gib=torch.cuda.max_memory_reserved(dev) / 2**30,
        steady_peak_allocated_gib=torch.cuda.max_memory_allocated(dev) / 2**30,
    )
    out["peak_reserved_gib"] = max(
        out["first_step_peak_reserved_gib"], out["steady_peak_reserved_gib"]
    )
    if row["system"] == "protrain":
        plan = protrain_fx.get_plan(compiled)
        d = plan.to_dict()
        pred = plan.predicted or {}
        out["plan"] = {
            k: d[k] for k in ("chunk_size", "n_persist", "n_buffer", "n_swap", "n_checkpoint")
        }
        out["plan"]["chunks"] = len(d["chunks"])
        out["predicted_peak_reserved_gib"] = pred.get("peak_bytes", 0) / 2**30 or None
        out["predicted_step_s"] = pred.get("iter_s")
        out["plan_from_cache"] = pred.get("from_cache")
        out["notes"] = list(plan.notes)
        out["summary"] = plan.summary()
    return out


def build_meta(spec, seq):
    import torch

    with torch.device("meta"):
        return build(spec, seq)


def child(row: dict, args, dirs: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if ALLOCS.get(row.get("alloc")):
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCS[row["alloc"]]
    env["TORCHINDUCTOR_CACHE_DIR"] = dirs["inductor"]
    # a plan cache of its own; the hardware profile measured once, copied in
    env["PROTRAIN_CACHE_DIR"] = os.path.join(dirs["root"], row["id"].replace("/", "-"))
    shutil.copytree(dirs["hardware"], env["PROTRAIN_CACHE_DIR"])
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


def evaluate(rows: list[dict]) -> dict:
    """Each row against its reference, and the counts the issue asks for."""
    refs = {(r["model"], r["batch"], r["seq"]): r for r in rows if r["system"] == "compile"}
    for r in rows:
        if r["system"] != "protrain" or not r.get("losses"):
            continue
        r["finite"] = all(x == x and abs(x) != float("inf") for x in r["losses"])
        ref = refs.get((r["model"], r["batch"], r["seq"]))
        if ref and ref.get("losses"):
            rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])]
            r["max_loss_rel_vs_compile"] = max(rel) if r["finite"] else float("nan")
            r["within_bf16_tolerance"] = r["finite"] and max(rel) <= BF16_REL
        if r.get("predicted_peak_reserved_gib"):
            p, m = r["predicted_peak_reserved_gib"], r["peak_reserved_gib"]
            r["peak_err"] = (m - p) / p
        if r.get("predicted_step_s"):
            p, m = r["predicted_step_s"], r["measured_step_s"]
            r["time_err"] = (m - p) / p
    pt = [r for r in rows if r["system"] == "protrain"]
    return {
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
    lines = [
        f"# Never out of memory: Hugging Face models under caps ({out['device']}, torch "
        f"{out['torch']}, {out['date']})",
        "",
        f"{c['protrain_rows']} protrain rows: {c['trained']} trained {STEPS} steps, "
        f"{c['no_plan_fits']} stopped with NoPlanFits, {c['oom']} out of memory, "
        f"{c['error']} other errors or timeouts; {c['non_finite']} with non-finite losses, "
        f"{c['outside_bf16_tolerance']} outside bf16 tolerance of torch.compile "
        f"({BF16_REL:.4f} relative per step), {c['peak_err_over_5pct']} with the reserved peak "
        f"more than 5% off the prediction, {c['time_err_over_5pct']} with the step time more than "
        "5% off.",
        "",
        "Peaks: the process's `max_memory_reserved` (profiling and the first step included). Step "
        "time: median of steps 4-20, synchronized. Errors: (measured - predicted) / predicted.",
        "",
        "| row | outcome | loss rel vs compile | reserved peak GiB pred / meas (err) | "
        "step s pred / meas (err) | tokens/s | first step s (Inductor cache) | plan | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        plan = r.get("plan")
        plan_s = (
            f"{plan['chunks']} x {plan['chunk_size'] / 2**20:.0f} MiB, "
            f"persist {plan['n_persist']}, buffer {plan['n_buffer']}, "
            f"swap {plan['n_swap']}, ckpt {plan['n_checkpoint']}"
            if plan
            else ("gradient checkpointing" if r.get("gradient_checkpointing") else "")
        )
        err = (r.get("error") or "").strip().splitlines()[-1:] or [""]
        rel = r.get("max_loss_rel_vs_compile")

        def pe(p, m, e, fmt):
            if r.get(m) is None:
                return "-"
            if r.get(p) is None:
                return fmt.format(r[m])
            return f"{fmt.format(r[p])} / {fmt.format(r[m])} ({r[e] * 100:+.1f}%)"

        lines.append(
            f"| {r['id']} | {r.get('outcome', '-')} | {'-' if rel is None else f'{rel:.1e}'} | "
            f"{pe('predicted_peak_reserved_gib', 'peak_reserved_gib', 'peak_err', '{:.2f}')} | "
            f"{pe('predicted_step_s', 'measured_step_s', 'time_err', '{:.3f}')} | "
            f"{r.get('tokens_per_s') and round(r['tokens_per_s']) or '-'} | "
            f"{r.get('first_step_s', '-')} ({r.get('inductor_cache', '-')}) | {plan_s} | "
            f"{err[0][:160]} |"
        )
    return "\n".join(lines) + "\n"


def write(path: str, rows: list[dict], meta: dict) -> None:
    out = dict(meta, counts=evaluate(rows), rows=rows)
    with open(path + ".json", "w") as f:
        json.dump(out, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(table(out))


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
        done = [r for r in done if r["id"] not in {x["id"] for x in old["rows"]}] + old["rows"]
    if args.merge:
        write(args.out, done, meta)
        print(table(dict(meta, counts=evaluate(done), rows=done)))
        return
    import torch

    meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    keep = [r for r in done if r.get("outcome") != "timeout"]
    have = {r["id"] for r in keep}
    only = {x for x in args.only.split(",") if x}
    models = [x for x in args.models.split(",") if x]  # also the order the rows run in
    todo = [
        r
        for r in grid
        if r["id"] not in have
        and (not only or r["id"] in only)
        and (not models or r["model"] in models)
    ]
    if models:
        todo.sort(key=lambda r: models.index(r["model"]))
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
