"""The host-to-device path of a chunk store: a chunk's values copied into a device chunk buffer
ahead of use (``prefetch``) and out of it into a tensor the compiled graph owns (``gather``).

A chunk may be copied only once the host worker is done with it (a CPU optimizer step may still be
writing its transfer copy), once a provisional in-backward step has been committed or taken back,
and once writes that eager code made to its parameters are taken in. :class:`ChunkTransfers` holds
these as methods of :class:`~protrain_fx.runtime.chunk_store.ChunkStore`, which inherits them; the
slots themselves, their streams and their life cycle are protrain_fx/runtime/chunk_buffers.py's.
"""

from __future__ import annotations

import torch

from protrain_fx import config
from protrain_fx.plan.profiles import UPLOAD_PIECE
from protrain_fx.runtime import block_timer, distributed, mapped
from protrain_fx.runtime.worker import WORKER

# debugging aid: PROTRAIN_DEBUG_SYNC=1 synchronizes the device around every chunk operation (no
# overlap)
DEBUG_SYNC = config.settings().sync_chunks


# elements of the device staging a master in another dtype than its chunk buffer goes up through
# (transfer_copies=False); the cost model budgets one piece (plan/profiles.py, UPLOAD_PIECE)
PIECE = UPLOAD_PIECE
_PIECES: dict = {}  # (device, dtype) -> [its staging piece, the event after its last use]


def upload(dst: torch.Tensor, src: torch.Tensor, most: int = PIECE) -> None:
    """``dst.copy_(src)`` on the current stream, for a host ``src`` and a device ``dst`` of another
    dtype without a temporary of ``src``'s size on the device (torch's copy_ would make one): piece
    by piece through a device staging buffer of ``src``'s dtype, each piece cast into ``dst`` on the
    same stream (so the next piece's copy waits for the cast that reads the staging). The cast
    rounds as ``Tensor.to`` does, like a host transfer copy. The staging holds ``PIECE``
    elements, or ``most`` (the largest chunk that goes up) if fewer."""
    if dst.dtype == src.dtype or dst.device.type != "cuda" or src.device.type == "cuda":
        dst.copy_(src, non_blocking=True)
        return
    stream = torch.cuda.current_stream(dst.device)
    key = (dst.device, src.dtype)
    size = min(PIECE, max(most, src.numel()))
    if key not in _PIECES or _PIECES[key][0].numel() < size:
        if key in _PIECES and _PIECES[key][1] is not None:
            _PIECES[key][1].synchronize()  # the smaller one's last casts are done
        _PIECES[key] = [torch.empty(size, dtype=src.dtype, device=dst.device), None]
    piece, last = _PIECES[key]
    n_piece = piece.numel()
    if last is not None:  # its last casts may run on another stream (the profiler's compute one)
        stream.wait_event(last)
    for i in range(0, src.numel(), n_piece):
        part = src[i : i + n_piece]
        piece[: part.numel()].copy_(part, non_blocking=True)
        dst[i : i + part.numel()].copy_(piece[: part.numel()])
    done = torch.cuda.Event()
    done.record(stream)
    _PIECES[key][1] = done


def release_pieces() -> None:
    """Free the upload staging (the last store is gone)."""
    _PIECES.clear()


