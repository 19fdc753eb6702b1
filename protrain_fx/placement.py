"""Placement: bind a graph's parameters to chunk stores, deciding which chunks are resident.

Runs once per compiled graph, when its joint graph (or inference graph) exists and before the chunk
passes. Parameters already owned by a store (an earlier graph of the same model: another shape, an
inference graph) keep their chunks and placement; the others get a new store. For a new store,
``n_persist`` comes from the options (set by the automatic plan, protrain_fx/autoplan.py, when the
user left it unset), or is "all chunks". The transfer dtype is ``param_dtype``, or the autocast
dtype the graph is being compiled under, or the parameters' own dtype.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from protrain_fx import _compat
from protrain_fx.errors import NoPlanFits
from protrain_fx.machine import memory
from protrain_fx.options import Options, format_bytes
from protrain_fx.plan.layout import pack
from protrain_fx.plan.plan import ChunkPlan, Plan
from protrain_fx.plan.profiles import ADAM_STATES, GRAD_BUFFERS
from protrain_fx.runtime import device_steps, distributed, hybrid_optim
from protrain_fx.runtime.chunk_store import ChunkStore, get_store, store_of
from protrain_fx.runtime.param_values import HOST_VALUES, hook_owners_of


def autocast_dtypes() -> dict[str, torch.dtype]:
    """The autocast dtype of each device type autocast is enabled for, right now. Read it on entry
    to the backend: aot_autograd's partition and compile callbacks run with autocast turned off."""
    out = {}
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            out[device_type] = torch.get_autocast_dtype(device_type)
    return out


def transfer_dtype(
    options: Options,
    device: torch.device,
    master_dtype: torch.dtype,
    autocast: dict[str, torch.dtype],
) -> torch.dtype:
    if options.param_dtype is not None:
        return options.param_dtype
    return autocast.get(device.type, master_dtype)


def estimate_device_bytes(
    chunk_bytes: list[int],
    chunk_size: int,
    n_persist: int,
    n_buffer: int,
    transfer_elem: int,
    master_elem: int,
    activation_bytes: int,
    optimizer_states: int,
) -> dict[str, int]:
    """Device memory of a placement, by component (before the fragmentation factor)."""
    resident = sum(chunk_bytes[:n_persist])
    largest_offloaded = max(chunk_bytes[n_persist:], default=0) // master_elem * transfer_elem
    return {
        "resident_params": resident,
        "resident_grads": resident,
        "resident_optimizer": resident * optimizer_states,
        "chunk_buffers": n_buffer * largest_offloaded,
        # device gradient buffers, master dtype (a chunk larger than chunk_size needs none)
        "grad_buffers": GRAD_BUFFERS
        * max((b for b in chunk_bytes[n_persist:] if b <= chunk_size), default=0),
        "activations": activation_bytes,
    }


def bind_chunks(
    plan: Plan,
    options: Options,
    params: list[tuple[int, str, torch.nn.Parameter]],
    root,
    activation_bytes: int,
    training: bool,
    autocast: dict[str, torch.dtype],
) -> None:
    """Create or reuse the stores of ``params`` and record the binding in ``plan`` (see module
    docstring). ``activation_bytes``: what the graph saves for backward
    (:func:`protrain_fx.graph.fx.saved_activation_bytes` of its joint graph), for the estimate."""
    if not params:
        return
    with _compat.real_tensor_mode():
        _bind(plan, options, params, root, activation_bytes, training, autocast)


