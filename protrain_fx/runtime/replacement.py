"""Moving resident chunks to the host in the middle of training, with their values, gradients and
optimizer state, so that a re-plan can offload more than the first plan did.

The first plan of a graph may keep chunks resident that a later re-plan needs on the host: the
loop keeps gradients between steps (gradient accumulation the first plan did not know of), or a
step ran out of device memory. A resident chunk's state is its parameters' device tensors, their
``.grad`` and the user's optimizer's ``opt.state[p]``; an offloaded chunk's is its host master,
its host gradient accumulator (``.grad`` a view of it) and the Adam moments that protrain's
HybridOptimizer (runtime/hybrid_optim.py) keeps on the host. :func:`offload_resident` turns the
last resident chunks (in first-use order, so the resident ones stay a prefix, as in every plan)
into offloaded ones: each parameter's value goes into its chunk's new master and the parameter
becomes a device view of it; a gradient it holds goes into the accumulator
(``fold_foreign_grads``); its optimizer state moves into the host moments (the optimizer takes
over state it finds in ``opt.state``, as for a checkpoint loaded before the first call). Nothing is
rounded or recomputed: training goes on exactly as before, only placed otherwise.

Only where nothing else depends on the old placement (:func:`may_offload`): one rank (a sharded
store's resident chunks are replicated and all-reduced), a store whose parameters are all the
graph's (a store of a model compiled in regions is one of several laid out alike), and protrain
stepping the offloaded chunks. Other graphs bound to the store (another shape, an evaluation
graph) see its ``placement_version`` change and are re-planned at their next call
(protrain_fx/compiled_graph.py).
"""

from __future__ import annotations

import logging

import torch

from protrain_fx.errors import ProtrainError
from protrain_fx.options import format_bytes
from protrain_fx.runtime import device_steps, hybrid_optim
from protrain_fx.runtime.chunk_store import live_stores, release_unused_buffers, store_of
from protrain_fx.runtime.worker import WORKER

log = logging.getLogger("protrain_fx")
# moves made in this process: a graph's per-call check (binding.py) compares one number first
moves = 0


def may_offload(params: list, optimizer) -> bool:
    """Whether a re-plan of the graph with parameters ``params`` may move resident chunks of their
    stores to the host: an optimizer protrain steps (or no parameter of theirs that trains: a
    frozen model's chunks hold nothing beside their values), one rank, parameters that are views of
    their host values, stores holding only the graph's parameters, and no store made like one of
    them for parameters of another call of the same code (a graph break in a block loop:
    binding.py), which would no longer be laid out like it."""
    params = [p for p in params if p is not None]
    stores = list({id(s): s for s in map(store_of, params) if s is not None}.values())
    if not stores:
        return False
    if optimizer is None and any(
        p is not None and p.requires_grad for s in stores for p in s.params
    ):
        return False
    own, ours = {id(p) for p in params}, {id(s) for s in stores}
    for s in stores:
        if not s.aliased or s.world.sharded:
            return False
        if any(p is not None and id(p) not in own for p in s.params):
            return False
    for s in live_stores():
        t = s.template() if s.template is not None else None
        if t is not None and id(t) in ours and id(s) not in ours:
            return False
    return True


def offload_beyond(layout, graph_inputs: list, params: list, n_persist: int, optimizer) -> None:
    """Keep resident only the parameters in the first ``n_persist`` chunks of the graph's chunk
    ``layout`` (its plan's): each store of the graph's parameters (one, or one per region of a graph
    compiled in regions, whose chunks are a run of the layout's) keeps resident its chunks that
    hold such parameters, and moves the others to the host (:func:`offload_resident`)."""
    chunk_of = {s.fqn: s.chunk for s in layout.slots}
    stores, keep = {}, {}
    for gi, p in zip(graph_inputs, params):
        s = store_of(p) if p is not None else None
        if s is None:
            continue
        stores[id(s)] = s
        k = keep.get(id(s), 0)
        if chunk_of[gi.fqn or gi.node_name] < n_persist:
            k = max(k, s.entry(p).chunk + 1)
        keep[id(s)] = k
    moved = [offload_resident(s, keep[i], optimizer) for i, s in stores.items()]
    chunks, nbytes = sum(m[0] for m in moved), sum(m[1] for m in moved)
    if chunks:
        log.warning(
            "protrain: %d resident chunk%s (%s) moved to the host, with their gradients and "
            "optimizer state; %d chunks stay resident",
            chunks,
            "" if chunks == 1 else "s",
            format_bytes(nbytes),
            sum(s.n_persist for s in stores.values()),
        )


