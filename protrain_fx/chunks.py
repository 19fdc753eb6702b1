"""ChunkStore: the runtime owner of parameter values packed in chunks.

Resident chunks (the first ``n_persist`` in first-use order) keep their parameters as ordinary device
tensors: autograd fills ``param.grad`` and the user's optimizer steps them on the device. Offloaded chunks
keep, per chunk, an fp32 master copy in (pinned) host memory and a copy in the transfer dtype
(``param_dtype``; the master itself when that is fp32); their ``nn.Parameter`` objects become *shells*:
device tensors of the right shape whose storage is freed, so the graphs dynamo traced stay valid and no
retrace happens. Compiled graphs read offloaded chunks through ``protrain::gather``, which returns a view
of one of ``n_buffer`` reusable device chunk buffers ("slots"), filled ahead of use by
``protrain::prefetch`` on a host-to-device stream and handed back by ``protrain::release``. A slot keeps
its chunk's data after release until it is reused, so backward's first re-gathers (the chunks forward used
last) often need no copy. Gradients of offloaded chunks arrive flat through ``protrain::chunk_grad``; the
store copies them to the host on a device-to-host stream and hands them to the attached optimizer.

On a CPU compute device the same code runs with real copies and no streams.
"""
from __future__ import annotations

import itertools
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from . import block_timer, distributed, hardware
from ._weakmap import IdentityWeakMap
from .chunk_layout import ALIGN_BYTES, ChunkLayout
from .options import ProtrainError, format_bytes

N_GRAD_BUFFERS = 2  # device gradient buffers per store
# debugging aid: PROTRAIN_DEBUG_SYNC=1 synchronizes the device around every chunk operation (no overlap)
DEBUG_SYNC = os.environ.get("PROTRAIN_DEBUG_SYNC") == "1"
_STORES: dict[int, "ChunkStore"] = {}
_STORE_IDS = itertools.count()
# parameter -> its store (weak: a dead model takes its store with it)
_PARAM_STORE = IdentityWeakMap()


def get_store(store_id: int) -> "ChunkStore":
    try:
        return _STORES[store_id]
    except KeyError:
        raise ProtrainError(f"protrain chunk store {store_id} no longer exists (its model was freed)") from None


def store_of(param: torch.Tensor) -> "ChunkStore | None":
    return _PARAM_STORE.get(param)


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


