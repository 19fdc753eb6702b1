"""What the suite measures: the scenarios (a model family, its configuration, batch, sequence
length, memory cap and the systems that run it) and the facts of a model that a row carries (its
label, parameter count and model FLOPs per token, from the model built on the meta device).
:func:`base_row` is a row's identity before anything runs: every row of every output starts from it,
with the ``ROW_KEYS`` columns.
"""

from __future__ import annotations

import json

import torch
from peers import SYSTEMS, build

FLOPS_FORMULA = (
    "6 * N + 12 * L * d * seq FLOPs per token (N: parameters outside embedding "
    "tables, L layers, width d; PaLM's model-FLOPs formula without causal halving; "
    "recomputation not counted)"
)
ROW_KEYS = (
    "scenario",
    "system",
    "model",
    "params",
    "cap_gib",
    "batch",
    "seq",
    "tokens_per_s",
    "tflops",
    "peak_gib",
    "ratio_to_ceiling",
    "error",
)
SEQ = 1024
GPT_1_4B = dict(
    n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=SEQ, tie_embeddings=False
)
TINY_GPT = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32, tie_embeddings=False)


def llama_cfg(n_layer: int) -> dict:
    return dict(
        n_layer=n_layer,
        dim=4096,
        n_head=32,
        n_kv_head=32,
        ffn_dim=11008,
        vocab_size=32000,
        max_seq_len=SEQ,
        tie_embeddings=False,
    )


def search_cfg(args, n_layer: int) -> dict:
    w = args.search_width
    return dict(GPT_1_4B, n_layer=n_layer, n_embd=w, n_head=max(1, w // 128))


def scenarios(args) -> dict[str, dict]:
    """name -> {kind, cfg, batch, seq, cap_gib, systems}. ``maxmodel`` (cfg None) is run by
    :func:`size_search.search`."""
    every = tuple(SYSTEMS)
    if args.smoke:
        return {
            "smoke": dict(
                kind="gpt",
                cfg=TINY_GPT,
                batch=2,
                seq=TINY_GPT["block_size"],
                cap_gib=0.0,
                systems=every,
            )
        }
    llama = llama_cfg(args.llama_layers)
    return {
        "gpt1.4b": dict(kind="gpt", cfg=GPT_1_4B, batch=8, seq=SEQ, cap_gib=0.0, systems=every),
        "gpt1.4b-cap24": dict(
            kind="gpt", cfg=GPT_1_4B, batch=8, seq=SEQ, cap_gib=24.0, systems=every
        ),
        "llama": dict(
            kind="llama",
            cfg=llama,
            batch=args.llama_batch,
            seq=SEQ,
            cap_gib=0.0,
            systems=("compile",),
        ),
        "llama-cap40": dict(
            kind="llama", cfg=llama, batch=args.llama_batch, seq=SEQ, cap_gib=40.0, systems=every
        ),
        "maxmodel": dict(
            kind="gpt",
            cfg=None,
            batch=args.search_batch,
            seq=SEQ,
            cap_gib=0.0,
            systems=every,
            steps=args.search_steps,
            warmup=args.search_warmup,
        ),
    }


# -------------------------------------------------------------------------------------- model facts
def model_label(kind: str, cfg: dict) -> str:
    if kind == "gpt":
        return f"GPT d{cfg['n_embd']} L{cfg['n_layer']} v{cfg['vocab_size']}"
    return f"LLaMA d{cfg['dim']} L{cfg['n_layer']} ffn{cfg['ffn_dim']} v{cfg['vocab_size']}"


_STATS: dict = {}


def model_stats(kind: str, cfg: dict, seq: int) -> tuple[int, float]:
    """(parameters, model FLOPs per token: FLOPS_FORMULA), from the model built on the meta
    device."""
    key = (kind, json.dumps(cfg, sort_keys=True), seq)
    if key not in _STATS:
        with torch.device("meta"):
            m = build(kind, **cfg)
        n = sum(p.numel() for p in m.parameters())
        matmul = {id(mod.weight) for mod in m.modules() if isinstance(mod, torch.nn.Linear)}
        emb = sum(
            mod.weight.numel()
            for mod in m.modules()
            if isinstance(mod, torch.nn.Embedding) and id(mod.weight) not in matmul
        )
        d = cfg.get("n_embd", cfg.get("dim"))
        _STATS[key] = (n, 6.0 * (n - emb) + 12.0 * cfg["n_layer"] * d * seq)
    return _STATS[key]


def base_row(scenario: str, system: str, sc: dict) -> dict:
    params, flops = model_stats(sc["kind"], sc["cfg"], sc["seq"])
    row = dict.fromkeys(ROW_KEYS)
    row.update(
        scenario=scenario,
        system=system,
        model=model_label(sc["kind"], sc["cfg"]),
        params=params,
        cap_gib=sc["cap_gib"],
        batch=sc["batch"],
        seq=sc["seq"],
        flops_per_token=flops,
    )
    return row
