"""Block-wise activation management on the GPU: memory and time of keep / recompute / swap layouts.

    python benchmarks/activations_bench.py --out benchmarks/results/activations_h200
    # a smoke run anywhere
    python benchmarks/activations_bench.py --device cpu --tiny --out /tmp/act

Every layout runs in its own subprocess on ../shared/ANCHORS.md's GPT (1.42 B parameters, batch 8 x
1024, bf16 autocast, uncapped, everything resident): all-keep, all-recompute, all-swap, mixes, and
n_swap in {1, 2, 4, 8}. Per layout: step time, forward/backward time (CUDA events), peak memory and
activation memory (peak during the step minus what is allocated before it: parameters, gradients,
optimizer state), bytes the forward saves for backward per block (on the device, and in host memory
for swap blocks).

For n_swap = 1, 2, 4, 8 the table puts the measured step-time increase over all-keep next to the
bound computed from measurements: the swapped bytes' copy time at the measured pinned bandwidth,
minus what the compute that can hide it absorbs (device-to-host copies behind the rest of forward;
each block's reload behind the backward of the block after it).
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
from models import GPT, GPTConfig  # noqa: E402

ANCHOR = dict(
    n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024, tie_embeddings=False
)
TINY = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)


def layouts(n_layer: int) -> list[tuple[str, int, int]]:
    half, quarter = n_layer // 2, n_layer // 4
    out = [
        ("all-keep", 0, 0),
        ("all-recompute", 0, n_layer),
        ("all-swap", n_layer, 0),
        ("swap 1/4 + recompute 1/4", quarter, quarter),
        ("recompute 1/2", 0, half),
        ("swap 1/4 + recompute 1/2", quarter, half),
        ("swap 1/8 + recompute 1/4", n_layer // 8, quarter),
    ]
    out += [(f"n_swap={k}", k, 0) for k in (1, 2, 4, 8) if k <= n_layer and k not in (n_layer,)]
    return out


def run_one(args) -> dict:
    from protrain_fx import get_plan, pipeline
    from protrain_fx.runtime import swap_pool

    device = torch.device(args.device)
    cfg = TINY if args.tiny else ANCHOR
    seq = cfg["block_size"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg)).to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    saved = []

    def record(gm, plan):  # what forward returns for backward, after protrain's forward passes
        saved.append(gm)
        return gm

    pipeline.probe("forward", record).__enter__()  # for the whole run
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"n_swap": args.n_swap, "n_checkpoint": args.n_checkpoint},
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg["vocab_size"], (args.batch, seq), generator=g).to(device)
    y = torch.randint(0, cfg["vocab_size"], (args.batch, seq), generator=g).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    cuda = device.type == "cuda"

    def step(timing=None):
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
        t0 = time.perf_counter()
        with autocast:
            loss = compiled(x, y)
        if cuda:
            ev[1].record()
        t1 = time.perf_counter()
        # what forward holds for backward (swapped blocks: once copied out)
        if timing is not None and cuda:
            torch.cuda.synchronize()
            timing.setdefault("after_fwd_bytes", []).append(torch.cuda.memory_allocated())
        loss.backward()
        if cuda:
            ev[2].record()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if timing is not None:
            timing.setdefault("step_ms", []).append((t3 - t0) * 1e3)
            timing.setdefault("fwd_ms", []).append(
                ev[0].elapsed_time(ev[1]) if cuda else (t1 - t0) * 1e3
            )
            timing.setdefault("bwd_ms", []).append(
                ev[1].elapsed_time(ev[2]) if cuda else (t2 - t1) * 1e3
            )
        return loss

    step()
    step()
    with timeshare.measuring():
        step()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timing: dict = {}
        for _ in range(args.steps):
            loss = step(timing)
        # on the GPU the steps above synchronize after forward for the memory reading; the step time
        # comes from further steps without that synchronize
        plain: dict = {}
        for _ in range(args.steps if cuda else 0):
            _timed_plain(step, plain)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    med = {k: sorted(v)[len(v) // 2] for k, v in timing.items()}
    if cuda:
        med["step_ms"] = sorted(plain["step_ms"])[len(plain["step_ms"]) // 2]
    after_fwd = med.pop("after_fwd_bytes", base)
    plan = get_plan(compiled)
    per_block = _saved_per_block(saved[0], plan) if saved else {}
    res = {
        "layout": args.name,
        "n_swap": args.n_swap,
        "n_checkpoint": args.n_checkpoint,
        "batch": args.batch,
        "seq": seq,
        "params": sum(p.numel() for p in model.parameters()),
        **med,
        "tokens_per_s": args.batch * seq / (med["step_ms"] / 1e3),
        "peak_gib": peak / 2**30,
        "activation_gib": (after_fwd - base) / 2**30,
        "peak_over_states_gib": (peak - base) / 2**30,
        "states_gib": base / 2**30,
        "loss": float(loss),
        "policies": [b.policy for b in plan.blocks],
        "saved_per_block": per_block,
    }
    if plan.swap_pool is not None:
        pool = swap_pool.get_pool(plan.swap_pool)
        res["swapped_bytes_per_step"] = pool.nbytes
        res.update(_copy_bandwidth(pool, device))
    return res


def _timed_plain(step, plain: dict) -> None:
    """One step timed with nothing but a synchronize at its end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(None)
    plain.setdefault("step_ms", []).append((time.perf_counter() - t0) * 1e3)


