"""A backward that runs out of device memory, redone inside ``loss.backward()`` (issue 21,
deliverable 2), on the GPU: where the CPU tests cannot look (autograd's CUDA thread, CUDA random
numbers, bf16 autocast, Inductor's code).

Two runs of one Hugging Face Llama (tied embeddings, GQA, attention dropout 0.1, its own
``labels=`` loss) from the same init on the same batches, bf16 autocast, AdamW, protrain with every
chunk offloaded under a budget: one uninterrupted, one where a CUDA out-of-memory error is raised
inside the second step's backward after its first chunk's gradients were handed over (injected:
``ChunkStore.grad_ready`` raises once). The training loop has no retry. Reported: whether the loop
saw an exception, the line protrain logged, the losses of both runs and the largest difference of
their final weights (the redone step runs a re-planned, recompiled graph: Inductor's rounding may
differ, nothing else).

``--automatic``: the automatic budget instead (the process capped at the reserve plus half the
model's training state, so that some chunks stay resident and the rest are offloaded), and the
error raised in the third step's backward, after two optimizer steps made the resident chunks'
moments: the re-plan's budget must count them as the plan's own (memory.placed_bytes).

    python benchmarks/redo_check.py --out $OUT/redo_check [--automatic]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

STEPS = 4
DEV = "cuda"
AUTOMATIC = False


def small_llama(device, *, vocab: int, ffn: int, layers: int, **extra):
    """An HF ``LlamaForCausalLM`` of width 256 (GQA 4/2 heads, tied embeddings), seed 0, in train
    mode on ``device``; ``extra``: more config fields (also warm_cache_probe.py's model)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        **extra,
    )
    return transformers.LlamaForCausalLM(cfg).to(device).train()


def build():
    # --automatic: larger (22 M parameters), so that the training state, not the CUDA context's
    # workspaces, decides what stays resident
    return small_llama(
        DEV,
        vocab=32000 if AUTOMATIC else 8192,
        ffn=2048 if AUTOMATIC else 688,
        layers=8 if AUTOMATIC else 4,
        attention_dropout=0.1,
        attn_implementation="eager",
    )


def _smallest_budget() -> int:
    """The smallest budget that fits a plan for this model and batch (NoPlanFits says it when
    asked for a 1-byte budget)."""
    from protrain_fx.errors import NoPlanFits

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(
        model, backend="protrain", options={"optimizer": opt, "memory_budget": 1}
    )
    x = torch.randint(0, 8192, (4, 256), device=DEV)
    try:
        compiled(input_ids=x, labels=x)
    except Exception as e:  # dynamo wraps the backend's error
        cause = e
        while cause is not None and not isinstance(cause, NoPlanFits):
            cause = cause.__cause__ or getattr(cause, "inner_exception", None)
        if cause is None:
            raise
        torch._dynamo.reset()
        return cause.min_device_bytes
    raise RuntimeError("a 1-byte budget was accepted")


def run(inject_at: int | None, said: list) -> dict:
    from protrain_fx.runtime.chunk_store import ChunkStore

    torch._dynamo.reset()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    options = {"optimizer": opt, "memory_budget": 16 * nbytes, "n_persist": 0}
    if AUTOMATIC and DEV == "cuda":  # states (weights, gradients, two moments): 4x; half of it
        # above the smallest plan's need (activations, buffers) and the 1 GiB reserve: a cap of
        # the reserve plus half the states alone left the smallest plan no room (run 26)
        smallest = _smallest_budget()
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        options = {"optimizer": opt}
        cap = (1 << 30) + smallest + 2 * nbytes
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.mem_get_info()[1])
        print(
            f"capped at {cap / 2**30:.3f} GiB (the smallest plan {smallest / 2**30:.3f}); "
            f"states {4 * nbytes / 2**30:.3f}"
        )
    compiled = torch.compile(model, backend="protrain", options=options)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 8192, (4, 256), generator=g).to(DEV) for _ in range(STEPS)]
    torch.manual_seed(2)
    real = ChunkStore.grad_ready
    calls = {"n": 0, "raised": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == inject_at:
            calls["raised"] += 1
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 1.00 GiB (injected)"
            )
        return real(self, *a, **k)

    losses, seen, t0 = [], None, time.perf_counter()
    try:
        for i, x in enumerate(data):
            if i == (2 if AUTOMATIC else 1) and inject_at:
                ChunkStore.grad_ready = flaky
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
                loss = compiled(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    except Exception as e:  # the loop has no retry: any exception here is a failure
        import traceback

        seen = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    finally:
        ChunkStore.grad_ready = real
    import protrain_fx

    plan = protrain_fx.get_plan(compiled)
    return {
        "plan": None if plan is None else plan.summary().splitlines()[:3] + plan.notes,
        "losses": losses,
        "exception_seen_by_loop": seen,
        "injected": calls["raised"],
        "seconds": round(time.perf_counter() - t0, 1),
        "state": {k: v.detach().float().cpu() for k, v in model.state_dict().items()},
        "logged": list(said),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    ap.add_argument("--automatic", action="store_true", help="see the module docstring")
    args = ap.parse_args()
    global DEV, AUTOMATIC
    DEV, AUTOMATIC = args.device, args.automatic

    said: list = []

    class Catch(logging.Handler):
        def emit(self, rec):
            if "out of device memory" in rec.getMessage():
                said.append(rec.getMessage())

    logging.getLogger("protrain_fx").addHandler(Catch())
    plain = run(None, said)
    said.clear()
    redone = run(1 if AUTOMATIC else 2, said)
    diff = max((plain["state"][k] - redone["state"][k]).abs().max().item() for k in plain["state"])
    rel = (
        max(abs(a - b) / abs(a) for a, b in zip(plain["losses"], redone["losses"]))
        if len(redone["losses"]) == len(plain["losses"])
        else None
    )
    out = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
        "torch": torch.__version__,
        "uninterrupted": {k: v for k, v in plain.items() if k != "state"},
        "redone": {k: v for k, v in redone.items() if k != "state"},
        "loss_rel_max": rel,
        "final_weights_max_abs_diff": diff,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
