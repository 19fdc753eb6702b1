"""``torch.nn.utils.clip_grad_norm_`` extended to the gradients protrain keeps on the host, sharded.

With several data-parallel ranks an offloaded chunk's gradient is a shard in this rank's host
memory, not in ``param.grad``, so torch's own clipping would neither count it in the total norm nor
scale it. :func:`install` replaces ``clip_grad_norm_`` in ``torch.nn.utils`` and
``torch.nn.utils.clip_grad`` (once; never at import: the hybrid optimizer calls it when a sharded
chunk store attaches to it, which the backend does when it compiles a graph or binds one to another
block's parameters) with a function that, when some of the parameters are offloaded in a sharded
store, first waits for the resident gradients' averaging over the ranks, takes the total norm over
the device gradients and every rank's host shards together, and scales both; otherwise it calls
torch's original.
"""

from __future__ import annotations

import torch

from protrain_fx.runtime import distributed
from protrain_fx.runtime.chunk_store import store_of

_INSTALLED = False


def install() -> None:
    """Data parallel: offloaded gradients are shards on the host, not in ``param.grad``, so
    ``torch.nn.utils.clip_grad_norm_`` must be extended to them (installed when a sharded store
    attaches)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_mod

    original = clip_mod.clip_grad_norm_

    def clip_grad_norm_(
        parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None
    ):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        # data parallel: resident gradients averaged over the ranks first
        distributed.wait_resident_grads()
        handles = {
            store_of(p).optimizer
            for p in params
            if store_of(p) is not None
            and store_of(p).optimizer is not None
            and not store_of(p).aliased
            and store_of(p).param_is_offloaded(p)
        }
        if not handles:
            return original(
                params,
                max_norm,
                norm_type=norm_type,
                error_if_nonfinite=error_if_nonfinite,
                foreach=foreach,
            )
        host = [g for h in handles for g in h.offloaded_grads(params)]
        device_grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        norms = [torch.linalg.vector_norm(g, norm_type) for g in device_grads]
        host_norms = [torch.linalg.vector_norm(g, norm_type) for g in host]
        # the compute device even when no gradient is in param.grad (every chunk offloaded or
        # sharded): NCCL reduces device tensors only
        dev = device_grads[0].device if device_grads else next(iter(handles)).stores[0].device
        # shards: the norm spans the ranks
        host_norms = [distributed.shard_norm(host_norms, norm_type, dev)]
        all_norms = torch.stack([n.to(dev) for n in norms + host_norms])
        total = torch.linalg.vector_norm(all_norms, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in device_grads:
                g.mul_(coef.to(g.device))
            for g in host:
                g.mul_(coef.to(g.device))
        return total

    clip_mod.clip_grad_norm_ = clip_grad_norm_
    nn_utils.clip_grad_norm_ = clip_grad_norm_
    _INSTALLED = True
