"""benchmarks/run.py: the CPU smoke mode writes a row for every system and the three files; the GPU
path's parent logic (guards, admission, reruns, wheels, deadline) with the children faked; a
failing, crashing or hanging child becomes a row with its error; the size search, --merge, and
benchmarks/timeshare.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import run  # noqa: E402
import timeshare  # noqa: E402
from suite import (  # noqa: E402
    admission,
    failures,
    machine,
    merging,
    outputs,
    resume,
    scenarios,
    scheduler,
    size_search,
)

H200_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 "
    "GiB of which "
    "{free} is free. Including non-PyTorch memory, this process has 23.10 GiB memory in "
    "use."
)


def test_smoke_writes_a_row_per_system_and_the_files(tmp_path):
    out = tmp_path / "smoke"
    p = subprocess.run(
        [sys.executable, os.path.join(BENCH, "run.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == set(run.SYSTEMS) and len(data["rows"]) == len(run.SYSTEMS), p.stdout
    for name, r in rows.items():
        assert set(scenarios.ROW_KEYS) <= set(r), name
        ok = r["error"] is None and r["tokens_per_s"] and r["tokens_per_s"] > 0
        assert ok or (isinstance(r["error"], str) and r["error"]), (name, r)
    for name in ("protrain", "eager", "compile", "compile_ac"):  # these run on the CPU
        assert rows[name]["error"] is None, (name, rows[name]["error"], p.stdout[-2000:])
        assert rows[name]["tflops"] > 0 and rows[name]["step_ms"] > 0
    for name in ("fsdp2_offload", "ds_zero2_offload", "ds_zero3_offload", "torchao_offload"):
        assert "needs CUDA" in rows[name]["error"]
    assert rows["compile"]["ratio_to_ceiling"] == pytest.approx(1.0)
    assert rows["protrain"]["n_chunks"] >= 1  # its plan made it into the row
    for ext in (".json", ".md"):
        assert (tmp_path / ("smoke" + ext)).stat().st_size > 0, ext
    md = (tmp_path / "smoke.md").read_text()
    assert all(f"| smoke | {name} |" in md for name in run.SYSTEMS)
    try:
        import matplotlib  # noqa: F401 - the `bench` extra, which scripts/bootstrap.sh installs
    except ImportError:
        assert "matplotlib" in data["plot_error"]
    else:
        assert "plot_error" not in data
        assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "code, expect",
    [
        ("print('RESULT ' + '{\"tokens_per_s\": 5.0}')", None),
        ("import sys; print('noise'); sys.exit(3)", "exited with code 3"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
        ("import time; time.sleep(30)", "timed out after 2 s"),
    ],
)
def test_a_failing_child_becomes_an_error(code, expect):
    res = scheduler.run_child([sys.executable, "-c", code], dict(os.environ), timeout=2)
    if expect is None:
        assert res == {"tokens_per_s": 5.0}
    else:
        assert expect in res["error"]


# ----------------------------------------------------------------------------- the GPU path,
# children faked
def _gpu_ctx(argv=(), total=139.8, host=120.0):
    args = run.parse_args(["--device", "cuda", *argv])
    return scheduler.Ctx(args, total, host)


def test_predicted_failures_are_rows_not_runs():
    ctx = _gpu_ctx()
    sc = scenarios.scenarios(ctx.args)["llama-cap40"]
    expect = {
        "compile": "OOM (predicted",
        "eager": "OOM (predicted",
        "compile_ac": "OOM (predicted",
        "torchao_offload": "OOM (predicted",
        "ds_zero2_offload": None,
        "ds_zero3_offload": None,
        "fsdp2_offload": None,
        "protrain": None,
    }
    for system, want in expect.items():
        row = scenarios.base_row("llama-cap40", system, sc)
        got = admission.predicted_failure(system, row, ctx)
        assert (got is None) if want is None else got.startswith(want), (system, got)
    row = scenarios.base_row("llama-cap40", "ds_zero3_offload", sc)
    small_host = _gpu_ctx(host=50.0)
    host_oom = admission.predicted_failure("ds_zero3_offload", row, small_host)
    assert host_oom.startswith("host OOM (predicted")
    assert failures.short_error(host_oom) == "host OOM*"
    no_predict = _gpu_ctx(["--no-predict"], host=50.0)
    assert admission.predicted_failure("ds_zero3_offload", row, no_predict) is None
    cpu = scheduler.Ctx(run.parse_args(["--device", "cpu"]), 0.0, 20.0)
    assert "needs CUDA" in admission.predicted_failure("fsdp2_offload", row, cpu)


def test_own_limit_hit_reads_torch_oom_messages():
    assert failures.own_limit_hit(H200_OOM.format(free="80.00 GiB"))  # the process's cap did
    assert not failures.own_limit_hit(H200_OOM.format(free="1.50 GiB"))  # the device was full
    assert not failures.own_limit_hit(H200_OOM.format(free="512.00 MiB"))
    assert not failures.own_limit_hit("OOM: something else ran out of memory")
    assert failures.memory_failure("killed by SIGKILL (the host's OOM killer?)")
    assert not failures.memory_failure("boom")


def test_gpu_run_with_children_faked(tmp_path, monkeypatch):
    """One GPU-style run of gpt1.4b, gpt1.4b-cap24 and llama-cap40, all systems, --jobs 3: every row
    is there; predicted OOMs never start; wheels reach only the peers' children; a soft-capped OOM
    runs again alone; an OOM at the system's own cap does not."""
    calls, lock = [], threading.Lock()
    concurrency = {"now": 0, "max": 0}

    def fake_run_child(argv, env, timeout, ctx=None):
        system, spec = argv[argv.index("--one") + 1], json.loads(argv[argv.index("--spec") + 1])
        with lock:
            calls.append((system, spec, env))
            concurrency["now"] += 1
            concurrency["max"] = max(concurrency["max"], concurrency["now"])
        time.sleep(0.05)
        with lock:
            concurrency["now"] -= 1
        assert (
            spec["device"] == "cuda"
            and spec["steps"] == 4
            and spec["warmup"] == 3
            and spec["settle"]
        )
        assert env[timeshare.LOCK_ENV] == ctx.lock_path and env["NCCL_NVLS_ENABLE"] == "0"
        assert ("/fake/site" in env.get("PYTHONPATH", "")) == run.SYSTEMS[system].wheels, system
        if system == "eager" and not spec["cap_gib"] and spec["soft_cap_gib"]:
            # its soft cap: run again alone
            return {"error": "OOM: " + H200_OOM.format(free="40.00 GiB")}
        # slowed by its soft cap
        if system == "compile_ac" and not spec["cap_gib"] and spec["soft_cap_gib"]:
            return {"params": 123, "tokens_per_s": 1.0, "alloc_retries": 3, "step_ms": 8.0}
        if system in ("compile", "eager") and spec["cap_gib"]:
            return {"error": "OOM: " + H200_OOM.format(free="90.00 GiB")}  # its own cap: a true OOM
        return {
            "params": 123,
            "tokens_per_s": 1000.0 + len(system),
            "peak_gib": 20.0,
            "step_ms": 8.0,
            "step_ms_min": 7.0,
            "step_ms_max": 9.0,
        }

    monkeypatch.setattr(scheduler, "run_child", fake_run_child)
    monkeypatch.setattr(machine, "gpu_info", lambda: ("NVIDIA H200", 139.8))
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "120GiB")  # what the host-memory checks read
    monkeypatch.setattr(
        machine,
        "install_peer_wheels",
        lambda lock_path, log: log.update(status="fake") or "/fake/site",
    )
    out = tmp_path / "gpu"
    run.main(
        [
            "--device",
            "cuda",
            "--jobs",
            "3",
            "--scenarios",
            "gpt1.4b,gpt1.4b-cap24,llama-cap40",
            "--out",
            str(out),
        ]
    )
    data = json.loads((tmp_path / "gpu.json").read_text())
    rows = {(r["scenario"], r["system"]): r for r in data["rows"]}
    assert len(rows) == len(data["rows"]) == 3 * len(run.SYSTEMS)
    assert data["peer_install"] == {"status": "fake"} and data["device"] == "NVIDIA H200"
    started = [(s, spec["cap_gib"], spec["cfg"].get("dim")) for s, spec, _ in calls]
    for system in ("compile", "eager", "compile_ac", "torchao_offload"):  # predicted at 40 GiB
        assert rows[("llama-cap40", system)]["error"].startswith("OOM (predicted"), system
        assert (system, 40.0, 4096) not in started
    eager = rows[("gpt1.4b", "eager")]
    assert (
        eager["error"] is None
        and "soft" not in eager["first_try_error"]
        and "capped at" in eager["first_try_error"]
    )
    assert eager["ran_alone"] is True
    assert [s.get("soft_cap_gib") for sys_, s, _ in calls if sys_ == "eager" and not s["cap_gib"]][
        -1
    ] is None
    ac = rows[("gpt1.4b", "compile_ac")]
    assert ac["tokens_per_s"] == 1010.0 and "retry 3 times" in ac["first_try_error"]
    capped = rows[("gpt1.4b-cap24", "compile")]
    assert capped["error"].startswith("OOM") and "first_try_error" not in capped
    assert rows[("gpt1.4b", "protrain")]["ratio_to_ceiling"] == pytest.approx(1008 / 1007)
    assert concurrency["max"] >= 2  # children did share the machine
    assert any(r.get("alive_next_to_it") for r in data["rows"])
    for r in data["rows"]:  # never two offloading systems alive together
        heavy = {"fsdp2_offload", "ds_zero2_offload", "ds_zero3_offload", "torchao_offload"}
        if r["system"] in heavy:
            assert not {n.split("@")[0] for n in r.get("alive_next_to_it") or []} & heavy, r
    md = (tmp_path / "gpu.md").read_text()
    assert "| llama-cap40 | torchao_offload |" in md and "ran again alone" in md


