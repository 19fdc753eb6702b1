"""Shapes that vary (issue 26): sixteen sequence lengths and three batch sizes compile a few times,
not once per shape, train exactly like eager at every shape with offloaded chunks, and a dynamic
graph re-planned after an out-of-memory error stays dynamic."""

import copy

import pytest
import torch
from models import build

import protrain_fx
from protrain_fx import backend, region_program
from protrain_fx.profiling.longer_inputs import LongerInputs
from protrain_fx.runtime.chunk_store import ChunkStore
from protrain_fx.testing import make_adamw, random_batches


def gpt():
    torch.manual_seed(0)
    return build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=64)


def count_compiles(monkeypatch):
    calls = []
    real = backend._compile

    def counted(*a, **k):
        calls.append(a[1][-1].shape if a[1] and isinstance(a[1][-1], torch.Tensor) else None)
        return real(*a, **k)

    monkeypatch.setattr(backend, "_compile", counted)
    return calls


def sweep_data():
    data = []
    for i, seq in enumerate(range(4, 20)):  # 16 lengths, batch sizes 2, 1 and 3 among them
        batch = (2, 1, 3)[i % 3]
        data.append(random_batches(1, batch, seq, vocab=64, seed=seq)[0])
    return data


def train(call, opt, data):
    losses = []
    for x, y in data:
        loss = call(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def offloaded_pair(base, compiler="eager"):
    """An eager copy of ``base`` and its AdamW, and a protrain-compiled copy (every chunk on the
    host, a budget of three times the parameters) and its AdamW: (ref, ref_opt, mine, opt,
    compiled)."""
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt, opt = make_adamw(ref), make_adamw(mine)
    budget = 3 * sum(p.numel() * 4 for p in base.parameters())
    compiled = torch.compile(
        mine,
        backend="protrain",
        options={"compiler": compiler, "optimizer": opt, "memory_budget": budget, "n_persist": 0},
    )
    return ref, ref_opt, mine, opt, compiled


# Inductor: 4 compiles of ~1 min each on 2 cores, outside CI
@pytest.mark.parametrize("compiler", ["eager"])
def test_sixteen_lengths_compile_a_few_times_and_match_eager(monkeypatch, compiler):
    compiles = count_compiles(monkeypatch)
    ref, ref_opt, mine, opt, compiled = offloaded_pair(gpt(), compiler)
    data = sweep_data()
    ref_losses, losses = train(ref, ref_opt, data), train(compiled, opt, data)
    assert len(compiles) <= 3, f"{len(compiles)} compiles for 16 shapes"
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert rel <= 1e-5, (losses, ref_losses)
    sd, ref_sd = mine.state_dict(), ref.state_dict()
    assert max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd) <= 1e-3
    assert "host" in [c["placement"] for c in protrain_fx.get_plan(compiled).to_dict()["chunks"]]


def test_a_dynamic_graph_replanned_after_an_oom_stays_dynamic(monkeypatch):
    # the out-of-memory re-plan alone (not those at larger calls' sizes, tested below)
    monkeypatch.setattr(LongerInputs, "MAX_REPLANS", 0)
    ref, ref_opt, mine, opt, compiled = offloaded_pair(gpt())
    data = sweep_data()
    losses = train(compiled, opt, data[:3])  # the third shape compiles the dynamic graph
    real, state = ChunkStore.gather, {"n": 0}

    def flaky(self, *a, **k):
        state["n"] += 1
        if state["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, *a, **k)

    monkeypatch.setattr(ChunkStore, "gather", flaky)
    compiles = count_compiles(monkeypatch)
    # re-planned once, then every other length on the new plan
    losses += train(compiled, opt, data[3:])
    assert state["n"] > 1 and len(compiles) == 1, compiles
    ref_losses = train(ref, ref_opt, data)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    plan = protrain_fx.get_plan(compiled)
    assert any("re-planned after running out of device memory" in n for n in plan.notes)


def _in_python_dispatcher() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)