class ChunkTransfers:
    """Copies of a store's offloaded chunks to the compute device (mixed into ChunkStore)."""

    def ensure_buffers(self, n_buffer: int) -> None:
        """Have at least ``n_buffer`` device chunk buffers (called when a graph that gathers is
        compiled)."""
        if self.buffers is not None:
            self.buffers.ensure(n_buffer)

    def wait_copies(self, chunk: int) -> None:
        """Before the chunk's host values are overwritten (a CPU optimizer step, its inverse): wait
        for host-to-device copies of it still in flight."""
        if self.buffers is not None and self.is_cuda:
            self.buffers.wait_copies((self.id, chunk))

    @property
    def n_buffer(self) -> int:
        return len(self.buffers.slots) if self.buffers is not None else 0

    def invalidate(self, chunk: int | None = None) -> None:
        """Forget device copies of ``chunk`` (all chunks when None): their host values changed."""
        if self.buffers is None:
            return
        if chunk is None:
            self.buffers.forget_store(self.id)
        else:
            self.buffers.invalidate((self.id, chunk))

    def _fill(self, chunk: int):
        def fill(dst: torch.Tensor) -> int:
            """Copy the host values into the device buffer: the whole chunk, or with several ranks
            this rank's shard into its place and an all-gather of the others (on the current
            stream). A shard kept on the device is cast into its place (no host copy)."""
            src = self.transfer[chunk]
            n = self._chunk_numel[chunk]
            if self.profiling:
                block_timer.RECORDER.record(block_timer.STEP, block_timer.COPY_START, self.device)
            most = self.buffers.numel
            if not self.world.sharded:
                upload(dst[:n], src, most)
            else:
                lo, hi = self.host_range(chunk)
                upload(dst[lo:hi], src, most)
                distributed.all_gather_into(dst[:n], dst[lo:hi])
            if self.profiling:
                block_timer.RECORDER.record(block_timer.STEP, block_timer.COPY_END, self.device)
            return 0 if self.home_on_device(chunk) else src.numel() * src.element_size()

        return fill

    def sync_writes(self, chunk: int) -> bool:
        """Take in what eager code wrote into the chunk's parameters (``p.mul_(0.9)`` under no_grad,
        a ``load_state_dict``, another optimizer): the parameters are views of the master, so only
        the transfer copy and the device copies are stale. A parameter given another tensor
        (``p.data = t``, ``p.set_(t)``, ``module.double().float()``) has its values copied into the
        master and is made its view again; before, the graph went on training the master, the new
        values ignored and the parameter left behind. Returns whether anything was written."""
        if not self.aliased:
            return False
        changed = False
        for i in self._chunk_entries[chunk]:
            p = self._params[i]()
            if p is not None and p.numel() and p.data_ptr() != self._master_ptr(i):
                changed |= self._take_rebound(i, p)
            elif p is not None and self._given_back(i, p):
                changed |= self._take_given_back(i, p)
            elif i in self._held_aside and not _held_elsewhere(self._held_aside[i][0]):
                del self._held_aside[i]  # the saved tensor is gone: nothing to give back
            elif p is not None and p._version != self._synced.get(i):
                self._synced[i] = p._version
                changed = True
        if changed:
            if self.is_cuda:  # the write may still be queued on the device
                torch.cuda.current_stream(self.device).synchronize()
            self._stats["transfer_refreshes"] += 1
            self.refresh_transfer(chunk)
        return changed

    def _master_ptr(self, i: int) -> int:
        e = self.entries[i]
        master = self.master[e.chunk]
        return master.data_ptr() + e.offset * master.element_size()

    def _take_rebound(self, i: int, p: torch.Tensor) -> bool:
        """Its new tensor's values into the master, the parameter its view again; not for a tensor
        of another dtype or shape (``model.to(dtype)``: dynamo compiles the model again, which
        refuses training it, binding.refuse_converted; evaluating it reads the chunks)."""
        e, new = self.entries[i], p.data
        if new.dtype != self.master_dtype or new.shape != e.shape:
            return False
        view = mapped.device_view(self.master[e.chunk], e.offset, e.shape, self.device)
        old = self._installed.get(i)
        if old is not None and _held_elsewhere(old):
            # ``saved = p.data; p.data = t`` (an EMA's weights swapped in for an evaluation): the
            # saved tensor shares the master, which now takes t's values; eager's keeps the old
            # ones, kept aside here (on the host) for when it is given back (_take_given_back)
            part = self.master[e.chunk][e.offset : e.offset + e.numel]
            self._held_aside[i] = (old, part.clone())
        with torch.no_grad():
            view.copy_(new)
        self._install(i, p, view)
        return True

    def _install(self, i: int, p: torch.Tensor, view: torch.Tensor) -> None:
        p.data = view
        self._synced[i], self._installed[i] = p._version, p.untyped_storage()

    def _given_back(self, i: int, p: torch.Tensor) -> bool:
        """Whether ``p`` was given back a tensor saved before an earlier ``p.data = t``."""
        aside = self._held_aside.get(i)
        return aside is not None and p.untyped_storage()._cdata == aside[0]._cdata

    def _take_given_back(self, i: int, p: torch.Tensor) -> bool:
        """``p.data = saved``: the values the saved tensor holds in eager PyTorch back into the
        master. Where the tensor protrain gave the parameter since is itself held elsewhere
        (``p.data, q.data = q.data, p.data`` twice: q would share the master and show the
        parameter's values, where eager's shows its own), that cannot be exact: refused."""
        from protrain_fx.errors import ProtrainError

        e = self.entries[i]
        since = self._installed.get(i)
        if since is not None and _held_elsewhere(since):
            raise ProtrainError(
                f"protrain: parameter {e.fqn!r} had its .data swapped with another tensor's "
                "(p.data, q.data = q.data, p.data): an offloaded parameter's data is a view of its "
                "chunk, so the other tensor would share it. Copy values instead: under "
                "torch.no_grad(), tmp = p.detach().clone(); p.copy_(q); q.copy_(tmp)"
            )
        _, values = self._held_aside.pop(i)
        with torch.no_grad():
            self.master[e.chunk][e.offset : e.offset + e.numel].copy_(values)
        view = mapped.device_view(self.master[e.chunk], e.offset, e.shape, self.device)
        self._install(i, p, view)
        return True

    def _ready_for_copy(self, chunk: int) -> None:
        WORKER.wait_chunk((self.id, chunk))  # a CPU step of the chunk may still be running
        # a graph reads the chunk before opt.step(): a provisional step goes
        if self.live_optimizer() is not None:
            self.optimizer.before_chunk_read(self, chunk)
        self.sync_writes(chunk)

    def prefetch(self, chunk: int, ahead: bool = False) -> None:
        """Start copying ``chunk`` into a device buffer (no copy when a buffer still holds it).
        ``ahead``: for a graph that has not started yet, into a free buffer only (none while
        profiling)."""
        if not self.is_offloaded(chunk) or (ahead and self.profiling):
            return
        if DEBUG_SYNC and self.is_cuda:
            torch.cuda.synchronize()
        self._ready_for_copy(chunk)
        self.buffers.prefetch(
            (self.id, chunk), self._fill(chunk), on_compute=self._on_compute(chunk), ahead=ahead
        )

    def _on_compute(self, chunk: int) -> bool:
        """Whether the chunk's copy runs on the compute stream: while profiling (between the
        profiler's copy marks), and for a shard kept on the device, which the optimizer's step
        and gradient accumulation write on the compute stream (ordered after them there)."""
        return self.profiling or self.home_on_device(chunk)

    def gather(self, chunk: int) -> torch.Tensor:
        """The chunk's parameters on the compute device: a fresh flat tensor in the transfer dtype
        that the caller owns (see protrain_fx/runtime/chunk_buffers.py)."""
        key = (self.id, chunk)
        if not self.buffers.is_reserved(key):
            self._ready_for_copy(chunk)
        out = self.buffers.gather(
            key, self._chunk_numel[chunk], self._fill(chunk), on_compute=self._on_compute(chunk)
        )
        if DEBUG_SYNC and self.is_cuda:
            torch.cuda.synchronize()
        return out

    def shard_values(self, chunk: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of a chunk sharded on the devices, in ``dtype``: a new tensor the
        graph all-gathers itself (a functional collective: passes/chunk_gather.py)."""
        self._ready_for_copy(chunk)
        with torch.no_grad():
            return self.transfer[chunk].to(dtype, copy=True)

    def reset_after_error(self) -> None:
        """An exception escaped a compiled graph: no chunk buffer stays reserved, no copy stays
        queued."""
        if self.buffers is not None:
            self.buffers.reset()
        try:
            WORKER.wait()
        except Exception:  # the graph's own error is the one that matters
            pass


def _held_elsewhere(storage: torch.UntypedStorage) -> bool:
    """Whether a tensor outside protrain shares ``storage`` (protrain holds one reference)."""
    return torch._C._storage_Use_Count(storage._cdata) > 1
