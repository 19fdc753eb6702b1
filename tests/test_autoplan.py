"""The automatic plan on the CPU (where the budget is whatever is passed): profiled under the most
frugal plan, searched, trained exactly like eager PyTorch, cached, and explained (summary, memory
plot)."""

import pickle

import pytest
import torch
from models import build

import protrain_fx
from protrain_fx import autoplan, plan_cache
from protrain_fx.errors import NoPlanFits
from protrain_fx.profiling import frugal
from protrain_fx.testing import compare_with_eager, make_adamw, random_batches, train_steps

OPTS = {"compiler": "eager"}


def gpt(n_layer=4, **kw):
    torch.manual_seed(0)
    return build("gpt", n_layer=n_layer, n_embd=32, n_head=2, block_size=16, vocab_size=64, **kw)


def state_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("n_layer", [4, 8])
def test_automatic_plan_offloads_to_fit_and_trains_like_eager(n_layer):
    model = gpt(n_layer)
    # under params + grads + two moments: some chunks must leave the device
    budget = 2 * state_bytes(model)
    r = compare_with_eager(
        model,
        random_batches(4, 2, 16, vocab=64),
        dict(OPTS, memory_budget=budget),
        give_optimizer=True,
    )
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-3 and r.max_param_update > 1e-3
    plan, pred = r.plan, r.plan.predicted
    assert pred["peak_bytes"] <= budget and pred["budget_bytes"] == budget
    assert plan.n_persist < len(plan.chunks)
    assert pred["profile_s"] > 0 and pred["search_s"] > 0 and pred["plans_evaluated"] > 1
    # compiled in regions, the profiled step runs every block (each distinct one compiled once);
    # a whole graph is profiled on a short copy with three of them (protrain_fx/graph/shorten.py)
    regions = any("compiled in" in n and "regions" in n for n in plan.notes)
    assert regions
    assert pred["profiled"]["conditions"].get("profiled_blocks", n_layer) == n_layer
    assert len(pred["profiled"]["block_fwd_ms"]) == n_layer and all(
        t > 0 for t in pred["profiled"]["block_fwd_ms"]
    )
    assert pred["timeline"][0][2] == "step start" and pred["timeline"][-1][2] == "step end"
    assert plan.measured["iter_s"] > 0  # the step meter saw the training steps
    text = plan.summary()
    assert "automatic plan" in text and "predicted" in text


def test_given_knobs_are_honoured_and_the_rest_searched():
    model = gpt()
    r = compare_with_eager(
        model,
        random_batches(2, 2, 16, vocab=64),
        dict(OPTS, memory_budget="1GiB", n_swap=1, n_persist=2),
        give_optimizer=True,
    )
    assert r.max_loss_rel <= 1e-5
    assert r.plan.n_swap == 1 and r.plan.n_persist == 2 and r.plan.blocks[0].policy == "swap"


def test_profiling_leaves_no_trace_with_dropout():
    """The profiling step consumes random numbers (dropout) and makes gradients; both are undone:
    the run equals one with the same knobs given and no profiling."""
    data = random_batches(3, 2, 16, vocab=64)
    losses, chosen = [], None
    for options in (dict(OPTS, memory_budget="1GiB"), None):
        torch._dynamo.reset()
        model = gpt(dropout=0.2)
        opt = make_adamw(model)
        if options is None:  # the knobs the automatic plan chose, given: no profiling
            options = dict(OPTS, **{k: getattr(chosen, k) for k in autoplan.KNOBS})
        compiled = torch.compile(model, backend="protrain", options=dict(options, optimizer=opt))
        torch.manual_seed(1)
        losses.append(train_steps(model, compiled, data, opt=opt))
        chosen = protrain_fx.get_plan(compiled)
    assert losses[0] == losses[1]


