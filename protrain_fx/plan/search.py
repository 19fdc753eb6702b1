"""Plan search: the fastest (chunk_size, n_persist, n_buffer, n_swap, n_checkpoint) whose predicted
peak fits the device budget and whose pinned host memory fits the host, by the cost model in
cost_model.py.

Exhaustive and exact: every chunk size profiled, every n_buffer candidate, every (n_swap,
n_checkpoint) with n_swap + n_checkpoint <= blocks, and every n_persist. The layout-dependent costs
are built once per (chunk size, n_buffer, n_swap, n_checkpoint) and each n_persist is then priced in
O(1); layouts are visited cheapest lower bound first, and the search stops at the first whose bound
exceeds the best plan found. Knobs given by the user are fixed and only the others are searched.
Ties: :func:`plan_key`.

When nothing fits, :class:`NoPlanFits` names the smallest budget that would work (the least
predicted peak over every plan the fixed knobs allow), or the host memory the smallest pinned
footprint needs.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import time
from dataclasses import dataclass

from protrain_fx.errors import NoPlanFits
from protrain_fx.options import format_bytes
from protrain_fx.plan.cost_model import LayoutCosts, _ProfileArrays
from protrain_fx.plan.profiles import ADAM_STATES, GraphProfile, Hardware, Prediction
from protrain_fx.plan.ranks_cost import shard_counts
from protrain_fx.plan.timeline import peak_parts


@dataclass(frozen=True)
class SearchResult:
    best: Prediction
    evaluated: int  # plans priced
    seconds: float


def plan_key(
    time_s: float,
    n_persist: int,
    n_swap: int,
    n_checkpoint: int,
    peak: int,
    chunk_size: int = 0,
    n_buffer: int = 0,
    n_shard: int = 0,
) -> tuple:
    """What "better" means: faster; at equal predicted time (the model hides transfers and the CPU
    step behind compute exactly, so ties are common) more resident chunks, then fewer swapped, then
    fewer recomputed blocks (less traffic and work the model may not see), then the smaller peak,
    then the smaller chunks and fewer buffers (so that a full tie does not depend on the order the
    layouts were tried in), then fewer chunks sharded on the devices."""
    # times equal to the microsecond tie
    return (round(time_s, 6), -n_persist, n_swap, n_checkpoint, peak, chunk_size, n_buffer, n_shard)


def n_buffer_candidates(n_buffer: int | None, min_n_buffer: int = 1) -> list[int]:
    if n_buffer is not None:
        return [n_buffer]
    return [b for b in (1, 2, 3) if b >= min_n_buffer] or [min_n_buffer]


def search(
    profiles: list[GraphProfile],
    hw: Hardware,
    device_budget: int,
    host_budget: int | None = None,
    *,
    n_persist: int | None = None,
    n_buffer: int | None = None,
    n_swap: int | None = None,
    n_checkpoint: int | None = None,
    min_n_buffer: int = 1,
    max_n_persist: int | None = None,
    n_shard: int | None = None,
    explain: bool = True,
) -> SearchResult:
    """The fastest plan that fits; the profiles are one per candidate chunk size (one if the size is
    given); ``max_n_persist``: at most that many resident chunks (a re-plan that may move resident
    chunks to the host, never back). With several ranks ``n_shard`` chunks after the resident ones
    are sharded on the devices (plan/ranks_cost.py): given, or every count searched (``None``).
    Where no plan fits, the :class:`NoPlanFits` names the smallest budgets that would do, priced
    over every layout again (as long as the search); ``explain=False`` raises it without them.
    The cyclic garbage collector is paused meanwhile: the search makes many small short-lived
    objects, and a full collection over everything torch has loaded, when one falls inside it,
    costs more than the search."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _search(
            profiles,
            hw,
            device_budget,
            host_budget,
            n_persist=n_persist,
            n_buffer=n_buffer,
            n_swap=n_swap,
            n_checkpoint=n_checkpoint,
            min_n_buffer=min_n_buffer,
            max_n_persist=max_n_persist,
            n_shard=n_shard,
            explain=explain,
        )
    finally:
        if enabled:
            gc.enable()


