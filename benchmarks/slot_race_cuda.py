"""The slot race of 2026-12-01 on CUDA (GPU): a 4-layer GPT, every chunk offloaded, regional and
whole-model compilation, Inductor, fp32, 4 AdamW steps (lr 1e-2) against eager on the same GPU,
once as it runs and once with the host worker forced to finish every task right after each chunk
gradient (the ordering that served stale slot values before the fix). Writes
$OUT/cuda_smoke.json (or /tmp); results: benchmarks/results/slot_race_cuda_h200.md.

    python benchmarks/slot_race_cuda.py
"""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]
import test_habits as th  # noqa: E402
import torch  # noqa: E402

from protrain_fx.runtime import chunk_grads  # noqa: E402
from protrain_fx.runtime.worker import WORKER  # noqa: E402


def to_cuda(model):
    return model.cuda()


out = []
real = chunk_grads.ChunkGrads.grad_ready
for ahead in (False, True):
    chunk_grads.ChunkGrads.grad_ready = real
    if ahead:

        def worker_ahead(self, *a, **k):
            real(self, *a, **k)
            WORKER.wait()

        chunk_grads.ChunkGrads.grad_ready = worker_ahead
    for cf in ("regional", "whole"):
        torch._dynamo.reset()
        t0 = time.perf_counter()
        base = th.gpt(n_layer=4).cuda()
        data = [(x.cuda(), y.cuda()) for x, y in th.gpt_data(n=4)]
        try:
            p = th.parity(
                base,
                th.offload(base, compiler="inductor"),
                compile_fn=th.regional("blocks") if cf == "regional" else th.whole,
                data=data,
            )
            row = dict(
                ahead=ahead,
                cf=cf,
                loss_rel=th.rel_err(p.trace, p.ref_trace),
                param_abs=th.sd_diff(p.mine.state_dict(), p.ref.state_dict()),
                update=th.sd_diff(p.ref.state_dict(), p.base.state_dict()),
            )
        except Exception as e:
            row = dict(ahead=ahead, cf=cf, error=repr(e)[:500])
        row["s"] = round(time.perf_counter() - t0, 1)
        print(row, flush=True)
        out.append(row)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "cuda_smoke.json"), "w"), indent=1)
