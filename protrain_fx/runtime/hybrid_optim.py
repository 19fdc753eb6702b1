"""HybridOptimizer: the user's ``torch.optim.Adam``/``AdamW``, with the offloaded chunks' step on the CPU.

The user's optimizer object stays the one they step, schedule and checkpoint. Resident parameters are
stepped by it on the device, as always. For the offloaded chunks of the stores attached to it, protrain
keeps the Adam moments in host memory and runs the step on the CPU (one pass of protrain_fx/machine/cpu_adam.py
over the flat chunk where it can), with the hyperparameters of the user's param groups; torch's own step
skips those parameters (their ``.grad`` is hidden from it during ``opt.step()``).

The step of a chunk may run *inside backward*, on the host worker right behind the chunk's last gradient,
overlapped with the rest of backward. That is the speed of offloading, and it must not change the result.
So such a step is provisional until ``opt.step()`` commits it:

* it is taken only from the second cycle on, once protrain has seen how many gradients each chunk gets
  between two ``opt.step()`` calls (gradient accumulation), never for AMSGrad or non-fp32 masters;
* ``opt.step()`` commits it if nothing the step depended on changed since; if a hyperparameter changed
  (``lr``, ``weight_decay``, ``betas``, ... set between ``backward()`` and ``opt.step()``), the step is
  taken back and redone with the new values;
* taken back as well when anything writes the chunk's gradients before ``opt.step()`` (clipping,
  unscaling: the gradient views call back first, protrain_fx/runtime/mapped.py), when another backward adds to
  them (more micro-steps than learned), and when ``opt.zero_grad()`` comes without ``opt.step()`` (a skipped
  step: an exception, a non-finite loss);
* after clipping or a hyperparameter change between backward and step has been seen once, chunks step at
  ``opt.step()`` from then on (every step would otherwise be taken back).

Taking a step back inverts Adam exactly in real arithmetic (in float64: the restored values are within
float32 rounding of the originals), from the moments, the parameter and the gradient, which are all still
there. ``opt.step(closure)`` runs the closure first, as Adam does. Gradients stay as eager leaves them
(``param.grad`` is a view of the host accumulator; ``zero_grad()`` and ``set_to_none`` work as always).
``opt.state_dict()`` / ``opt.load_state_dict()`` keep torch's format, keyed by the original parameters.
"""
from __future__ import annotations

import math
import threading
import time
import types
import weakref
from dataclasses import dataclass, field

import torch

from protrain_fx.machine import cpu_adam
from protrain_fx.runtime import distributed, mapped
from protrain_fx.runtime.chunk_store import ChunkStore, store_of
from protrain_fx.errors import ProtrainError
from protrain_fx.runtime.worker import WORKER
from protrain_fx.machine import pinned

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)
HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
_UNDO_PIECE = 1 << 22  # elements the float64 inverse works on at a time


def handle_of(opt: torch.optim.Optimizer) -> "HybridOptimizer | None":
    return getattr(opt, "_protrain_hybrid", None)


def attach(opt: torch.optim.Optimizer, store: ChunkStore) -> "HybridOptimizer":
    """Take over ``opt`` (once) and give it the offloaded chunks of ``store``."""
    h = handle_of(opt)
    if h is None:
        h = HybridOptimizer(opt)
        opt._protrain_hybrid = h  # the handle lives exactly as long as the optimizer
    h.add_store(store)
    return h


def set_grad_accumulation(opt: torch.optim.Optimizer, micro_steps: int) -> None:
    """Declare that every ``opt.step()`` follows exactly ``micro_steps`` backward passes, so the CPU step of
    offloaded chunks can overlap the last backward from the first step on (a wrong count costs time, never
    exactness: a provisional step is taken back)."""
    if isinstance(micro_steps, bool) or not isinstance(micro_steps, int) or micro_steps < 1:
        raise ProtrainError(f"micro_steps must be an int >= 1, got {micro_steps!r}")
    opt._protrain_micro_steps = micro_steps
    h = handle_of(opt)
    if h is not None:
        for st in h.states.values():
            st.learned = st.learned or micro_steps