def _saved_per_block(gm, plan) -> dict:
    """Bytes forward returns for backward, by block: {block name: {"device": ..., "host": ...}}."""
    from protrain_fx.graph.annotation import annotation_of
    from protrain_fx.runtime import ops

    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    out: dict[str, dict[str, int]] = {}
    for node in outputs[len(outputs) - len(plan.saved_names) :]:
        val = node.meta.get("val") if node is not None else None
        if node is None or node.op == "placeholder" or not isinstance(val, torch.Tensor):
            continue
        ann = annotation_of(node)
        name = ann.block_name if ann is not None and ann.block_name else "non-block"
        where = "host" if node.target is ops.OFFLOAD else "device"
        out.setdefault(name, {"device": 0, "host": 0})[where] += (
            int(val.numel()) * val.element_size()
        )  # SymInt: its hint
    return out


def _copy_bandwidth(pool, device) -> dict:
    if device.type != "cuda" or pool.buffer is None:
        return {}
    n = pool.nbytes
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {}
    for name, fn in (
        ("d2h_gb_s", lambda: pool.buffer.copy_(dev, non_blocking=True)),
        ("h2d_gb_s", lambda: dev.copy_(pool.buffer, non_blocking=True)),
    ):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(3):  # median of three: one copy can be slow
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        out[name] = n / sorted(times)[1] / 1e6
    return out


def _mean_block(row: dict) -> dict:
    blocks = [v for k, v in row["saved_per_block"].items() if k != "non-block"]
    return {w: sum(b[w] for b in blocks) / max(1, len(blocks)) for w in ("device", "host")}


def swap_bound(row: dict, keep: dict, n_layer: int, d2h_gb_s: float, h2d_gb_s: float) -> dict:
    """The step-time increase physics forces on a swap layout, from measurements: the swapped bytes
    go down and come back up at the measured pinned bandwidths (``copy_ms``); the compute that can
    hide them is all that runs between the end of block 0's forward (when the first offload can
    start) and the start of block 0's backward (when the last reload must be done): the other
    blocks' forward and backward, measured on all-keep. What the copies exceed that by cannot be
    hidden (``bound_increase_ms``)."""
    nbytes = row["swapped_bytes_per_step"]
    copy_ms = nbytes / d2h_gb_s / 1e6 + nbytes / h2d_gb_s / 1e6
    window_ms = (keep["fwd_ms"] + keep["bwd_ms"]) * (n_layer - 1) / n_layer
    bound = max(0.0, copy_ms - window_ms)
    measured = row["step_ms"] - keep["step_ms"]
    return {
        "copy_ms": copy_ms,
        "window_ms": window_ms,
        "bound_increase_ms": bound,
        "measured_increase_ms": measured,
        "measured_increase_pct": 100 * measured / keep["step_ms"],
        "d2h_gb_s": d2h_gb_s,
        "h2d_gb_s": h2d_gb_s,
        "hidden": bound == 0.0,
    }


