"""Device chunk buffers ("slots"): where offloaded chunks land on the compute device, shared by
every chunk store whose chunks have the same (device, dtype, size).

A compiled graph reads an offloaded chunk through ``protrain::gather``, which returns a *fresh*
tensor that Inductor owns: the slot's contents copied on the compute stream. Inductor alone then
decides when that memory is dead (after the last kernel that reads it, fusions and inlined reads
included), so a chunk's data can never be overwritten while compiled code still reads it. The slots
only stage host-to-device copies:

    EMPTY --prefetch--> RESERVED(c) --gather--> CACHED(c) --prefetch of another chunk--> RESERVED(d)
                           ^                       |
                           +----prefetch of c------+   (a hit: no copy; backward's first chunks are
                                                         forward's last)

``prefetch`` issues the host-to-device copy on the copy stream into a slot that is EMPTY or the
least recently used CACHED one; ``gather`` waits for it, copies the slot out and records when the
compute stream is done reading the slot (the next copy into it waits for that). ``reset`` (after an
exception inside a compiled graph) drops every reservation. On a CPU compute device the copies are
real and synchronous.

The host values of a chunk change behind a slot's back: the host worker's CPU optimizer step may
run while the slot is RESERVED (a backward prefetched the chunk, Inductor put the chunk's gradient
ahead of its gather, the step started at once). ``invalidate`` therefore bumps the chunk's
*generation*; a slot remembers the generation it was filled from, its gather still serves those
values (what the running backward must see, as eager would) but leaves the slot EMPTY instead of
CACHED, and a prefetch never hits a slot of an older generation. Writers of a chunk's host values
first wait for copies of it still in flight (:meth:`ChunkBuffers.wait_copies`).
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from dataclasses import dataclass

import torch

from protrain_fx import config
from protrain_fx.errors import ProtrainError

# debugging aid: PROTRAIN_DEBUG_POISON=1 fills a slot with NaN once gather has copied it out and
# never serves a chunk from a slot without copying it again: compiled code that still read a slot
# would compute with NaN
POISON = config.settings().debug_poison


class SlotState(enum.Enum):
    EMPTY = "empty"
    RESERVED = "reserved"  # prefetched (copy issued or a cached hit), waiting for its gather
    CACHED = "cached"  # holds a chunk's data, free to be reused


# the transitions a slot may take; anything else is a bug in the schedule
_ALLOWED = {
    (SlotState.EMPTY, SlotState.RESERVED),
    (SlotState.CACHED, SlotState.RESERVED),
    (SlotState.RESERVED, SlotState.CACHED),
    (SlotState.CACHED, SlotState.EMPTY),
    (SlotState.RESERVED, SlotState.EMPTY),  # reset after an exception
    (SlotState.EMPTY, SlotState.EMPTY),
}


@dataclass
class Slot:
    buffer: torch.Tensor
    state: SlotState = SlotState.EMPTY
    key: tuple | None = None  # (store id, chunk) whose data it holds or awaits
    ready: object = None  # copy-stream event: the host-to-device copy is done
    free: object = None  # compute-stream event: gather's read of the slot is done
    last_used: int = 0
    generation: int = 0  # the chunk's generation its data was copied from
    # reserved ahead of the graph that gathers it (the next region of a program, protrain_fx/
    # region_program.py): a graph's own prefetch may take the slot back if it needs it
    ahead: bool = False

    def move(self, state: SlotState, key=None) -> None:
        if (self.state, state) not in _ALLOWED:
            raise ProtrainError(
                f"protrain internal error: chunk buffer {self.state.value} -> {state.value}"
            )
        self.state, self.key = state, key


class DeviceStreams:
    """The copy streams of one device, shared by every store and swap on it (CUDA only)."""

    def __init__(self, device: torch.device):
        self.h2d = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.d2h = torch.cuda.Stream(device) if device.type == "cuda" else None


_STREAMS: dict[torch.device, DeviceStreams] = {}


def streams_of(device: torch.device) -> DeviceStreams:
    if device not in _STREAMS:
        _STREAMS[device] = DeviceStreams(device)
    return _STREAMS[device]


class ChunkBuffers:
    """The slots of one (device, dtype, numel); see the module docstring."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numel: int):
        self.device, self.dtype, self.numel = device, dtype, numel
        self.is_cuda = device.type == "cuda"
        self.slots: list[Slot] = []
        self.streams = streams_of(device)
        self._clock = 0
        # reentrant: a collected store's finalizer (chunk_store._forget_store, run by a garbage
        # collection that any allocation may start) calls forget_store, also on a thread inside this
        # lock
        self._lock = threading.RLock()
        self._generation: dict[tuple, int] = {}  # (store id, chunk) -> times its values changed
        # the copies' own durations (CUDA: their events on the copy stream, read once done) and
        # bytes, summed (uploads(): what later plans price the gathers at, machine/step_rates.py)
        self._timed: collections.deque = collections.deque()
        self.upload_s, self.upload_bytes = 0.0, 0
        self.stats = {
            "h2d_copies": 0,
            "h2d_bytes": 0,
            "slot_hits": 0,
            "unprefetched_gathers": 0,
            "ahead": 0,  # prefetches for a graph not started yet (the next region)
            "ahead_taken_back": 0,  # ... whose slot a graph's own prefetch needed
        }

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.numel * self.dtype.itemsize

    def ensure(self, n: int) -> None:
        """Have at least ``n`` slots (called when a graph that needs them is compiled)."""
        while len(self.slots) < n:
            self.slots.append(Slot(torch.empty(self.numel, dtype=self.dtype, device=self.device)))

    def _find(self, key) -> Slot | None:
        return next(
            (s for s in self.slots if s.key == key and s.state is not SlotState.EMPTY), None
        )

    def holds(self, key) -> bool:
        return self._find(key) is not None

    def is_reserved(self, key) -> bool:
        s = self._find(key)
        return s is not None and s.state is SlotState.RESERVED

    def prefetch(self, key, fill, on_compute: bool = False, ahead: bool = False) -> None:
        """Reserve a slot for chunk ``key`` and start ``fill(dst)`` (the host-to-device copy) unless
        a slot already holds it; on the copy stream, or with ``on_compute`` on the compute stream
        (the profiler). ``ahead``: before the graph that gathers it runs, into a free slot only
        (none free: nothing done); a graph's own prefetch may take such a slot back."""
        with self._lock:
            s = self._find(key)
            current = self._generation.get(key, 0)
            if s is not None and s.state is SlotState.RESERVED and s.ahead:
                if s.generation != current:  # reserved ahead, and the host values changed since
                    s.move(SlotState.EMPTY)
                    s.ahead = False
                    s = None
            if s is not None and s.state is SlotState.RESERVED:
                s.ahead = s.ahead and ahead  # the graph's own prefetch keeps it
                return  # already prefetched (a gather without a schedule, or prefetched twice)
            self.stats["ahead"] += int(ahead)
            if s is not None and not POISON and s.generation == current:
                s.move(SlotState.RESERVED, key)
                s.ahead = ahead
                self.stats["slot_hits"] += 1
                return
            if s is not None:  # an older generation's values: never served again
                s.move(SlotState.EMPTY)
            free = [x for x in self.slots if x.state is not SlotState.RESERVED]
            if not free and ahead:
                self.stats["ahead"] -= 1
                return
            ahead_slots = [x for x in self.slots if x.ahead]
            if not free and ahead_slots:  # reserved ahead for a chunk not gathered first after all
                victim = min(ahead_slots, key=lambda x: x.last_used)
                victim.move(SlotState.EMPTY)  # its copy runs before the next one on the stream
                victim.ahead = False
                free = [victim]
                self.stats["ahead_taken_back"] += 1
            if not free:
                raise ProtrainError(
                    f"protrain: all {len(self.slots)} device chunk buffers are awaiting their "
                    "gathers, so chunk "
                    f"{key[1]} cannot be prefetched (the schedule prefetches more chunks than the "
                    "plan's n_buffer)"
                )
            s = min(free, key=lambda x: (x.state is not SlotState.EMPTY, x.last_used))
            if s.state is SlotState.CACHED:
                s.move(SlotState.EMPTY)
            s.move(SlotState.RESERVED, key)
            s.ahead = ahead
            s.generation = current
            self._clock += 1
            s.last_used = self._clock
            if self.is_cuda and not on_compute:
                # a new slot: its memory may be what queued compute work freed just now
                if s.free is None:
                    self.streams.h2d.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.streams.h2d):
                    if s.free is not None:
                        self.streams.h2d.wait_event(s.free)
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(self.streams.h2d)
                    n = fill(s.buffer)
                    s.ready = torch.cuda.Event(enable_timing=True)
                    s.ready.record(self.streams.h2d)
                self._timed.append((start, s.ready, n))
                self.uploads()  # the list kept short
            else:
                if s.free is not None:  # on the compute stream itself: ordered after gather's read
                    s.free = None
                t0 = time.perf_counter()
                n = fill(s.buffer)
                if not self.is_cuda:  # a CPU device's copies are synchronous
                    self.upload_s, self.upload_bytes = (
                        self.upload_s + time.perf_counter() - t0,
                        self.upload_bytes + n,
                    )
                s.ready = None
            self.stats["h2d_copies"] += 1
            self.stats["h2d_bytes"] += n

    def uploads(self) -> tuple[float, int]:
        """Seconds and bytes of the host-to-device copies on the copy stream so far (on CUDA those
        done by now)."""
        with self._lock:
            while self._timed and self._timed[0][1].query():
                start, end, n = self._timed.popleft()
                self.upload_s, self.upload_bytes = (
                    self.upload_s + start.elapsed_time(end) / 1e3,
                    self.upload_bytes + n,
                )
            return self.upload_s, self.upload_bytes

    def gather(self, key, numel: int, fill, on_compute: bool = False) -> torch.Tensor:
        """The chunk's data as a fresh tensor on the compute device (prefetching it now if no
        slot has it)."""
        if _TRACE.on:
            _TRACE.keys.append(key)
        s = self._find(key)
        if s is None or s.state is not SlotState.RESERVED:
            self.stats["unprefetched_gathers"] += int(s is None)
            self.prefetch(key, fill, on_compute)
            s = self._find(key)
        s.ahead = False
        compute = torch.cuda.current_stream(self.device) if self.is_cuda else None
        if s.ready is not None:
            compute.wait_event(s.ready)
        out = torch.empty(numel, dtype=self.dtype, device=self.device)
        out.copy_(s.buffer[:numel])
        with self._lock:
            if self.is_cuda:
                s.free = torch.cuda.Event()
                s.free.record(compute)
            s.move(SlotState.CACHED, key)
            if s.generation != self._generation.get(key, 0):
                s.move(SlotState.EMPTY)  # the host values changed since the copy
            if POISON:
                s.buffer.fill_(float("nan"))
                s.move(SlotState.EMPTY)
        return out

    def invalidate(self, key) -> None:
        """The host values of chunk ``key`` changed: no slot serves the older ones to a later
        prefetch (a reserved slot still serves its gather; see the module docstring)."""
        with self._lock:
            self._generation[key] = self._generation.get(key, 0) + 1
            s = self._find(key)
            if s is not None and (s.state is SlotState.CACHED or s.ahead):
                # a slot reserved ahead serves no gather yet: its graph will copy the new values
                s.move(SlotState.EMPTY)
                s.ahead = False

    def forget_store(self, store_id: int) -> None:
        with self._lock:
            for s in self.slots:
                if s.key is not None and s.key[0] == store_id and s.state is not SlotState.EMPTY:
                    self._generation[s.key] = self._generation.get(s.key, 0) + 1
                    if s.state is SlotState.CACHED:
                        s.move(SlotState.EMPTY)

    def wait_copies(self, key) -> None:
        """Block until no host-to-device copy of chunk ``key`` is in flight (before its host values
        are overwritten: the copy reads them asynchronously)."""
        with self._lock:
            events = [
                s.ready
                for s in self.slots
                if s.key == key and s.state is SlotState.RESERVED and s.ready is not None
            ]
        for e in events:
            e.synchronize()

    def reset(self) -> None:
        """After an exception inside a compiled graph: no slot stays reserved (copies in flight
        finish first)."""
        if self.is_cuda:
            self.streams.h2d.synchronize()
        with self._lock:
            for s in self.slots:
                if s.state is SlotState.RESERVED:
                    s.move(SlotState.EMPTY)
                s.ahead = False

    def reserved(self) -> list:
        return [s.key for s in self.slots if s.state is SlotState.RESERVED]


