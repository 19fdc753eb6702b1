"""Run benchmark subprocesses side by side while they compile, and let them measure one at a time.

Compiling a 1.4 B model takes a minute or more of host time per configuration, measuring it a few seconds;
the GPU machine is lent by the minute. So a parent starts a batch of children at once (``run_batch``); each
child compiles and warms up, then enters ``measure_turn()``: it waits until every child of the batch is ready
(or has exited), then takes an exclusive file lock, so timed sections never overlap each other nor anyone's
compilation. Children measure per-process quantities only (their own CUDA events, peak counters, timers), so a
neighbour idling in the lock queue does not change them; the batch must fit in device and host memory together.

Without the parent's environment (a child run by hand) ``measure_turn()`` does nothing.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import time

DIR_ENV = "PROTRAIN_BENCH_TURNS_DIR"
N_ENV = "PROTRAIN_BENCH_TURNS_N"
ID_ENV = "PROTRAIN_BENCH_TURNS_ID"


def _ready(d: str, i: str) -> None:
    with open(os.path.join(d, f"ready_{i}"), "w"):
        pass


@contextlib.contextmanager
def measure_turn(wait_s: float = 900.0):
    """Inside: no other child of the batch is compiling or measuring."""
    d, n, i = os.environ.get(DIR_ENV), os.environ.get(N_ENV), os.environ.get(ID_ENV)
    if not d:
        yield
        return
    _ready(d, i)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sum(f.startswith("ready_") for f in os.listdir(d)) >= int(n):
            break
        time.sleep(0.2)
    with open(os.path.join(d, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_batch(argvs: list[list[str]], env: dict, timeout: float) -> list[tuple[int, str, str]]:
    """Run the commands together; returns (returncode, stdout, stderr) of each, in order. A child that exits
    (or is killed at ``timeout``) before its turn counts as ready, so the others never wait for it."""
    with tempfile.TemporaryDirectory(prefix="turns_") as d:
        procs = []
        for i, argv in enumerate(argvs):
            out = open(os.path.join(d, f"out_{i}"), "w+")
            err = open(os.path.join(d, f"err_{i}"), "w+")
            e = dict(env, **{DIR_ENV: d, N_ENV: str(len(argvs)), ID_ENV: str(i)})
            procs.append((subprocess.Popen(argv, stdout=out, stderr=err, env=e, text=True), out, err))
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(procs)
        while any(c is None for c in codes):
            for i, (p, _, _) in enumerate(procs):
                if codes[i] is None:
                    if p.poll() is not None:
                        codes[i] = p.returncode
                        _ready(d, str(i))
                    elif time.monotonic() > deadline:
                        p.kill()
                        p.wait()
                        codes[i] = -9
                        _ready(d, str(i))
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