def test_resume_keeps_what_ran_and_runs_the_rest(tmp_path, monkeypatch):
    """--resume: the same command over two device calls. The first call's rows that ran (measured or
    failed) are kept as they are; rows its deadline left unrun, and systems it did not have, run in
    the second."""
    started = []

    def fake_run_child(argv, env, timeout, ctx=None):
        system = argv[argv.index("--one") + 1]
        started.append(system)
        if system == "eager":
            return {"error": "OOM: CUDA out of memory. Tried to allocate 2.00 GiB"}
        return dict(MEASURED, tokens_per_s=1000.0 + len(system))

    MEASURED = {
        "params": 123,
        "peak_gib": 1.0,
        "step_ms": 8.0,
        "step_ms_min": 7.0,
        "step_ms_max": 9.0,
    }
    monkeypatch.setattr(scheduler, "run_child", fake_run_child)
    monkeypatch.setattr(machine, "gpu_info", lambda: ("NVIDIA H200", 139.8))
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "120GiB")
    out = str(tmp_path / "suite")
    gpt = scenarios.scenarios(run.parse_args([]))["gpt1.4b"]
    first = {
        "rows": [
            dict(
                scenarios.base_row("gpt1.4b", "compile", gpt),
                **dict(MEASURED, tokens_per_s=555.0),
                error=None,
                wall_s=1.0,
            ),
            dict(scenarios.base_row("gpt1.4b", "eager", gpt), error="OOM: earlier", wall_s=1.0),
            dict(
                scenarios.base_row("gpt1.4b", "protrain", gpt),
                error="not run: the run's deadline passed",
                wall_s=0.0,
            ),
            dict(
                scenarios.base_row("gpt1.4b", "compile_ac", gpt),
                error="ModuleNotFoundError: No module named 'x' (not installed)",
                wall_s=1.0,
            ),
        ]
    }
    (tmp_path / "suite.json").write_text(json.dumps(first))
    argv = [
        "--device",
        "cuda",
        "--scenarios",
        "gpt1.4b",
        "--systems",
        "compile,eager,protrain,compile_ac",
        "--out",
        out,
        "--resume",
        out + ".json",
    ]
    run.main(argv)
    # compile measured and eager failed before: neither runs again; a system that could not be
    # imported does
    assert sorted(started) == ["compile_ac", "protrain"]
    started.remove("compile_ac")
    rows = {r["system"]: r for r in json.loads((tmp_path / "suite.json").read_text())["rows"]}
    assert rows["compile"]["tokens_per_s"] == 555.0 and rows["compile"]["resumed"]
    assert rows["eager"]["error"] == "OOM: earlier"
    assert rows["protrain"]["tokens_per_s"] == 1008.0 and not rows["protrain"].get("resumed")
    assert "earlier device call" in (tmp_path / "suite.md").read_text()
    run.main(argv)  # everything ran: a third call starts nothing
    assert started == ["protrain"]
    assert resume.resumed_rows(str(tmp_path / "missing.json"), [("gpt1.4b", "compile")]) == {}


