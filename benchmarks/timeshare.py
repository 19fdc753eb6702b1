"""Share the GPU machine between benchmark subprocesses: build and compile side by side, measure
alone.

Building a model and compiling it takes a minute or more of host time per system; the timed steps
take seconds, and the machine is lent by the minute. benchmarks/run.py therefore runs up to
``--jobs`` systems at once, under two rules:

* Admission (parent side, :class:`Slots`): a child starts when fewer than ``jobs`` run and its
  claimed device and host memory fit next to those already running; the first waiting claim in
  priority order that fits goes first. An exclusive claim runs with no other child, and nothing
  overtakes it. A claim larger than the whole machine is admitted alone (the claim is an estimate;
  the child finds out). At most one *host-heavy* child (host claim over ``heavy_host_gib``: the
  systems that keep model states in host memory) is alive at a time: on the H200 an FSDP2
  CPU-offload step timed next to idle processes holding ~60 GB of pinned memory ran 3.4x slower
  (benchmarks/README.md), so an offloading system is never measured next to another one.
* Timing (child side, a file lock named by ``$PROTRAIN_BENCH_LOCK``): a child holds the lock
  *shared* from start-up (taken before ``import torch``) through building, compiling and warming up,
  and *exclusive* for its timed steps (:func:`measuring`). An exclusive lock is granted only when
  nobody holds it in either mode, so no timed step overlaps another system's compilation, warm-up or
  timed steps; children waiting for their turn are blocked in ``flock`` and use no CPU or GPU time
  (they do keep their memory, which admission has accounted for). The parent takes the lock shared
  while it installs the peers' wheels.
* Two parents on one machine (one per GPU) share both rules when the outer command names the locks:
  ``$PROTRAIN_BENCH_LOCK`` (timing) and ``$PROTRAIN_BENCH_HEAVY_LOCK`` (one host-heavy child at a
  time; the parent takes it before starting such a child, :func:`host_heavy_turn`, so the child's
  time limit starts with its turn; turns go in the order they were asked for).

Without ``$PROTRAIN_BENCH_LOCK`` (a child run by hand, ``--jobs 1``) the child functions do nothing.

:func:`run_together` is the parent side for a fixed batch without admission (chunks_bench.py and
activations_bench.py start all their configurations at once and size the batch themselves).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import subprocess
import tempfile
import threading
import time

LOCK_ENV = "PROTRAIN_BENCH_LOCK"
HEAVY_LOCK_ENV = "PROTRAIN_BENCH_HEAVY_LOCK"
_fd: int | None = None  # this child's handle on the lock
_path: str | None = None  # and its path


def start_busy() -> None:
    """Child start-up: take the lock shared (blocks while another child measures)."""
    global _fd, _path
    path = os.environ.get(LOCK_ENV)
    if not path or _fd is not None:
        return
    _fd, _path = os.open(path, os.O_RDWR | os.O_CREAT, 0o600), path
    _shared(_fd, path)


def _exclusive(fd: int, path: str) -> None:
    """Take the lock exclusive, holding the gate while waiting (see :func:`_shared`). The shared
    lock is let go first: a waiter holding both would deadlock with one holding the shared lock,
    waiting for the gate."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    gate = os.open(path + ".gate", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(gate)


