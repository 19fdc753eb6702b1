"""The errors protrain raises on what it cannot do exactly: each says why and what to do instead.

``ProtrainError`` is the base (a ``RuntimeError``); ``OptionsError`` is a bad option (also a
``ValueError``); ``NoPlanFits`` is a budget no plan meets, with the smallest device or host budget
that would work.
"""

from __future__ import annotations


class ProtrainError(RuntimeError):
    """Base class of the errors protrain-fx raises on bad input."""


class OptionsError(ProtrainError, ValueError):
    """An option is unknown or has a bad value."""


class NoPlanFits(ProtrainError):
    def __init__(
        self, message: str, min_device_bytes: int | None = None, min_host_bytes: int | None = None
    ):
        super().__init__(message)
        self.min_device_bytes = min_device_bytes
        self.min_host_bytes = min_host_bytes
