"""protrain's own tensors are never inference tensors.

A graph may first be called under ``torch.inference_mode()`` (an evaluation before the model ever
trained, a frozen teacher's forward): what protrain makes then lasts (chunk buffers, chunk stores,
swap pools, the plan's placement), and an inference tensor cannot be written or saved for backward
outside that mode, so the training step after it would fail ("Inplace update to inference tensor
outside InferenceMode"). protrain's entry points (the backend's compile, a compiled graph's call)
run such a call with inference mode off and gradients off instead: what eager PyTorch computes
under ``torch.no_grad()``, the same values, returned as ordinary tensors.
"""

from __future__ import annotations

import functools

import torch


def never_inference_tensors(fn):
    """``fn`` run outside inference mode (with gradients off) when called inside it."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return run
