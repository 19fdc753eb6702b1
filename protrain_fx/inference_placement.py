"""Inference graphs placed within the budget: a frozen model, or a model evaluated before it trains.

The automatic plan (protrain_fx/autoplan.py) profiles and searches training graphs. A graph dynamo
traces under ``torch.no_grad()`` or ``torch.inference_mode()``, or of a model with no trainable
parameter (a distillation teacher, a DPO reference model), has no backward to profile, and keeping
every chunk resident places more than the device holds wherever the parameters alone do not fit
(an 8 B model's 30 GiB of fp32 parameters evaluated before its first training step under a 24 GiB
cap). When such a graph's parameters have no chunk store yet, no ``n_persist`` was given, and a
budget applies (a CUDA device, or ``memory_budget``), this keeps the first chunks (in first-use
order) resident as far as the budget allows beside what a forward-only run needs: the chunk buffers
offloaded chunks are gathered through (``n_buffer``, 2 unless given) and the copies gathered out of
them, and the most bytes of tensors alive at once (protrain_fx/graph/forward_memory.py), with the
allocator's factor on all but the resident chunks. Offloaded chunks of a frozen model need no
optimizer; a trainable model's first training graph releases this placement
(:func:`release_for_training`) and places the parameters afresh. A budget too small for every
placement is a :class:`~protrain_fx.errors.NoPlanFits` naming the minimum.

On a CUDA device without a ``memory_budget`` the process's graphs share the device: a training
plan of another model takes such a placement back (its resident chunks to the host) and sets
aside the least it needs (:func:`release_for_training`); a placement beside training graphs keeps
between its calls at most what their steps leave (:func:`_beside_training`), and where not even
its least fits there, those graphs plan again at their next call.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import torch

from protrain_fx import budgets, config
from protrain_fx._weakmap import IdentityWeakMap
from protrain_fx.budgets import device_budget, device_usage
from protrain_fx.errors import NoPlanFits, ProtrainError
from protrain_fx.graph import regional
from protrain_fx.graph.build_plan import chunked_params, default_chunk_size
from protrain_fx.graph.forward_memory import forward_peak_bytes
from protrain_fx.options import Options, format_bytes
from protrain_fx.placement import autocast_dtypes, transfer_dtype
from protrain_fx.plan.layout import pack
from protrain_fx.plan.plan import training_plans
from protrain_fx.plan.profiles import FRAGMENTATION
from protrain_fx.runtime import distributed, replacement
from protrain_fx.runtime.chunk_store import live_stores, release_unused_buffers, store_of
from protrain_fx.runtime.param_values import dissolve_store

N_BUFFER = 2  # chunk buffers of an inference placement unless n_buffer is given (placement.py's)
GATHERED = 2  # copies gathered out of the buffers alive at once (the chunk in use, the next one)
log = logging.getLogger("protrain_fx")
# parameters placed here within the device's shared budget (CUDA, no memory_budget), to the least
# their graph's placement needs (a 1-list, one per graph): a training plan of another model takes
# that placement back and sets that aside (release_for_training)
_SHARED = IdentityWeakMap()


def shares_device(opts: Options, device: torch.device | None) -> bool:
    """Whether this graph's budget is the device's, shared with the process's other graphs (CUDA
    without a ``memory_budget``; a graph given one is given its share)."""
    return device is not None and device.type == "cuda" and opts.memory_budget is None


def wanted(
    opts: Options, live: list, device: torch.device | None, training_plan: bool, example_inputs
) -> bool:
    """Whether this graph's chunks are placed here (module docstring): not a graph some input of
    which needs a gradient (frozen layers between trainable ones: their backward saves
    activations a forward-only estimate does not count; they keep every chunk resident)."""
    return (
        not training_plan
        and not _backward_through(example_inputs)
        and device is not None
        and bool(live)
        and opts.n_persist is None
        and (shares_device(opts, device) or opts.memory_budget is not None)
        and config.settings().autoplan
        and distributed.world().size == 1
        and all(store_of(p) is None for p in live)
    )


def release_for_training(live: list, opts: Options, device: torch.device | None) -> str | None:
    """Before a training graph is planned, placements made here that would squeeze it: this model's
    own (:func:`_release_own`), and on a device shared by the process's graphs other models'
    (:func:`_release_others`). A note, or None when nothing was released."""
    notes = [_release_own(live), _release_others(live, opts, device)]
    return "; ".join(n for n in notes if n) or None


def _release_own(live: list) -> str | None:
    """The stores an inference placement made for these parameters (an evaluation before the first
    training step), while no optimizer state exists and they hold no other graph's parameters, are
    dissolved (their offloaded values become host values, the resident ones stay on the device), so
    that the training plan places the parameters afresh (its profile runs with every chunk
    offloaded, and it may keep more chunks resident than the evaluation did). Graphs compiled for
    them are planned again at their next call."""
    stores = list({id(s): s for s in map(store_of, live) if s is not None}.values())
    mine = {id(p) for p in live}
    if not stores or not all(
        s.for_inference
        and s.optimizer is None
        and all(p is None or id(p) in mine for p in s.params)
        for s in stores
    ):
        return None
    for s in stores:
        s.placement_version += 1
        dissolve_store(s)
    replacement.moves += 1
    return (
        "the placement an earlier graph without gradients made (an evaluation before the first "
        "training step) was released: this training plan places the parameters afresh"
    )


def _release_others(live: list, opts: Options, device: torch.device | None) -> str | None:
    """On a device shared by the process's graphs, a frozen model placed here first (a distillation
    teacher or a DPO reference model, whose forward runs before the trained model's first call)
    holds what the device had then, and the training plan would get what is left. Its resident
    chunks move to the host and its store is dissolved, so that the training plan gets the device
    its step needs; the frozen model's graphs are placed again at their next call, beside this
    plan's step (:func:`choose`). Only stores placed here within the shared budget, of parameters
    this graph does not have; a model compiled in regions as a whole."""
    if not shares_device(opts, device):
        return None
    mine = {id(p) for p in live}
    frozen = {
        id(s): s
        for s in live_stores()
        if s.for_inference
        and s.optimizer is None
        and s.device == device
        and s.aliased
        and all(p is None or (id(p) not in mine and p in _SHARED) for p in s.params)
    }
    # a model compiled in regions: a block's store and those made like it go together
    family = {id(s): id(s.template()) for s in live_stores() if s.template and s.template()}
    for a, b in family.items():
        if (a in frozen) != (b in frozen):
            frozen.pop(a, None), frozen.pop(b, None)
    if not any(s.n_persist for s in frozen.values()):
        return None
    chunks = nbytes = 0
    for s in frozen.values():
        try:
            moved, size = replacement.offload_resident(s, 0)
        except (ProtrainError, RuntimeError) as e:  # host memory for its values ran out
            # the stores stay, offloaded as far as they could be, and are not placed again
            log.warning("protrain: a frozen model's placement stays on the device: %s", e)
            return None
        chunks, nbytes = chunks + moved, nbytes + size
    for s in frozen.values():
        s.placement_version += 1
        dissolve_store(s)
    replacement.moves += 1
    release_unused_buffers()
    torch.cuda.empty_cache()
    graphs = {}  # the least each released graph's placement needs, set aside for it
    for s in frozen.values():
        for p in s.params:
            if p is not None and (least := _SHARED.get(p)) is not None:
                graphs.setdefault(id(least), (least, p, set()))[2].add(id(p))
    for (least,), p, ids in graphs.values():
        budgets.SET_ASIDE[p] = (least, frozenset(ids))
    aside = sum(least for (least,), _, _ in graphs.values())
    return (
        f"{chunks} resident chunks ({format_bytes(nbytes)}) of another model placed without "
        "gradients (a frozen model whose forward came first) moved to the host before this plan: "
        f"it is placed again at its next call, beside this plan's step, in the "
        f"{format_bytes(aside)} its least placement needs, set aside"
    )


def _backward_through(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )


def unplanned_note(opts: Options, live: list, training_plan: bool, example_inputs) -> str | None:
    """What the plan says when a ``memory_budget`` applies to no plan of this graph: no parameter
    trains, yet a gradient flows through it to its inputs."""
    if training_plan or opts.memory_budget is None or not live:
        return None
    if not _backward_through(example_inputs) or any(store_of(p) for p in live):
        return None
    return (
        "memory_budget not applied: no parameter of this graph trains, yet a gradient flows "
        "through it to its inputs (frozen layers between trainable ones), which neither the "
        "training plan nor the inference placement covers; every chunk stays resident"
    )


def _beside_training(opts: Options, device: torch.device, placed: list) -> tuple[int, str]:
    """``(bytes, what)``: on a device shared by the process's graphs, the device bytes the other
    models' training steps need beyond what is allocated now: the largest of their plans'
    predicted peaks less the predicted start of their step, less what is allocated beyond those
    starts (a forward's saved tensors, when this graph runs between a trained model's forward and
    backward), and what of their starts is not allocated yet. (0, "") where none."""
    if not shares_device(opts, device):
        return 0, ""
    mine = {id(p) for p in placed}
    steps, held = [], {}
    for plan, params in training_plans():
        pred = plan.predicted or {}
        if params[0].device != device or any(id(p) in mine for p in params):
            continue
        peak, timeline = pred.get("peak_bytes") or 0, pred.get("timeline") or [[0, 0]]
        start = int(timeline[0][1])
        # and the loop's own tensors beside it, where they exceed the reserve's share
        steps.append(max(0, peak - start) + (pred.get("loop_excess_bytes") or 0))
        key = frozenset(map(id, params))  # another shape's graph of the same parameters: once
        held[key] = max(held.get(key, 0), start)
    if not steps:
        return 0, ""
    # allocated now beyond their predicted start and other frozen models' resident chunks: a
    # forward's saved tensors (part of the step's need) or the user's; short of it: their state
    # yet to come (Adam's moments before a step)
    _, others, _ = device_usage(device, placed, opts.optimizer)
    frozen = [s for s in live_stores() if s.for_inference and s.device == device]
    frozen = [s for s in frozen if not any(p is not None and id(p) in mine for p in s.params)]
    resident = sum(s.layout.used_bytes(c) for s in frozen for c in range(s.n_persist))
    start = sum(held.values())
    beside = max(0, max(steps) - max(0, others - start - resident)) + max(0, start - others)
    graphs = f"{len(steps)} other training graph{'s' if len(steps) > 1 else ''}"
    return beside, f"the steps of {graphs} on this device"


def choose(
    gm, graph_inputs, live: list, structure, opts: Options, regions, root
) -> tuple[Options, int, str]:
    """``(options, peak, note)``: the options with ``n_persist`` (and ``n_buffer``) set when not
    every chunk fits resident, the predicted peak of device memory, and a line for the plan saying
    what was placed and why."""
    device = live[0].device
    entries, groups = chunked_params(graph_inputs, regions)
    chunk_size = opts.chunk_size or default_chunk_size(entries, structure, groups)
    layout = pack(entries, chunk_size, groups)
    chunk_bytes = [layout.used_bytes(c) for c in range(layout.n_chunks)]
    n = len(chunk_bytes)
    master = live[0].dtype
    t_elem = transfer_dtype(opts, device, master, autocast_dtypes()).itemsize
    n_buffer = opts.n_buffer if opts.n_buffer is not None else N_BUFFER
    activations = forward_peak_bytes(gm, {gi.node_name for gi in graph_inputs if gi.is_param})
    peers = regional.siblings(root) if root is not None else []
    placed = live + [p for m in peers if m is not root for p in m.parameters()]
    mine = {id(p) for p in placed}
    for p, (_, ids) in budgets.SET_ASIDE.items():  # what a training plan set aside for these
        if ids & mine:
            budgets.SET_ASIDE.pop(p)
    budget, why = device_budget(opts, device, placed)
    if len(peers) > 1:
        budget //= len(peers)
        why += f", divided by the {len(peers)} blocks of this structure"

    # per n_persist k: the largest offloaded chunk in the transfer dtype, and the device bytes
    largest = [max(chunk_bytes[k:], default=0) // master.itemsize * t_elem for k in range(n + 1)]
    resident = [0, *itertools.accumulate(chunk_bytes)]
    needs = [
        resident[k] + int(FRAGMENTATION * ((n_buffer + GATHERED) * largest[k] + activations))
        for k in range(n + 1)
    ]

    def sizes(k: int) -> str:
        buffers = f", chunk buffers {n_buffer} x {format_bytes(largest[k])}" if largest[k] else ""
        return f"forward's tensors at most {format_bytes(activations)} at once{buffers}"

    fits = [k for k in range(n + 1) if needs[k] <= budget]
    beside, beside_why = _beside_training(opts, device, placed)
    beside //= max(1, len(peers))  # one block's share, as the budget
    if beside and fits:
        # what stays on the device between calls (resident chunks, chunk buffers) leaves room
        # for the other training graphs' steps, when some placement does
        held = [resident[k] + int(FRAGMENTATION * n_buffer * largest[k]) for k in range(n + 1)]
        roomy = [k for k in fits if held[k] <= budget - beside]
        fits = roomy or [min(fits, key=held.__getitem__)]
        why += (
            f"; {format_bytes(beside)} left for {beside_why}"
            if roomy
            else f"; the least it keeps between calls, though {beside_why} need "
            f"{format_bytes(beside)} more: they plan again at their next call, leaving room"
        )
        if not roomy:
            budgets.shared_version += 1
    if shares_device(opts, device):
        least = [min(needs) * max(1, len(peers))]  # one per graph, in the budget's terms
        for p in placed:
            _SHARED[p] = least
    if not fits:
        # the least over every placement: a resident chunk can take the largest one out of the
        # buffers' size
        least = min(range(n + 1), key=needs.__getitem__)
        # in the budget's terms: one of N blocks compiled alike gets 1/N of it
        smallest = needs[least] * max(1, len(peers))
        each = f", {len(peers)} blocks x {format_bytes(needs[least])}" if len(peers) > 1 else ""
        raise NoPlanFits(
            f"memory budget {format_bytes(budget)} ({why}) is too small for this inference graph "
            f"(no gradients: torch.no_grad(), or no trainable parameter): its smallest placement "
            f"({least} of {n} chunks resident) needs {format_bytes(needs[least])} on "
            f"the device ({sizes(least)}); the smallest budget that would work is {smallest} bytes "
            f"({format_bytes(smallest)}{each}); a smaller batch lowers the forward's part",
            min_device_bytes=smallest,
        )
    k = max(fits)
    if k == n:
        return (
            opts,
            needs[k],
            (
                f"inference graph: every chunk resident ({format_bytes(sum(chunk_bytes))}; "
                f"{sizes(n)}) within the budget {format_bytes(budget)} ({why})"
            ),
        )
    return (
        dataclasses.replace(opts, n_persist=k, n_buffer=n_buffer),
        needs[k],
        (
            f"inference graph placed within the budget {format_bytes(budget)} ({why}): {k} of "
            f"{n} chunks resident ({format_bytes(resident[k])}), the rest "
            f"offloaded; predicted peak {format_bytes(needs[k])} ({sizes(k)}, "
            f"x{FRAGMENTATION:g} for the allocator)"
        ),
    )
