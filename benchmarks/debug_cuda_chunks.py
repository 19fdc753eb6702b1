"""Which variant of a small GPT breaks parity with offloaded fp32 chunks on CUDA (debugging aid)."""
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

VARIANTS = {
    "inductor": ({}, {}, {}),
    "eager_compiler": ({}, {"compiler": "eager"}, {}),
    "no_bias": ({"bias": False}, {}, {}),
    "untied": ({"tie_embeddings": False}, {}, {}),
    "n_buffer4": ({}, {"n_buffer": 4}, {}),
    "sync": ({}, {}, {"PROTRAIN_DEBUG_SYNC": "1"}),
    "bf16": ({}, {}, {"AUTOCAST": "1"}),
}


def one(name):
    from models import build

    from protrain_fx.testing import compare_with_eager, random_batches

    model_kw, opts, _ = VARIANTS[name]
    torch.manual_seed(0)
    base = build("gpt", **{"n_layer": 4, "n_embd": 512, "n_head": 8, "block_size": 256, "vocab_size": 4096,
                           **model_kw}).cuda()
    data = random_batches(3, 8, 256, vocab=4096, device="cuda")
    ac = torch.bfloat16 if os.environ.get("AUTOCAST") else None
    r = compare_with_eager(base, data, {"n_persist": 0, "chunk_size": "8MiB", **opts}, give_optimizer=True,
                           autocast_dtype=ac)
    print(f"{name:15s} loss rel {r.max_loss_rel:.2e} param abs {r.max_param_abs:.2e} first losses "
          f"{r.losses[0]:.6f}/{r.ref_losses[0]:.6f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
    else:
        for name, (_, _, env) in VARIANTS.items():
            subprocess.run([sys.executable, __file__, name], env={**os.environ, **env}, timeout=120)
