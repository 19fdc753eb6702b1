"""What a backward has handed over, so that a backward redone after running out of device memory
hands over only the rest.

An offloaded chunk's gradients leave the device inside backward (``ChunkStore.grad_ready``): once
handed over they are in the host accumulator, and the optimizer may already have queued the chunk's
provisional step behind them. A backward that runs out of device memory half way has handed over
some chunks; the graph's caller (protrain_fx/backend.py, ``ProtrainGraph``) re-plans, replays the
forward on the same inputs and runs the backward again. That second backward produces every
gradient again, and the chunks handed over the first time must not be added twice. So the caller
runs each backward of a step inside :func:`handing_over` with one set for the step: a chunk's
gradients are handed over only if the set does not hold them yet (:func:`first_time`), and are
added to it once they are (:func:`handed_over`). Outside such a backward (a fixed plan, a graph run
by hand) everything is handed over, as always.
"""

from __future__ import annotations

import contextlib

# the set of the backward running now (one at a time: autograd runs a device's backward functions
# on one thread; a backward inside another, the profiler's in a re-plan, runs with None), and how
# often each key was met in it so far
_current: set | None = None
_seen: dict = {}


@contextlib.contextmanager
def handing_over(delivered: set | None):
    """Run a backward recording in ``delivered`` (and skipping what it holds); None: no record."""
    global _current, _seen
    before, _current, _seen = (_current, _seen), delivered, {}
    try:
        yield
    finally:
        _current, _seen = before


def first_time(key: tuple) -> tuple | None:
    """The hand-over of the gradients ``key`` (store id, chunk, members) that is due now, as the
    record :func:`handed_over` takes: ``key`` with how often this backward met it before (a tied
    weight's chunk gets its gradients from two graphs of a model compiled in regions); None when
    an earlier try of this step's backward handed it over already."""
    if _current is None:
        return key
    n = _seen.get(key, 0)
    _seen[key] = n + 1
    return None if (key, n) in _current else (key, n)


def handed_over(record: tuple) -> None:
    if _current is not None:
        _current.add(record)
