"""Hardware profile (protrain_fx/machine/) on the CPU: measurement, the on-disk cache, live
memory."""

import dataclasses
import json
import math
import os

import pytest
import torch

from protrain_fx.machine import measure, memory, pinned, profile
from protrain_fx.machine.measure import hardware_profile
from protrain_fx.machine.memory import current_memory
from protrain_fx.machine.profile import HardwareProfile

RATES = (
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
    "duplex_bytes_per_s",
    "cpu_adam_params_per_s",
    "gpu_adam_params_per_s",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(profile.ENV_REFRESH, raising=False)
    monkeypatch.delenv(profile.ENV_CACHE_DIR, raising=False)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One real measurement for the module (about half a second on a 2-core box)."""
    folder = str(tmp_path_factory.mktemp("hw"))
    return hardware_profile("cpu", cache_dir=folder), folder


@pytest.fixture
def counting_measure(monkeypatch, measured):
    """Replace the measurement by a fast one that counts its calls."""
    calls = []

    def fake(device=None):
        calls.append(device)
        return dataclasses.replace(measured[0], cpu_adam_params_per_s=1e9 + len(calls))

    monkeypatch.setattr(measure, "measure_hardware", fake)
    return calls


def test_profile_on_cpu_is_positive_and_finite(measured):
    p, folder = measured
    assert p.device == "cpu"
    for name in RATES:
        v = getattr(p, name)
        assert isinstance(v, float) and math.isfinite(v) and v > 0, (name, v)
    assert p.gpu_adam_params_per_s == p.cpu_adam_params_per_s  # the CPU is the device
    assert 0 < p.device_free_bytes <= p.device_total_bytes
    assert 0 < p.host_available_bytes <= p.host_total_bytes
    assert p.pinned_limit_bytes is None or p.pinned_limit_bytes > 0
    assert p.cpu_cores >= 1 and p.cpu_threads >= 1 and p.copy_bytes > 0 and p.cpu_adam_numel > 0
    # the host's triad bandwidth, and the CPU step's bytes touched per second as a share of it
    # (issue 24.4; on this 2-core VM the step's five streams run faster than the triad's three)
    assert math.isfinite(p.host_triad_bytes_per_s) and p.host_triad_bytes_per_s > 1e8
    frac = p.cpu_adam_bandwidth_fraction()
    assert frac is not None and 0 < frac < 10
    assert f"{frac:.0%} of the host's triad bandwidth" in p.summary()
    # about 0.6 s on a 2-core box; generous for a loaded CI runner
    assert 0 < p.measure_seconds < 15
    assert p.measured_at
    # stored as JSON with a schema, and round-trips exactly
    (path,) = [f for f in os.listdir(folder) if f.endswith(".json")]
    with open(os.path.join(folder, path)) as f:
        data = json.load(f)
    assert data["schema"] == profile.SCHEMA_VERSION
    assert HardwareProfile.from_dict(data) == p
    assert HardwareProfile.from_dict(p.to_dict()) == p
    # atomic write left nothing behind
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]


def test_key_names_device_and_torch_version(measured):
    p, _ = measured
    assert torch.__version__ in p.key and p.torch_version == torch.__version__
    assert p.device_name and p.device_name in p.key
    assert p.key == profile.profile_key("cpu")
    assert f"cores={p.cpu_cores}" in p.key and f"threads={torch.get_num_threads()}" in p.key


def test_cache_hit_does_not_measure(measured, monkeypatch):
    p, folder = measured

    def boom(device=None):
        raise AssertionError("measured although a valid cache file exists")

    monkeypatch.setattr(measure, "measure_hardware", boom)
    again = hardware_profile("cpu", cache_dir=folder)
    assert again == p
    assert hardware_profile(None, cache_dir=folder) == p  # no CUDA here: None means the CPU


def test_refresh_measures_again(tmp_path, counting_measure, monkeypatch):
    first = hardware_profile("cpu", cache_dir=str(tmp_path))
    assert len(counting_measure) == 1
    assert hardware_profile("cpu", cache_dir=str(tmp_path)) == first
    assert len(counting_measure) == 1
    second = hardware_profile("cpu", cache_dir=str(tmp_path), refresh=True)
    assert len(counting_measure) == 2 and second != first
    # the refreshed one was stored
    assert hardware_profile("cpu", cache_dir=str(tmp_path)) == second
    monkeypatch.setenv(profile.ENV_REFRESH, "1")
    hardware_profile("cpu", cache_dir=str(tmp_path))
    assert len(counting_measure) == 3
    monkeypatch.setenv(profile.ENV_REFRESH, "0")
    hardware_profile("cpu", cache_dir=str(tmp_path))
    assert len(counting_measure) == 3


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        b"\xff\xfe\x00garbage",
        "[]",
        '{"schema": 0}',
        "OLD_SCHEMA",
        "MISSING_FIELD",
        "WRONG_TYPE",
        "NEGATIVE_RATE",
        "OTHER_KEY",
        "",
    ],
)
def test_corrupt_or_stale_cache_is_measured_again(tmp_path, counting_measure, measured, content):
    path = profile.cache_path(profile.profile_key("cpu"), str(tmp_path))
    good = measured[0].to_dict()
    if content == "OLD_SCHEMA":
        content = json.dumps({**good, "schema": profile.SCHEMA_VERSION - 1})
    elif content == "MISSING_FIELD":
        content = json.dumps({k: v for k, v in good.items() if k != "h2d_bytes_per_s"})
    elif content == "WRONG_TYPE":
        content = json.dumps({**good, "device_total_bytes": "lots"})
    elif content == "NEGATIVE_RATE":
        content = json.dumps({**good, "d2h_bytes_per_s": -1.0})
    elif content == "OTHER_KEY":
        content = json.dumps({**good, "key": "device=cuda:Some GPU|torch=0.0"})
    os.makedirs(tmp_path, exist_ok=True)
    with open(path, "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())
    p = hardware_profile("cpu", cache_dir=str(tmp_path))
    assert len(counting_measure) == 1
    with open(path) as f:
        assert HardwareProfile.from_dict(json.load(f)) == p  # overwritten with a valid profile


def test_env_cache_dir_and_unwritable_dir(tmp_path, counting_measure, monkeypatch):
    monkeypatch.setenv(profile.ENV_CACHE_DIR, str(tmp_path / "root"))
    hardware_profile("cpu")
    assert [f for f in os.listdir(tmp_path / "root" / "hardware") if f.endswith(".json")]
    # a cache "folder" that is a file: the profile is still returned, just not cached
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = hardware_profile("cpu", cache_dir=str(blocker))
    assert p.cpu_adam_params_per_s > 0 and len(counting_measure) == 2


def test_from_dict_ignores_unknown_and_needs_required(measured):
    d = measured[0].to_dict()
    assert HardwareProfile.from_dict({**d, "future_field": 1}) == measured[0]
    with pytest.raises(ValueError):
        HardwareProfile.from_dict({k: v for k, v in d.items() if k != "key"})
    # extras have defaults: a synthetic profile (for cost-model tests) needs only the documented
    # fields
    extras = {
        f.name for f in dataclasses.fields(HardwareProfile) if f.default is not dataclasses.MISSING
    }
    minimal = {k: v for k, v in d.items() if k not in extras}
    assert HardwareProfile.from_dict(minimal).h2d_bytes_per_s == measured[0].h2d_bytes_per_s


def test_current_memory_is_live_and_sane():
    free, total, host_available, host_total = current_memory("cpu")
    assert all(isinstance(x, int) for x in (free, total, host_available, host_total))
    assert 0 < host_available <= host_total and (free, total) == (host_available, host_total)
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            mem_total = (
                int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
            )
        assert host_total <= mem_total
    # 1 GiB touched: live numbers see some of it go. MemAvailable is the kernel's estimate (the
    # page cache it would reclaim counts in part: on the CI VM 512 MiB touched lowered it by 94-212
    # MiB), and other processes (a second test worker) allocate and free meanwhile, so one of a few
    # tries must see a drop of 64 MiB
    seen = []
    for _ in range(5):
        before = current_memory("cpu")[2]
        big = torch.ones(1 << 30, dtype=torch.uint8)
        seen.append(before - current_memory("cpu")[2])
        del big
        if seen[-1] > 64 << 20:
            break
    assert seen[-1] > 64 << 20, seen


def test_stated_host_memory_replaces_a_ballooned_total(monkeypatch):
    """$PROTRAIN_HOST_MEMORY: the stated total, less what is in use now (a cgroup limit still
    caps it)."""
    monkeypatch.setattr(memory, "_read_meminfo", lambda: (20 << 30, 31 << 30))  # 11 GiB in use
    monkeypatch.setattr(memory, "_cgroup_memory", lambda: None)
    assert memory.host_memory() == (20 << 30, 31 << 30)
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "240GiB")
    assert memory.host_memory() == (229 << 30, 240 << 30)
    monkeypatch.setattr(memory, "_cgroup_memory", lambda: (100 << 30, 128 << 30))
    assert memory.host_memory() == (100 << 30, 128 << 30)
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "lots")
    with pytest.raises(memory.ProtrainError, match="PROTRAIN_HOST_MEMORY"):
        memory.host_memory()


def test_unsupported_devices():
    with pytest.raises(memory.ProtrainError):
        memory.resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(memory.ProtrainError):
            memory.resolve_device("cuda")


def test_registered_host_memory_is_exact_and_unregistered_with_its_last_view(monkeypatch):
    """Where torch's pinned allocator rounds blocks up to a power of two (torch 2.11 has no setting
    against it), chunk-sized blocks are anonymous memory of their exact size, page-locked in place;
    the registration ends (and the memory goes) when the last tensor over it is freed, not before.
    """
    calls = []
    monkeypatch.setattr(pinned, "_host_register", lambda ptr, n: calls.append(("register", ptr, n)))
    monkeypatch.setattr(pinned, "_host_unregister", lambda ptr: calls.append(("unregister", ptr)))
    monkeypatch.setattr(pinned, "_pinned_exact", False)
    monkeypatch.setattr(pinned, "PINNED_EXACT_ABOVE_MB", 0)
    t = pinned.pinned_empty(1000, torch.float32)
    assert t.shape == (1000,) and t.dtype == torch.float32
    assert calls == [("register", t.data_ptr(), 4000)]
    t.copy_(torch.arange(1000.0))
    view = t[10:20]
    del t
    import gc

    gc.collect()
    assert len(calls) == 1  # a view still holds the memory
    assert view.tolist() == [float(i) for i in range(10, 20)]
    del view
    gc.collect()
    assert calls[-1][0] == "unregister" and calls[-1][1] == calls[0][1]
    assert pinned.registered_host_empty(0, torch.bfloat16).numel() == 0
    small = []  # blocks at or under the threshold stay with torch's allocator
    monkeypatch.setattr(pinned, "PINNED_EXACT_ABOVE_MB", 1)
    monkeypatch.setattr(pinned.torch, "empty", lambda *a, **k: small.append(k) or torch.zeros(1))
    pinned.pinned_empty(1000, torch.float32)
    assert small == [{"dtype": torch.float32, "pin_memory": True}]


def test_a_torch_without_the_pinned_rounding_settings_is_not_an_error(monkeypatch):
    """torch 2.11 refuses ``pinned_max_round_threshold_mb`` with a ValueError ("Unrecognized key"):
    protrain then pins large blocks itself (registered_host_empty) instead of failing the compile.
    """

    def refuse(settings):
        raise ValueError(
            "Unrecognized key 'pinned_max_round_threshold_mb' in Accelerator allocator config."
        )

    monkeypatch.setattr(pinned, "_pinned_exact", None)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    assert pinned.exact_pinned_blocks() is False


def test_every_pinned_host_buffer_goes_through_pinned_empty():
    """torch 2.11 pins a block at the next power of two: a chunk's Adam moments and gradient pinned
    through ``torch.empty(..., pin_memory=True)`` took twice the plan's host bytes (run 5's 96-layer
    model was killed by the host's OOM killer). Only machine/pinned.py (and the bandwidth
    measurement) allocates pinned memory; everything else asks pinned.pinned_empty, which is
    exact-size."""
    import pathlib
    import re

    root = pathlib.Path(profile.__file__).parent.parent
    offenders = []
    for path in list(root.rglob("*.py")) + list((root.parent / "passes").glob("*.py")):
        if path.relative_to(root.parent).as_posix() in (
            "protrain_fx/machine/pinned.py",
            "protrain_fx/machine/measure.py",
        ):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pin_memory\s*=|\.pin_memory\(", line.split("#")[0]):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_measuring_leaves_the_random_numbers_alone(tmp_path):
    """The hardware profile is measured inside the first compiled call on a new machine: it must
    not move torch's global generator (a data order or a dropout mask drawn after it would differ
    from eager's on that run only)."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    hardware_profile("cpu", refresh=True, cache_dir=str(tmp_path))
    assert torch.equal(torch.get_rng_state(), before)
