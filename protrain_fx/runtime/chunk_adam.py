"""The CPU Adam step of one offloaded chunk, and its inverse.

An offloaded chunk's Adam state (:class:`ChunkOptState`: moments in host memory, a step count per
parameter) sits beside the chunk's host master copy and gradient accumulator. Stepping the chunk
runs torch's CPU Adam/AdamW over those host tensors with a param group's hyperparameters: as one
call over the whole flat chunk when every parameter is in one group, has a gradient and has taken as
many steps (with protrain_fx/machine/cpu_adam.py's one-pass kernel where it applies, which also
writes the bf16 transfer copy), else one call per param group. A step taken inside backward is
provisional (:class:`Provisional`, protrain_fx/runtime/hybrid_optim.py) and may have to be taken
back: Adam is then inverted exactly in real arithmetic, in float64, from the moments, the parameter
and the gradient, which are all still there (the restored values are within float32 rounding of the
originals; one pass of cpu_adam's kernel where it applies, the same values as the float64
tensors). :class:`ChunkAdam` holds these steps as methods of the hybrid optimizer (which inherits
them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from protrain_fx.machine import cpu_adam, pinned
from protrain_fx.runtime import device_steps
from protrain_fx.runtime.chunk_store import ChunkStore
from protrain_fx.runtime.worker import WORKER

HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
SNAP = 2.0**-21  # four float32 units in the last place (_adam_inverse)
_UNDO_PIECE = 1 << 22  # elements the float64 inverse works on at a time


@dataclass
class Provisional:
    """An in-backward step of one chunk, not yet committed by ``opt.step()``."""

    groups: dict  # param group index -> the hyperparameters it used
    steps_before: dict  # entry -> step count before it
    entries: list  # the entries it stepped
    whole: bool  # one call over the flat chunk
    param_versions: dict  # entry -> the parameter's version after it
    # entry -> its gradient view's version when it read it (runtime/overlap.py)
    grad_versions: dict = field(default_factory=dict)


def _pin_moments(st) -> None:
    """A chunk stepped on the compute device streams its moments up and back with asynchronous
    copies, which need pinned host memory: moments are made pageable (only the CPU's step reads
    them otherwise, and pinning 8 bytes a parameter took seconds of the first step), so a chunk's
    are pinned at its first step there (once: asking CUDA whether memory is pinned is a driver
    call)."""
    if st.moments_pinned:
        return
    for name in ("exp_avg", "exp_avg_sq"):
        t = getattr(st, name)
        if not t.is_pinned():
            held = pinned.host_empty(t.numel(), t.dtype, True)
            held.copy_(t)
            setattr(st, name, held)
    st.moments_pinned = True


@dataclass
class ChunkOptState:
    store: ChunkStore
    chunk: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    members: list[int]  # store entries of the chunk that are in the optimizer
    group_of: dict[int, int]  # entry -> param group index
    # entry -> step count (from its first step)
    steps: dict[int, torch.Tensor] = field(default_factory=dict)
    arrivals: int = 0  # gradients handed to the chunk since the last opt.step()
    learned: int | None = None  # arrivals per cycle, as seen at the last opt.step()
    # arrivals in one backward (a tied weight's chunk gets two in a model compiled in regions), as
    # seen in the first backward that reached it, and in the backward running now
    per_backward: int | None = None
    in_backward: int = 0
    moments_pinned: bool = False  # by _pin_moments (pageable until a device step needs them)
    skipped: bool = False  # the guarded kernel left elements of a non-finite gradient (_step_chunk)
    provisional: Provisional | None = None
    # offloaded in the middle of a cycle, its gradient so far folded in (runtime/replacement.py):
    # the arrivals of this cycle are not a cycle's, so opt.step() learns nothing from them
    partial: bool = False

    def with_max_exp_avg_sq(self) -> torch.Tensor:
        """AMSGrad's running maximum, made (zeros, as torch makes it for a parameter's first step)
        where a param group turned amsgrad on after the chunk's state was made (a group added
        with it, a loaded optimizer state that has it)."""
        if self.max_exp_avg_sq is None:
            self.max_exp_avg_sq = torch.zeros_like(self.exp_avg_sq)
        return self.max_exp_avg_sq


class ChunkAdam:
    """The chunk steps of :class:`protrain_fx.runtime.hybrid_optim.HybridOptimizer` (which inherits
    them): it provides ``timers`` and the step-count bookkeeping ``_set_step`` / ``_clear_step``
    (protrain_fx/runtime/optim_state.py)."""

    def _step_chunk(
        self, st: ChunkOptState, entries: list[int], groups: dict[int, dict], guard: bool = False
    ) -> bool | None:
        """Adam on the chunk's master copy for ``entries`` (store entries with a gradient), with the
        hyperparameters ``groups``. When every parameter of the chunk is in one param group, has a
        gradient and has taken the same number of steps (the usual case), one call runs over the
        whole flat chunk (padding included, which nothing reads), with cpu_adam's one-pass kernel
        where it applies. Otherwise one call per param group over the parameters. Returns whether it
        was the whole-chunk call. ``guard`` (a provisional step): a gradient that is not finite
        (a NaN loss's) leaves the chunk as it was and returns None; Adam's NaN state could not be
        taken back if the loop then skips the step, as eager loops do (:func:`_nonfinite`)."""
        store = st.store
        store.wait_copies(st.chunk)  # a prefetch may still be reading the values stepped here
        master, grad = store.master[st.chunk], store.grad[st.chunk]
        by_group: dict[int, list[int]] = {}
        for i in entries:
            by_group.setdefault(st.group_of[i], []).append(i)
        if any(groups[gi]["amsgrad"] for gi in by_group):
            st.with_max_exp_avg_sq()
        step_counts = {float(st.steps[i]) if i in st.steps else 0.0 for i in entries}
        whole = (
            len(by_group) == 1
            and len(entries) == len(store.chunk_entry_indices(st.chunk))
            and len(step_counts) == 1
            and master.dtype == torch.float32
        )
        if guard and _nonfinite(self, st, whole, groups):
            return None
        if whole:
            ((gi, idxs),) = by_group.items()
            step = torch.tensor(step_counts.pop(), dtype=torch.float32)
            g = groups[gi]
            # clipping's multiply, pending (runtime/grad_scale.py): the kernel applies it as it
            # reads the gradients; the other steps need it applied first
            scale = store.chunk_grad_scale(st.chunk)
            if scale != 1.0 and (
                st.chunk in store.device_step_chunks or not self._one_pass_applies(st, g)
            ):
                store.settle_grad_scale(store.chunk_entry_indices(st.chunk))
                scale = 1.0
            # both write the transfer copy themselves
            if not (
                self._device_step(st, step, g) or self._one_pass_step(st, step, g, scale, guard)
            ):
                vmax = [st.max_exp_avg_sq] if st.max_exp_avg_sq is not None else []
                _adam(
                    g,
                    [master],
                    [grad],
                    [st.exp_avg],
                    [st.exp_avg_sq],
                    vmax,
                    [step],
                    impl=_impl(store, g, store.home_on_device(st.chunk)),
                )
                store.refresh_transfer(st.chunk)
            else:
                store.invalidate(st.chunk)
            if st.skipped:  # the kernel left elements of a NaN gradient as they were: back, all
                st.skipped = False
                _adam_inverse(g, float(step), master, grad, st.exp_avg, st.exp_avg_sq)
                store.refresh_transfer(st.chunk)
                return None
            for i in idxs:  # every parameter took this step
                self._set_step(st, i, float(step))
            self.timers.whole_chunk_steps += 1
            return True
        store.settle_grad_scale(store.chunk_entry_indices(st.chunk))
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
                home = store.home_on_device(st.chunk)
                _adam(
                    groups[gi],
                    params,
                    grads,
                    m,
                    v,
                    vmax,
                    steps,
                    impl=_impl(store, groups[gi], home),
                )
        store.refresh_transfer(st.chunk)
        return False

    def _device_step(self, st: ChunkOptState, step: torch.Tensor, g: dict) -> bool:
        """The whole-chunk step on the compute device (protrain_fx/runtime/device_steps.py) for a
        chunk the plan chose: queued, not waited for (the worker's waits cover it); it advances
        ``step``. False where it does not apply."""
        store = st.store
        master, transfer = store.master[st.chunk], store.transfer[st.chunk]
        if (
            st.chunk not in store.device_step_chunks
            or st.max_exp_avg_sq is not None
            or g["amsgrad"]
            or master.dtype != torch.float32
            or store.world.sharded
        ):
            return False
        impl = "fused" if store.is_cuda else _impl(store, g)
        before = float(step)
        step += 1

        def adam(p, gr, m, v):
            steps = [torch.full((), before, dtype=torch.float32, device=p.device)]
            _adam(g, [p], [gr], [m], [v], [], steps, impl=impl)

        if store.is_cuda:
            _pin_moments(st)
        scratch = device_steps.scratch(
            store.device, store.chunk_capacity, None if transfer is master else transfer.dtype
        )
        t0 = time.perf_counter()
        k = scratch.take()
        event = scratch.step(
            k,
            master,
            store.grad[st.chunk],
            st.exp_avg,
            st.exp_avg_sq,
            None if transfer is master else transfer,
            adam,
        )
        if event is not None:
            WORKER.pending((store.id, st.chunk), event)
        self.timers.device_step_queue_s += time.perf_counter() - t0
        self.timers.device_steps += 1
        self.timers.device_step_params += master.numel()
        return True

    def _one_pass_applies(self, st: ChunkOptState, g: dict) -> bool:
        store = st.store
        master, transfer = store.master[st.chunk], store.transfer[st.chunk]
        return not (
            st.max_exp_avg_sq is not None
            or g["amsgrad"]
            or master.dtype != torch.float32
            or master.device.type != "cpu"
            or transfer is not master
            and transfer.dtype != torch.bfloat16
            or not cpu_adam.available()
            or _impl(store, g) != "fused"
        )

    def _one_pass_step(
        self, st: ChunkOptState, step: torch.Tensor, g: dict, scale: float, guard: bool = False
    ) -> bool:
        """The whole-chunk step with protrain_fx/machine/cpu_adam.py's kernel, which also writes the
        bf16 transfer copy (one pass over the chunk instead of two) and multiplies the gradients by
        ``scale`` as it reads them (a pending clip, runtime/grad_scale.py); it advances ``step``.
        False where it does not apply."""
        if not self._one_pass_applies(st, g):
            return False
        store = st.store
        master, transfer = store.master[st.chunk], store.transfer[st.chunk]
        step += 1  # torch counts the step before using it
        beta1, beta2 = g["betas"]
        t0 = time.perf_counter()
        st.skipped = 0 < cpu_adam.adam_step(
            master,
            store.grad[st.chunk],
            st.exp_avg,
            st.exp_avg_sq,
            None if transfer is master else transfer,
            float(step),
            lr=float(g["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            decoupled=g["decoupled_weight_decay"],
            maximize=g["maximize"],
            grad_scale=scale,
            guard=guard,
        )
        self.timers.kernel_s += time.perf_counter() - t0
        self.timers.kernel_params += master.numel()
        self.timers.one_pass_steps += 1
        return True

    def _undo(self, st: ChunkOptState, bookkeeping: bool = True) -> None:
        """Take back the chunk's provisional step: Adam inverted (see the module docstring).
        ``bookkeeping``: also put the step counts back (not once the optimizer is gone)."""
        WORKER.wait_chunk((st.store.id, st.chunk))
        rec, st.provisional = st.provisional, None
        if rec is None:  # the step met a NaN gradient and was never taken
            return
        store = st.store
        store.wait_copies(st.chunk)
        master, grad = store.master[st.chunk], store.grad[st.chunk]
        spans = (
            [(0, master.numel(), rec.entries)]
            if rec.whole
            else [
                (store.host_slices(i)[0].start, store.host_slices(i)[0].stop, [i])
                for i in rec.entries
                if store.host_slices(i) is not None
            ]
        )
        # parameters the loop wrote since (a checkpoint loaded to roll back, a re-initialization)
        # keep what it wrote: only their moments are taken back
        written = [
            (sl, master[sl].clone())
            for i in rec.entries
            if store.written_since(i, rec.param_versions.get(i, -1))
            and (sl := (store.host_slices(i) or (None,))[0]) is not None
        ]
        for lo, hi, idxs in spans:
            g = rec.groups[st.group_of[idxs[0]]]
            t = rec.steps_before[idxs[0]] + 1
            for a in range(lo, hi, _UNDO_PIECE):
                b = min(hi, a + _UNDO_PIECE)
                _adam_inverse(g, t, master[a:b], grad[a:b], st.exp_avg[a:b], st.exp_avg_sq[a:b])
        for sl, values in written:
            master[sl].copy_(values)
        for i in rec.entries if bookkeeping else ():
            before = rec.steps_before[i]
            if before == 0:
                self._clear_step(st, i)
            else:
                self._set_step(st, i, before)
        store.refresh_transfer(st.chunk)
        self.timers.undone_steps += 1


def step_hyperparameters(g: dict, decoupled: bool) -> dict:
    """The hyperparameters of a param group that a step uses (the step's identity)."""
    out = {k: g.get(k) for k in HYPER}
    out["lr"] = float(out["lr"]) if torch.is_tensor(out["lr"]) else out["lr"]
    out["betas"] = tuple(float(b) for b in out["betas"])
    out["decoupled_weight_decay"] = bool(g.get("decoupled_weight_decay", decoupled))
    out["amsgrad"], out["maximize"] = bool(out["amsgrad"]), bool(out["maximize"])
    out["fused"], out["foreach"] = g.get("fused"), g.get("foreach")
    return out


def _impl(store: ChunkStore, g: dict, home_on_device: bool = False) -> str:
    """How the CPU step of an offloaded chunk runs. With a CUDA compute device: fused (protrain's
    one-pass kernel, or torch's fused CPU Adam), the fastest. With a CPU compute device, eager
    PyTorch steps the same tensors on the same device, so protrain runs the implementation the
    user's optimizer would (its ``fused`` / ``foreach`` settings; torch's default there is the
    for-loop), for the same rounding: parameters whose gradient is pure rounding noise (an attention
    key bias) turn one-ulp differences into steps of size ``lr``. A chunk sharded on a CUDA device
    (``home_on_device``) is stepped there as eager would step it (fused when asked, else
    foreach)."""
    if home_on_device and store.is_cuda:  # a shard on a GPU: the implementation eager runs there
        if g.get("fused"):
            return "fused"
        return "single" if g.get("foreach") is False else "foreach"
    if store.device.type != "cpu" or store.master_dtype != torch.float32 and not g.get("fused"):
        return "fused" if store.master_dtype == torch.float32 or g.get("fused") else "single"
    return "fused" if g.get("fused") else "foreach" if g.get("foreach") else "single"


def _adam(g: dict, params, grads, m, v, vmax, steps, *, impl: str) -> None:
    """torch's CPU Adam/AdamW over lists of host tensors, with hyperparameters ``g`` (see
    step_hyperparameters), in the implementation ``impl`` ("fused", "foreach" or "single")."""
    from torch.optim.adam import adam

    beta1, beta2 = g["betas"]
    # torch's fused CUDA Adam takes its step counts on the device: copies, written back after
    on_device = (
        impl == "fused" and params[0].device.type == "cuda" and steps[0].device.type == "cpu"
    )
    counts = [s.to(params[0].device) for s in steps] if on_device else steps
    adam(
        params,
        grads,
        m,
        v,
        vmax,
        counts,
        foreach=impl == "foreach",
        fused=impl == "fused",
        decoupled_weight_decay=g["decoupled_weight_decay"],
        amsgrad=g["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        eps=g["eps"],
        maximize=g["maximize"],
    )
    if on_device:
        for s, c in zip(steps, counts):
            s.copy_(c)


def _nonfinite(opt, st: ChunkOptState, whole: bool, groups) -> bool:
    """Whether a provisional step must not be taken (its gradient is not finite), checked before
    it (a pass over the gradient) where the one-pass kernel, which checks as it reads, will not
    run the step."""
    kernel = whole and opt._one_pass_applies(st, next(iter(groups.values())))
    if kernel and st.chunk not in st.store.device_step_chunks:
        return False
    return not bool(torch.isfinite(st.store.grad[st.chunk]).all())


def _adam_inverse(
    g: dict, t: float, p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor
) -> None:
    """Undo the Adam step number ``t`` with hyperparameters ``g`` on (p, m, v), in place, in
    float64 (with cpu_adam's kernel where it applies: the same values in one pass)."""
    beta1, beta2 = (float(b) for b in g["betas"])  # as cpu_adam.adam_inverse takes them
    lr, wd, eps = float(g["lr"]), float(g["weight_decay"]), float(g["eps"])
    flat = all(
        x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
        for x in (p, grad, m, v)
    )
    if flat and cpu_adam.available():
        cpu_adam.adam_inverse(p, grad, m, v, t, g)
        return
    p1, m1, v1, gr = p.double(), m.double(), v.double(), grad.double()
    size = gr.abs()  # of the terms of L2's gradient sum (the rounding the moments saw)
    if g["maximize"]:
        gr = -gr
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    update = (lr / bc1) * m1 / (v1.sqrt() / math.sqrt(bc2) + eps)
    if g["decoupled_weight_decay"]:
        p0 = (p1 + update) / (1 - lr * wd) if wd != 0 else p1 + update
    else:
        p0 = p1 + update
        if wd != 0:
            gr = gr + wd * p0
            size = size + (wd * p0).abs()
    # moments that were 0 (an element first stepped now) come back as the float32 step's
    # rounding: where both are within SNAP of the rounding of the terms they are computed from,
    # both are 0 (one alone is a real moment beside a rounded one); cpu_adam's inverse does the same
    gm, gv = (1 - beta1) * gr, (1 - beta2) * gr * gr
    dm, dv = m1 - gm, v1 - gv
    first = (dm.abs() <= SNAP * torch.maximum(m1.abs(), (1 - beta1) * size)) & (
        dv.abs() <= SNAP * torch.maximum(v1, (1 - beta2) * gr.abs() * size)
    )
    m0 = torch.where(first, 0.0, dm / beta1)
    v0 = torch.where(first, 0.0, dv / beta2).clamp_(min=0)
    p.copy_(p0)
    m.copy_(m0)
    v.copy_(v0)