def add_swap_bounds(rows: list[dict], n_layer: int) -> dict | None:
    """Bounds for the pure swap rows against this run's all-keep, at the run's median measured
    bandwidths (one pool copy can be slow: each row measures its own, the median of the run is
    used)."""
    keep = next((r for r in rows if r.get("layout") == "all-keep" and "error" not in r), None)
    bw = [r for r in rows if "d2h_gb_s" in r]
    if keep is None or not bw:
        return keep
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    d2h, h2d = med([r["d2h_gb_s"] for r in bw]), med([r["h2d_gb_s"] for r in bw])
    for r in rows:
        if "error" not in r and r["n_swap"] and not r["n_checkpoint"]:
            r["swap_bound"] = swap_bound(r, keep, n_layer, d2h, h2d)
    return keep


def merge(paths: list[str], out_path: str) -> None:
    """Combine runs: each layout's newest successful row wins (errors of earlier runs are listed as
    superseded); every row keeps the all-keep of its own run as its baseline (``vs_keep``)."""
    runs = [json.load(open(p)) for p in paths]
    rows, superseded = {}, []
    for i, run in enumerate(runs):
        for r in run["rows"]:
            r.pop("swap_bound", None)
        keep = add_swap_bounds(run["rows"], ANCHOR["n_layer"])  # against the run's own all-keep
        for r in run["rows"]:
            r["run"] = i + 1
            # the first run's names
            r["layout"] = r["layout"].replace(", recompute", " + recompute")
            if keep is not None and "error" not in r:
                r["vs_keep"] = {
                    "step_ms": keep["step_ms"],
                    "activation_gib": keep["activation_gib"],
                    "fwd_ms": keep["fwd_ms"],
                    "bwd_ms": keep["bwd_ms"],
                }
            name = r["layout"]
            if name in rows and "error" in rows[name]:
                superseded.append(rows.pop(name))
            if name not in rows or "error" not in r:
                if name in rows:
                    superseded.append(rows[name])
                rows[name] = r
    order = [name for name, _, _ in layouts(ANCHOR["n_layer"])]
    out = {
        "date": runs[-1]["date"],
        "device": runs[-1]["device"],
        "torch": runs[-1]["torch"],
        "runs": [{"run": i + 1, "argv": r["argv"]} for i, r in enumerate(runs)],
        "rows": sorted(
            rows.values(), key=lambda r: order.index(r["layout"]) if r["layout"] in order else 99
        ),
        "superseded": superseded,
    }
    with open(out_path + ".json", "w") as f:
        json.dump(out, f, indent=2)
    keep = next(
        (r for r in out["rows"] if r.get("layout") == "all-keep" and "error" not in r), None
    )
    with open(out_path + ".md", "w") as f:
        f.write(markdown(out, keep))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "activations_h200"))
    ap.add_argument("--timeout", type=int, default=420, help="seconds per batch of layouts")
    ap.add_argument(
        "--parallel", type=int, default=4, help="layouts compiled side by side (device memory!)"
    )
    ap.add_argument("--only", default="", help="comma-separated layout names to run (default: all)")
    ap.add_argument("--one", action="store_true", help="internal: run one layout")
    ap.add_argument("--name", default="")
    ap.add_argument("--n-swap", type=int, default=0)
    ap.add_argument("--n-checkpoint", type=int, default=0)
    ap.add_argument(
        "--merge", nargs="+", default=None, help="combine the JSON of several runs into --out"
    )
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    if args.one:
        try:
            res = run_one(args)
        except Exception as e:
            import traceback

            traceback.print_exc()
            res = {"layout": args.name, "error": timeshare.error_text(e)}
        print("RESULT " + json.dumps(res), flush=True)
        return
    n_layer = (TINY if args.tiny else ANCHOR)["n_layer"]
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    todo = [
        (name, n_swap, n_ckpt)
        for name, n_swap, n_ckpt in layouts(n_layer)
        if not wanted or name in wanted
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    rows = []
    # each batch compiles side by side, then times one at a time
    for b in range(0, len(todo), args.parallel):
        batch = todo[b : b + args.parallel]
        argvs = [
            [
                sys.executable,
                __file__,
                "--one",
                "--name",
                name,
                "--n-swap",
                str(n_swap),
                "--n-checkpoint",
                str(n_ckpt),
                "--device",
                args.device,
                "--batch",
                str(args.batch),
                "--steps",
                str(args.steps),
            ]
            + (["--tiny"] if args.tiny else [])
            for name, n_swap, n_ckpt in batch
        ]
        for (name, _, _), (code, so, se) in zip(
            batch, timeshare.run_together(argvs, env, args.timeout)
        ):
            line = next((l for l in so.splitlines() if l.startswith("RESULT ")), None)
            row = (
                json.loads(line[7:])
                if line
                else {"layout": name, "error": f"exit {code}: " + (se or so)[-1500:]}
            )
            rows.append(row)
            print(
                row.get("layout"),
                {k: row[k] for k in ("step_ms", "peak_gib", "activation_gib") if k in row}
                or row.get("error", "")[:600],
                flush=True,
            )
    keep = add_swap_bounds(rows, n_layer)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "argv": sys.argv[1:],
        "rows": rows,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(out, keep))