def _shared(fd: int, path: str) -> None:
    """Take the lock shared, but not while a child waits to measure: it holds the gate
    (``path.gate``) until it has the lock, so new shared holders queue behind it. Without the gate a
    steady stream of children starting up (another parent's next group) kept a measurement waiting
    for good: flock does not queue an exclusive waiter ahead of later shared requests."""
    gate = os.open(path + ".gate", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(gate)  # lets the gate go


@contextlib.contextmanager
def measuring(then_busy: bool = False):
    """Inside: nobody else holds the lock (no other child builds, compiles, warms up or measures).
    After: the lock is let go, or with ``then_busy`` held shared again (the child has more compiling
    or warming up to do, which must not overlap another child's measurement)."""
    if _fd is None:
        yield
        return
    _exclusive(_fd, _path)
    try:
        yield
    finally:
        fcntl.flock(_fd, fcntl.LOCK_SH if then_busy else fcntl.LOCK_UN)


def error_text(e: BaseException) -> str:
    """What a failing child reports in its row: the start of the exception (dispatcher errors put
    the operator first and a long key list after) and the innermost frames of its traceback."""
    import traceback

    frames = "".join(traceback.format_tb(e.__traceback__)[-3:])
    return f"{type(e).__name__}: {str(e)[:1200]}\n{frames[-1500:]}"


@contextlib.contextmanager
def busy(path: str | None):
    """Parent side: hold the lock shared (no child measures meanwhile)."""
    if not path:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _shared(fd, path)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def host_heavy_turn(path: str | None, deadline: float | None = None, poll_s: float = 0.5):
    """Parent side, two parents on one machine: hold the host-heavy lock
    (``$PROTRAIN_BENCH_HEAVY_LOCK``) exclusive while one host-heavy child runs, so the machine has
    one offloading system alive, not one per parent. Taken by the parent *before* it starts the
    child, so a child's time limit counts from its turn, not from its queueing behind the other
    parent's. Turns go first come, first served across parents (a ticket in ``path.queue/``; a
    parent with several waiting rows would otherwise win most races for a lock polled by all).
    Yields True once held, or False when ``deadline`` (``time.monotonic()``) came first; no path:
    True at once."""
    if not path:
        yield True
        return
    queue = path + ".queue"
    os.makedirs(queue, exist_ok=True)
    ticket = os.path.join(queue, f"{time.time_ns():020d}-{os.getpid()}-{threading.get_ident()}")
    open(ticket, "w").close()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            if _first_in_queue(queue, os.path.basename(ticket)):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
            if deadline is not None and time.monotonic() >= deadline:
                yield False
                return
            time.sleep(poll_s)
        yield True
    finally:
        os.close(fd)  # lets the lock go
        with contextlib.suppress(FileNotFoundError):
            os.remove(ticket)


def _first_in_queue(queue: str, mine: str) -> bool:
    """Whether ``mine`` is the oldest ticket of a live process (a dead parent's tickets are
    removed)."""
    for name in sorted(os.listdir(queue)):
        if name == mine:
            return True
        try:
            os.kill(int(name.split("-")[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(queue, name))
            continue
        except (ValueError, IndexError):
            continue  # a stray file, not a ticket
        except PermissionError:
            pass  # a live process of another user
        return False
    return False


class Claim:
    """One admitted child: ``neighbours`` collects the labels of the children alive at the same
    time."""

    def __init__(
        self,
        device_gib: float,
        host_gib: float,
        exclusive: bool,
        heavy: bool = False,
        label: str = "",
    ):
        self.device_gib, self.host_gib, self.exclusive, self.heavy = (
            device_gib,
            host_gib,
            exclusive,
            heavy,
        )
        self.label = label
        self.neighbours: set[str] = set()

    @property
    def shared(self) -> bool:
        return bool(self.neighbours)


class Slots:
    """Admission of children by count and claimed memory (see the module docstring)."""

    def __init__(
        self, jobs: int, device_gib: float, host_gib: float, heavy_host_gib: float = float("inf")
    ):
        self.jobs, self.device_gib, self.host_gib = max(1, jobs), device_gib, host_gib
        self.heavy_host_gib = heavy_host_gib
        self._cv = threading.Condition()
        self._running: list[Claim] = []
        self._waiting: list[tuple[float, int, Claim]] = []  # (priority, ticket, claim), kept sorted
        self._tickets = itertools.count()

    def _fits(self, c: Claim) -> bool:
        run = self._running
        if not run:
            return True
        if c.exclusive or any(r.exclusive for r in run) or len(run) >= self.jobs:
            return False
        if c.heavy and any(r.heavy for r in run):
            return False
        return (
            sum(r.device_gib for r in run) + c.device_gib <= self.device_gib
            and sum(r.host_gib for r in run) + c.host_gib <= self.host_gib
        )

    def _admissible(self, c: Claim) -> bool:
        """The first waiting claim, in priority order, that fits now; a waiting exclusive claim
        goes first."""
        exclusive = next((w for _, _, w in self._waiting if w.exclusive), None)
        if exclusive is not None:
            return exclusive is c and not self._running
        return next((w for _, _, w in self._waiting if self._fits(w)), None) is c

    @contextlib.contextmanager
    def claim(
        self,
        device_gib: float = 0.0,
        host_gib: float = 0.0,
        exclusive: bool = False,
        priority: float = 0,
        label: str = "",
    ):
        """Wait for admission (lower ``priority`` first, then first come), hold it inside. A smaller
        claim may overtake one that does not fit yet; nothing overtakes an exclusive claim."""
        c = Claim(
            device_gib, host_gib, exclusive, heavy=host_gib > self.heavy_host_gib, label=label
        )
        with self._cv:
            entry = (priority, next(self._tickets), c)
            self._waiting.append(entry)
            self._waiting.sort(key=lambda e: e[:2])
            while not self._admissible(c):
                self._cv.wait()
            self._waiting.remove(entry)
            for r in self._running:
                r.neighbours.add(c.label or "?")
                c.neighbours.add(r.label or "?")
            self._running.append(c)
            self._cv.notify_all()
        try:
            yield c
        finally:
            with self._cv:
                self._running.remove(c)
                self._cv.notify_all()


def run_together(argvs: list[list[str]], env: dict, timeout: float) -> list[tuple[int, str, str]]:
    """Parent side for a fixed batch: start every command at once with the lock named in their
    environment (they compile side by side and time one at a time, see :func:`measuring`); returns
    (returncode, stdout, stderr) of each, in order. A child still running at ``timeout`` is killed.
    ``$PROTRAIN_BENCH_LOCK``, when ``env`` already names it, is the lock used (shared with whoever
    else uses it)."""
    with tempfile.TemporaryDirectory(prefix="timeshare_") as d:
        procs = []
        for i, argv in enumerate(argvs):
            out = open(os.path.join(d, f"out_{i}"), "w+")
            err = open(os.path.join(d, f"err_{i}"), "w+")
            # a lock already named in the environment is shared with other parents (two benchmark
            # streams on two GPUs of one host): their timed steps do not overlap ours either
            e = dict(env, **{LOCK_ENV: env.get(LOCK_ENV) or os.path.join(d, "lock")})
            procs.append(
                (subprocess.Popen(argv, stdout=out, stderr=err, env=e, text=True), out, err)
            )
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(procs)
        while any(c is None for c in codes):
            for i, (p, _, _) in enumerate(procs):
                if codes[i] is None:
                    if p.poll() is not None:
                        codes[i] = p.returncode
                    elif time.monotonic() > deadline:
                        p.kill()
                        p.wait()
                        codes[i] = -9
            time.sleep(0.2)
        results = []
        for code, (_, out, err) in zip(codes, procs):
            out.seek(0)
            err.seek(0)
            so, se = out.read(), err.read()
            out.close()
            err.close()
            if code == -9:
                se += f"\nkilled after {timeout:.0f} s"
            results.append((code, so, se))
        return results
