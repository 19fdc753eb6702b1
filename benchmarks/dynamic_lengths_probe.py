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

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for d in ("tests", "examples", "benchmarks"):
    sys.path.insert(0, os.path.join(HERE, "..", d))

import torch._dynamo.utils as du  # noqa: E402
from hf_models import HF_VOCAB, hf_llama  # noqa: E402


def main() -> None:
    which = sys.argv[1]
    if which.startswith("tiny"):
        model, vocab, lengths = (
            hf_llama(attn_implementation="sdpa").cuda(),
            HF_VOCAB,
            (16, 12, 14, 10),
        )
    else:
        from oom_sweep import MODELS, build

        spec = MODELS["llama3.2-1b"]
        model = build(spec, 256, host=which.endswith("host"))
        vocab, lengths = spec["vocab"], (256, 192, 224)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend = "protrain" if "protrain" in which else "inductor"
    options = (
        {"memory_budget": "3GiB"} if backend == "protrain" and which.startswith("big") else None
    )
    compiled = torch.compile(model, backend=backend, options=options)
    for n in lengths:
        x = torch.randint(0, vocab, (2, n), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("RESULT", which, "graphs:", du.counters["stats"]["unique_graphs"], flush=True)


if __name__ == "__main__":
    main()
