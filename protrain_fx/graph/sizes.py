"""Concrete values for sizes that may be symbolic (dynamic shapes), without adding guards.

A graph dynamo traced with symbolic sizes serves every later size, but protrain measures and plans
it at concrete ones: by default its example inputs' (the symbols' hints, the sizes dynamo traced it
at); ``int()`` on a symbolic size would instead specialize the graph to one shape, a guard and a
compile per size. Inside :func:`planned_at` every such reading takes the sizes of one call instead,
a larger one than the graph was planned for (profiling/longer_inputs.py): the static profile, the
plan cache's keys, the profiled step's inputs and so the search see that call's activations, while
the code compiled stays symbolic. Allocates nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from protrain_fx import _compat

# (symbol -> value, the call's inputs) while planning at a call's sizes (planned_at)
_AT: contextvars.ContextVar[tuple[dict, list] | None] = contextvars.ContextVar(
    "protrain_planned_at", default=None
)


def size_hint(x, fallback: int = 1) -> int:
    """``x`` (an int, or a SymInt at its hint or at the sizes of :func:`planned_at`)."""
    if isinstance(x, int):
        return x
    node = getattr(x, "node", None)
    at = _AT.get()
    if at is not None and node is not None and (v := _evaluated(node, at[0])) is not None:
        return v
    return _compat.symint_hint(x, fallback)


def numel_hint(t: torch.Tensor) -> int:
    """Elements of a (possibly symbolically shaped) tensor, as :func:`size_hint` reads sizes."""
    n = 1
    for d in t.shape:
        n *= size_hint(d)
    return n


def _evaluated(node, values: dict) -> int | None:
    expr = getattr(node, "expr", None)
    if expr is None or not getattr(expr, "free_symbols", None):
        return None
    if not expr.free_symbols & values.keys():
        return None
    import sympy

    v = expr.xreplace({k: sympy.Integer(n) for k, n in values.items()})
    v = v.xreplace(_compat.shape_env_hints(node))
    try:
        return int(v)
    except TypeError:  # a symbol neither the call nor the shape environment gives a value
        return None


def call_values(examples: list, fakes: dict, args) -> dict:
    """The values a call's ``args`` give the symbols of a graph's example inputs: a SymInt input's
    symbol its int, a symbolic dimension of a tensor input (``fakes``: the fakes dynamo traced the
    real ``examples`` as, by position) the call's size there. Only sizes that are one symbol (not
    ``s0 - 1``) are read."""
    values: dict = {}

    def read(size, value) -> None:
        expr = getattr(getattr(size, "node", None), "expr", None)
        if expr is not None and getattr(expr, "is_Symbol", False) and isinstance(value, int):
            values.setdefault(expr, value)

    for i, (e, a) in enumerate(zip(examples, args)):
        e = fakes.get(i, e)
        if isinstance(e, torch.SymInt):
            read(e, a)
        elif isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and e.dim() == a.dim():
            for d, n in zip(e.shape, a.shape):
                read(d, n)
    return values


@contextlib.contextmanager
def planned_at(values: dict, inputs: list):
    """Read symbolic sizes at ``values`` (:func:`call_values`) and profile on ``inputs`` (that
    call's), inside."""
    token = _AT.set((values, list(inputs)))
    try:
        yield
    finally:
        _AT.reset(token)


def profiled_inputs(example_inputs: list) -> list:
    """The inputs a profiled step runs on: the graph's example inputs, or inside
    :func:`planned_at` the call's."""
    at = _AT.get()
    return list(example_inputs) if at is None else list(at[1])


def planned_key() -> str | None:
    """What the plan cache's key adds inside :func:`planned_at` (the sizes), else None."""
    at = _AT.get()
    return None if at is None else repr(sorted((str(k), v) for k, v in at[0].items()))
