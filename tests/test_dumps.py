"""Dumps: one folder per compiled graph with each stage's code, the plan and the node annotations;
the same artifacts in torch's structured trace."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from models import build

import protrain_fx
from protrain_fx.report.dump import TSV_COLUMNS
from protrain_fx.testing import random_batches, train_steps


def _train_and_infer(options):
    torch.manual_seed(0)
    model = build("gpt", n_layer=2, n_embd=32, n_head=2)
    compiled = torch.compile(model, backend="protrain", options=options)
    train_steps(model, compiled, random_batches(2, 2, 8))
    train_plan = protrain_fx.get_plan(compiled)
    with torch.no_grad():
        compiled(random_batches(1, 2, 8)[0][0])
    return compiled, train_plan


@pytest.mark.usefixtures("whole_graph")
def test_dump_layout(tmp_path):
    compiled, train_plan = _train_and_infer({"dump_dir": str(tmp_path)})
    graphs = sorted(os.listdir(tmp_path))
    assert len(graphs) == 2, graphs  # the training graph and the inference graph
    train_dir, infer_dir = (tmp_path / g for g in graphs)
    assert sorted(os.listdir(train_dir)) == [
        "annotations.tsv",
        "bw.py",
        "dynamo.py",
        "fw.py",
        "joint.py",
        "passes",
        "plan.json",
    ]
    assert sorted(os.listdir(infer_dir)) == [
        "annotations.tsv",
        "dynamo.py",
        "inference.py",
        "passes",
        "plan.json",
    ]
    from protrain_fx import pipeline

    # the graph after every pass of every stage, in order (protrain_fx/pipeline.py)
    assert sorted(os.listdir(train_dir / "passes")) == sorted(
        f"{stage}_{i:02d}_{name}.py"
        for stage in pipeline.TRAINING_ORDER
        for i, name in enumerate(pipeline.STAGES[stage])
    )
    assert json.loads((train_dir / "plan.json").read_text()) == train_plan.to_dict()
    assert (
        json.loads((infer_dir / "plan.json").read_text())
        == protrain_fx.get_plan(compiled).to_dict()
    )
    assert "def forward(self" in (train_dir / "dynamo.py").read_text()
    for name in ("joint.py", "fw.py", "bw.py"):
        code = (train_dir / name).read_text()
        assert "def forward(self" in code and "torch.ops.aten" in code, name
    assert "tangents_1" in (train_dir / "bw.py").read_text()

    with open(train_dir / "annotations.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert tuple(rows[0].keys()) == TSV_COLUMNS
    stages = {r["stage"] for r in rows}
    assert stages == {"dynamo", "joint", "fw", "bw"}
    fw_block_rows = [
        r for r in rows if r["stage"] == "fw" and r["op"] == "call_function" and r["block"]
    ]
    assert {r["block"] for r in fw_block_rows} == {"blocks.0", "blocks.1"}
    # phase is the node's autograd origin; the partitioner may compute a few backward-origin nodes
    # that need only forward values in fw, and recompute forward nodes in bw
    fw_phases = [r["phase"] for r in rows if r["stage"] == "fw" and r["op"] == "call_function"]
    assert set(fw_phases) <= {"forward", "backward"} and fw_phases.count(
        "forward"
    ) > fw_phases.count("backward")
    assert any(
        r["phase"] == "backward" and r["block"] == "blocks.1" for r in rows if r["stage"] == "bw"
    )
    params = {r["param"]: r["chunk"] for r in rows if r["stage"] == "joint" and r["param"]}
    # no graph break: same names
    assert params == {fqn: str(c) for fqn, c in train_plan.param_chunk.items() if fqn in params}
    assert "wte.weight" in params and all(c != "" for c in params.values())
    assert all(
        int(r["out_bytes"]) > 0
        for r in rows
        if r["stage"] == "fw"
        and r["op"] == "call_function"
        and r["target"] in ("mm.default", "addmm.default")
    )


@pytest.mark.usefixtures("whole_graph")
def test_env_var_turns_dumps_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_DUMP_DIR", str(tmp_path))
    _train_and_infer({"compiler": "eager"})
    assert len(os.listdir(tmp_path)) == 2


def test_no_dump_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("PROTRAIN_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    _train_and_infer({"compiler": "eager"})
    assert os.listdir(tmp_path) == []


TRACE_SCRIPT = r"""
import torch
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
torch.compile(m, backend="protrain", options={"compiler": "eager"})(torch.randn(2,
8)).sum().backward()
"""


def test_structured_trace_has_protrain_artifacts(tmp_path):
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    res = subprocess.run(
        [sys.executable, "-c", TRACE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    for name in (
        "protrain_plan",
        "protrain_dynamo",
        "protrain_joint",
        "protrain_fw",
        "protrain_bw",
    ):
        assert f'"name": "{name}"' in text, name
