"""The gradient path of a chunk store: from a compiled backward to the host accumulator.

Gradients of an offloaded chunk arrive flat through ``protrain::chunk_grad`` (:meth:`grad_ready`):
packed into a device gradient buffer in the chunk layout and the master dtype, copied to the host on
the copy stream (:meth:`copy_to_host`; a chunk larger than the layout's size, one parameter, goes as
autograd made it, in its own dtype, copied on the compute stream: :meth:`grad_goes_as_is`):
straight into the chunk's accumulator while the chunk holds no gradient yet and the dtypes agree,
else added to on the device where the whole chunk has a gradient (runtime/grad_add.py), or copied
into a host staging buffer (:class:`GradStaging`) that the host worker adds (or copies, for a
parameter whose ``.grad`` is None) into the accumulator, upcasting there (exact). The parameters'
``.grad`` then is the accumulator's view on the compute device (:meth:`grad_alias`), exactly as
eager autograd would have left it; gradients that eager code put in ``.grad`` meanwhile are folded
into the accumulator first. A callback at the end of every backward waits for the worker, so after
``loss.backward()`` returns gradients are final, and checks that no parameter got gradients both
from a compiled graph and from code outside it. :class:`ChunkGrads` holds these as methods of
:class:`protrain_fx.runtime.chunk_store.ChunkStore`, which inherits it."""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch.autograd import Variable

from protrain_fx.errors import ProtrainError
from protrain_fx.machine import pinned
from protrain_fx.plan.profiles import N_OVERSIZED_STAGING
from protrain_fx.plan.profiles import STAGING as N_STAGING
from protrain_fx.runtime import distributed, grad_add, grad_scale, kept_grads, mapped, step_redo
from protrain_fx.runtime.param_hooks import only_accumulated, with_param_hooks
from protrain_fx.runtime.worker import WORKER

# the staging buffers, as many as the cost model prices: N_STAGING of packed gradients (master
# dtype); N_OVERSIZED_STAGING of an oversized chunk's (grad_goes_as_is), in its own dtype, per size:
# an untied embedding and head of one shape share them, so two (backward's end does not wait for the
# head's to be added)


# elements per slice when a lower-precision gradient is added into an fp32 one on the host
UPCAST_ADD_BLOCK = 1 << 22