@dataclass
class Provisional:
    """An in-backward step of one chunk, not yet committed by ``opt.step()``."""

    groups: dict  # param group index -> the hyperparameters it used
    steps_before: dict  # entry -> step count before it
    entries: list  # the entries it stepped
    whole: bool  # one call over the flat chunk
    param_versions: dict  # entry -> the parameter's version after it


@dataclass
class ChunkOptState:
    store: ChunkStore
    chunk: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    members: list[int]  # store entries of the chunk that are in the optimizer
    group_of: dict[int, int]  # entry -> param group index
    steps: dict[int, torch.Tensor] = field(default_factory=dict)  # entry -> step count (from its first step)
    arrivals: int = 0  # gradients handed to the chunk since the last opt.step()
    learned: int | None = None  # arrivals per cycle, as seen at the last opt.step()
    provisional: Provisional | None = None


@dataclass
class Timers:
    """Host-side seconds and counts, cumulative (reset by the benchmark)."""

    worker_step_s: float = 0.0  # CPU steps on the worker thread
    step_wait_s: float = 0.0  # opt.step() waiting for the worker
    deferred_step_s: float = 0.0  # CPU steps run inside opt.step()
    in_backward_steps: int = 0
    deferred_steps: int = 0
    undone_steps: int = 0  # provisional steps taken back
    whole_chunk_steps: int = 0  # chunk steps done as one call over the flat chunk
    one_pass_steps: int = 0  # of which with protrain_fx/machine/cpu_adam.py