class _Trace:
    """The chunks gathered, in order, while a region of a program records what its graph gathers
    (protrain_fx/region_program.py: the next region's first chunks are then prefetched ahead)."""

    def __init__(self):
        self.on = 0
        self.keys: list[tuple] = []


_TRACE = _Trace()


def trace_begin() -> int:
    """Start recording gathers; returns where this recording starts."""
    _TRACE.on += 1
    return len(_TRACE.keys)


def trace_end(start: int) -> list[tuple]:
    """The (store id, chunk) keys gathered since :func:`trace_begin` returned ``start``."""
    out = _TRACE.keys[start:]
    _TRACE.on = max(0, _TRACE.on - 1)
    if not _TRACE.on:
        _TRACE.keys = []
    return out


class GradBuffers:
    """Device buffers the packed gradients of offloaded chunks wait in until their copy to the host
    is done, used in rotation (one (device, dtype, numel) set shared by every store)."""

    N = 2

    def __init__(self, device: torch.device, dtype: torch.dtype, numel: int):
        self.device, self.dtype, self.numel = device, dtype, numel
        self.bufs: list[torch.Tensor] = []
        self.done: list = []
        self._next = 0

    @property
    def nbytes(self) -> int:
        return len(self.bufs) * self.numel * self.dtype.itemsize

    def take(self) -> tuple[int, torch.Tensor]:
        """The next buffer, once its last copy to the host is done (the compute stream waits for
        it)."""
        if not self.bufs:
            with torch.no_grad():
                self.bufs = [
                    torch.empty(self.numel, dtype=self.dtype, device=self.device)
                    for _ in range(self.N)
                ]
            self.done = [None] * self.N
        k = self._next
        self._next = (k + 1) % self.N
        if self.done[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done[k])
            self.done[k] = None
        return k, self.bufs[k]

    def copied(self, k: int, event) -> None:
        self.done[k] = event