def test_one_byte_budget_names_the_smallest_that_works_and_a_retry_under_it_trains():
    """``except protrain_fx.NoPlanFits`` around the first call catches it (dynamo passes it on as
    itself, not wrapped in its BackendCompilerFailed), and compiling again under the budget it
    names trains like eager."""
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_adamw(model)
    compiled = torch.compile(
        model, backend="protrain", options=dict(OPTS, optimizer=opt, memory_budget=1)
    )
    data = random_batches(3, 2, 16, vocab=64)
    with pytest.raises(NoPlanFits, match=r"the smallest budget that would work is \d+ bytes") as e:
        compiled(*data[0])
    assert isinstance(e.value, protrain_fx.ProtrainError) and e.value.min_device_bytes > 1
    # a worker process can send it back: pickled as the plain class, its numbers kept
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is NoPlanFits and back.min_device_bytes == e.value.min_device_bytes
    assert str(back) == str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    r = compare_with_eager(
        model, data, dict(OPTS, memory_budget=e.value.min_device_bytes), give_optimizer=True
    )
    assert r.max_loss_rel <= 1e-6 and r.max_param_update > 1e-3


def test_a_profiled_step_out_of_device_memory_names_a_lower_bound_and_leaves_the_model(
    monkeypatch,
):
    """Even the most frugal plan ran out of device memory while profiling (the H200's HF
    Llama-3.2-1B shape at 8 x 2048 under 16 GiB): a NoPlanFits that names what every plan needs at
    least (what was allocated plus the failed request, from torch's message), and the model as it
    was (the parameters put back after the failed step's memory is released)."""
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    message = (
        "CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a total capacity of 139.80 "
        "GiB of which 123.44 GiB is free. Of the allocated memory 15.49 GiB is allocated by "
        "PyTorch, and 37.69 MiB is reserved by PyTorch but unallocated."
    )

    def out_of_memory(*a, **k):
        raise torch.OutOfMemoryError(message)

    monkeypatch.setattr(frugal, "profile_step", out_of_memory)
    opt = make_adamw(model)
    compiled = torch.compile(
        model, backend="protrain", options=dict(OPTS, memory_budget="1GiB", optimizer=opt)
    )
    with pytest.raises(NoPlanFits) as err:
        compiled(*random_batches(1, 2, 16, vocab=64)[0])
    e = err.value
    assert e.min_device_bytes == int(15.49 * 2**30 + 1002 * 2**20)  # no allocator factor on the CPU
    assert "more than 16.47 GiB" in str(e) and "most frugal plan" in str(e)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert autoplan.oom_need_bytes(RuntimeError("no numbers"), torch.device("cpu")) == 0


def test_without_an_optimizer_everything_stays_resident():
    """No optimizer exists when the model is first called (created later): every chunk stays
    resident."""
    model = gpt()
    compiled = torch.compile(model, backend="protrain", options=dict(OPTS, memory_budget="1GiB"))
    x, y = random_batches(1, 2, 16, vocab=64)[0]
    compiled(x, y).backward()
    plan = protrain_fx.get_plan(compiled)
    assert plan.n_persist == len(plan.chunks)
    assert any("no optimizer" in n for n in plan.notes)


def test_the_users_adamw_is_found_when_not_given():
    """The one-line promise: no options but a budget, and the AdamW made before the first call is
    found and taken over from the first step (exact), so that chunks can be offloaded."""
    model = gpt()
    r = compare_with_eager(
        model, random_batches(3, 2, 16, vocab=64), dict(OPTS, memory_budget=2 * state_bytes(model))
    )
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-3 and r.max_param_update > 1e-3
    assert r.plan.n_persist < len(r.plan.chunks)
    assert any(n.startswith("optimizer found: the AdamW") for n in r.plan.notes), r.plan.notes
    from protrain_fx.runtime import hybrid_optim

    assert hybrid_optim.handle_of(r.opt) is not None


def test_a_budget_that_needs_offloading_without_an_optimizer_says_to_pass_it():
    model = gpt()
    compiled = torch.compile(
        model, backend="protrain", options=dict(OPTS, memory_budget=2 * state_bytes(model))
    )
    with pytest.raises(
        Exception,
        match=r"no optimizer to step offloaded "
        r"ones.*options=\{'optimizer': opt\}",
    ):
        compiled(*random_batches(1, 2, 16, vocab=64)[0])


