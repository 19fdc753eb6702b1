"""The architecture stays as docs/design.md draws it: layers that import only those below them, no
import cycles, the runtime without torch.fx, the environment read in config.py alone, a pass list
whose declared reads and writes match what the passes touch, passes and graph analysis that allocate
nothing, and modules of a readable size. Each check reads the source (ast) or runs one small
compile; none needs a GPU."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE, PASSES_DIR = ROOT / "protrain_fx", ROOT / "passes"

# bottom to top; a module may import modules of its own layer or of the layers below
LAYERS = [
    ("base", ("_compat", "_version", "_weakmap", "config", "errors", "options", "progress")),
    ("machine", ("machine",)),
    ("plan", ("plan",)),
    ("runtime", ("runtime",)),
    ("graph", ("graph",)),
    ("passes", ("passes",)),
    ("profiling", ("profiling",)),
    ("report", ("report",)),
    (
        "orchestration",
        (
            "plan_cache",
            "budgets",
            "autoplan",
            "inference_placement",
            "trained_peers",
            "placement",
            "pipeline",
            "code_cache",
            "region_program",
            "backend",
            "inference_mode",
            "model_instances",
            "compiled_graph",
            "testing",
            "__init__",
            "integrations",
        ),
    ),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"] or ["__init__"]
        out["protrain_fx." + ".".join(parts)] = path
    for path in sorted(PASSES_DIR.glob("*.py")):
        name = "protrain_fx.passes" + ("" if path.stem == "__init__" else "." + path.stem)
        out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    head = module.split(".")[1] if module != "protrain_fx" else "__init__"
    for i, (_, heads) in enumerate(LAYERS):
        if head in heads:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to docs/design.md)")


def _imports(path: pathlib.Path, top_level_only: bool) -> set[str]:
    """protrain_fx modules ``path`` imports (a name imported from a package counts as its
    module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("protrain_fx")
        ):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("protrain_fx")}
    return {m for m in found if m in MODULES}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_layers_import_only_downwards():
    """Every import counts, also those inside functions (a lazy import hides a layer violation, it
    does not remove it)."""
    wrong = []
    for module, path in MODULES.items():
        for target in _imports(path, top_level_only=False):
            if _layer(target) > _layer(module):
                wrong.append(
                    f"{module} ({LAYERS[_layer(module)][0]}) imports {target} "
                    f"({LAYERS[_layer(target)][0]})"
                )
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = {m: _imports(p, top_level_only=True) - {m} for m, p in MODULES.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_the_runtime_does_not_import_fx():
    for module, path in MODULES.items():
        if _layer(module) not in (_layer("protrain_fx.runtime"), _layer("protrain_fx.machine")):
            continue
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(n == "torch.fx" or n.startswith("torch.fx.") for n in names), module


def _environment_reads(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in (
            "environ",
            "getenv",
            "putenv",
            "unsetenv",
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv") for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from os import ...")
    return found


def test_the_environment_is_read_in_config_alone():
    found = [
        r for m, p in MODULES.items() if m != "protrain_fx.config" for r in _environment_reads(p)
    ]
    assert not found, "\n".join(found)


def test_the_environment_check_catches_a_read():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=ROOT, delete=True) as f:
        f.write("import os\nDEBUG = os.environ.get('PROTRAIN_DEBUG_X') == '1'\n")
        f.flush()
        assert len(_environment_reads(pathlib.Path(f.name))) == 1


def test_every_protrain_variable_is_documented_in_config():
    import re

    from protrain_fx import config

    named = set()
    for path in MODULES.values():  # every PROTRAIN_ name the package mentions (messages included)
        named |= set(re.findall(r"\bPROTRAIN_[A-Z_]*[A-Z]\b", path.read_text()))
    assert named <= set(config.VARIABLES), sorted(named - set(config.VARIABLES))
    settings = config.settings()
    assert settings.autoplan is True or settings.autoplan is False


def test_flags_have_one_reading(monkeypatch):
    from protrain_fx import config
    from protrain_fx.errors import OptionsError

    for raw, want in (
        ("1", True),
        ("yes", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        ("", False),
        ("off", False),
    ):
        monkeypatch.setenv("PROTRAIN_PLAN_CACHE", raw)
        assert config.settings().plan_cache is want, raw
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "maybe")
    with pytest.raises(OptionsError, match="PROTRAIN_PLAN_CACHE='maybe'"):
        config.settings()


# ------------------------------------------------------------------------------ the pass list
def test_pass_contracts_are_consistent():
    from protrain_fx import pipeline

    assert pipeline.check_contracts() == []
    for names in pipeline.STAGES.values():
        assert set(names) <= set(pipeline.PASSES)


def _plan_accesses(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """Fields of ``plan`` a pass module reads and those it writes (assigns, or mutates in place)."""
    tree = ast.parse(path.read_text())
    reads, writes = set(), set()
    mutators = {
        "append",
        "extend",
        "update",
        "add",
        "pop",
        "setdefault",
        "clear",
        "insert",
        "remove",
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "plan"
        ):
            (writes if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in mutators
            and isinstance(node.func.value, ast.Attribute)
            and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id == "plan"
        ):
            writes.add(node.func.value.attr)
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Attribute)
                    and isinstance(t.value.value, ast.Name)
                    and t.value.value.id == "plan"
                ):
                    writes.add(t.value.attr)
    return reads - {"plan"}, writes


