"""benchmarks/oom_sweep.py's bookkeeping on the CPU (its rows run on the GPU): the counts the issue
asks for, the table, and the summary of an allocator snapshot."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import oom_sweep  # noqa: E402


def _row(id_, system="protrain", **kw):
    model, shape = id_.split("/")[:2]
    batch, seq = (int(x) for x in shape[1:].split("s"))
    return dict(id=id_, model=model, batch=batch, seq=seq, system=system, **kw)


def test_counts_and_table():
    ref = _row("m/b1s8/compile", system="compile", outcome="trained", losses=[2.0, 1.0])
    good = _row(
        "m/b1s8/cap16/default",
        outcome="trained",
        losses=[2.0, 1.001],
        predicted_peak_reserved_gib=10.0,
        peak_reserved_gib=10.2,
        predicted_peak_allocated_gib=9.8,
        peak_allocated_gib=9.9,
        alloc_retries=3,
        predicted_step_s=1.0,
        measured_step_s=1.2,
        plan=dict(chunks=4, chunk_size=2**26, n_persist=1, n_buffer=1, n_swap=0, n_checkpoint=2),
    )
    nan = _row("m/b1s8/cap16/segments", outcome="trained", losses=[2.0, float("nan")])
    oom = _row(
        "m/b1s8/cap24/default",
        outcome="oom",
        error="Traceback\n  File x\ntorch.OutOfMemoryError: CUDA out of memory.\n\nSet VERBOSE=1",
    )
    # a variant whose loop clips (SWEEP_CLIP): the unclipped reference says nothing of its losses
    clipped = _row("m/b1s8/cap16/default/clip", outcome="trained", losses=[2.0, 1.5], clip=1.0)
    rows = [ref, good, nan, oom, clipped]
    counts = oom_sweep.evaluate(rows)
    assert "max_loss_rel_vs_compile" not in clipped and clipped["finite"]
    # ... and, a variant (an id with a fifth part: set by hand for an A/B), it is not counted
    assert counts == dict(
        variants=1,
        protrain_rows=3,
        trained=2,
        no_plan_fits=0,
        oom=1,
        error=0,
        non_finite=1,
        outside_bf16_tolerance=1,  # the NaN row
        peak_err_over_5pct=0,  # +2%
        time_err_over_5pct=1,  # +20%
    )
    assert abs(good["peak_err"] - 0.02) < 1e-12 and abs(good["time_err"] - 0.2) < 1e-12
    text = oom_sweep.table(dict(device="d", torch="t", date="today", counts=counts, rows=rows))
    assert "Not counted: 1 variant rows" in text
    line = next(x for x in text.splitlines() if x.startswith("| m/b1s8/cap16/default"))
    assert "10.00 / 10.20 (+2.0%)" in line and "9.80 / 9.90 | 3 |" in line
    assert "1.000 / 1.200 (+20.0%)" in line and "persist 1" in line
    # the error column names the error, not the line after it
    oom_line = next(x for x in text.splitlines() if x.startswith("| m/b1s8/cap24/default"))
    assert "OutOfMemoryError: CUDA out of memory." in oom_line and "VERBOSE" not in oom_line


def test_snapshot_summary():
    def frame(name):
        return {"filename": f"/x/protrain_fx/{name}.py", "line": 1, "name": name}

    snap = {
        "segments": [
            {
                "stream": 0,
                "total_size": 3 << 30,
                "allocated_size": 1 << 30,
                "blocks": [
                    {"state": "active_allocated", "size": 1 << 30},
                    {"state": "inactive", "size": 2 << 30},
                ],
            }
        ],
        "device_traces": [
            [
                {
                    "action": "alloc",
                    "addr": 1,
                    "size": 1 << 20,
                    "stream": 0,
                    "frames": [frame("a")],
                },
                {"action": "segment_map", "addr": 9, "size": 2 << 20, "stream": 0},
                {
                    "action": "alloc",
                    "addr": 2,
                    "size": 2 << 20,
                    "stream": 0,
                    "frames": [frame("b")],
                },
                {"action": "free_completed", "addr": 1, "size": 1 << 20},
                {
                    "action": "alloc",
                    "addr": 3,
                    "size": 1 << 19,
                    "stream": 0,
                    "frames": [frame("c")],
                },
            ]
        ],
    }
    s = oom_sweep.summarize_snapshot(snap)
    assert s["streams"]["0"] == dict(
        segments=1, free_blocks=1, reserved_gib=3.0, allocated_gib=1.0, largest_free_gib=2.0
    )
    # the growth came with b's request; the traced peak (3 MiB) held a and b
    assert s["growth_events"] == [
        dict(action="segment_map", gib=0.002, request_mib=2.0, stream="0", where=["b.py:1:b"])
    ]
    assert s["traced_peak_gib_above_start"] == round(3 / 1024, 3)
    assert [x["where"] for x in s["largest_at_traced_peak"]] == [["b.py:1:b"], ["a.py:1:a"]]


def test_clock_windows(monkeypatch):
    """The SM clock sampler (through a stand-in NVML whose clock drops once the steps start)
    splits its samples at protrain's progress lines and the timed steps, and the table shows both
    means."""
    import logging
    import time
    import types

    state = {"mhz": 1980}
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=1,
        NVMLError=RuntimeError,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetClockInfo=lambda h, kind: state["mhz"],
        nvmlDeviceGetPowerUsage=lambda h: 650_000,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    clocks = oom_sweep.Clocks(0)
    log = logging.getLogger("protrain_fx.test_clock_windows")
    log.addHandler(clocks)
    log.setLevel(logging.INFO)

    def wait_samples(n):
        start = len(clocks.samples)
        deadline = time.monotonic() + 10
        while len(clocks.samples) < start + n and time.monotonic() < deadline:
            time.sleep(0.02)

    log.info("protrain [ 1.0 s] graph 0/0: profiling one step (1 + 2 runs)")
    wait_samples(3)
    log.info("protrain [ 2.0 s] graph 0/0: searching the plans under a budget of 1 GiB")
    state["mhz"] = 1755
    wait_samples(2)
    clocks.mark("steps_start")
    wait_samples(3)
    clocks.mark("steps_end")
    summary = clocks.summary()
    log.removeHandler(clocks)
    assert summary["profiling"]["sm_mhz_mean"] == 1980 and summary["profiling"]["samples"] >= 3
    assert summary["steps"]["sm_mhz_mean"] == 1755 and summary["steps"]["watts_mean"] == 650.0
    row = _row("m/b1s8/cap16/default", outcome="trained", losses=[2.0], clocks=summary)
    rows = [row]
    text = oom_sweep.table(
        dict(device="d", torch="t", date="today", counts=oom_sweep.evaluate(rows), rows=rows)
    )
    assert "SM clock profiled 1980 MHz, steps 1755 MHz (650 W)" in text


def test_host_column():
    """The host column: the plan's predicted buffers, then the resident set after the steps and
    at its peak, each above the baseline, and the peak's error against the prediction; rows
    without the measurements show a dash."""
    rows = [
        _row(
            "m/b1s8/cap16/default",
            outcome="trained",
            losses=[2.0],
            predicted_host_gib=40.0,
            rss_base_gib=3.5,
            rss_steps_gib=44.25,
            peak_rss_gib=50.0,
        ),
        _row("m/b1s8/cap16/segments", outcome="trained", losses=[2.0]),
    ]
    text = oom_sweep.table(
        dict(device="d", torch="t", date="today", counts=oom_sweep.evaluate(rows), rows=rows)
    )
    lines = {x.split(" | ")[0]: x.split(" | ") for x in text.splitlines() if x.startswith("| m/")}
    header = next(x for x in text.splitlines() if x.startswith("| row")).split(" | ")
    col = next(i for i, h in enumerate(header) if h.startswith("host GiB"))
    assert lines["| m/b1s8/cap16/default"][col] == "40.00 / 40.75 / 46.50 (+16.2%)"
    assert lines["| m/b1s8/cap16/segments"][col] == "-"
    assert all(len(v) == len(header) for v in lines.values())


def test_rows_outside_the_grid_run_only_when_named():
    """Issue 25's host-scale row and issue 24's FSDP2 row are not part of a plain sweep (whose
    counts are the automatic plan's), and run when named."""
    grid = oom_sweep.rows_of_grid()
    plain = {r["id"] for r in oom_sweep.selected(grid, set(), [], [])}
    qwen, fsdp = "qwen2.5-14b/b4s1024/cap139/default", "llama3.2-3b/b4s1024/cap24/fsdp2"
    assert qwen not in plain and fsdp not in plain
    assert "llama3.2-3b/b4s1024/cap24/default" in plain
    assert len(plain) == len(grid) - 2
    named = oom_sweep.selected(grid, set(), [fsdp, qwen], [])
    assert [r["id"] for r in named] == [fsdp, qwen]
    assert [r["id"] for r in oom_sweep.selected(grid, set(), [], ["qwen2.5-14b"])] == [qwen]
    assert not oom_sweep.selected(grid, {qwen}, [qwen], [])
    with pytest.raises(SystemExit, match="no such row: llama3.2-1b/b4s1024/cap8/default"):
        oom_sweep.selected(grid, set(), [qwen, "llama3.2-1b/b4s1024/cap8/default"], [])