def test_on_the_cpu_a_generous_budget_keeps_every_chunk_resident():
    """On a CPU compute device offloading cannot be faster (the optimizer runs on the cores that
    compute)."""
    model = gpt()
    r = compare_with_eager(
        model,
        random_batches(2, 2, 16, vocab=64),
        dict(OPTS, memory_budget="1GiB"),
        give_optimizer=True,
    )
    assert r.plan.n_persist == len(r.plan.chunks)


def forbid_profiling(monkeypatch, why: str) -> None:
    """From now on a profiled step fails the test."""

    def no_profiling(*a, **k):
        raise AssertionError(f"profiled although {why}")

    monkeypatch.setattr(frugal, "profile_step", no_profiling)


def test_plan_cache_skips_profiling(monkeypatch, tmp_path):
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "1")
    monkeypatch.setattr(plan_cache, "path_of", lambda key: str(tmp_path / f"{key}.json"))
    options = dict(OPTS, memory_budget="1GiB")
    first = gpt()
    opt = make_adamw(first)
    compiled = torch.compile(first, backend="protrain", options=dict(options, optimizer=opt))
    train_steps(first, compiled, random_batches(6, 2, 16, vocab=64), opt=opt)
    knobs = {k: getattr(protrain_fx.get_plan(compiled), k) for k in autoplan.KNOBS}
    (entry,) = tmp_path.glob("*.json")
    torch._dynamo.reset()

    forbid_profiling(monkeypatch, "the plan was cached")
    second = gpt()
    opt = make_adamw(second)
    compiled = torch.compile(second, backend="protrain", options=dict(options, optimizer=opt))
    train_steps(second, compiled, random_batches(1, 2, 16, vocab=64), opt=opt)
    plan = protrain_fx.get_plan(compiled)
    assert plan.predicted["from_cache"] and {k: getattr(plan, k) for k in autoplan.KNOBS} == knobs
    import json

    saved = json.loads(entry.read_text())
    # plan.json: both sides
    assert saved["measured"]["iter_s"] > 0 and saved["predicted"]["iter_s"] > 0


