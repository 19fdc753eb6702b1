"""The hybrid optimizer's state as torch shows it: ``opt.state``, ``state_dict``,
``load_state_dict``.

The Adam state of offloaded parameters lives in protrain's host buffers (one moment tensor per
chunk, protrain_fx/runtime/chunk_adam.py), not where torch keeps an optimizer's state. So that code
reading or saving the optimizer sees what eager torch would hold, every offloaded parameter that has
state gets an ``opt.state[p]`` entry made by protrain (its step count tensor and device views of the
host moments); ``opt.state_dict()`` gains the offloaded parameters' state in torch's format, keyed
by the parameters' indices (each rank's shard gathered), with a provisional step taken back first;
and ``opt.load_state_dict()`` routes their saved state into the host buffers (a parameter without
saved state starts fresh, as in torch) and hands torch's loader the rest. :class:`TorchStateView`
holds this as methods of the hybrid optimizer, which inherits it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from protrain_fx.runtime import mapped
from protrain_fx.runtime.worker import WORKER

if TYPE_CHECKING:
    from protrain_fx.runtime.chunk_adam import ChunkOptState


class TorchStateView:
    """The state methods of :class:`protrain_fx.runtime.hybrid_optim.HybridOptimizer` (which
    inherits them): it provides ``opt``, ``states``, ``_published``, ``_offloaded`` and
    ``_undo``."""

    def _import_state(self, st: ChunkOptState, i: int, state: dict) -> None:
        # this rank's share of the parameter (all of it with one rank)
        part = st.store.host_slices(i)
        if part is not None and "exp_avg" in state:
            sl, flat = part
            with torch.no_grad():
                st.exp_avg[sl].copy_(state["exp_avg"].reshape(-1)[flat])
                st.exp_avg_sq[sl].copy_(state["exp_avg_sq"].reshape(-1)[flat])
                if "max_exp_avg_sq" in state:
                    vmax = st.with_max_exp_avg_sq()
                    vmax[sl].copy_(state["max_exp_avg_sq"].reshape(-1)[flat])
        if "step" in state:
            self._set_step(st, i, float(state["step"]))

    # ----------------------------------------------------------- steps and torch's state view
    def _set_step(self, st: ChunkOptState, i: int, value: float) -> None:
        """The parameter's step count (one tensor for its life: ``opt.state[p]["step"]`` is the
        same one)."""
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
        """``opt.state[p]`` of an offloaded parameter that has state, as eager torch would hold it:
        the step count and device views of the host moments (so a reader such as
        torch.distributed.checkpoint, which takes an empty ``opt.state`` for an optimizer that never
        stepped, sees the real state)."""
        store = st.store
        p = store.param(i)
        if p is None or not store.aliased:
            return
        entry = self.opt.state.get(p)
        if (
            entry is not None
            and entry.get("step") is st.steps[i]
            and ("max_exp_avg_sq" in entry) == (st.max_exp_avg_sq is not None)
        ):
            return
        e = store.entries[i]
        view = {
            name: mapped.device_view(getattr(st, name), e.offset, e.shape, store.device)
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
            if getattr(st, name) is not None
        }
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

    # ------------------------------------------------------------------- state the user changed
    def _state_changed(self, st: ChunkOptState) -> list[int]:
        """Entries of the chunk with state whose ``opt.state`` entry is no longer the one protrain
        published: the user removed it (``opt.state.clear()``, ``del opt.state[p]``, a new
        ``opt.state``: a reset, as torch then starts the parameter afresh) or set their own."""
        store = st.store
        if not store.aliased:
            return []
        return [i for i in st.steps if (p := store.param(i)) is not None and not self._ours(p)]

    def _take_user_state(self) -> None:
        """Before ``opt.step()``: state the user removed or set since protrain published it is
        taken as they left it (fresh moments and step count, or their entry imported), after a
        provisional step that used the old one is taken back."""
        for st in self.states.values():
            changed = self._state_changed(st)
            if not changed:
                continue
            store = st.store
            given = {i: self.opt.state.get(store.param(i)) for i in changed}
            if st.provisional is not None:
                self._undo(st)
            for i in changed:
                p = store.param(i)
                self.opt.state.pop(p, None)
                self._published.pop(id(p), None)
                st.steps.pop(i, None)
                part = store.host_slices(i)
                moments = (st.exp_avg, st.exp_avg_sq, st.max_exp_avg_sq)
                for m in moments if part is not None else ():
                    if m is not None:
                        m[part[0]].zero_()
                if given[i]:
                    self._import_state(st, i, given[i])

    # ------------------------------------------------------------------------------ state dicts
    def _indexed_params(self) -> list[torch.Tensor]:
        """Parameters in torch's state_dict index order (param groups in order)."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    def _state_dict_post(self, sd: dict) -> dict:
        WORKER.wait()
        for st in self.states.values():
            if st.provisional is not None:  # not committed: the state is as before the step
                self._undo(st)
        index = {id(p): k for k, p in enumerate(self._indexed_params())}
        # a chunk's moments, every rank's shard gathered
        whole: dict[tuple[int, str], torch.Tensor] = {}

        def moment(st: ChunkOptState, name: str) -> torch.Tensor:
            key = (id(st), name)
            # the same chunks in the same order on every rank: collectives line up
            if key not in whole:
                whole[key] = st.store.host_chunk(st.chunk, getattr(st, name))
            return whole[key]

        for p, st, i, e in self._offloaded(self._indexed_params()):
            idx = index[id(p)]
            if i not in st.steps:
                continue  # never stepped: torch has no state for it either
            sl = slice(e.offset, e.offset + e.numel)
            names = ("exp_avg", "exp_avg_sq") + (
                ("max_exp_avg_sq",) if st.max_exp_avg_sq is not None else ()
            )
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
