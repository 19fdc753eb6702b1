"""Inputs larger than a dynamic graph's plan was made for: planned again at their sizes where the
plan has no room for them, told where it has.

A graph dynamo traced with symbolic sizes (dynamic shapes: the second sequence length of a loop)
serves every later size, but protrain plans it at the sizes it was traced at, the hints of its
example inputs: the profile, the chosen knobs and the predicted peak are that shape's. A later call
with larger inputs (a longer sequence, a larger batch) brings more activations than that plan
counted. :class:`LongerInputs` counts the elements of a call's tensor inputs other than parameters
and, once per new largest call of an automatic plan, estimates the plan's peak at that size: the
predicted peak plus the growth of what grows with the inputs (the saved activations, backward's
working set), in proportion. Where that passes the plan's budget, the graph is planned again at
the call's sizes before the call runs (compiled_graph.ProtrainGraph; graph/sizes.py reads the
symbolic sizes at that call's values and profiles on its inputs; the code stays symbolic, so
nothing is compiled by dynamo again), at most ``MAX_REPLANS`` times a graph; where it fits, one
line and a plan note say so. Running out of memory anyway is survived as for any plan (a re-plan
with a lower budget)."""

from __future__ import annotations

import logging

import torch

from protrain_fx.errors import NoPlanFits
from protrain_fx.graph import sizes
from protrain_fx.options import format_bytes

log = logging.getLogger("protrain_fx")

# what grows with the inputs, among the predicted breakdown's bytes (plan/cost_model.py): the saved
# activations and backward's working set (logits, loss), not the tail (the embedding's dense
# gradient: the table's size)
GROWING = ("activation_bytes", "transient_bytes")


def elements(args, params: set[int]) -> int:
    """Elements of the tensors among ``args`` outside the positions ``params``, at their hint sizes
    where symbolic."""
    return sum(
        sizes.numel_hint(a)
        for i, a in enumerate(args)
        if i not in params and isinstance(a, torch.Tensor)
    )


def peak_at(predicted: dict, ratio: float) -> int | None:
    """The plan's reserved peak estimated for inputs ``ratio`` times those it was planned at (None
    where the plan predicted none)."""
    peak = predicted.get("peak_bytes")
    if not peak:
        return None
    grows = sum((predicted.get("breakdown") or {}).get(k) or 0 for k in GROWING)
    fragmentation = (predicted.get("profiled") or {}).get("fragmentation") or 1.0
    return int(peak + max(0.0, ratio - 1) * grows * fragmentation)


class LongerInputs:
    """A dynamic graph's planned inputs' elements (``examples``: its example inputs; ``fakes``: the
    fakes dynamo traced their real tensors as, by position), the largest call's seen since, and the
    re-plans made for larger calls."""

    MAX_REPLANS = 4

    def __init__(self, examples, fakes: dict, params: set[int]):
        self.examples, self.fakes, self.params = examples, fakes, params
        self.planned = self.widest = elements(examples, params)
        self.replans = 0

    def seen(self, graph, args) -> None:
        """A call of ``graph`` (compiled_graph.ProtrainGraph) on ``args``: larger than any before,
        it is planned again at their sizes where its automatic plan has no room for them (see the
        module docstring), or said to go on under the plan."""
        n = elements(args, self.params)
        if n <= self.widest:
            return
        self.widest = n
        plan = graph.plan
        predicted = plan.predicted or {}
        budget, peak = predicted.get("budget_bytes"), peak_at(predicted, n / self.planned)
        head = (
            f"inputs of {n:,} elements, {n / self.planned:.2f}x the {self.planned:,} its plan was "
            "made for (a dynamic graph is planned at the shape dynamo traced it at)"
        )
        replan = graph.choice is not None and self.replans < self.MAX_REPLANS
        if replan and peak and budget and peak > budget:
            self._replan(
                graph,
                args,
                n,
                f"{head}: its peak there, about {format_bytes(peak)}, would pass the budget of "
                f"{format_bytes(budget)}; planning it again at these sizes",
            )
            return
        msg = f"{head}: activations grow with them" + (
            f", to a peak of about {format_bytes(peak)} (budget {format_bytes(budget)})"
            if peak and budget
            else ", so the peak may pass the predicted one"
        )
        msg += "; it re-plans if it runs out of memory"
        log.warning("protrain: graph %s: %s", plan.graph_name, msg)
        plan.notes = [note for note in plan.notes if not note.startswith("inputs of ")] + [msg]

    def _replan(self, graph, args, n: int, why: str) -> None:
        self.replans += 1
        log.warning("protrain: graph %s: %s", graph.plan.graph_name, why)
        try:
            with sizes.planned_at(sizes.call_values(self.examples, self.fakes, args), args):
                graph.recompile(args, tuple(graph.choice.failed_peaks), f"re-planned: {why}")
            self.planned = n
        except NoPlanFits as e:  # nor at a larger size: the plan goes on, said once
            self.replans = self.MAX_REPLANS
            log.warning(
                "protrain: graph %s: no plan fits these sizes (%s); going on under the plan as "
                "it is",
                graph.plan.graph_name,
                str(e).splitlines()[0][:300],
            )