class HybridOptimizer:
    def __init__(self, opt: torch.optim.Optimizer):
        if type(opt) not in SUPPORTED:
            raise ProtrainError(
                f"protrain can take over torch.optim.Adam or torch.optim.AdamW only, got {type(opt).__name__}; "
                "leave options['optimizer'] unset and your optimizer steps offloaded parameters through device "
                "views of host memory (exact, slower)"
            )
        for g in opt.param_groups:
            for flag in ("capturable", "differentiable"):
                if g.get(flag):
                    raise ProtrainError(f"protrain: {type(opt).__name__}({flag}=True) is not supported")
        self._opt = _WeakOpt(opt)
        self.decoupled = isinstance(opt, torch.optim.AdamW)
        self.stores: list[ChunkStore] = []
        self.states: dict[tuple[int, int], ChunkOptState] = {}
        self.overlap = True  # in-backward steps; off for good once clipping or a late hyperparameter is seen
        self.notes: list[str] = []
        self.cycles = 0
        self.timers = Timers()
        self._members_sig = None
        self._hidden: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._published: dict[int, dict] = {}  # id(param) -> the opt.state entry protrain made for it
        self._lock = threading.Lock()
        self._orig_zero_grad = weakref.WeakMethod(opt.zero_grad)  # nothing of protrain's may hold the optimizer
        opt.zero_grad = types.MethodType(_zero_grad, opt)  # instance attributes: the class stays untouched
        prev_step = opt.step

        def step(o, closure=None):
            return _step(o, prev_step, closure)

        if getattr(prev_step, "_wrapped_by_lr_sched", False):  # an LR scheduler's counter stays visible to it
            step._wrapped_by_lr_sched = True
        opt.step = types.MethodType(step, opt)
        opt.register_step_pre_hook(lambda o, args, kwargs: handle_of(o)._before_step())
        opt.register_step_post_hook(lambda o, args, kwargs: handle_of(o)._after_step())
        opt.register_state_dict_post_hook(lambda o, sd: handle_of(o)._state_dict_post(sd))
        opt.register_load_state_dict_pre_hook(lambda o, sd: handle_of(o)._load_state_dict_pre(sd))
        opt.register_load_state_dict_post_hook(lambda o: handle_of(o)._republish())
        mapped.HostGrad.on_write = _on_grad_write

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self._opt()

    # --------------------------------------------------------------------------- setup
    def _group_index(self) -> dict[int, int]:
        return {id(p): gi for gi, g in enumerate(self.opt.param_groups) for p in g["params"]}

    def add_store(self, store: ChunkStore) -> None:
        if store in self.stores:
            return
        dtype = store.master_dtype  # Adam's moments have the parameter's dtype, as in torch
        amsgrad = any(g.get("amsgrad") for g in self.opt.param_groups)
        pin = store.is_cuda
        for c in store.offloaded_chunks:
            n = store.host_numel(c)  # this rank's shard with several ranks

            def buf():  # pinned at its exact size (torch 2.11 would round a chunk up to a power of two)
                return pinned.host_empty(n, dtype, pin).zero_()

            st = ChunkOptState(store, c, buf(), buf(), buf() if amsgrad else None, [], {})
            micro = getattr(self.opt, "_protrain_micro_steps", None)
            st.learned = micro
            self.states[(store.id, c)] = st
        self.stores.append(store)
        store.optimizer = self
        self._members_sig = None
        self._refresh_members()
        if store.world.sharded:
            _install_clip_hook()  # sharded gradients are not in param.grad: clipping must find them

    def remove_store(self, store: ChunkStore) -> None:
        """Forget a store (a failed compile gave its parameters back)."""
        for c in store.offloaded_chunks:
            self.states.pop((store.id, c), None)
        if store in self.stores:
            self.stores.remove(store)
        store.optimizer = None
        self._members_sig = None

    def _refresh_members(self) -> None:
        """Which offloaded parameters this optimizer steps, in which param group (after add_param_group, a
        loaded state dict, or a new store); state the optimizer already has for them is taken over."""
        groups = self.opt.param_groups
        sig = tuple(id(p) for g in groups for p in g["params"])
        if sig != self._members_sig:
            self._members_sig = sig
            group_of_param = self._group_index()
            for st in self.states.values():
                st.members, st.group_of = [], {}
                for p, e in st.store.chunk_entries(st.chunk):
                    gi = group_of_param.get(id(p))
                    if gi is not None:
                        i = st.store.entry_index(p)
                        st.members.append(i)
                        st.group_of[i] = gi
        if not self.opt.state:
            return
        for st in self.states.values():
            for i in st.members:
                p = st.store.param(i)
                # state torch made for it (a checkpoint loaded before the first call; a step torch took itself
                # before protrain attached, e.g. a closure that compiled the model) moves to the host buffers
                if p is not None and p in self.opt.state and not self._ours(p):
                    self._import_state(st, i, self.opt.state.pop(p))

    def _import_state(self, st: ChunkOptState, i: int, state: dict) -> None:
        part = st.store.host_slices(i)  # this rank's share of the parameter (all of it with one rank)
        if part is not None and "exp_avg" in state:
            sl, flat = part
            with torch.no_grad():
                st.exp_avg[sl].copy_(state["exp_avg"].reshape(-1)[flat])
                st.exp_avg_sq[sl].copy_(state["exp_avg_sq"].reshape(-1)[flat])
                if st.max_exp_avg_sq is not None and "max_exp_avg_sq" in state:
                    st.max_exp_avg_sq[sl].copy_(state["max_exp_avg_sq"].reshape(-1)[flat])
        if "step" in state:
            self._set_step(st, i, float(state["step"]))

    # ------------------------------------------------------------------ steps and torch's state view
    def _set_step(self, st: ChunkOptState, i: int, value: float) -> None:
        """The parameter's step count (one tensor for its life: ``opt.state[p]["step"]`` is the same one)."""
        if i in st.steps:
            st.steps[i].fill_(value)
        else:
            st.steps[i] = torch.tensor(value, dtype=torch.float32)
        self._publish(st, i)

    def _clear_step(self, st: ChunkOptState, i: int) -> None:
        """The parameter has no optimizer state (never stepped, or a step taken back)."""
        st.steps.pop(i, None)
        p = st.store.param(i)
        if p is not None and st.store.aliased:
            self.opt.state.pop(p, None)

    def _publish(self, st: ChunkOptState, i: int) -> None:
        """``opt.state[p]`` of an offloaded parameter that has state, as eager torch would hold it: the step
        count and device views of the host moments (so a reader such as torch.distributed.checkpoint, which
        takes an empty ``opt.state`` for an optimizer that never stepped, sees the real state)."""
        store = st.store
        p = store.param(i)
        if p is None or not store.aliased:
            return
        entry = self.opt.state.get(p)
        if entry is not None and entry.get("step") is st.steps[i]:
            return
        e = store.entries[i]
        view = {name: mapped.device_view(getattr(st, name), e.offset, e.shape, store.device)
                for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if getattr(st, name) is not None}
        self.opt.state[p] = {"step": st.steps[i], **view}
        self._published[id(p)] = self.opt.state[p]

    def _republish(self) -> None:
        """After torch's loader replaced ``opt.state``: the offloaded parameters' entries again."""
        for st in self.states.values():
            for i in list(st.steps):
                self._publish(st, i)

    def _ours(self, p) -> bool:
        entry = self.opt.state.get(p)
        return entry is not None and self._published.get(id(p)) is entry

    # ----------------------------------------------------------------- gradients (graph side)
    def before_chunk_grad(self, store: ChunkStore, chunk: int) -> None:
        """A gradient is about to be added to the chunk: a provisional step of it is taken back first."""
        st = self.states.get((store.id, chunk))
        if st is not None and st.provisional is not None:
            self._undo(st)

    def before_chunk_read(self, store: ChunkStore, chunk: int) -> None:
        """A compiled graph is about to read the chunk (a forward before opt.step(): more micro-steps than
        learned, an evaluation): a provisional step of it is taken back first, as eager would not have
        stepped yet."""
        st = self.states.get((store.id, chunk))
        if st is not None and st.provisional is not None:
            self._undo(st)

    def after_chunk_grad(self, store: ChunkStore, chunk: int, members: list[int]) -> None:
        """The chunk's gradient is queued on the worker: if this completes the chunk's gradient as learned,
        queue its step behind it (provisional until opt.step())."""
        st = self.states.get((store.id, chunk))
        if st is None:
            return
        st.arrivals += 1
        if not self._may_step_in_backward(st) or st.arrivals != st.learned:
            return
        self._refresh_members()
        entries = [i for i in st.members if store.has_grad(i)]
        if not entries:
            return
        groups = self._group_snapshot(st)
        rec = Provisional(groups, {i: float(st.steps[i]) if i in st.steps else 0.0 for i in entries}, entries,
                          False, {})
        st.provisional = rec
        WORKER.submit((store.id, chunk), self._provisional_step, st, rec)

    def _may_step_in_backward(self, st: ChunkOptState) -> bool:
        return (self.overlap and st.learned is not None and st.max_exp_avg_sq is None
                and st.store.master_dtype == torch.float32
                and not any(g.get("amsgrad") for g in self.opt.param_groups))

    def _provisional_step(self, st: ChunkOptState, rec: Provisional) -> None:
        t0 = time.perf_counter()
        rec.whole = self._step_chunk(st, rec.entries, rec.groups)
        rec.param_versions = {i: st.store.param_version(i) for i in rec.entries}
        self.timers.worker_step_s += time.perf_counter() - t0
        self.timers.in_backward_steps += 1

    def _group_snapshot(self, st: ChunkOptState) -> dict[int, dict]:
        return {gi: _hyper(self.opt.param_groups[gi], self.decoupled) for gi in set(st.group_of.values())}

    # -------------------------------------------------------------------------------- step
    def _step_chunk(self, st: ChunkOptState, entries: list[int], groups: dict[int, dict]) -> bool:
        """Adam on the chunk's master copy for ``entries`` (store entries with a gradient), with the
        hyperparameters ``groups``. When every parameter of the chunk is in one param group, has a gradient
        and has taken the same number of steps (the usual case), one call runs over the whole flat chunk
        (padding included, which nothing reads), with cpu_adam's one-pass kernel where it applies. Otherwise
        one call per param group over the parameters. Returns whether it was the whole-chunk call."""
        store = st.store
        master, grad = store.master[st.chunk], store.grad[st.chunk]
        by_group: dict[int, list[int]] = {}
        for i in entries:
            by_group.setdefault(st.group_of[i], []).append(i)
        step_counts = {float(st.steps[i]) if i in st.steps else 0.0 for i in entries}
        whole = (len(by_group) == 1 and len(entries) == len(store.chunk_entry_indices(st.chunk))
                 and len(step_counts) == 1 and master.dtype == torch.float32)
        if whole:
            (gi, idxs), = by_group.items()
            step = torch.tensor(step_counts.pop(), dtype=torch.float32)
            g = groups[gi]
            if not self._one_pass_step(st, step, g):  # it writes the transfer copy itself
                vmax = [st.max_exp_avg_sq] if st.max_exp_avg_sq is not None else []
                _adam(g, [master], [grad], [st.exp_avg], [st.exp_avg_sq], vmax, [step], impl=_impl(store, g))
                store.refresh_transfer(st.chunk)
            else:
                store.invalidate(st.chunk)
            for i in idxs:  # every parameter took this step
                self._set_step(st, i, float(step))
            self.timers.whole_chunk_steps += 1
            return True
        for gi, idxs in by_group.items():
            params, grads, m, v, vmax, steps = [], [], [], [], [], []
            for i in idxs:
                if i not in st.steps:
                    self._set_step(st, i, 0.0)
                step_count = st.steps[i]
                part = store.host_slices(i)
                if part is None:  # all of it in other ranks' shards: only its step count moves here
                    step_count.add_(1)
                    continue
                sl = part[0]
                params.append(master[sl])
                grads.append(grad[sl])
                m.append(st.exp_avg[sl])
                v.append(st.exp_avg_sq[sl])
                if st.max_exp_avg_sq is not None:
                    vmax.append(st.max_exp_avg_sq[sl])
                steps.append(step_count)
            if params:
                _adam(groups[gi], params, grads, m, v, vmax, steps, impl=_impl(store, groups[gi]))
        store.refresh_transfer(st.chunk)
        return False

    def _one_pass_step(self, st: ChunkOptState, step: torch.Tensor, g: dict) -> bool:
        """The whole-chunk step with protrain_fx/machine/cpu_adam.py's kernel, which also writes the bf16 transfer
        copy (one pass over the chunk instead of two); it advances ``step``. False where it does not apply."""
        store = st.store
        master, transfer = store.master[st.chunk], store.transfer[st.chunk]
        if (st.max_exp_avg_sq is not None or g["amsgrad"] or master.dtype != torch.float32
                or master.device.type != "cpu" or transfer is not master and transfer.dtype != torch.bfloat16
                or not cpu_adam.available() or _impl(store, g) != "fused"):
            return False
        step += 1  # torch counts the step before using it
        beta1, beta2 = g["betas"]
        cpu_adam.adam_step(
            master, store.grad[st.chunk], st.exp_avg, st.exp_avg_sq, None if transfer is master else transfer,
            float(step), lr=float(g["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]), decoupled=g["decoupled_weight_decay"],
            maximize=g["maximize"])
        self.timers.one_pass_steps += 1
        return True

    def _undo(self, st: ChunkOptState) -> None:
        """Take back the chunk's provisional step: Adam inverted (see module docstring)."""
        WORKER.wait_chunk((st.store.id, st.chunk))
        rec, st.provisional = st.provisional, None
        store = st.store
        master, grad = store.master[st.chunk], store.grad[st.chunk]
        spans = ([(0, master.numel(), rec.entries)] if rec.whole else
                 [(store.host_slices(i)[0].start, store.host_slices(i)[0].stop, [i])
                  for i in rec.entries if store.host_slices(i) is not None])
        for lo, hi, idxs in spans:
            g = rec.groups[st.group_of[idxs[0]]]
            t = rec.steps_before[idxs[0]] + 1
            for a in range(lo, hi, _UNDO_PIECE):
                b = min(hi, a + _UNDO_PIECE)
                _adam_inverse(g, t, master[a:b], grad[a:b], st.exp_avg[a:b], st.exp_avg_sq[a:b])
        for i in rec.entries:
            before = rec.steps_before[i]
            if before == 0:
                self._clear_step(st, i)
            else:
                self._set_step(st, i, before)
        store.refresh_transfer(st.chunk)
        self.timers.undone_steps += 1

    def _before_step(self) -> None:
        t0 = time.perf_counter()
        WORKER.wait()
        t1 = time.perf_counter()
        self.timers.step_wait_s += t1 - t0
        self._refresh_members()
        for store in self.stores:
            for c in store.offloaded_chunks:
                store.fold_foreign_grads(c)
        for st in self.states.values():
            rec = st.provisional
            if rec is not None:
                self._check_untouched(st, rec)
                now = self._group_snapshot(st)
                if any(now[gi] != rec.groups[gi] for gi in rec.groups):
                    self._undo(st)  # a hyperparameter was set between backward and opt.step(): redo with it
                    self._disable_overlap("a param group's hyperparameters changed between backward() and "
                                          "opt.step()")
                else:
                    st.provisional = None
                    continue
            entries = [i for i in st.members if st.store.has_grad(i)]
            if entries:
                self._step_chunk(st, entries, self._group_snapshot(st))
                self.timers.deferred_steps += 1
        self.timers.deferred_step_s += time.perf_counter() - t1
        # torch's own step must not touch what protrain stepped
        self._hidden = []
        for st in self.states.values():
            for i in st.members:
                p = st.store.param(i)
                if p is not None and p.grad is not None:
                    self._hidden.append((p, p.grad))
                    p.grad = None

    def _check_untouched(self, st: ChunkOptState, rec: Provisional) -> None:
        for i in rec.entries:
            if st.store.written_since(i, rec.param_versions.get(i, -1)):
                raise ProtrainError(
                    f"protrain: parameter {st.store.entries[i].fqn!r} was written between backward() and "
                    "opt.step(), after protrain had already stepped it inside backward; write parameters "
                    "before backward() or after opt.step()")

    def _after_step(self) -> None:
        for p, g in self._hidden:
            p.grad = g
        self._hidden = []
        for st in self.states.values():
            if st.arrivals:
                st.learned = st.arrivals
            st.arrivals = 0
        self.cycles += 1

    def _disable_overlap(self, why: str) -> None:
        if self.overlap:
            self.overlap = False
            self.notes.append(f"{why}: offloaded chunks step at opt.step() from now on (not inside backward)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        WORKER.wait()
        for st in self.states.values():
            if st.provisional is not None:
                self._undo(st)  # no opt.step() came: that step was skipped
            st.arrivals = 0
            if not st.store.aliased:
                st.store.clear_grads(st.chunk)
        self._zeroing = True
        try:
            self._orig_zero_grad()(set_to_none=set_to_none)
        finally:
            self._zeroing = False

    _zeroing = False

    def on_grad_write(self, keys: set) -> None:
        """Gradients of these (store id, entry) are about to be written by eager code (clipping, unscaling):
        a provisional step of their chunk is taken back first, and chunks step at opt.step() from now on."""
        if self._zeroing:
            return
        self._disable_overlap("gradients of offloaded parameters are changed between backward() and opt.step() "
                              "(clipping, unscaling)")
        for store_id, i in keys:
            for st in self.states.values():
                if st.store.id == store_id:
                    st = self.states.get((store_id, st.store.entries[i].chunk))
                    if st is not None and st.provisional is not None:
                        self._undo(st)
                    break

    # --------------------------------------------------------------------------- clipping (sharded)
    def offloaded_grads(self, params) -> list[torch.Tensor]:
        """Host gradient views of the offloaded parameters among ``params`` that have a gradient (sharded
        stores, whose gradients are not in ``param.grad``)."""
        WORKER.wait()
        out = []
        for _, st, i, e in self._offloaded(params):
            if st.provisional is not None:
                self._undo(st)
                self._disable_overlap("gradients were clipped")
            part = st.store.host_slices(i)
            if st.store.has_grad(i) and part is not None:
                out.append(st.store.grad[st.chunk][part[0]])
        return out

    # ---------------------------------------------------------------------- state dicts
    def _offloaded(self, params):
        """(parameter, its chunk's state, store entry index, entry) for the offloaded ones among ``params``
        that this optimizer steps."""
        for p in params:
            store = store_of(p)
            if store is None or store.optimizer is not self or not store.param_is_offloaded(p):
                continue
            e = store.entry(p)
            yield p, self.states[(store.id, e.chunk)], store.entry_index(p), e

    def _indexed_params(self) -> list[torch.Tensor]:
        """Parameters in torch's state_dict index order (param groups in order)."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    def _state_dict_post(self, sd: dict) -> dict:
        WORKER.wait()
        for st in self.states.values():
            if st.provisional is not None:  # not committed: the state is as before the step
                self._undo(st)
        index = {id(p): k for k, p in enumerate(self._indexed_params())}
        whole: dict[tuple[int, str], torch.Tensor] = {}  # a chunk's moments, every rank's shard gathered

        def moment(st: ChunkOptState, name: str) -> torch.Tensor:
            key = (id(st), name)
            if key not in whole:  # the same chunks in the same order on every rank: collectives line up
                whole[key] = st.store.host_chunk(st.chunk, getattr(st, name))
            return whole[key]

        for p, st, i, e in self._offloaded(self._indexed_params()):
            idx = index[id(p)]
            if i not in st.steps:
                continue  # never stepped: torch has no state for it either
            sl = slice(e.offset, e.offset + e.numel)
            names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if st.max_exp_avg_sq is not None else ())
            entry = {"step": st.steps[i].clone()}
            entry.update({name: moment(st, name)[sl].clone().view(e.shape) for name in names})
            sd["state"][idx] = entry
        sd["state"] = dict(sorted(sd["state"].items()))
        return sd

    def _load_state_dict_pre(self, sd: dict) -> dict:
        """Offloaded parameters' state goes to the host buffers; torch's loader sees the rest."""
        WORKER.wait()
        for st in self.states.values():
            if st.provisional is not None:
                self._undo(st)
        sd = dict(sd)
        state = dict(sd["state"])
        loaded: set[tuple[int, int]] = set()
        index = {id(p): k for k, p in enumerate(self._indexed_params())}
        for p, st, i, _ in self._offloaded(self._indexed_params()):
            idx = index[id(p)]
            saved = state.pop(idx, state.pop(str(idx), None))
            if saved is not None:
                self._import_state(st, i, saved)
                loaded.add((id(st), i))
        for st in self.states.values():  # as in torch: a parameter without saved state starts fresh
            for i in st.members:
                if (id(st), i) in loaded:
                    continue
                self._clear_step(st, i)
                part = st.store.host_slices(i)
                if part is not None:
                    sl = part[0]
                    st.exp_avg[sl].zero_()
                    st.exp_avg_sq[sl].zero_()
                    if st.max_exp_avg_sq is not None:
                        st.max_exp_avg_sq[sl].zero_()
        sd["state"] = state
        return sd


class _WeakOpt:
    """A weak reference to the optimizer (its hooks hold the handle; the handle must not hold it)."""

    def __init__(self, opt):
        self._ref = weakref.ref(opt)

    def __call__(self):
        opt = self._ref()
        if opt is None:
            raise ProtrainError("protrain: the optimizer was freed")
        return opt


def _step(opt, prev_step, closure=None):
    """``opt.step`` with a closure: evaluate it first (its backward hands protrain the gradients), then
    step, as torch's Adam does."""
    if closure is None:
        return prev_step()
    with torch.enable_grad():
        loss = closure()
    prev_step()
    return loss


def _zero_grad(opt, set_to_none: bool = True):
    handle_of(opt).zero_grad(set_to_none)


def _on_grad_write(grads) -> None:
    """mapped.HostGrad's callback: route writes of offloaded gradients to their optimizers."""
    by_store: dict[int, set] = {}
    for g in grads:
        owner = getattr(g, "_protrain_owner", None)
        if owner is not None:
            by_store.setdefault(owner[0], set()).add(owner)
    from protrain_fx.runtime.chunk_store import _STORES

    for store_id, keys in by_store.items():
        store = _STORES.get(store_id)
        if store is not None and store.optimizer is not None:
            store.optimizer.on_grad_write(keys)


def _hyper(g: dict, decoupled: bool) -> dict:
    """The hyperparameters of a param group that a step uses (the step's identity)."""
    out = {k: g.get(k) for k in HYPER}
    out["lr"] = float(out["lr"]) if torch.is_tensor(out["lr"]) else out["lr"]
    out["betas"] = tuple(float(b) for b in out["betas"])
    out["decoupled_weight_decay"] = bool(g.get("decoupled_weight_decay", decoupled))
    out["amsgrad"], out["maximize"] = bool(out["amsgrad"]), bool(out["maximize"])
    out["fused"], out["foreach"] = g.get("fused"), g.get("foreach")
    return out


def _impl(store: ChunkStore, g: dict) -> str:
    """How the CPU step of an offloaded chunk runs. With a CUDA compute device: fused (protrain's one-pass
    kernel, or torch's fused CPU Adam), the fastest. With a CPU compute device, eager PyTorch steps the same
    tensors on the same device, so protrain runs the implementation the user's optimizer would (its
    ``fused`` / ``foreach`` settings; torch's default there is the for-loop), for the same rounding:
    parameters whose gradient is pure rounding noise (an attention key bias) turn one-ulp differences into
    steps of size ``lr``."""
    if store.device.type != "cpu" or store.master_dtype != torch.float32 and not g.get("fused"):
        return "fused" if store.master_dtype == torch.float32 or g.get("fused") else "single"
    return "fused" if g.get("fused") else "foreach" if g.get("foreach") else "single"


def _adam(g: dict, params, grads, m, v, vmax, steps, *, impl: str) -> None:
    """torch's CPU Adam/AdamW over lists of host tensors, with hyperparameters ``g`` (see _hyper), in the
    implementation ``impl`` ("fused", "foreach" or "single")."""
    from torch.optim.adam import adam

    beta1, beta2 = g["betas"]
    adam(params, grads, m, v, vmax, steps, foreach=impl == "foreach", fused=impl == "fused",
         decoupled_weight_decay=g["decoupled_weight_decay"], amsgrad=g["amsgrad"], beta1=beta1, beta2=beta2,
         lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=g["maximize"])


def _adam_inverse(g: dict, t: float, p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """Undo the Adam step number ``t`` with hyperparameters ``g`` on (p, m, v), in place, in float64."""
    beta1, beta2 = g["betas"]
    lr, wd, eps = float(g["lr"]), float(g["weight_decay"]), float(g["eps"])
    p1, m1, v1, gr = p.double(), m.double(), v.double(), grad.double()
    if g["maximize"]:
        gr = -gr
    bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
    update = (lr / bc1) * m1 / (v1.sqrt() / math.sqrt(bc2) + eps)
    if g["decoupled_weight_decay"]:
        p0 = (p1 + update) / (1 - lr * wd) if wd != 0 else p1 + update
    else:
        p0 = p1 + update
        if wd != 0:
            gr = gr + wd * p0
    m0 = (m1 - (1 - beta1) * gr) / beta1
    v0 = ((v1 - (1 - beta2) * gr * gr) / beta2).clamp_(min=0)
    p.copy_(p0)
    m.copy_(m0)
    v.copy_(v0)


# ------------------------------------------------------------------------- clipping (sharded stores)
_CLIP_INSTALLED = False


def _install_clip_hook() -> None:
    """Data parallel: offloaded gradients are shards on the host, not in ``param.grad``, so
    ``torch.nn.utils.clip_grad_norm_`` must be extended to them (installed when a sharded store attaches)."""
    global _CLIP_INSTALLED
    if _CLIP_INSTALLED:
        return
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_mod

    original = clip_mod.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        distributed.wait_resident_grads()  # data parallel: resident gradients averaged over the ranks first
        handles = {store_of(p).optimizer for p in params if store_of(p) is not None
                   and store_of(p).optimizer is not None and not store_of(p).aliased
                   and store_of(p).param_is_offloaded(p)}
        if not handles:
            return original(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                            foreach=foreach)
        host = [g for h in handles for g in h.offloaded_grads(params)]
        device_grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        norms = [torch.linalg.vector_norm(g, norm_type) for g in device_grads]
        host_norms = [torch.linalg.vector_norm(g, norm_type) for g in host]
        dev = device_grads[0].device if device_grads else torch.device("cpu")
        host_norms = [distributed.shard_norm(host_norms, norm_type, dev)]  # shards: the norm spans the ranks
        all_norms = torch.stack([n.to(dev) for n in norms + host_norms])
        total = torch.linalg.vector_norm(all_norms, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in device_grads:
                g.mul_(coef.to(g.device))
            for g in host:
                g.mul_(coef.to(g.device))
        return total

    clip_mod.clip_grad_norm_ = clip_grad_norm_
    nn_utils.clip_grad_norm_ = clip_grad_norm_
    _CLIP_INSTALLED = True