@torch._dynamo.allow_in_graph
def positions(h):
    """Position offsets, read as a C++ kernel reads them: run on fake tensors outside dynamo's and
    aot_autograd's tracing (which run under the python dispatcher), the size becomes an int and a
    guard. On CUDA, HF Llama's rotary ``inv_freq @ position_ids`` matmul does this (run 103)."""
    if not _in_python_dispatcher():
        int(h.shape[1])
    return torch.arange(h.shape[1], dtype=h.dtype, device=h.device)[None, :, None] * 1e-3


class Layer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class PositionsNet(torch.nn.Module):
    def __init__(self, vocab=64, d=32, n_layer=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Layer(d) for _ in range(n_layer))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x, y):
        h = self.emb(x)
        h = h + positions(h)
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("examples", ["traced", "propagated"])
def test_regions_compile_on_the_sizes_dynamo_traced_not_on_a_second_trace(monkeypatch, examples):
    """A graph compiled in regions takes its regions' example inputs from dynamo's trace: running
    the regions again on fake tensors specialized a size a kernel read as an int, one graph per
    sequence length (4 compiles for 4 lengths, where plain torch.compile makes 2). Where the
    regions do run again (``propagated``: a re-plan's own fake mode), they run under the python
    dispatcher, as dynamo traced them, and specialize nothing either."""
    if examples == "propagated":
        monkeypatch.setattr(region_program, "_traced_examples", lambda *a: None)
    torch.manual_seed(0)
    compiles = count_compiles(monkeypatch)
    ref, ref_opt, mine, opt, compiled = offloaded_pair(PositionsNet())
    data = [random_batches(1, 2, seq, vocab=64, seed=seq)[0] for seq in (16, 12, 14, 10)]
    ref_losses, losses = train(ref, ref_opt, data), train(compiled, opt, data)
    assert len(compiles) == 2, f"{len(compiles)} compiles for 4 lengths"
    assert "regions" in protrain_fx.get_plan(compiled).summary()
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    sd, ref_sd = mine.state_dict(), ref.state_dict()
    assert max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd) <= 1e-3


def test_a_call_larger_than_the_dynamic_graphs_plan_is_told_once_per_new_largest(caplog):
    """The dynamic graph is planned at the length dynamo traced it at (the second); a longer call
    runs on that plan, and one line (and the plan's notes) says its peak may pass the prediction,
    once per new largest call, none for shorter ones."""
    _, _, _, opt, compiled = offloaded_pair(gpt())
    data = [random_batches(1, 2, seq, vocab=64, seed=seq)[0] for seq in (8, 12, 16, 10, 18, 16)]
    with caplog.at_level("WARNING", logger="protrain_fx"):
        train(compiled, opt, data)
    told = [r.getMessage() for r in caplog.records if "its plan was made for" in r.getMessage()]
    # x and y of 2 x 12 planned: 48 elements; 2 x 16 and 2 x 18 are told
    assert len(told) == 2, told
    assert "inputs of 64 elements, 1.33x the 48" in told[0] and "inputs of 72" in told[1]
    notes = protrain_fx.get_plan(compiled).notes
    assert [n for n in notes if n.startswith("inputs of ")] == [told[1].split(": ", 2)[2]]


def long_pair(budget_params: int):
    """An eager GPT of block size 64 and a protrain copy under ``budget_params`` times its
    parameters' bytes, the placement the search's."""
    torch.manual_seed(0)
    base = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=64)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt, opt = make_adamw(ref), make_adamw(mine)
    budget = budget_params * sum(p.numel() * 4 for p in base.parameters())
    options = {"compiler": "eager", "optimizer": opt, "memory_budget": budget}
    return ref, ref_opt, mine, opt, torch.compile(mine, backend="protrain", options=options)


