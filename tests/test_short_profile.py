"""Profiling a short copy of the graph (issue 23, deliverable 2): the automatic plan profiles a
copy with three of the model's blocks (protrain_fx/graph/shorten.py) instead of compiling the
whole graph a second time; what it derives for every block must be what the whole graph's profile
gives (that the plan trains like eager: tests/test_autoplan.py, 8 layers)."""

import pytest
import torch
from hf_models import hf_llama, hf_loss_no_cache
from models import build

import protrain_fx
from protrain_fx.graph.blocks import detect_blocks
from protrain_fx.graph.shorten import KEPT, shorten
from protrain_fx.testing import make_adamw

OPTS = {"compiler": "eager"}


def dynamo_graph(fn, *args):
    """The dynamo graph of ``fn(*args)`` and its example inputs."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return seen[0]


def test_an_hf_llama_graph_is_shortened_to_three_blocks_that_run():
    model = hf_llama(num_hidden_layers=8)
    x = torch.randint(0, 512, (2, 16))
    gm, inputs = dynamo_graph(lambda x: hf_loss_no_cache(model, x), x)
    structure = detect_blocks(gm)
    short, why = shorten(gm, structure)
    assert short is not None, why
    assert [b.name for b in short.structure.blocks] == [f"model.layers.{i}" for i in range(KEPT)]
    assert short.expand == [0, 1, 1, 1, 1, 1, 1, 2]
    assert len(detect_blocks(short.gm).blocks) == KEPT  # no node of a cut block is left
    # the short graph is the same model with three layers: same inputs, a loss of the same kind
    loss = short.gm(*inputs)[0]
    assert loss.shape == () and torch.isfinite(loss)
    full = gm(*inputs)[0]
    assert not torch.equal(loss, full)  # it really is another computation
    assert len(short.gm.graph.nodes) < len(gm.graph.nodes) * 0.6


def test_blocks_that_compute_differently_are_profiled_whole():
    class Wide(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.a = torch.nn.Linear(16, width)
            self.b = torch.nn.Linear(width, 16)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Wide(32 if i != 4 else 48) for i in range(6))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    model = Stack()
    gm, _ = dynamo_graph(model, torch.randn(2, 16))
    short, why = shorten(gm, detect_blocks(gm))
    assert short is None and "block 4" in why and "computes differently" in why


def test_four_blocks_are_profiled_whole():
    torch.manual_seed(0)
    model = build("gpt", n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    x = torch.randint(0, 64, (2, 16))
    gm, _ = dynamo_graph(model, x, x)
    short, why = shorten(gm, detect_blocks(gm))
    assert short is None and "4 blocks" in why


def _profiled(monkeypatch, whole: bool, model, batch, **knobs):
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
    monkeypatch.setenv("PROTRAIN_PROFILE_WHOLE", "1" if whole else "0")
    torch._dynamo.reset()
    opt = make_adamw(model)
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) * 2
    compiled = torch.compile(
        model,
        backend="protrain",
        options=dict(OPTS, optimizer=opt, memory_budget=budget, **knobs),
    )
    loss = hf_loss_no_cache(compiled, batch)
    loss.backward()
    opt.step()
    return protrain_fx.get_plan(compiled)


@pytest.mark.usefixtures("whole_graph")
def test_the_short_profile_derives_what_the_whole_one_measures(monkeypatch):
    """Saved bytes per block under both policies, the recomputed FLOP share and the block
    signatures come from partitions of the graph: the short copy's, widened to every block, must
    equal the whole graph's exactly (HF Llama, 5 layers, tied embeddings, GQA: the fewest that are
    shortened, KEPT + 2; the middle kept block stands for three)."""
    layers = KEPT + 2
    batch = torch.randint(0, 512, (2, 16))
    short = _profiled(monkeypatch, False, hf_llama(num_hidden_layers=layers), batch)
    # the whole graph profiled for the plan the short profile chose (which plan is fastest rests on
    # measured times, which differ between two profiles, and the more under load)
    knobs = ("chunk_size", "n_persist", "n_buffer", "n_swap", "n_checkpoint")
    chosen = {k: getattr(short, k) for k in knobs}
    whole = _profiled(monkeypatch, True, hf_llama(num_hidden_layers=layers), batch, **chosen)
    pw, ps = whole.predicted["profiled"], short.predicted["profiled"]
    for key in (
        "saved_keep",
        "saved_recompute",
        "saved_nonblock_keep",
        "saved_nonblock_recompute",
        "recomputed_share",
    ):
        assert ps[key] == pw[key], key
    assert len(ps["block_fwd_ms"]) == layers
    assert ps["conditions"]["profiled_blocks"] == KEPT and ps["conditions"]["blocks"] == layers
    assert "profiled_blocks" not in pw["conditions"]
    assert any(f"3 of its {layers} blocks" in n for n in short.notes)
    assert any("profiled the whole graph: PROTRAIN_PROFILE_WHOLE=1" in n for n in whole.notes)
    # the same memory: the same predicted peak for the same plan
    assert {k: getattr(whole, k) for k in knobs} == chosen
    assert short.predicted["peak_bytes"] == whole.predicted["peak_bytes"]
