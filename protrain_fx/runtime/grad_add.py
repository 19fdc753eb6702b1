"""Adding to an offloaded chunk's gradient on the compute device: the second micro-step on.

An offloaded chunk's gradient accumulator lives in host memory. Its first gradient since it was
zeroed is copied straight into it; before this module, every later one (gradient accumulation) was
copied into a host staging buffer and added there by the host worker: 12 bytes of host memory
traffic per parameter on the CPU, whose memory bandwidth the CPU optimizer's steps are bound by, and
a sum whose 2-norm clipping then read over the link. Here the device gradient buffer, already packed
in the chunk layout, gets the accumulator added to it instead, read over the link through a device
view of its pinned memory (4 bytes a parameter up, on the copy stream beside backward's compute);
clipping's norms come from the sum while it is on the device (grad_scale.py), and the sum goes down
into the accumulator as a first gradient does. The floating-point sum is the same either way (an
fp32 add rounds once, in either order), so training is bit for bit what it was. Used where every
parameter of the chunk has a gradient and gets one now, in the master dtype, unsharded; the host
path stays for the rest (a partial chunk, an oversized chunk's low-precision gradient, shards) and
with ``PROTRAIN_DEVICE_GRAD_ADD=0``. On a CPU compute device the same additions run on the CPU.
"""

from __future__ import annotations

import torch

from protrain_fx import config
from protrain_fx.runtime import mapped


def wanted(store, as_is: bool, fresh: list[bool], members: list[int], chunk: int) -> bool:
    """Whether the chunk's gradient ``members`` just produced is added on the compute device: all
    of the chunk's parameters hold a gradient and get one now, packed, unsharded."""
    return (
        not as_is
        and not any(fresh)
        and len(members) == len(store._chunk_entries[chunk])
        and not store.world.sharded
        and store.device_grad_add
    )


def enabled() -> bool:
    """``PROTRAIN_DEVICE_GRAD_ADD`` (default on), read when a store is made: the plan priced the
    host bytes of the same setting (``Hardware.grads_added_on_device``), and the environment is not
    parsed again for every chunk's gradient."""
    return config.settings().device_grad_add


def add_on_device(store, chunk: int, buf: torch.Tensor, acc: torch.Tensor, members: list[int]):
    """``acc[:n] += buf`` (the accumulator in host memory, the packed device gradient buffer of
    ``n`` elements), computed in ``buf`` and copied down into ``acc``; clipping's norms noted from
    the sum. Returns the event that marks the copy done (None on the CPU, where it is done)."""
    n = buf.numel()
    store._stats["grad_adds_on_device"] += 1
    with torch.no_grad():
        if not store.is_cuda:
            buf.add_(acc[:n])
            store.note_grad_norms(chunk, buf, members)
            return store.copy_to_host(buf, acc)
        compute = torch.cuda.current_stream(store.device)
        copies = store.streams.d2h
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(copies):
            copies.wait_event(ready)
            buf.add_(mapped.device_view(acc, 0, (n,), store.device))
            store.note_grad_norms(chunk, buf, members)
            noted = [i for i in members if i in store._grad_scale.norms]
            if noted:  # computed on the copy stream: read on the compute stream after this event,
                # and their memory not reused before the compute stream is done with them
                normed = torch.cuda.Event()
                normed.record(copies)
                for i in noted:
                    norm, host, version, _ = store._grad_scale.norms[i]
                    norm.record_stream(compute)
                    store._grad_scale.norms[i] = (norm, host, version, normed)
            # the copy down, as a first gradient's (ordered after the add on this stream)
            return store.copy_to_host(buf, acc)
