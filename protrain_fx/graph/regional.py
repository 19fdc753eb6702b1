"""Regional compilation: a graph whose module is one of several blocks of the same structure.

With ``for b in model.layers: b.compile(backend="protrain")`` each block is compiled on its own,
and dynamo may run one compiled graph for all of them (or compile each separately when guards
differ). Either way every block's parameters, saved activations and resident chunks are live at
the end of forward at once, while the plan of one block's graph sees one block. So the automatic
plan of such a graph is chosen for the block's share of the budget: ``1/N`` of it for ``N`` blocks
of that structure in the block's container, with the parameters of all ``N`` counted as placed by
the plan (not as memory of others). What runs outside the blocks (embedding, head, loss) is not
planned under regional compilation; the plan's notes say so, and the gradients and optimizer
state that the parameters outside the blocks will hold once they train eagerly are taken out of the
budget first (:func:`outside_params`, ``budgets.eager_growth``).

The container is found from the block itself (the ``_modules`` dict that holds it, through the
garbage collector's referrers), since a module does not know its parent. A block compiled as
``layers[i] = torch.compile(layers[i], ...)`` sits in its list inside the wrapper torch.compile
made (as its ``_orig_mod``): the wrapper's container is the list, and the blocks are the wrapped
modules there (before, each such block was planned for the whole budget).
"""

from __future__ import annotations

import gc

import torch.nn as nn


def _signature(m: nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def _container_of(module: nn.Module) -> tuple[dict, str, dict] | None:
    """The ``_modules`` dict of the module that holds ``module`` (the first found), with its key
    there and the holder's ``__dict__``. (A ``_modules`` dict is referred to by its owner's
    ``__dict__``, whose ``_modules`` entry it is.)"""
    for ref in gc.get_referrers(module):
        if not isinstance(ref, dict):
            continue
        key = next((k for k, v in ref.items() if v is module), None)
        if key is None:
            continue
        for o in gc.get_referrers(ref):
            if isinstance(o, dict) and o.get("_modules") is ref:
                return ref, key, o
    return None


def _unwrapped(m):
    """The module torch.compile wrapped (``OptimizedModule._orig_mod``), or ``m``."""
    inner = m.__dict__.get("_modules", {}).get("_orig_mod") if isinstance(m, nn.Module) else None
    return inner if inner is not None and type(m).__name__ == "OptimizedModule" else m


def siblings(root) -> list[nn.Module]:
    """The blocks of ``root``'s structure (same class, same parameter names, shapes and dtypes)
    in the container that holds ``root``, ``root`` included; ``[root]`` when ``root`` is no such
    block (a whole model, a module held by no container, a container of other kinds)."""
    if not isinstance(root, nn.Module) or not any(True for _ in root.parameters()):
        return [root] if root is not None else []
    found = _container_of(root)
    if found is not None and found[1] == "_orig_mod":  # layers[i] = torch.compile(layers[i])
        holder = [w for w in gc.get_referrers(found[2]) if getattr(w, "__dict__", None) is found[2]]
        found = _container_of(holder[0]) if holder else None
    if found is None:
        return [root]
    modules, key, _ = found
    if not key.isdigit():  # an attribute (model.head), not an entry of a list of blocks
        return [root]
    sig = _signature(root)
    same = [_unwrapped(m) for k, m in list(modules.items()) if k.isdigit()]
    same = [m for m in same if isinstance(m, nn.Module) and (m is root or _signature(m) == sig)]
    return same if len(same) > 1 else [root]


def outside_params(blocks: list, optimizers: list) -> list:
    """The parameters that the optimizers holding ``blocks``' parameters hold besides those: the
    embedding, final norm and head of a model whose blocks are compiled one by one (one pass over
    the live optimizers; a model is not found from its blocks without the garbage collector's
    referrers, 0.6 s a time on an HF Llama of 16 layers). ``optimizers``: the live ones
    (``optimizer_lookup.live_optimizers()``)."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    out, seen = [], set(inside)
    for o in optimizers:
        held = [p for g in o.param_groups for p in g["params"]]
        if any(id(p) in inside for p in held):
            for p in held:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out
