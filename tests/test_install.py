"""The package as a user gets it (issue 26): the source tree copied as a fresh clone has it, ``pip
install .`` into a new virtual environment of the user's own, and a 15-line script with a Hugging
Face model and ``torch.compile(model, backend="protrain")`` with no options (the budget from
``PROTRAIN_MEMORY_BUDGET``, the optimizer found by protrain) trains with offloaded chunks exactly
like eager PyTorch. A built wheel holds the passes and the entry point.

The new environment gets torch and transformers from this one (a path file: nothing is downloaded);
protrain itself only from what it installs (run outside the source tree, so the tree cannot stand in
for it)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORED = shutil.ignore_patterns(
    ".venv",
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    "scratch",
    ".whl",
    ".device_out",
    "benchmarks",
)

SCRIPT = """\
import copy, json, torch, transformers, protrain_fx
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               tie_word_embeddings=True)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg)
ref = copy.deepcopy(model)
opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
compiled = torch.compile(model, backend="protrain")  # no options: budget from the environment
losses = {"protrain": [], "eager": []}
for step in range(3):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    for name, m, o in (("protrain", compiled, opt), ("eager", ref, ref_opt)):
        loss = m(input_ids=x, labels=x).loss
        loss.backward(); o.step(); o.zero_grad(); losses[name].append(loss.item())
plan = protrain_fx.get_plan(compiled)
print(json.dumps({"losses": losses, "chunks": [c["placement"] for c in plan.to_dict()["chunks"]],
                  "notes": plan.notes, "module": protrain_fx.__file__,
                  "param_abs": max((a - b).abs().max().item() for a, b in
                                   zip(model.state_dict().values(), ref.state_dict().values()))}))
"""


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert p.returncode == 0, (
        f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    )
    return p.stdout


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A copy of the source tree (as a clone has it) and a new venv with protrain installed from
    it."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "protrain-fx"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    inner = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    # torch, transformers from this environment
    with open(os.path.join(inner, "_outer_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    # as a user does: pip builds it
    run([py, "-m", "pip", "install", "-q", "--no-deps", "."], cwd=src)
    return tmp, src, py


def test_pip_install_then_one_line_trains_offloaded_like_eager(fresh):
    tmp, _, py = fresh
    (tmp / "train.py").write_text(SCRIPT)
    assert len(SCRIPT.splitlines()) <= 21  # the 15 lines of training, plus the report
    env = {**os.environ, "PROTRAIN_MEMORY_BUDGET": "600kB", "PROTRAIN_PLAN_CACHE": "0"}
    env.pop("PYTHONPATH", None)
    out = json.loads(run([py, "train.py"], cwd=tmp, env=env).strip().splitlines()[-1])
    assert out["module"].startswith(str(tmp / "venv")), out["module"]  # the installed package ran
    assert "host" in out["chunks"], out["chunks"]  # chunks really offloaded
    assert any(n.startswith("optimizer found: the AdamW") for n in out["notes"]), out["notes"]
    mine, ref = out["losses"]["protrain"], out["losses"]["eager"]
    assert max(abs(a - b) / abs(b) for a, b in zip(mine, ref)) <= 1e-5, out["losses"]
    assert out["param_abs"] <= 1e-3


def test_built_wheel_has_the_passes_and_the_entry_point(fresh, tmp_path):
    _, src, py = fresh
    run([py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), "."], cwd=src)
    (wheel,) = tmp_path.glob("protrain_fx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "protrain_fx/passes/chunk_gather.py" in names and "protrain_fx/backend.py" in names
    packages = {os.path.dirname(n) for n in names if n.endswith(".py")}
    source_packages = {
        os.path.relpath(d, src).replace("passes", "protrain_fx/passes", 1)
        for d, _, files in os.walk(src / "protrain_fx")
        if "__init__.py" in files
    }
    source_packages |= {"protrain_fx/passes"}
    assert source_packages <= packages, f"missing from the wheel: {source_packages - packages}"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert (
        "[torch_dynamo_backends]" in text
        and "protrain = protrain_fx.backend:protrain_backend" in text
    )