def test_resume_goes_on_with_a_search_the_deadline_cut(tmp_path, monkeypatch):
    """maxmodel over two device calls: the first call's deadline stops the doubling search after L16
    trained; the second (--resume) keeps L16 as it was and goes on at L32, then L64, its first
    failure."""
    started, fail_from, cut_at = [], [64], [32]

    def fake_run_child(argv, env, timeout, ctx=None):
        n_layer = json.loads(argv[argv.index("--spec") + 1])["cfg"]["n_layer"]
        started.append(n_layer)
        if n_layer == cut_at[0]:
            return {
                "error": "not run to the end: the run's --deadline (500 s) stopped it after 100 s"
            }
        if n_layer >= fail_from[0]:
            return {"error": "OOM: CUDA out of memory. Tried to allocate 2.00 GiB"}
        return {
            "params": n_layer * 10**8,
            "peak_gib": float(n_layer),
            "step_ms": 8.0,
            "step_ms_min": 7.0,
            "step_ms_max": 9.0,
            "tokens_per_s": 1000.0 / n_layer,
        }

    monkeypatch.setattr(scheduler, "run_child", fake_run_child)
    monkeypatch.setattr(machine, "gpu_info", lambda: ("NVIDIA H200", 139.8))
    monkeypatch.setattr(machine, "install_peer_wheels", lambda lock_path, log: None)
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "120GiB")
    out = str(tmp_path / "suite")
    argv = [
        "--device",
        "cuda",
        "--scenarios",
        "maxmodel",
        "--systems",
        "protrain",
        "--search-start",
        "16",
        "--out",
        out,
    ]
    run.main(argv)
    assert started == [16, 32]
    (row,) = json.loads((tmp_path / "suite.json").read_text())["rows"]
    assert row["layers"] == 16 and row["search_stopped"] == "deadline or interrupt"
    started.clear()
    cut_at[0] = None
    run.main(argv + ["--resume", out + ".json"])
    assert started == [32, 64]  # L16 not again
    (row,) = json.loads((tmp_path / "suite.json").read_text())["rows"]
    assert row["layers"] == 32 and row["error"] is None and row["search_stopped"] == "first failure"
    assert [a["layers"] for a in row["search"]] == [16, 32, 64]
    assert row["first_failure"]["layers"] == 64
    started.clear()
    run.main(argv + ["--resume", out + ".json"])  # the search is complete: nothing runs
    assert started == []
    # asked for 2 bisection steps now: L48 fails, L40 trains; L16-L64 are not run again
    fail_from[0] = 48
    run.main(argv + ["--resume", out + ".json", "--search-refine", "2"])
    assert started == [48, 40]
    (refined,) = json.loads((tmp_path / "suite.json").read_text())["rows"]
    assert refined["layers"] == 40 and refined["first_failure"]["layers"] == 48
    started.clear()
    run.main(argv + ["--resume", out + ".json", "--search-refine", "2"])  # its 2 steps are taken
    assert started == []
    # a fix of the system: --rerun-attempt measures L48 again, and the search goes on
    fail_from[0] = 64
    run.main(
        argv + ["--resume", out + ".json", "--search-refine", "2", "--rerun-attempt", "protrain@48"]
    )
    assert started == [48, 56]
    (again,) = json.loads((tmp_path / "suite.json").read_text())["rows"]
    assert again["layers"] == 56 and again["first_failure"]["layers"] == 64
    assert [a["layers"] for a in again["search"]] == [16, 32, 40, 48, 56, 64]
    assert (
        again["replaced_attempts"][0]["layers"] == 48
        and "OOM" in again["replaced_attempts"][0]["error"]
    )
    assert "L48 measured again (--rerun-attempt)" in (tmp_path / "suite.md").read_text()
    started.clear()
    # forgetting the depth a search reports starts it over; a bad spec or no --resume is refused
    assert resume.forget_attempts(again, {56}) is None
    assert resume.forget_attempts(again, {8}) is again
    for bad in (
        ["--rerun-attempt", "protrain@x", "--resume", "r.json"],
        ["--rerun-attempt", "protrain@48"],
    ):
        with pytest.raises(SystemExit):
            run.parse_args(bad)
    older = dict(row, search_stopped="deadline or interrupt", search=row["search"][:2])
    # a row written before the depth was recorded: the largest attempt that trained
    del older["layers"]
    assert size_search.earlier_attempts(older)[32]["model"] == row["model"]


