"""HybridOptimizer: the user's ``torch.optim.Adam``/``AdamW``; offloaded chunks stepped on the CPU.

The user's optimizer object stays the one they step, schedule and checkpoint. Resident parameters
are stepped by it on the device, as always. For the offloaded chunks of the stores attached to it,
protrain keeps the Adam moments in host memory and runs the step on the CPU (one pass of
protrain_fx/machine/cpu_adam.py over the flat chunk where it can), with the hyperparameters of the
user's param groups; torch's own step skips those parameters (their ``.grad`` is hidden from it
during ``opt.step()``).

The step of a chunk may run *inside backward*, on the host worker right behind the chunk's last
gradient, overlapped with the rest of backward. That is the speed of offloading, and it must not
change the result. So such a step is provisional until ``opt.step()`` commits it:

* it is taken only from the second cycle on, once protrain has seen how many gradients each chunk
  gets between two ``opt.step()`` calls (accumulation), never for AMSGrad or non-fp32 masters;
* ``opt.step()`` commits it if nothing the step depended on changed since; if a hyperparameter
  changed (``lr``, ``weight_decay``, ``betas``, ... set between ``backward()`` and ``opt.step()``),
  the step is taken back and redone with the new values;
* taken back as well when anything writes the chunk's gradients before ``opt.step()`` (clipping,
  unscaling: the gradient views call back first, protrain_fx/runtime/mapped.py), when another
  backward adds to them (more micro-steps than learned), when ``opt.zero_grad()`` comes without
  ``opt.step()`` (a skipped step), another optimizer steps them (runtime/foreign_steps.py) or the
  user resets ``opt.state`` (``_take_user_state``);
* after a hyperparameter change between backward and step has been seen once, chunks step at
  ``opt.step()`` from then on (every step would otherwise be taken back); after clipping that
  changed the gradients, while it goes on: once clipping has been a multiply by one for a few steps
  (norms under ``max_norm``), chunks step inside backward again (protrain_fx/runtime/overlap.py).

Taking a step back inverts Adam exactly in real arithmetic (in float64: the restored values are
within float32 rounding of the originals), from the moments, the parameter and the gradient, which
are all still there. ``opt.step(closure)`` runs the closure first, as Adam does. Gradients stay as
eager leaves them (``param.grad`` is a view of the host accumulator; ``zero_grad()`` and
``set_to_none`` work as always). ``opt.state_dict()`` / ``opt.load_state_dict()`` keep torch's
format, keyed by the original parameters.

The chunk's CPU Adam step and its inverse are in protrain_fx/runtime/chunk_adam.py, torch's view of
the state (``opt.state``, the state dicts) in protrain_fx/runtime/optim_state.py, both inherited by
:class:`HybridOptimizer`; clipping of sharded gradients is in protrain_fx/runtime/clip.py.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from protrain_fx._weakmap import WeakBound, WeakOrRaise, weakly
from protrain_fx.errors import ProtrainError
from protrain_fx.machine import step_rates
from protrain_fx.runtime import clip, foreign_steps, overlap, step_hooks
from protrain_fx.runtime.chunk_adam import (
    ChunkAdam,
    ChunkOptState,
    Provisional,
    step_hyperparameters,
)
from protrain_fx.runtime.chunk_store import ChunkStore, store_of
from protrain_fx.runtime.optim_state import TorchStateView
from protrain_fx.runtime.optimizer_lookup import SUPPORTED, UNSUPPORTED_FLAGS
from protrain_fx.runtime.overlap import Overlap, OverlapControl
from protrain_fx.runtime.worker import WORKER


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
    """Declare that every ``opt.step()`` follows exactly ``micro_steps`` backward passes, so the CPU
    step of offloaded chunks can overlap the last backward from the first step on (a wrong count
    costs time, never exactness: a provisional step is taken back)."""
    if isinstance(micro_steps, bool) or not isinstance(micro_steps, int) or micro_steps < 1:
        raise ProtrainError(f"micro_steps must be an int >= 1, got {micro_steps!r}")
    opt._protrain_micro_steps = micro_steps
    h = handle_of(opt)
    if h is not None:
        for st in h.states.values():
            if st.learned is None and st.per_backward is not None:
                st.learned = micro_steps * st.per_backward


@dataclass
class Timers:
    """Host-side seconds and counts, cumulative (reset by the benchmark)."""

    worker_step_s: float = 0.0  # CPU steps on the worker thread
    # inside the one-pass C kernel (GIL released; any thread): its rate is kernel_params /
    # kernel_s, and worker_step_s less the in-backward part of it is Python around the kernel
    kernel_s: float = 0.0
    kernel_params: int = 0
    # of those, the steps that ran on the CPU (not queued for the device): what the CPU rate is
    cpu_in_backward_s: float = 0.0
    cpu_in_backward_params: int = 0
    span: step_rates.WorkerSpan = field(default_factory=step_rates.WorkerSpan)  # and waits between
    step_wait_s: float = 0.0  # opt.step() waiting for the worker
    deferred_step_s: float = 0.0  # CPU steps run inside opt.step()
    in_backward_steps: int = 0
    deferred_steps: int = 0
    deferred_params: int = 0  # parameters stepped on the CPU inside opt.step()
    undone_steps: int = 0  # provisional steps taken back
    whole_chunk_steps: int = 0  # chunk steps done as one call over the flat chunk
    one_pass_steps: int = 0  # of which with protrain_fx/machine/cpu_adam.py
    # of which on the compute device (protrain_fx/runtime/device_steps.py): their count, parameters
    # and the host seconds spent queueing them (waiting for a free slot included)
    device_steps: int = 0
    device_step_params: int = 0
    device_step_queue_s: float = 0.0


class HybridOptimizer(ChunkAdam, TorchStateView, OverlapControl):
    def __init__(self, opt: torch.optim.Optimizer):
        if type(opt) not in SUPPORTED:
            raise ProtrainError(
                "protrain can take over torch.optim.Adam or torch.optim.AdamW only, got "
                f"{type(opt).__name__}; leave options['optimizer'] unset and your optimizer steps "
                "offloaded parameters through device views of host memory (exact, slower)"
            )
        for g in opt.param_groups:
            for flag, why in UNSUPPORTED_FLAGS.items():
                if g.get(flag):
                    raise ProtrainError(
                        f"protrain: {type(opt).__name__}({flag}=True) is not supported: {why}; "
                        f"create it with {flag}=False"
                    )
        self._opt = WeakOrRaise(opt, "optimizer")  # its hooks hold the handle, not it
        self.decoupled = isinstance(opt, torch.optim.AdamW)
        self.stores: list[ChunkStore] = []
        self.states: dict[tuple[int, int], ChunkOptState] = {}
        self._overlap = Overlap()  # whether chunks step inside backward (runtime/overlap.py)
        self.cycles = 0
        self.timers = Timers()
        self._rate_from: tuple[float, int] | None = None
        self._at_step_from: tuple[float, int] = (0.0, 0)
        self._upload_from: tuple[float, int] = (0.0, 0)  # chunk buffers' uploads at FROM_STEP
        self._micro_steps: int | None = None  # micro_steps()
        self._members_sig = None
        self._hidden: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        # id(param) -> the opt.state entry protrain made for it
        self._published: dict[int, dict] = {}
        self._lock = threading.Lock()
        # nothing of protrain's may hold the optimizer
        self._orig_zero_grad = weakref.WeakMethod(opt.zero_grad)
        # instance attributes (the class stays untouched) bound weakly: an optimizer the user
        # drops is freed at once, as in eager, not stepping its chunks in the next backward
        opt.zero_grad = WeakBound(_zero_grad, opt)
        prev, lr_sched = weakly(opt.step, opt), getattr(opt.step, "_wrapped_by_lr_sched", False)

        def step(o, closure=None):
            return _step(o, prev(), closure)

        opt.step = WeakBound(step, opt)
        if lr_sched:  # an LR scheduler's counter stays visible to it
            opt.step._wrapped_by_lr_sched = True
        pre = opt.register_step_pre_hook(lambda o, args, kwargs: handle_of(o)._before_step())
        post = opt.register_step_post_hook(lambda o, args, kwargs: handle_of(o)._after_step())
        self.hook_ids = (pre.id, post.id)  # kept innermost (runtime/step_hooks.py)
        opt.register_state_dict_post_hook(lambda o, sd: handle_of(o)._state_dict_post(sd))
        opt.register_load_state_dict_pre_hook(lambda o, sd: handle_of(o)._load_state_dict_pre(sd))
        opt.register_load_state_dict_post_hook(lambda o: handle_of(o)._republish())
        overlap.install()
        foreign_steps.install()

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self._opt()

    # --------------------------------------------------------------------------- setup
    def _group_index(self) -> dict[int, int]:
        return {id(p): gi for gi, g in enumerate(self.opt.param_groups) for p in g["params"]}

    def add_store(self, store: ChunkStore) -> None:
        """Step ``store``'s offloaded chunks; again after more were offloaded (replacement.py)."""
        new = [c for c in store.offloaded_chunks if (store.id, c) not in self.states]
        if store in self.stores and not new:  # bound again by another compile: nothing to add
            return
        dtype = store.master_dtype  # Adam's moments have the parameter's dtype, as in torch
        amsgrad = any(g.get("amsgrad") for g in self.opt.param_groups)
        for c in new:
            # this rank's shard; pageable (only the CPU's step reads them; a chunk stepped on the
            # device pins its own: chunk_adam._pin_moments), or on the device for a chunk sharded
            # there. Arrivals per step: learned at the first opt.step(), or, with the micro-steps
            # declared, once the first backward has shown how many each backward brings
            m = [store.state_empty(c, dtype, False).zero_() for _ in range(3 if amsgrad else 2)]
            m += [None]
            st = ChunkOptState(store, c, m[0], m[1], m[2], [], {})
            self.states[(store.id, c)] = st
        self.stores += [] if store in self.stores else [store]
        store.optimizer = self
        self._members_sig = None
        self._refresh_members()
        if store.world.sharded:
            clip.install()  # sharded gradients are not in param.grad: clipping must find them

    def orphan(self, store: ChunkStore) -> None:
        """The optimizer was collected while ``store``'s model lives on (the user dropped it, maybe
        for a new one): a step of its chunks taken inside a backward that no ``opt.step()``
        committed is taken back (eager never took it), and the store forgets this handle; its
        offloaded parameters then keep plain gradients that any optimizer steps through their
        views (:meth:`ChunkStore.live_optimizer`)."""
        WORKER.wait()
        for c in store.offloaded_chunks:
            st = self.states.get((store.id, c))
            if st is not None and st.provisional is not None:
                self._undo(st, bookkeeping=False)
        self.remove_store(store)

    def remove_store(self, store: ChunkStore) -> None:
        """Forget a store (a failed compile gave its parameters back)."""
        for c in store.offloaded_chunks:
            self.states.pop((store.id, c), None)
        if store in self.stores:
            self.stores.remove(store)
        store.optimizer = None
        self._members_sig = None

    def _refresh_members(self) -> None:
        """Which offloaded parameters this optimizer steps, in which param group (after
        add_param_group, a loaded state dict, or a new store); state the optimizer already has for
        them is taken over."""
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
                # state torch made for it (a checkpoint loaded before the first call; a step torch
                # took itself before protrain attached, e.g. a closure that compiled the model)
                # moves to the host buffers
                if p is not None and p in self.opt.state and not self._ours(p):
                    self._import_state(st, i, self.opt.state.pop(p))

    # ----------------------------------------------------------------- gradients (graph side)
    def before_chunk_grad(self, store: ChunkStore, chunk: int) -> None:
        """A gradient is about to be added to the chunk: a provisional step of it is taken back
        first."""
        st = self.states.get((store.id, chunk))
        if st is not None and st.provisional is not None:
            self._undo(st)

    def before_chunk_read(self, store: ChunkStore, chunk: int) -> None:
        """A compiled graph is about to read the chunk (a forward before opt.step(): more
        micro-steps than learned, an evaluation): a provisional step of it is taken back first, as
        eager would not have stepped yet."""
        st = self.states.get((store.id, chunk))
        if st is not None and st.provisional is not None:
            self._undo(st)

    def after_chunk_grad(self, store: ChunkStore, chunk: int, members: list[int]) -> None:
        """The chunk's gradient is queued on the worker: if this completes the chunk's gradient as
        learned, queue its step behind it (provisional until opt.step())."""
        st = self.states.get((store.id, chunk))
        if st is None:
            return
        st.arrivals += 1
        st.in_backward += 1
        # (one whose opt.state the user reset steps at opt.step())
        if (
            st.arrivals != st.learned
            or not self._may_step_in_backward(st)
            or self._state_changed(st)
        ):
            return
        self._refresh_members()
        entries = [i for i in st.members if store.has_grad(i)]
        if not entries:
            return
        groups = self._group_snapshot(st)
        rec = Provisional(
            groups,
            {i: float(st.steps[i]) if i in st.steps else 0.0 for i in entries},
            entries,
            False,
            {},
            overlap.grad_versions(store, entries),
        )
        st.provisional = rec
        # a step of an optimizer dropped meanwhile (with its model) fails for no one to see
        WORKER.submit((store.id, chunk), self._provisional_step, st, rec, owner=self._opt._ref)

    def micro_steps(self) -> int | None:
        """Backward passes per ``opt.step()``, as the chunks' learned arrivals showed at the last
        step (None before the first): what the loop's plans price (plan/accumulation.py). Counted
        once a step (``_after_step``), read at every call (profiling/step_meter.py)."""
        return self._micro_steps

    def backward_ended(self) -> None:
        """A backward pass is over (chunk_grads' end-of-backward callback): the first one a chunk's
        gradients came in tells how many arrive per backward, which with declared micro-steps
        (:func:`set_grad_accumulation`) gives the arrivals per step. Nothing for a store whose
        optimizer is gone (the user dropped it, or it awaits collection with its model): every
        store's handle is told of every backward."""
        if self._opt._ref() is None:
            return
        micro = getattr(self.opt, "_protrain_micro_steps", None)
        for st in self.states.values():
            if st.in_backward and st.per_backward is None:
                st.per_backward = st.in_backward
                if micro is not None and st.learned is None:
                    st.learned = micro * st.per_backward
            st.in_backward = 0

    def _may_step_in_backward(self, st: ChunkOptState) -> bool:
        # a shard kept on the device steps at opt.step(), on the compute stream: fast there, and
        # ordered with its gradients and its next gather without the host worker
        return (
            self.overlap
            and not st.store.home_on_device(st.chunk)
            and st.learned is not None
            and st.max_exp_avg_sq is None
            and st.store.master_dtype == torch.float32
            and not any(g.get("amsgrad") for g in self.opt.param_groups)
        )

    def _provisional_step(self, st: ChunkOptState, rec: Provisional) -> None:
        t, t0 = self.timers, time.perf_counter()
        on_device = t.device_step_params
        rec.whole = self._step_chunk(st, rec.entries, rec.groups, guard=True)
        if rec.whole is None:  # a NaN gradient: steps at opt.step(), if the loop does not skip
            st.provisional = None
            return
        rec.param_versions = {i: st.store.param_version(i) for i in rec.entries}
        dt = time.perf_counter() - t0
        t.worker_step_s += dt
        t.in_backward_steps += 1
        if t.device_step_params == on_device:  # stepped on the CPU
            t.cpu_in_backward_s += dt
            t.cpu_in_backward_params += st.exp_avg.numel()
            t.span.mark(self.cycles, t0, t0 + dt)

    def _observe_cpu_rate(self) -> None:
        """The CPU steps' seconds per parameter inside backward (the waits between them included:
        step_rates.WorkerSpan), and inside ``opt.step()`` (a loop that clips), from optimizer step
        FROM_STEP to each of AT_STEPS, recorded for the next plans on this machine; not where
        chunks step on the device (waits for the link)."""
        if any(s.device_step_chunks for s in self.stores):
            return
        if self.cycles != step_rates.FROM_STEP and self.cycles not in step_rates.AT_STEPS:
            return
        t, kinds = self.timers, {s.transfer_copies for s in self.stores}
        now = (t.span.total(self.cycles), t.cpu_in_backward_params)
        at_step = (t.deferred_step_s, t.deferred_params)
        bufs = {id(s.buffers): s.buffers for s in self.stores if s.buffers and not s.world.sharded}
        up = tuple(sum(x) for x in zip((0.0, 0), *(b.uploads() for b in bufs.values())))
        if self.cycles == step_rates.FROM_STEP:
            self._rate_from, self._at_step_from, self._upload_from = now, at_step, up
        elif self.cycles in step_rates.AT_STEPS and self._rate_from and len(kinds) == 1:
            copies, device = kinds.pop(), self.stores[0].device
            step_rates.observe(device, copies, now, self._rate_from)
            step_rates.observe(device, copies, at_step, self._at_step_from, True)
            step_rates.observe_upload(device, copies, up, self._upload_from)

    def cpu_span_per_step(self) -> float | None:
        """Mean seconds a step of the worker's CPU steps inside backward (step_rates.WorkerSpan)
        since optimizer step FROM_STEP; None before the step after it (profiling/step_meter.py
        tells by it whether a step kept the device busy)."""
        steps = self.cycles - step_rates.FROM_STEP
        if self._rate_from is None or steps <= 0:
            return None
        return (self.timers.span.total(self.cycles) - self._rate_from[0]) / steps

    def _group_snapshot(self, st: ChunkOptState) -> dict[int, dict]:
        return {
            gi: step_hyperparameters(self.opt.param_groups[gi], self.decoupled)
            for gi in set(st.group_of.values())
        }

    def _before_step(self) -> None:
        t0 = time.perf_counter()
        WORKER.wait()
        t1 = time.perf_counter()
        self.timers.step_wait_s += t1 - t0
        self._refresh_members()
        self._take_user_state()  # opt.state.clear(), say
        for st in list(self.states.values()):
            if st.provisional is not None:  # p.grad = None, a write through p.grad.detach()
                self.take_back_rewritten(st)
        for store in self.stores:
            for c in store.offloaded_chunks:
                store.fold_foreign_grads(c)
        for st in self.states.values():
            rec = st.provisional
            if rec is not None:
                self._check_untouched(st, rec)
                now = self._group_snapshot(st)
                if any(now[gi] != rec.groups[gi] for gi in rec.groups):
                    # a hyperparameter was set between backward and opt.step(): redo with it
                    self._undo(st)
                    self._disable_overlap(
                        "a param group's hyperparameters changed between backward() and opt.step()"
                    )
                else:
                    st.provisional = None
                    continue
            entries = [i for i in st.members if st.store.has_grad(i)]
            if entries:
                self._step_chunk(st, entries, self._group_snapshot(st))
                self.timers.deferred_steps += 1
                self.timers.deferred_params += st.exp_avg.numel()
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
                    f"protrain: parameter {st.store.entries[i].fqn!r} was written between "
                    "backward() and opt.step(), after protrain had already stepped it inside "
                    "backward; write parameters before backward() or after opt.step()"
                )

    def _after_step(self) -> None:
        for p, g in self._hidden:
            p.grad = g
        self._hidden = []
        for st in self.states.values():  # a partial cycle's count teaches nothing (ChunkOptState)
            if st.arrivals and not st.partial:
                st.learned = st.arrivals
            st.arrivals, st.partial = 0, False
        seen = (
            st.learned // st.per_backward
            for st in self.states.values()
            if st.learned and st.per_backward
        )
        self._micro_steps = max(seen, default=0) or None
        self.cycles += 1
        self._observe_cpu_rate()
        self._overlap_cycle_ended()

    def zero_grad(self, set_to_none: bool = True) -> None:
        WORKER.wait()
        for st in self.states.values():
            if st.provisional is not None:
                self._undo(st)  # no opt.step() came: that step was skipped
            st.arrivals = 0
            # a clip's multiply still pending (runtime/grad_scale.py) goes with the gradients
            st.store.settle_grad_scale(st.store.chunk_entry_indices(st.chunk), drop=True)
            if not st.store.aliased:
                st.store.clear_grads(st.chunk)
        self._zeroing = True
        try:
            self._orig_zero_grad()(set_to_none=set_to_none)
        finally:
            self._zeroing = False

    _zeroing = False

    # --------------------------------------------------------------------------- clipping (sharded)
    def offloaded_grads(self, params) -> list[torch.Tensor]:
        """Host gradient views of the offloaded parameters among ``params`` that have a gradient
        (sharded stores, whose gradients are not in ``param.grad``)."""
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
        """(parameter, its chunk's state, store entry index, entry) for the offloaded ones among
        ``params`` that this optimizer steps."""
        for p in params:
            store = store_of(p)
            if store is None or store.optimizer is not self or not store.param_is_offloaded(p):
                continue
            e = store.entry(p)
            yield p, self.states[(store.id, e.chunk)], store.entry_index(p), e


def _step(opt, prev_step, closure=None):
    """``opt.step`` with a closure: evaluate it first (its backward hands protrain the gradients),
    then step, as torch's Adam does."""
    step_hooks.keep_innermost(opt, getattr(handle_of(opt), "hook_ids", None))
    if closure is None:
        return prev_step()
    with torch.enable_grad():
        loss = closure()
    prev_step()
    return loss


def _zero_grad(opt, set_to_none: bool = True):
    handle_of(opt).zero_grad(set_to_none)