def _search(
    profiles,
    hw,
    device_budget,
    host_budget,
    *,
    n_persist,
    n_buffer,
    n_swap,
    n_checkpoint,
    min_n_buffer,
    max_n_persist,
    n_shard,
    explain,
) -> SearchResult:
    t0 = time.perf_counter()

    def persists(prof):  # the n_persist to try: given, or every one up to the bound
        if n_persist is not None:
            return [n_persist]
        top = len(prof.chunks) if max_n_persist is None else min(max_n_persist, len(prof.chunks))
        return range(top + 1)

    def plans(prof, lc=None):
        """(n_persist, n_shard) to price. With ``lc`` and n_shard searched: beside each n_persist
        from the most shards that fit (the peak grows with them) down, until even the CPU steps of
        the chunks left offloaded make a step slower than the best found (fewer shards: more)."""
        floors = None
        for p in persists(prof):
            counts = shard_counts(hw, n_shard, len(prof.chunks), p)
            if lc is None or len(counts) == 1:
                yield from ((p, sh) for sh in counts)
                continue
            floors = floors or _Floors(lc)
            device, cpu = floors.at(p)
            per_param, total = lc.cpu_per_param, lc.numel[-1]
            if best_key is not None and device + floors.least_to[-1] > best_key[0] + 1e-6:
                continue  # no count of shards beside p beats the best
            lo, hi = counts.start, counts.stop - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if lc.peak_bytes(p, mid) <= device_budget else (lo, mid - 1)
            # fewer shards from here on: the CPU's floor only grows, the device's is least_to's
            for sh in range(lo, counts.start - 1, -1):
                if best_key is not None:
                    worst, q = best_key[0] + 1e-6, p + sh
                    if floors.cpu_known and cpu + (total - lc.numel[q]) * per_param > worst:
                        break
                    if device + floors.least_to[q] > worst:
                        break
                    if device + floors.by_q[q] > worst:
                        continue
                yield p, sh

    shards = hw.world_size > 1 and n_shard != 0  # chunks may be sharded on the devices

    best: Prediction | None = None
    best_key = None
    evaluated = 0
    # every layout (chunk size, n_buffer, n_swap, n_checkpoint) with its O(1) lower bound, cheapest
    # first: once a layout's bound exceeds the best plan found, so do all the later ones' (exact,
    # and most layouts are never built)
    layouts = []
    for prof in profiles:
        n_blocks, n_chunks = len(prof.blocks), len(prof.chunks)
        if n_persist is not None and n_persist > n_chunks:
            continue
        swaps = [n_swap] if n_swap is not None else range(n_blocks + 1)
        for nb in n_buffer_candidates(n_buffer, min_n_buffer):
            arrays = _ProfileArrays(prof, hw, nb)
            for s in swaps:
                if s > n_blocks:
                    continue
                for k in [n_checkpoint] if n_checkpoint is not None else range(n_blocks - s + 1):
                    if s + k <= n_blocks:
                        layouts.append(
                            (
                                arrays.lower_bound_s(s, k, device_budget, shards, host_budget),
                                len(layouts),
                                prof,
                                nb,
                                s,
                                k,
                                arrays,
                            )
                        )
    layouts.sort(key=lambda t: t[:2])
    for bound, _, prof, nb, s, k, arrays in layouts:
        if best_key is not None and bound > best_key[0] + 1e-6:
            # no n_persist of this layout or any later one can beat (or tie) the best plan; the
            # margin
            break
            # keeps a rounding difference between the two sums from dropping a tie
        if bound == math.inf or arrays.peak_lower_bound(s, k) > device_budget:
            # no n_persist of it fits the device, or none both the device and the host (if no plan
            # does, the error pass below prices it anyway)
            continue
        lc = LayoutCosts(prof, hw, nb, s, k, arrays)
        for p, sh in plans(prof, lc) if shards else ((p, 0) for p in persists(prof)):
            peak = lc.peak_bytes(p, sh)
            if peak > device_budget:
                continue
            if host_budget is not None and lc.host_bytes(p, sh) > host_budget:
                continue
            evaluated += 1
            t = lc.time_s(p, n_shard=sh)
            if best_key is not None and t > best_key[0] + 1e-6:
                continue  # slower than the best even after rounding: not a tie
            key = plan_key(t, p, s, k, peak, prof.chunk_size, nb, sh)
            if best_key is None or key < best_key:
                best_key, best = key, lc.predict(p, sh)
    if best is None and not explain:
        raise NoPlanFits(
            f"no plan fits both the device budget ({format_bytes(device_budget)}) and the host "
            "memory protrain may pin"
            + (f" ({format_bytes(max(0, host_budget))})" if host_budget is not None else "")
        )
    if best is None:  # the smallest peak and pinned footprint over every layout, for the error
        # and the smallest peak of the plans whose pinned memory fits the host: the device budget
        # that would do where the host is what is short (more resident chunks, less pinned)
        min_peak, min_host, host_ok_peak, smallest = None, None, None, None
        for _, _, prof, nb, s, k, arrays in layouts:
            lc = LayoutCosts(prof, hw, nb, s, k, arrays)
            for p, sh in plans(prof):
                peak = lc.peak_bytes(p, sh)
                if min_peak is None or peak < min_peak:
                    min_peak, smallest = peak, (lc, p, sh)
                host = lc.host_bytes(p, sh)
                if peak <= device_budget:
                    min_host = host if min_host is None else min(min_host, host)
                if host_budget is not None and host <= host_budget:
                    host_ok_peak = peak if host_ok_peak is None else min(host_ok_peak, peak)
        if min_peak is None:
            raise NoPlanFits(
                "no plan satisfies the given knobs (n_persist larger than the chunks, "
                "or n_swap + "
                "n_checkpoint larger than the blocks)"
            )
        if min_peak > device_budget:
            raise NoPlanFits(
                f"memory budget {format_bytes(device_budget)} is too small: the smallest plan "
                "(everything "
                f"offloaded, activations swapped or recomputed as far as the knobs allow) needs "
                f"{format_bytes(min_peak)} on the device; the smallest budget that would work is "
                f"{min_peak} bytes "
                f"({format_bytes(min_peak)}); {_smallest_parts(*smallest)}",
                min_device_bytes=min_peak,
                min_host_bytes=min_host,
            )
        raise NoPlanFits(
            f"the host memory protrain may pin ({format_bytes(max(0, host_budget))}: what is "
            "available less a "
            f"reserve) is too small for the pinned buffers of any plan that fits "
            f"the device budget: the smallest needs {format_bytes(min_host)} of pinned host "
            "memory; free host memory or give a larger memory_budget (more resident chunks need "
            "less host memory): "
            + (
                f"the smallest device budget whose plans fit this host is {host_ok_peak} bytes "
                f"({format_bytes(host_ok_peak)})"
                if host_ok_peak is not None
                else "no device budget makes a plan fit this host"
            ),
            min_device_bytes=host_ok_peak,
            min_host_bytes=min_host,
        )
    return SearchResult(best, evaluated, time.perf_counter() - t0)