def test_a_call_the_dynamic_plan_has_no_room_for_is_planned_at_its_sizes_first(monkeypatch, caplog):
    """The dynamic graph is planned at 4 x 12 tokens; a call of 4 x 60, whose activations the plan
    has no room for under the budget, is planned for first, at its own sizes (profiled on its
    inputs: the bytes saved for backward grow with them; the new plan's peak is within the budget);
    calls no longer than it then run on that plan; dynamo compiles nothing again; losses and
    parameters as eager's."""
    compiles = count_compiles(monkeypatch)
    ref, ref_opt, mine, opt, compiled = long_pair(8)
    data = [random_batches(1, 4, seq, vocab=64, seed=seq)[0] for seq in (8, 12, 60, 40, 60)]
    losses = train(compiled, opt, data[:2])
    first = protrain_fx.get_plan(compiled)
    with caplog.at_level("WARNING", logger="protrain_fx"):
        losses += train(compiled, opt, data[2:])
    said = [r.getMessage() for r in caplog.records if "its plan was made for" in r.getMessage()]
    assert len(said) == 1 and "planning it again at these sizes" in said[0], said
    assert len(compiles) == 3, compiles  # the two dynamo graphs, one plan at the longer sizes
    plan = protrain_fx.get_plan(compiled)
    assert plan is not first and any(n.startswith("re-planned: inputs of 480") for n in plan.notes)
    # what the blocks and the rest save for backward, as profiled: 5x the tokens, 5x the bytes
    saved = lambda p: sum(p.predicted["profiled"]["saved_keep"])  # noqa: E731
    assert saved(plan) >= 4 * saved(first) > 0, (saved(plan), saved(first))
    assert plan.predicted["peak_bytes"] <= plan.predicted["budget_bytes"]
    ref_losses = train(ref, ref_opt, data)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    sd, ref_sd = mine.state_dict(), ref.state_dict()
    assert max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd) <= 1e-5


def test_no_plan_at_a_longer_calls_sizes_goes_on_under_the_plan_and_tries_no_more(caplog):
    """Where no plan fits the budget at the longer call's sizes, the graph goes on under its plan
    (running out of memory would be survived as for any plan), says so once, and tries no other
    size; the training is eager's."""
    ref, ref_opt, mine, opt, compiled = long_pair(6)
    data = [random_batches(1, 4, seq, vocab=64, seed=seq)[0] for seq in (8, 12, 60, 64)]
    with caplog.at_level("WARNING", logger="protrain_fx"):
        losses = train(compiled, opt, data)
    said = [r.getMessage() for r in caplog.records if "these sizes" in r.getMessage()]
    assert len(said) == 2 and "no plan fits these sizes" in said[1], said
    assert "it re-plans if it runs out of memory" in protrain_fx.get_plan(compiled).notes[-1]
    ref_losses = train(ref, ref_opt, data)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5


def test_a_second_run_takes_the_plan_at_the_longer_sizes_from_the_plan_cache(monkeypatch, tmp_path):
    """The plan made at a longer call's sizes has a plan cache entry of its own (keyed by those
    sizes): a second run of the loop profiles nothing and is served it, placement included."""
    from protrain_fx import plan_cache
    from protrain_fx.profiling import frugal

    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "1")
    monkeypatch.setattr(plan_cache, "path_of", lambda key: str(tmp_path / f"{key}.json"))
    monkeypatch.setattr(plan_cache, "profile_path", lambda key: str(tmp_path / f"{key}.profile"))
    data = [random_batches(1, 4, seq, vocab=64, seed=seq)[0] for seq in (8, 12, 60)]
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        _, _, _, opt, compiled = long_pair(8)
        runs.append(train(compiled, opt, data))
        plan = protrain_fx.get_plan(compiled)
        assert any(n.startswith("re-planned: inputs of 480") for n in plan.notes)

        def no_profiling(*a, **k):
            raise AssertionError("profiled in the second run")

        monkeypatch.setattr(frugal, "profile_step", no_profiling)
    assert plan.predicted["from_cache"] and runs[0] == runs[1]
