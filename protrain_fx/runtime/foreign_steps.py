"""Another optimizer stepping parameters whose offloaded chunks protrain steps for one optimizer.

protrain steps the offloaded chunks for one Adam/AdamW, the chunks' *owner* (the hybrid optimizer,
protrain_fx/runtime/hybrid_optim.py), often inside backward, provisionally until the owner's
``opt.step()``. Loops also step those parameters with another optimizer: a rebuilt one
(``opt = AdamW(model.parameters())`` for a second phase, while the old one still lives: protrain's
hooks keep it in reference cycles until the garbage collector runs, and a scheduler may hold it),
or a second one on purpose. Eager PyTorch steps a parameter when, and only when, an optimizer
holding it steps; before, the owner's provisional steps stayed on the parameters that the other
optimizer then stepped again (two updates a step, silently). So a global optimizer step pre-hook,
before any other optimizer's step over offloaded parameters:

* collects garbage once per owner, so that an owner the user dropped lets its stores go now (its
  provisional steps taken back: ``HybridOptimizer.orphan``);
* with the owner alive, has it take its provisional steps of those chunks back (the other optimizer
  steps from eager's values) and step at its own ``opt.step()`` from then on; the other optimizer
  steps those parameters through their device views (exact; slower, its moments for them made on
  the device), said once;
* with no owner (dropped now or earlier), an optimizer protrain can step (Adam, AdamW) takes the
  stores over once its step is done (the global post-hook): from its next step their offloaded
  chunks step on the host's cores again, and the state its step made for them moves to host memory.
"""

from __future__ import annotations

import gc
import logging
import weakref

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from protrain_fx.runtime.chunk_store import store_of

log = logging.getLogger("protrain_fx")

_installed = False
# owners whose optimizer was found alive after a collection (collected for once each)
_collected_for: "weakref.WeakSet" = weakref.WeakSet()
# optimizer -> the stores it takes over after its step (weak both ways)
_to_adopt: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_said_views = False


def install() -> None:
    """Hook every optimizer's step (once a process; the hooks return at once for an optimizer
    over no offloaded parameter of another's)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_before_any_step)
        register_optimizer_step_post_hook(_after_any_step)
        _installed = True


def offloaded_chunks_of(opt: torch.optim.Optimizer) -> dict:
    """``{store: {chunk, ...}}``: the offloaded chunks holding parameters of ``opt``."""
    out: dict = {}
    for group in opt.param_groups:
        for p in group["params"]:
            store = store_of(p)
            if store is not None and store.param_is_offloaded(p):
                out.setdefault(store, set()).add(store.entry(p).chunk)
    return out


def _before_any_step(opt, args, kwargs) -> None:
    from protrain_fx.runtime.hybrid_optim import handle_of

    mine = handle_of(opt)
    foreign = {
        s: chunks
        for s, chunks in offloaded_chunks_of(opt).items()
        if mine is None or s.optimizer is not mine
    }
    if not foreign:
        return
    owners = {id(s.optimizer): s.optimizer for s in foreign if s.optimizer is not None}
    if any(h not in _collected_for for h in owners.values()):
        del owners
        gc.collect()  # an owner the user dropped, kept by reference cycles only, goes now
    adopt = []
    for store, chunks in foreign.items():
        owner = store.live_optimizer()  # lets a collected owner's stores go
        if owner is None:
            adopt.append(weakref.ref(store))
            continue
        _collected_for.add(owner)
        owner.foreign_step(store, chunks, type(opt).__name__)
        _say_views(opt, owner)
    if adopt and _can_own(opt):
        if len(args) > 1 or kwargs.get("closure") is not None:
            _to_adopt[opt] = adopt  # the closure's backward comes first: after this step
        else:
            _adopt(opt, adopt, "this step")


def _after_any_step(opt, args, kwargs) -> None:
    _adopt(opt, _to_adopt.pop(opt, ()), "its next step")


def _adopt(opt, stores, when: str) -> None:
    """``opt`` takes over the stores left without an optimizer: taken in its step pre-hook, the
    hybrid's own pre-hook (registered now, run next) steps their chunks on the host's cores in
    this very step, so torch's step never makes their moments on the compute device."""
    from protrain_fx.runtime.hybrid_optim import attach

    for ref in stores:
        store = ref()
        if store is not None and store.live_optimizer() is None:
            attach(opt, store)
            log.info(
                "protrain: the %s stepping store %d's offloaded chunks takes them over (their "
                "optimizer is gone): they step on the host's cores from %s",
                type(opt).__name__,
                store.id,
                when,
            )


def _can_own(opt) -> bool:
    from protrain_fx.runtime.optimizer_lookup import SUPPORTED, UNSUPPORTED_FLAGS

    return type(opt) in SUPPORTED and not any(
        g.get(flag) for g in opt.param_groups for flag in UNSUPPORTED_FLAGS
    )


def _say_views(opt, owner) -> None:
    global _said_views
    if not _said_views:
        _said_views = True
        log.warning(
            "protrain: a %s steps parameters whose offloaded chunks protrain steps for another "
            "optimizer (a %s, still alive): it steps them through device views of host memory "
            "(exact, slower; its moments for them on the compute device); drop the other one "
            "(`del old_opt`) to have protrain step them for this one",
            type(opt).__name__,
            type(owner.opt).__name__,
        )
