"""Memory the training loop allocates outside the compiled graphs, between a trained model's forward
and its backward, measured in the first steps of a plan and budgeted by the next.

A plan budgets what its graph allocates. Between the forward's return and the backward the loop runs
its own code on the device: a loss on the returned logits in fp32
(``F.cross_entropy(out.logits.float(), ...)``), a distillation KL (fp32 copies of 128k-vocabulary
logits, 1002 MiB each at batch 2 x 1024), their backward; all of it beside the step's saved
activations, where the plan's peak is. Only the automatic budget's reserve held it, and on an H100 a
distillation loop ran out of memory there, in its own code, where protrain cannot redo the step
(benchmarks/results/distill_h100_run82a.md). So, during the first :data:`LOOKS` training calls of an
automatic plan's graph on a device whose budget is what the process may use (CUDA without a
``memory_budget``; one process, not data parallel), a *window* opens at the forward's return and
closes when the backward reaches the graph (a hook on its outputs: the loop's own backward ran by
then) or at its next forward on the same parameters (one graph that dynamo runs for every block of
a regional compilation is called for the other blocks inside the window: those calls are cut out
like other protrain calls, and a window is one look however many blocks it spans): the device's
peak allocated bytes in it (the allocator's peak counter,
reset at the window's start) less what was allocated at its start is what the loop held at most.
Calls of protrain graphs inside the window (a teacher's forward, the other blocks of a regional
compilation) are cut out: their own peaks are not read, and what they leave allocated (placed
chunks, outputs) is not the loop's. The graphs whose forwards the window spans are told
(``ProtrainGraph.loop_seen``); the measured bytes go into the plan's measured side and the plan
cache entry, and where they exceed what the plan left (its budget less its predicted peak) and half
the reserve (``budgets.loop_allowance``), the graph is planned again at its next call with its
budget less that excess: once in the run, and from the first plan of later runs of the same script
(the entry remembers). A frozen model placed beside it leaves that room too
(inference_placement._beside_training).

Before anything is measured (a first run's first plan) the plan budgets a *prior* read from the
graph's outputs: a graph that returns no scalar loss but tensors that need gradients (logits) is
taken to feed a loss the loop computes of its own, and an fp32 cross-entropy holds about
:data:`PRIOR_FP32_COPIES` fp32 copies of its input plus its gradient in the input's dtype: 14 bytes
per element of bf16 logits (the ``own_loss`` row of benchmarks/results/distill_h100_run83.md
measured 13.98). So a loop computing its own loss on 128k-vocabulary logits has its room at its
first step; where even the smallest plan leaves that loss short by more than the reserve's
unbudgeted half, the first call raises NoPlanFits instead (:func:`choose_beside_prior`). A block
compiled on its own (regional compilation) returns hidden states that feed the
next block; the head and loss run eagerly after the last block, inside its window: its prior is
that loss on the logits of the table outside the blocks (:func:`head_prior_bytes`). Once a window
measured the loop the prior is dropped: where the plan budgeted much more than that
(:func:`room_unused`: a loop that reads the logits lightly), it is planned again for what was
measured, in this run and from the next run's first plan. The peak counter is reset in those
first calls: a loop reading ``torch.cuda.max_memory_allocated`` reads it since then.
"""

from __future__ import annotations

import logging
import weakref

import torch

from protrain_fx.errors import NoPlanFits
from protrain_fx.graph import sizes
from protrain_fx.graph.fx import example_value
from protrain_fx.options import format_bytes
from protrain_fx.runtime import distributed

log = logging.getLogger("protrain_fx")

LOOKS = 2  # training calls of a plan whose windows are measured (before the step meter's reset)
# an fp32 cross-entropy's fp32 tensors per element of its input, at most, before its backward
# reaches the graph: the upcast (or the saved log-softmax), the gradient of the log-softmax and of
# its input
PRIOR_FP32_COPIES = 3
LOW_PRECISION = (torch.float16, torch.bfloat16)  # logits in 2 bytes under autocast
# a prior budgeted more than the measured loop by this share of the budget: planned again
UNUSED_SHARE = 0.05


