"""Gradients the training loop keeps from one backward to the next forward, told apart at a
forward: resident parameters' gradients still there and not all zero are gradient accumulation (the
next backward adds to them: at least two micro-steps per ``opt.step()``, which later plans price,
plan_cache.micro_steps); all zero, ``zero_grad(set_to_none=False)`` kept them. Either way the plan
must count resident gradients through the whole step (compiled_graph.ProtrainGraph._kept_grads
re-plans once for them)."""

from __future__ import annotations

import torch

LOOKED_AT = 4  # resident gradients whose values tell accumulation from kept zeros


def why_kept(held: list, optimizer) -> str:
    """Why the loop keeps gradients, ``held`` being resident gradients seen at a forward; a loop
    that accumulates tells ``optimizer`` that it saw at least two micro-steps."""
    if any(any_nonzero(g) for g in held[:LOOKED_AT]):
        if optimizer is not None and not getattr(optimizer, "_protrain_micro_steps", None):
            optimizer._protrain_micro_steps_seen = 2
        return (
            "the loop keeps gradients between steps (a resident parameter's gradient from "
            "the last backward was there, not zeroed, at a forward: gradient accumulation)"
        )
    return (
        "the loop keeps gradients between steps (resident parameters' gradients were there, "
        "zeroed, at a forward: zero_grad(set_to_none=False))"
    )


def any_nonzero(grad: torch.Tensor) -> bool:
    """Whether a gradient (dense, or sparse from an ``nn.Embedding(sparse=True)``) has a value that
    is not zero."""
    g = grad.detach()
    if g.is_sparse:
        g = g.coalesce().values()
    elif g.layout != torch.strided:
        g = g.to_dense()
    return bool(g.ne(0).any())
