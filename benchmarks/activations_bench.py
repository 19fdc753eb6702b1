"""Block-wise activation management on the GPU: memory and time of keep / recompute / swap layouts.

    python benchmarks/activations_bench.py --out benchmarks/results/activations_h200
    python benchmarks/activations_bench.py --device cpu --tiny --out /tmp/act      # a smoke run anywhere

Every layout runs in its own subprocess on ../shared/ANCHORS.md's GPT (1.42 B parameters, batch 8 x 1024,
bf16 autocast, uncapped, everything resident): all-keep, all-recompute, all-swap, mixes, and n_swap in
{1, 2, 4, 8}. Per layout: step time, forward/backward time (CUDA events), peak memory and activation memory
(peak during the step minus what is allocated before it: parameters, gradients, optimizer state), bytes
the forward saves for backward per block (on the device, and in host memory for swap blocks).

For n_swap = 1, 2, 4, 8 the table puts the measured step-time increase over all-keep next to the bound
computed from measurements: the swapped bytes' copy time at the measured pinned bandwidth, minus what the
compute that can hide it absorbs (device-to-host copies behind the rest of forward; each block's reload
behind the backward of the block after it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from gpu_turns import measure_turn, run_batch  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402

ANCHOR = dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024, tie_embeddings=False)
TINY = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)


def layouts(n_layer: int) -> list[tuple[str, int, int]]:
    half, quarter = n_layer // 2, n_layer // 4
    out = [("all-keep", 0, 0), ("all-recompute", 0, n_layer), ("all-swap", n_layer, 0),
           ("swap 1/4, recompute 1/4", quarter, quarter), ("recompute 1/2", 0, half),
           ("swap 1/4, recompute 1/2", quarter, half)]
    out += [(f"n_swap={k}", k, 0) for k in (1, 2, 4, 8) if k <= n_layer and k not in (n_layer,)]
    return out


def run_one(args) -> dict:
    from protrain_fx import backend, get_plan, swap_pool

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

    backend.PIPELINE["forward"] = backend.PIPELINE["forward"] + (record,)
    compiled = torch.compile(model, backend="protrain", options={"n_swap": args.n_swap, "n_checkpoint": args.n_checkpoint})
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
        if timing is not None and cuda:  # what forward holds for backward (swapped blocks: once copied out)
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
            timing.setdefault("fwd_ms", []).append(ev[0].elapsed_time(ev[1]) if cuda else (t1 - t0) * 1e3)
            timing.setdefault("bwd_ms", []).append(ev[1].elapsed_time(ev[2]) if cuda else (t2 - t1) * 1e3)
        return loss

    step()
    step()
    with measure_turn():
        step()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timing: dict = {}
        for _ in range(args.steps):
            loss = step(timing)
        # on the GPU the steps above synchronize after forward for the memory reading; the step time comes
        # from further steps without that synchronize
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
    res = {"layout": args.name, "n_swap": args.n_swap, "n_checkpoint": args.n_checkpoint, "batch": args.batch,
           "seq": seq, "params": sum(p.numel() for p in model.parameters()), **med,
           "tokens_per_s": args.batch * seq / (med["step_ms"] / 1e3), "peak_gib": peak / 2**30,
           "activation_gib": (after_fwd - base) / 2**30, "peak_over_states_gib": (peak - base) / 2**30,
           "states_gib": base / 2**30, "loss": float(loss),
           "policies": [b.policy for b in plan.blocks], "saved_per_block": per_block}
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
    from protrain_fx import ops
    from protrain_fx.passes.annotate import annotation_of

    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    out: dict[str, dict[str, int]] = {}
    for node in outputs[len(outputs) - len(plan.saved_names):]:
        val = node.meta.get("val") if node is not None else None
        if node is None or node.op == "placeholder" or not isinstance(val, torch.Tensor):
            continue
        ann = annotation_of(node)
        name = ann.block_name if ann is not None and ann.block_name else "non-block"
        where = "host" if node.target is ops.OFFLOAD else "device"
        out.setdefault(name, {"device": 0, "host": 0})[where] += val.numel() * val.element_size()
    return out


def _copy_bandwidth(pool, device) -> dict:
    if device.type != "cuda" or pool.buffer is None:
        return {}
    n = pool.nbytes
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {}
    for name, fn in (("d2h_gb_s", lambda: pool.buffer.copy_(dev, non_blocking=True)),
                     ("h2d_gb_s", lambda: dev.copy_(pool.buffer, non_blocking=True))):
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


def swap_bound(row: dict, keep: dict, n_layer: int) -> dict:
    """Expected step-time increase of a swap layout from measurements (see module docstring)."""
    if "swapped_bytes_per_step" not in row or "d2h_gb_s" not in row:
        return {}
    nbytes = row["swapped_bytes_per_step"]
    d2h_ms = nbytes / row["d2h_gb_s"] / 1e6
    h2d_ms = nbytes / row["h2d_gb_s"] / 1e6
    k = row["n_swap"]
    fwd_block = keep["fwd_ms"] / n_layer
    bwd_block = keep["bwd_ms"] / n_layer
    # offloads of blocks 0..k-1 run behind the forward of the blocks after each; reloads one block ahead
    exposed_fwd = max(0.0, d2h_ms - fwd_block * (n_layer - 1))
    exposed_bwd = max(0.0, h2d_ms / k - bwd_block) * k
    return {"copy_ms": d2h_ms + h2d_ms, "bound_increase_ms": exposed_fwd + exposed_bwd,
            "measured_increase_ms": row["step_ms"] - keep["step_ms"],
            "hidden": exposed_fwd + exposed_bwd == 0.0}


def _error_text(e: BaseException) -> str:
    """The start of the exception (dispatcher errors put the operator first and a long key list after) and
    the innermost frames of its traceback."""
    import traceback

    frames = "".join(traceback.format_tb(e.__traceback__)[-3:])
    return f"{type(e).__name__}: {str(e)[:1200]}\n{frames[-1500:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "activations_h200"))
    ap.add_argument("--timeout", type=int, default=420, help="seconds per batch of layouts")
    ap.add_argument("--parallel", type=int, default=4, help="layouts compiled side by side (device memory!)")
    ap.add_argument("--only", default="", help="comma-separated layout names to run (default: all)")
    ap.add_argument("--one", action="store_true", help="internal: run one layout")
    ap.add_argument("--name", default="")
    ap.add_argument("--n-swap", type=int, default=0)
    ap.add_argument("--n-checkpoint", type=int, default=0)
    args = ap.parse_args()
    if args.one:
        try:
            res = run_one(args)
        except Exception as e:
            import traceback

            traceback.print_exc()
            res = {"layout": args.name, "error": _error_text(e)}
        print("RESULT " + json.dumps(res), flush=True)
        return
    n_layer = (TINY if args.tiny else ANCHOR)["n_layer"]
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    todo = [(name, n_swap, n_ckpt) for name, n_swap, n_ckpt in layouts(n_layer) if not wanted or name in wanted]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    rows = []
    for b in range(0, len(todo), args.parallel):  # each batch compiles side by side, then times one at a time
        batch = todo[b:b + args.parallel]
        argvs = [[sys.executable, __file__, "--one", "--name", name, "--n-swap", str(n_swap), "--n-checkpoint",
                  str(n_ckpt), "--device", args.device, "--batch", str(args.batch), "--steps", str(args.steps)]
                 + (["--tiny"] if args.tiny else []) for name, n_swap, n_ckpt in batch]
        for (name, _, _), (code, so, se) in zip(batch, run_batch(argvs, env, args.timeout)):
            line = next((l for l in so.splitlines() if l.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"layout": name, "error": f"exit {code}: " + (se or so)[-1500:]}
            rows.append(row)
            print(row.get("layout"), {k: row[k] for k in ("step_ms", "peak_gib", "activation_gib") if k in row}
                  or row.get("error", "")[:600], flush=True)
    keep = next((r for r in rows if r.get("layout") == "all-keep" and "error" not in r), None)
    if keep is not None:
        for r in rows:
            if "error" not in r and r["n_swap"] and not r["n_checkpoint"]:
                r["swap_bound"] = swap_bound(r, keep, n_layer)
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "argv": sys.argv[1:], "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(out, keep))


def markdown(out: dict, keep: dict | None) -> str:
    lines = [f"# Activation layouts on {out['device']} (torch {out['torch']}, {out['date']})", "",
             f"Command: `python benchmarks/activations_bench.py {' '.join(out['argv'])}`", "",
             "| layout | step ms | fwd ms | bwd ms | peak GiB | activation GiB | vs all-keep activations |",
             "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['layout']} | error: {r['error'][:150].replace('|', '/').replace(chr(10), ' ')} | | | | | |")
            continue
        rel = f"{100 * (1 - r['activation_gib'] / keep['activation_gib']):.0f}% less" if keep and keep["activation_gib"] else "-"
        lines.append(f"| {r['layout']} | {r['step_ms']:.0f} | {r['fwd_ms']:.0f} | {r['bwd_ms']:.0f} | {r['peak_gib']:.1f} | "
                     f"{r['activation_gib']:.2f} | {rel} |")
    sw = [r for r in out["rows"] if r.get("swap_bound")]
    if sw:
        lines += ["", "Swap: measured step-time increase over all-keep against the bound from measured copy time and "
                  "the compute that can hide it (ms).", "",
                  "| n_swap | swapped MiB | copy ms (d2h+h2d) | bound increase | measured increase |", "|---|---|---|---|---|"]
        for r in sw:
            b = r["swap_bound"]
            lines.append(f"| {r['n_swap']} | {r['swapped_bytes_per_step'] / 2**20:.0f} | {b['copy_ms']:.1f} | "
                         f"{b['bound_increase_ms']:.1f} | {b['measured_increase_ms']:.1f} |")
    by_name = {r["layout"]: r for r in out["rows"] if "error" not in r}
    if keep and keep.get("saved_per_block"):
        n = len([k for k in keep["saved_per_block"] if k != "non-block"])
        kb = _mean_block(keep)
        lines += ["", f"What each policy costs and saves per block (means over the {n} blocks; time = (layout step - "
                  "all-keep step) / blocks):", "",
                  "| policy | device MiB kept for backward per block | host MiB per block | device MiB freed vs keep | "
                  "ms per block |", "|---|---|---|---|---|"]
        for pol, name in (("keep", "all-keep"), ("recompute", "all-recompute"), ("swap", "all-swap")):
            r = by_name.get(name)
            if r is None or not r.get("saved_per_block"):
                continue
            b = _mean_block(r)
            lines.append(f"| {pol} | {b['device'] / 2**20:.1f} | {b['host'] / 2**20:.1f} | "
                         f"{(kb['device'] - b['device']) / 2**20:.1f} | {(r['step_ms'] - keep['step_ms']) / n:.2f} |")
    if keep and keep.get("saved_per_block"):
        lines += ["", "Bytes forward keeps for backward per block (MiB), by policy:", "",
                  "| layout | block 0 device | block 0 host | last block device |", "|---|---|---|---|"]
        for r in out["rows"]:
            spb = r.get("saved_per_block") or {}
            blocks = sorted(k for k in spb if k != "non-block")
            if not blocks:
                continue
            b0, bl = spb[blocks[0]], spb[blocks[-1]]
            lines.append(f"| {r['layout']} | {b0['device'] / 2**20:.1f} | {b0['host'] / 2**20:.1f} | {bl['device'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