def _smallest_parts(lc: LayoutCosts, n_persist: int, n_shard: int) -> str:
    """What the smallest plan's peak is made of, largest part first."""
    parts = peak_parts(lc, n_persist)
    if n_shard:
        parts["chunks sharded on the devices"] = lc.shard_bytes(n_persist, n_shard)
    knobs = (
        f"n_buffer={lc.n_buffer}, n_swap={lc.n_swap}, n_checkpoint={lc.n_checkpoint}, "
        f"chunk size {format_bytes(lc.prof.chunk_size)}"
    )
    listed = "; ".join(
        f"{name} {format_bytes(v)}" for name, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v
    )
    return f"that plan ({knobs}) holds at its peak: {listed}"


class _Floors:
    """Times no plan of one layout beats, cheaper to get than its price, for ``n_persist``
    resident chunks and chunks ``q..`` offloaded (those between sharded on the devices): the
    device's (compute and transfers, the sharded chunks' collectives, casts, swap copies compute
    waits for, resident all-reduces, the optimizer steps on the device: ``device(p) + by_q[q]``)
    and the CPU's (forward, then the CPU steps of the offloaded chunks, more as ``q`` falls: not
    where device steps share that work, which is then not ``offloaded x rate``)."""

    def __init__(self, lc: LayoutCosts):
        hw, sh, self.lc = lc.hw, lc.sharded, lc
        self.slow, self.gpu = min(1.0, hw.sustained_slowdown), 1 / hw.gpu_adam_params_per_s
        self.by_q = [
            (sh.fwd[q] + sh.bwd[q] - lc.fwd_off[q] - lc.bwd_off[q]) * self.slow
            + sh.numel[q] * self.gpu
            for q in range(len(lc.numel))
        ]
        self.least_to = list(itertools.accumulate(self.by_q, min))  # over every q' <= q
        self.cpu_known = not (hw.device_steps or hw.device_step_share)

    def at(self, p: int) -> tuple[float, float]:
        """The device's floor less ``by_q[q]``, and the CPU's less its offloaded chunks' steps."""
        lc, hw, sh, n = self.lc, self.lc.hw, self.lc.sharded, len(self.lc.numel) - 1
        cast_fwd, cast_bwd = lc.cast_s(p)
        exposed = lc.swap_exposed_s(p) + lc.allreduce_exposed[p]
        exposed += (lc.allreduce_s[p] - lc.allreduce_exposed[p]) * hw.collective_contention
        nonblock = lc.prof.nonblock_fwd_s + lc.prof.nonblock_bwd_s
        compute = lc.fwd_res[p] + lc.bwd_res[p] + lc.fwd_off[n] + lc.bwd_off[n] + nonblock
        on_device = (compute + cast_fwd + cast_bwd + exposed - sh.fwd[p] - sh.bwd[p]) * self.slow
        fwd = lc.fwd_res[n] + lc.prof.nonblock_fwd_s + cast_fwd
        device = on_device + (lc.numel[p] - sh.numel[p]) * self.gpu
        return device, fwd * self.slow + lc.numel[p] * self.gpu


