"""How many graphs dynamo compiles for one model fed several sequence lengths (GPU): plain
``torch.compile`` (Inductor) against ``backend="protrain"``. Dynamo traces the second length with
dynamic sizes, so two graphs serve every length; a backend whose compile specializes the sizes
makes one graph per length, and past dynamo's recompile limit (8) the frame runs eagerly.

    python benchmarks/dynamic_lengths_probe.py tiny_inductor|tiny_protrain|big_protrain_host

``tiny_*``: the tests' HF Llama (4 layers, width 128, sdpa) on the GPU, lengths 16, 12, 14, 10;
``big_protrain_host``: the Llama-3.2-1B shape built under ``host_init``, a 3 GiB budget, lengths
256, 192, 224. bf16 autocast, ``labels=`` loss, AdamW. Prints ``RESULT <case> graphs: N``; run
with ``TORCH_LOGS=recompiles`` to see why each graph was compiled.
"""

import sys, os, torch

sys.path.insert(0, "tests")
sys.path.insert(0, "examples")
sys.path.insert(0, "benchmarks")
import torch._dynamo.utils as du
from hf_models import hf_llama, HF_VOCAB

which = sys.argv[1]
if which.startswith("tiny"):
    m = hf_llama(attn_implementation="sdpa").cuda()
    V = HF_VOCAB
    lens = (16, 12, 14, 10)
else:
    from oom_sweep import MODELS, build

    spec = MODELS["llama3.2-1b"]
    m = build(spec, 256, host=which.endswith("host"))
    V = spec["vocab"]
    lens = (256, 192, 224)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
bk = "protrain" if "protrain" in which else "inductor"
c = torch.compile(
    m,
    backend=bk,
    options={"memory_budget": "3GiB"}
    if bk == "protrain" and not which.startswith("tiny")
    else None,
)
for n in lens:
    x = torch.randint(0, V, (2, n), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = c(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
print("RESULT", which, "graphs:", du.counters["stats"]["unique_graphs"], flush=True)