def test_deadline_and_interrupt_rows():
    sc = dict(
        kind="gpt", cfg=scenarios.TINY_GPT, batch=2, seq=32, cap_gib=0.0, systems=tuple(run.SYSTEMS)
    )
    ctx = scheduler.Ctx(run.parse_args(["--device", "cpu", "--deadline", "10"]), 0.0, 20.0)
    ctx.deadline_at = time.monotonic() - 1
    row = scheduler.run_job("s", "eager", sc, ctx)
    assert row["error"].startswith("not run:") and failures.short_error(row["error"]) == "deadline"
    assert row["params"] > 0 and row["tokens_per_s"] is None
    for spent in ("0", "-3"):  # a deadline already spent (a wrapper's time left): nothing starts
        ctx = scheduler.Ctx(run.parse_args(["--device", "cpu", "--deadline", spent]), 0.0, 20.0)
        assert failures.short_error(scheduler.run_job("s", "eager", sc, ctx)["error"]) == "deadline"
    ctx = scheduler.Ctx(run.parse_args(["--device", "cpu"]), 0.0, 20.0)
    assert ctx.deadline_at is None
    ctx.stopping = True
    assert failures.short_error(scheduler.run_job("s", "eager", sc, ctx)["error"]) == "stopped"


@pytest.mark.parametrize(
    "refine, largest, first_fail, tried",
    [
        (0, 8, 16, [2, 4, 8, 16]),
        (2, 12, 14, [2, 4, 8, 16, 12, 14]),
    ],
)
def test_size_search_doubles_until_the_first_failure(
    monkeypatch, refine, largest, first_fail, tried
):
    calls = []

    def fake_run_job(scenario, system, sc, ctx, priority=0):  # trains up to 12 layers, fails above
        n = sc["cfg"]["n_layer"]
        calls.append(n)
        row = scenarios.base_row(scenario, system, sc)
        if n <= 12:
            row.update(tokens_per_s=100.0 / n, peak_gib=float(n))
        else:
            row["error"] = f"OOM: CUDA out of memory at {n} layers"
        return row

    monkeypatch.setattr(size_search, "run_job", fake_run_job)
    args = run.parse_args(
        [
            "--device",
            "cpu",
            "--search-width",
            "64",
            "--search-start",
            "2",
            "--search-refine",
            str(refine),
        ]
    )
    sc = scenarios.scenarios(args)["maxmodel"]
    row = size_search.search("eager", sc, SimpleNamespace(args=args), lambda r, what: None)
    assert calls == tried
    assert row["error"] is None and row["model"] == f"GPT d64 L{largest} v50304"
    assert row["first_failure"]["layers"] == first_fail and "OOM" in row["first_failure"]["error"]
    assert [a["layers"] for a in row["search"]] == sorted(tried)


