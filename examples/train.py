"""Train a small byte-level GPT on Shakespeare with ``torch.compile(model, backend="protrain")``.

    python examples/train.py                      # CPU (or the GPU when one is present), 200 steps
    python examples/train.py --device cuda --layers 8 --width 512 --batch 32 --seq 256
    python examples/train.py --model llama --compiler eager --dump-dir /tmp/protrain_dumps
    torchrun --nproc-per-node=2 examples/train.py --device cuda   # data parallel (gloo on the CPU)

Prints the loss, tokens/s and the protrain plan summary. The text
(examples/data/tiny_shakespeare.txt) is the first 256 kB of the public-domain "tiny shakespeare"
corpus; tokens are its bytes (vocabulary 256).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_shakespeare.txt")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N or auto (the GPU when present)"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="autocast dtype; auto = bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument(
        "--no-compile", action="store_true", help="run plain eager PyTorch (the reference)"
    )
    p.add_argument("--dump-dir", default=None)
    p.add_argument(
        "--memory-budget",
        default=None,
        help="device bytes the plan must fit, e.g. 2GiB (default on CUDA: what is free)",
    )
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


def load_tokens(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    with open(DATA, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    n = int(0.9 * len(data))
    return data[:n].to(device), data[n:].to(device)


def get_batch(
    data: torch.Tensor, batch: int, seq: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - seq - 1, (batch,), generator=gen).to(data.device)
    offsets = torch.arange(seq + 1, device=data.device)
    chunk = data[ix[:, None] + offsets]
    return chunk[:, :-1], chunk[:, 1:]


def setup_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on CUDA, gloo on the CPU), one
    GPU per local rank. protrain shards offloaded chunks over the ranks and averages gradients;
    --batch is per rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def mean_over_ranks(x: float, world: int, device: torch.device) -> float:
    """The mean of ``x`` over the ranks (for logging: each rank trains on its own batches)."""
    if world == 1:
        return x
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t)
    return t.item() / world


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = (
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "auto"
        else torch.device(args.device)
    )
    rank, world, device = setup_distributed(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[args.dtype]
    torch.manual_seed(args.seed)
    if args.model == "gpt":
        model = build(
            "gpt", n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.seq
        )
    else:
        model = build(
            "llama",
            n_layer=args.layers,
            dim=args.width,
            n_head=args.heads,
            n_kv_head=max(1, args.heads // 2),
            ffn_dim=int(8 * args.width / 3) // 8 * 8,
            max_seq_len=args.seq,
        )
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    def lr_factor(step: int) -> float:  # linear warmup, then cosine to 10%
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    if args.no_compile:
        step_model = model
    else:
        # the optimizer lets the automatic plan offload chunks (on CUDA, or wherever a budget is
        # given)
        options = {"compiler": args.compiler, "optimizer": opt}
        if args.dump_dir:
            options["dump_dir"] = args.dump_dir
        if args.memory_budget:
            options["memory_budget"] = args.memory_budget
        step_model = torch.compile(model, backend="protrain", options=options)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    train, val = load_tokens(device)
    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches
    say(
        f"protrain-fx example: {args.model} with {n_params / 1e6:.2f} M parameters on {device} "
        f"({'eager' if args.no_compile else 'backend=protrain, compiler=' + args.compiler}, "
        f"{dtype}), "
        f"batch {args.batch} x {args.seq} "
        f"tokens{f' per rank, {world} ranks' if world > 1 else ''}, "
        f"{len(train)} training tokens",
        flush=True,
    )

    losses, t_start, t_window, tok_window = [], time.perf_counter(), time.perf_counter(), 0
    first_step_s = None
    for step in range(args.steps):
        x, y = get_batch(train, args.batch, args.seq, gen)
        with autocast:
            loss = step_model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        # .item() synchronizes: the timings are real
        losses.append(mean_over_ranks(loss.item(), world, device))
        tok_window += x.numel() * world
        if step == 0:
            first_step_s = time.perf_counter() - t_start
            t_window, tok_window = time.perf_counter(), 0
            say(
                f"step    0  loss {losses[0]:.4f}  (first step incl. compilation: "
                f"{first_step_s:.1f} s)",
                flush=True,
            )
        elif (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            dt = time.perf_counter() - t_window
            say(
                f"step {step + 1:4d}  loss "
                f"{sum(losses[-args.log_every :]) / len(losses[-args.log_every :]):.4f}  "
                f"lr {sched.get_last_lr()[0]:.2e}  {tok_window / dt:,.0f} tokens/s",
                flush=True,
            )
            t_window, tok_window = time.perf_counter(), 0

    steady = (time.perf_counter() - t_start - first_step_s) / max(1, args.steps - 1)
    plan = None
    if not args.no_compile:
        import protrain_fx

        # the training graph's plan (validation compiles another)
        plan = protrain_fx.get_plan(step_model)
    with torch.no_grad(), autocast:
        vx, vy = get_batch(val, args.batch, args.seq, torch.Generator().manual_seed(0))
        val_loss = mean_over_ranks(step_model(vx, vy).item(), world, device)
    head, tail = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
    tokens_per_s = args.batch * args.seq * world / steady
    say(
        f"loss: first 10 steps {head:.4f} -> last 10 steps {tail:.4f}; validation loss "
        f"{val_loss:.4f}; "
        f"{tokens_per_s:,.0f} tokens/s over steps 2..{args.steps}"
    )
    if plan is not None:
        say(plan.summary())
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {
        "first_loss": head,
        "last_loss": tail,
        "val_loss": val_loss,
        "tokens_per_s": tokens_per_s,
    }


if __name__ == "__main__":
    main()