def add_upcast(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` for flat tensors, exact like ``add_``, without its temporary: on the CPU,
    ``add_`` of a tensor of another dtype first makes a copy of all of it in ``dst``'s dtype (an
    oversized chunk's bf16 gradient added into its fp32 accumulator, the second micro-step on: 1.47
    GiB of pageable host memory for Llama-3.2-3B's embedding). Slice by slice, the copy is
    :data:`UPCAST_ADD_BLOCK` elements at most."""
    if src.dtype == dst.dtype:
        dst.add_(src)
        return
    for i in range(0, dst.numel(), UPCAST_ADD_BLOCK):
        dst[i : i + UPCAST_ADD_BLOCK].add_(src[i : i + UPCAST_ADD_BLOCK])


class GradStaging:
    """Host buffers a gradient waits in when it must be added to (not copied into) its
    accumulator, or upcast into it."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, count: int = N_STAGING):
        self.free = [pinned.host_empty(numel, dtype, pin) for _ in range(count)]
        self._cond = threading.Condition()

    def take(self) -> torch.Tensor:
        with self._cond:
            while not self.free:
                self._cond.wait()
            return self.free.pop()

    def give(self, buf: torch.Tensor) -> None:
        with self._cond:
            self.free.append(buf)
            self._cond.notify()


_STAGINGS: "weakref.WeakValueDictionary[tuple, GradStaging]" = weakref.WeakValueDictionary()


def shared_staging(
    numel: int, dtype: torch.dtype, pin: bool, count: int = N_STAGING
) -> GradStaging:
    """The staging buffers of that size, shared by every store that stages gradients of it (a model
    compiled in regions has a store per block: one set of buffers, not one per store); freed with
    the last store that uses them."""
    key = (numel, dtype, pin, count)
    staging = _STAGINGS.get(key)
    if staging is None:
        staging = _STAGINGS[key] = GradStaging(numel, dtype, pin, count)
    return staging


def _compute_event(device: torch.device):
    """An event at the current point of the compute stream (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class _Backward:
    """What the running backward handed to the host, waited for at its end; per autograd graph
    task (one that raised, in a user's hook too, never runs its callback: one flag stayed set)."""

    tasks: set = set()  # graph tasks whose callback is queued
    touched: dict = {}  # (store id, entry) -> gradient version when protrain set it


def forget_end_of_backward() -> None:
    """A backward that raised: its callback never runs."""
    _Backward.tasks.discard(torch._C._current_graph_task_id())


def _end_of_backward(task: int) -> None:
    from protrain_fx.runtime.chunk_store import _STORES

    _Backward.tasks.discard(task)
    touched, _Backward.touched = _Backward.touched, {}
    WORKER.wait()
    stores = list(_STORES.values())
    for opt in {id(h): h for h in (s.live_optimizer() for s in stores)}.values():
        if opt is not None:
            opt.backward_ended()
    for (store_id, i), version in touched.items():
        store = _STORES.get(store_id)
        if store is None:
            continue
        p = store._params[i]()
        if (
            p is not None
            and p.grad is store._grad_alias.get(i)
            and store._grad_plain[i]._version != version
        ):
            raise ProtrainError(
                f"protrain: parameter {store.entries[i].fqn!r} received gradients both from a "
                "protrain-compiled graph and from code outside it in the same backward pass, which "
                "protrain cannot order; compile the code that uses it with backend='protrain' too"
            )


def queue_end_of_backward() -> None:
    task = torch._C._current_graph_task_id()
    if task in _Backward.tasks or step_redo.enclosed():  # (the user's backward has it queued)
        return
    try:
        Variable._execution_engine.queue_callback(functools.partial(_end_of_backward, task))
        _Backward.tasks.add(task)
    except RuntimeError:  # not inside a backward pass (a graph run by hand): finish now
        WORKER.wait()


class ChunkGrads:
    """The gradient methods of :class:`protrain_fx.runtime.chunk_store.ChunkStore` (which inherits
    them); see the module docstring."""

    def has_grad(self, index: int) -> bool:
        """Whether the parameter's gradient is present (``.grad`` not None), as eager autograd sees
        it."""
        if not self.aliased:
            return index in self._has_grad
        p = self._params[index]()
        return p is not None and p.grad is not None

    def grad_alias(self, index: int) -> torch.Tensor:
        """``param.grad`` of an offloaded parameter: a view of its chunk's accumulator on the
        compute device."""
        g = self._grad_alias.get(index)
        if g is None:
            e = self.entries[index]
            view = mapped.device_view(self.ensure_grad(e.chunk), e.offset, e.shape, self.device)
            g = self._grad_alias[index] = mapped.host_grad(view)
            g._protrain_owner = (self.id, index)
            grad_scale.install()
            # shares its version counter, read without the subclass's dispatch
            self._grad_plain[index] = view
        return g

    def ensure_grad(self, chunk: int) -> torch.Tensor:
        acc = self.grad.get(chunk)
        if acc is None:
            acc = self.grad[chunk] = self.state_empty(chunk, self.master_dtype).zero_()
        return acc

    def fold_foreign_grads(self, chunk: int) -> None:
        """Gradients that eager autograd put into ``.grad`` of the chunk's parameters (a graph
        dynamo ran eagerly, code outside the compiled region) go into the accumulator, and ``.grad``
        becomes its view."""
        if not self.aliased:
            return
        for i in self._chunk_entries[chunk]:
            p = self._params[i]()
            if p is None or p.grad is None or p.grad is self._grad_alias.get(i):
                continue
            foreign = p.grad
            WORKER.wait_chunk((self.id, chunk))
            self.settle_grad_scale([i], drop=True)
            kept_grads.move_out(self, i)
            e = self.entries[i]
            with torch.no_grad():
                self.ensure_grad(chunk)[e.offset : e.offset + e.numel].copy_(
                    foreign.detach().reshape(-1)
                )
            p.grad = self.grad_alias(i)

    def foreign_grads(self) -> bool:
        return any(
            self._params[i]() is not None
            and self._params[i]().grad is not None
            and self._params[i]().grad is not self._grad_alias.get(i)
            for c in self.offloaded_chunks
            for i in self._chunk_entries[c]
        )

    def clear_grads(self, chunk: int) -> None:
        """Sharded stores: ``opt.zero_grad()`` (aliased stores see ``.grad = None`` instead)."""
        for i in self._chunk_entries[chunk]:
            self._has_grad.discard(i)

    def grad_goes_as_is(self, chunk: int) -> bool:
        """A chunk larger than the layout's chunk size holds one parameter (a large vocabulary's
        embedding or head, protrain_fx/plan/layout.py): its gradient goes to the host as autograd
        made it, copied on the compute stream (the kernels after it cannot reuse its memory before
        the copy is done), instead of through a device gradient buffer of its size (two of them
        would be twice the table on the device). With several ranks it is packed like any chunk
        (the reduce-scatter takes the flat chunk)."""
        return (
            not self.world.sharded
            and self._chunk_numel[chunk] > self.chunk_capacity
            and len(self._chunk_entries[chunk]) == 1
        )

    def oversized_grad_elems(self) -> dict[str, int]:
        """Parameter -> bytes per element of the gradient its oversized offloaded chunk sent while
        profiling (what its host staging holds; 0: none came, an embedding's rows only)."""
        return {
            self.entries[self._chunk_entries[c][0]].fqn: self.as_is_grad_elem.get(c, 0)
            for c in self.offloaded_chunks
            if self.grad_goes_as_is(c)
        }

    def row_tables(self, tied: bool = False) -> dict[str, int]:
        """Parameter -> bytes of its table in the master dtype, for each oversized offloaded chunk
        whose gradient came while profiling as a dense part (a tied head's) and then the lookup's
        rows (passes/sparse_embedding_grads.py): were the chunk resident, backward would build the
        table's dense gradient on the device while the parameter's gradient holds the head's part,
        one table more at the end of backward than the profiled step had (the cost model's
        ``ChunkProfile.table_grad_bytes``). ``tied=False``: every chunk whose gradient came as rows
        (beside a gradient kept from the last backward, any resident table is built as one more:
        ``ChunkProfile.row_table_bytes``)."""
        return {
            self.entries[self._chunk_entries[c][0]].fqn: self._chunk_numel[c]
            * self.master_dtype.itemsize
            for c in self.offloaded_chunks
            if c in self.row_grad_chunks
            and (self.as_is_grad_elem.get(c, 0) or not tied)
            and self.grad_goes_as_is(c)
        }

    def grad_ready(
        self,
        chunk: int,
        grads: list[torch.Tensor],
        members: list[int],
        rows: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
        reduced: torch.Tensor | None = None,
    ) -> None:
        """A backward pass produced the gradients of the chunk's parameters ``members`` (store
        entries), or for a chunk sharded on the devices ``reduced``, this rank's shard of
        their packed sum over the ranks (reduce-scattered by the graph:
        passes/optimizer_calls.py): pack them into a device gradient buffer in the chunk
        layout and master dtype, copy it to the host and add it to (or, for parameters
        without a gradient yet, copy it into) the accumulator on the host worker. With
        ``rows`` the chunk's one parameter is an embedding table whose gradient is ``grads``
        (a dense part, or none) plus ``rows[k]`` in its row ``indices[k]``
        (passes/sparse_embedding_grads.py): the rows go to the host and are added there
        (:meth:`_rows_to_host`). While profiling, gradients are dropped (an oversized one's
        dtype noted first: what its staging will hold, profiling/frugal.py)."""
        if self.profiling:
            if grads and self.grad_goes_as_is(chunk):
                self.as_is_grad_elem[chunk] = grads[0].element_size()
            if rows is not None:
                self.row_grad_chunks.add(chunk)
            return
        if self.aliased and (grads or rows is not None):  # backward(inputs=...), autograd.grad
            members, grads = only_accumulated(self, members, grads, rows is not None)
            if not members:
                return
        record = step_redo.first_time((self.id, chunk, tuple(members)))
        if record is None:  # a redone backward: handed over before it ran out
            return
        if grads and self.aliased:  # the parameters' own gradient hooks (runtime/param_hooks.py)
            grads = with_param_hooks([self._params[i]() for i in members], grads)
        self.forget_grad_norms(self._chunk_entries[chunk])
        if self.live_optimizer() is not None:
            # takes back a step of this chunk not yet committed
            self.optimizer.before_chunk_grad(self, chunk)
        self.fold_foreign_grads(chunk)
        # a multiply still pending: applied before the gradient is added to, dropped if replaced
        for i in self._chunk_entries[chunk]:
            if i in self._grad_scale:
                WORKER.wait_chunk((self.id, chunk))
                self.settle_grad_scale([i], drop=not self.has_grad(i))
            if not self.has_grad(i):  # a new gradient: tensors kept of the old one keep its
                kept_grads.move_out(self, i)  # values (runtime/kept_grads.py)
                self._grad_scale.aliased.discard(i)
        fresh = [not self.has_grad(i) for i in members]
        all_entries = self._chunk_entries[chunk]
        others_absent = all(not self.has_grad(i) for i in all_entries if i not in members)
        if reduced is not None:  # already this rank's shard of the sum: the mean, added in place
            with torch.no_grad():
                shard = reduced.detach() / self.world.size
            parts = [(self.host_slices(i), f) for i, f in zip(members, fresh)]
            self._accumulate(self.ensure_grad(chunk), shard, parts)
        elif grads:
            self._dense_to_host(chunk, grads, members, fresh, others_absent)
        if rows is not None:
            self._rows_to_host(chunk, members[0], rows, indices, fresh[0] and not grads)
        for i in members:
            if self.aliased:
                p = self._params[i]()
                if p is not None:
                    p.grad = self.grad_alias(i)
                    _Backward.touched[(self.id, i)] = self._grad_plain[i]._version
            else:
                self._has_grad.add(i)
        if self.optimizer is not None:
            self.optimizer.after_chunk_grad(self, chunk, members)
        step_redo.handed_over(record)
        queue_end_of_backward()

    def pack_grads(self, chunk: int, grads: list[torch.Tensor], members: list[int]) -> torch.Tensor:
        """The gradients of the chunk's parameters ``members`` in the chunk layout and master dtype
        (zeros elsewhere), a new tensor of the padded chunk's size: what a graph reduce-scatters
        for a chunk sharded on the devices (passes/optimizer_calls.py)."""
        out = torch.zeros(self._chunk_numel[chunk], dtype=self.master_dtype, device=self.device)
        self._pack_into(out, grads, members)
        return out

    def _pack_into(self, buf: torch.Tensor, grads: list[torch.Tensor], members: list[int]) -> None:
        """Copy the gradients of the store entries ``members`` into their places in the flat
        chunk-layout ``buf``."""
        with torch.no_grad():
            views = [
                buf[e.offset : e.offset + e.numel].view(e.shape)
                for e in (self.entries[i] for i in members)
            ]
            torch._foreach_copy_(views, [g.detach() for g in grads])

    def _dense_to_host(self, chunk, grads, members, fresh, others_absent) -> None:
        n = self._chunk_numel[chunk]
        as_is = self.grad_goes_as_is(chunk)
        all_entries = self._chunk_entries[chunk]
        if as_is:  # one parameter: its gradient is the flat chunk, in its own dtype (the host
            # upcasts it: no master-dtype table of the vocabulary's size on the device)
            k, buf = None, grads[0].detach().contiguous().reshape(-1)
        else:
            k, buf = self.grad_buffers.take()
            buf = buf[:n]
        with torch.no_grad():
            if not as_is and len(members) < len(all_entries):
                buf.zero_()  # parameters without a gradient here contribute zeros, not stale values
            if not as_is:
                self._pack_into(buf, grads, members)
            if self.world.sharded:
                shard = torch.empty(self.host_numel(chunk), dtype=buf.dtype, device=buf.device)
                distributed.reduce_scatter_mean(shard, buf, self.world.size)
                buf = shard
        acc = self.ensure_grad(chunk)
        if self.home_on_device(chunk):  # a shard kept on the device: added there, in order
            self._accumulate(acc, buf, [(self.host_slices(i), f) for i, f in zip(members, fresh)])
            if k is not None:
                self.grad_buffers.copied(k, _compute_event(self.device))
            return
        direct = all(fresh) and others_absent and buf.dtype == acc.dtype
        WORKER.wait_chunk((self.id, chunk)) if not direct else None
        pool = None
        if not direct and grad_add.wanted(self, as_is, fresh, members, chunk):
            event = grad_add.add_on_device(self, chunk, buf, acc, members)
            self.grad_buffers.copied(k, event)
            if event is not None:
                WORKER.submit((self.id, chunk), event.synchronize)
            return
        if direct:  # straight into the accumulator (clipping's norms from here: grad_scale.py)
            dst = acc
            self.note_grad_norms(chunk, buf, members)
        else:
            pool = self._oversized_staging(n, buf.dtype) if as_is else self._packed_staging()
            dst = pool.take()
        event = self.copy_to_host(buf, dst, on_compute_stream=as_is)
        if k is not None:
            self.grad_buffers.copied(k, event)
        if not direct:
            parts = [(self.host_slices(i), f) for i, f in zip(members, fresh)]
            WORKER.submit((self.id, chunk), self._accumulate, acc, dst, parts, event, pool)
        elif event is not None:
            WORKER.submit((self.id, chunk), event.synchronize)

    def _packed_staging(self) -> GradStaging:
        """The staging of packed gradients (master dtype), of the largest packed chunk's size."""
        if self._staging is None:
            packed = [
                self.host_numel(c) for c in self.offloaded_chunks if not self.grad_goes_as_is(c)
            ]
            self._staging = shared_staging(
                max(packed + [self.chunk_capacity // self.world.size]),
                self.master_dtype,
                self.is_cuda,
            )
        return self._staging

    def _oversized_staging(self, numel: int, dtype: torch.dtype) -> GradStaging:
        """The staging of an oversized chunk's gradient, in the dtype autograd made it."""
        key = (numel, dtype)
        pool = self._oversized.get(key)
        if pool is None:
            pool = self._oversized[key] = shared_staging(
                numel, dtype, self.is_cuda, N_OVERSIZED_STAGING
            )
        return pool

    def _rows_to_host(self, chunk: int, entry: int, rows, indices, fresh: bool) -> None:
        """An embedding's gradient as its lookup's rows (tokens x hidden) and token ids: copied to
        the host (on the compute stream: the compiled graph owns them and may reuse them after
        this call) and added there, on the host worker after whatever the chunk's gradient had,
        into the parameter's gradient row by row (``index_add_``). The table of the vocabulary's
        size never exists on the device."""
        e = self.entries[entry]
        rows = rows.detach().reshape(-1, rows.shape[-1]).to(self.master_dtype)
        ids = indices.detach().reshape(-1)
        self._stats["d2h_copies"] += 1
        self._stats["d2h_bytes"] += rows.numel() * rows.element_size() + ids.numel() * 8
        if self.is_cuda:
            host_rows = pinned.cached_host_empty(tuple(rows.shape), rows.dtype, True)
            host_ids = pinned.cached_host_empty(tuple(ids.shape), torch.long, True)
            host_rows.copy_(rows, non_blocking=True)
            host_ids.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        else:  # the graph's own memory: a copy of it, now
            host_rows, host_ids, event = rows.clone(), ids.to(torch.long, copy=True), None
        grad = self.ensure_grad(chunk)[e.offset : e.offset + e.numel].view(e.shape)
        WORKER.submit((self.id, chunk), self._add_rows, grad, host_rows, host_ids, event, fresh)

    @staticmethod
    def _add_rows(grad: torch.Tensor, rows, ids, event, fresh: bool) -> None:
        """The rows of each token summed in their order, then added to the gradient once per
        token: eager's table (zeros, rows added in order) added to what the gradient held (the
        tied head's part, an earlier micro-step's), the same fp32 sums."""
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            tokens, which = torch.unique(ids, return_inverse=True)
            table = torch.zeros(len(tokens), rows.shape[1], dtype=rows.dtype)
            table.index_add_(0, which, rows)
            if fresh:
                grad.zero_()
            grad.index_add_(0, tokens, table)

    @staticmethod
    def _accumulate(acc: torch.Tensor, staged: torch.Tensor, parts, event=None, pool=None) -> None:
        """On the host worker: the staged gradient copied into (or added to) the accumulator, in
        the accumulator's dtype (an upcast of a low-precision gradient is exact). For a shard kept
        on the device: on the compute stream, with no event and no staging pool."""
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            for part, fresh in parts:
                if part is None:
                    continue
                sl = part[0]
                if fresh:
                    acc[sl].copy_(staged[sl])
                else:
                    add_upcast(acc[sl], staged[sl])
        if pool is not None:
            pool.give(staged)

    def resident_grads_ready(
        self, chunk: int, grads: list[torch.Tensor], members: list[int]
    ) -> None:
        """Data parallel: start averaging a resident chunk's parameter gradients (store entries
        ``members``) over the ranks, in place: the graph still returns them to autograd, after
        waiting for the collective at its end
        (:func:`protrain_fx.runtime.distributed.start_resident_all_reduce`). While profiling,
        nothing."""
        if self.profiling:
            return
        distributed.start_resident_all_reduce(
            [self._params[i]() for i in members], [g.detach() for g in grads]
        )
        self._stats["resident_all_reduces"] += 1

    def copy_to_host(self, flat: torch.Tensor, dst: torch.Tensor, on_compute_stream=False):
        """Device-to-host copy of a device gradient buffer on the copy stream (or, for memory the
        compiled code owns, on the compute stream, ordered before whatever reuses it); returns the
        event that marks it done (None on CPU, where the copy is synchronous)."""
        n = flat.numel()
        self._stats["d2h_copies"] += 1
        self._stats["d2h_bytes"] += n * flat.element_size()
        if not self.is_cuda:
            dst[:n].copy_(flat)
            return None
        if on_compute_stream:
            dst[:n].copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            return done
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.streams.d2h):
            self.streams.d2h.wait_event(ready)
            dst[:n].copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.streams.d2h)
        flat.record_stream(self.streams.d2h)
        return done