def markdown(out: dict, keep: dict | None) -> str:
    runs = out.get("runs")
    lines = [f"# Activation layouts on {out['device']} (torch {out['torch']}, {out['date']})", ""]
    if runs:
        lines += [
            "Merged from several runs (`python benchmarks/activations_bench.py --merge "
            "...`); every row is compared "
            "with the all-keep of its own run:",
            "",
        ]
        lines += [
            f"- run {r['run']}: `python benchmarks/activations_bench.py {' '.join(r['argv'])}`"
            for r in runs
        ]
        lines.append("")
    else:
        lines += [f"Command: `python benchmarks/activations_bench.py {' '.join(out['argv'])}`", ""]
    lines += [
        "| layout | run | step ms | fwd ms | bwd ms | peak GiB | activation GiB | "
        "activations vs all-keep | "
        "step vs all-keep |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['layout']} | {r.get('run', '')} | error: "
                f"{r['error'][:150].replace('|', '/').replace(chr(10), ' ')} | | | | | | |"
            )
            continue
        base = r.get("vs_keep") or keep
        rel = (
            f"{100 * (1 - r['activation_gib'] / base['activation_gib']):.0f}% less"
            if base and base["activation_gib"]
            else "-"
        )
        srel = f"{100 * (r['step_ms'] / base['step_ms'] - 1):+.1f}%" if base else "-"
        lines.append(
            f"| {r['layout']} | {r.get('run', '')} | {r['step_ms']:.0f} | "
            f"{r['fwd_ms']:.0f} | {r['bwd_ms']:.0f} | "
            f"{r['peak_gib']:.1f} | {r['activation_gib']:.2f} | {rel} | {srel} |"
        )
    lines += [
        "",
        "activation GiB = device memory held between forward and backward (allocated "
        "after forward minus "
        "before it); peak includes parameters, gradients and AdamW state (15.9 GiB).",
    ]
    sw = [r for r in out["rows"] if r.get("swap_bound")]
    if sw:
        b0 = sw[0]["swap_bound"]
        lines += [
            "",
            "Swap: the step-time increase over all-keep next to what physics forces: the "
            "swapped bytes' copy "
            "down and up at the run's median measured pinned bandwidth "
            f"({b0['d2h_gb_s']:.1f} GB/s d2h, "
            f"{b0['h2d_gb_s']:.1f} GB/s h2d), against the compute that can hide it (the "
            "other blocks' forward "
            "and backward, measured on all-keep). Where the copies fit, the increase should "
            "be <= 5% of the "
            "step; where they do not, within 10% of the un-hidden copy time.",
            "",
            "| n_swap | swapped MiB | copy ms (d2h+h2d) | hiding compute ms | un-hidden "
            "(bound) ms | "
            "measured increase ms | measured % of step | holds |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sw:
            b = r["swap_bound"]
            if b["hidden"]:
                ok = (
                    "yes (fits; <= 5%)"
                    if b["measured_increase_pct"] <= 5
                    else "no (fits, but > 5%)"
                )
            else:
                ok = (
                    "yes (within 10%)"
                    if abs(b["measured_increase_ms"] - b["bound_increase_ms"])
                    <= 0.1 * b["bound_increase_ms"]
                    else "no (not within 10%)"
                )
            lines.append(
                f"| {r['n_swap']} | {r['swapped_bytes_per_step'] / 2**20:.0f} | "
                f"{b['copy_ms']:.1f} | "
                f"{b['window_ms']:.1f} | {b['bound_increase_ms']:.1f} | "
                f"{b['measured_increase_ms']:.1f} | "
                f"{b['measured_increase_pct']:+.1f}% | {ok} |"
            )
    by_name = {r["layout"]: r for r in out["rows"] if "error" not in r}
    if keep and keep.get("saved_per_block"):
        n = len([k for k in keep["saved_per_block"] if k != "non-block"])
        kb = _mean_block(keep)
        lines += [
            "",
            f"What each policy costs and saves per block (means over the {n} blocks; "
            "time = (layout step - "
            "all-keep step) / blocks):",
            "",
            "| policy | device MiB kept for backward per block | host MiB per block | device "
            "MiB freed vs keep | "
            "ms per block |",
            "|---|---|---|---|---|",
        ]
        for pol, name in (
            ("keep", "all-keep"),
            ("recompute", "all-recompute"),
            ("swap", "all-swap"),
        ):
            r = by_name.get(name)
            if r is None or not r.get("saved_per_block"):
                continue
            b = _mean_block(r)
            base = r.get("vs_keep") or keep
            lines.append(
                f"| {pol} | {b['device'] / 2**20:.1f} | {b['host'] / 2**20:.1f} | "
                f"{(kb['device'] - b['device']) / 2**20:.1f} | "
                f"{(r['step_ms'] - base['step_ms']) / n:.2f} |"
            )
        incomplete = []
        lines += [
            "",
            "Bytes forward keeps for backward per block (MiB), by layout:",
            "",
            "| layout | policies | block 0 device | block 0 host | last block device | all "
            "blocks device | all blocks host |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in out["rows"]:
            spb = r.get("saved_per_block") or {}
            blocks = sorted(
                (k for k in spb if k != "non-block"), key=lambda k: int(k.rsplit(".", 1)[-1])
            )
            if not blocks:
                continue
            if len(blocks) != len(r.get("policies", [])):
                incomplete.append(r["layout"])
                continue
            b0, bl = spb[blocks[0]], spb[blocks[-1]]
            pol = "".join(p[0] for p in r.get("policies", []))
            lines.append(
                f"| {r['layout']} | {pol} | {b0['device'] / 2**20:.1f} | "
                f"{b0['host'] / 2**20:.1f} | "
                f"{bl['device'] / 2**20:.1f} | "
                f"{sum(spb[k]['device'] for k in blocks) / 2**20:.0f} | "
                f"{sum(spb[k]['host'] for k in blocks) / 2**20:.0f} |"
            )
        lines += ["", "policies: one letter per block (k keep, r recompute, s swap)."]
        if incomplete:
            lines += [
                "",
                "Not shown: " + ", ".join(incomplete) + ". For these the forward graph "
                "the benchmark recorded "
                "did not attribute a saved tensor to every block (a recompute block saves "
                "only its input, which "
                "the block before it produced; for the swap + recompute mixes on CUDA the "
                "recorded graph covered "
                "only blocks 0-1, cause not found). Their measured activation memory above "
                "matches their policies "
                "(e.g. swap 1/4 + recompute 1/4: 12 keep blocks x 672.6 MiB + 6 recompute "
                "inputs x 64 MiB + "
                "1150.6 MiB outside blocks = 9.3 GiB; measured 9.26 GiB).",
            ]
    if out.get("superseded"):
        lines += ["", "Rows of earlier runs replaced by a later run:", ""]
        for r in out["superseded"]:
            what = (
                ("error: " + r.get("diagnosis", r["error"][:300].replace("\n", " ")))
                if "error" in r
                else f"step {r.get('step_ms', 0):.0f} ms"
            )
            lines.append(f"- {r['layout']} (run {r.get('run')}): {what}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
