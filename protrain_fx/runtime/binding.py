"""Which chunks a compiled graph works on, decided at every call from the parameters it is called
with.

Dynamo calls one compiled graph with whatever parameters the traced frame holds: with regional
compilation (``block.compile(backend="protrain")`` for every block) or a graph break inside the
block loop, the graph of the first block runs for every block. protrain's ops find their chunk from
the parameter tensors they are handed (protrain_fx/runtime/ops.py), so such a call works on the
right chunks as long as those parameters are laid out as the graph's code expects: the same chunk
grouping, offsets and placement. :class:`GraphBinding` checks that before each call (a pointer
comparison when the parameters are the ones of the last call) and:

* parameters that belong to no chunk store yet (the next block's, at its first call) get a store
  made like the graph's own (same layout, same placement), attached to the same optimizer;
* parameters laid out otherwise (another store's chunks) make the call run the graph as dynamo
  traced it, eagerly: exact (offloaded parameters are device views of their host values), only
  slower; said once.

:func:`runtime_guard` wraps each compiled forward and backward: an exception inside one (an OOM, a
failing user function) leaves no device chunk buffer reserved and no copy queued, so the loop can go
on.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import torch

from protrain_fx import _compat
from protrain_fx.errors import ProtrainError
from protrain_fx.runtime import (
    chunk_buffers,
    chunk_grads,
    device_steps,
    hybrid_optim,
    param_hooks,
    replacement,
    step_redo,
    swap_pool,
)
from protrain_fx.runtime.chunk_store import ChunkStore, store_of

log = logging.getLogger("protrain_fx")


def on_error(fn, catch, handle):
    """``fn`` (a compiled graph, boxed or not) whose ``catch`` exceptions go to ``handle(e)``, which
    returns the exception to raise (``e`` itself: re-raised as it is)."""

    def call(invoke):
        try:
            return invoke()
        except catch as e:
            new = handle(e)
            if new is e:
                raise
            raise new from e

    if getattr(fn, "_boxed_call", False):

        def run(args):
            return call(lambda: fn(args))

        run._boxed_call = True
    else:

        def run(*args):
            return call(lambda: fn(*args))

    run.__wrapped__ = fn
    # what aot_autograd reads off a compiled graph to save its cache entry (code_cache.py)
    return _compat.keep_cache_attrs(run, fn)


def runtime_guard(fn):
    """``fn`` (a compiled graph, boxed or not) that resets protrain's run-time state if it
    raises."""

    def reset(e):
        chunk_buffers.reset_all()
        swap_pool.reset_all()
        chunk_grads.forget_end_of_backward()
        return e

    return on_error(fn, BaseException, reset)


class GraphBinding:
    """See the module docstring. ``positions``: the graph inputs that are parameters; ``params``:
    those the graph was compiled with."""

    def __init__(
        self,
        graph_name: str,
        positions: list[int],
        params: list[torch.nn.Parameter],
        optimizer,
        eager_graph,
        root=None,
    ):
        self.graph_name = graph_name
        # the module dynamo traced: a store made for other parameters installs its state-dict
        # hooks there when its parameters are shells (several ranks)
        self._root = weakref.ref(root) if isinstance(root, torch.nn.Module) else None
        self.positions = positions
        self._last = [weakref.ref(p) for p in params]
        self._compiled_for = list(self._last)
        self._signature = placement_signature(params)
        stores = {id(s): s for s in (store_of(p) for p in params) if s is not None}
        # a store made by this graph for exactly its parameters can be made again for another
        # block's
        self._template = None
        if len(stores) == 1:
            (t,) = stores.values()
            if len(t.entries) == len({id(p) for p in params}):
                self._template = weakref.ref(t)
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        # parameters in no store get stores like the graph's own (a block's graph), not a graph
        # of their own (protrain_fx/model_instances.py)
        self.makes_like_its_own = self._template is not None
        self._eager_graph = eager_graph
        self._said = False
        # each store's placement when the graph was bound (runtime/replacement.py moves it)
        self._versions = [(weakref.ref(s), s.placement_version) for s in stores.values()]
        self._moves = replacement.moves

    def placement_moved(self) -> bool:
        """Whether resident chunks of a store this graph's code was compiled for have moved to the
        host since (another graph's re-plan), or the store is gone: the code reads them as they
        were placed, so the graph must be planned again before its next call."""
        if replacement.moves == self._moves:  # none in this process since (every call: one compare)
            return False
        # a store gone since (an inference placement released for training) counts as moved
        return any((s := r()) is None or s.placement_version != v for r, v in self._versions)

    def __call__(self, compiled, args):
        params = [args[i] for i in self.positions]
        if torch.is_grad_enabled() and any(param_hooks.hooked(p) for p in params):
            param_hooks.prepare(params)  # p.register_hook on offloaded parameters
        same = len(params) == len(self._last) and all(r() is p for r, p in zip(self._last, params))
        if same or self._bind(params):
            self._last = [weakref.ref(p) for p in params]
            out = compiled(*args)
            if torch.is_grad_enabled():
                step_redo.refused_at_create_graph(out)
            return out
        if not self._said:
            self._said = True
            log.warning(
                "protrain: graph %s was called with parameters laid out in chunks unlike "
                "those it was "
                "compiled for; it runs eagerly for them (exact, slower)",
                self.graph_name,
            )
        return self._eager_graph(*args)

    def bind(self, params: list) -> None:
        """Bind ``params`` now (the regions of a program that share this graph's code, before the
        first step): stores made like the graph's own when they have none; their layout must be the
        one the graph was compiled for."""
        if not self._bind(params):
            raise ProtrainError(
                f"protrain internal error: graph {self.graph_name}'s code was bound to parameters "
                "laid out otherwise"
            )

    def _bind(self, params: list) -> bool:
        if all(store_of(p) is None for p in params) and self._template is not None:
            template = self._template()
            if template is not None:
                self._mirror(template, params)
        return placement_signature(params) == self._signature

    def _mirror(self, template: ChunkStore, params: list) -> None:
        """A store for ``params`` made like ``template`` (the same layout over parameters of the
        same shapes in the same order, the same placement)."""
        by_entry = {}
        for p, ref in zip(params, self._compiled_for):
            t = ref()
            if t is None or store_of(t) is not template:
                raise ProtrainError(
                    "protrain internal error: the graph's template parameters are gone"
                )
            by_entry[template.entry_index(t)] = p
        named = [(template.entries[i].fqn, by_entry[i]) for i in range(len(template.entries))]
        from protrain_fx.runtime.param_values import HOST_VALUES

        host_values = {id(p): HOST_VALUES.pop(p) for _, p in named if p in HOST_VALUES}
        store = ChunkStore(
            named,
            template.layout,
            template.n_persist,
            template.param_dtype,
            host_values,
            transfer_copies=template.transfer_copies,
        )
        root = self._root() if self._root is not None else None
        fqns: dict = {}  # the parameters' own names (errors name them), not the template's
        for name, p in root.named_parameters(remove_duplicate=False) if root is not None else ():
            fqns.setdefault(id(p), name)
        for i, e in enumerate(store.entries):  # in the layout's order, as the template's
            store.entries[i] = dataclasses.replace(e, fqn=fqns.get(id(by_entry[i]), e.fqn))
        store.ensure_buffers(template.n_buffer)
        store.template = weakref.ref(template)
        store.for_inference = template.for_inference
        opt = self._optimizer() if self._optimizer is not None else None
        # a store for a graph without gradients steps nothing (as placement.py's), so that training
        # may release it (inference_placement.release_for_training)
        if store.offloaded_chunks and opt is not None and not store.for_inference:
            hybrid_optim.attach(opt, store)
            device_steps.assign(store, template.device_step_share)
        if store.offloaded_chunks and not store.aliased and root is not None:
            from protrain_fx.runtime.param_values import hook_owners_of

            hook_owners_of(root, [p for _, p in named])


def refuse_converted(params: list) -> None:
    """Parameters converted after protrain placed them (``model.to(dtype or device)``, ``.half()``:
    each given a tensor of another dtype or device) make dynamo compile the model again, but their
    chunk stores hold the old dtype and place, and a training step would hand autograd gradients
    of the old dtype. Refused for training, saying what to do; evaluation and generation of the
    converted model run as they are."""
    if not torch.is_grad_enabled():
        return
    for p in params:
        s = store_of(p)
        if s is None or not p.requires_grad:
            continue
        if p.dtype != s.master_dtype or p.device != s.device or p.shape != s.entry(p).shape:
            raise ProtrainError(
                f"protrain: parameter {s.entry(p).fqn!r} is now {p.dtype} {tuple(p.shape)} on "
                f"{p.device}, but protrain holds it in a chunk of {s.master_dtype} "
                f"{tuple(s.entry(p).shape)} on {s.device}: the model was "
                "converted after its first compiled call (model.to(...), .half(), .bfloat16()). "
                "protrain cannot train the converted model in the chunks made for the old one: "
                "convert the model before compiling it, or build and compile the converted model "
                "anew (a fresh model, load_state_dict, torch.compile(..., backend='protrain')); "
                "evaluating or generating with the converted model works as it is"
            )


def placement_signature(params: list, unplaced: bool = False) -> tuple | None:
    """How ``params`` sit in chunks, relative to one another: per offloaded parameter (group,
    offset, transfer dtype, chunk size), where group numbers the distinct (store, chunk) pairs in
    order of first appearance, and None per resident one; None when a parameter is in no store
    (with ``unplaced``: "unplaced" for that parameter)."""
    groups: dict[tuple[int, int], int] = {}
    out = []
    for p in params:
        s = store_of(p)
        if s is None:
            if unplaced:
                out.append("unplaced")
                continue
            return None
        e = s.entry(p)
        # the graph reads a resident parameter itself: any chunk will do
        if not s.is_offloaded(e.chunk):
            out.append(None)
            continue
        g = groups.setdefault((s.id, e.chunk), len(groups))
        out.append((g, e.offset, s.param_dtype, s.chunk_numel(e.chunk)))
    return tuple(out)
