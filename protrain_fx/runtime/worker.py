"""The host worker: one thread that runs, in order, what backward hands to the host (accumulating a
chunk's gradient copy into its host gradient, the CPU optimizer step of that chunk), so the compute
device never waits for them.

Tasks are tagged with the chunk they touch; :meth:`Worker.wait_chunk` waits for one chunk's tasks
(before its host values are read), :meth:`Worker.wait` for all. A task may leave work of the chunk
queued on the compute device (an Adam step run there, runtime/device_steps.py): it registers the
event that ends it (:meth:`Worker.pending`), and both waits synchronize with it too, so the worker
goes on to the next chunk while the device and the copies work. The thread exists while some chunk
store uses it and stops when the last one is gone, so a deleted model leaves no thread behind; a
forked child starts its own.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor


class Worker:
    def __init__(self):
        self._executor: ThreadPoolExecutor | None = None
        self._futures: deque[tuple] = deque()  # (chunk key, task, its owner's weak reference)
        self._last: dict[tuple, Future] = {}  # chunk key -> its newest task
        self._users: "weakref.WeakSet" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._events: dict[tuple, list] = {}  # chunk key -> device events its values wait for

    def attach(self, user) -> None:
        self._users.add(user)

    def detach(self, user) -> None:
        self._users.discard(user)
        if not len(self._users):
            self.shutdown()

    def submit(self, key: tuple, fn, *args, owner=None) -> Future:
        """Queue ``fn(*args)`` for chunk ``key``; its error is raised by a wait unless ``owner``
        (a weak reference) is dead by then, or the chunk's store is."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="protrain-host"
                )
            fut = self._executor.submit(fn, *args)
            self._futures.append((key, fut, owner))
            self._last[key] = fut
        return fut

    def pending(self, key: tuple, event) -> None:
        """The chunk's host values are final only once ``event`` (a CUDA event) has completed."""
        with self._lock:
            self._events.setdefault(key, []).append(event)

    def wait_chunk(self, key: tuple) -> None:
        fut = self._last.get(key)
        if fut is not None:
            fut.result()
            with self._lock:
                if self._last.get(key) is fut:
                    del self._last[key]
        if self._events:
            with self._lock:
                events = self._events.pop(key, ())
            for ev in events:
                ev.synchronize()

    def wait(self) -> None:
        """Block until every task handed over so far is done; the first task's exception is
        raised, unless its owner or chunk store is gone (a model dropped after a failed backward,
        whose queued step then found its optimizer freed: raised in the next model's
        ``opt.step()``)."""
        error = None
        while True:
            with self._lock:
                if not self._futures:
                    break
                key, fut, owner = self._futures.popleft()
            try:
                fut.result()
            except BaseException as e:  # keep draining: nothing may stay queued behind an error
                alive = owner is None or owner() is not None
                if alive and any(getattr(u, "id", None) == key[0] for u in self._users):
                    error = error or e
        with self._lock:
            self._last = {k: f for k, f in self._last.items() if not f.done()}
            events, self._events = self._events, {}
        for evs in events.values():
            for ev in evs:
                ev.synchronize()
        if error is not None:
            raise error

    def busy(self) -> bool:
        return any(not f.done() for _, f, _ in list(self._futures))

    def after_fork(self) -> None:
        """In a child forked from a process whose thread existed (a DataLoader worker, a
        ``multiprocessing`` fork): that thread is not there, so what it had queued is dropped and a
        thread of the child's own starts at its first task (before, the child's first backward
        waited for the parent's thread forever)."""
        self._executor, self._lock = None, threading.Lock()
        self._futures, self._last, self._events = deque(), {}, {}

    def shutdown(self) -> None:
        ex, self._executor = self._executor, None
        if ex is not None:  # never wait for itself (a store collected on the worker thread)
            ex.shutdown(wait=not threading.current_thread().name.startswith("protrain-host"))
        self._futures.clear()
        self._last.clear()
        self._events.clear()


WORKER = Worker()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WORKER.after_fork)
