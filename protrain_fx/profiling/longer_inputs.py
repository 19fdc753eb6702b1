"""Inputs larger than a dynamic graph's plan was made for, told at the call that brings them.

A graph dynamo traced with symbolic sizes (dynamic shapes: the second sequence length of a loop)
serves every later size, but protrain plans it at the sizes it was traced at, the hints of its
example inputs: the profile, the chosen knobs and the predicted peak are that shape's. A later call
with larger inputs (a longer sequence, a larger batch) runs on that plan with more activations
than it counted, and is re-planned only if it runs out of memory (compiled_graph.ProtrainGraph).
:class:`LongerInputs` counts the elements of a call's tensor inputs other than parameters and,
once per new largest call, says in one line and in the plan's notes that its peak may pass the
prediction, so that a measured peak above it has its reason beside it."""

from __future__ import annotations

import logging

import torch

from protrain_fx import _compat
from protrain_fx.options import format_bytes

log = logging.getLogger("protrain_fx")


def elements(args, params: set[int]) -> int:
    """Elements of the tensors among ``args`` outside the positions ``params``, at their hint sizes
    where symbolic."""
    return sum(
        _compat.numel_hint(a)
        for i, a in enumerate(args)
        if i not in params and isinstance(a, torch.Tensor)
    )


class LongerInputs:
    """The planned inputs' elements (``examples``: a dynamic graph's example inputs) and the largest
    call's seen since."""

    def __init__(self, examples, params: set[int]):
        self.params = params
        self.planned = self.widest = elements(examples, params)

    def seen(self, plan, args) -> str | None:
        """The line said when ``args`` are larger than any call before (None otherwise)."""
        n = elements(args, self.params)
        if n <= self.widest:
            return None
        self.widest = n
        peak = (plan.predicted or {}).get("peak_bytes")
        msg = (
            f"inputs of {n:,} elements, {n / self.planned:.2f}x the {self.planned:,} its plan was "
            "made for (a dynamic graph is planned at the shape dynamo traced it at): activations "
            "grow with them, so the peak may pass the predicted "
            f"{format_bytes(peak) if peak else 'one'}; it re-plans if it runs out of memory"
        )
        log.warning("protrain: graph %s: %s", plan.graph_name, msg)
        plan.notes = [note for note in plan.notes if not note.startswith("inputs of ")] + [msg]
        return msg