def search_or_without_copies(
    profiles: list[GraphProfile],
    hw: Hardware,
    device_budget: int,
    host_budget: int | None,
    may_drop_copies: bool,
    **knobs,
) -> tuple[SearchResult, str | None]:
    """:func:`search` with host transfer copies of the offloaded chunks and, where they may be
    dropped (not given) and the transfer dtype is narrower than the masters', without them: masters
    go up and are cast on the device, twice the bytes up for 2 bytes less host memory per offloaded
    parameter and a CPU step that writes no copy (faster: ``Hardware.cpu_s_per_param``). The faster
    plan of the two that fit (copies on a tie), with a note that says why when it keeps none; the
    first search's error when neither fits."""
    lean = [dataclasses.replace(p, transfer_copies=False) for p in profiles]
    droppable = may_drop_copies and lean[0].upload_staging_bytes
    try:  # where the copies may be dropped, an error names the budgets only if neither fits
        res = search(profiles, hw, device_budget, host_budget, explain=not droppable, **knobs)
        with_copies = None
    except NoPlanFits as e:
        res, with_copies = None, e
    if not droppable:
        if res is None:
            raise with_copies
        return res, None
    try:
        without = search(lean, hw, device_budget, host_budget, explain=False, **knobs)
    except NoPlanFits:
        if res is None:  # neither fits: the first search again, its error with the budgets
            search(profiles, hw, device_budget, host_budget, **knobs)
            raise with_copies from None
        return res, None
    if res is None:
        why = (
            "no plan with host transfer copies of the offloaded chunks fits: "
            f"{with_copies}; so they keep none (transfer_copies=False)"
        )
        return without, why
    both = dict(evaluated=res.evaluated + without.evaluated, seconds=res.seconds + without.seconds)
    if without.best.time_s >= res.best.time_s:
        return dataclasses.replace(res, **both), None
    why = (
        "offloaded chunks keep no host transfer copy (transfer_copies=False): predicted "
        f"{1e3 * without.best.time_s:.1f} ms a step against {1e3 * res.best.time_s:.1f} ms with "
        "them (the CPU step writes no copy; the gathers move the masters)"
    )
    return dataclasses.replace(without, **both), why


