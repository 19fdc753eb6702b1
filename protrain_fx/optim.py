"""HybridOptimizer: the user's ``torch.optim.Adam``/``AdamW`` with the offloaded chunks' step on the CPU.

The user's optimizer object stays the one they step, schedule and checkpoint:

* resident parameters keep their ``.grad`` and their state in ``opt.state``; the optimizer's own step
  updates them on the device (offloaded parameters have ``grad=None``, which Adam skips);
* each offloaded chunk has, in pinned host memory, an fp32 gradient accumulator and the Adam moments; its
  step is a fused CPU AdamW over views of the chunk's master copy, with the hyperparameters read from the
  user's param groups at that moment (LR schedulers keep working);
* ``protrain::chunk_grad`` hands a chunk's flat gradient to a worker thread that accumulates it and, on the
  last micro-step before ``opt.step()``, steps that chunk while the GPU continues the backward pass.

When is a backward the last micro-step? The first ``opt.step()`` runs every CPU step at the step call and
records how many backward passes fed it (the gradient-accumulation count k). From then on each chunk steps
inside its k-th backward. Gradient clipping needs every gradient before any update, so a call to
``torch.nn.utils.clip_grad_norm_`` (which protrain extends to the host gradients) turns in-backward
stepping off for good. ``protrain_fx.set_grad_accumulation(opt, k)`` declares k up front (then even the
first step overlaps). A backward beyond the k-th before ``opt.step()`` raises instead of mixing steps.

Offloaded gradients are consumed by the step that uses them (``opt.zero_grad()`` also clears them).
``opt.state_dict()`` / ``opt.load_state_dict()`` keep torch's format, keyed by the original parameters.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import cpu_adam, distributed, hardware
from .chunks import ChunkStore, store_of
from .options import ProtrainError

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)
_HANDLES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, HybridOptimizer]" = weakref.WeakKeyDictionary()
N_STAGING = 4


def handle_of(opt: torch.optim.Optimizer) -> "HybridOptimizer | None":
    return _HANDLES.get(opt)


def attach(opt: torch.optim.Optimizer, store: ChunkStore) -> "HybridOptimizer":
    """Take over ``opt`` (once) and give it the offloaded chunks of ``store``."""
    h = _HANDLES.get(opt)
    if h is None:
        h = HybridOptimizer(opt)
        _HANDLES[opt] = h
    h.add_store(store)
    return h


def set_grad_accumulation(opt: torch.optim.Optimizer, micro_steps: int) -> None:
    """Declare that every ``opt.step()`` follows exactly ``micro_steps`` backward passes, so the CPU step of
    offloaded chunks can overlap the last backward from the first step on."""
    if isinstance(micro_steps, bool) or not isinstance(micro_steps, int) or micro_steps < 1:
        raise ProtrainError(f"micro_steps must be an int >= 1, got {micro_steps!r}")
    _PENDING_ACCUMULATION[opt] = micro_steps
    h = _HANDLES.get(opt)
    if h is not None:
        h.micro_steps = micro_steps


_PENDING_ACCUMULATION: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


@dataclass
class ChunkOptState:
    store: ChunkStore
    chunk: int
    grad_acc: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    members: list[int]  # store entry indices of the chunk's parameters that are in the optimizer
    group_of: dict[int, int]  # entry index -> param group index
    steps: dict[int, torch.Tensor]  # entry index -> step count (created at the parameter's first step)
    grads_this_cycle: int = 0
    learned_k: int | None = None
    acc_fresh: bool = True
    stepped_this_cycle: bool = False
    has_grad: set = field(default_factory=set)


@dataclass
class Timers:
    """Host-side seconds, cumulative (reset by the benchmark)."""

    worker_busy_s: float = 0.0  # accumulate + step on the worker thread
    worker_step_s: float = 0.0  # of which the AdamW steps
    step_wait_s: float = 0.0  # opt.step() waiting for the worker (the part not hidden behind backward)
    deferred_step_s: float = 0.0  # CPU steps run inside opt.step()
    in_backward_steps: int = 0
    deferred_steps: int = 0
    whole_chunk_steps: int = 0  # chunk steps done as one fused call over the flat chunk
    one_pass_steps: int = 0  # of which with protrain_fx.cpu_adam (Adam and the bf16 transfer copy in one pass)
    async_steps: int = 0  # opt.step() calls that left in-backward CPU steps running behind the next forward
    forward_wait_s: float = 0.0  # gathers (or gradients) waiting for such a step


class HybridOptimizer:
    def __init__(self, opt: torch.optim.Optimizer):
        if type(opt) not in SUPPORTED:
            raise ProtrainError(
                f"protrain can take over torch.optim.Adam or torch.optim.AdamW only, got {type(opt).__name__}"
            )
        for g in opt.param_groups:
            for flag in ("capturable", "differentiable"):
                if g.get(flag):
                    raise ProtrainError(f"protrain: {type(opt).__name__}({flag}=True) is not supported")
        self.opt = opt
        self.decoupled = isinstance(opt, torch.optim.AdamW)
        self.stores: list[ChunkStore] = []
        self.states: dict[tuple[int, int], ChunkOptState] = {}
        self.micro_steps: int | None = _PENDING_ACCUMULATION.get(opt)
        self.overlap = True  # off for good once clipping is seen
        self.cycles = 0
        self.timers = Timers()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-cpu-adam")
        self._futures: deque[Future] = deque()
        # (store id, chunk) -> the in-backward step still running after opt.step() returned; the next read of
        # the chunk's host values (its gather in the next forward, its next gradient) waits for it
        self._pending: dict[tuple[int, int], Future] = {}
        self.async_step = os.environ.get("PROTRAIN_ASYNC_STEP", "1") != "0"
        self._staging: list[torch.Tensor] = []
        self._staging_free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._orig_zero_grad = opt.zero_grad
        opt.zero_grad = self.zero_grad  # instance attribute: the class's method stays untouched
        opt.register_step_pre_hook(lambda o, args, kwargs: self._before_step())
        opt.register_step_post_hook(lambda o, args, kwargs: self._after_step())
        opt.register_state_dict_post_hook(lambda o, sd: self._state_dict_post(sd))
        opt.register_load_state_dict_pre_hook(lambda o, sd: self._load_state_dict_pre(sd))

    # --------------------------------------------------------------------------- setup
    def _group_index(self) -> dict[int, int]:
        return {id(p): gi for gi, g in enumerate(self.opt.param_groups) for p in g["params"]}

    def add_store(self, store: ChunkStore) -> None:
        if store in self.stores:
            return
        group_of_param = self._group_index()
        amsgrad = any(g.get("amsgrad") for g in self.opt.param_groups)
        pin = store.is_cuda
        for c in store.offloaded_chunks:
            n = store.host_numel(c)  # this rank's shard with several ranks
            members, group_of = [], {}
            for p, e in store.chunk_entries(c):
                gi = group_of_param.get(id(p))
                if gi is not None:
                    i = store.entry_index(p)
                    members.append(i)
                    group_of[i] = gi

            def buf():  # pinned at its exact size (torch 2.11 would round a chunk up to a power of two)
                return hardware.host_empty(n, torch.float32, pin).zero_()

            st = ChunkOptState(store, c, buf(), buf(), buf(), buf() if amsgrad else None, members, group_of, {})
            # state the user's optimizer already had (a checkpoint loaded before the first call)
            for i in members:
                p = store.params[i]
                if p in self.opt.state:
                    self._import_state(st, i, self.opt.state.pop(p))
            self.states[(store.id, c)] = st
        if store.offloaded_chunks and not self._staging:
            size = max(store.host_numel(c) for c in store.offloaded_chunks)
            self._staging = [hardware.host_empty(size, store.param_dtype, pin) for _ in range(N_STAGING)]
            self._staging_free = list(self._staging)
        self.stores.append(store)
        store.optimizer = self

    def _import_state(self, st: ChunkOptState, i: int, state: dict) -> None:
        part = st.store.host_slices(i)  # this rank's share of the parameter (all of it with one rank)
        if part is not None:
            sl, flat = part
            with torch.no_grad():
                st.exp_avg[sl].copy_(state["exp_avg"].reshape(-1)[flat])
                st.exp_avg_sq[sl].copy_(state["exp_avg_sq"].reshape(-1)[flat])
                if st.max_exp_avg_sq is not None and "max_exp_avg_sq" in state:
                    st.max_exp_avg_sq[sl].copy_(state["max_exp_avg_sq"].reshape(-1)[flat])
        step = state["step"]
        st.steps[i] = torch.tensor(float(step), dtype=torch.float32)

    # ----------------------------------------------------------------- gradients (graph side)
    def chunk_grad(self, store: ChunkStore, chunk: int, flat_grad: torch.Tensor, members_with_grad: list[int]):
        """Copy a chunk's flat device gradient to the host and queue its accumulation (and step); returns
        the event that marks the device buffer free again (None on CPU)."""
        st = self.states[(store.id, chunk)]
        self.wait_chunk(store.id, chunk)  # last cycle's step reads the accumulator this copy overwrites
        if st.stepped_this_cycle:
            raise ProtrainError(
                f"protrain: another backward pass before opt.step(), but chunk {chunk} was already stepped "
                f"inside backward pass {st.grads_this_cycle} of this cycle (protrain learned that "
                f"{st.learned_k or self.micro_steps} backward pass(es) precede each opt.step()). Keep the number "
                "of micro-steps per step constant, or declare it with protrain_fx.set_grad_accumulation(opt, n)."
            )
        st.grads_this_cycle += 1
        st.has_grad.update(members_with_grad)
        k = self.micro_steps if self.micro_steps is not None else st.learned_k
        step_now = self.overlap and k is not None and st.grads_this_cycle >= k
        if flat_grad.dtype == torch.float32 and st.acc_fresh:
            dst, mode = st.grad_acc, "direct"
        else:
            dst, mode = self._take_staging(), ("copy" if st.acc_fresh else "add")
        event = store.copy_to_host(flat_grad, dst)
        st.acc_fresh = False
        if step_now:
            st.stepped_this_cycle = True
            st.acc_fresh = True  # the step consumes the accumulated gradient
        # the step's hyperparameters are taken now, during this backward (the step may run after opt.step()
        # has returned and a scheduler has moved on)
        groups = self._group_snapshot(st) if step_now else None
        fut = self._executor.submit(self._work, st, dst, mode, event, flat_grad.numel(), groups)
        self._futures.append(fut)
        if step_now:
            self._pending[(store.id, chunk)] = fut
        return event

    def _take_staging(self) -> torch.Tensor:
        while not self._staging_free:
            self._futures.popleft().result()  # backpressure: wait for the oldest task
        with self._lock:
            return self._staging_free.pop()

    def _group_snapshot(self, st: ChunkOptState) -> dict[int, dict]:
        return {gi: {k: v for k, v in self.opt.param_groups[gi].items() if k != "params"}
                for gi in set(st.group_of.values())}

    def _work(self, st: ChunkOptState, src: torch.Tensor, mode: str, event, n: int, groups: dict | None) -> None:
        step_now = groups is not None
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            if mode == "copy":
                st.grad_acc[:n].copy_(src[:n])
            elif mode == "add":
                st.grad_acc[:n].add_(src[:n])
        if mode != "direct":
            with self._lock:
                self._staging_free.append(src)
        if step_now:
            t1 = time.perf_counter()
            self._step_chunk(st, groups)
            self.timers.worker_step_s += time.perf_counter() - t1
            self.timers.in_backward_steps += 1
        self.timers.worker_busy_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the worker has finished everything handed to it."""
        while self._futures:
            self._futures.popleft().result()
        self._pending.clear()

    def wait_chunk(self, store_id: int, chunk: int) -> None:
        """Block until the chunk's pending step (if any) is done: before its host values are read."""
        fut = self._pending.pop((store_id, chunk), None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.timers.forward_wait_s += time.perf_counter() - t0

    def _wait_unless_pending_step(self) -> None:
        """Wait for the worker's gradient accumulations, not for steps left running by opt.step()."""
        pending = set(map(id, self._pending.values()))
        for fut in list(self._futures):
            if id(fut) not in pending:
                fut.result()
        while self._futures and self._futures[0].done():
            self._futures.popleft().result()

    # -------------------------------------------------------------------------------- step
    def _step_chunk(self, st: ChunkOptState, groups: dict | None = None) -> None:
        """AdamW on the chunk's master copy, with the hyperparameters of ``groups`` (a snapshot) or, without,
        of the user's param groups now. When every parameter of the chunk is in one param group, has a
        gradient and has taken the same number of steps (the usual case), one call runs over the whole flat
        chunk (padding included, which nothing reads), with cpu_adam's one-pass kernel where it applies:
        much faster on the CPU than a list of small tensors. Otherwise one call per param group over the
        parameters that have a gradient."""
        store = st.store
        master = store.master[st.chunk]
        by_group: dict[int, list[int]] = {}
        for i in st.members:
            if i in st.has_grad:
                by_group.setdefault(st.group_of[i], []).append(i)
        group = (lambda gi: groups[gi]) if groups is not None else (lambda gi: self.opt.param_groups[gi])
        step_counts = {float(st.steps[i]) if i in st.steps else 0.0 for i in st.members}
        whole = (len(by_group) == 1 and len(st.members) == len(store.chunk_entries(st.chunk))
                 and len(next(iter(by_group.values()), [])) == len(st.members) and len(step_counts) == 1)
        if whole:
            (gi, idxs), = by_group.items()
            step = torch.tensor(step_counts.pop(), dtype=torch.float32)
            if not self._one_pass_step(st, step, group(gi)):  # it writes the transfer copy itself
                vmax = [st.max_exp_avg_sq] if st.max_exp_avg_sq is not None else []
                self._adam(group(gi), [master], [st.grad_acc], [st.exp_avg], [st.exp_avg_sq], vmax, [step])
                store.refresh_transfer(st.chunk)
            for i in idxs:  # every parameter took this step
                st.steps[i] = step.clone()
            self.timers.whole_chunk_steps += 1
        else:
            for gi, idxs in by_group.items():
                params, grads, m, v, vmax, steps = [], [], [], [], [], []
                for i in idxs:
                    step_count = st.steps.setdefault(i, torch.tensor(0.0, dtype=torch.float32))
                    part = store.host_slices(i)
                    if part is None:  # all of it in other ranks' shards: only its step count moves here
                        step_count.add_(1)
                        continue
                    sl = part[0]
                    params.append(master[sl])
                    grads.append(st.grad_acc[sl])
                    m.append(st.exp_avg[sl])
                    v.append(st.exp_avg_sq[sl])
                    if st.max_exp_avg_sq is not None:
                        vmax.append(st.max_exp_avg_sq[sl])
                    steps.append(step_count)
                if params:
                    self._adam(group(gi), params, grads, m, v, vmax, steps)
            store.refresh_transfer(st.chunk)
        st.has_grad.clear()

    def _adam(self, g: dict, params, grads, m, v, vmax, steps) -> None:
        """torch's fused CPU Adam/AdamW over lists of host tensors, with param group ``g``'s settings."""
        from torch.optim.adam import adam

        beta1, beta2 = g["betas"]
        lr = g["lr"]
        adam(params, grads, m, v, vmax, steps, foreach=False, fused=True,
             decoupled_weight_decay=g.get("decoupled_weight_decay", self.decoupled),
             amsgrad=bool(g.get("amsgrad", False)), beta1=beta1, beta2=beta2,
             lr=float(lr) if torch.is_tensor(lr) else lr, weight_decay=g["weight_decay"], eps=g["eps"],
             maximize=bool(g.get("maximize", False)))

    def _one_pass_step(self, st: ChunkOptState, step: torch.Tensor, g: dict) -> bool:
        """The whole-chunk step with protrain_fx.cpu_adam's kernel, which also writes the bf16 transfer copy
        (one pass over the chunk instead of two); it advances ``step``. False where it does not apply."""
        store = st.store
        master, transfer = store.master[st.chunk], store.transfer[st.chunk]
        if (st.max_exp_avg_sq is not None or g.get("amsgrad") or master.dtype != torch.float32
                or master.device.type != "cpu" or transfer is not master and transfer.dtype != torch.bfloat16
                or not cpu_adam.available()):
            return False
        step += 1  # torch counts the step before using it
        beta1, beta2 = g["betas"]
        cpu_adam.adam_step(
            master, st.grad_acc, st.exp_avg, st.exp_avg_sq, None if transfer is master else transfer, float(step),
            lr=float(g["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]), decoupled=bool(g.get("decoupled_weight_decay", self.decoupled)),
            maximize=bool(g.get("maximize", False)))
        self.timers.one_pass_steps += 1
        return True

    def _before_step(self) -> None:
        t0 = time.perf_counter()
        deferred = any(st.grads_this_cycle and not st.stepped_this_cycle for st in self.states.values())
        if deferred or not self.async_step:
            self.wait()
        else:
            # every chunk with gradients was stepped inside backward: let those steps finish behind the next
            # forward (each gather waits for its own chunk) instead of here
            self._wait_unless_pending_step()
            self.timers.async_steps += 1
        t1 = time.perf_counter()
        self.timers.step_wait_s += t1 - t0
        for st in self.states.values():
            if st.grads_this_cycle and not st.stepped_this_cycle:
                self._step_chunk(st)
                st.acc_fresh = True
                self.timers.deferred_steps += 1
        self.timers.deferred_step_s += time.perf_counter() - t1

    def _after_step(self) -> None:
        for st in self.states.values():
            if st.grads_this_cycle:
                st.learned_k = st.grads_this_cycle
            st.grads_this_cycle = 0
            st.stepped_this_cycle = False
            if (st.store.id, st.chunk) not in self._pending:  # a running step clears it itself
                st.has_grad.clear()
        for store in self.stores:
            store.invalidate()
        self.cycles += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_unless_pending_step()
        self._orig_zero_grad(set_to_none=set_to_none)
        for st in self.states.values():
            if not st.stepped_this_cycle and (st.store.id, st.chunk) not in self._pending:
                st.acc_fresh = True
                st.grads_this_cycle = 0
                st.has_grad.clear()

    # --------------------------------------------------------------------------- clipping
    def offloaded_grads(self, params) -> list[torch.Tensor]:
        """Host gradient views (fp32) of the offloaded parameters among ``params`` that have a gradient."""
        self.wait()
        out = []
        for _, st, i, e in self._offloaded(params):
            if st.stepped_this_cycle:
                raise ProtrainError(
                    "protrain: gradient clipping was called after the optimizer already stepped offloaded chunks "
                    "inside backward. Clip from the first step on (protrain then keeps the CPU step until "
                    "opt.step()), or call protrain_fx.set_grad_accumulation only without clipping."
                )
            part = st.store.host_slices(i)
            if i in st.has_grad and part is not None:
                out.append(st.grad_acc[part[0]])
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
        self.wait()
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
        self.wait()
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
                st.steps.pop(i, None)
                part = st.store.host_slices(i)
                if part is not None:
                    sl = part[0]
                    st.exp_avg[sl].zero_()
                    st.exp_avg_sq[sl].zero_()
                    if st.max_exp_avg_sq is not None:
                        st.max_exp_avg_sq[sl].zero_()
        sd["state"] = state
        return sd


# ------------------------------------------------------------------------------- clipping hook
_CLIP_INSTALLED = False


def _install_clip_hook() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` include the host gradients of offloaded parameters."""
    global _CLIP_INSTALLED
    if _CLIP_INSTALLED:
        return
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_mod

    original = clip_mod.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        distributed.wait_resident_grads()  # data parallel: resident gradients averaged over the ranks first
        handles = {store_of(p).optimizer for p in params if store_of(p) is not None and store_of(p).optimizer is not None
                   and store_of(p).param_is_offloaded(p)}
        if not handles:
            return original(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        host = [g for h in handles for g in h.offloaded_grads(params)]
        for h in handles:
            h.overlap = False  # clipping needs every gradient before any step
        device_grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        norms = [torch.linalg.vector_norm(g, norm_type) for g in device_grads]
        host_norms = [torch.linalg.vector_norm(g, norm_type) for g in host]
        dev = device_grads[0].device if device_grads else torch.device("cpu")
        if distributed.world().sharded:  # host gradients are this rank's shards: their norm spans the ranks
            host_norms = [distributed.shard_norm(host_norms, norm_type, dev)]
        all_norms = torch.stack([n.to(dev) for n in norms + host_norms]) if norms or host_norms else torch.zeros(1, device=dev)
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


_install_clip_hook()  # as early as protrain_fx is imported (the entry point imports it at torch.compile())