def test_size_search_stopped_by_the_deadline_is_not_a_failure(monkeypatch):
    def fake_run_job(scenario, system, sc, ctx, priority=0):
        row = scenarios.base_row(scenario, system, sc)
        if sc["cfg"]["n_layer"] <= 4:
            row.update(tokens_per_s=1.0)
        else:
            row["error"] = "not run: the run's --deadline (10 s) was reached"
        return row

    monkeypatch.setattr(size_search, "run_job", fake_run_job)
    args = run.parse_args(["--device", "cpu", "--search-width", "64", "--search-start", "2"])
    row = size_search.search(
        "eager",
        scenarios.scenarios(args)["maxmodel"],
        SimpleNamespace(args=args),
        lambda r, what: None,
    )
    assert (
        row["error"] is None
        and row["first_failure"] is None
        and row["search_stopped"] == "deadline or interrupt"
    )
    assert row["model"] == "GPT d64 L4 v50304"


def test_merge_recomputes_ratios(tmp_path):
    def row(scenario, system, tps, cap=0.0):
        r = dict.fromkeys(scenarios.ROW_KEYS)
        r.update(
            scenario=scenario,
            system=system,
            model="GPT d64 L2 v256",
            params=10**6,
            cap_gib=cap,
            batch=2,
            seq=32,
            tokens_per_s=tps,
            tflops=None if tps is None else tps * 1e-9,
            peak_gib=1.0,
        )
        if tps is None:
            r["error"] = "OOM: out of memory"
        return r

    meta = dict(
        date="d",
        device="cpu",
        torch="t",
        argv=[],
        host="h",
        ac_budget=0.5,
        warmup=1,
        steps=1,
        jobs=1,
        llama="l",
        search={},
    )
    (tmp_path / "a.json").write_text(
        json.dumps(
            dict(meta, rows=[row("s", "compile", 200.0), row("s-cap", "eager", 1.0, cap=24.0)])
        )
    )
    (tmp_path / "b.json").write_text(
        json.dumps(
            dict(
                meta,
                rows=[
                    row("s-cap", "protrain", 50.0, cap=24.0),
                    row("s-cap", "eager", None, cap=24.0),
                ],
            )
        )
    )
    late = row("s", "compile", None)
    late["error"] = "not run: the run's --deadline (500 s) was reached"
    # never replaces a measured row
    (tmp_path / "c.json").write_text(json.dumps(dict(meta, rows=[late])))
    merged = [str(tmp_path / n) for n in ("a.json", "b.json", "c.json")]
    merging.merge(
        SimpleNamespace(
            merge=merged, out=str(tmp_path / "merged"), note=["run 2 measured protrain alone"]
        ),
        run.parse_args,
    )
    data = json.loads((tmp_path / "merged.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    assert len(data["rows"]) == 3 and len(data["merged_from"]) == 3
    assert rows["protrain"]["ratio_to_ceiling"] == pytest.approx(0.25)
    # the later file wins
    assert rows["eager"]["ratio_to_ceiling"] is None and "OOM" in rows["eager"]["error"]
    assert "| s-cap | eager |" in (tmp_path / "merged.md").read_text()
    assert "- run 2 measured protrain alone" in (tmp_path / "merged.md").read_text()
    assert (tmp_path / "merged.png").stat().st_size > 0 or data.get("plot_error")


def test_merge_gives_every_system_a_row(tmp_path):
    """A merge of runs that never reached some systems still has a row for each, saying so; a row
    whose system could not be imported gives way to a later one, even one that was not run."""
    args = run.parse_args(["--search-start", "16"])
    sc = scenarios.scenarios(args)
    gpt = dict(
        scenarios.base_row("gpt1.4b", "compile", sc["gpt1.4b"]), tokens_per_s=100.0, error=None
    )
    broken = dict(
        scenarios.base_row("gpt1.4b", "ds_zero2_offload", sc["gpt1.4b"]),
        error="ModuleNotFoundError: No module named 'deepspeed'",
    )
    late = dict(broken, error="not run: the run's --deadline (500 s) was reached")
    l32 = dict(sc["maxmodel"], cfg=scenarios.search_cfg(args, 32))
    big = dict(
        scenarios.base_row("maxmodel", "protrain", l32),
        tokens_per_s=5.0,
        error=None,
        layers=32,
        search=[],
    )
    capped = dict(
        scenarios.base_row("llama-cap40", "protrain", sc["llama-cap40"]),
        tokens_per_s=2.0,
        error=None,
    )
    meta = dict(
        date="d",
        device="NVIDIA H200",
        device_gib=139.8,
        torch="t",
        argv=[],
        host="h",
        ac_budget=0.5,
        warmup=1,
        steps=1,
        jobs=1,
        llama="l",
        search={
            k: getattr(args, "search_" + k)
            for k in ("width", "start", "max_layers", "batch", "steps", "warmup", "refine")
        },
    )
    (tmp_path / "a.json").write_text(
        json.dumps(
            dict(meta, host="h240", host_gib_for_checks=240.0, rows=[gpt, broken, big, capped])
        )
    )
    (tmp_path / "b.json").write_text(
        json.dumps(dict(meta, host="h125", host_gib_for_checks=125.0, rows=[late]))
    )
    merging.merge(
        SimpleNamespace(
            merge=[str(tmp_path / "a.json"), str(tmp_path / "b.json")],
            out=str(tmp_path / "merged"),
            note=[],
        ),
        run.parse_args,
    )
    rows = {
        (r["scenario"], r["system"]): r
        for r in json.loads((tmp_path / "merged.json").read_text())["rows"]
    }
    # rows from machines with different host memory say which they ran on
    md = (tmp_path / "merged.md").read_text()
    assert "Hosts (" in md and "h240 (a.json)" in md and "h125 (b.json)" in md
    assert (
        rows[("maxmodel", "protrain")]["host_gib"] == 240.0
        and rows[("gpt1.4b", "ds_zero2_offload")]["host"] == "h125"
    )
    assert "| protrain | GPT d4096 L32 v50304 | 6.86 B | 4 x 1024 | 5 | - | 240 |" in md
    assert set(rows) == {
        (n, s) for n in ("gpt1.4b", "maxmodel", "llama-cap40") for s in sc[n]["systems"]
    }
    # 88 GiB of states
    assert rows[("llama-cap40", "eager")]["error"].startswith("OOM (predicted, not run)")
    assert rows[("gpt1.4b", "ds_zero2_offload")]["error"] == late["error"]
    assert rows[("gpt1.4b", "eager")]["error"] == "not run: none of the merged runs reached it"
    assert (
        rows[("maxmodel", "ds_zero2_offload")]["error"]
        == "not run: none of the merged runs reached it"
    )
    assert failures.short_error(rows[("maxmodel", "ds_zero2_offload")]["error"]) == "not run"
    assert rows[("maxmodel", "eager")]["layers"] == 16 and rows[("maxmodel", "eager")]["params"] > 0
    assert rows[("maxmodel", "protrain")]["tokens_per_s"] == 5.0


# --------------------------------------------------------------------------------------------
# timeshare
def test_measuring_waits_for_every_busy_holder(tmp_path, monkeypatch):
    path = str(tmp_path / "lock")
    monkeypatch.setenv(timeshare.LOCK_ENV, path)
    monkeypatch.setattr(timeshare, "_fd", None)
    other = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_SH)  # another child, compiling
    timeshare.start_busy()
    entered = threading.Event()

    def measure():
        with timeshare.measuring():
            entered.set()
            probe = os.open(path, os.O_RDWR)  # nobody may take it, even shared, while we measure
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            os.close(probe)

    t = threading.Thread(target=measure)
    t.start()
    assert not entered.wait(0.3)  # still waiting for the other child
    os.close(other)
    t.join(5)
    assert entered.is_set()
    os.close(timeshare._fd)


def test_a_waiting_measurement_goes_before_later_starters(tmp_path):
    """A child waiting to measure holds the gate: children starting after it queue behind it instead
    of taking the lock shared and keeping it waiting (two parents' groups, one after another, did).
    """
    path = str(tmp_path / "lock")
    compiling = os.open(path, os.O_RDWR | os.O_CREAT)
    timeshare._shared(compiling, path)
    order = []

    def measure():
        fd = os.open(path, os.O_RDWR)
        timeshare._shared(fd, path)
        timeshare._exclusive(fd, path)
        order.append("measured")
        time.sleep(0.2)
        os.close(fd)

    def start_up():
        fd = os.open(path, os.O_RDWR)
        timeshare._shared(fd, path)
        order.append("started")
        os.close(fd)

    m = threading.Thread(target=measure)
    m.start()
    time.sleep(0.3)  # the measurement waits for the compiling child
    s = threading.Thread(target=start_up)
    s.start()
    time.sleep(0.3)
    assert order == []  # the newcomer queues behind the measurement
    os.close(compiling)
    m.join(5)
    s.join(5)
    assert order == ["measured", "started"]


def test_slots_admit_by_count_and_memory_and_keep_exclusive_alone():
    slots = timeshare.Slots(jobs=2, device_gib=100.0, host_gib=100.0)
    log, lock = [], threading.Lock()

    def job(name, dev, host=0.0, exclusive=False, priority=0, hold=0.15):
        with slots.claim(dev, host, exclusive, priority):
            with lock:
                log.append(("in", name, time.monotonic()))
            time.sleep(hold)
            with lock:
                log.append(("out", name, time.monotonic()))

    threads = [
        threading.Thread(target=job, args=a, kwargs=k)
        for a, k in [
            # b waits for a: 120 > 100 GiB
            (("a", 60.0), {"priority": 0}),
            (("b", 60.0), {"priority": 1}),
            (("c", 30.0), {"priority": 2}),  # c fits next to a: overtakes b
            (("x", 1.0), {"exclusive": True, "priority": 3, "hold": 0.05}),
        ]
    ]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(5)
    order = [n for kind, n, _ in log if kind == "in"]
    assert order.index("c") < order.index("b")
    spans = {n: [t for kind, m, t in log if m == n] for n in "abcx"}
    for n in "abc":  # the exclusive one overlapped nobody
        assert spans[n][1] <= spans["x"][0] or spans[n][0] >= spans["x"][1], (n, spans)
    assert spans["a"][1] <= spans["b"][0] or spans["b"][1] <= spans["a"][0]


@pytest.mark.parametrize(
    "kind, cfg",
    [
        (
            "gpt",
            dict(
                n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32, tie_embeddings=False
            ),
        ),
        ("gpt", dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32)),
        (
            "llama",
            dict(
                n_layer=2,
                dim=64,
                n_head=4,
                n_kv_head=2,
                ffn_dim=128,
                vocab_size=256,
                max_seq_len=32,
                tie_embeddings=False,
            ),
        ),
    ],
)
def test_skipping_the_default_init_leaves_nothing_uninitialized(kind, cfg):
    """peers._build skips torch's default Linear/Embedding init: the models' own init must
    overwrite it all."""
    import peers
    import torch

    with peers._own_init_only(fill=float("nan")):
        m = peers.build(kind, **cfg)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert (
        torch.nn.Linear.reset_parameters is not None
        and torch.isfinite(torch.nn.Linear(2, 2).weight).all()
    )