def make_room(params: list, nbytes: int, optimizer=None) -> tuple[int, int]:
    """Move the last resident chunks of the stores of ``params`` to the host until at least
    ``nbytes`` of them moved (at least one chunk), for a call without gradients (an evaluation)
    that ran out of device memory beside the training plan's resident state. Only where
    :func:`may_offload` allows it with the optimizer protrain already steps for the stores'
    offloaded chunks (else ``optimizer``, the user's); returns how many chunks moved and their
    bytes ((0, 0): none could)."""
    params = [p for p in params if p is not None]
    stores = list({id(s): s for s in map(store_of, params) if s is not None}.values())
    live = [h for s in stores if (h := s.live_optimizer()) is not None]
    optimizer = live[0]._opt._ref() if live else optimizer
    if not may_offload(params, optimizer):
        return 0, 0
    chunks = moved = 0
    for s in reversed(stores):  # the last chunks of the last store first, as a plan would
        keep = s.n_persist
        while keep > 0 and moved < max(nbytes, 1):
            keep -= 1
            moved += s.layout.used_bytes(keep)
        if keep < s.n_persist:
            chunks += offload_resident(s, keep, optimizer)[0]
    return chunks, moved


def offload_resident(store, n_persist: int, optimizer=None) -> tuple[int, int]:
    """Make chunks ``n_persist .. store.n_persist - 1`` of ``store`` offloaded (see the module
    docstring); ``optimizer``: the user's, which protrain then steps them for. Returns how many
    chunks moved and their bytes."""
    old = store.n_persist
    if n_persist >= old:
        return 0, 0
    if store.world.sharded or not store.aliased:
        raise ProtrainError(
            "protrain internal error: resident chunks of a sharded store cannot move to the host"
        )
    WORKER.wait()  # nothing of the store's in flight on the host worker
    if store.is_cuda:  # values and gradients the compute stream may still be writing
        torch.cuda.current_stream(store.device).synchronize()
    moved = range(n_persist, old)
    store.n_persist = n_persist
    try:
        # values: each chunk's new master (pinned on CUDA) takes them, the parameters become views
        store._take_values(store.params, {}, moved)
        for c in moved:  # held gradients into the accumulators, .grad their views
            store.fold_foreign_grads(c)
    except BaseException:  # host memory ran out half way (pinning): everything back as it was
        _put_back(store, moved, old)
        raise
    store.make_buffers()  # sized for the offloaded chunks now; sizes no store uses are freed
    release_unused_buffers()
    store.placement_version += 1
    global moves
    moves += 1
    h = store.live_optimizer()
    if h is None and optimizer is not None:
        h = hybrid_optim.attach(optimizer, store)
    elif h is not None:
        h.add_store(store)  # the moments of the new offloaded chunks; opt.state taken over
    for c in moved if h is not None else ():  # this cycle's count of gradients is not a cycle's
        h.states[(store.id, c)].partial = True
    device_steps.assign(store, store.device_step_share)  # its share over the offloaded chunks now
    if store.is_cuda:
        torch.cuda.empty_cache()  # the device tensors they held
    return len(moved), sum(store.layout.used_bytes(c) for c in moved)


def _put_back(store, moved: range, old: int) -> None:
    """Undo a move that failed half way: the chunks that got a master give their values (and the
    gradients folded into their accumulators) back to device tensors, and stay resident."""
    for c in moved:
        for i in store.chunk_entry_indices(c):
            p, alias = store.param(i), store._grad_alias.pop(i, None)
            plain = store._grad_plain.pop(i, None)
            store._grad_scale.plain.pop(i, None)  # tensors sharing it keep that memory (kept_grads)
            if p is None:
                continue
            if c in store.master:  # its value is a view of the master: a device copy again
                p.data = p.data.to(store.device, copy=True)
            if alias is not None and p.grad is alias:
                p.grad = plain.to(store.device, copy=True)
            store._synced.pop(i, None)
            store._installed.pop(i, None)
            store._held_aside.pop(i, None)
        for table in (store.master, store.transfer, store.grad):
            table.pop(c, None)
    store.n_persist = old
