"""Compiled codes served from aot_autograd's cache with what their compile did
(protrain_fx/code_cache.py): a second compile of the same model (a second run of a script) gets
every region code from the cache, runs none of protrain's passes, and trains bit for bit like the
first, which trains like eager; codes of other plans (another block policy on the same block code,
another placement) are never served for each other; a code whose sidecar was lost is compiled
again; the served forward and backward keep protrain's run-time guards (an out-of-memory error in a
served backward goes where a compiled one's goes); ``PROTRAIN_COMPILE_CACHE=0``, dumps and the
profiling plan bypass it."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import LossOnly, hf_llama
from torch._dynamo.utils import counters

import protrain_fx
from protrain_fx import code_cache, pipeline
from protrain_fx.backend import StepOutOfMemory
from protrain_fx.runtime import hybrid_optim
from protrain_fx.runtime.chunk_store import ChunkStore
from protrain_fx.testing import make_adamw, random_batches, train_steps

# block 0 swapped, blocks 1-2 recomputed, block 3 kept; chunks partly offloaded
OPTIONS = {"compiler": "inductor", "n_persist": 3, "n_swap": 1, "n_checkpoint": 2, "n_buffer": 1}


@pytest.fixture
def code_cache_on(monkeypatch, tmp_path):
    """The cache on, its sidecars (and the key: the environment is part of it) in a fresh folder."""
    monkeypatch.setenv("PROTRAIN_COMPILE_CACHE", "1")
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    return tmp_path


def base_model():
    return LossOnly(hf_llama(num_hidden_layers=4, attn_implementation="sdpa"))


def run(base, data, options=OPTIONS, passes=None):
    """Train a copy of ``base`` through protrain; the losses, the weights, the plan, how many codes
    aot_autograd served and saved, and the passes that ran."""
    torch._dynamo.reset()
    counters.clear()
    model = copy.deepcopy(base)
    opt = make_adamw(model)
    compiled = torch.compile(model, backend="protrain", options=dict(options, optimizer=opt))
    losses = train_steps(model, compiled, data, opt=opt)
    aot = dict(counters["aot_autograd"])
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "plan": protrain_fx.get_plan(compiled),
        "hits": aot.get("autograd_cache_hit", 0),
        "saved": aot.get("autograd_cache_saved", 0),
        "passes": list(passes) if passes is not None else None,
        "model": model,
        "opt": opt,
        "compiled": compiled,
    }


def count_passes(monkeypatch) -> list:
    ran = []
    real = pipeline.run_stage

    def counting(stage, gm, plan, dump):
        ran.append(stage)
        return real(stage, gm, plan, dump)

    monkeypatch.setattr(pipeline, "run_stage", counting)
    return ran


def same(a, b) -> bool:
    return a["losses"] == b["losses"] and all(
        torch.equal(a["state"][k], b["state"][k]) for k in a["state"]
    )


@pytest.mark.parametrize("regions", ["1", "0"])
def test_a_second_compile_is_served_every_code_and_trains_bit_for_bit_like_the_first(
    monkeypatch, code_cache_on, regions
):
    """In regions and compiled whole (whose backward is compiled at its first call, after the
    forward's entry was made: the sidecar is written once the backward is compiled, and the served
    graph's optimizer steps its offloaded chunks as the compiled one's did)."""
    monkeypatch.setenv("PROTRAIN_REGIONS", regions)
    base = base_model()
    data = random_batches(3, 2, 16, vocab=512)
    first = run(base, data)
    codes = len(list((code_cache_on / "codes").glob("*.json")))
    # in regions: pre, a swapped block, recomputed blocks (resident, offloaded), a kept one, post;
    # one sidecar and one aot_autograd entry per code
    assert first["saved"] == codes >= (5 if regions == "1" else 1) and first["hits"] == 0
    passes = count_passes(monkeypatch)
    second = run(base, data, passes=passes)
    assert second["hits"] == codes and second["saved"] == 0
    assert not [s for s in passes if s != "dynamo"], passes  # no joint, forward or backward passes
    assert same(first, second), (first["losses"], second["losses"])
    assert code_cache.SERVED_NOTE in second["plan"].notes
    if regions == "1":
        said = next(n for n in second["plan"].notes if n.startswith("compiled in"))
        assert f"({codes} served from aot_autograd's cache)" in said, said
    # the served graph's stores are attached to the optimizer (it steps their offloaded chunks)
    handles = [hybrid_optim.handle_of(r["opt"]) for r in (first, second)]
    assert handles[1] is not None and len(handles[1].states) == len(handles[0].states) > 0
    # what the passes wrote comes back: the swapped block's values, the chunk table
    assert second["plan"].swapped == first["plan"].swapped and second["plan"].swapped
    assert [c.placement for c in second["plan"].chunks] == [
        c.placement for c in first["plan"].chunks
    ]
    # and the first trains like eager
    ref = copy.deepcopy(base)
    ref_losses = train_steps(ref, ref, data, opt=make_adamw(ref))
    assert max(abs(a - b) / abs(b) for a, b in zip(first["losses"], ref_losses)) <= 1e-5
    sd = ref.state_dict()
    assert max((first["state"][k] - sd[k]).abs().max().item() for k in sd) <= 1e-3


def test_codes_of_other_plans_are_never_served_for_each_other(code_cache_on):
    """Another plan of the same model: the codes whose placement or policy differ (the embedding's
    chunk offloaded instead of resident, which the tied head in the code after the blocks reads;
    every block offloaded and recomputed) are compiled, not served; the one code both plans share
    (a kept, offloaded block) is served; both train like eager, and served like compiled."""
    base = base_model()
    data = random_batches(2, 2, 16, vocab=512)
    ref = copy.deepcopy(base)
    ref_losses = train_steps(ref, ref, data, opt=make_adamw(ref))
    first = run(base, data)
    other = {**OPTIONS, "n_persist": 0, "n_swap": 0, "n_checkpoint": 3}
    compiled_other = run(base, data, other)
    # pre, the recomputed blocks and post compiled again; the kept block served
    assert compiled_other["saved"] == 3 and compiled_other["hits"] == 1
    served_other = run(base, data, other)
    assert served_other["hits"] == 4 and same(compiled_other, served_other)
    for r in (first, compiled_other):
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)) <= 1e-5


def test_a_code_whose_sidecar_was_lost_is_compiled_again(monkeypatch, code_cache_on):
    base = base_model()
    data = random_batches(2, 2, 16, vocab=512)
    first = run(base, data)
    for f in (code_cache_on / "codes").glob("*.json"):
        f.unlink()
    passes = count_passes(monkeypatch)
    second = run(base, data, passes=passes)
    assert "joint" in passes and "backward" in passes  # compiled, not served blind
    assert same(first, second)
    assert len(list((code_cache_on / "codes").glob("*.json"))) == first["saved"]
    third = run(base, data)
    assert third["hits"] == first["saved"] and same(first, third)


@pytest.mark.parametrize("regions", ["1", "0"])
def test_a_served_backward_keeps_protrains_guards(monkeypatch, code_cache_on, regions):
    """Out of memory inside a backward under a budget: compiled or served, the error reaches
    protrain's handler (a StepOutOfMemory that says what happened; never the raw error), and the
    run trains the same afterwards; in regions and compiled whole (where the handler is the guard
    around the compiled backward). Every knob is given, so both runs have one plan."""
    from protrain_fx.backend import ProtrainGraph

    monkeypatch.setenv("PROTRAIN_REGIONS", regions)
    monkeypatch.setattr(ProtrainGraph, "MAX_REPLANS", 0)  # no re-plan: the same plan runs on
    base = base_model()
    data = random_batches(3, 2, 16, vocab=512)
    states = sum(p.numel() * 4 for p in base.parameters())
    options = {**OPTIONS, "memory_budget": 3 * states, "n_persist": 0}
    outcomes = []
    for _ in range(2):  # compiled, then served
        r = run(base, data[:1], options)
        real = ChunkStore.grad_ready
        calls = {"n": 0}

        def flaky(self, *a, _real=real, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. (injected)")
            return _real(self, *a, **k)

        monkeypatch.setattr(ChunkStore, "grad_ready", flaky)
        x, y = data[1]
        with pytest.raises(StepOutOfMemory) as raised:
            r["compiled"](x, y).backward()
        monkeypatch.setattr(ChunkStore, "grad_ready", real)
        r["opt"].zero_grad()
        losses = train_steps(r["model"], r["compiled"], data[1:], opt=r["opt"])
        state = {k: v.detach().clone() for k, v in r["model"].state_dict().items()}
        said = str(raised.value).split(":")[0]
        outcomes.append(((r["hits"], r["saved"]), said, r["losses"] + losses, state))
    ((hits0, saved0), said0, losses0, sd0), ((hits1, saved1), said1, losses1, sd1) = outcomes
    assert hits0 == 0 and saved0 >= (5 if regions == "1" else 1)
    assert hits1 == saved0 and saved1 == 0
    assert said0 == said1, (said0, said1)
    assert losses0 == losses1 and all(torch.equal(sd0[k], sd1[k]) for k in sd0)


@pytest.mark.parametrize("how", ["variable", "dump"])
def test_the_cache_is_bypassed_when_turned_off_or_dumping(
    monkeypatch, code_cache_on, tmp_path, how
):
    base = base_model()
    data = random_batches(1, 2, 16, vocab=512)
    options = dict(OPTIONS)
    if how == "variable":
        monkeypatch.setenv("PROTRAIN_COMPILE_CACHE", "0")
    else:
        options["dump_dir"] = str(tmp_path / "dumps")
    first, second = run(base, data, options), run(base, data, options)
    assert first["saved"] == second["saved"] == second["hits"] == 0
    assert not (code_cache_on / "codes").exists()


def test_an_evaluation_graph_is_served_too(code_cache_on):
    """Training steps, then an evaluation under ``torch.no_grad()`` (an inference graph on the
    training plan's chunks): the second run is served both, and evaluates bit for bit the same."""
    base = base_model()
    data = random_batches(2, 2, 16, vocab=512)
    outs = []
    for _ in range(2):
        r = run(base, data)
        with torch.no_grad():
            evals = [r["compiled"](x, y).item() for x, y in data]
        outs.append((dict(counters["aot_autograd"]), evals, r["losses"]))
    (aot0, evals0, losses0), (aot1, evals1, losses1) = outs
    assert aot0.get("autograd_cache_hit", 0) == 0 and aot0.get("autograd_cache_saved", 0) >= 6
    assert aot1.get("autograd_cache_hit", 0) == aot0["autograd_cache_saved"]
    assert "autograd_cache_miss" not in aot1
    assert evals0 == evals1 and losses0 == losses1


def test_the_profiling_plan_is_served_with_its_static_profile_under_another_budget(
    monkeypatch, code_cache_on
):
    """Two runs of an automatic plan under two budgets (no plan cache): the second run's profiling
    plan (every chunk offloaded, every block recomputed: the same code whatever the budget) is
    served, with the static profile its partitions gave the first run."""
    from protrain_fx import region_program

    profiles = []
    real = region_program.RegionProgram.static_profile

    def recording(self, n_blocks):
        out = real(self, n_blocks)
        profiles.append(out)
        return out

    monkeypatch.setattr(region_program.RegionProgram, "static_profile", recording)
    base = base_model()
    data = random_batches(1, 2, 16, vocab=512)
    states = sum(p.numel() * 4 for p in base.parameters())
    runs = [
        run(base, data, {"compiler": "inductor", "memory_budget": k * states, "n_persist": 0})
        for k in (3, 4)
    ]
    assert len(profiles) == 2 and profiles[0] == profiles[1], profiles
    assert profiles[0].signatures and profiles[0].saved.recompute
    # pre, a block, post of the profiling plan: compiled by the first run, served to the second
    assert runs[0]["hits"] == 0 and runs[1]["hits"] >= 3
    assert max(abs(a - b) for a, b in zip(runs[0]["losses"], runs[1]["losses"])) <= 1e-5


def test_a_plan_from_the_plan_cache_is_served_the_codes_of_the_run_that_cached_it(
    monkeypatch, code_cache_on
):
    """The automatic plan of a model whose chunks all stay resident: the search may pick n_buffer
    1, which the placement runs as 0 (no chunk to gather). The plan cache keeps the knobs as
    decided, so a second run compiles from the options the first compiled from and is served its
    codes (run 41: the 1.42 B GPT's warm run compiled its 4 codes again, its cached plan saying
    n_buffer 0)."""
    import json

    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "1")
    base = base_model()
    # past the step meter's first save (StepMeter.SAVE_AT), which rewrites the cached entry
    data = random_batches(6, 2, 16, vocab=512)
    states = sum(p.numel() * 4 for p in base.parameters())
    options = {"compiler": "inductor", "memory_budget": 8 * states}
    first = run(base, data, options)
    assert all(c.placement == "device" for c in first["plan"].chunks)
    decided = first["plan"].decided_knobs
    (entry,) = [json.load(open(p)) for p in (code_cache_on / "plans").glob("*.json")]
    assert entry["measured"] and entry["knobs"] == decided, (entry["knobs"], decided)
    second = run(base, data, options)
    assert second["plan"].predicted["from_cache"]
    # every code of the plan served (the first run also saved its profiling plan's codes)
    said = next(n for n in second["plan"].notes if n.startswith("compiled in"))
    codes = int(said.split(" distinct codes")[0].rsplit(" ", 1)[-1])
    assert second["hits"] == codes > 0 and second["saved"] == 0, said
    assert f"({codes} served from aot_autograd's cache)" in said, said
    assert same(first, second), (first["losses"], second["losses"])
