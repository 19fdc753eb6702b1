"""Finding the user's optimizer when the compile was not given one.

Offloaded chunks are stepped by protrain (protrain_fx/runtime/hybrid_optim.py), so it must know the
optimizer before the first step. ``torch.compile`` compiles at the first call of the model, and in
ordinary scripts the optimizer exists by then (``opt = AdamW(model.parameters())`` before the loop),
so at compile time :func:`find_optimizer` looks through the live ``torch.optim.Optimizer`` objects
(the garbage collector's list, once per compile) for those holding any of the graph's parameters.
Exactly one Adam/AdamW among them: protrain takes it over as if it were given
(``options={"optimizer": opt}``), from the first step, and says so in the plan. Several, or only
optimizers protrain cannot step (SGD, say): none is taken, the chunks stay resident, and the note
(and a budget error) says what to do.
"""

from __future__ import annotations

import gc

import torch

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)
# the flags protrain cannot honour on the optimizers it steps, and why
UNSUPPORTED_FLAGS = {
    "capturable": "offloaded chunks step on the host's cores, outside any CUDA graph",
    "differentiable": "offloaded chunks step outside autograd, so the step has no gradient",
}


def live_optimizers() -> list[torch.optim.Optimizer]:
    return [o for o in gc.get_objects() if torch.optim.Optimizer in type(o).__mro__]


def find_optimizer(params: list) -> tuple[torch.optim.Optimizer | None, str | None]:
    """``(the optimizer to take over or None, a note for the plan or None)`` for a graph's
    parameters."""
    ids = {id(p) for p in params if p is not None and p.requires_grad}
    if not ids:
        return None, None
    holders = [
        o
        for o in live_optimizers()
        if any(id(p) in ids for g in o.param_groups for p in g["params"])
    ]
    if not holders:
        return None, None
    ours = [o for o in holders if type(o) in SUPPORTED]
    if len(ours) == 1:
        opt = ours[0]
        n = sum(id(p) in ids for g in opt.param_groups for p in g["params"])
        return opt, (
            f"optimizer found: the {type(opt).__name__} over {n} of this graph's "
            "parameters, taken over as "
            "if given (pass options={'optimizer': opt} to choose another)"
        )
    names = ", ".join(sorted(type(o).__name__ for o in holders))
    if ours:
        return None, (
            f"several Adam/AdamW optimizers hold this graph's parameters ({names}): none "
            "taken, so every "
            "chunk stays resident; pass the one protrain should run as "
            "options={'optimizer': opt}"
        )
    return None, (
        f"the optimizer(s) over this graph's parameters ({names}) cannot step offloaded "
        "chunks (protrain "
        "supports torch.optim.Adam and AdamW), so every chunk stays resident"
    )
