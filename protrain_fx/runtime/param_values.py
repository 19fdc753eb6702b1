"""Where a parameter's value lives when it is not in the parameter: an offloaded chunk's host master
copy (:mod:`protrain_fx.runtime.chunk_store`) or, before the first compile, :func:`host_init`'s
pinned host copy. Hooks on the owning modules make ``model.state_dict()`` /
``model.load_state_dict()`` give and take plain tensors under the original keys, as if the parameter
held its value.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch
import torch.nn as nn

from protrain_fx._weakmap import IdentityWeakMap
from protrain_fx.errors import ProtrainError
from protrain_fx.runtime.chunk_store import device_shell, store_of

log = logging.getLogger("protrain_fx")

# host_init's parameters before a ChunkStore takes them: parameter -> host tensor
HOST_VALUES = IdentityWeakMap()
_HOOKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def host_value(p: torch.Tensor) -> torch.Tensor | None:
    """The host tensor that holds ``p``'s value (``host_init``, a dissolved store), or None."""
    return HOST_VALUES.get(p)


def is_external(p: torch.Tensor) -> bool:
    store = store_of(p)
    return (store is not None and store.param_is_offloaded(p)) or p in HOST_VALUES


def value_of(p: torch.Tensor) -> torch.Tensor:
    """The parameter's value as a plain tensor (a host copy when it is offloaded)."""
    store = store_of(p)
    if store is not None and store.param_is_offloaded(p):
        return store.read(p)
    if p in HOST_VALUES:
        return HOST_VALUES[p].clone()
    return p.detach()


def write_value(p: torch.Tensor, value: torch.Tensor) -> None:
    store = store_of(p)
    if store is not None and store.param_is_offloaded(p):
        store.write(p, value)
    elif p in HOST_VALUES:
        if HOST_VALUES[p].shape != value.shape:
            raise ProtrainError(
                f"shape {tuple(value.shape)} does not match the parameter's {tuple(p.shape)}"
            )
        HOST_VALUES[p].copy_(value)
    else:
        with torch.no_grad():
            p.copy_(value)


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    for name, p in module._parameters.items():
        if p is not None and is_external(p) and prefix + name in state_dict:
            state_dict[prefix + name] = value_of(p)


