"""Parity harness: train a model eagerly and through backend="protrain" on the same data and
compare.

Used by the test suite (CPU) and by ``benchmarks/cuda_parity.py`` (GPU); handy for users checking a
model.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from protrain_fx.plan.plan import Plan, get_plan


def stores_of(model: torch.nn.Module) -> list:
    """The chunk stores that hold ``model``'s parameters, in the order of their first parameter
    (one per region when the model is compiled in regions, protrain_fx/graph/regions.py)."""
    from protrain_fx.runtime.chunk_store import store_of

    out = []
    for p in model.parameters():
        s = store_of(p)
        if s is not None and s not in out:
            out.append(s)
    return out


def random_batches(n: int, batch: int, seq: int, vocab: int = 256, seed: int = 0, device="cpu"):
    """``n`` (tokens, targets) pairs of shape (batch, seq)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (batch, seq), generator=g).to(device),
            torch.randint(0, vocab, (batch, seq), generator=g).to(device),
        )
        for _ in range(n)
    ]


def make_adamw(
    model: torch.nn.Module, *, lr=1e-3, weight_decay=0.1, groups: str = "one", fused=None
):
    """AdamW over ``model``; ``groups="decay_split"`` puts matrices in a weight-decay group and the
    rest in a group without decay (two param groups with different hyperparameters)."""
    params = list(model.parameters())
    if groups == "decay_split":
        spec = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    else:
        spec = params
    kw = {} if fused is None else {"fused": fused}
    return torch.optim.AdamW(spec, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), **kw)


def train_steps(
    model,
    step_fn,
    data,
    *,
    opt=None,
    lr=1e-3,
    weight_decay=0.1,
    autocast_dtype=None,
    micro_steps=1,
    clip=None,
    scheduler=None,
    groups="one",
) -> list[float]:
    """Optimizer steps over ``data`` with ``loss = step_fn(x, y)``: ``micro_steps`` batches per step
    (losses averaged), optional ``clip`` (max global grad norm) and ``scheduler(opt)`` (an LR
    scheduler factory). Returns the loss of every micro-step."""
    opt = (
        opt
        if opt is not None
        else make_adamw(model, lr=lr, weight_decay=weight_decay, groups=groups)
    )
    sched = scheduler(opt) if scheduler is not None else None
    losses = []
    for i, (x, y) in enumerate(data):
        ctx = (
            torch.autocast(x.device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else nullcontext()
        )
        with ctx:
            loss = step_fn(x, y)
        (loss / micro_steps).backward()
        losses.append(loss.item())
        if (i + 1) % micro_steps == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    return losses


def steps_with(call, opts: list, data, loss_fn=lambda call, x, y: call(x, y)) -> list[float]:
    """One step per batch of ``data``, every optimizer of ``opts`` stepping (in order) and zeroing
    after backward; the losses."""
    losses = []
    for x, y in data:
        loss = loss_fn(call, x, y)
        loss.backward()
        losses.append(loss.item())
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
    return losses


@dataclass
class ParityResult:
    ref_losses: list[float]
    losses: list[float]
    max_loss_rel: float
    max_param_abs: float
    # how far eager training moved the parameters (proves the steps did something)
    max_param_update: float
    plan: Plan
    compiled: torch.nn.Module
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    ref: torch.nn.Module
    ref_opt: torch.optim.Optimizer


def compare_with_eager(
    base: torch.nn.Module,
    data,
    options=None,
    *,
    give_optimizer: bool = False,
    fused=None,
    **train_kw,
) -> ParityResult:
    """Train one copy of ``base`` eagerly and another through backend="protrain" on ``data``. With
    ``give_optimizer`` the protrain copy's AdamW is passed as ``options["optimizer"]`` (needed
    whenever chunks are offloaded). Parameters are compared through ``state_dict()`` (offloaded ones
    live on the host)."""
    ref = copy.deepcopy(base)
    mine = copy.deepcopy(base)
    opt_kw = {k: train_kw[k] for k in ("lr", "weight_decay", "groups") if k in train_kw}
    opt_kw["fused"] = fused
    ref_opt, opt = make_adamw(ref, **opt_kw), make_adamw(mine, **opt_kw)
    options = dict(options or {})
    if give_optimizer:
        options["optimizer"] = opt
    compiled = torch.compile(mine, backend="protrain", options=options)
    ref_losses = train_steps(ref, ref, data, opt=ref_opt, **train_kw)
    losses = train_steps(mine, compiled, data, opt=opt, **train_kw)
    base_sd, ref_sd, mine_sd = base.state_dict(), ref.state_dict(), mine.state_dict()
    update = max((ref_sd[k].cpu() - base_sd[k].cpu()).abs().max().item() for k in ref_sd)
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    pabs = max((mine_sd[k].cpu() - ref_sd[k].cpu()).abs().max().item() for k in ref_sd)
    return ParityResult(
        ref_losses, losses, rel, pabs, update, get_plan(compiled), compiled, mine, opt, ref, ref_opt
    )