class CudaMeter:
    """The allocator's counters (a test puts a meter of its own for the CPU in :data:`METERS`)."""

    def allocated(self, device) -> int:
        return torch.cuda.memory_allocated(device)

    def peak(self, device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak(self, device) -> None:
        torch.cuda.reset_peak_memory_stats(device)


METERS = {"cuda": CudaMeter()}  # by device type


class _Window:
    def __init__(self, device, meter, at: int):
        self.device, self.meter = device, meter
        self.base = at  # allocated at the first forward's return, plus what protrain calls left
        self.loop_peak = 0  # the most the loop held above base, over the segments so far
        self.members: list = []  # the graphs whose forwards it spans (weakly)
        # (graph, first parameter) of those forwards: one graph may run for several blocks
        self.calls: set = set()
        self.inside_from: int | None = None  # allocated at a protrain call's start, inside one

    def segment_peak(self) -> None:
        self.loop_peak = max(self.loop_peak, self.meter.peak(self.device) - self.base)


_OPEN: _Window | None = None


def measures(graph) -> bool:
    """Whether ``graph``'s next training call opens (or joins) a window."""
    device = getattr(graph, "device", None)
    return (
        device is not None
        and device.type in METERS
        and graph.choice is not None
        and graph.loop_looks < LOOKS
        and torch.is_grad_enabled()
        and not graph.plan.profile_blocks  # the block marks reset the counters themselves
        and graph.plan.predicted is not None
        and graph.plan.predicted.get("loop_allowance_bytes") is not None  # a shared budget
        # one process: ranks deciding apart would re-plan apart (a re-plan is collective)
        and distributed.world().size == 1
    )


def _call_key(graph, args) -> tuple:
    """A graph's call told apart from its calls for other blocks (one graph dynamo runs for every
    block of a regional compilation): the graph and its first parameter input."""
    k = getattr(graph, "anchor", None)
    first = args[graph._graph_inputs[k].index] if k is not None and args is not None else None
    return id(graph), id(first)


def call_started(graph, args=None) -> None:
    """A protrain graph's call begins: a segment of the open window ends before it; a member's
    next forward on the same parameters closes the window (no backward came between)."""
    w = _OPEN
    if w is None or w.device != getattr(graph, "device", None):
        return
    if _call_key(graph, args) in w.calls:
        return _close(w)
    w.segment_peak()
    w.inside_from = w.meter.allocated(w.device)


def call_returned(graph, out, args=None) -> None:
    """A protrain graph's call returned ``out``: what it left allocated is not the loop's; a
    measuring training graph's forward opens the window, or joins it; a new segment starts."""
    global _OPEN
    w = _OPEN
    if w is not None and w.inside_from is not None:
        w.base += w.meter.allocated(w.device) - w.inside_from
        w.inside_from = None
    if measures(graph):
        outs = out if isinstance(out, (list, tuple)) else [out]
        wanting = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
        if wanting:
            if w is None:
                meter = METERS[graph.device.type]
                w = _OPEN = _Window(graph.device, meter, meter.allocated(graph.device))
            if not any(r() is graph for r in w.members):  # a window a look, however many blocks
                graph.loop_looks += 1
                w.members.append(weakref.ref(graph))
            w.calls.add(_call_key(graph, args))
            closing = _closing(w)  # fires once the loop's own backward reached the graph
            for t in wanting:
                t.register_hook(closing)
    if w is not None and w is _OPEN:
        w.meter.reset_peak(w.device)


def _closing(w: _Window):
    """A gradient hook closing ``w`` (``w`` in a closure, not a default argument: dynamo keeps a
    traced function's defaults in a cache keyed by the function)."""

    def hook(grad):
        _close(w)

    return hook


def abandon() -> None:
    """A protrain call raised: the window says nothing."""
    global _OPEN
    _OPEN = None


def _close(w: _Window) -> None:
    global _OPEN
    if w is not _OPEN:
        return
    _OPEN = None
    w.segment_peak()
    for r in w.members:
        if (graph := r()) is not None:
            graph.loop_seen(max(0, w.loop_peak))


def lacks_room(plan, nbytes: int) -> bool:
    """Records ``nbytes`` (the loop's most between forward and backward) in the plan's measured side
    and says whether the plan lacks room for it: more than its budget less its predicted peak, over
    the allowance and what the plan already budgeted of the loop."""
    pred = plan.predicted or {}
    plan.measured = dict(plan.measured or {}, loop_bytes=nbytes)
    excess = max(0, nbytes - pred["loop_allowance_bytes"]) - (pred.get("loop_excess_bytes") or 0)
    # one of n blocks compiled alike: the device's room is n times its plan's
    return excess > (pred["budget_bytes"] - pred["peak_bytes"]) * (pred.get("budget_shares") or 1)


def replan_why(plan, nbytes: int) -> str | None:
    """Records ``nbytes`` (:func:`lacks_room`); the line saying why the plan is made again, where
    it lacks room for the loop or budgeted far more than it holds (:func:`room_unused`)."""
    if lacks_room(plan, nbytes):
        return replan_line(plan, nbytes)
    return unused_line(plan, nbytes) if room_unused(plan.predicted, nbytes) else None


def replan_line(plan, nbytes: int) -> str:
    pred = plan.predicted or {}
    return (
        f"protrain: graph {plan.graph_name}: the training loop held up to {format_bytes(nbytes)} "
        "of its own on the device between this graph's forward and its backward (a loss on the "
        "returned logits, a distillation term), more than the plan left beside its predicted peak "
        f"({format_bytes(pred['peak_bytes'])} of {format_bytes(pred['budget_bytes'])}) and "
        f"{format_bytes(pred['loop_allowance_bytes'])} of the reserve; planning it again with "
        "that budgeted"
    )


def no_room(plan, e: NoPlanFits) -> None:
    """After the re-plan for the measured loop found no plan (``e``): where even the smallest plan
    is over the budget left beside the loop by more than the reserve's unbudgeted half, out of
    memory in the loop's own code is certain (H100 run 93: a regional compilation at a 12 GiB cap,
    HF's fp32 loss on 128k-vocabulary logits out of memory at step 2): raised as a NoPlanFits that
    says so and what to do. Else the plan that ran goes on (one line)."""
    why = str(e).splitlines()[0]
    need, left = e.min_device_bytes, e.budget_bytes
    if (
        need is None
        or left is None
        or need - left <= (plan.predicted or {}).get("loop_allowance_bytes", 0)
    ):
        log.warning(
            f"protrain: graph {plan.graph_name}: no plan leaves the loop that room ({why}); going "
            "on under the plan as it is: out of memory in protrain's graphs a step is redone, in "
            "the loop's own code it is not (make the loop's own tensors smaller, or give a "
            "memory_budget)"
        )
        return
    kept = (
        " Blocks compiled one by one keep the chunks their first plans kept resident."
        if (plan.predicted or {}).get("budget_shares", 1) > 1
        else ""
    )
    raise NoPlanFits(
        f"graph {plan.graph_name}: the training loop holds up to "
        f"{format_bytes(plan.measured['loop_bytes'])} of its own on the device between this "
        "graph's forward and its backward (a loss on the model's logits, a distillation term), "
        f"and beside it no plan fits: the smallest needs {format_bytes(need)} where "
        f"{format_bytes(left)} is left, so the loop's own code would run out of memory, where "
        "protrain cannot redo the step. Make the loop's own tensors smaller (a smaller batch; "
        "compile the whole model rather than its blocks one by one, so that its head and loss "
        "are planned), or give a memory_budget (the loop's own tensors are then yours to fit "
        f"beside it).{kept} ({why})",
        need,
        e.min_host_bytes,
        budget_bytes=left,
    ) from None


def prior_bytes(gm: torch.fx.GraphModule) -> int:
    """What the loop is assumed to hold of its own before it was measured, from the outputs of the
    graph dynamo traced: 0 where one of them is a scalar that needs gradients (the loss is the
    graph's: HF's ``labels=``), else, for the largest floating output that needs gradients (the
    logits, not an HF model's key-value cache), :data:`PRIOR_FP32_COPIES` fp32 copies of it and its
    gradient in its own dtype."""
    outs = [n for n in gm.graph.nodes if n.op == "output"]
    if not outs:
        return 0
    largest = 0
    for node in _flat_nodes(outs[0].args):
        v = example_value(node)
        if not isinstance(v, torch.Tensor) or not v.requires_grad or not v.is_floating_point():
            continue
        n = sizes.numel_hint(v)
        if n == 1:
            return 0  # a loss the graph computes: the loop calls its backward
        per_element = 4 * PRIOR_FP32_COPIES + (v.dtype.itemsize if v.dtype.itemsize < 4 else 0)
        largest = max(largest, n * per_element)
    return largest


def head_prior_bytes(gm: torch.fx.GraphModule, outside: list) -> int:
    """:func:`prior_bytes` for one of several blocks compiled alike (regional compilation), whose
    output feeds the next block: the model's head and loss run eagerly after the last block, in the
    window. An fp32 cross-entropy on logits as wide as the widest parameter ``outside`` the blocks
    whose rows are as wide as the block's output (the embedding, tied or not, or the head), for as
    many tokens as that output has rows; 0 where no parameter outside is such a table."""
    out, rows = _head_tables(gm, outside)
    if out is None:
        return 0
    width = int(out.shape[-1])
    rows = max(rows, default=0)
    # the logits in 16 bits where the block computes in 16 bits (autocast)
    values = (example_value(n) for n in gm.graph.nodes)
    low = any(isinstance(v, torch.Tensor) and v.dtype in LOW_PRECISION for v in values)
    per_element = 4 * PRIOR_FP32_COPIES + (2 if low else 0)
    return sizes.numel_hint(out) // max(1, width) * int(rows) * per_element


def head_prior_certain(gm: torch.fx.GraphModule, outside: list) -> bool:
    """Whether the head :func:`head_prior_bytes` assumes is the only table outside the blocks as
    wide as their output (a tied embedding, or an embedding and an untied head of the same rows):
    not where another is narrower in rows (GPT-2's position table; a classifier's head beside the
    embedding), whose logits may be far smaller."""
    return len(_head_tables(gm, outside)[1]) == 1


def _head_tables(gm: torch.fx.GraphModule, outside: list) -> tuple:
    """``(the block's widest floating output, the row counts of the 2-D parameters outside the
    blocks as wide as it)``; ``(None, set())`` where the block returns no such tensor."""
    outs = [n for n in gm.graph.nodes if n.op == "output"]
    vals = [example_value(n) for o in outs for n in _flat_nodes(o.args)]
    hidden = [v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim]
    if not hidden:
        return None, set()
    out = max(hidden, key=sizes.numel_hint)
    width = int(out.shape[-1])
    return out, {int(p.shape[0]) for p in outside if p.ndim == 2 and p.shape[1] == width}


def _flat_nodes(arg) -> list:
    if isinstance(arg, torch.fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _flat_nodes(a)]
    if isinstance(arg, dict):
        return [n for a in arg.values() for n in _flat_nodes(a)]
    return []


def budgeted(
    raw: dict | None, seen: int | None, allowance_bytes: int | None, prior: int = 0
) -> tuple[int, int, int]:
    """``(loop bytes, excess over the allowance, prior)`` a plan budgets: the most seen in this
    process (``seen``; None: no window closed yet) or by the plan cache entry's runs, or, where
    neither measured anything, the ``prior`` (:func:`prior_bytes`; then returned as the third);
    (0, 0, 0) where the budget is not the device's."""
    if allowance_bytes is None:
        return 0, 0, 0
    measured, predicted = (raw or {}).get("measured") or {}, (raw or {}).get("predicted") or {}
    if seen is None and "loop_bytes" not in measured:
        loop = max(prior, predicted.get("loop_bytes") or 0)
        return loop, max(0, loop - allowance_bytes), prior if loop == prior else 0
    loop = max(seen or 0, measured.get("loop_bytes") or 0)
    return loop, max(0, loop - allowance_bytes), 0


def choose_beside_prior(choose, loop_bytes: int | None):
    """``choose(loop_bytes)`` (autoplan.choose); where the loop was not measured yet and no plan
    fits beside the prior (the error's ``loop_prior_bytes``), the plan beside as much of it as
    fits: the smallest plan, which leaves the loop the most room until it is measured (H100 run
    93: the plan made as if the loop held nothing kept chunks resident that blocks compiled one by
    one cannot move, and the loss ran out of memory); where not even that fits, as if the loop held
    nothing (one line and a note say which). Where the smallest plan leaves the loss short by more
    than the reserve's unbudgeted half and that loss is sure (``loop_prior_certain``), the
    NoPlanFits of :func:`_prior_no_room`, before the first step (run 95: out of memory in HF's loss
    at step 1)."""
    try:
        return choose(loop_bytes)
    except NoPlanFits as e:
        if loop_bytes is not None or not (prior := e.loop_prior_bytes):
            raise
        why = str(e).splitlines()[0][:200]
        short = (
            e.min_device_bytes - e.budget_bytes
            if e.min_device_bytes is not None and e.budget_bytes is not None
            else prior
        )
        # over the reserve's unbudgeted half, for the loss alone (without it a plan fits), where
        # the loss assumed is surely there
        refuse = e.loop_allowance_bytes < short <= prior - e.loop_allowance_bytes
        if refuse and e.loop_prior_certain:
            raise _prior_no_room(e, prior, short, why) from None
    part, choice = prior - short - max(4096, short // 1000), None  # the budget's rounding
    if part > 0:
        try:
            choice = choose(None, prior_cap=part)
        except NoPlanFits:
            pass
    kept = f"planned beside {format_bytes(part)} of it" if choice else "planned without it"
    choice = choice or choose(0)
    note = (
        f"no plan leaves room for the {format_bytes(prior)} a loss of the loop's own on the "
        f"model's outputs may hold ({why}); {kept} until the loop is measured"
    )
    log.warning("protrain: %s", note)
    choice.notes.append(note)
    return choice


def _prior_no_room(e: NoPlanFits, prior: int, short: int, why: str) -> NoPlanFits:
    """Not even the smallest plan leaves the loss assumed on the model's outputs room but for
    ``short`` bytes, more than the reserve's unbudgeted half: the loop's own code would run out of
    memory in the first step, where protrain cannot redo it (H100 run 95: blocks of a Llama-3.2-1B
    shape compiled one by one at an 8 GiB cap, HF's loss on 6.41 GiB of logits). Said before the
    first step, with what would do; a loop that holds far less than assumed gives a
    ``memory_budget``."""
    regional = e.budget_shares > 1
    what = (
        "a loss on the logits of the model's head after the blocks compiled one by one"
        if regional
        else "a loss of the loop's own on the logits the model returns"
    )
    fix = (
        "compile the whole model rather than its blocks one by one (its head and loss are then "
        "planned, the loss over chunks of tokens)"
        if regional
        else "compute the loss inside the compiled model (a Hugging Face model: pass labels=), "
        "where protrain plans it over chunks of tokens"
    )
    return NoPlanFits(
        f"no plan leaves room for the {format_bytes(prior)} that {what} is assumed to hold in "
        "fp32 between forward and backward (not measured yet): beside it even the smallest plan "
        f"is {format_bytes(short)} over the budget, more than the "
        f"{format_bytes(e.loop_allowance_bytes)} of the reserve the loop may hold unplanned, so "
        "the loop's own code would run out of memory in the first step, where protrain cannot "
        f"redo it. To train: {fix}; or a smaller batch; or "
        f"{format_bytes(short - e.loop_allowance_bytes)} more device memory; or, where the loop "
        "holds far less than assumed, a memory_budget (the loop's own tensors are then yours to "
        f"fit beside it). ({why.split(';')[0]})",
        e.min_device_bytes,
        e.min_host_bytes,
        loop_prior_bytes=prior,
        budget_bytes=e.budget_bytes,
        loop_allowance_bytes=e.loop_allowance_bytes,
        budget_shares=e.budget_shares,
        loop_prior_certain=True,
    )


def room_unused(pred: dict, nbytes: int) -> bool:
    """Whether a plan that budgeted the prior left much more room than the loop, measured at
    ``nbytes``, needed (:data:`UNUSED_SHARE` of its budget)."""
    if not pred.get("loop_prior_bytes"):
        return False
    excess = max(0, nbytes - (pred.get("loop_allowance_bytes") or 0))
    unused = (pred.get("loop_excess_bytes") or 0) - excess
    return unused > UNUSED_SHARE * pred["budget_bytes"] * (pred.get("budget_shares") or 1)


def unused_line(plan, nbytes: int) -> str:
    pred = plan.predicted or {}
    what = (
        "the head's loss after the blocks compiled one by one"
        if (pred.get("budget_shares") or 1) > 1
        else "a loss on the returned logits"
    )
    return (
        f"protrain: graph {plan.graph_name}: the training loop held up to {format_bytes(nbytes)} "
        f"of its own between this graph's forward and its backward, less than the "
        f"{format_bytes(pred.get('loop_prior_bytes') or 0)} assumed before it was measured ({what} "
        "in fp32); planning it again with the room it needs"
    )
