"""Several trained models on one device (a GAN's generator and discriminator, an actor and its
critic), each compiled with protrain and no ``memory_budget``, so that every graph's budget is what
the process may use on the device less what others hold (budgets.device_budget).

The model whose first training call comes first is planned alone and takes what the device has
(its resident chunks, gradients and Adam moments); the next model's plan gets what is left, and
where not even its smallest plan fits there, its compile raised :class:`NoPlanFits` in a setup
that fits: the first model could have offloaded more. Now that plan makes room first
(:func:`make_room`): the other trained models' last resident chunks move to the host with their
gradients and optimizer state (runtime/replacement.py, as for an evaluation that ran out of memory
beside training) until the shortfall moved, and it plans again; their graphs plan again at their
next call (their placement moved), in what this one leaves. Only where those models' stores allow
it (one rank, an optimizer protrain steps or finds, stores holding one graph's parameters); the
trained models share the device in the order they were planned, not evenly (give each a
``memory_budget`` to split it yourself).

"""

from __future__ import annotations

import logging

import torch

from protrain_fx import inference_placement
from protrain_fx.budgets import device_budget
from protrain_fx.errors import NoPlanFits
from protrain_fx.graph import regional
from protrain_fx.options import Options, format_bytes
from protrain_fx.plan.plan import training_plans
from protrain_fx.runtime import replacement
from protrain_fx.runtime.chunk_store import release_unused_buffers
from protrain_fx.runtime.optimizer_lookup import find_optimizer

log = logging.getLogger("protrain_fx")


def make_room(
    live: list, opts: Options, device: torch.device, e: NoPlanFits, root=None
) -> str | None:
    """After this training graph's plan raised ``e`` on a device shared by the process's graphs:
    move other trained models' resident chunks to the host, a chunk at a time, until ``e``'s
    minimum fits today's budget; a note for the plan, or None where it cannot (``e`` stands).
    ``root``: the module traced; the blocks compiled like it (regional compilation) are the same
    model, not another."""
    if not inference_placement.shares_device(opts, device) or not e.min_device_bytes:
        return None
    peers = regional.siblings(root) if root is not None else []
    mine = {id(p) for p in live} | {id(p) for m in peers for p in m.parameters()}
    others = {}  # the other trained models' graphs, one entry per parameter set
    for plan, params in training_plans():
        if params[0].device == device and not any(id(p) in mine for p in params):
            others[frozenset(map(id, params))] = params

    def short() -> int:  # what this plan's least lacks now
        return e.min_device_bytes - device_budget(opts, device, live)[0]

    need = lacking = short()
    if not others or lacking <= 0:
        return None
    chunks = moved = 0
    for params in others.values():
        opt = find_optimizer(params)[0]
        while lacking > 0:  # a chunk at a time: its gradient and Adam moments go with it
            n, nbytes = replacement.make_room(params, 1, opt)
            if not n:
                break
            chunks, moved, lacking = chunks + n, moved + nbytes, short()
    if lacking > 0:  # what moved stays moved (their next calls re-plan); the plan still fails
        return None
    release_unused_buffers()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    note = (
        f"{chunks} resident chunks ({format_bytes(moved)}) of another trained model on this device "
        f"moved to the host with their optimizer state: this plan's least needs "
        f"{format_bytes(e.min_device_bytes)}, {format_bytes(need)} more than it had; that model "
        "plans again at its next call"
    )
    log.warning("protrain: %s", note)
    return note
