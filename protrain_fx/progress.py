"""Progress lines while a model waits for its first step.

Before the first step of a graph can run, dynamo traces it, protrain may compile and profile it
under a frugal plan and search, and Inductor compiles the chosen plan's forward (and, at the first
``backward()``, its backward). On a large model that is minutes. Each phase prints one line when it
starts, with the seconds since dynamo began the graph, and when the graph is ready one line sums
the phases up. The lines go through :mod:`logging` (logger ``protrain_fx.progress``, level INFO);
``logging.getLogger("protrain_fx").setLevel(logging.WARNING)`` quiets them. If the application has
configured no logging at all, a handler on stderr is attached to the ``protrain_fx`` logger at the
first line, so that they are seen by default.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

from protrain_fx import _compat

log = logging.getLogger("protrain_fx.progress")


def _ensure_visible() -> None:
    root = logging.getLogger("protrain_fx")
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    if not root.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)


class Progress:
    """The phases of one graph on its way to the first step."""

    def __init__(self, graph: str):
        now = time.perf_counter()
        started = _compat.dynamo_compile_started_s()
        traced = time.time() - started if started is not None else None
        self.graph = graph
        self.start = now - traced if traced is not None and traced >= 0 else now
        self.phases: dict[str, float] = {}
        if traced is not None and traced >= 0:
            self.phases["tracing"] = traced
        self.finished = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, message: str) -> None:
        _ensure_visible()
        log.info("protrain [%7.1f s] graph %s: %s", self.elapsed(), self.graph, message)

    def arrived(self, n_nodes: int, params: list, n_blocks: int, device) -> None:
        from protrain_fx.options import format_bytes

        size = format_bytes(sum(p.nbytes for p in params))
        self.line(
            f"{n_nodes} nodes, {len(params)} parameters ({size}), {n_blocks} blocks, on {device}"
        )

    @contextlib.contextmanager
    def phase(self, name: str, message: str | None = None):
        """One line as the phase starts; its seconds are added to ``phases[name]``."""
        self.line(message or name)
        t0 = time.perf_counter()
        self._open = (name, t0)
        try:
            yield
        finally:
            self._open = None
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    _open: tuple[str, float] | None = None

    def ready(self) -> None:
        """The graph can run its first step: one line with the phases' seconds."""
        if self.finished:
            return
        self.finished = True
        phases = dict(self.phases)
        if self._open is not None:  # ready from inside a phase (an inference graph's compile)
            name, t0 = self._open
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
        self.line(f"ready after {self.elapsed():.1f} s ({parts})")


class Silent(Progress):
    """No graph is on its way (a re-plan, a test calling the pipeline directly): nothing said."""

    def __init__(self):
        super().__init__("-")
        self.finished = True

    def line(self, message: str) -> None:
        pass


_CURRENT = threading.local()


def begin(graph: str) -> Progress:
    """A new graph arrived at the backend: its tracker (also :func:`current` from now on)."""
    p = Progress(graph)
    _CURRENT.progress = p
    return p


def current() -> Progress:
    """The tracker of the graph being compiled on this thread (:class:`Silent` if none)."""
    return getattr(_CURRENT, "progress", None) or Silent()


def end() -> None:
    """The backend is done with its graph: later compiles on this thread say nothing until the
    next :func:`begin`."""
    _CURRENT.progress = None


@contextlib.contextmanager
def silenced():
    """Compiles inside say nothing (a graph compiled in regions says one line per region code,
    protrain_fx/region_program.py, not one per stage of each)."""
    before = getattr(_CURRENT, "progress", None)
    _CURRENT.progress = Silent()
    try:
        yield
    finally:
        _CURRENT.progress = before
