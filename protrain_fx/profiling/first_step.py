"""The first training step's own time, said in lines after the graph's ready line.

The ready line (protrain_fx/progress.py) ends the compile, but the first step still pays for what
only a first step does: compiled kernels loaded at their first launch, chunk and gradient buffers
allocated, the first uploads of offloaded chunks, the host worker's first CPU optimizer steps. On a
large offloaded model that is seconds with nothing said (the Llama-3.2-3B shape at 24 GiB on the
H200: 4.6 s for the first step against 0.7 s for the next ones, 2.2 s for the all-resident 1.42 B
GPT; `benchmarks/results/first_step_h200_run42.md`). So an automatic plan's graph says, once, how
long its first call ran, how long the backward of that call ran (its outputs' gradients to the end
of the backward pass), and when the user's first ``opt.step()`` returned after that backward (the
waits for the host worker's CPU steps and the user's own code in between included). Each is timed
on the host up to a device synchronize, taken only in this first step and only where the lines are
shown (the ``protrain_fx`` logger at INFO); later steps are never synchronized by protrain.
"""

from __future__ import annotations

import logging
import time

import torch

from protrain_fx import progress


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FirstStep:
    """The first call of one graph, its backward and the optimizer step after it."""

    def __init__(self, prog: progress.Progress, device: torch.device, optimizer=None):
        self.prog, self.device = prog, device
        self.optimizer = optimizer  # a weak reference to the user's optimizer, or None
        self.backward_start: float | None = None
        self.backward_end: float | None = None
        self.compiles_backward = False
        self.called = False
        self.done = False  # every line said (or none left to say)
        self._hook = None

    @staticmethod
    def shown(prog: progress.Progress) -> bool:
        return not isinstance(prog, progress.Silent) and progress.log.isEnabledFor(logging.INFO)

    def call_ran(self, out, started: float) -> None:
        """The graph's first call returned ``out``; it began at ``started`` (perf_counter)."""
        self.called = True
        _synchronize(self.device)
        kind = "forward" if torch.is_grad_enabled() else "call, without gradients"
        self.prog.line(f"first {kind} ran in {time.perf_counter() - started:.2f} s")
        outs = out if isinstance(out, (list, tuple)) else [out]
        wanting = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
        if not wanting:
            self.done = True
            return
        for t in wanting:  # whichever the backward starts from (the loss, or logits)
            t.register_hook(lambda grad: self._backward_started())

    def _backward_started(self) -> None:
        if self.backward_start is not None:
            return
        self.backward_start = time.perf_counter()
        # a graph compiled whole compiles its backward now, before its ready line
        self.compiles_backward = not self.prog.finished
        # after the last gradient of this backward pass (chunk_grads queues its own end-of-backward
        # work later, so that runs after this)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        _synchronize(self.device)
        self.backward_end = time.perf_counter()
        ran = self.backward_end - self.backward_start
        compiled = " (its compile included)" if self.compiles_backward else ""
        self.prog.line(f"first backward ran in {ran:.2f} s{compiled}")
        opt = self.optimizer() if self.optimizer is not None else None
        if opt is not None:  # removed by close(): not from inside torch's loop over the hooks
            self._hook = opt.register_step_post_hook(lambda o, a, k: self._optimizer_stepped())
        else:
            self.done = True

    def _optimizer_stepped(self) -> None:
        if self.done:
            return
        self.done = True
        _synchronize(self.device)
        after = time.perf_counter() - self.backward_end
        self.prog.line(
            f"first opt.step() returned {after:.2f} s after that backward (the CPU optimizer's "
            "steps it waited for and the loop's own code in between included)"
        )

    def close(self) -> None:
        """Remove the optimizer's hook (the graph's next call after the lines were said)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def watch(prog: progress.Progress, device: torch.device, optimizer=None) -> FirstStep | None:
    """A :class:`FirstStep` for a graph's first call, or None where its lines would not be shown."""
    return FirstStep(prog, device, optimizer) if FirstStep.shown(prog) else None
