"""What the parent learns of and prepares on the machine before any child starts: the GPU's name and
memory (through NVML, so that the parent makes no CUDA context of its own), the host line of the
outputs, and the peers' packages: DeepSpeed and torchao from .whl/
(benchmarks/fetch_peer_wheels.sh), installed into PEER_SITE once per machine, in the background
while other systems compile, and put on the PYTHONPATH of those systems' children only
(:func:`scheduler.child_env`).
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys
import time

import timeshare
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_SITE = "/tmp/site"


def install_peer_wheels(lock_path: str | None, log: dict) -> str | None:
    """Install .whl/ (DeepSpeed sdist + wheels, torchao) into PEER_SITE once per machine; PEER_SITE,
    or None when there is nothing to install. As ../shared/reference/run_peers.sh: wheels with
    --no-deps, DeepSpeed's sdist with --no-build-isolation (its ops are JIT-built at first use).
    Never raises: what failed goes to ``log`` (the run's ``peer_install``) and the systems' own
    rows."""
    try:
        whl = os.path.join(ROOT, ".whl")
        wheels = sorted(glob.glob(os.path.join(whl, "*.whl")))
        sdists = sorted(glob.glob(os.path.join(whl, "*.tar.gz")))
        log["files"] = [os.path.basename(p) for p in wheels + sdists]
        if not wheels and not sdists:
            log["status"] = "no .whl/ folder: peers imported from the environment as it is"
            return None
        stamp = os.path.join(PEER_SITE, ".installed-from-whl")
        listing = "\n".join(log["files"])
        if os.path.exists(stamp) and open(stamp).read() == listing:
            log["status"] = f"already installed in {PEER_SITE}"
            return PEER_SITE
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            PEER_SITE,
        ]
        t0, errors = time.perf_counter(), []
        steps = ([pip + wheels] if wheels else []) + [
            pip + ["--no-build-isolation", s] for s in sdists
        ]
        with timeshare.busy(lock_path):  # nobody measures while pip runs
            for cmd in steps:
                p = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    env=dict(os.environ, DS_BUILD_OPS="0"),
                    check=False,
                )
                if p.returncode:
                    errors.append(f"{os.path.basename(cmd[-1])}: {(p.stderr or p.stdout)[-800:]}")
        if not errors:
            with open(stamp, "w") as f:
                f.write(listing)
        log.update(
            status="installed" if not errors else "installed with errors",
            errors=errors,
            seconds=round(time.perf_counter() - t0, 1),
        )
        print(
            f"peer wheels: {log['status']} into {PEER_SITE} ({log['seconds']:.0f} s)"
            f"{' ' if errors else ''}{' | '.join(errors)}",
            flush=True,
        )
        return PEER_SITE
    except Exception as e:  # noqa: BLE001 - the peers' rows will say what is missing
        log["status"] = f"failed: {type(e).__name__}: {e}"
        print(f"peer wheels: {log['status']}", flush=True)
        return None


def gpu_info() -> tuple[str, float]:
    """(name, GiB) of GPU 0 through NVML, so that the parent process makes no CUDA context of its
    own."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        total = pynvml.nvmlDeviceGetMemoryInfo(h).total
        return (name.decode() if isinstance(name, bytes) else name), total / 2**30
    except Exception:  # noqa: BLE001
        total = torch.cuda.get_device_properties(0).total_memory
        return torch.cuda.get_device_name(), total / 2**30


def host_description(avail: float | None, total: float | None) -> str:
    mem = (
        f", {total:.0f} GiB memory ({avail:.0f} GiB available at start)" if total and avail else ""
    )
    return f"{os.cpu_count()} CPU cores{mem}, Python {platform.python_version()}"
