"""Progress lines while a graph waits for its first step (issue 23.3): one line per phase on the
``protrain_fx.progress`` logger, with the seconds since dynamo began the graph; a level quiets
them."""

import logging
import re
import subprocess
import sys

import pytest
import torch
from models import build

from protrain_fx.testing import random_batches


def _train_one_step(options, n_layer: int = 2):
    torch.manual_seed(0)
    model = build("gpt", n_layer=n_layer, n_embd=32, n_head=2, block_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="protrain", options={"optimizer": opt, **options})
    ((x, y),) = random_batches(1, 2, 16)
    compiled(x, y).backward()
    opt.step()
    return compiled


@pytest.mark.parametrize("regions", [True, False])
def test_one_line_per_phase_under_an_automatic_plan(caplog, monkeypatch, regions):
    """A whole graph compiles its backward at the first backward; a graph compiled in regions
    compiles each region's code (forward and backward) in one line per code."""
    monkeypatch.setenv("PROTRAIN_REGIONS", "1" if regions else "0")
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        _train_one_step({"compiler": "eager", "memory_budget": "1GB"})
    lines = [r.getMessage() for r in caplog.records if r.name == "protrain_fx.progress"]
    text = "\n".join(lines)
    region = ["compiling region code 1: pre", "compiling region code 2: blocks.0"]
    order = [
        "nodes,",
        "compiling the profiling plan",
        *(region if regions else []),
        "profiling one step",
        "searching the plans",
        "searched",
        "compiling the plan",
        *(region if regions else ["compiling the backward"]),
        "ready after",
    ]
    where, start = [], 0
    for key in order:  # each line after the one before it
        at = next((i for i, line in enumerate(lines) if i >= start and key in line), -1)
        where.append(at)
        start = at + 1 if at >= 0 else start
    assert -1 not in where and where == sorted(where), text
    assert all(line.startswith("protrain [") and " s] graph " in line for line in lines), text
    ready = lines[where[-1]]
    for phase in ("tracing", "profiling compile", "profiling", "search", "compile"):
        assert f"{phase} " in ready, ready


def test_binding_the_regions_that_reuse_a_code_says_so(caplog, monkeypatch):
    """Regions that reuse a compiled code get chunk stores of their own (host memory pinned for
    their offloaded chunks on CUDA: seconds on a large model): a line as the first is bound, and one
    with how many, how long and how much host memory, also in the plan's notes."""
    import protrain_fx

    monkeypatch.setenv("PROTRAIN_REGIONS", "1")
    options = {"compiler": "eager", "n_persist": 0, "n_swap": 0, "n_checkpoint": 0}
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        compiled = _train_one_step(options, n_layer=4)
    lines = [r.getMessage() for r in caplog.records if r.name == "protrain_fx.progress"]
    start = [i for i, line in enumerate(lines) if "binding the regions that reuse" in line]
    done = [i for i, line in enumerate(lines) if "regions to chunk stores in" in line]
    assert len(start) == 1 and len(done) == 1 and start[0] < done[0], lines
    assert "bound 3 regions" in lines[done[0]] and "KiB of host memory" in lines[done[0]], lines
    assert any("regions to chunk stores in" in n for n in protrain_fx.get_plan(compiled).notes)


def test_bound_host_memory_is_not_lowered_by_what_others_free(caplog, monkeypatch):
    """The binding line's host memory is what the binding allocated: another graph's buffers
    collected meanwhile (here: freed inside the first binding) do not lower it (a CI run of
    2026-12-05 printed "0 B of host memory" for offloaded stores that way)."""
    from protrain_fx.machine import pinned
    from protrain_fx.runtime import binding

    monkeypatch.setenv("PROTRAIN_REGIONS", "1")
    options = {"compiler": "eager", "n_persist": 0, "n_swap": 0, "n_checkpoint": 0}

    def bound_line() -> str:
        torch._dynamo.reset()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="protrain_fx"):
            _train_one_step(options, n_layer=4)
        said = [r.getMessage() for r in caplog.records if "to chunk stores in" in r.getMessage()]
        assert len(said) == 1, said
        return re.sub(r" in [\d.]+ s", "", said[0].split("] ", 1)[1])  # no clock, no time

    alone = bound_line()
    others = [pinned.host_empty(16 << 20, torch.uint8, pin=False)]  # another graph's 16 MiB
    bind = binding.GraphBinding.bind

    def bind_while_others_are_freed(self, params):
        others.clear()
        return bind(self, params)

    monkeypatch.setattr(binding.GraphBinding, "bind", bind_while_others_are_freed)
    assert bound_line() == alone and not others
    assert "bound 3 regions" in alone and "KiB of host memory" in alone, alone


