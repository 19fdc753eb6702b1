"""benchmarks/loop_at_scale.py's parent logic on the CPU, its children faked: a child cut by its
deadline keeps the steps it finished and its last lines (run 52's two rows came back empty), a row
run without the checkpoint is compared on everything else, and the table shows the reserved peak of
each part of the loop."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import loop_at_scale  # noqa: E402


def test_a_child_cut_by_its_deadline_keeps_what_it_said(monkeypatch, tmp_path):
    said = (
        b"protrain [    4.1 s] graph 0/0: tracing\n"
        b"step 0: loss 12.3782 (75.104 s)\n"
        b"step 1: loss 12.3772 (1.498 s)\n"
    )
    asked = {}

    def cut(cmd, **kwargs):
        asked["cmd"] = cmd
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], stderr=said)

    monkeypatch.setattr(loop_at_scale.subprocess, "run", cut)
    row = loop_at_scale.child("llama3.2-3b", "protrain", 12, 5.0, str(tmp_path), False)
    assert "--no-checkpoint" in asked["cmd"]
    assert row["outcome"] == "timeout"
    assert row["steps_done"] == [
        "step 0: loss 12.3782 (75.104 s)",
        "step 1: loss 12.3772 (1.498 s)",
    ]
    assert "graph 0/0: tracing" in row["error"]
    assert loop_at_scale.compare(row, {"outcome": "trained"}) == {}


def test_a_row_without_the_checkpoint_is_compared_on_the_rest():
    ref = {
        "outcome": "trained",
        "losses": [12.0, 11.0],
        "norms": [3.0, 2.0],
        "eval_losses": [12.5],
        "checkpoint_sum": 1000.0,
        "printed_weight": 0.25,
    }
    mine = {**ref, "losses": [12.0, 11.011]}
    del mine["checkpoint_sum"], mine["printed_weight"]
    worst = loop_at_scale.compare(mine, ref)
    assert "checkpoint_sum" not in worst and "printed_weight" not in worst
    assert worst["losses"] == pytest.approx(0.001) and worst["within_tolerance"]
    # with the checkpoint, a sum off by more than the tolerance fails the row
    assert not loop_at_scale.compare({**ref, "checkpoint_sum": 1100.0}, ref)["within_tolerance"]


def test_the_table_shows_the_reserved_peak_of_each_part_of_the_loop():
    row = {
        "model": "llama3.2-3b",
        "system": "protrain",
        "outcome": "trained",
        "cap_gib": 24,
        "predicted_peak_reserved_gib": 21.76,
        "peak_reserved_gib": 23.09,
        "peaks_reserved_gib": {"first step": 22.1, "training steps": 21.9, "evaluation": 23.09},
    }
    line = loop_at_scale.table([row]).splitlines()[-1]
    assert "21.76 / 23.09 (24)<br>first step 22.10, training steps 21.90, evaluation 23.09" in line
    row["peaks_allocated_gib"] = {"first step": 20.3, "training steps": 20.1, "evaluation": 21.5}
    line = loop_at_scale.table([row]).splitlines()[-1]
    assert (
        "evaluation 23.09<br>allocated: first step 20.30, training steps 20.10, evaluation " in line
    )