def test_dry_run_lists_jobs_and_predicted_failures(capsys):
    run.main(
        [
            "--dry-run",
            "--host-gib",
            "118",
            "--scenarios",
            "llama-cap40,maxmodel",
            "--systems",
            "compile,fsdp2_offload",
        ]
    )
    out = capsys.readouterr().out
    assert "llama-cap40    compile" in out and "NOT RUN: OOM (predicted" in out
    assert "maxmodel       fsdp2_offload     GPT d4096 L32" in out and "host OOM (predicted" in out


def test_slots_keep_host_heavy_children_apart():
    """Two children holding model states in host memory are never alive together; a light one may
    join one."""
    slots = timeshare.Slots(jobs=3, device_gib=100.0, host_gib=100.0, heavy_host_gib=10.0)
    spans, lock = {}, threading.Lock()

    def job(name, host):
        with slots.claim(1.0, host):
            t0 = time.monotonic()
            time.sleep(0.15)
            with lock:
                spans[name] = (t0, time.monotonic())

    threads = [
        threading.Thread(target=job, args=a) for a in (("h1", 20.0), ("h2", 20.0), ("light", 4.0))
    ]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(5)
    (a0, a1), (b0, b1), (l0, l1) = spans["h1"], spans["h2"], spans["light"]
    assert a1 <= b0 or b1 <= a0  # the heavy ones one after the other
    assert l0 < a1 and a0 < l1  # the light one next to the first heavy one