def test_another_budget_reuses_the_profile(monkeypatch, tmp_path):
    """A graph's profiled step does not depend on the budget: a plan for another budget (another
    cap, a re-plan) searches again from the kept profile, without compiling and running the
    profiling plan again, and fits its own budget."""
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "1")
    monkeypatch.setattr(plan_cache, "path_of", lambda key: str(tmp_path / f"{key}.json"))
    batches = random_batches(3, 2, 16, vocab=64)
    first = gpt()
    opt = make_adamw(first)
    compiled = torch.compile(
        first, backend="protrain", options=dict(OPTS, memory_budget="1GiB", optimizer=opt)
    )
    train_steps(first, compiled, batches, opt=opt)
    (kept,) = tmp_path.glob("*.profile")
    roomy = protrain_fx.get_plan(compiled)
    torch._dynamo.reset()

    forbid_profiling(monkeypatch, "the graph's profile was kept")
    second = gpt()
    opt2 = make_adamw(second)
    tight = roomy.predicted["peak_bytes"] * 3 // 4
    compiled2 = torch.compile(
        second, backend="protrain", options=dict(OPTS, memory_budget=tight, optimizer=opt2)
    )
    losses = train_steps(second, compiled2, batches, opt=opt2)
    plan = protrain_fx.get_plan(compiled2)
    assert not plan.predicted["from_cache"]  # a new plan, searched
    assert plan.predicted["peak_bytes"] <= tight < roomy.predicted["peak_bytes"]
    assert plan.n_persist < roomy.n_persist
    assert any("profile from the profile cache" in n for n in plan.notes), plan.notes
    assert plan.predicted["profiled"] == roomy.predicted["profiled"]
    # the same training as eager
    ref = gpt()
    ref_opt = make_adamw(ref)
    ref_losses = train_steps(ref, ref, batches, opt=ref_opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_memory_plot_of_an_automatic_plan(tmp_path):
    pytest.importorskip("matplotlib")
    model = gpt()
    r = compare_with_eager(
        model,
        random_batches(2, 2, 16, vocab=64),
        dict(OPTS, memory_budget="1GiB"),
        give_optimizer=True,
    )
    path = protrain_fx.plot_memory(r.plan, str(tmp_path / "memory.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_new_shapes_replan_activations_and_keep_training_like_eager():
    """A recompile for a new batch or sequence length keeps the chunk placement and searches the
    activation knobs again; training stays exact across the shape changes."""
    model = gpt()
    data = (
        random_batches(2, 2, 16, vocab=64)
        + random_batches(2, 2, 8, vocab=64, seed=1)
        + random_batches(2, 3, 12, vocab=64, seed=2)
    )
    # chunks offloaded (n_persist 1) so that each shape's activations are planned beside the same
    # placement
    r = compare_with_eager(
        model,
        data,
        dict(OPTS, memory_budget=4 * state_bytes(model), n_persist=1),
        give_optimizer=True,
    )
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-3
    assert any("chunk placement kept" in n for n in r.plan.notes)


def test_profiled_blocks_give_a_measured_timeline(monkeypatch, tmp_path):
    """PROTRAIN_PROFILE_BLOCKS=1: the chosen plan keeps its block marks, and a recent step's marks
    become plan.measured["timeline"], drawn against the prediction (marks are cleared every step).
    """
    monkeypatch.setenv("PROTRAIN_PROFILE_BLOCKS", "1")
    from protrain_fx.runtime import block_timer

    model = gpt()
    r = compare_with_eager(
        model,
        random_batches(5, 2, 16, vocab=64),
        dict(OPTS, memory_budget="1GiB"),
        give_optimizer=True,
    )
    assert r.max_loss_rel <= 1e-5
    labels = [t[2] for t in r.plan.measured["timeline"]]
    assert "fwd enter block 0" in labels and "bwd exit block 0" in labels
    assert len(block_timer.RECORDER.marks) <= 4 * 4 * 2  # one step's marks, not five


def test_a_new_shape_that_does_not_fit_beside_the_placement_moves_resident_chunks(
    monkeypatch, caplog
):
    """A longer sequence and a larger batch after two steps, which no plan with the first graph's
    resident chunks fits under the budget (a longer sequence alone fits since the profile no
    longer counts the resident parameters' saved views as activations): its plan moves resident
    chunks to the host, with their gradients and Adam state (runtime/replacement.py), instead of
    failing; training (HF Llama, its ``labels=`` loss) stays eager's through both shapes and
    back."""
    import copy

    from hf_models import HF_VOCAB, LossOnly, hf_llama

    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
    base = LossOnly(hf_llama())
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    data = [  # the token ids are the labels too
        (x, x)
        for x, _ in random_batches(2, 2, 16, vocab=HF_VOCAB)
        + random_batches(2, 4, 64, vocab=HF_VOCAB, seed=1)
        + random_batches(1, 2, 16, vocab=HF_VOCAB, seed=2)
    ]
    ref_losses = train_steps(ref, ref, data, opt=make_adamw(ref))
    opt = make_adamw(mine)
    budget = 3 * state_bytes(mine)
    compiled = torch.compile(
        mine,
        backend="protrain",
        options={"compiler": "eager", "memory_budget": budget, "optimizer": opt},
    )
    with caplog.at_level("WARNING", logger="protrain_fx"):
        losses = train_steps(mine, compiled, data, opt=opt)
    assert "moved to the host, with their gradients and optimizer state" in caplog.text
    plan = protrain_fx.get_plan(compiled)
    assert any("no plan with its chunk placement fits" in n for n in plan.notes), plan.notes
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    for p, q in zip(mine.parameters(), ref.parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=0, atol=1e-5)
