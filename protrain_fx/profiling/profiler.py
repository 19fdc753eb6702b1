"""Profiler: what the cost model needs of one graph, measured once per new graph.

The static part (what the partitions say, per block, without a run) is
protrain_fx/profiling/static.py's.

Timed part, one real step under the most frugal plan (every chunk offloaded, every block recomputed,
so a model larger than the device can be profiled): the Inductor-compiled kernels run with
``protrain::mark`` at every block boundary (passes/block_marks.py; around each block's region in a
graph compiled in regions, protrain_fx/region_program.py) and chunk copies serialized on the compute
stream between copy marks, which :mod:`protrain_fx.runtime.block_timer` subtracts, so block times
are compute only. A warm-up run fills the allocator's cache; the timed runs (the minimum per block
over two) reuse it, and blocks with the same signature (the same ops on the same FLOPs: a
transformer's layers) all get the fastest one's times (:func:`identical_block_times`). Gradients are
dropped, RNG state and mutated inputs restored: the step leaves no trace on training. Per block it
gives forward time and backward time (which includes its recomputation: the recomputed share of the
forward time is taken out by the static part's recomputed FLOP share), outside blocks the rest, and
the step's peak allocation, from which the largest transient working set (logits, loss, a recomputed
block) follows.

:func:`graph_profile` turns both into the cost model's
:class:`~protrain_fx.plan.profiles.GraphProfile` for any chunk size: block times are spread over
the chunks holding the block's parameters by bytes.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.utils._pytree as pytree

from protrain_fx import config
from protrain_fx.graph import sizes
from protrain_fx.plan.layout import pack
from protrain_fx.plan.profiles import FRAGMENTATION, BlockProfile, ChunkProfile, GraphProfile
from protrain_fx.profiling.static import SavedBytes, StaticProfile
from protrain_fx.runtime import block_timer


def identical_block_times(
    step: "StepProfile", static: StaticProfile, which: str = ""
) -> tuple[list[float], list[float]]:
    """Per block forward and backward seconds, each block of a group with the same signature given
    the group's fastest. Timing noise only adds (the host stalled, another process ran): on the H200
    one profile measured some of a GPT's 24 identical blocks at their usual 1.37 ms forward and
    others at up to 3.0 ms, which priced recomputation 1.6x too high and chose a swap plan.
    ``which``: "_host", the host's times to queue them instead, each group given its median
    (what the host takes varies from block to block with what else it runs; the fastest would
    hide that)."""
    fwd = list(getattr(step, f"block_fwd{which}_s"))
    bwd = list(getattr(step, f"block_bwd{which}_s"))
    if len(static.signatures) != len(fwd):
        return fwd, bwd
    groups: dict = {}
    for i, sig in enumerate(static.signatures):
        groups.setdefault(sig, []).append(i)
    pick = statistics.median if which else min
    for members in groups.values():
        f, b = pick(fwd[i] for i in members), pick(bwd[i] for i in members)
        for i in members:
            fwd[i], bwd[i] = f, b
    return fwd, bwd


# ------------------------------------------------------------------------------------------ timed
# part
@dataclass
class StepProfile:
    """One profiled step (the fastest of the measured ones, per quantity)."""

    block_fwd_s: list[float]
    block_bwd_s: list[float]  # includes the block's recomputation
    nonblock_fwd_s: float
    nonblock_bwd_s: float
    peak_bytes: int  # highest allocation during the step
    start_bytes: int  # allocated when it started
    reserved_ratio: float | None  # the allocator's reserved over allocated peak (None on the CPU)
    seconds: float  # wall time of the profiling runs (warm-up included)
    timeline: list = field(default_factory=list)  # block_timer.memory_timeline of the last run
    # what the machine was doing: host load average (1 min) before and after, and on CUDA the SM
    # clock and NVML's clock throttle reasons at the end (a slow profile can then be told from a
    # slow host or GPU)
    conditions: dict = field(default_factory=dict)
    # what backward's end holds beside the resident gradients (block_timer: "tail_bytes")
    tail_bytes: int = 0
    # the part of nonblock_bwd_s before the blocks' backward (block_timer: "head_bwd_ms")
    head_bwd_s: float = 0.0
    # parameter -> bytes per element of the dense gradient its oversized chunk sent to the host as
    # autograd made it (bf16 under autocast: its staging's), 0 where none came (an embedding's
    # rows only); a parameter missing was not oversized here (priced in the master dtype)
    oversized_grad_elem: dict = field(default_factory=dict)
    # parameter -> bytes of its dense table for a tied embedding whose gradient came as the head's
    # dense part and then the lookup's rows (ChunkStore.tied_row_tables): the table a resident
    # chunk's backward builds beside the gradient it holds
    tied_row_tables: dict = field(default_factory=dict)
    # the logits the graph returns beside a fused loss: the step holds them through backward (its
    # peak counts them), as a loop that keeps the model's output does; a loop that drops it before
    # backward peaks lower by them
    returned_logits_bytes: int = 0
    # every parameter whose gradient came as rows (tied or not): its table's bytes
    row_tables: dict = field(default_factory=dict)
    # what the host took to queue each block's forward and backward (backward with its
    # recomputation) and the rest of each, every chunk offloaded (its gathers' bookkeeping
    # included), the fastest run's (block_timer: "*_host_ms"; empty: not measured, a profile cached
    # before). On CUDA an offloaded chunk's forward runs no faster than its host queues it
    block_fwd_host_s: list = field(default_factory=list)
    block_bwd_host_s: list = field(default_factory=list)
    nonblock_fwd_host_s: float = 0.0
    nonblock_bwd_host_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def times_ms(self) -> dict:
        """The measured times in milliseconds, named as the fields (``_s`` -> ``_ms``): what a
        plan's details show of its profile."""
        names = ("block_fwd", "block_bwd", "block_fwd_host", "block_bwd_host", "nonblock_fwd")
        names += ("nonblock_bwd", "nonblock_fwd_host", "nonblock_bwd_host", "head_bwd")
        out = {}
        for name in names:
            v = getattr(self, f"{name}_s")
            out[f"{name}_ms"] = [1e3 * x for x in v] if isinstance(v, list) else 1e3 * v
        return out