def test_two_parents_share_the_locks_and_leave_their_folder(tmp_path, monkeypatch):
    """Two run.py parents on one machine (one per GPU): the timing lock named in the environment
    reaches the children; the host-heavy lock is held by the parent while an offloading system's
    child runs (and only then), not passed on; the lock's folder is not removed at the end (it is
    the caller's, e.g. /tmp)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "other_file").write_text("kept")
    monkeypatch.setenv(timeshare.LOCK_ENV, str(shared / "turns.lock"))
    monkeypatch.setenv(timeshare.HEAVY_LOCK_ENV, str(shared / "heavy.lock"))
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "120GiB")
    envs, held = {}, {}

    def heavy_lock_is_held() -> bool:
        fd = os.open(shared / "heavy.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def fake_run_child(argv, env, timeout, ctx=None):
        system = argv[argv.index("--one") + 1]
        envs[system], held[system] = env, heavy_lock_is_held()
        return {
            "params": 123,
            "tokens_per_s": 1000.0,
            "peak_gib": 20.0,
            "step_ms": 8.0,
            "step_ms_min": 8.0,
            "step_ms_max": 8.0,
        }

    monkeypatch.setattr(scheduler, "run_child", fake_run_child)
    monkeypatch.setattr(machine, "gpu_info", lambda: ("NVIDIA H200", 139.8))
    monkeypatch.setattr(machine, "install_peer_wheels", lambda lock_path, log: None)
    run.main(
        [
            "--device",
            "cuda",
            "--jobs",
            "3",
            "--scenarios",
            "gpt1.4b",
            "--out",
            str(tmp_path / "gpu"),
        ]
    )
    assert set(envs) == set(run.SYSTEMS)
    for system, env in envs.items():
        assert env[timeshare.LOCK_ENV] == str(shared / "turns.lock")
        assert timeshare.HEAVY_LOCK_ENV not in env, system
        heavy = system in (
            "fsdp2_offload",
            "ds_zero2_offload",
            "ds_zero3_offload",
            "torchao_offload",
        )
        # a light one may run while a heavy one holds it; a heavy one always runs holding it
        if heavy:
            assert held[system], system
    assert not heavy_lock_is_held()
    assert (shared / "other_file").read_text() == "kept"


def test_a_heavy_child_waits_for_its_turn_without_spending_its_time_limit(tmp_path, monkeypatch):
    """The other parent holds the host-heavy lock: an offloading system is not started (its time
    limit does not run while it waits); at the run's deadline its row says it was not run, so
    --resume runs it later."""
    lock = tmp_path / "heavy.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other parent's offloading child
    monkeypatch.setenv(timeshare.HEAVY_LOCK_ENV, str(lock))
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "120GiB")
    started = []

    def fake_run_child(argv, env, timeout, ctx=None):
        started.append(argv[argv.index("--one") + 1])
        return {
            "params": 123,
            "tokens_per_s": 1000.0,
            "peak_gib": 20.0,
            "step_ms": 8.0,
            "step_ms_min": 8.0,
            "step_ms_max": 8.0,
        }

    monkeypatch.setattr(scheduler, "run_child", fake_run_child)
    monkeypatch.setattr(machine, "gpu_info", lambda: ("NVIDIA H200", 139.8))
    monkeypatch.setattr(machine, "install_peer_wheels", lambda lock_path, log: None)
    try:
        run.main(
            [
                "--device",
                "cuda",
                "--jobs",
                "3",
                "--scenarios",
                "gpt1.4b",
                "--deadline",
                "32",
                "--systems",
                "compile,fsdp2_offload",
                "--out",
                str(tmp_path / "gpu"),
            ]
        )
    finally:
        os.close(fd)
    rows = {r["system"]: r for r in json.loads((tmp_path / "gpu.json").read_text())["rows"]}
    assert started == ["compile"]
    assert rows["compile"]["error"] is None
    assert "waiting for the host-heavy turn" in rows["fsdp2_offload"]["error"]
    assert failures.not_run(rows["fsdp2_offload"])


def test_host_heavy_turns_go_first_come_first_served(tmp_path):
    """Three waiters ask for the host-heavy turn while it is held: they get it in the order they
    asked, however their polling falls; a ticket left by a dead parent is skipped, not waited for.
    """
    lock = str(tmp_path / "heavy.lock")
    os.makedirs(lock + ".queue")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # oldest, of a dead process
    open(os.path.join(lock + ".queue", f"{0:020d}-{dead.pid}-1"), "w").close()
    order = []
    holder = timeshare.host_heavy_turn(lock, poll_s=0.01)
    assert holder.__enter__() is True

    def wait(name: str, poll_s: float) -> None:
        with timeshare.host_heavy_turn(lock, time.monotonic() + 30, poll_s) as turn:
            assert turn
            order.append(name)
            time.sleep(0.05)

    threads = []
    # the first polls slowest
    for name, poll in (("first", 0.2), ("second", 0.001), ("third", 0.001)):
        threads.append(threading.Thread(target=wait, args=(name, poll)))
        threads[-1].start()
        time.sleep(0.05)  # each has its ticket before the next asks
    holder.__exit__(None, None, None)  # the turn is let go
    for t in threads:
        t.join(30)
    assert order == ["first", "second", "third"]
    assert os.listdir(lock + ".queue") == []  # every ticket gone, the dead one's too


# --------------------------------------------------------------------------------------------
# trace_summary
def test_trace_summary_finds_idle_gaps_and_collective_slowdown():
    """A synthetic trace: two GEMMs on the compute stream, the second beside an all-reduce and
    slower; an idle gap between them; a host-to-device copy on its own stream."""
    import trace_summary

    def ev(name, ts, dur, stream, cat="kernel", **args):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": dict(stream=stream, **args),
        }

    events = [
        ev("gemm", 0, 10, 7),
        ev("gemm", 20, 14, 7),
        ev("ncclDevKernel_AllReduce", 18, 30, 20),
        ev("Memcpy HtoD (Pinned -> Device)", 50, 5, 9, cat="gpu_memcpy", bytes=100),
        # host events are ignored
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
    ]
    s = trace_summary.summarize(events)
    assert s["span_ms"] == pytest.approx(0.055)
    assert s["compute_busy_ms"] == pytest.approx(0.024) and s["compute_idle_ms"] == pytest.approx(
        0.031
    )
    assert s["compute_gaps"][0] == {
        "at_ms": 0.01,
        "gap_ms": 0.01,
        "after": "gemm",
        "before": "gemm",
    }
    assert s["collective_busy_ms"] == pytest.approx(0.030)
    assert s["collective_overlapping_compute_ms"] == pytest.approx(0.014)
    (gemm,) = s["compute_beside_collectives"]
    assert (gemm["mean_alone_us"], gemm["mean_beside_us"], gemm["extra_ms"]) == (10.0, 14.0, 0.004)
    assert s["copies"]["Memcpy HtoD"] == {"total_ms": 0.005, "count": 1, "bytes": 100}
    assert s["streams"]["20"]["collective_kernels"] == 1
    assert trace_summary.summarize(events[-1:]) == {"error": "no device events in the trace"}


def test_host_peak_against_the_plan_above_the_process_before_the_build():
    """issue 25: a protrain row's host peak is compared with its plan's host bytes above what the
    process held before the model was built (libraries, the CUDA context)."""
    row = dict(plan_predicted={"host_bytes": 100 * 2**30}, host_peak_gib=106.0, host_base_gib=2.0)
    assert "(104.0 above the 2.0 GiB before the build: +4.0%)" in outputs._notes(row)
    del row["host_base_gib"]  # a row of an older run: the two numbers alone
    assert outputs._notes(row) == "host memory: plan 100.0 GiB pinned, process peak 106.0 GiB"
