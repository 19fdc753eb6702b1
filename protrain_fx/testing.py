"""Parity harness: train a model eagerly and through backend="protrain" on the same data and compare.

Used by the test suite (CPU) and by ``benchmarks/cuda_parity.py`` (GPU); handy for users checking a model.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .plan import Plan, get_plan


def random_batches(n: int, batch: int, seq: int, vocab: int = 256, seed: int = 0, device="cpu"):
    """``n`` (tokens, targets) pairs of shape (batch, seq)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=g).to(device),
         torch.randint(0, vocab, (batch, seq), generator=g).to(device))
        for _ in range(n)
    ]


def train_steps(model, step_fn, data, *, lr=1e-3, weight_decay=0.1, autocast_dtype=None) -> list[float]:
    """One AdamW step per (x, y) in ``data`` with ``loss = step_fn(x, y)``; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for x, y in data:
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
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
    plan: Plan
    compiled: torch.nn.Module


def compare_with_eager(base: torch.nn.Module, data, options=None, **train_kw) -> ParityResult:
    """Train one copy of ``base`` eagerly and another through backend="protrain" on ``data``."""
    ref = copy.deepcopy(base)
    mine = copy.deepcopy(base)
    compiled = torch.compile(mine, backend="protrain", options=options)
    ref_losses = train_steps(ref, ref, data, **train_kw)
    losses = train_steps(mine, compiled, data, **train_kw)
    update = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), base.parameters()))
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    pabs = max((p - q).abs().max().item() for p, q in zip(mine.parameters(), ref.parameters()))
    return ParityResult(ref_losses, losses, rel, pabs, update, get_plan(compiled), compiled)