def brute_force(
    profiles: list[GraphProfile],
    hw: Hardware,
    device_budget: int,
    host_budget: int | None = None,
    n_buffers=(1, 2, 3),
) -> Prediction | None:
    """Every plan priced from scratch with cost_model.predict (for tests)."""
    from protrain_fx.plan.cost_model import predict
    from protrain_fx.plan.profiles import Knobs

    best, best_key = None, None
    for prof in profiles:
        for nb in n_buffers:
            for s in range(len(prof.blocks) + 1):
                for k in range(len(prof.blocks) - s + 1):
                    for p in range(len(prof.chunks) + 1):
                        for sh in shard_counts(hw, None, len(prof.chunks), p):
                            copies = prof.transfer_copies
                            knobs = Knobs(prof.chunk_size, p, nb, s, k, 0.0, copies, sh)
                            pred = predict(prof, hw, knobs)
                            if pred.peak_bytes > device_budget or (
                                host_budget is not None and pred.host_bytes > host_budget
                            ):
                                continue
                            peak = pred.peak_bytes
                            key = plan_key(pred.time_s, p, s, k, peak, prof.chunk_size, nb, sh)
                            if best_key is None or key < best_key:
                                best, best_key = pred, key
    return best


def check_host_floor(param_bytes: int, device_budget: int, host_budget: int, ranks: int) -> None:
    """Before any profiling: raise :class:`NoPlanFits` if no plan can fit the host, by a bound
    that needs no profile. Resident parameters hold on the device their value, gradient and
    ``ADAM_STATES`` moments (``2 + ADAM_STATES`` times their bytes; activations and buffers only
    add), so at most ``device_budget / (2 + ADAM_STATES)`` bytes of parameters are resident; every
    other byte is offloaded, and an offloaded parameter holds on the host at least its master, its
    gradient accumulator and its moments (this rank's ``1/ranks`` of them). The Llama-3.1-8B shape
    at 24 GiB on a 125 GiB host was refused this way only after its profiled step (90-107 s)."""
    per_byte = 2 + ADAM_STATES
    offloaded = max(0, param_bytes - device_budget // per_byte)
    need = offloaded * per_byte // max(1, ranks)
    if need <= max(0, host_budget):
        return
    # the device budget below which even this bound does not fit the host
    floor = per_byte * max(0, param_bytes - max(0, host_budget) * max(1, ranks) // per_byte)
    raise NoPlanFits(
        f"the host memory protrain may pin ({format_bytes(max(0, host_budget))}: what is "
        f"available less a reserve) is too small for any plan under a memory budget of "
        f"{format_bytes(device_budget)}: at least {format_bytes(offloaded)} of the "
        f"{format_bytes(param_bytes)} of parameters must be offloaded, which needs at least "
        f"{format_bytes(need)} of pinned host memory (masters, gradients and Adam moments); "
        f"found before profiling; free host memory or give a larger memory_budget: no plan fits "
        f"this host below {floor} bytes ({format_bytes(floor)}) of device memory",
        min_device_bytes=floor,
        min_host_bytes=need,
    )
