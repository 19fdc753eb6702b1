"""The errors protrain raises on what it cannot do exactly: each says why and what to do instead.

``ProtrainError`` is the base (a ``RuntimeError``); ``OptionsError`` is a bad option (also a
``ValueError``); ``NoPlanFits`` is a budget no plan meets, with the smallest device or host budget
that would work.
"""

from __future__ import annotations

import functools
import sys
import traceback


class ProtrainError(RuntimeError):
    """Base class of the errors protrain-fx raises on bad input."""


class OptionsError(ProtrainError, ValueError):
    """An option is unknown or has a bad value."""


class NoPlanFits(ProtrainError):
    def __init__(
        self,
        message: str,
        min_device_bytes: int | None = None,
        min_host_bytes: int | None = None,
        loop_prior_bytes: int = 0,
        budget_bytes: int | None = None,
        loop_allowance_bytes: int = 0,
        budget_shares: int = 1,
        loop_prior_certain: bool = True,
    ):
        super().__init__(message)
        self.min_device_bytes = min_device_bytes
        self.min_host_bytes = min_host_bytes
        self.budget_bytes = budget_bytes  # the device budget searched, as min_device_bytes counts
        # the room for the training loop's own tensors the budget was short of, assumed before
        # they were measured (profiling/loop_memory.py)
        self.loop_prior_bytes = loop_prior_bytes
        # what of the reserve the loop may hold without a plan counting it (budgets.loop_allowance)
        self.loop_allowance_bytes = loop_allowance_bytes
        self.budget_shares = budget_shares  # blocks compiled alike, each planned for 1/n of it
        # the loss the prior assumes is surely the loop's (not a guess among several tables)
        self.loop_prior_certain = loop_prior_certain


def release_frames(exc: BaseException) -> None:
    """Clear the frames of ``exc``'s traceback and of every exception it was raised from or while
    handling (``__cause__``, ``__context__``): a NoPlanFits raised from a profiled step's
    out-of-memory error keeps that error, whose frames hold the step's device tensors (H200: 15.5
    GiB still allocated when the parameters were put back, which then ran out of memory)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def raised_past_dynamo(backend):
    """``backend`` (a torch.compile backend) with its ProtrainErrors reaching the caller as
    themselves: dynamo wraps what a backend raises in its ``BackendCompilerFailed`` (so ``except
    protrain_fx.NoPlanFits:`` around the first call caught nothing), except its own
    ``ShortenTraceback``, which it passes on with its frames trimmed. The error raised is of a
    class made from both: an instance of the error's own class (its attributes kept), and dynamo's
    frames left out of its traceback."""

    @functools.wraps(backend)
    def compile(*args, **kwargs):
        try:
            return backend(*args, **kwargs)
        except ProtrainError as e:
            from torch._dynamo.exc import ShortenTraceback

            if isinstance(e, ShortenTraceback):
                raise
            cls = type(e)
            if cls not in _PAST_DYNAMO:
                body = {
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "__reduce__": _as_raised,  # pickled as the plain class (a worker's error)
                }
                _PAST_DYNAMO[cls] = type(cls.__name__, (cls, ShortenTraceback), body)
            err = Exception.__new__(_PAST_DYNAMO[cls], *e.args)
            err.__dict__.update(e.__dict__)
            err.plain_state = dict(e.__dict__)  # what pickles (dynamo adds its own as it passes)
            err.first_useful_frame = sys._getframe()  # dynamo trims what is above it
            raise err.with_traceback(e.__traceback__) from e.__cause__

    return compile


_PAST_DYNAMO: dict[type, type] = {}


def _as_raised(err) -> tuple:
    plain = next(c for c in type(err).__mro__ if c in _PAST_DYNAMO)
    return (_rebuilt, (plain, err.args, err.plain_state))


def _rebuilt(cls, args, state):
    err = Exception.__new__(cls, *args)
    err.__dict__.update(state)
    return err
