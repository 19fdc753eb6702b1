"""When the offloaded chunks' CPU steps may run inside backward: the hybrid optimizer's overlap.

A chunk's step taken inside backward is provisional (protrain_fx/runtime/hybrid_optim.py): what
changes what it depended on before ``opt.step()`` takes it back, and it is redone at ``opt.step()``.
Two habits make those steps futile, for good or for a while, and the chunks then step at
``opt.step()``, after backward:

* hyperparameters set between ``backward()`` and ``opt.step()`` (a scheduler stepped before the
  optimizer): every step would be taken back, so for good;
* gradients written between ``backward()`` and ``opt.step()`` by an actual change (clipping whose
  total norm exceeds ``max_norm``, unscaling by a GradScaler): for as long as it lasts. Clipping is
  often active only early in training (large gradients at initialization) and a multiply by exactly
  one afterwards, which changes nothing (``mapped._scale``): once the loop's writes have
  been such identities for :data:`FIRST_CALM` consecutive steps, chunks step inside backward again.
  A real write after that takes those provisional steps back (protrain_fx/runtime/chunk_adam.py:
  the values come back within rounding, so that step is eager's within the CPU fp32 tolerance, not
  bit for bit, and the take-back costs about one more CPU step) and doubles the calm needed the next
  time (at most :data:`MAX_CALM` steps), so a loop that clips most steps pays a take-back rarely.

:class:`Overlap` is that policy's state; :class:`OverlapControl`, inherited by
:class:`protrain_fx.runtime.hybrid_optim.HybridOptimizer`, applies it: the gradient views' callbacks
(:func:`install`, protrain_fx/runtime/mapped.py) reach it, it takes provisional steps back and says
what changed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from protrain_fx.runtime import grad_scale, mapped

if TYPE_CHECKING:
    from protrain_fx.runtime.chunk_store import ChunkStore

log = logging.getLogger("protrain_fx")

# consecutive steps whose gradient writes were all identities before chunks step inside backward
# again; doubled after each such return that a real write then ended, up to MAX_CALM
FIRST_CALM = 2
MAX_CALM = 64


class Overlap:
    """Whether chunks step inside backward now (:attr:`on`), and why not (:attr:`serial_why`)."""

    def __init__(self):
        self.serial_why: str | None = None
        self.lasting = False  # off for good (hyperparameters), not only while gradients are written
        self.calm_needed = FIRST_CALM
        self.calm = 0  # consecutive steps with identity writes only, while off
        self.returns = 0  # times the overlap came back
        self._written = False  # this cycle: gradients changed by eager code
        self._identity = False  # this cycle: gradients multiplied by exactly one

    @property
    def on(self) -> bool:
        return self.serial_why is None

    def turn_off(self, why: str, lasting: bool) -> bool:
        """Chunks step at ``opt.step()`` from now on (``lasting``: for good); True when that is
        news (the caller says so once)."""
        if not lasting:
            self._written = True
        if self.on:
            if not lasting and self.returns:  # the last return did not last: wait longer next time
                self.calm_needed = min(MAX_CALM, 2 * self.calm_needed)
            self.serial_why, self.lasting, self.calm = why, lasting, 0
            return True
        if lasting and not self.lasting:
            self.serial_why, self.lasting = why, True
        return False

    def identity_write(self) -> None:
        """Eager code multiplied offloaded gradients by exactly one (clipping under max_norm)."""
        self._identity = True

    def force(self, on: bool) -> None:
        """Set by hand (benchmarks comparing the two): on, or off for good."""
        self.__init__()
        if not on:
            self.serial_why, self.lasting = "turned off by hand", True

    def cycle_ended(self) -> bool:
        """``opt.step()`` is done: count a calm cycle; True when chunks step inside backward again
        from the next backward on."""
        written, identity = self._written, self._identity
        self._written = self._identity = False
        if self.on or self.lasting:
            return False
        self.calm = self.calm + 1 if identity and not written else 0
        if self.calm < self.calm_needed:
            return False
        self.serial_why, self.calm = None, 0
        self.returns += 1
        return True


class OverlapControl:
    """The hybrid optimizer's side of :class:`Overlap` (needs ``_overlap``, ``states``, ``_undo``
    and ``_zeroing`` of :class:`protrain_fx.runtime.hybrid_optim.HybridOptimizer`)."""

    @property
    def overlap(self) -> bool:  # chunks step inside backward now
        return self._overlap.on

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self._overlap.force(on)

    @property
    def serial_why(self) -> str | None:  # why chunks step at opt.step() now (step_meter)
        return self._overlap.serial_why

    def _disable_overlap(self, why: str, lasting: bool = True) -> None:
        """Chunks step at opt.step() from now on (``lasting``: for good, else while gradients are
        written); said once at INFO, later plans price it (step_meter)."""
        first = self._overlap.returns == 0
        if self._overlap.turn_off(why, lasting):
            until = "from now on" if lasting else "while that goes on"
            log.log(
                logging.INFO if first else logging.DEBUG,
                "protrain: %s: offloaded chunks step at opt.step(), after backward, %s (later "
                "plans price it so)",
                why,
                until,
            )

    def _overlap_cycle_ended(self) -> None:
        if self._overlap.cycle_ended():
            log.log(
                logging.INFO if self._overlap.returns == 1 else logging.DEBUG,
                "protrain: gradients unchanged between backward() and opt.step() for %d steps "
                "(clipping under max_norm): offloaded chunks step inside backward again",
                self._overlap.calm_needed,
            )

    def on_grad_write(self, keys: set) -> None:
        """Gradients of these (store id, entry) are about to be changed by eager code (clipping,
        unscaling): a provisional step of their chunk is taken back first, and chunks step at
        opt.step() while that goes on."""
        if self._zeroing:
            return
        self._disable_overlap(
            "gradients of offloaded parameters are changed between backward() and opt.step() "
            "(clipping, unscaling)",
            lasting=False,
        )
        for store_id, i in keys:
            for st in self.states.values():
                if st.store.id == store_id:
                    st = self.states.get((store_id, st.store.entries[i].chunk))
                    if st is not None and st.provisional is not None:
                        self._undo(st)
                    break

    def foreign_step(self, store: ChunkStore, chunks, who: str) -> None:
        """Another optimizer (``who``) is about to step parameters of these offloaded chunks
        (runtime/foreign_steps.py): a provisional step of them is taken back first, as eager steps
        a parameter only when an optimizer holding it steps; if one was, chunks step at this
        optimizer's own ``opt.step()`` from then on (each such step would be taken back)."""
        from protrain_fx.runtime.worker import WORKER

        WORKER.wait()
        pending = [st for c in chunks if (st := self.states.get((store.id, c))) is not None]
        pending = [st for st in pending if st.provisional is not None]
        for st in pending:
            self._undo(st)
        if pending:
            self._disable_overlap(f"another optimizer (a {who}) steps parameters of these chunks")

    def on_grad_identity(self, keys: set) -> None:
        """Gradients of these were multiplied by exactly one (clipping under ``max_norm``): their
        versions moved, their values did not (:meth:`take_back_rewritten`)."""
        self._overlap.identity_write()
        for st in self.states.values():
            rec = st.provisional
            if rec is not None:
                rec.grad_versions.update(grad_versions(st.store, rec.grad_versions, keys))

    def take_back_rewritten(self, st) -> None:
        """Before ``opt.step()`` commits a provisional step: a gradient it read that eager code
        replaced (``p.grad = None``, ``p.grad = p.grad * 0.5``) takes it back, as a write through
        the view does (:meth:`on_grad_write`; the host gradient it inverts with is still there).
        Writes through the view, an alias of it (``detach()``, ``.data``, a slice: took it back
        when made) or ``out=`` are seen as they come; one that moved the view's version counter
        unseen could not be taken back exactly: an error."""
        store, rec = st.store, st.provisional
        now = grad_versions(store, rec.grad_versions)
        replaced = {
            (store.id, i)
            for i in rec.grad_versions
            if (p := store.param(i)) is not None and p.grad is not store._grad_alias.get(i)
        }
        if replaced:
            self.on_grad_write(replaced)
            return
        for i, version in rec.grad_versions.items():
            if now.get(i) != version:
                from protrain_fx.errors import ProtrainError

                raise ProtrainError(
                    f"protrain: the gradient of {store.entries[i].fqn!r} (offloaded) was written "
                    "between backward() and opt.step() in a way protrain did not see, after its "
                    "chunk had stepped inside backward; write gradients through `p.grad` or a "
                    "view of it made after backward()"
                )


def grad_versions(store: ChunkStore, entries, keys=None) -> dict:
    """Entry -> the version counter of its gradient view (``param.grad`` of an aliased store), for
    those of ``entries`` (and, given, among the (store id, entry) ``keys``)."""
    if not store.aliased:
        return {}
    return {
        i: view._version
        for i in entries
        if (keys is None or (store.id, i) in keys)
        and (view := store._grad_plain.get(i)) is not None
    }


def install() -> None:
    """Route the gradient views' callbacks (mapped.HostGrad) to the optimizers of their stores."""
    mapped.HostGrad.on_write = _on_grad_write
    mapped.HostGrad.on_identity = _on_grad_identity


def _on_grad_write(grads) -> None:
    _route(grads, "on_grad_write")


def _on_grad_identity(grads) -> None:
    _route(grads, "on_grad_identity")


def _route(grads, method: str) -> None:
    for store, entries in grad_scale.owners(grads).items():
        if store.optimizer is not None:
            getattr(store.optimizer, method)({(store.id, i) for i in entries})