def test_passes_touch_only_the_plan_fields_they_declare():
    from protrain_fx import pipeline

    by_module: dict[str, list] = {}
    for spec in pipeline.PASSES.values():
        by_module.setdefault(spec.run.__module__, []).append(spec)
    wrong = []
    for module, specs in by_module.items():
        reads, writes = _plan_accesses(MODULES[module])
        declared_reads = set().union(*(s.reads | s.writes for s in specs))
        declared_writes = set().union(*(s.writes for s in specs))
        if reads - declared_reads:
            wrong.append(f"{module} reads undeclared {sorted(reads - declared_reads)}")
        if writes - declared_writes:
            wrong.append(f"{module} writes undeclared {sorted(writes - declared_writes)}")
    assert not wrong, "\n".join(wrong)


def test_a_pass_that_writes_an_undeclared_field_is_stopped(monkeypatch):
    from protrain_fx import pipeline
    from protrain_fx.errors import ProtrainError
    from protrain_fx.plan.plan import Plan

    def sneaky(gm, plan):
        plan.n_buffer = 7
        return gm

    monkeypatch.setitem(pipeline.PASSES, "sneaky", pipeline.PassSpec("sneaky", sneaky, frozenset()))
    monkeypatch.setitem(pipeline.STAGES, "dynamo", ("sneaky",))
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    plan = Plan(chunk_size=0, n_persist=0, n_buffer=1, n_swap=0, n_checkpoint=0)
    with pytest.raises(
        ProtrainError,
        match=r"sneaky changed plan fields it does not declare: "
        r"\['n_buffer'\]",
    ):
        pipeline.run_stage("dynamo", gm, plan)


def test_passes_that_results_need_cannot_be_disabled(monkeypatch):
    from protrain_fx import pipeline
    from protrain_fx.errors import ProtrainError

    monkeypatch.setenv("PROTRAIN_DISABLE_PASSES", "chunk_gather")
    with pytest.raises(ProtrainError, match="chunk_gather cannot be disabled"):
        pipeline.disabled_passes()
    monkeypatch.setenv("PROTRAIN_DISABLE_PASSES", "swap_offload,chunk_schedule")
    assert pipeline.disabled_passes() == {"swap_offload", "swap_reload", "chunk_schedule"}


def test_disabling_the_optional_passes_keeps_results_exact(monkeypatch):
    from models import build

    from protrain_fx.testing import compare_with_eager, random_batches

    monkeypatch.setenv(
        "PROTRAIN_DISABLE_PASSES", "swap_offload,chunk_schedule,recompute,block_marks"
    )
    torch.manual_seed(0)
    model = build("llama", n_layer=2, dim=32, n_head=2, n_kv_head=1, ffn_dim=64, max_seq_len=32)
    r = compare_with_eager(
        model,
        random_batches(2, batch=2, seq=16),
        {"compiler": "eager", "n_persist": 0, "chunk_size": 32768, "n_swap": 1, "n_checkpoint": 1},
    )
    assert r.max_loss_rel <= 1e-6 and r.max_param_abs <= 1e-6


# ------------------------------------------------------------------------------ allocation
ALLOCATING_CALLS = {
    "torch.empty",
    "torch.zeros",
    "torch.ones",
    "torch.full",
    "torch.empty_like",
    "torch.zeros_like",
    "torch.ones_like",
    "torch.full_like",
    "torch.tensor",
    "torch.randn",
    "torch.rand",
    "torch.arange",
    "torch.empty_strided",
}
ALLOCATING_METHODS = {
    "ensure_buffers",
    "ensure",
    "pinned_empty",
    "host_empty",
    "cached_host_empty",
    "registered_host_empty",
    "pin_memory",
    "cuda",
    "to",
}


