"""What a plan may use: the device budget of an automatic plan (``memory_budget``, or what this
process may use less a reserve) and the host memory its store frees as it takes the parameters over.
protrain_fx/autoplan.py plans under them; the host side's limit is
:func:`protrain_fx.machine.memory.pinnable_host`.

A re-plan of a graph whose parameters already have a store (runtime/replacement.py) counts what
that store holds on the host as its own: the new plan's host bytes include every offloaded chunk,
those already offloaded too.
"""

from __future__ import annotations

import torch

from protrain_fx._weakmap import IdentityWeakMap
from protrain_fx.machine import memory
from protrain_fx.options import Options, format_bytes
from protrain_fx.profiling import loop_memory
from protrain_fx.runtime import chunk_buffers
from protrain_fx.runtime.chunk_store import store_of
from protrain_fx.runtime.param_values import host_value

# a device shared by the process's graphs (CUDA, no memory_budget; inference_placement.py): a frozen
# model whose placement a training plan took back is placed again at its next call, in what that
# plan leaves; the least it needs there is set aside (a parameter of it -> (bytes, its parameters'
# ids)) until then
SET_ASIDE = IdentityWeakMap()
# bumped where a frozen model was placed in less than that beside training graphs planned before
# it: they plan again at their next call (compiled_graph.py), setting its least aside
shared_version = 0


def set_aside_bytes(params: list) -> tuple[int, str]:
    """``(bytes, why)`` set aside for frozen models other than ``params``'s."""
    mine = {id(p) for p in params if p is not None}
    aside = [n for _, (n, ids) in SET_ASIDE.items() if not ids & mine]
    if not aside:
        return 0, ""
    return sum(aside), (
        f", {format_bytes(sum(aside))} set aside for {len(aside)} frozen "
        f"model{'s' if len(aside) > 1 else ''} placed again at its next call"
    )


def reserve_bytes(limit: int) -> int:
    """Device memory the automatic budget leaves unused: the CUDA context's workspaces (cuBLAS,
    NCCL), the allocator's rounding and what the user allocates besides the model (the batch,
    metrics)."""
    return max(1 << 30, int(0.04 * limit))


def loop_allowance(opts: Options, device: torch.device) -> int | None:
    """What of the automatic budget's reserve the training loop may hold of its own between forward
    and backward without a plan counting it (profiling/loop_memory.py); None where the budget is
    not what the process may use on the device (a ``memory_budget``, a device without a meter)."""
    if opts.memory_budget is not None or device.type not in loop_memory.METERS:
        return None
    return reserve_bytes(device_usage(device, [], None)[2]) // 2


def device_budget(opts: Options, device: torch.device, params: list) -> tuple[int, str]:
    """``memory_budget`` when given; on CUDA otherwise what this process may use (the per-process
    fraction of the device, or what the driver has free plus this process's allocator cache,
    whichever is less) less everything already allocated except this graph's parameters, their
    gradients and optimizer state and their stores' buffers (which the plan places), the reserve
    and what is set aside for frozen models placed again at their next call."""
    if opts.memory_budget is not None:
        return opts.memory_budget, "memory_budget"
    usable, others, limit = device_usage(device, params, opts.optimizer)
    aside, aside_why = set_aside_bytes(params)
    budget = usable - others - reserve_bytes(limit) - aside
    return budget, (
        f"device memory this process may use ({format_bytes(usable)}) less "
        f"{format_bytes(others)} allocated by others and a "
        f"{format_bytes(reserve_bytes(limit))} reserve{aside_why}"
    )


def device_usage(device: torch.device, params: list, optimizer=None) -> tuple[int, int, int]:
    """``(usable, others, limit)`` on a CUDA device: the bytes this process may use (the driver's
    free memory and this process's allocator cache, within the per-process limit), those allocated
    by others than the parameters ``params`` (their values, gradients, ``optimizer``'s state and
    their stores' chunk buffers), and the per-process limit."""
    free, total, _, _ = memory.current_memory(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    limit = int(total * fraction)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    held = [(p, store_of(p)) for p in params if p is not None]
    stores = {id(s): s for _, s in held if s is not None}
    # an offloaded parameter (and its gradient) is a device view of host memory: not allocated here
    resident = [p for p, s in held if s is None or not s.param_is_offloaded(p)]
    mine = memory.placed_bytes(device, resident, optimizer)
    others = max(0, allocated - mine - chunk_buffers.held_by(stores.values(), device))
    return min(limit, free + reserved), others, limit


# optimizer state per parameter element, in parameter-sized tensors, by optimizer class name
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1}


def eager_growth(params: list, device: torch.device, optimizers: list) -> tuple[int, int]:
    """``(bytes, count)``: what the parameters on ``device`` among ``params`` that train outside
    every compiled graph will still allocate there: each one's gradient where it has none yet, and
    its optimizer's state where that optimizer holds none for it yet (two tensors of its size for
    Adam-like optimizers, one for Adagrad and for SGD or RMSprop with momentum, two for optimizers
    not known here). ``optimizers``: the live ones (``optimizer_lookup.live_optimizers()``)."""
    trained = [p for p in params if p is not None and p.requires_grad and p.device == device]
    if not trained:
        return 0, 0
    ids = {id(p) for p in trained}
    holders = {}
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) in ids:
                    holders[id(p)] = (o, g)
    total = 0
    for p in trained:
        if store_of(p) is not None:
            continue  # placed by a plan
        total += p.nbytes if p.grad is None else 0
        o, g = holders.get(id(p), (None, None))
        if o is None or o.state.get(p):
            continue
        name = type(o).__name__
        n = _STATE_TENSORS.get(name, 2)
        if name in ("SGD", "RMSprop"):
            n = int(bool(g.get("momentum"))) + int(bool(g.get("centered")))
        n += int(bool(g.get("amsgrad")))
        total += n * p.nbytes
    return total, len(trained)


def host_freed_bytes(params: list) -> int:
    """Host bytes that the plan of a graph with parameters ``params`` counts as its own: the host
    values (host_init's) its store frees as it takes each chunk over, and what the stores they
    already have hold on the host (masters, transfer copies, gradient accumulators, Adam moments),
    which a re-plan's host bytes include."""
    held = sum(v.nbytes for v in (host_value(p) for p in params) if v is not None)
    stores = {id(s): s for s in (store_of(p) for p in params) if s is not None}
    for s in stores.values():
        held += s.host_bytes
        h = s.optimizer
        for (sid, _), st in h.states.items() if h is not None else ():
            moments = (st.exp_avg, st.exp_avg_sq, st.max_exp_avg_sq) if sid == s.id else ()
            held += sum(t.nbytes for t in moments if t is not None and not t.is_cuda)
    return held