def test_an_inference_graph_is_ready_after_its_compile(caplog):
    torch.manual_seed(0)
    model = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32)
    compiled = torch.compile(model, backend="protrain", options={"compiler": "eager"})
    ((x, y),) = random_batches(1, 2, 16)
    with caplog.at_level(logging.INFO, logger="protrain_fx"), torch.no_grad():
        compiled(x, y)
    ready = [r.getMessage() for r in caplog.records if "ready after" in r.getMessage()]
    assert len(ready) == 1 and "compile " in ready[0], ready


def test_lines_are_on_stderr_by_default_and_a_level_quiets_them():
    """In a fresh interpreter with no logging configured the lines reach stderr; with the
    ``protrain_fx`` logger at WARNING, none do."""
    code = (
        "import logging, sys\n"
        "sys.path.insert(0, 'examples'); sys.path.insert(0, 'tests')\n"
        "from test_progress import _train_one_step\n"
        "if sys.argv[1] == 'quiet': logging.getLogger('protrain_fx').setLevel(logging.WARNING)\n"
        "_train_one_step({'compiler': 'eager'})\n"
    )
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for mode in ("default", "quiet"):
        proc = subprocess.run(
            [sys.executable, "-c", code, mode], cwd=root, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[mode] = proc.stderr
    assert "compiling the plan" in out["default"] and "ready after" in out["default"]
    assert "protrain [" not in out["quiet"], out["quiet"][-2000:]


@pytest.mark.parametrize("regions", [True, False])
def test_the_first_step_says_how_long_its_parts_ran(caplog, monkeypatch, regions):
    """After the ready line the first step still loads kernels, allocates buffers and runs the
    first CPU optimizer steps: its forward, its backward and the first opt.step() of an automatic
    plan each say how long they took (first_step.py), once; a graph compiled whole says its
    backward included its compile; the second step says nothing."""
    monkeypatch.setenv("PROTRAIN_REGIONS", "1" if regions else "0")
    torch.manual_seed(0)
    model = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"optimizer": opt, "compiler": "eager", "memory_budget": "1GB"}
    compiled = torch.compile(model, backend="protrain", options=options)
    said = []
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        for x, y in random_batches(2, 2, 16):
            (compiled(x, y) / 2).backward()  # the backward starts below the graph's output
            opt.step()
            opt.zero_grad()
            said.append(len(caplog.records))
    lines = [r.getMessage() for r in caplog.records if r.name == "protrain_fx.progress"]
    firsts = [line for line in lines if "] graph 0/0: first " in line]
    assert [line.split(": first ")[1].split(" ")[0] for line in firsts] == [
        "forward",
        "backward",
        "opt.step()",
    ], lines
    assert all(line.startswith("protrain [") for line in firsts), firsts
    assert ("(its compile included)" in firsts[1]) == (not regions), firsts
    ready = next(i for i, line in enumerate(lines) if "ready after" in line)
    assert (lines.index(firsts[0]) > ready) == regions, lines
    assert said[1] == said[0], "the second step said something"


def test_first_step_lines_of_two_graphs_sharing_one_optimizer(caplog):
    """A graph break gives two graphs, each with its own first-step lines and its own hook on the
    one optimizer: both say theirs, and the hooks go without disturbing the optimizer's own loop
    over them (removing one from inside that loop raised 'OrderedDict mutated during
    iteration')."""

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h).pow(2).mean()

    torch.manual_seed(0)
    model = Broken()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"optimizer": opt, "compiler": "eager", "memory_budget": "1GB"}
    compiled = torch.compile(model, backend="protrain", options=options)
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        for _ in range(3):
            compiled(torch.randn(4, 16)).backward()
            opt.step()
            opt.zero_grad()
    lines = [r.getMessage() for r in caplog.records if r.name == "protrain_fx.progress"]
    steps = [line for line in lines if ": first opt.step() returned" in line]
    assert len(steps) == 2 and steps[0].split(":")[0] != steps[1].split(":")[0], lines
    hooks = [getattr(h, "__qualname__", "") for h in opt._optimizer_step_post_hooks.values()]
    assert not any("FirstStep" in q for q in hooks), hooks  # gone after the next calls