# per block, what the profiled runs time (block_timer.block_timings' "<key>_ms"), the fastest kept
TIMED = ("fwd", "bwd", "fwd_host", "bwd_host")

# the spin queued before every block mark while profiling on CUDA (block_timer: host stalls): longer
# than the host takes to queue one block's kernels (0.2-0.6 ms for a GPT block on an idle host);
# ~100 marks per run. PROTRAIN_PROFILE_SPIN_S overrides it (0: none)
SPIN_LEAD_S = 0.003


def spin_lead_s() -> float:
    spin = config.settings().profile_spin_s
    return SPIN_LEAD_S if spin is None else spin


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _device_clocks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    from protrain_fx.machine.memory import nvml_device

    with nvml_device(device) as found:
        if found is None:
            return {"nvml_error": "no NVML device"}
        pynvml, h = found
        try:
            return {
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "throttle_reasons": pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),
            }
        except Exception as e:  # NVML query not permitted: the profile stands without it
            return {"nvml_error": repr(e)[:200]}


def _returned_logits_bytes(outs) -> int:
    """Bytes of the logits the graph returns beside a fused loss (passes/chunked_loss.py)."""
    from protrain_fx.runtime.loss_ops import is_returned_logits

    return sum(
        o.numel() * o.element_size()
        for o in pytree.tree_leaves(outs)
        if isinstance(o, torch.Tensor) and is_returned_logits(o)
    )