_BUFFERS: dict[tuple, ChunkBuffers] = {}
_GRAD_BUFFERS: dict[tuple, GradBuffers] = {}


def chunk_buffers(device: torch.device, dtype: torch.dtype, numel: int) -> ChunkBuffers:
    key = (device, dtype, numel)
    if key not in _BUFFERS:
        _BUFFERS[key] = ChunkBuffers(device, dtype, numel)
    return _BUFFERS[key]


def grad_buffers(device: torch.device, dtype: torch.dtype, numel: int) -> GradBuffers:
    key = (device, dtype, numel)
    if key not in _GRAD_BUFFERS:
        _GRAD_BUFFERS[key] = GradBuffers(device, dtype, numel)
    return _GRAD_BUFFERS[key]


def held_by(stores, device: torch.device) -> int:
    """Device bytes of the chunk and gradient buffers ``stores`` use, each set once (stores of one
    chunk size share theirs): a plan of their parameters prices and reuses them, so its budget does
    not count them as another's."""
    held = {}
    for s in stores:
        for b in (s.buffers, s.grad_buffers):
            if b is not None and b.device == device:
                held[id(b)] = b.nbytes
    return sum(held.values())


def release_unused(live_keys: set) -> None:
    """Free the buffers of sizes no live store uses any more (a deleted model's)."""
    for table in (_BUFFERS, _GRAD_BUFFERS):
        for key in [k for k in list(table) if k not in live_keys]:
            del table[key]


def reset_all() -> None:
    for b in list(_BUFFERS.values()):
        b.reset()
