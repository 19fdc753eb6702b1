"""The CPU optimizer's rate inside a training step, measured during the profiled step's warm-up run.

The hardware profile times the CPU AdamW step alone, once per machine, on pageable memory. Inside a
training step the same kernel runs on the host worker thread over pinned buffers, beside the
threads that queue backward and the copies between host and device, and the two rates differ by
host: on one H200 host alone 4.57 G params/s against about 3.6 inside steps, on another alone 3.58
against 3.7-3.96 inside steps (benchmarks/results/oom_sweep_h200.md). A constant factor between
them cannot fit both, so the profiler measures the rate where it is used: while the warm-up run of
the profiled step goes (its timings are discarded), every offloaded chunk whose gradients backward
hands over gets one CPU step of its size on scratch buffers in pinned memory, on the host worker,
in the order a training step gives them. Nothing of the model is touched. The rate is the
parameters stepped over the kernel time.
"""

from __future__ import annotations

import threading
import time

import torch

from protrain_fx.machine import measure, pinned
from protrain_fx.runtime.worker import WORKER

# elements of the scratch buffers: a chunk larger than this (an embedding of its own) is stepped
# in slices of it (the kernel's rate does not depend on the length past the caches)
SCRATCH_NUMEL = 16 << 20


class CpuStepProbe:
    def __init__(self):
        self.on = False
        self.pin = False
        self.params = 0
        self.seconds = 0.0
        self._scratch = None  # (tensors, out) of SCRATCH_NUMEL elements at most
        self._lock = threading.Lock()

    def start(self, pin: bool) -> None:
        """From now until :meth:`stop`, :meth:`chunk` steps scratch buffers (pinned if ``pin``)."""
        self.on, self.pin, self.params, self.seconds = True, pin, 0, 0.0

    def chunk(self, key: tuple, numel: int) -> None:
        """A chunk of ``numel`` parameters got its gradients: one CPU step of its size, queued on
        the host worker behind that chunk's other work (nothing while the probe is off)."""
        if self.on:
            WORKER.submit(key, self._step, numel)

    def _step(self, numel: int) -> None:
        with self._lock:
            if self._scratch is None:
                out = pinned.host_empty(SCRATCH_NUMEL, torch.bfloat16, pin=self.pin)
                self._scratch = (measure.adam_tensors(SCRATCH_NUMEL, "cpu", self.pin), out)
            (p,), (g,), (m,), (v,), steps = self._scratch[0]
            out = self._scratch[1]
            left = numel
            while left > 0:
                k = min(left, SCRATCH_NUMEL)
                step = measure.cpu_adam_stepper(
                    ([p[:k]], [g[:k]], [m[:k]], [v[:k]], steps), out[:k]
                )
                t0 = time.perf_counter()
                step()
                self.seconds += time.perf_counter() - t0
                self.params += k
                left -= k

    def stop(self) -> float | None:
        """Wait for the queued steps, free the scratch buffers; the measured parameters per second
        (None if nothing was stepped)."""
        if not self.on:
            return None
        self.on = False
        WORKER.wait()
        with self._lock:
            self._scratch = None
        return self.params / self.seconds if self.seconds > 0 else None


PROBE = CpuStepProbe()
