"""Hardware profile: what the machine can move and compute, for the cost model and the plan search.

Measured (quickly: about 0.6 s on a 2-core CPU box; meant to stay under ~3 s on an H200 machine):

- **copy bandwidth** between pinned host memory and the device: host->device alone, device->host
  alone, and both at once (total bytes over the time until both are done). On CUDA: ``COPY_BYTES``
  (256 MiB) uint8 buffers, pinned by torch's pinned allocator (the one the chunk store and swap pool
  use), one warm-up, the median of a few timed repetitions, timed with CUDA events on two dedicated
  streams so the duplex copies really run concurrently (each on its own copy engine). On a CPU
  device the same copies are real host memcpys (duplex: two threads).
- **AdamW throughput** in parameters per second over one flat fp32 tensor with fp32 gradients and
  moments: on the CPU the step ``runtime/hybrid_optim.py`` runs for an offloaded chunk
  (``cpu_adam``'s one pass that also writes the bf16 transfer copy, or torch's fused AdamW and a
  copy where the kernel does not build; timed with ``perf_counter``), on the device torch's fused
  AdamW (``torch.optim.adam.adam(..., fused=True)``, what resident chunks pay, timed with events; on
  a CPU device the CPU number).
- **memory**: device total and free (``torch.cuda.mem_get_info``, cross-checked against pynvml when
  it loads), host total and available (``/proc/meminfo`` ``MemAvailable``, capped by the process's
  cgroup memory limit), and ``RLIMIT_MEMLOCK``.

Why cached: bandwidths and optimizer rates belong to the machine, not the model, and re-measuring
them on every compile would cost seconds and disturb a device that may already be busy. The profile
is stored as JSON, one file per key (device name, torch version, host name, CPU model, usable cores,
torch threads), under ``cache_dir``, else ``$PROTRAIN_CACHE_DIR/hardware``, else
``~/.cache/protrain_fx/hardware`` (``$XDG_CACHE_HOME`` respected). ``refresh=True`` or
``PROTRAIN_REFRESH_HARDWARE=1`` re-measures; a corrupt file, another schema or another key is
re-measured and overwritten, never an error. Writes are atomic (temporary file + ``os.replace``)
and, where ``fcntl`` exists, processes measuring the same key take turns (a second rank waits and
then reads the first one's file instead of measuring while the first one copies).

The memory numbers in a profile are a snapshot of when it was measured, kept for information only:
budgets must use :func:`current_memory`, which reads live values and is never cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import socket
import uuid
from dataclasses import dataclass

import torch

from protrain_fx import config
from protrain_fx.machine.memory import (
    cpu_model,
    device_name,
    resolve_device,
    usable_cores,
)

log = logging.getLogger(__name__)

# 2: the CPU rate is that of the step runtime/hybrid_optim.py runs (one-pass kernel or torch + copy)
SCHEMA_VERSION = 5  # 3: host_triad_bytes_per_s; 4: gpu_sustained_slowdown;
# 5: cpu_adam_masters_params_per_s


ENV_CACHE_DIR = "PROTRAIN_CACHE_DIR"

ENV_REFRESH = "PROTRAIN_REFRESH_HARDWARE"


@dataclass(frozen=True)
class HardwareProfile:
    """One machine's measured rates and memory (see the module docstring). Rates are per second;
    bytes are bytes. Fields after ``measured_at`` are extras with defaults, so a synthetic profile
    (cost-model tests) needs only the first ones.

    ``pinned_limit_bytes`` is a cap on pinned host memory beyond host RAM, None when there is none
    known (so far always: torch pins through the CUDA driver, which does not charge
    ``RLIMIT_MEMLOCK``; the rlimit is kept in ``memlock_limit_bytes`` for information). Host RAM,
    live, comes from :func:`current_memory`."""

    key: str
    device: str
    device_name: str
    torch_version: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    cpu_adam_params_per_s: float
    gpu_adam_params_per_s: float
    device_total_bytes: int
    device_free_bytes: int
    host_total_bytes: int
    host_available_bytes: int
    pinned_limit_bytes: int | None
    measured_at: str
    # extras
    hostname: str = ""
    cpu_model: str = ""
    cpu_cores: int = 0  # usable cores (sched_getaffinity)
    cpu_threads: int = 0  # torch.get_num_threads() when measured
    # RLIMIT_MEMLOCK soft limit if finite (informative, see below)
    memlock_limit_bytes: int | None = None
    # pynvml's view of the device, None without pynvml / on CPU
    nvml_total_bytes: int | None = None
    nvml_free_bytes: int | None = None
    copy_bytes: int = 0  # bytes per copy in the bandwidth measurement
    cpu_adam_numel: int = 0
    gpu_adam_numel: int = 0
    measure_seconds: float = 0.0
    cpu_adam_kind: str = ""  # which CPU step cpu_adam_params_per_s timed
    host_triad_bytes_per_s: float = 0.0  # the host's memory bandwidth (STREAM triad), 0: unknown
    # dense matrix products kept back to back for seconds against one after an idle second: the
    # device at its power limit runs a lower clock than the profiled blocks saw (1.0 on the CPU)
    gpu_sustained_slowdown: float = 1.0
    # the CPU step of an offloaded chunk that keeps no transfer copy (Knobs.transfer_copies False):
    # the same step writing no bf16 copy; 0: not measured (cpu_adam_params_per_s then)
    cpu_adam_masters_params_per_s: float = 0.0

    def cpu_adam_bytes_per_param(self) -> int:
        """Host memory bytes one parameter's CPU step touches: the one-pass kernel reads parameter,
        gradient and both moments and writes parameter, moments and the bf16 copy (30); torch's
        fused Adam then a copy sweeps twice (28 + 6)."""
        return 30 if self.cpu_adam_kind.startswith("one-pass") else 34

    def cpu_adam_bandwidth_fraction(self) -> float | None:
        """The CPU step's rate in bytes touched per second as a fraction of the triad bandwidth
        (None when the bandwidth is unknown)."""
        if not self.host_triad_bytes_per_s:
            return None
        bytes_per_s = self.cpu_adam_params_per_s * self.cpu_adam_bytes_per_param()
        return bytes_per_s / self.host_triad_bytes_per_s

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["schema"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d) -> HardwareProfile:
        """Inverse of :meth:`to_dict`. Raises ``ValueError`` on another schema, a missing field, a
        value of the wrong type or a rate that is not positive and finite; unknown keys are ignored.
        """
        if not isinstance(d, dict):
            raise ValueError(f"hardware profile must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(
                f"hardware profile schema {d.get('schema')!r}, expected {SCHEMA_VERSION}"
            )
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"hardware profile lacks {f.name!r}")
                continue
            kwargs[f.name] = _coerce(f.name, f.type, d[f.name])
        profile = cls(**kwargs)
        profile._validate()
        return profile

    def _validate(self) -> None:
        for name in (
            "h2d_bytes_per_s",
            "d2h_bytes_per_s",
            "duplex_bytes_per_s",
            "cpu_adam_params_per_s",
            "gpu_adam_params_per_s",
        ):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"hardware profile {name}={v!r} is not a positive finite rate")
        for name in (
            "device_total_bytes",
            "device_free_bytes",
            "host_total_bytes",
            "host_available_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware profile {name} is negative")

    def summary(self) -> str:
        G = 1e9
        return (
            f"{self.device} ({self.device_name}), torch {self.torch_version}: "
            f"h2d {self.h2d_bytes_per_s / G:.1f} GB/s, d2h {self.d2h_bytes_per_s / G:.1f} "
            "GB/s, "
            f"both {self.duplex_bytes_per_s / G:.1f} GB/s; AdamW cpu "
            f"{self.cpu_adam_params_per_s / G:.2f} "
            f"G params/s{self._bandwidth_note()} "
            f"({self.cpu_adam_masters_params_per_s / G:.2f} without the bf16 copy), device "
            f"{self.gpu_adam_params_per_s / G:.2f} "
            f"G params/s; sustained compute {self.gpu_sustained_slowdown:.3f}x slower; device "
            f"{self.device_free_bytes / 2**30:.1f}/{self.device_total_bytes / 2**30:.1f} GiB "
            "free, host "
            f"{self.host_available_bytes / 2**30:.1f}/{self.host_total_bytes / 2**30:.1f} GiB "
            "available"
        )

    def _bandwidth_note(self) -> str:
        frac = self.cpu_adam_bandwidth_fraction()
        if frac is None:
            return ""
        return (
            f" ({frac:.0%} of the host's triad bandwidth, "
            f"{self.host_triad_bytes_per_s / 1e9:.1f} GB/s, at "
            f"{self.cpu_adam_bytes_per_param()} B per parameter)"
        )


def _coerce(name: str, annotation: str, value):
    kind = str(annotation).replace(" ", "")
    if value is None and kind.endswith("|None"):
        return None
    if kind.startswith("str"):
        if not isinstance(value, str):
            raise ValueError(f"hardware profile {name} must be a string")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"hardware profile {name} must be a number, got {value!r}")
    if kind.startswith("int"):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"hardware profile {name} must be an integer, got {value!r}")
        return int(value)
    return float(value)


# ------------------------------------------------------------------------------------ public entry
# points


def profile_key(device: str | torch.device | None = None) -> str:
    """The cache key: device name, torch version, host name, CPU model, usable cores and torch
    threads (the CPU Adam rate depends on the last two). Devices of the same name on one host share
    a profile."""
    dev = resolve_device(device)
    return (
        f"device={dev.type}:{device_name(dev)}|torch={torch.__version__}|host={socket.gethostname()}"
        f"|cpu={cpu_model()}|cores={usable_cores()}|threads={torch.get_num_threads()}"
    )


def cache_root() -> str:
    """Where protrain keeps what it measures or builds per machine (this profile, the CPU Adam
    kernel)."""
    root = config.settings().cache_dir
    if not root:
        xdg = config.settings().xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "protrain_fx")
    return root


def cache_dir_default() -> str:
    return os.path.join(cache_root(), "hardware")


def cache_path(key: str, cache_dir: str | None = None) -> str:
    """``<dir>/<readable part of the key>-<hash of the key>.json``."""
    name = key.split("|")[0].removeprefix("device=")
    torch_part = next((p for p in key.split("|") if p.startswith("torch=")), "")
    slug = re.sub(r"[^A-Za-z0-9.+]+", "_", f"{name}-{torch_part.removeprefix('torch=')}").strip(
        "_"
    )[:80]
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir or cache_dir_default(), f"{slug}-{digest}.json")


# ------------------------------------------------------------------------------------------------
# cache
def _for_device(profile: HardwareProfile, dev: torch.device) -> HardwareProfile:
    """A cached profile serves every device of the same name on the host: report the one asked
    for."""
    return profile if profile.device == str(dev) else dataclasses.replace(profile, device=str(dev))


def _load(path: str, key: str) -> HardwareProfile | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning("protrain: unreadable hardware profile %s (%s): measuring again", path, e)
        return None
    try:
        profile = HardwareProfile.from_dict(data)
    except (ValueError, TypeError, KeyError) as e:
        log.warning("protrain: invalid hardware profile %s (%s): measuring again", path, e)
        return None
    if profile.key != key:
        log.warning(
            "protrain: hardware profile %s is for %r, not %r: measuring again",
            path,
            profile.key,
            key,
        )
        return None
    return profile


def cached(device: str | torch.device | None = None) -> HardwareProfile | None:
    """The cached profile of ``device``, or None: never measures (the runtime asks mid-training)."""
    key = profile_key(device)
    return _load(cache_path(key), key)


def write_json(path: str, data, what: str) -> None:
    """Atomic JSON write (a temporary file in the same folder, then ``os.replace``), for every file
    protrain caches (hardware profile, step rates, plan cache entries); a folder that cannot be
    written is a warning naming ``what``, never an error (measured or searched again next time)."""
    folder = os.path.dirname(path)
    tmp = os.path.join(
        folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    )
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("protrain: could not write %s at %s: %s", what, path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _store(path: str, profile: HardwareProfile) -> None:
    write_json(path, profile.to_dict(), "the hardware profile")


@contextlib.contextmanager
def _key_lock(path: str):
    """An exclusive ``flock`` on ``<path>.lock`` while measuring, so that processes on one host
    (ranks) neither measure at the same time (they would share the host's memory bandwidth) nor
    twice; nothing where ``fcntl`` is missing or the folder cannot be written."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. a file system without locks
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock
