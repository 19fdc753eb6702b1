"""How much memory there is, live: the device's total and free (torch, cross-checked with NVML), the
host's total and available (``/proc/meminfo`` capped by the process's cgroup limit), the
locked-memory limit, the usable cores. Budgets read these, never a cached profile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re

import torch

from protrain_fx import config
from protrain_fx.errors import ProtrainError
from protrain_fx.options import parse_bytes

log = logging.getLogger(__name__)

_UNLIMITED = 1 << 60  # cgroup "no limit" values are near 2**63


def current_memory(
    device: str | torch.device | None = None, *, include_allocator_cache: bool = False
) -> tuple[int, int, int, int]:
    """Live ``(device_free, device_total, host_available, host_total)`` in bytes, never cached.

    ``device_free`` is the driver's free memory (``torch.cuda.mem_get_info``); memory that this
    process's caching allocator reserved but does not use counts as used, unless
    ``include_allocator_cache`` adds it (``memory_reserved - memory_allocated``: reusable by this
    process, though maybe fragmented). On a CPU device the device numbers are the host's."""
    dev = resolve_device(device)
    host_available, host_total = host_memory()
    if dev.type != "cuda":
        return host_available, host_total, host_available, host_total
    free, total = torch.cuda.mem_get_info(dev)
    if include_allocator_cache:
        free += max(0, torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    return int(free), int(total), host_available, host_total


def placed_bytes(device: torch.device, params: list, optimizer=None) -> int:
    """Device bytes that a plan of ``params`` (its resident ones: the caller leaves out offloaded
    parameters, views of host memory) places itself, so not another's: the parameters', their
    gradients' and, with ``optimizer``, their optimizer state's (Adam's moments, made at the first
    step), each storage once. A re-plan after steps that counted the moments and gradients of
    resident chunks as another's (the 1B shape at 16 GiB on the H200: 7.18 GiB) found no plan in
    the budget left."""
    storages: dict[int, int] = {}
    state = getattr(optimizer, "state", None) or {}
    for p in params:
        if p is None:
            continue
        for t in (p, p.grad, *(state[p].values() if p in state else ())):
            if isinstance(t, torch.Tensor) and t.device == device:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


# ------------------------------------------------------------------------------------------ machine
# facts
def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_model()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        for field in ("model name", "Model", "Hardware", "cpu model", "CPU part"):
            m = re.search(rf"^{field}\s*:\s*(.+)$", info, re.MULTILINE)
            if m and m.group(1).strip():
                return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memlock_limit() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, AttributeError, ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def host_memory() -> tuple[int, int]:
    """Live ``(available, total)`` host RAM in bytes: ``/proc/meminfo``
    ``MemAvailable``/``MemTotal``, capped by the memory limits of this process's cgroup and its
    ancestors (a container's limit is what pinned pools run into); elsewhere ``psutil`` if it is
    installed, else ``sysconf``.

    ``$PROTRAIN_HOST_MEMORY`` (bytes, or with a unit: ``240GiB``, ``256GB``) states the total
    instead, for virtual machines whose ``MemTotal`` starts small and grows as memory is touched (a
    ballooned guest); available is then that total less what is in use now."""
    meminfo = _read_meminfo()
    if meminfo is not None:
        available, total = meminfo
    else:
        available, total = _portable_host_memory()
    stated = config.settings().host_memory
    if stated:
        in_use = max(0, total - available)
        total = parse_bytes(stated.strip(), what="PROTRAIN_HOST_MEMORY")
        available = max(0, total - in_use)
    cg = _cgroup_memory()
    if cg is not None:
        cg_available, cg_limit = cg
        total = min(total, cg_limit)
        available = min(available, cg_available)
    return max(0, int(available)), max(0, int(total))


def _read_meminfo() -> tuple[int, int] | None:
    try:
        with open("/proc/meminfo") as f:
            fields = {}
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[name] = int(parts[0]) * (
                        1024 if len(parts) > 1 and parts[1] == "kB" else 1
                    )
    except (OSError, ValueError):
        return None
    if "MemTotal" not in fields:
        return None
    available = fields.get("MemAvailable")
    if available is None:  # kernels before 3.14
        available = fields.get("MemFree", 0) + fields.get("Buffers", 0) + fields.get("Cached", 0)
    return available, fields["MemTotal"]


def _portable_host_memory() -> tuple[int, int]:
    try:
        import psutil  # optional, not a dependency

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        try:
            available = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            available = total
        return available, total
    except (ValueError, OSError, AttributeError):
        return 0, 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: str, names: tuple[str, ...]) -> int:
    try:
        with open(path) as f:
            stats = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
    except (OSError, ValueError):
        return 0
    for name in names:
        if name in stats:
            try:
                return int(stats[name])
            except ValueError:
                return 0
    return 0


