"""A training loop as people write it, on a Hugging Face model at a cap that forces offloading,
against torch.compile uncapped on the same init and data (GPU).

    python benchmarks/loop_at_scale.py --out $OUT/loop_at_scale [--models llama3.2-1b,llama3.2-3b]
        [--steps 12] [--deadline 560]

The loop is the same in both systems' processes, and written as a fine-tuning script would write
it: ``torch.compile(model, backend="protrain")`` with no options (the optimizer made before and
found by protrain), AdamW in two parameter groups (no weight decay for norms), fused, under
``transformers.get_cosine_schedule_with_warmup``; two micro-steps per optimizer step on batches
with right padding (``attention_mask``, labels -100 there), ``labels=`` loss, bf16 autocast;
``clip_grad_norm_(..., 1.0)``; every fourth step an evaluation under ``model.eval()`` and
``torch.no_grad()`` on a batch twice as large; half way a checkpoint (the model's and the
optimizer's state dicts saved) and a printed weight; one step abandoned after its first forward (a
bad batch skipped, the loss never backpropagated). Compared per step, at bf16 tolerance
(oom_sweep.TOLERANCE): the training losses, the gradient norms, the evaluation losses, the
checkpoint's sum and the printed weight. Reported per row: outcome (trained, out of memory, error),
the largest relative differences, the reserved peak against the cap, the median step time and the
time to the first step.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from oom_sweep import MODELS, build  # noqa: E402

# (model, batch, seq, cap GiB for protrain): caps where the model's states do not fit
ROWS = {"llama3.2-1b": (4, 1024, 16), "llama3.2-3b": (4, 1024, 24)}
MICRO = 2
TOLERANCE = 0.0156  # bf16 relative per step, as oom_sweep.py
SKIPPED_STEP = 5  # the step abandoned after its first forward


def batches(spec: dict, batch: int, seq: int, steps: int):
    import torch

    g = torch.Generator().manual_seed(1)
    train = []
    for _ in range(steps * MICRO):
        x = torch.randint(0, spec["vocab"], (batch, seq), generator=g)
        mask = torch.ones_like(x)
        mask[0, -seq // 8 :] = 0  # right padding on the first sequence
        labels = x.masked_fill(mask == 0, -100)
        train.append((x, mask, labels))
    evaluation = torch.randint(0, spec["vocab"], (2 * batch, seq), generator=g)
    return train, evaluation


def run(model_name: str, system: str, steps: int, checkpoint: bool = True) -> dict:
    import torch
    import transformers

    spec = MODELS[model_name]
    batch, seq, cap = ROWS[model_name]
    dev = torch.device("cuda")
    out: dict = {"model": model_name, "system": system, "batch": batch, "seq": seq}
    t0 = time.perf_counter()
    if system == "protrain":
        import protrain_fx

        if "protrain" not in torch._dynamo.list_backends(exclude_tags=()):
            torch._dynamo.register_backend(protrain_fx.backend.protrain_backend, name="protrain")
        model = build(spec, seq, host=True)
        torch.cuda.set_per_process_memory_fraction(
            cap * 2**30 / torch.cuda.get_device_properties(dev).total_memory
        )
        out["cap_gib"] = cap
    else:
        model = build(spec, seq)
    torch.cuda.reset_peak_memory_stats(dev)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        fused=True,
    )
    sched = transformers.get_cosine_schedule_with_warmup(opt, 2, steps)
    if system == "protrain":
        compiled = torch.compile(model, backend="protrain")
    else:
        compiled = torch.compile(model)
    train, evaluation = batches(spec, batch, seq, steps)
    losses, norms, lrs, evals, times = [], [], [], [], []
    phases = []  # per step: ms to the end of the last backward, of the clip, of opt.step()
    # reserved and allocated peaks (GiB) per part of the loop: a reset leaves the reserved peak at
    # what the allocator keeps cached (an evaluation's segments stay in the next steps' peak), the
    # allocated one at what is alive, so the allocated peaks say which part needs the memory
    peaks: dict[str, float] = {}
    allocated: dict[str, float] = {}

    def peak_of(part: str) -> None:
        for table, now in (
            (peaks, torch.cuda.max_memory_reserved(dev)),
            (allocated, torch.cuda.max_memory_allocated(dev)),
        ):
            table[part] = round(max(table.get(part, 0.0), now / 2**30), 3)
        torch.cuda.reset_peak_memory_stats(dev)

    for i in range(steps):
        ts = time.perf_counter()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        step_loss = 0.0
        for m in range(MICRO):
            x, mask, labels = (t.to(dev) for t in train[i * MICRO + m])
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(input_ids=x, attention_mask=mask, labels=labels).loss
            if i == SKIPPED_STEP:  # a bad batch: the step is abandoned before any backward
                break
            (loss / MICRO).backward()
            step_loss += loss.item() / MICRO
        if i == SKIPPED_STEP:
            del loss
            opt.zero_grad(set_to_none=True)
            continue
        ev[1].record()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ev[2].record()
        opt.step()
        ev[3].record()
        norms.append(norm.item())
        sched.step()
        opt.zero_grad(set_to_none=True)
        lrs.append(sched.get_last_lr()[0])
        losses.append(step_loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - ts)
        phases.append([round(ev[0].elapsed_time(e), 1) for e in ev[1:]])
        if i == 0:
            out["first_step_s"] = round(time.perf_counter() - t0, 2)
        peak_of(
            "first step"
            if i == 0
            else "training steps after an evaluation"
            if evals
            else "training steps"
        )
        if i % 4 == 3:
            model.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                ev = evaluation.to(dev)
                evals.append(compiled(input_ids=ev, labels=ev).loss.item())
            model.train()
            peak_of("evaluation")
        if checkpoint and i == steps // 2:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            out["checkpoint_mib"] = round(buf.tell() / 2**20, 1)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True, map_location="cpu")
            out["checkpoint_sum"] = sum(
                float(v.double().sum()) for v in saved["model"].values() if v.is_floating_point()
            )
            del saved, buf
            w = model.model.layers[-1].mlp.down_proj.weight
            out["printed_weight"] = float(w[0, :8].double().sum())
            peak_of("checkpoint")
        print(f"step {i}: loss {step_loss:.4f} ({times[-1]:.3f} s)", file=sys.stderr, flush=True)
    out.update(
        losses=losses,
        norms=norms,
        lrs=lrs,
        eval_losses=evals,
        step_s=statistics.median(times[3:]),
        # medians over the steps after the third: backward's end, the clip's, opt.step()'s (ms)
        phases_ms=[round(statistics.median(p[k] for p in phases[3:]), 1) for k in range(3)],
        peak_reserved_gib=max(peaks.values()),
        peaks_reserved_gib=peaks,
        peaks_allocated_gib=allocated,
    )
    if system == "protrain":
        import protrain_fx
        from protrain_fx.runtime import hybrid_optim

        plan = protrain_fx.get_plan(compiled)
        pred = plan.predicted or {}
        out["plans"] = [plan.summary().splitlines()[1].strip()]
        peak = pred.get("peak_bytes_output_dropped") or pred.get("peak_bytes") or 0
        out["predicted_peak_reserved_gib"] = peak / 2**30
        # an optimizer step's where the plan priced the loop's micro-steps (plan/accumulation.py),
        # else one micro-step's; the step meter's own measure of it, and the whole summary
        out["predicted_step_s"] = pred.get("iter_s")
        out["predicted_micro_steps"] = (pred.get("breakdown") or {}).get("micro_steps", 1)
        out["meter_step_s"] = (plan.measured or {}).get("iter_s")
        out["summary"] = plan.summary()
        out["stats"] = {
            k: sum(s.stats.get(k, 0) for s in hybrid_optim.handle_of(opt).stores)
            for k in ("grad_norms_served", "grad_adds_on_device", "d2h_bytes")
        }
    return out


def child(
    model_name: str, system: str, steps: int, timeout: float, cache: str, checkpoint: bool
) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PROTRAIN_CACHE_DIR=cache)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    result = os.path.join(cache, "row.json")
    args = ["--run", model_name, system, "--steps", str(steps), "--result", result]
    args += [] if checkpoint else ["--no-checkpoint"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, __file__, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        # what the child had said: its phases and the steps it finished (a hang shows where)
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        steps_done = [ln for ln in err.splitlines() if ln.startswith("step ")]
        return {
            "model": model_name,
            "system": system,
            "outcome": "timeout",
            "wall_s": round(time.perf_counter() - t0, 1),
            "steps_done": steps_done,
            "error": "\n".join(err.splitlines()[-30:]),
        }
    if p.returncode == 0:
        with open(result) as f:
            out = json.load(f)
        out["outcome"] = "trained"
        # what protrain said (its plans, re-plans and warnings), without the progress lines
        said = [ln for ln in p.stderr.splitlines() if ln.startswith("protrain:")]
        out["protrain_said"] = said[-40:]
    else:
        err = p.stderr[-3000:]
        oom = "OutOfMemoryError" in err or "out of memory" in err
        out = {"model": model_name, "system": system, "error": err}
        out["outcome"] = "oom" if oom else "error"
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: out.get(k) for k in ("model", "system", "outcome", "wall_s")}), flush=True)
    return out


def rel(a, b) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(mine: dict, ref: dict) -> dict:
    if mine.get("outcome") != "trained" or ref.get("outcome") != "trained":
        return {}
    worst = {}
    for key in ("losses", "norms", "eval_losses"):
        a, b = mine[key], ref[key]
        worst[key] = max(map(rel, a, b)) if len(a) == len(b) and a else float("inf")
    for key in ("checkpoint_sum", "printed_weight"):
        if key in mine:  # not with --no-checkpoint
            worst[key] = rel(mine[key], ref[key])
    worst["within_tolerance"] = all(v <= TOLERANCE for v in worst.values())
    return worst


def by_part(peaks: dict | None, allocated: dict | None = None) -> str:
    """The reserved peak of each part of the loop, as `<br>first step 22.1, ...`, and the allocated
    peaks where the row has them (`<br>allocated: first step 20.3, ...`)."""
    out = ""
    for label, table in (("", peaks), ("allocated: ", allocated)):
        if table:
            out += "<br>" + label + ", ".join(f"{part} {gib:.2f}" for part, gib in table.items())
    return out


def predicted_step(r: dict) -> str:
    """A protrain row's predicted optimizer step and the micro-steps it priced, before ``/``."""
    if r.get("predicted_step_s") is None:
        return ""
    return f"{r['predicted_step_s']:.3f} ({r.get('predicted_micro_steps', 1)}) / "


def table(rows: list[dict]) -> str:
    head = (
        "| model | system | outcome | losses / norms / eval losses: max rel | checkpoint sum, "
        "printed weight: rel | reserved peak GiB: predicted / measured (cap) | step s: "
        "predicted (micro-steps priced) / measured | "
        "phases ms | first step s | plan |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        c = r.get("vs_compile") or {}
        fmt = lambda k: f"{c[k]:.1e}" if k in c else "-"  # noqa: E731
        lines.append(
            f"| {r['model']} | {r['system']} | {r['outcome']} | "
            f"{fmt('losses')} / {fmt('norms')} / {fmt('eval_losses')} | "
            f"{fmt('checkpoint_sum')}, {fmt('printed_weight')} | "
            f"{r.get('predicted_peak_reserved_gib', 0):.2f} / "
            f"{r.get('peak_reserved_gib', 0):.2f} ({r.get('cap_gib', '-')})"
            f"{by_part(r.get('peaks_reserved_gib'), r.get('peaks_allocated_gib'))} | "
            f"{predicted_step(r)}{r.get('step_s', 0):.3f} | "
            f"{' / '.join(map(str, r.get('phases_ms', [])))} | "
            f"{r.get('first_step_s', '-')} | "
            f"{'; '.join(r.get('plans', []))} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--models", default=",".join(ROWS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=560)
    ap.add_argument("--systems", default="compile,protrain")
    ap.add_argument("--reference", help="a JSON of this script whose compile rows are compared")
    ap.add_argument("--cache", help="the Inductor and protrain cache folder (default: a new one)")
    ap.add_argument("--label", default="", help="said in the title")
    ap.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="skip the checkpoint half way, for an A/B of step times (the state dicts through "
        "host memory: most of the 98 s the 3B shape's row of run 51 ran after its first step)",
    )
    ap.add_argument("--run", nargs=2)
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.run:
        with open(args.result, "w") as f:
            json.dump(run(*args.run, args.steps, not args.no_checkpoint), f)
        return
    import torch

    start, rows = time.perf_counter(), []
    cache = args.cache or tempfile.mkdtemp(prefix="loop_at_scale-")
    os.makedirs(cache, exist_ok=True)
    stored = {}
    if args.reference:
        with open(args.reference) as f:
            stored = {r["model"]: r for r in json.load(f)["rows"] if r["system"] == "compile"}
    for name in args.models.split(","):
        pair = {"compile": stored[name]} if name in stored else {}
        if pair:
            rows.append(dict(stored[name], reference=args.reference))
        for system in args.systems.split(","):
            left = args.deadline - (time.perf_counter() - start)
            if left < 60:
                break
            pair[system] = child(name, system, args.steps, left, cache, not args.no_checkpoint)
            rows.append(pair[system])
        if "protrain" in pair and "compile" in pair:
            pair["protrain"]["vs_compile"] = compare(pair["protrain"], pair["compile"])
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.out + ".json", "w") as f:
            json.dump({**meta, "steps": args.steps, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(
                f"# A training loop as people write it ({meta['device']}, torch "
                f"{meta['torch']}){' ' + args.label if args.label else ''}\n\n"
                f"`python benchmarks/loop_at_scale.py {' '.join(sys.argv[1:])}`; the loop: this "
                f"script's docstring. Tolerance {TOLERANCE} relative per value. Phases: medians "
                "over the steps after the third of the time from the step's start to the end "
                "of its last backward, of the clip and of opt.step(), in ms.\n\n" + table(rows)
            )


if __name__ == "__main__":
    main()