def _grad_outputs(outs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs the profiled backward starts from, with ones as their gradients: every
    differentiable one but logits returned beside a fused loss (passes/chunked_loss.py), which a
    training step never back-propagates through (their gradient function raises)."""
    from protrain_fx.runtime.loss_ops import is_returned_logits

    leaves = [
        o
        for o in pytree.tree_leaves(outs)
        if isinstance(o, torch.Tensor)
        and o.requires_grad
        and o.is_floating_point()
        and not is_returned_logits(o)
    ]
    return leaves, [torch.ones_like(o) for o in leaves]


def _drop_grad(t: torch.Tensor) -> None:
    t.grad = None


_drop_grad.protrain_own = True  # not a user's hook (runtime/param_hooks.py)


def profile_step(
    compiled, inputs: list, stores, n_blocks: int, device: torch.device, runs: int = 2
) -> StepProfile:
    """Run ``compiled`` (the profiling plan's graph) forward and backward ``1 + runs`` times on
    ``inputs`` and return its per-block times (see module docstring). Leaves no trace: gradients of
    offloaded chunks are dropped by the stores, other gradients restored, mutated inputs and RNG
    state restored."""
    t0 = time.perf_counter()
    # the graph's own inputs, cut from any autograd history: an activation from an earlier graph (a
    # graph break) must not be backpropagated into that graph's real backward, nor have its version
    # bumped by the restore below (its graph saved it); sizes at their hints (dynamic shapes)
    inputs = [
        sizes.size_hint(t)
        if isinstance(t, torch.SymInt)
        else t.data.requires_grad_(t.requires_grad)
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
        else t
        for t in inputs
    ]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    grads = [t.grad for t in leaves]
    # dropped as they come, as offloaded chunks' are: a chunk an earlier graph placed resident (an
    # evaluation before the first step, another shape) keeps its gradient on the device, which the
    # search prices itself; held here, it would count again in the measured working set
    drops = [t.register_post_accumulate_grad_hook(_drop_grad) for t in leaves]
    snapshot = [
        (t, t.detach().clone())
        for t in inputs
        if isinstance(t, torch.Tensor)
        and not isinstance(t, torch.nn.Parameter)
        and t.untyped_storage().size() > 0
    ]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    rec = block_timer.RECORDER
    best: dict | None = None
    reserved_ratio, returned = None, 0
    for s in stores:
        s.profiling = True
    # private (torch's own tests use it): optional
    if device.type == "cuda" and hasattr(torch.cuda, "_sleep"):
        rec.lead_s = spin_lead_s()
    conditions = {"loadavg_before": _loadavg()}
    try:
        for run in range(1 + runs):
            for t in leaves:
                t.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                if run == 0:
                    # the warm-up run starts from an empty cache (its reserved/allocated ratio is
                    # the step's own); the timed runs reuse what it cached, as training steps do: a
                    # run that has to map device memory mid-step stalls the host and so the kernels
                    # (cudaMalloc synchronizes; expandable segments map page by page), and those
                    # stalls would count as block time
                    torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            rec.clear()
            rec.record(block_timer.STEP, block_timer.STEP_START, device)
            outs = compiled(*inputs)
            rec.record(block_timer.STEP, block_timer.FWD_END, device)
            returned = max(returned, _returned_logits_bytes(outs))
            out_leaves, ones = _grad_outputs(outs)
            if out_leaves:
                torch.autograd.backward(out_leaves, ones)
            del outs, out_leaves, ones
            rec.record(block_timer.STEP, block_timer.STEP_END, device)
            timings = block_timer.block_timings()
            if device.type == "cuda":
                peak_alloc = max(timings[block_timer.STEP]["peak_bytes"], 1)
                ratio = torch.cuda.max_memory_reserved(device) / peak_alloc
                reserved_ratio = ratio if reserved_ratio is None else max(reserved_ratio, ratio)
            if run == 0:
                continue
            row = {
                key: [timings.get(b, {}).get(f"{key}_ms", 0.0) / 1e3 for b in range(n_blocks)]
                for key in TIMED
            }
            row["step"] = timings[block_timer.STEP]
            if best is None:
                best = row
            else:
                for key in TIMED:
                    best[key] = [min(a, b) for a, b in zip(best[key], row[key])]
                for k in ("fwd_ms", "bwd_ms", "head_bwd_ms", "fwd_host_ms", "bwd_host_ms"):
                    best["step"][k] = min(best["step"][k], row["step"][k])
                for k in ("peak_bytes", "start_allocated", "tail_bytes"):
                    best["step"][k] = max(best["step"][k], row["step"][k])
        timeline = block_timer.memory_timeline()
        conditions.update(loadavg_after=_loadavg(), **_device_clocks(device))
    finally:
        rec.lead_s = 0.0
        for s in stores:
            s.profiling = False
        rec.clear()
        for h in drops:
            h.remove()
        for t, g in zip(leaves, grads):
            t.grad = g
        with torch.no_grad():
            for t, saved in snapshot:
                t.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    step = best["step"]
    fwd, bwd = best["fwd"], best["bwd"]
    return StepProfile(
        block_fwd_s=fwd,
        block_bwd_s=bwd,
        nonblock_fwd_s=max(0.0, step["fwd_ms"] / 1e3 - sum(fwd)),
        nonblock_bwd_s=max(0.0, step["bwd_ms"] / 1e3 - sum(bwd)),
        peak_bytes=int(step["peak_bytes"]),
        start_bytes=int(step["start_allocated"]),
        reserved_ratio=reserved_ratio,
        seconds=time.perf_counter() - t0,
        timeline=timeline,
        conditions=conditions,
        tail_bytes=int(step["tail_bytes"]),
        head_bwd_s=min(step["head_bwd_ms"] / 1e3, max(0.0, step["bwd_ms"] / 1e3 - sum(bwd))),
        returned_logits_bytes=returned,
        **_host_times(best, device),
    )


def _host_times(best: dict, device: torch.device) -> dict:
    """The host's side of the fastest run, on CUDA (on the CPU the host is the device)."""
    if device.type != "cuda":
        return {}
    step = best["step"]
    fwd, bwd = best["fwd_host"], best["bwd_host"]
    return {
        "block_fwd_host_s": fwd,
        "block_bwd_host_s": bwd,
        "nonblock_fwd_host_s": max(0.0, step["fwd_host_ms"] / 1e3 - sum(fwd)),
        "nonblock_bwd_host_s": max(0.0, step["bwd_host_ms"] / 1e3 - sum(bwd)),
    }


def _tuples(x):
    """Lists back to the tuples they were before JSON (block signatures compare by equality)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def profile_to_dict(step: StepProfile, static: StaticProfile) -> dict:
    """A profiled step and the static profile as JSON-able values (the profile cache,
    protrain_fx/plan_cache.py)."""
    return {"step": step.to_dict(), "static": asdict(static)}


def profile_from_dict(d: dict) -> tuple[StepProfile, StaticProfile]:
    """The inverse of :func:`profile_to_dict`."""
    st = d["static"]
    static = StaticProfile(
        SavedBytes(**st["saved"]),
        list(st["recomputed_share"]),
        [_tuples(sig) for sig in st.get("signatures") or []],
    )
    return StepProfile(**d["step"]), static


def expand_profile(
    step: StepProfile, static: StaticProfile, expand: list[int]
) -> tuple[StepProfile, StaticProfile]:
    """The profile of a short copy of the graph (protrain_fx/graph/shorten.py) as the full graph's:
    block ``b`` of the full graph takes what was measured and derived for block ``expand[b]`` of the
    short one. The step's peak grows by what the blocks cut out save under recomputation (the
    profiled plan recomputes every block), so the transient working set :func:`graph_profile`
    derives from it is the short step's."""

    def widen(values: list) -> list:
        return [values[e] for e in expand]

    saved = static.saved
    wide_saved = SavedBytes(
        widen(saved.keep), widen(saved.recompute), saved.nonblock_keep, saved.nonblock_recompute
    )
    wide_static = StaticProfile(
        wide_saved,
        widen(static.recomputed_share),
        widen(static.signatures) if len(static.signatures) == len(saved.keep) else [],
    )
    extra = sum(wide_saved.recompute) - sum(saved.recompute)
    wide_step = dataclasses.replace(
        step,
        block_fwd_s=widen(step.block_fwd_s),
        block_bwd_s=widen(step.block_bwd_s),
        block_fwd_host_s=widen(step.block_fwd_host_s) if step.block_fwd_host_s else [],
        block_bwd_host_s=widen(step.block_bwd_host_s) if step.block_bwd_host_s else [],
        peak_bytes=step.peak_bytes + extra,
        conditions=dict(step.conditions, profiled_blocks=len(step.block_fwd_s), blocks=len(expand)),
    )
    return wide_step, wide_static


# ------------------------------------------------------------------------------------ GraphProfile
def graph_profile(
    step: StepProfile,
    static: StaticProfile,
    params: list[tuple[str, int, int | None]],
    chunk_size: int,
    *,
    master_elem: int,
    transfer_elem: int,
    resident_cast_elem: int,
    fragmentation: tuple[float, int] | None = None,
    groups: list | None = None,
    reload_lead_blocks: int = 1,
) -> GraphProfile:
    """The cost model's profile for ``chunk_size``. ``params``: ``(fqn, bytes, block index or
    None)`` in first-use order (how the chunks are packed; ``groups``: as ``pack``'s, when the
    graph is compiled in regions). ``fragmentation``: what to budget for the allocator,
    ``(factor, extra_bytes)`` (protrain_fx/machine/allocator.py, which calibrates fixed segments'
    with the profiled step's own; None: the cost model's default factor). ``reload_lead_blocks``:
    the profile's field (compiled in regions: 0)."""
    saved = static.saved
    n_blocks = len(step.block_fwd_s)
    block_fwd, block_bwd = identical_block_times(step, static)
    # the host's forward, every chunk offloaded (0 where not measured: on the CPU, or a profile
    # cached before): what an offloaded chunk's stretch takes at least (cost_model.py)
    host_fwd = identical_block_times(step, static, "_host")[0]
    if len(host_fwd) != n_blocks:
        host_fwd = [0.0] * n_blocks
    blocks = []
    for i in range(n_blocks):
        rc = block_fwd[i] * static.recomputed_share[i]
        blocks.append(
            BlockProfile(
                fwd_s=block_fwd[i],
                bwd_s=max(0.0, block_bwd[i] - rc),
                keep_bytes=saved.keep[i],
                input_bytes=saved.recompute[i],
                recompute_s=rc,
            )
        )
    layout = pack([(fqn, nbytes) for fqn, nbytes, _ in params], chunk_size, groups)
    block_of = {fqn: b for fqn, _, b in params}
    block_bytes = [0] * n_blocks
    for s in layout.slots:
        b = block_of.get(s.fqn)
        if b is not None:
            block_bytes[b] += s.nbytes
    group_of = dict(zip((fqn for fqn, _, _ in params), groups)) if groups is not None else {}
    chunk_group = {s.chunk: group_of.get(s.fqn, 0) for s in reversed(layout.slots)}
    per_chunk = [[0.0, 0.0, set(), 0.0] for _ in range(layout.n_chunks)]
    for s in layout.slots:
        b = block_of.get(s.fqn)
        if b is None:
            continue
        share = s.nbytes / block_bytes[b]
        row = per_chunk[s.chunk]
        row[0] += blocks[b].fwd_s * share
        row[1] += blocks[b].bwd_s * share
        row[2].add(b)
        row[3] += host_fwd[b] * share
    fqns: dict[int, list[str]] = {}
    for s in layout.slots:
        fqns.setdefault(s.chunk, []).append(s.fqn)
    # a chunk of one parameter (an oversized table or head): what the profiled step noted of it
    alone = {c: names[0] for c, names in fqns.items() if len(names) == 1}
    chunks = tuple(
        ChunkProfile(
            numel=(layout.used_bytes(c) + master_elem - 1) // master_elem,
            fwd_s=f,
            bwd_s=b,
            blocks=tuple(sorted(bl)),
            group=chunk_group.get(c, 0),
            grad_elem=step.oversized_grad_elem.get(alone.get(c)),
            table_grad_bytes=step.tied_row_tables.get(alone.get(c), 0),
            row_table_bytes=step.row_tables.get(alone.get(c), 0),
            host_fwd_s=h,
        )
        for c, (f, b, bl, h) in enumerate(per_chunk)
    )
    # what the all-recompute step held beyond what was allocated at its start (chunk buffers, model
    # states, the batch) and what it saved: the transient working set
    transient = step.peak_bytes - step.start_bytes - sum(saved.recompute) - saved.nonblock_recompute
    return GraphProfile(
        chunk_size=chunk_size,
        chunks=chunks,
        blocks=tuple(blocks),
        nonblock_fwd_s=step.nonblock_fwd_s,
        nonblock_bwd_s=step.nonblock_bwd_s,
        nonblock_saved_bytes=saved.nonblock_keep,
        transient_bytes=max(0, transient),
        tail_bytes=step.tail_bytes,
        head_bwd_s=step.head_bwd_s,
        master_elem=master_elem,
        transfer_elem=transfer_elem,
        resident_cast_elem=resident_cast_elem,
        fragmentation=FRAGMENTATION if fragmentation is None else fragmentation[0],
        fragmentation_bytes=0 if fragmentation is None else fragmentation[1],
        reload_lead_blocks=reload_lead_blocks,
    )