def _allocations(path: pathlib.Path) -> list[str]:
    """Calls in ``path`` that allocate real memory; factory calls inside ``with <x>.fake_mode:``
    make fake tensors and are fine."""
    tree = ast.parse(path.read_text())
    fake_spans = [
        (n.lineno, n.end_lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.With)
        and any("fake_mode" in ast.unparse(i.context_expr) for i in n.items)
    ]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        in_fake = any(a <= node.lineno <= b for a, b in fake_spans)
        method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if (name in ALLOCATING_CALLS and not in_fake) or (
            method in ALLOCATING_METHODS and name not in ("torch.fx.GraphModule.to",)
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    return found


def test_passes_and_graph_analysis_allocate_nothing_in_their_source():
    files = sorted(PASSES_DIR.glob("*.py")) + sorted((PACKAGE / "graph").glob("*.py"))
    found = [a for f in files for a in _allocations(f)]
    assert not found, "\n".join(found)


def _allocating_frames(monkeypatch, extra_pass=None) -> list[str]:
    """One compile and step of an offloaded, swapped, recomputed model: every real tensor allocated
    through torch's factories or protrain's buffer and pinned-memory functions is traced to the
    frames that asked for it; returns those in a pass or the graph layer."""
    import sys

    from models import build
    from torch._subclasses.fake_tensor import FakeTensor

    from protrain_fx import pipeline
    from protrain_fx.machine import pinned
    from protrain_fx.runtime import chunk_buffers

    culprits = []
    watched = (str(PASSES_DIR), str(PACKAGE / "graph"))

    def check(result):
        if isinstance(result, FakeTensor) or (isinstance(result, torch.Tensor) and result.is_meta):
            return  # no memory behind it
        # the callers of traced(), innermost first (what inspect.stack()[2:] lists, without reading
        # every frame's source lines: that made each allocation cost milliseconds)
        frame = sys._getframe(2)
        while frame is not None:
            filename, function = frame.f_code.co_filename, frame.f_code.co_name
            # a pass or the graph layer; or the control's stand-in pass
            if filename.startswith(watched) or function == "allocating":
                culprits.append(
                    f"{filename}:{frame.f_lineno} ({function}): "
                    f"{type(result).__name__}"
                    f" {getattr(result, 'shape', None)} "
                    f"{getattr(result, 'device', None)}"
                )
                return
            frame = frame.f_back

    def wrap(owner, name):
        real = getattr(owner, name)

        def traced(*args, **kwargs):
            out = real(*args, **kwargs)
            check(out)
            return out

        monkeypatch.setattr(owner, name, traced)

    for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "tensor"):
        wrap(torch, name)
    for name in ("pinned_empty", "host_empty", "cached_host_empty", "registered_host_empty"):
        wrap(pinned, name)
    wrap(chunk_buffers.ChunkBuffers, "ensure")
    if extra_pass is not None:
        monkeypatch.setitem(
            pipeline.PASSES, "extra", pipeline.PassSpec("extra", extra_pass, frozenset())
        )
        monkeypatch.setitem(pipeline.STAGES, "forward", pipeline.STAGES["forward"] + ("extra",))
    torch.manual_seed(0)
    model = build("llama", n_layer=2, dim=32, n_head=2, n_kv_head=1, ffn_dim=64, max_seq_len=32)
    compiled = torch.compile(
        model,
        backend="protrain",
        options={
            "compiler": "eager",
            "n_persist": 0,
            "chunk_size": 32768,
            "n_swap": 1,
            "n_checkpoint": 1,
        },
    )
    x = torch.randint(0, 256, (2, 16))
    compiled(x, x).backward()
    return culprits


def test_passes_and_graph_analysis_allocate_nothing_when_they_run(monkeypatch):
    culprits = _allocating_frames(monkeypatch)
    assert not culprits, "\n".join(culprits)


def test_the_allocation_check_catches_a_pass_that_allocates(monkeypatch):
    """The old chunk_schedule allocated the device buffers itself, in real-tensor mode: caught."""
    from protrain_fx import _compat
    from protrain_fx.runtime import chunk_store

    def allocating(gm, plan):
        with _compat.real_tensor_mode():
            for store_id in {sid for sid, _ in plan.input_entry.values()}:
                chunk_store.get_store(store_id).buffers.slots.clear()
                chunk_store.get_store(store_id).ensure_buffers(2)
        return gm

    culprits = _allocating_frames(monkeypatch, allocating)
    assert any("allocating" in c for c in culprits), culprits


# ------------------------------------------------------------------------------ size
def test_no_module_is_too_long():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > 520
    ]
    assert not long, long


# ------------------------------------------------------------------------------ style
def test_ruff_format_and_lint_are_clean():
    """The formatter and the linter (ruff, line length 100; pyproject.toml says what is checked)
    have nothing to change or report."""
    import subprocess
    import sys

    ruff = [sys.executable, "-m", "ruff"]
    fmt = subprocess.run(
        ruff + ["format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, "run `ruff format .`:\n" + fmt.stdout[-3000:] + fmt.stderr[-1000:]
    lint = subprocess.run(ruff + ["check", "."], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, (
        "run `ruff check --fix .`:\n" + lint.stdout[-3000:] + lint.stderr[-1000:]
    )
