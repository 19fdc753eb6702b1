"""Why a second run recompiles (issue 23, time to the first step): the same small training script
run twice in two processes sharing the Inductor and plan caches; per run, Inductor's FX graph cache
hits, misses and bypasses (with the bypass reasons) and each compiled graph's cache key with the
details it was hashed from; then the details that differ between the runs' graphs, which say what
makes a key unstable.

    python benchmarks/warm_cache_probe.py --out $OUT/warm_cache_probe [--device cuda]

writes ``OUT.json`` (both runs) and prints the differing detail lines. The model is a 2-layer
Hugging Face Llama (tied embeddings, GQA) under a budget that offloads every chunk, bf16 autocast on
CUDA, its own ``labels=`` loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(result: str, device: str) -> None:
    import torch
    from redo_check import small_llama  # this folder: the script's own
    from torch._dynamo.utils import counters
    from torch._inductor import codecache

    import protrain_fx

    records, bypasses = [], []
    real_hash = codecache.compiled_fx_graph_hash

    def hashed(*a, **k):
        key, lines = real_hash(*a, **k)
        records.append({"key": key, "lines": [str(x)[:400] for x in lines]})
        return key, lines

    codecache.compiled_fx_graph_hash = hashed

    class Catch(logging.Handler):
        def emit(self, rec):
            msg = rec.getMessage()
            if "Bypassing" in msg or "bypass" in msg.lower():
                bypasses.append(msg[:500])

    lg = logging.getLogger("torch._inductor.codecache")
    lg.setLevel(logging.INFO)
    lg.addHandler(Catch())
    t0 = time.perf_counter()
    model = small_llama(device, vocab=4096, ffn=512, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"optimizer": opt, "memory_budget": 8 * nbytes, "n_persist": 0},
    )
    x = torch.randint(0, model.config.vocab_size, (2, 128), device=device)
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    with amp:
        loss = compiled(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    first = time.perf_counter() - t0
    plan = protrain_fx.get_plan(compiled)
    out = {
        "first_step_s": round(first, 2),
        "loss": loss.item(),
        "counters": {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")},
        "bypasses": bypasses,
        "graphs": records,
        "phases": getattr(plan, "phases", None),
    }
    with open(result, "w") as f:
        json.dump(out, f, default=str)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.device)
        return
    root = tempfile.mkdtemp(prefix="warm_cache_probe-")
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
        PROTRAIN_CACHE_DIR=os.path.join(root, "protrain"),
        PROTRAIN_PLAN_CACHE="1",
    )
    runs = []
    for i in range(2):
        res = os.path.join(root, f"run{i}.json")
        p = subprocess.run(
            [sys.executable, __file__, "--out", args.out, "--device", args.device, "--child", res],
            env=env,
            capture_output=True,
            text=True,
        )
        if p.returncode:
            print(p.stderr[-4000:])
            raise SystemExit(p.returncode)
        with open(res) as f:
            runs.append(json.load(f))
    a, b = runs
    # the second run compiles only the chosen plan's graphs (the first also the profiling plan's):
    # each of its graphs whose key the first run lacks is set against the first run's graph that
    # shares most detail lines with it
    first_keys = {g["key"] for g in a["graphs"]}
    diffs = []
    for k, gb in enumerate(b["graphs"]):
        if gb["key"] in first_keys:
            continue
        lb = set(gb["lines"])
        ga = max(a["graphs"], key=lambda g: len(lb & set(g["lines"])))
        la = set(ga["lines"])
        diffs.append({"graph": k, "only_first": sorted(la - lb), "only_second": sorted(lb - la)})
    out = {"runs": runs, "differing_keys": diffs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    for r in runs:
        print(json.dumps({k: r[k] for k in ("first_step_s", "loss", "counters", "bypasses")}))
    print(f"{len(diffs)} of the second run's {len(b['graphs'])} graphs missed the first's keys")
    for d in diffs:
        print(f"graph {d['graph']} of the second run: key differs")
        for line in d["only_first"][:20]:
            print("  first :", line[:300])
        for line in d["only_second"][:20]:
            print("  second:", line[:300])


if __name__ == "__main__":
    main()
