"""Automatic plan: choose the knobs the user left unset, by profiling the graph once and searching.

For a new training graph (on a CUDA device, or wherever a ``memory_budget`` is given)
:func:`choose`:

1. looks the graph up in the plan cache (keyed by the graph's code and input shapes, the options,
   the hardware profile, the allocator's settings, the budget's 64 MiB bin and torch's, protrain's
   and the cost model's versions): a hit skips profiling, unless the cached plan ran out of memory
   or gave a non-finite loss (never served again: the new search keeps its predictions under 90% of
   the failed plan's peak) or its predicted peak exceeds the budget asked for now;
2. otherwise compiles the graph under the most frugal plan (every chunk offloaded, every block
   recomputed; when its blocks repeat, a copy with three of them, whose measurements stand for all
   blocks: protrain_fx/graph/shorten.py), runs one profiled step on the real inputs
   (protrain_fx/profiling/profiler.py; nothing it does reaches training), and gives the parameters
   back (the chosen plan places them afresh);
3. searches every plan with the cost model (protrain_fx/plan/search.py) under the budget
   (``memory_budget``, or the device memory this process can use less :func:`reserve_bytes`) and the
   host memory, honouring the knobs given in the options;
4. returns the options with every knob set, and the prediction (time, peak, timeline) for the plan.

A graph whose parameters already have a chunk store (another graph of the same model, a recompile
for a new shape) keeps that store's chunk size. A re-plan (out of memory, gradients kept between
steps) searches every placement with no more resident chunks than the store has: the ones it drops
move to the host with their gradients and optimizer state (protrain_fx/runtime/replacement.py,
where the store allows it); a new shape keeps the placement unless no plan fits beside it.
``PROTRAIN_AUTOPLAN=0`` turns this off (knobs not given then mean: everything resident, activations
kept; a ``memory_budget`` is then an error); ``PROTRAIN_PLAN_CACHE=0`` ignores the plan cache.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from protrain_fx import budgets, config, plan_cache, progress
from protrain_fx.budgets import device_budget, host_freed_bytes, reserve_bytes  # noqa: F401  (tests)
from protrain_fx.errors import NoPlanFits, ProtrainError
from protrain_fx.graph import regional
from protrain_fx.graph.build_plan import chunked_params, default_chunk_size
from protrain_fx.graph.sizes import planned_key
from protrain_fx.machine import allocator, measure, memory, pinned, step_rates
from protrain_fx.options import Options, format_bytes
from protrain_fx.plan.layout import pack
from protrain_fx.plan.prediction import prediction
from protrain_fx.plan.profiles import Hardware
from protrain_fx.plan.search import check_host_floor, search, search_or_without_copies
from protrain_fx.plan_cache import COST_MODEL_VERSION, KNOBS  # noqa: F401  (the cache key's; tests read autoplan.KNOBS)
from protrain_fx.profiling import loop_memory
from protrain_fx.profiling.frugal import oom_need_bytes, profile_frugal  # noqa: F401  (tests)
from protrain_fx.profiling.profiler import graph_profile, profile_from_dict, profile_to_dict
from protrain_fx.runtime import distributed, replacement
from protrain_fx.runtime.chunk_store import store_of
from protrain_fx.runtime.optimizer_lookup import live_optimizers

log = logging.getLogger("protrain_fx")
# a plan that ran out of memory (or its cache entry's record of one) makes the next search keep its
# predictions under this share of the failed plan's predicted peak
FAILED_PEAK_MARGIN = 0.9
KEPT_PLACEMENT = "chunk placement kept from an earlier graph; activation knobs searched"


@dataclass
class Choice:
    options: Options  # the user's options with every knob set
    predicted: dict
    notes: list[str] = field(default_factory=list)
    cache_path: str | None = None
    # of earlier plans of this graph that ran out of memory
    failed_peaks: list[int] = field(default_factory=list)
    # the plan may keep fewer chunks resident than the graph's store does (runtime/replacement.py)
    offload_resident: bool = False


def wanted(opts: Options, params: list, device: torch.device | None) -> bool:
    """Whether this graph gets an automatic plan (see module docstring)."""
    if (
        device is None
        or not torch.is_grad_enabled()
        or not any(p is not None and p.requires_grad for p in params)
    ):
        return False
    if not config.settings().autoplan:
        if opts.memory_budget is not None:
            raise ProtrainError(
                "memory_budget is met by the automatic plan, which "
                "PROTRAIN_AUTOPLAN=0 turns off: "
                "unset one of them (or give n_persist / n_swap / n_checkpoint "
                "instead)"
            )
        return False
    return device.type == "cuda" or opts.memory_budget is not None


def choose(
    gm,
    example_inputs,
    graph_inputs,
    params: list,
    structure,
    opts: Options,
    compile_profiling,
    failed_peaks: tuple[int, ...] = (),
    root=None,
    regions=None,
    grads_held: str | None = None,
    cache_path: str | None = None,
    loop_bytes: int | None = None,
    prior_cap: int | None = None,
) -> Choice:
    """See the module docstring. ``compile_profiling(gm, opts) -> (compiled, plan)`` compiles a copy
    of the graph under the profiling plan with the given options and block structure (the graph's,
    or that of its short copy: protrain_fx/graph/shorten.py). ``failed_peaks``: predicted peaks
    of plans of this graph that ran out of memory in this process (the plan cache remembers those of
    earlier runs). ``root``: the module dynamo traced; one of ``N`` blocks of one structure
    (regional compilation, protrain_fx/graph/regional.py) gets ``1/N`` of the budget.
    ``regions``: the graph's :class:`~protrain_fx.graph.regions.RegionSplit` when it is compiled in
    regions (chunks never span two; the profiling plan runs the whole graph, each distinct region
    compiled once). ``grads_held``: why the loop keeps gradients between steps (seen at a call).
    ``cache_path``: a re-plan's, its graph's first plan's entry, so that what this process learned
    (kept gradients, micro-steps, a placement that fits) is what its next run's first plan reads,
    whatever the budget left now (the key's). ``loop_bytes``: the most the training loop held of its
    own between this graph's forward and backward, measured in this process (None: not yet;
    profiling/loop_memory.py); ``prior_cap``: at most that much of what it is assumed to hold
    until measured (loop_memory.choose_beside_prior)."""
    live = [p for p in params if p is not None]
    device = live[0].device
    existing = {id(s): s for s in (store_of(p) for p in live) if s is not None}
    fixed = {k: getattr(opts, k) for k in KNOBS}
    notes = []
    n_blocks = len(structure.blocks)
    # a graph break's piece of the model
    if (fixed["n_swap"] or 0) + (fixed["n_checkpoint"] or 0) > n_blocks:
        n_swap = min(fixed["n_swap"] or 0, n_blocks)
        fixed.update(
            n_swap=n_swap if fixed["n_swap"] is not None else None,
            n_checkpoint=min(fixed["n_checkpoint"], n_blocks - n_swap)
            if fixed["n_checkpoint"] is not None
            else None,
        )
    param_entries, groups = chunked_params(graph_inputs, regions)
    peers = regional.siblings(root) if root is not None else []
    n_peers = max(1, len(peers))
    # resident chunks the plan may move to the host: at most this many stay (runtime/replacement.py)
    max_persist, offload_first, resident = None, False, None
    if existing:
        store = next(iter(existing.values()))
        # this graph may hold fewer chunks than the store; in regions, each region's store keeps
        # its first chunks resident
        n_own = pack(param_entries, store.layout.chunk_size, groups).n_chunks
        resident = min(sum(s.n_persist for s in existing.values()), n_own)
        if (
            fixed["n_persist"] is None
            and n_peers == 1  # not one of several blocks compiled alike (regional compilation)
            and replacement.may_offload(live, opts.optimizer)
        ):
            max_persist = resident
            # a re-plan (out of memory, kept gradients, a larger call: graph/sizes.py) searches
            # every placement up to the kept one; a new shape keeps it unless nothing fits beside it
            offload_first = bool(failed_peaks or grads_held or loop_bytes or planned_key())
        fixed.update(
            chunk_size=store.layout.chunk_size,
            n_persist=None if offload_first else resident,
            n_shard=store.n_shard,
            transfer_copies=store.transfer_copies,
        )
        notes.append(
            "chunk size kept from an earlier graph; resident chunks may move to the host (with "
            "their gradients and optimizer state), the other knobs searched"
            if offload_first
            else KEPT_PLACEMENT
        )
    all_resident = opts.optimizer is None and fixed["n_persist"] is None  # offloading needs it
    if all_resident:
        notes.append(
            "no optimizer in the options, so every chunk stays resident (pass "
            "options={'optimizer': opt} to let the plan offload chunks)"
        )
    alloc = allocator.prepare(device)  # before anything of the plan is allocated
    placed = params + [p for m in peers if m is not root for p in m.parameters()]
    budget, budget_why = device_budget(opts, device, placed)
    growth, outside = 0, []
    if n_peers > 1:
        # the embedding, norm and head train eagerly: their gradients and optimizer state to come
        live_opts = live_optimizers()  # one pass over the process's objects for both
        outside = regional.outside_params(peers, live_opts)
        growth, n_out = budgets.eager_growth(outside, device, live_opts)
        if growth:
            budget -= growth
            budget_why += (
                f", less {format_bytes(growth)} of gradients and optimizer state the {n_out} "
                "parameters outside the compiled blocks will hold"
            )
        budget //= n_peers
        budget_why += f", divided by the {n_peers} blocks of this structure"
        notes.append(
            f"regional compilation: this graph's module is one of {n_peers} blocks of one "
            f"structure, so its plan is chosen for 1/{n_peers} of the budget "
            f"({format_bytes(budget)}; what the blocks share, the chunk buffers and the working "
            f"set of the block running, counts 1/{n_peers} in each); code outside the compiled "
            "blocks is not planned and must fit in the reserve"
        )
    hw_profile = measure.hardware_profile(device)
    key = plan_cache.key(
        gm, example_inputs, opts, hw_profile.key, budget, alloc.key, regions is not None
    )
    path = cache_path or plan_cache.path_of(key)
    # rank 0's cache decides for every rank
    raw = plan_cache.read(path)
    allowance = budgets.loop_allowance(opts, device)
    # before the loop was measured: what a loss of its own on the graph's outputs would hold (for
    # one of several blocks, whose outputs feed the next block: on the head's logits after the last;
    # not for ranks, never measured)
    prior, prior_certain = 0, True
    if distributed.world().size == 1:
        prior = (
            loop_memory.prior_bytes(gm)
            if n_peers == 1
            else loop_memory.head_prior_bytes(gm, outside)
        )
        prior_certain = n_peers == 1 or loop_memory.head_prior_certain(gm, outside)
    prior = prior if prior_cap is None else min(prior, prior_cap)
    loop, loop_excess, prior = loop_memory.budgeted(raw, loop_bytes, allowance, prior)
    where = "graph's outputs" if n_peers == 1 else "logits of the head after the blocks"
    if loop_excess:  # the loop's own tensors beside the step: out of the budget
        budget -= loop_excess // n_peers
        budget_why += (
            f", less {format_bytes(loop_excess)} the loop holds beyond the reserve's half"
            + (f" (assumed from the {where} until measured)" if prior else "")
        )
    looped = dict(
        loop_bytes=loop,
        loop_excess_bytes=loop_excess,
        loop_allowance_bytes=allowance,
        loop_prior_bytes=prior,
        budget_shares=n_peers,  # blocks compiled alike: each plan's budget is 1/n of the device's
    )
    cached, failed, refused, at_step, gap = distributed.broadcast_object(
        plan_cache.usable(
            raw, budget, memory.pinnable_host(device, host_freed_bytes(live), n_peers)
        )
        + (plan_cache.steps_at_opt_step(raw), plan_cache.allocator_gap(raw))
    )
    grads_held = plan_cache.grads_held(raw, opts.optimizer, grads_held)
    micro = plan_cache.micro_steps(raw, opts.optimizer)  # per optimizer step, and why
    placement = (fixed["chunk_size"], fixed["n_persist"], resident) if existing else None
    why = cached and plan_cache.unfit(cached, grads_held, micro, placement)  # priced, fits?
    if not why and cached and not prior and loop_memory.room_unused(cached["predicted"], loop):
        why = "its plan left the loop the room assumed before it was measured, more than it holds"
    cached, refused = (None, why) if why else (cached, refused)
    if refused:
        notes.append(refused)
    failed = sorted(set(failed) | set(failed_peaks))
    prog = progress.current()
    if cached is not None and not failed_peaks:
        prog.line(f"plan from the plan cache ({path}): no profiling")
        knobs = cached["knobs"]
        predicted = dict(cached["predicted"], from_cache=True, budget_bytes=budget, **looped)
        return Choice(
            dataclasses.replace(opts, **{k: knobs.get(k, 0) for k in KNOBS}),
            predicted,
            notes + [f"plan from the plan cache ({path}); no profiling"],
            path,
            failed,
            offload_resident=bool(existing) and knobs.get("n_persist", 0) < resident,  # move
        )
    unlowered = None  # the budget before a failed plan lowered it
    if failed:
        margin = int(min(failed) * FAILED_PEAK_MARGIN)
        if margin < budget:
            unlowered, budget = budget, margin
            budget_why = (
                f"{FAILED_PEAK_MARGIN:.0%} of the predicted peak of a plan of this graph that "
                f"ran out of memory ({format_bytes(min(failed))})"
            )
            notes.append(f"budget lowered to {format_bytes(budget)}: {budget_why}")

    if not all_resident and not existing and fixed["n_persist"] is None:  # no profile needed
        floor_args = (  # rank 0's numbers: every rank refuses or none does (no hang)
            sum(n for _, n in param_entries),
            budget,
            memory.pinnable_host(device, host_freed_bytes(live), n_peers),
            distributed.world().size if distributed.world().sharded else 1,
        )
        check_host_floor(*distributed.broadcast_object(floor_args))

    # ---- profile under the most frugal plan, on a copy with three of the blocks when they repeat;
    # or take this graph's profile from the cache (another budget or allocator cap, a re-plan)
    default_size = fixed["chunk_size"] or default_chunk_size(param_entries, structure, groups)
    profile_path = plan_cache.profile_path(
        plan_cache.key(
            gm, example_inputs, opts, hw_profile.key, None, alloc.key, regions is not None
        )
    )
    kept = distributed.broadcast_object(plan_cache.read_profile(profile_path))
    if kept is not None:
        step, static = profile_from_dict(kept)
        transfer_elem, compile_s, graph_name = kept["transfer_elem"], 0.0, kept["graph"]
        host_freed = host_freed_bytes(live)
        notes.append(f"profile from the profile cache ({profile_path}): no profiling compile")
        prog.line(f"profile from the profile cache ({profile_path}): no profiling")
    else:
        step, static, compile_s, plan, host_freed = profile_frugal(
            gm,
            example_inputs,
            structure,
            opts,
            fixed,
            default_size,
            compile_profiling,
            live,
            existing,
            notes,
            device,
            regions,
            alloc,
        )
        transfer_elem = (
            plan.param_dtype or live[0].dtype
        ).itemsize  # what offloaded chunks travel as
        graph_name = plan.graph_name
        if distributed.world().rank == 0:
            plan_cache.save_profile(
                profile_path,
                dict(profile_to_dict(step, static), graph=graph_name, transfer_elem=transfer_elem),
            )
    pinned.release_cached_pinned_memory()  # so that the host memory measured below is what is free

    # ---- search
    master_elem = live[0].dtype.itemsize
    cast_elem = (
        transfer_elem
        if (
            torch.is_autocast_enabled(device.type)
            and torch.get_autocast_dtype(device.type) != live[0].dtype
        )
        else 0
    )
    block_of = {}
    for fqn, _ in param_entries:
        b = structure.block_of_param(fqn)
        block_of[fqn] = b.index if b is not None else None
    entries = [(fqn, nbytes, block_of[fqn]) for fqn, nbytes in param_entries]
    sizes = (
        [default_size]
        if fixed["chunk_size"]
        else [default_size, default_size * 3 // 2, default_size * 2]
    )
    frag = allocator.fragmentation(alloc, step.reserved_ratio, step.peak_bytes, gap)
    profiles = [
        graph_profile(
            step,
            static,
            entries,
            cs,
            master_elem=master_elem,
            transfer_elem=transfer_elem,
            resident_cast_elem=cast_elem,
            fragmentation=frag,
            groups=groups,
            # in regions a swap block's own code starts its reloads (docs/design.md, section 11)
            reload_lead_blocks=0 if regions is not None else 1,
        )
        for cs in sizes
    ]
    # the profiling store's masters (host_init's values moved into them) are freed as the plan's
    # store takes each chunk over
    host_budget = memory.pinnable_host(device, host_freed, n_peers)
    hw = Hardware.of(hw_profile, step_rates.read(hw_profile, device.type))
    if device.type == "cpu":  # the optimizer on the cores that compute; no GPU host's triad bound
        hw = dataclasses.replace(hw, shared_compute=True, host_bytes_per_s=0.0)
    if at_step:  # the loop clips gradients: the CPU steps run after backward (plan_cache)
        hw = dataclasses.replace(hw, steps_at_opt_step=True)
        notes.append(f"offloaded chunks step at opt.step() in this loop ({at_step}): so priced")
    if grads_held:  # resident gradients through the whole step
        hw = dataclasses.replace(hw, grads_held=True)
        notes.append(f"{grads_held}: resident gradients priced through the whole step")
    if n_peers > 1:  # each block's peak counts its share of what they share
        hw = dataclasses.replace(hw, budget_shares=n_peers)
    if micro[0] > 1:  # forward and backward that often per optimizer step (plan/accumulation.py)
        hw = dataclasses.replace(hw, micro_steps=micro[0])
        notes.append(f"{micro[0]} micro-steps per optimizer step ({micro[1]}): so priced")
    w = distributed.world()
    # offloaded chunks may step on the device, streamed (runtime/device_steps.py): one rank, a
    # device that is not the host, the share not given, not turned off (PROTRAIN_DEVICE_STEPS=0)
    hw = dataclasses.replace(
        hw,
        device_steps=device.type == "cuda"
        and w.size == 1
        and fixed["device_steps"] is None
        and config.settings().device_steps,
        # a share the user fixed is priced as given (one rank, a device that is not the host)
        device_step_share=fixed["device_steps"] if device.type == "cuda" and w.size == 1 else None,
        grads_added_on_device=not w.sharded and config.settings().device_grad_add,
    )
    if w.sharded:  # the collectives' rate, measured now by every rank together
        hw = dataclasses.replace(
            hw, world_size=w.size, collective_bytes_per_s=distributed.collective_bytes_per_s(device)
        )
    knobs_given = dict(
        n_buffer=fixed["n_buffer"], n_swap=fixed["n_swap"], n_checkpoint=fixed["n_checkpoint"]
    )
    if w.sharded:  # chunks sharded on the devices: given, or searched (plan/ranks_cost.py)
        knobs_given["n_shard"] = fixed["n_shard"]
    if fixed["transfer_copies"] is False:  # given: priced as given
        profiles = [dataclasses.replace(p, transfer_copies=False) for p in profiles]
    prog.line(f"searching the plans under a budget of {format_bytes(budget)}")

    def searched(budget):
        """The search under ``budget``; n_persist = every chunk depends on the chunk size, so
        all-resident searches once per size."""
        if all_resident:
            results = [
                search([p], hw, budget, host_budget, n_persist=len(p.chunks), **knobs_given)
                for p in profiles
            ]
            res = min(results, key=lambda r: (r.best.time_s, r.best.peak_bytes))
            return dataclasses.replace(
                res,
                evaluated=sum(r.evaluated for r in results),
                seconds=sum(r.seconds for r in results),
            )
        given = dict(knobs_given, max_n_persist=max_persist)
        args = (profiles, hw, budget, host_budget, fixed["transfer_copies"] is None)
        try:
            res, why = search_or_without_copies(*args, n_persist=fixed["n_persist"], **given)
        except NoPlanFits:
            if max_persist is None or offload_first:
                raise
            res, why = search_or_without_copies(*args, **given)
            notes[notes.index(KEPT_PLACEMENT)] = (
                "chunk size kept from an earlier graph; no plan with its chunk placement fits, so "
                "resident chunks move to the host (with their gradients and optimizer state)"
            )
        notes.extend([why] if why else [])
        return res

    try:  # every rank searches; rank 0's outcome is the one every rank runs (distributed.py)
        try:
            res = searched(budget)
        except NoPlanFits as e:
            # under 90% of a failed plan's peak nothing fits, but a plan smaller than the failed one
            # does: the smallest
            smallest = e.min_device_bytes
            if unlowered is None or smallest is None or smallest >= min(failed + [unlowered + 1]):
                raise
            budget, budget_why = (
                smallest,
                "the smallest plan's peak: 90% of the peak of a plan of this graph that ran out "
                f"of memory ({format_bytes(min(failed))}) is below it",
            )
            notes.append(f"budget raised to {format_bytes(budget)}: {budget_why}")
            res = searched(budget)
    except NoPlanFits as e:
        hint = (
            (
                "; every chunk was kept resident because protrain has no optimizer to step "
                "offloaded ones: it steps torch.optim.Adam and AdamW, found when created before "
                "the model's first call or passed as options={'optimizer': opt}"
            )
            if all_resident
            else ""
        )
        min_dev, min_host = e.min_device_bytes, e.min_host_bytes
        if n_peers > 1 and min_dev is not None:  # in terms of the whole budget the user sets
            min_dev = min_dev * n_peers + growth
            hint += (
                f"; for all {n_peers} blocks of this regional compilation the budget must be at "
                f"least {format_bytes(min_dev)} ({min_dev} bytes)"
            )
            min_host = min_host * n_peers if min_host is not None else None
        budget_all = budget * n_peers + growth if n_peers > 1 else budget  # as min_dev counts
        failure = (  # NoPlanFits' arguments, in its order
            f"{e} (budget: {budget_why}){hint}",
            min_dev,
            min_host,
            prior,
            budget_all,
            allowance or 0,
            n_peers,
            prior_certain,
        )
        outcome = distributed.broadcast_object(("failed", failure))
    else:
        outcome = distributed.broadcast_object(
            (
                "ok",
                prediction(res, profiles, hw, budget, budget_why, compile_s, step, static, alloc),
            )
        )
    if outcome[0] == "failed":
        raise NoPlanFits(*outcome[1]) from None
    knobs, predicted = outcome[1]
    predicted["allocator_gap_bytes"] = gap if frag is not None else 0  # kept by the next plans
    predicted["grads_held"] = grads_held  # why (plan_cache.grads_held), or None
    predicted.update(looped)
    if fixed["device_steps"] is not None:
        knobs["device_steps"] = fixed["device_steps"]
    if distributed.world().rank == 0:
        plan_cache.save_entry(
            path, plan_cache.entry(graph_name, knobs, predicted, None, failed_peaks=failed)
        )
    prog.phases["search"] = predicted["search_s"]
    prog.line(
        f"searched {predicted['plans_evaluated']} plans in {predicted['search_s']:.2f} s: "
        + ", ".join(f"{k}={v}" for k, v in knobs.items())
    )
    log.debug(
        "protrain: profiled in %.1f s (+%.1f s compile), searched %d plans in %.3f s: %s",
        step.seconds,
        compile_s,
        predicted["plans_evaluated"],
        predicted["search_s"],
        knobs,
    )
    return Choice(
        dataclasses.replace(opts, **knobs), predicted, notes, path, failed, max_persist is not None
    )