def _bind(plan, options, params, root, activation_bytes, training, autocast) -> None:
    new = [(idx, fqn, p) for idx, fqn, p in params if store_of(p) is None]
    if new:
        _new_store(plan, options, new, root, activation_bytes, training, autocast)
    stores = []
    for idx, fqn, p in params:
        store = store_of(p)
        plan.input_entry[idx] = (store.id, store.entry_index(p))
        if store not in stores:
            stores.append(store)
    offloaded = [s for s in stores if s.offloaded_chunks]
    if offloaded and training and not plan.profiling:  # the profiler's step drops its gradients
        if options.optimizer is not None:
            for s in offloaded:
                hybrid_optim.attach(options.optimizer, s)
                # some offloaded chunks step on the compute device (runtime/device_steps.py)
                device_steps.assign(s, options.device_steps or 0.0)
            plan.device_steps = options.device_steps or 0.0
        elif not any(s.optimizer is not None for s in offloaded):
            plan.notes.append(
                "offloaded chunks are stepped by your optimizer through device views of host "
                "memory, which is "
                "exact but slow on a GPU: pass options={'optimizer': opt} (torch.optim.Adam or "
                "AdamW) to let "
                "protrain step them on the CPU during backward"
            )
    _describe(plan, stores, params, options)


def _new_store(plan, options, new, root, activation_bytes, training, autocast) -> None:
    fqns = [(fqn, p) for _, fqn, p in new]
    device, master = fqns[0][1].device, fqns[0][1].dtype
    sizes = [(fqn, p.numel() * p.element_size()) for fqn, p in fqns]
    layout = pack(sizes, plan.chunk_size)
    param_dtype = transfer_dtype(options, device, master, autocast)
    chunk_bytes = [layout.used_bytes(c) for c in range(layout.n_chunks)]
    n_buffer = options.n_buffer if options.n_buffer is not None else 2
    elem, t_elem = master.itemsize, param_dtype.itemsize
    activations = activation_bytes if training else 0
    # n_persist: given, or chosen by the automatic plan (protrain_fx/autoplan.py, which sets the
    # option), else every chunk resident
    n_persist = (
        layout.n_chunks if options.n_persist is None else min(options.n_persist, layout.n_chunks)
    )
    # with one rank a chunk "sharded" over the ranks is a resident one
    n_shard = options.n_shard or 0
    if n_shard and not distributed.world().sharded:
        n_persist = min(layout.n_chunks, n_persist + n_shard)
        plan.notes.append(f"n_shard={n_shard} with one rank: those chunks are resident")
        n_shard = 0
    plan.estimate = estimate_device_bytes(
        chunk_bytes, plan.chunk_size, n_persist, n_buffer, t_elem, elem, activations, ADAM_STATES
    )
    # the store takes the host values over (each is freed once its chunk holds it); a store that
    # fails half-built hands back what it has not placed, so the parameters keep their values
    host_values = {id(p): HOST_VALUES.pop(p) for _, p in fqns if p in HOST_VALUES}
    try:
        store = ChunkStore(
            fqns,
            layout,
            n_persist,
            param_dtype,
            host_values,
            n_shard,
            transfer_copies=options.transfer_copies is not False,
        )
    except BaseException:
        for _, p in fqns:
            if id(p) in host_values:
                HOST_VALUES[p] = host_values[id(p)]
        raise
    del host_values
    store.for_inference = not training
    if store.n_shard:
        home = [c for c in store.offloaded_chunks if store.home_on_device(c)]
        states = sum(store.host_numel(c) for c in home) * elem * (2 + ADAM_STATES)
        plan.notes.append(
            f"n_shard={store.n_shard}: {format_bytes(states)} of master, gradient and moment "
            f"shards on this device (1/{store.world.size} of {len(home)} chunks)"
        )
    # with several ranks resident chunks are replicated: average their gradients across ranks
    distributed.average_resident_grads(
        [p for _, p in fqns if not store.param_is_offloaded(p)], options.optimizer
    )
    if store.aliased:
        # parameters are views of their values: state_dict() and load_state_dict() need no hooks
        return
    if store.offloaded_chunks and root is not None and isinstance(root, torch.nn.Module):
        hook_owners_of(root, [p for _, p in fqns])
    elif store.offloaded_chunks:
        plan.notes.append(
            "could not find the compiled module, so model.state_dict() cannot read offloaded "
            "parameters; "
            "read them with protrain_fx.runtime.param_values.value_of(param)"
        )