def _cgroup_memory() -> tuple[int, int] | None:
    """``(available, limit)`` under the tightest finite cgroup memory limit on the way from this
    process's cgroup to the root (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); available =
    limit - (usage - inactive file cache, which the kernel reclaims). None when no finite limit is
    found."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []  # (folder, limit file, usage file, stat names)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2
            candidates.append(
                ("/sys/fs/cgroup", rel, "memory.max", "memory.current", ("inactive_file",))
            )
        elif "memory" in controllers.split(","):  # v1
            candidates.append(
                (
                    "/sys/fs/cgroup/memory",
                    rel,
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                    ("total_inactive_file", "inactive_file"),
                )
            )
    best = None
    seen = set()
    for mount, rel, limit_file, usage_file, stat_names in candidates:
        rel = rel.strip("/")
        # the process's cgroup, then its ancestors (only the ones visible in this namespace)
        while True:
            folder = os.path.join(mount, rel) if rel else mount
            if folder not in seen:
                seen.add(folder)
                limit = _read_int(os.path.join(folder, limit_file))
                if limit is not None and 0 < limit < _UNLIMITED:
                    usage = _read_int(os.path.join(folder, usage_file)) or 0
                    inactive = _read_stat(os.path.join(folder, "memory.stat"), stat_names)
                    available = max(0, limit - max(0, usage - inactive))
                    best = (
                        (available, limit)
                        if best is None
                        else (min(best[0], available), min(best[1], limit))
                    )
            if not rel:
                break
            rel = os.path.dirname(rel)
    return best


@contextlib.contextmanager
def nvml_device(dev: torch.device):
    """Yields ``(pynvml, handle)`` for ``dev`` (matched by UUID, so ``CUDA_VISIBLE_DEVICES`` and
    ``CUDA_DEVICE_ORDER`` cannot pick another GPU; else torch's own index mapping when the names
    agree), or ``None`` when pynvml, the driver library or the match is missing; NVML is shut down
    afterwards."""
    try:
        import pynvml
    except Exception:  # noqa: BLE001 - any import problem just means no NVML
        yield None
        return
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - pynvml raises its own NVMLError subclasses
        log.debug("protrain: pynvml unavailable: %s", e)
        yield None
        return
    try:
        handle = None
        candidates = _uuid_candidates(getattr(torch.cuda.get_device_properties(dev), "uuid", None))
        for candidate in candidates:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(candidate)
                break
            except Exception:  # noqa: BLE001
                continue
        # torch's own index mapping (honours CUDA_VISIBLE_DEVICES), if the names agree
        if handle is None:
            with contextlib.suppress(Exception):
                # private
                h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(dev))
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else name
                if name == torch.cuda.get_device_name(dev):
                    handle = h
        if handle is None:
            log.debug("protrain: no NVML device matches %s (UUIDs tried: %s)", dev, candidates)
        yield None if handle is None else (pynvml, handle)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def nvml_memory(dev: torch.device, torch_total: int) -> tuple[int | None, int | None]:
    """``(total, free)`` of ``dev`` according to pynvml (:func:`nvml_device`), or ``(None, None)``.
    Logs a warning when the totals disagree by more than 5%."""
    with nvml_device(dev) as found:
        if found is None:
            return None, None
        pynvml, handle = found
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception as e:  # noqa: BLE001
            log.debug("protrain hardware profile: pynvml query failed: %s", e)
            return None, None
    total, free = int(info.total), int(info.free)
    if torch_total and abs(total - torch_total) > 0.05 * torch_total:
        log.warning(
            "protrain hardware profile: NVML reports %d bytes on %s, torch %d",
            total,
            dev,
            torch_total,
        )
    return total, free


def _uuid_candidates(u) -> list[str]:
    """NVML spells a UUID ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``; torch's ``_CUuuid`` prints
    the hex part (and has ``bytes``): try every spelling."""
    if u is None:
        return []
    out = []
    raw = getattr(u, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        h = raw.hex()
        out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    text = str(u).strip()
    if text:
        out += [text] if text.startswith(("GPU-", "MIG-")) else [f"GPU-{text}", text, f"MIG-{text}"]
    return list(dict.fromkeys(out))


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None`` -> the current CUDA device if there is one, else the CPU; ``"cuda"`` ->
    ``cuda:<current>``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ProtrainError(f"protrain hardware profile: unsupported device {dev} (cuda or cpu)")
    if not torch.cuda.is_available():
        raise ProtrainError(f"protrain hardware profile: {dev} requested but CUDA is not available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    return torch.device("cuda", index)


def pinnable_host(device, freed: int, n_peers: int) -> int:
    """The host memory a plan may pin: what is available now, plus ``freed`` (host memory the
    plan's store takes over), less a reserve; each of ``n_peers`` blocks of a regional compilation
    offloads its share."""
    _, _, avail, total = current_memory(device)
    return (avail + freed - max(2 << 30, int(0.05 * total))) // n_peers