class ChunkStore:
    """Parameter values of one set of parameters, chunked; see the module docstring."""

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        layout: ChunkLayout,
        n_persist: int,
        param_dtype: torch.dtype,
        host_values: dict | None = None,
    ):
        if not params:
            raise ProtrainError("a chunk store needs parameters")
        first = params[0][1]
        self.device = first.device
        self.master_dtype = first.dtype
        for fqn, p in params:
            if p.device != self.device or p.dtype != self.master_dtype:
                raise ProtrainError(
                    f"protrain-fx needs all parameters of a graph on one device in one dtype; {fqn!r} is "
                    f"{p.dtype} on {p.device}, {params[0][0]!r} is {self.master_dtype} on {self.device}"
                )
        if not self.master_dtype.is_floating_point:
            raise ProtrainError(f"parameters must be floating point, got {self.master_dtype}")
        self.id = next(_STORE_IDS)
        self.param_dtype = param_dtype
        self.layout = layout
        self.n_chunks = layout.n_chunks
        self.n_persist = min(n_persist, self.n_chunks)
        elem = first.element_size()
        # with several ranks each offloaded chunk is split in equal shards (distributed.py): pad to a multiple
        self.world = distributed.world()
        align_elems = max(1, ALIGN_BYTES // elem) * self.world.size
        by_fqn = dict(params)
        params_in_order: list[torch.nn.Parameter] = []
        self.entries: list[ParamEntry] = []
        self._entry_of: dict[int, int] = {}  # id(param) -> index in entries
        for slot in layout.slots:
            p = by_fqn[slot.fqn]
            self._entry_of[id(p)] = len(self.entries)
            params_in_order.append(p)
            self.entries.append(ParamEntry(slot.fqn, slot.chunk, slot.offset // elem, p.numel(), p.shape))
        self._chunk_entries: list[list[int]] = [[] for _ in range(self.n_chunks)]
        for i, e in enumerate(self.entries):
            self._chunk_entries[e.chunk].append(i)
        self._chunk_numel = []
        for c in range(self.n_chunks):
            end = max(self.entries[i].offset + self.entries[i].numel for i in self._chunk_entries[c])
            self._chunk_numel.append((end + align_elems - 1) // align_elems * align_elems)

        self.is_cuda = self.device.type == "cuda"
        self.master: dict[int, torch.Tensor] = {}
        self.transfer: dict[int, torch.Tensor] = {}
        try:
            self._take_values(params_in_order, host_values if host_values is not None else {})
        except BaseException:
            self._give_values_back(params_in_order, host_values)
            raise
        # weak references: the store lives as long as its model does
        self._params = [weakref.ref(p) for p in params_in_order]
        for p in params_in_order:
            _PARAM_STORE[p] = self
        _STORES[self.id] = self
        weakref.finalize(params_in_order[0], _STORES.pop, self.id, None)

        # device chunk buffers ("slots"), allocated when the first graph that needs them is compiled
        self.n_buffer = 0
        self.slots: list[torch.Tensor] = []
        self._slot_chunk: list[int | None] = []  # whose data the slot holds
        self._slot_busy: list[bool] = []  # between prefetch/gather and release
        self._slot_free_event: list = []  # compute-stream event recorded at release
        self._slot_ready_event: list = []  # h2d-stream event recorded after the copy
        self._released_order: list[int] = []  # released slots, least recently released first
        self._chunk_slot: dict[int, int] = {}
        self.h2d_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.d2h_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.optimizer = None  # the HybridOptimizer that owns the offloaded chunks' optimizer state
        # device gradient buffers (allocated at the first backward), reused in rotation once copied out
        self._grad_bufs: list[torch.Tensor] = []
        self._grad_shards: list[torch.Tensor] = []
        self._grad_buf_done: list = []
        self._next_grad_buf = 0
        # set while the profiler runs a step (protrain_fx/profiler.py): chunk copies go on the compute stream
        # between copy marks (so block times exclude them) and gradients are dropped, not stepped
        self.profiling = False
        self.stats = {"h2d_copies": 0, "h2d_bytes": 0, "slot_hits": 0, "unprefetched_gathers": 0,
                      "d2h_copies": 0, "d2h_bytes": 0, "resident_all_reduces": 0}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ layout
    def chunk_numel(self, chunk: int) -> int:
        return self._chunk_numel[chunk]

    def _take_values(self, params_in_order: list, host_values: dict) -> None:
        """Fill the chunks, one at a time, from ``host_values`` (id(param) -> its value on the host, for
        parameters built under host_init or handed back by dissolve_store) or else the parameter itself.
        Each value is dropped from ``host_values`` once its chunk holds it, so the old copies are freed while
        the new ones are made: the host holds the values and the store together only one chunk at a time."""
        pin = self.is_cuda
        for c in range(self.n_chunks):
            members = [params_in_order[i] for i in self._chunk_entries[c]]
            if c < self.n_persist:  # resident: the parameter is the device tensor
                for p in members:
                    if id(p) in host_values:
                        p.data = host_values.pop(id(p)).to(self.device)
                continue
            master = hardware.host_empty(self.host_numel(c), self.master_dtype, pin)
            master.zero_()
            for i in self._chunk_entries[c]:
                part = self.host_slices(i)
                if part is not None:
                    p = params_in_order[i]
                    master[part[0]].copy_(host_values.get(id(p), p.data).reshape(-1)[part[1]])
            self.master[c] = master
            if self.param_dtype == self.master_dtype:
                self.transfer[c] = master
            else:
                self.transfer[c] = hardware.host_empty(self.host_numel(c), self.param_dtype, pin)
                self.transfer[c].copy_(master)
            dropped_pinned = False
            for p in members:
                old = host_values.pop(id(p), None)
                dropped_pinned |= old is not None and old.is_pinned()
                del old
                p.data = device_shell(p.shape, p.dtype, self.device)
            if dropped_pinned:  # a dissolved store's chunk: its pinned block goes back to the OS now
                hardware.release_cached_pinned_memory()

    def _give_values_back(self, params_in_order: list, host_values: dict | None) -> None:
        """A store that failed half-built: put the values of its finished offloaded chunks back into
        ``host_values`` (views of their masters), so the parameters keep their values. Resident ones already
        hold theirs. With several ranks a chunk keeps only this rank's shard: those values are lost."""
        if host_values is None or self.world.size > 1:
            return
        for c, master in self.master.items():
            for i in self._chunk_entries[c]:
                p, e = params_in_order[i], self.entries[i]
                host_values[id(p)] = master[e.offset:e.offset + e.numel].view(e.shape)

    def host_numel(self, chunk: int) -> int:
        """Elements of the chunk this rank keeps on the host (all of them with one rank)."""
        return self._chunk_numel[chunk] // self.world.size

    def host_range(self, chunk: int) -> tuple[int, int]:
        """This rank's shard of the chunk, in chunk elements."""
        n = self.host_numel(chunk)
        return self.world.rank * n, (self.world.rank + 1) * n

    def host_slices(self, index: int) -> tuple[slice, slice] | None:
        """Where store entry ``index`` meets this rank's shard: (slice of the host tensors, slice of the
        parameter's flat elements), or None when none of its elements are here."""
        e = self.entries[index]
        lo, hi = self.host_range(e.chunk)
        a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
        return None if a >= b else (slice(a - lo, b - lo), slice(a - e.offset, b - e.offset))

    def host_chunk(self, chunk: int, shard: torch.Tensor | None = None) -> torch.Tensor:
        """A whole offloaded chunk's host values: of its master copy, or of ``shard`` (another per-chunk host
        tensor, e.g. an Adam moment). The tensor itself with one rank, every rank's shard gathered with
        several (a collective: every rank calls it, in the same order)."""
        t = self.master[chunk] if shard is None else shard
        if not self.world.sharded:
            return t
        return distributed.gather_host(t, self.world.size, self.device)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [r() for r in self._params]

    def chunk_entries(self, chunk: int) -> list[tuple[torch.nn.Parameter, ParamEntry]]:
        return [(self._params[i](), self.entries[i]) for i in self._chunk_entries[chunk]]

    def entry(self, param: torch.Tensor) -> ParamEntry:
        return self.entries[self._entry_of[id(param)]]

    def entry_index(self, param: torch.Tensor) -> int:
        return self._entry_of[id(param)]

    def is_offloaded(self, chunk: int) -> bool:
        return chunk >= self.n_persist

    @property
    def offloaded_chunks(self) -> list[int]:
        return list(range(self.n_persist, self.n_chunks))

    def param_is_offloaded(self, param: torch.Tensor) -> bool:
        return self.is_offloaded(self.entry(param).chunk)

    # ------------------------------------------------------------------------------- values
    def read(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's current value as a plain tensor (host copy for offloaded parameters; with several
        ranks a collective, see :meth:`host_chunk`)."""
        if not self.param_is_offloaded(param):
            return param.detach()
        if self.optimizer is not None:
            self.optimizer.wait()
        e = self.entry(param)
        return self.host_chunk(e.chunk)[e.offset:e.offset + e.numel].view(e.shape).clone()

    def write(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set an offloaded parameter's value (load_state_dict)."""
        if self.optimizer is not None:
            self.optimizer.wait()
        e = self.entry(param)
        if tuple(value.shape) != tuple(e.shape):
            raise ProtrainError(f"{e.fqn}: shape {tuple(value.shape)} does not match the parameter {tuple(e.shape)}")
        part = self.host_slices(self.entry_index(param))
        if part is not None:  # this rank's share of it
            with torch.no_grad():
                self.master[e.chunk][part[0]].copy_(value.reshape(-1)[part[1]])
                if self.transfer[e.chunk] is not self.master[e.chunk]:
                    self.transfer[e.chunk][part[0]].copy_(self.master[e.chunk][part[0]])
        self.invalidate()

    def refresh_transfer(self, chunk: int) -> None:
        """After the optimizer updated the master: rewrite the transfer-dtype copy."""
        if self.transfer[chunk] is not self.master[chunk]:
            self.transfer[chunk].copy_(self.master[chunk])

    # ------------------------------------------------------------------------------ buffers
    def ensure_buffers(self, n_buffer: int) -> None:
        """Have at least ``n_buffer`` device chunk buffers (called when a graph is compiled)."""
        size = max((self._chunk_numel[c] for c in self.offloaded_chunks), default=0)
        while len(self.slots) < n_buffer:
            self.slots.append(torch.empty(size, dtype=self.param_dtype, device=self.device))
            self._slot_chunk.append(None)
            self._slot_busy.append(False)
            self._slot_free_event.append(None)
            self._slot_ready_event.append(None)
        self.n_buffer = len(self.slots)

    def invalidate(self) -> None:
        """Forget which chunks the buffers hold (their host values changed)."""
        for s in range(len(self.slots)):
            if not self._slot_busy[s]:
                self._slot_chunk[s] = None
        self._chunk_slot = {c: s for c, s in self._chunk_slot.items() if self._slot_busy[s]}

    def _free_slot(self, chunk: int) -> int:
        candidates = [s for s in range(len(self.slots)) if not self._slot_busy[s]]
        if not candidates:
            busy = [self._slot_chunk[s] for s in range(len(self.slots))]
            raise ProtrainError(
                f"protrain: no free device chunk buffer for chunk {chunk} (all {len(self.slots)} hold chunks "
                f"{busy} in use); the plan's n_buffer is too small for this graph's schedule"
            )
        empty = [s for s in candidates if self._slot_chunk[s] is None]
        if empty:
            return empty[0]
        order = {s: i for i, s in enumerate(self._released_order)}
        return min(candidates, key=lambda s: order.get(s, -1))

    def prefetch(self, chunk: int) -> None:
        """Start copying ``chunk`` into a free buffer (no-op when a buffer still holds it)."""
        if not self.is_offloaded(chunk):
            return
        if DEBUG_SYNC and self.is_cuda:
            torch.cuda.synchronize()
        if self.optimizer is not None:  # the chunk's CPU step may still be running after opt.step()
            self.optimizer.wait_chunk(self.id, chunk)
        with self._lock:
            s = self._chunk_slot.get(chunk)
            if s is not None and self._slot_chunk[s] == chunk:
                if not self._slot_busy[s]:
                    self.stats["slot_hits"] += 1
                self._slot_busy[s] = True
                self._drop_released(s)
                return
            if not self.slots:
                raise ProtrainError("protrain: chunk buffers were never allocated for this store")
            s = self._free_slot(chunk)
            old = self._slot_chunk[s]
            if old is not None:
                self._chunk_slot.pop(old, None)
            self._drop_released(s)
            n = self._chunk_numel[chunk]
            dst, src = self.slots[s][:n], self.transfer[chunk]
            if self.profiling:
                block_timer.RECORDER.record(block_timer.STEP, block_timer.COPY_START, self.device)
                self._fill(chunk, dst, src)
                block_timer.RECORDER.record(block_timer.STEP, block_timer.COPY_END, self.device)
                self._slot_ready_event[s] = None
            elif self.is_cuda:
                with torch.cuda.stream(self.h2d_stream):
                    if self._slot_free_event[s] is not None:
                        self.h2d_stream.wait_event(self._slot_free_event[s])
                    self._fill(chunk, dst, src)
                    ev = torch.cuda.Event()
                    ev.record(self.h2d_stream)
                self._slot_ready_event[s] = ev
            else:
                self._fill(chunk, dst, src)
            self.stats["h2d_copies"] += 1
            self.stats["h2d_bytes"] += src.numel() * src.element_size()
            self._slot_chunk[s] = chunk
            self._slot_busy[s] = True
            self._chunk_slot[chunk] = s

    def _fill(self, chunk: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the host values into the device buffer: the whole chunk, or with several ranks this rank's
        shard into its place and an all-gather of the others (on the current stream)."""
        if not self.world.sharded:
            dst.copy_(src, non_blocking=True)
            return
        lo, hi = self.host_range(chunk)
        dst[lo:hi].copy_(src, non_blocking=True)
        distributed.all_gather_into(dst, dst[lo:hi])

    def _drop_released(self, s: int) -> None:
        if s in self._released_order:
            self._released_order.remove(s)

    def gather(self, chunk: int) -> torch.Tensor:
        """The chunk's parameters on the compute device (flat, transfer dtype)."""
        s = self._chunk_slot.get(chunk)
        if s is None or self._slot_chunk[s] != chunk or not self._slot_busy[s]:
            if s is None or self._slot_chunk[s] != chunk:
                self.stats["unprefetched_gathers"] += 1
            self.prefetch(chunk)
            s = self._chunk_slot[chunk]
        if self.is_cuda and self._slot_ready_event[s] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._slot_ready_event[s])
        if DEBUG_SYNC and self.is_cuda:
            torch.cuda.synchronize()
        return self.slots[s][: self._chunk_numel[chunk]]

    def release(self, chunk: int) -> None:
        """The chunk's buffer may be refilled once the compute queued so far has run."""
        if DEBUG_SYNC and self.is_cuda:
            torch.cuda.synchronize()
        with self._lock:
            s = self._chunk_slot.get(chunk)
            if s is None or not self._slot_busy[s]:
                return
            self._slot_busy[s] = False
            if self.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self._slot_free_event[s] = ev
            self._released_order.append(s)

    # -------------------------------------------------------------------------------- grads
    def grad_ready(self, chunk: int, grads: list[torch.Tensor], members: list[int]) -> None:
        """Pack the chunk's parameter gradients (store entries ``members``) into a device gradient buffer in
        the chunk layout and master dtype (fp32: the host adds nothing but the optimizer step), and hand it
        to the optimizer, which copies it to the host. While profiling, gradients are dropped."""
        if self.profiling:
            return
        if self.optimizer is None:
            raise ProtrainError(
                "protrain: a backward pass produced gradients for offloaded parameters, but no optimizer was "
                "given: pass options={'optimizer': opt} to torch.compile so protrain can step them"
            )
        n = self._chunk_numel[chunk]
        if not self._grad_bufs:
            size = max(self._chunk_numel[c] for c in self.offloaded_chunks)
            with torch.no_grad():  # in the master dtype: copied straight into the host accumulator
                self._grad_bufs = [torch.empty(size, dtype=self.master_dtype, device=self.device)
                                   for _ in range(N_GRAD_BUFFERS)]
                # with several ranks: this rank's shard of the mean gradient, which goes to the host
                self._grad_shards = [torch.empty(size // self.world.size, dtype=self.master_dtype, device=self.device)
                                     for _ in range(N_GRAD_BUFFERS)] if self.world.sharded else []
            self._grad_buf_done = [None] * N_GRAD_BUFFERS
        k = self._next_grad_buf
        self._next_grad_buf = (k + 1) % len(self._grad_bufs)
        buf = self._grad_bufs[k][:n]
        if self.is_cuda and self._grad_buf_done[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._grad_buf_done[k])  # its last copy is done
        with torch.no_grad():
            if len(members) < len(self._chunk_entries[chunk]):
                buf.zero_()  # parameters without a gradient here contribute zeros, not stale values
            views = [buf[e.offset:e.offset + e.numel].view(e.shape) for e in (self.entries[i] for i in members)]
            torch._foreach_copy_(views, [g.detach() for g in grads])
            if self.world.sharded:
                shard = self._grad_shards[k][:self.host_numel(chunk)]
                distributed.reduce_scatter_mean(shard, buf, self.world.size)
                buf = shard
        self._grad_buf_done[k] = self.optimizer.chunk_grad(self, chunk, buf, members)

    def resident_grads_ready(self, chunk: int, grads: list[torch.Tensor], members: list[int]) -> None:
        """Data parallel: start averaging a resident chunk's parameter gradients (store entries ``members``)
        over the ranks, in place: the graph still returns them to autograd, after waiting for the collective
        at its end (:func:`protrain_fx.distributed.start_resident_all_reduce`). While profiling, nothing."""
        if self.profiling:
            return
        distributed.start_resident_all_reduce([self._params[i]() for i in members], [g.detach() for g in grads])
        self.stats["resident_all_reduces"] += 1

    def copy_to_host(self, flat: torch.Tensor, dst: torch.Tensor):
        """Device-to-host copy of one of the store's device gradient buffers on the d2h stream; returns the
        event that marks it done (None on CPU, where the copy is synchronous)."""
        n = flat.numel()
        self.stats["d2h_copies"] += 1
        self.stats["d2h_bytes"] += n * flat.element_size()
        if not self.is_cuda:
            dst[:n].copy_(flat)
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            dst[:n].copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        return done

    def unregister(self) -> None:
        """Forget this store (its parameters then belong to none; protrain_fx.param_values.dissolve_store)."""
        for p in self.params:
            if p is not None:
                _PARAM_STORE.pop(p, None)
        _STORES.pop(self.id, None)

    # ------------------------------------------------------------------------------ report
    def describe(self) -> str:
        off = self.offloaded_chunks
        host = sum(self.host_numel(c) for c in off)
        return (f"store {self.id}: {self.n_chunks} chunks, {self.n_persist} resident, {len(off)} offloaded "
                f"({format_bytes(host * self.master_dtype.itemsize)} of fp32 master "
                f"on the host)")
