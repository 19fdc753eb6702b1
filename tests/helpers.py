"""Shared test helpers: deterministic batches and the eager-vs-protrain parity harness."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import protrain_fx


def batches(n: int, batch: int, seq: int, vocab: int = 256, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
        for _ in range(n)
    ]


def train(model, step_fn, data, *, lr=1e-3, weight_decay=0.1, autocast_dtype=None) -> list[float]:
    """AdamW steps over ``data``; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    for x, y in data:
        with ctx:
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@dataclass
class ParityResult:
    ref_losses: list[float]
    losses: list[float]
    max_loss_rel: float
    max_param_abs: float
    max_param_update: float  # how far eager training moved the parameters (proves the steps did something)
    plan: protrain_fx.Plan
    compiled: torch.nn.Module


def run_parity(base: torch.nn.Module, data, options=None, **train_kw) -> ParityResult:
    """Train a copy of ``base`` eagerly and another through backend="protrain" on the same data."""
    ref = copy.deepcopy(base)
    mine = copy.deepcopy(base)
    compiled = torch.compile(mine, backend="protrain", options=options)
    ref_losses = train(ref, ref, data, **train_kw)
    losses = train(mine, compiled, data, **train_kw)
    update = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), base.parameters()))
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    pabs = max((p - q).abs().max().item() for p, q in zip(mine.parameters(), ref.parameters()))
    return ParityResult(ref_losses, losses, rel, pabs, update, protrain_fx.get_plan(compiled), compiled)
