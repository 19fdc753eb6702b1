"""ChunkStore: the runtime owner of parameter values packed in chunks.

Resident chunks (the first ``n_persist`` in first-use order) keep their parameters as ordinary
device tensors: autograd fills ``param.grad`` and the user's optimizer steps them on the device. An
offloaded chunk keeps in host memory (pinned on CUDA) its master copy, a copy in the transfer dtype
(``param_dtype``; the master itself when they agree) and, from its first gradient on, a gradient
accumulator. Its parameters and their gradients are views of that host memory on the compute device
(protrain_fx/runtime/mapped.py), so eager code sees the right values; compiled graphs instead read
the chunk through ``protrain::gather``, which copies it out of a device chunk buffer filled ahead of
use by ``protrain::prefetch`` (protrain_fx/runtime/chunk_buffers.py).

Which store and chunk an op means is found at run time from the parameter tensors the graph is
called with (:func:`store_of`), so one compiled graph can serve every block that shares its
structure.

Gradients of offloaded chunks arrive flat through ``protrain::chunk_grad``: packed into a device
gradient buffer, copied to the host on the copy stream and added (or copied, for a parameter whose
``.grad`` is None) into the accumulator on the host worker (protrain_fx/runtime/worker.py); the
parameters' ``.grad`` then is the accumulator's view, exactly as eager autograd would have left it.
A callback at the end of every backward waits for the worker, so after ``loss.backward()`` returns,
values and gradients are final. The attached optimizer (protrain_fx/runtime/hybrid_optim.py) may
queue the chunk's CPU step right behind its gradient. That gradient path is
protrain_fx/runtime/chunk_grads.py (methods :class:`ChunkStore` inherits).

With several data-parallel ranks (protrain_fx/runtime/distributed.py) a rank keeps only its shard of
each host tensor; parameters are then empty device *shells* and offloaded gradients stay on the host
(read through ``model.state_dict()`` hooks and protrain's clipping). The ``n_shard`` chunks after
the resident ones take the offloaded chunks' paths, but a rank keeps their shards in device memory
(:meth:`home_on_device`; docs/design.md, section 9).

On a CPU compute device the same code runs with real copies and no streams.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from protrain_fx._weakmap import IdentityWeakMap
from protrain_fx.errors import ProtrainError
from protrain_fx.machine import pinned
from protrain_fx.options import format_bytes
from protrain_fx.plan.layout import ALIGN_BYTES, ChunkLayout
from protrain_fx.runtime import distributed, grad_add, mapped
from protrain_fx.runtime.chunk_buffers import (
    chunk_buffers,
    grad_buffers,
    release_unused,
    streams_of,
)
from protrain_fx.runtime.chunk_grads import ChunkGrads, GradStaging
from protrain_fx.runtime.chunk_transfers import ChunkTransfers, release_pieces
from protrain_fx.runtime.grad_scale import GradScales, PendingScales
from protrain_fx.runtime.worker import WORKER

_STORES: dict[int, "ChunkStore"] = {}
_STORE_IDS = itertools.count()
# parameter -> its store (weak: a dead model takes its store with it)
_PARAM_STORE = IdentityWeakMap()


def live_store(store_id: int) -> "ChunkStore | None":
    """The store of that id, or None once it is gone."""
    return _STORES.get(store_id)


def get_store(store_id: int) -> "ChunkStore":
    try:
        return _STORES[store_id]
    except KeyError:
        msg = f"protrain chunk store {store_id} no longer exists (its model was freed)"
        raise ProtrainError(msg) from None


def store_of(param: torch.Tensor) -> "ChunkStore | None":
    return _PARAM_STORE.get(param)


def bound_chunk(anchor: torch.Tensor) -> tuple["ChunkStore", int]:
    """The store and chunk of the parameter ``anchor`` (an op's way to know its chunk at run
    time)."""
    store = _PARAM_STORE.get(anchor)
    if store is None:
        raise ProtrainError(
            "protrain internal error: a compiled graph was called with a parameter that belongs "
            "to no chunk store (the graph's binding check did not run)"
        )
    return store, store.entry(anchor).chunk


def live_stores() -> list["ChunkStore"]:
    return list(_STORES.values())


def free_storage(t: torch.Tensor) -> None:
    """Release a tensor's memory but keep its shape and strides (what dynamo's guards check)."""
    t.untyped_storage().resize_(0)


def device_shell(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    shell = torch.empty(shape, dtype=dtype, device=device)
    free_storage(shell)
    return shell


@dataclass
class ParamEntry:
    fqn: str
    chunk: int
    offset: int  # element offset in the chunk
    numel: int
    shape: torch.Size


class ChunkStore(ChunkGrads, ChunkTransfers, GradScales):
    """Parameter values of one set of parameters, chunked; see the module docstring."""

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        layout: ChunkLayout,
        n_persist: int,
        param_dtype: torch.dtype,
        host_values: dict | None = None,
        n_shard: int = 0,
        transfer_copies: bool = True,
    ):
        if not params:
            raise ProtrainError("a chunk store needs parameters")
        first = params[0][1]
        self.device = first.device
        self.master_dtype = first.dtype
        for fqn, p in params:
            if p.device != self.device or p.dtype != self.master_dtype:
                raise ProtrainError(
                    "protrain-fx needs all parameters of a graph on one device in one dtype; "
                    f"{fqn!r} is "
                    f"{p.dtype} on {p.device}, {params[0][0]!r} is {self.master_dtype} on "
                    f"{self.device}"
                )
        if not self.master_dtype.is_floating_point:
            raise ProtrainError(f"parameters must be floating point, got {self.master_dtype}")
        self.id = next(_STORE_IDS)
        self.param_dtype = param_dtype
        self.layout = layout
        self.n_chunks = layout.n_chunks
        self.n_persist = min(n_persist, self.n_chunks)
        self.placement_version = 0  # counts moves of resident chunks to the host (replacement.py)
        self.for_inference = False  # made for a graph without gradients (inference_placement.py)
        self.template = None  # the store this one was made like, for other parameters (binding.py)
        elem = first.element_size()
        # with several ranks each offloaded chunk is split in equal shards (distributed.py): pad to
        # a multiple
        self.world = distributed.world()
        # False: no host copy in the transfer dtype; a gather uploads the master and casts it
        # on the device (chunk_transfers.py)
        self.transfer_copies = transfer_copies
        # offloaded chunks whose shards stay on the device (several ranks only)
        self.n_shard = min(n_shard, self.n_chunks - self.n_persist) if self.world.sharded else 0
        # parameters are views of their host values (not shells)
        self.aliased = not self.world.sharded
        align_elems = max(1, ALIGN_BYTES // elem) * self.world.size
        by_fqn = dict(params)
        params_in_order: list[torch.nn.Parameter] = []
        self.entries: list[ParamEntry] = []
        self._entry_of: dict[int, int] = {}  # id(param) -> index in entries
        for slot in layout.slots:
            p = by_fqn[slot.fqn]
            self._entry_of[id(p)] = len(self.entries)
            params_in_order.append(p)
            self.entries.append(
                ParamEntry(slot.fqn, slot.chunk, slot.offset // elem, p.numel(), p.shape)
            )
        self._chunk_entries: list[list[int]] = [[] for _ in range(self.n_chunks)]
        for i, e in enumerate(self.entries):
            self._chunk_entries[e.chunk].append(i)
        self._chunk_numel = []
        for c in range(self.n_chunks):
            end = max(
                self.entries[i].offset + self.entries[i].numel for i in self._chunk_entries[c]
            )
            self._chunk_numel.append((end + align_elems - 1) // align_elems * align_elems)
        # elements of a chunk of the layout's size (what its device buffers hold)
        self.chunk_capacity = (layout.chunk_size // elem + align_elems - 1) // align_elems
        self.chunk_capacity *= align_elems

        self.is_cuda = self.device.type == "cuda"
        self.master: dict[int, torch.Tensor] = {}
        self.transfer: dict[int, torch.Tensor] = {}
        self.grad: dict[int, torch.Tensor] = {}  # host accumulators, from a chunk's first gradient
        self._grad_alias: dict[int, torch.Tensor] = {}  # entry -> its param.grad (a view of it)
        self._grad_plain: dict[int, torch.Tensor] = {}  # entry -> the same view as a plain tensor
        self._grad_scale = PendingScales()  # entry -> a multiply pending (grad_scale.py)
        # entry -> the parameter's version when protrain last read it
        self._synced: dict[int, int] = {}
        # entry -> the storage of the view protrain gave the parameter, and, after ``p.data = t``
        # while a tensor sharing the old view was held, (that storage, its values) (chunk_transfers)
        self._installed: dict[int, torch.UntypedStorage] = {}
        self._held_aside: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self._has_grad: set[int] = set()  # sharded stores: entries whose gradient is present
        self._params = [weakref.ref(p) for p in params_in_order]
        try:
            self._take_values(params_in_order, host_values if host_values is not None else {})
        except BaseException:
            self._give_values_back(params_in_order, host_values)
            raise
        self.buffers = self.grad_buffers = None  # a store whose buffers failed stays listed
        for p in params_in_order:
            _PARAM_STORE[p] = self
        _STORES[self.id] = self
        WORKER.attach(self)
        weakref.finalize(params_in_order[0], _forget_store, self.id)

        self.make_buffers()
        self.streams = streams_of(self.device)
        self._staging: GradStaging | None = None
        self._oversized: dict[tuple, GradStaging] = {}  # (numel, dtype) -> its staging
        self.as_is_grad_elem: dict[int, int] = {}  # chunk -> its gradient's bytes/element, profiled
        self.row_grad_chunks: set[int] = set()  # chunks whose gradient came as rows, profiled
        # offloaded chunks whose Adam step runs on the compute device (device_steps.assign)
        self.device_step_chunks: set[int] = set()
        self.device_step_share = 0.0
        # the HybridOptimizer that steps the offloaded chunks (protrain_fx/runtime/hybrid_optim.py)
        self.optimizer = None
        # set while the profiler runs a step (protrain_fx/profiling/profiler.py): chunk copies go on
        # the compute stream between copy marks (block times exclude them); gradients are dropped
        self.profiling = False
        self._stats = dict.fromkeys(
            ("d2h_copies", "d2h_bytes", "resident_all_reduces", "transfer_refreshes"), 0
        )
        self._stats.update(grad_norms_served=0, grad_adds_on_device=0)  # grad_scale/grad_add.py
        # whether later gradients of a whole chunk are summed on the device, read once, as planned
        self.device_grad_add = grad_add.enabled()

    @property
    def stats(self) -> dict:
        """Copy counters: this store's gradient copies, and its chunk buffers' (shared with stores
        of the same chunk size) host-to-device copies and hits."""
        return {**self._stats, **(self.buffers.stats if self.buffers is not None else {})}

    def make_buffers(self) -> None:
        """The device buffers the offloaded chunks need (again after chunks were offloaded:
        protrain_fx/runtime/replacement.py)."""
        # device buffers hold a whole chunk of the layout's size (a larger, oversized one if the
        # store offloads one): stores of one chunk size share them (one store per region of a
        # model compiled in regions, protrain_fx/graph/regions.py)
        big = max((self._chunk_numel[c] for c in self.offloaded_chunks), default=0)
        big = max(big, self.chunk_capacity) if big else 0
        self.buffers = chunk_buffers(self.device, self.param_dtype, big) if big else None
        # gradients are packed into device buffers of that size too, except a chunk larger than
        # the layout's size (one parameter: a large vocabulary's embedding or head), whose
        # gradient goes to the host as it is (chunk_grads.grad_ready): no buffer of its size
        packed = [
            self._chunk_numel[c] for c in self.offloaded_chunks if not self.grad_goes_as_is(c)
        ]
        gbig = max(max(packed), self.chunk_capacity) if packed else 0
        self.grad_buffers = grad_buffers(self.device, self.master_dtype, gbig) if gbig else None

    # ------------------------------------------------------------------------------------ layout
    def chunk_numel(self, chunk: int) -> int:
        return self._chunk_numel[chunk]

    def _take_values(self, params_in_order: list, host_values: dict, chunks=None) -> None:
        """Fill the chunks (``chunks``, or all), one at a time, from ``host_values`` (id(param) ->
        its value on the host, for parameters built under host_init or handed back by
        dissolve_store) or else the parameter itself. Each value is dropped from ``host_values``
        once its chunk holds it, so the old copies are freed while the new ones are made: the host
        holds the values and the store together only one chunk at a time."""
        pin = self.is_cuda
        for c in range(self.n_chunks) if chunks is None else chunks:
            members = [params_in_order[i] for i in self._chunk_entries[c]]
            if c < self.n_persist:  # resident: the parameter is the device tensor
                for p in members:
                    if id(p) in host_values:
                        p.data = host_values.pop(id(p)).to(self.device, copy=True)
                continue
            master = self.state_empty(c, self.master_dtype).zero_()
            for i in self._chunk_entries[c]:
                part = self.host_slices(i)
                if part is not None:
                    p = params_in_order[i]
                    master[part[0]].copy_(host_values.get(id(p), p.data).reshape(-1)[part[1]])
            self.master[c] = master
            # else cast on its way into the chunk buffer (_fill)
            if (
                self.param_dtype == self.master_dtype
                or self.home_on_device(c)
                or not self.transfer_copies
            ):
                self.transfer[c] = master
            else:
                self.transfer[c] = pinned.host_empty(self.host_numel(c), self.param_dtype, pin)
                self.transfer[c].copy_(master)
            dropped_pinned = False
            for i in self._chunk_entries[c]:
                p = params_in_order[i]
                old = host_values.pop(id(p), None)
                dropped_pinned |= old is not None and old.is_pinned()
                del old
                if self.aliased:
                    e = self.entries[i]
                    self._install(i, p, mapped.device_view(master, e.offset, e.shape, self.device))
                else:
                    p.data = device_shell(p.shape, p.dtype, self.device)
            # a dissolved store's chunk: its pinned block goes back to the OS now
            if dropped_pinned:
                pinned.release_cached_pinned_memory()

    def forget_views(self) -> None:
        """Drop the storages of the views given to parameters (each keeps a master alive)."""
        self._installed.clear()
        self._held_aside.clear()

    def _give_values_back(self, params_in_order: list, host_values: dict | None) -> None:
        """A store that failed half-built: put the values of its finished offloaded chunks back into
        ``host_values`` (views of their masters), so the parameters keep their values. Resident ones
        already hold theirs. With several ranks a chunk keeps only this rank's shard: those values
        are lost."""
        if host_values is None or self.world.size > 1:
            return
        for c, master in self.master.items():
            for i in self._chunk_entries[c]:
                p, e = params_in_order[i], self.entries[i]
                host_values[id(p)] = master[e.offset : e.offset + e.numel].view(e.shape)

    def host_numel(self, chunk: int) -> int:
        """Elements of the chunk this rank keeps on the host (all of them with one rank)."""
        return self._chunk_numel[chunk] // self.world.size

    def host_range(self, chunk: int) -> tuple[int, int]:
        """This rank's shard of the chunk, in chunk elements."""
        n = self.host_numel(chunk)
        return self.world.rank * n, (self.world.rank + 1) * n

    def host_slices(self, index: int) -> tuple[slice, slice] | None:
        """Where store entry ``index`` meets this rank's shard: (slice of the host tensors, slice of
        the parameter's flat elements), or None when none of its elements are here."""
        e = self.entries[index]
        lo, hi = self.host_range(e.chunk)
        a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
        return None if a >= b else (slice(a - lo, b - lo), slice(a - e.offset, b - e.offset))

    def host_chunk(self, chunk: int, shard: torch.Tensor | None = None) -> torch.Tensor:
        """A whole offloaded chunk's host values: of its master copy, or of ``shard`` (another
        per-chunk host tensor, e.g. an Adam moment). The tensor itself with one rank, every rank's
        shard gathered with several (a collective: every rank calls it, in the same order)."""
        t = self.master[chunk] if shard is None else shard
        if not self.world.sharded:
            return t
        return distributed.gather_host(t, self.world.size, self.device)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [r() for r in self._params]

    def param(self, index: int) -> torch.nn.Parameter | None:
        return self._params[index]()

    def chunk_entries(self, chunk: int) -> list[tuple[torch.nn.Parameter, ParamEntry]]:
        return [(self._params[i](), self.entries[i]) for i in self._chunk_entries[chunk]]

    def chunk_entry_indices(self, chunk: int) -> list[int]:
        return self._chunk_entries[chunk]

    def entry(self, param: torch.Tensor) -> ParamEntry:
        return self.entries[self._entry_of[id(param)]]

    def entry_index(self, param: torch.Tensor) -> int:
        return self._entry_of[id(param)]

    def is_offloaded(self, chunk: int) -> bool:
        return chunk >= self.n_persist

    def home_on_device(self, chunk: int) -> bool:
        """An offloaded chunk whose shards stay in device memory (see the module docstring)."""
        return self.n_persist <= chunk < self.n_persist + self.n_shard

    def state_empty(self, chunk: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        """This rank's share of an offloaded chunk (master, gradient, moment), uninitialized: in
        host memory, pinned with ``pin`` on CUDA, or on the device for a chunk sharded there."""
        if self.home_on_device(chunk):
            return torch.empty(self.host_numel(chunk), dtype=dtype, device=self.device)
        return pinned.host_empty(self.host_numel(chunk), dtype, self.is_cuda and pin)

    @property
    def offloaded_chunks(self) -> list[int]:
        return list(range(self.n_persist, self.n_chunks))

    def param_is_offloaded(self, param: torch.Tensor) -> bool:
        return self.is_offloaded(self.entry(param).chunk)

    # ------------------------------------------------------------------------------- values
    def read(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's current value as a plain tensor (host copy for offloaded parameters; with
        several ranks a collective, see :meth:`host_chunk`)."""
        if not self.param_is_offloaded(param):
            return param.detach()
        e = self.entry(param)
        WORKER.wait_chunk((self.id, e.chunk))
        self.sync_writes(e.chunk)
        return self.host_chunk(e.chunk)[e.offset : e.offset + e.numel].view(e.shape).clone()

    def write(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set an offloaded parameter's value (load_state_dict)."""
        e = self.entry(param)
        WORKER.wait_chunk((self.id, e.chunk))
        if tuple(value.shape) != tuple(e.shape):
            raise ProtrainError(
                f"{e.fqn}: shape {tuple(value.shape)} does not match the parameter {tuple(e.shape)}"
            )
        part = self.host_slices(self.entry_index(param))
        if part is not None:  # this rank's share of it
            with torch.no_grad():
                self.master[e.chunk][part[0]].copy_(value.reshape(-1)[part[1]])
        self.refresh_transfer(e.chunk)

    def refresh_transfer(self, chunk: int) -> None:
        """After the master changed: rewrite the transfer-dtype copy and forget device copies of
        the chunk."""
        if self.transfer[chunk] is not self.master[chunk]:
            self.wait_copies(chunk)
            self.transfer[chunk].copy_(self.master[chunk])
        self.invalidate(chunk)

    def written_since(self, index: int, version: int) -> bool:
        p = self._params[index]()
        return p is not None and p._version != version

    def param_version(self, index: int) -> int:
        p = self._params[index]()
        return -1 if p is None else p._version

    def unregister(self) -> None:
        """Forget this store (its parameters then belong to none; param_values.dissolve_store)."""
        for p in self.params:
            if p is not None:
                _PARAM_STORE.pop(p, None)
        _forget_store(self.id)

    def live_optimizer(self):
        """The HybridOptimizer stepping the offloaded chunks, or None; one whose optimizer the
        user dropped (collected) lets the store go first (``HybridOptimizer.orphan``)."""
        h = self.optimizer
        if h is not None and h._opt._ref() is None:
            h.orphan(self)
            h = None
        return h

    # ------------------------------------------------------------------------------ report
    @property
    def host_bytes(self) -> int:
        """Host bytes this store holds (masters, transfer copies, gradient accumulators,
        staging)."""
        host = [c for c in self.master if not self.home_on_device(c)]
        tensors = [self.master[c] for c in host] + [
            self.transfer[c] for c in host if self.transfer[c] is not self.master[c]
        ]
        tensors += [t for c, t in self.grad.items() if not self.home_on_device(c)] + (
            self._staging.free if self._staging is not None else []
        )
        tensors += [t for pool in self._oversized.values() for t in pool.free]
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self) -> str:
        off = self.offloaded_chunks
        dev = len(self.device_step_chunks)
        sharded = f", {self.n_shard} sharded on the devices" if self.n_shard else ""
        host = sum(self.host_numel(c) for c in off if not self.home_on_device(c))
        return (
            f"store {self.id}: {self.n_chunks} chunks, {self.n_persist} resident{sharded}, "
            f"{len(off) - self.n_shard} offloaded "
            f"({format_bytes(host * self.master_dtype.itemsize)} of "
            f"{str(self.master_dtype).replace('torch.', '')} master on the host"
            + (f"; {dev} of them stepped on the device, streamed)" if dev else ")")
        )


def _forget_store(store_id: int) -> None:
    """A store's model is gone (or it was dissolved): stop its worker use, free its host memory and
    the device buffers nobody else of that size uses."""
    store = _STORES.pop(store_id, None)
    if store is None:
        return
    WORKER.detach(store)
    # the compiled graph that dynamo keeps (until torch._dynamo.reset()) still refers to the store:
    # its host memory goes now, with the optimizer states it holds through its HybridOptimizer
    store.master.clear()
    store.transfer.clear()
    store.grad.clear()
    store.forget_views()
    store._grad_alias.clear()
    store._grad_plain.clear()
    store._staging, store._oversized, store.optimizer = None, {}, None
    if store.buffers is not None:
        store.buffers.forget_store(store_id)
    release_unused_buffers()
    if not _STORES:
        release_pieces()


def release_unused_buffers() -> None:
    """Free the device chunk and gradient buffers of sizes no live store uses any more."""
    live = set()
    for s in _STORES.values():
        for b, dtype in ((s.buffers, s.param_dtype), (s.grad_buffers, s.master_dtype)):
            live |= {(s.device, dtype, b.numel)} if b is not None else set()
    release_unused(live)