def _load_from_state_dict(
    module,
    original,
    state_dict,
    prefix,
    local_metadata,
    strict,
    missing_keys,
    unexpected_keys,
    error_msgs,
):
    external = {
        name: p for name, p in module._parameters.items() if p is not None and is_external(p)
    }
    for name, p in external.items():
        key = prefix + name
        if key not in state_dict:
            missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        if tuple(value.shape) != tuple(p.shape):
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape "
                f"{tuple(value.shape)} from "
                f"checkpoint, the shape in current model is {tuple(p.shape)}."
            )
            continue
        write_value(p, value)
    saved = {name: module._parameters[name] for name in external}
    for name in external:  # hidden from torch's loader, which would copy into the empty shell
        module._parameters[name] = None
    try:
        original(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
    finally:
        module._parameters.update(saved)


def install_hooks(modules) -> None:
    """Hook the modules that own parameters with external values (once per module)."""
    for module in modules:
        if module in _HOOKED:
            continue
        module._register_state_dict_hook(_state_dict_hook)
        module._load_from_state_dict = functools.partial(
            _load_from_state_dict, module, module._load_from_state_dict
        )
        _HOOKED.add(module)


def hook_owners_of(root: nn.Module, params) -> None:
    """Install the hooks on every module under ``root`` that owns one of ``params``."""
    ids = {id(p) for p in params}
    install_hooks(
        m
        for m in root.modules()
        if any(id(p) in ids for p in m._parameters.values() if p is not None)
    )


@contextlib.contextmanager
def host_init(device="cuda"):
    """Build a model whose parameters never have to fit on ``device``::

        with protrain_fx.host_init("cuda"):
            model = GPT(cfg)             # parameters are created (and initialized) in host memory

    On exit every parameter created inside becomes a device *shell* (right shape and dtype, no
    memory) and its value is kept in host memory as built (pageable: no second, pinned copy of the
    whole model; the chunk store copies each value into its chunk and frees it); buffers move to
    ``device``. ``torch.compile(model, backend="protrain")`` then takes the values from the host:
    resident chunks are copied to the device, offloaded ones stay on the host.
    ``model.state_dict()`` and ``load_state_dict()`` work throughout. Run such a model through
    protrain only: eager PyTorch would read the empty shells.
    """
    device = torch.device(device)
    created_params: list[tuple[nn.Module, str, torch.Tensor]] = []
    created_buffers: list[tuple[nn.Module, str]] = []
    orig_param, orig_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def register_parameter(self, name, param):
        orig_param(self, name, param)
        if param is not None:
            created_params.append((self, name, param))

    def register_buffer(self, name, tensor, persistent=True):
        orig_buffer(self, name, tensor, persistent)
        if tensor is not None:
            created_buffers.append((self, name))

    nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = orig_param, orig_buffer
    owners, done = [], set()
    for module, name, p in created_params:
        if module._parameters.get(name) is not p:
            continue  # replaced later (e.g. an output layer tied to the embedding)
        owners.append(module)
        if id(p) in done:
            continue
        done.add(id(p))
        # kept as built (pageable): the chunk store copies it into its pinned chunks
        host = p.data.detach()
        if host.untyped_storage().nbytes() != host.nbytes:
            host = host.clone()  # a view of something larger: keep only its own bytes
        HOST_VALUES[p] = host
        p.data = device_shell(p.shape, p.dtype, device)
    for module, name in created_buffers:
        buf = module._buffers.get(name)
        if buf is not None:
            module._buffers[name] = buf.to(device)
    install_hooks(owners)
    for module in dict.fromkeys(owners):  # once each, in order
        module.register_forward_pre_hook(_shells_run_eagerly)


_SAID_EAGER = False


def _shells_run_eagerly(module: nn.Module, args) -> None:
    """Forward pre-hook of the modules owning :func:`host_init`'s parameters. Traced by dynamo it
    does nothing (the graph's code places them); run eagerly (a module outside every compiled
    block of a regional compilation, the code of a graph break, a forward before any compile) its
    parameters that are still empty shells get their host values copied to their device, where
    eager PyTorch reads them (before, it read the shell: ``setStorage ... out of bounds for storage
    of size 0``). No plan placed them: the plans made later count them as memory of others."""
    global _SAID_EAGER
    if torch.compiler.is_compiling():
        return
    shells = [p for p in module._parameters.values() if p is not None and p in HOST_VALUES]
    if not shells:
        return
    nbytes = 0
    for p in shells:
        p.data = HOST_VALUES.pop(p).to(p.device)
        nbytes += p.nbytes
    if not _SAID_EAGER:
        _SAID_EAGER = True
        log.warning(
            "protrain: %s (built under host_init) ran outside protrain's compiled graphs, so its "
            "parameters' values were copied to %s (%.1f MiB; so for every such module, said "
            "once): compile the modules that hold most parameters with backend='protrain' "
            "(a whole model places all of them)",
            type(module).__name__,
            shells[0].device,
            nbytes / 2**20,
        )


def placement_snapshot(params) -> "callable":
    """Remember where ``params`` keep their values now; the returned function puts them back there
    (a failed compile leaves the model as it was): values held by chunk stores made since, or by
    host values set since, return to plain tensors on their devices, and those stores are forgotten.
    """
    before_store = {id(p): store_of(p) for p in params}
    before_host = {id(p) for p in params if p in HOST_VALUES}
    devices = {id(p): p.device for p in params}
    refs = [weakref.ref(p) for p in params]

    def restore() -> None:
        from protrain_fx.runtime.worker import WORKER

        WORKER.wait()
        new_stores = {}
        for r in refs:
            p = r()
            if p is None:
                continue
            s = store_of(p)
            if s is not None and s is not before_store[id(p)]:
                new_stores[id(s)] = s
                value = s.read(p) if s.param_is_offloaded(p) else p.detach()
            elif s is None and p in HOST_VALUES and id(p) not in before_host:
                value = HOST_VALUES.pop(p)
            else:
                continue
            if id(p) in before_host:  # built under host_init: back to a host value and a shell
                HOST_VALUES[p] = value.detach().to("cpu", copy=True)
                p.data = device_shell(p.shape, p.dtype, devices[id(p)])
            else:
                p.data = value.detach().to(devices[id(p)], copy=True)
            p.grad = None
        for s in new_stores.values():
            if s.optimizer is not None:  # its chunks' state goes with it (dynamo's restarts)
                s.optimizer.remove_store(s)
            s.unregister()
            s.master, s.transfer, s.grad = {}, {}, {}
            s.forget_views()

    return restore


def dissolve_store(store) -> None:
    """Hand ``store``'s parameters back as if built under :func:`host_init`: offloaded values become
    host values (views of the store's master copies, kept alive until the next store takes them),
    resident ones stay on the device, and the store is forgotten. The profiler does this after its
    step under the most frugal placement, so the chosen plan's store starts from the same values.
    Only before any optimizer state exists for the store (the profiler's gradients are dropped)."""
    if store.optimizer is not None:
        raise ProtrainError("protrain: a chunk store with optimizer state cannot be re-placed")
    for c in store.offloaded_chunks:
        full = store.host_chunk(c)  # every rank's shard, with several ranks
        for p, e in store.chunk_entries(c):
            HOST_VALUES[p] = full[e.offset : e.offset + e.numel].view(e.shape)
    store.unregister()
    # its transfer copies go now (the masters live on in the views until the next store takes them)
    store.master, store.transfer = {}, {}
    store.forget_views()