def _describe(plan: Plan, stores: list[ChunkStore], params, options: Options) -> None:
    """Make the plan's chunk table, knobs and notes reflect the stores the graph runs on."""
    store = stores[0]
    plan.param_dtype = store.param_dtype
    plan.chunk_size = store.layout.chunk_size
    plan.n_persist = store.n_persist
    plan.n_shard = store.n_shard
    plan.transfer_copies = store.transfer_copies
    plan.n_buffer = (
        max(1, store.n_buffer, options.n_buffer if options.n_buffer is not None else 2)
        if store.offloaded_chunks
        else 0
    )
    plan.n_buffer_given = options.n_buffer is not None and not plan.n_buffer_searched
    plan.chunks = [
        ChunkPlan(
            id=c,
            bytes=store.layout.used_bytes(c),
            params=[e.fqn for _, e in store.chunk_entries(c)],
            placement="sharded"
            if store.home_on_device(c)
            else "host"
            if store.is_offloaded(c)
            else "device",
        )
        for c in range(store.n_chunks)
    ]
    plan.param_chunk = {e.fqn: e.chunk for e in store.entries}
    if len(stores) > 1:
        plan.notes.append(
            f"this graph's parameters span {len(stores)} chunk stores; the table shows the first"
        )
    if (
        store.offloaded_chunks
        and not store.transfer_copies
        and store.param_dtype != store.master_dtype
    ):
        plan.notes.append(
            "offloaded chunks keep no host copy in "
            f"{str(store.param_dtype).replace('torch.', '')}: a gather uploads the master and "
            "casts it on the device (twice the bytes up, 2 bytes per parameter less host memory)"
        )
    if store.offloaded_chunks:
        plan.notes.append(
            "offloaded chunks travel as "
            f"{str(store.param_dtype).replace('torch.', '')}; "
            f"{store.describe()}"
        )


def gathers_chunks(gm: fx.GraphModule) -> bool:
    """Whether a graph after its passes gathers offloaded chunks (and so needs chunk buffers)."""
    from protrain_fx.runtime import ops

    return any(n.op == "call_function" and n.target is ops.GATHER for n in gm.graph.nodes)


def allocate_buffers(plan: Plan, gm: fx.GraphModule | None) -> None:
    """After a graph's passes: the device chunk buffers its prefetches fill (``plan.n_buffer`` per
    chunk store it reads), allocated by the runtime, never by a pass. ``gm`` None: the graph is
    known to gather (its code came from the cache, protrain_fx/code_cache.py)."""
    if gm is not None and not gathers_chunks(gm):
        return
    with _compat.real_tensor_mode():  # compile callbacks run under aot_autograd's fake mode
        for store_id in sorted({sid for sid, _ in plan.input_entry.values()}):
            get_store(store_id).ensure_buffers(max(1, plan.n_buffer))


def check_host_memory(plan: Plan, opts: Options, params: list, device) -> None:
    """Before anything is allocated: the host memory that offloading the chunks of parameters
    without a store yet needs (master, gradient, two moments, the transfer copy) fits what the host
    has, less a reserve."""
    live = [p for p in params if p is not None]
    if opts.n_persist is None or not live or any(store_of(p) is not None for p in live):
        return
    layout, elem = plan.layout, live[0].element_size()
    offloaded = sum(
        layout.used_bytes(c) for c in range(min(opts.n_persist, layout.n_chunks), layout.n_chunks)
    )
    transfer = opts.param_dtype.itemsize if opts.param_dtype is not None else elem
    copies = transfer != elem and opts.transfer_copies is not False
    per_param_bytes = 4 * elem + (transfer if copies else 0)
    need = offloaded // elem * per_param_bytes
    _, _, available, total = memory.current_memory(device)
    reserve = max(2 << 30, int(0.05 * total))
    if need > available - reserve:
        raise NoPlanFits(
            f"protrain: n_persist={opts.n_persist} offloads {format_bytes(offloaded)} of "
            "parameters, which need "
            f"{format_bytes(need)} of host memory (master, gradient, two Adam moments, transfer "
            "copy); the host has "
            f"{format_bytes(available)} available and protrain keeps a {format_bytes(reserve)} "
            "reserve: keep more "
            "chunks resident (a larger n_persist) or free host memory",
            min_host_bytes=need + reserve,
        )
