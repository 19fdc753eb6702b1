"""Inference graphs placed within the budget (protrain_fx/inference_placement.py): a frozen model (a
distillation teacher, a DPO reference model) and a model evaluated under ``torch.no_grad()`` before
its first training step. Before, such a graph kept every chunk resident whatever the budget (on a
GPU: out of memory wherever the parameters alone did not fit). CPU, fp32, against eager PyTorch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hf_models import HF_VOCAB, hf_llama

import protrain_fx
from protrain_fx.errors import NoPlanFits, ProtrainError
from protrain_fx.graph.forward_memory import forward_peak_bytes
from protrain_fx.plan.profiles import FRAGMENTATION
from protrain_fx.runtime import replacement
from protrain_fx.runtime.chunk_store import live_stores
from protrain_fx.testing import random_batches

# the 3-layer HF Llama's parameters: 1.94 MiB in 17 chunks (the tied embedding 256 KiB)
BUDGET = 1_500_000


def data(n=3, seed=1):
    return [x for x, _ in random_batches(n, 2, 16, vocab=HF_VOCAB, seed=seed)]


def frozen(seed=1):
    return hf_llama(seed=seed, num_hidden_layers=3).eval().requires_grad_(False)


def cause_of(e, kind):
    while e is not None and not isinstance(e, kind):
        e = e.__cause__ or e.__context__
    return e


def test_forward_peak_bytes_counts_views_once_and_frees_after_the_last_reader():
    """x (4 KiB, an input) -> a = x * 2 -> v = a.view(...) -> b = v + 1 -> c = b.sum(): a and its
    view are one 4 KiB storage, alive until b is made; the peak is x + a + b."""
    seen = {}

    def backend(gm, example_inputs):
        seen["peak"] = forward_peak_bytes(gm, set())
        return gm

    def f(x):
        a = x * 2
        v = a.view(32, 32)
        b = v + 1
        return b.sum()

    torch.compile(f, backend=backend)(torch.randn(1024))
    assert seen["peak"] == 3 * 4096, seen


def test_a_frozen_teacher_is_offloaded_within_the_budget_and_computes_as_eager():
    ref, mine = frozen(), frozen()
    teacher = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "memory_budget": BUDGET}
    )
    for x in data():
        with torch.no_grad():
            assert torch.equal(teacher(input_ids=x).logits, ref(input_ids=x).logits)
    plan = protrain_fx.get_plan(teacher)
    placements = {c.placement for c in plan.chunks}
    assert placements == {"device", "host"}, placements
    assert plan.inference and 0 < plan.n_persist < len(plan.chunks)
    assert plan.predicted["peak_bytes"] <= BUDGET
    assert any(n.startswith("inference graph placed within the budget") for n in plan.notes)
    assert "peak memory reserved: predicted" in plan.summary()


def test_a_budget_too_small_names_the_minimum_and_the_minimum_works():
    model = frozen()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = data(1)[0]
    with pytest.raises(Exception) as info:
        with torch.no_grad():
            torch.compile(
                model, backend="protrain", options={"compiler": "eager", "memory_budget": 100_000}
            )(input_ids=x)
    err = cause_of(info.value, NoPlanFits)
    assert err is not None and err.min_device_bytes > 100_000, info.value
    assert "inference graph" in str(err) and "smallest budget" in str(err)
    after = model.state_dict()  # a failed compile leaves the model as it was
    assert all(torch.equal(before[k], after[k]) for k in before)
    torch._dynamo.reset()
    teacher = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "memory_budget": err.min_device_bytes},
    )
    with torch.no_grad():
        assert torch.equal(teacher(input_ids=x).logits, frozen()(input_ids=x).logits)
    plan = protrain_fx.get_plan(teacher)
    assert plan.predicted["peak_bytes"] == err.min_device_bytes and plan.n_persist < len(
        plan.chunks
    )


def test_distillation_with_a_frozen_teacher_and_an_offloaded_student_trains_as_eager():
    """The student (HF Llama, AdamW, clipping) and the teacher each under a budget of its own; the
    loss is the student's own plus the KL divergence to the teacher's logits."""
    t_ref, t_mine = frozen(), frozen()
    s_ref = hf_llama(seed=0)
    s_mine = copy.deepcopy(s_ref)
    o_ref = torch.optim.AdamW(s_ref.parameters(), lr=1e-3)
    o_mine = torch.optim.AdamW(s_mine.parameters(), lr=1e-3)
    teacher = torch.compile(
        t_mine, backend="protrain", options={"compiler": "eager", "memory_budget": BUDGET}
    )
    student = torch.compile(
        s_mine,
        backend="protrain",
        options={"compiler": "eager", "optimizer": o_mine, "memory_budget": 3_000_000},
    )

    def step(t, s, params, opt, x):
        with torch.no_grad():
            target = F.softmax(t(input_ids=x).logits, -1)
        out = s(input_ids=x, labels=x)
        kd = F.kl_div(F.log_softmax(out.logits, -1), target, reduction="batchmean")
        loss = out.loss + kd
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    for x in data(4):
        a = step(t_ref, s_ref, s_ref.parameters(), o_ref, x)
        b = step(teacher, student, s_mine.parameters(), o_mine, x)
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)
    for p, q in zip(s_ref.parameters(), s_mine.parameters()):
        # the norm and the KL term's gradient summed in another order: rounding
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4)
    for plan in (protrain_fx.get_plan(teacher), protrain_fx.get_plan(student)):
        assert {c.placement for c in plan.chunks} == {"device", "host"}


def evaluate_train_evaluate(budget: int, held_out, lr: float, tol: float):
    """An HF Llama evaluated under ``no_grad`` on ``held_out`` before its first training step, then
    trained 3 steps, then evaluated again, eager and under ``memory_budget=budget``: every loss and
    parameter eager's within ``tol``. The plans after the first evaluation and after training."""
    ref = hf_llama(seed=0, num_hidden_layers=3)
    mine = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    o_mine = torch.optim.AdamW(mine.parameters(), lr=lr)
    compiled = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "memory_budget": budget}
    )

    def evaluate(model, module):
        module.eval()
        with torch.no_grad():
            loss = model(input_ids=held_out, labels=held_out).loss.item()
        module.train()
        return loss

    assert evaluate(compiled, mine) == evaluate(ref, ref)
    first = protrain_fx.get_plan(compiled)
    for x in data(3):
        for model, opt in ((ref, o_ref), (compiled, o_mine)):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    trained = protrain_fx.get_plan(compiled)
    a, b = evaluate(ref, ref), evaluate(compiled, mine)
    assert abs(a - b) <= tol * abs(a), (a, b)
    for p, q in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=tol)
    return first, trained


def test_evaluating_before_the_first_training_step_places_within_the_budget_then_trains_as_eager():
    # what training needs at least (1.52 MiB, everything offloaded), not every chunk resident
    first, trained = evaluate_train_evaluate(2_000_000, data(1, seed=4)[0], lr=1e-2, tol=1e-5)
    assert first.inference and 0 < first.n_persist < len(first.chunks)
    assert not trained.inference


def test_every_chunk_stays_resident_where_the_budget_allows():
    teacher = torch.compile(
        frozen(), backend="protrain", options={"compiler": "eager", "memory_budget": 64 << 20}
    )
    with torch.no_grad():
        teacher(input_ids=data(1)[0])
    plan = protrain_fx.get_plan(teacher)
    assert plan.n_persist == len(plan.chunks)
    assert any(n.startswith("inference graph: every chunk resident") for n in plan.notes)


def test_a_frozen_models_resident_chunks_may_move_to_the_host_without_an_optimizer():
    """An evaluation that runs out of memory moves resident chunks to the host (make_room); a frozen
    model's chunks hold nothing but their values, so no optimizer is needed for it; a trainable
    one's still needs the optimizer protrain steps."""
    for trains in (False, True):
        model = hf_llama(seed=0, num_hidden_layers=2).requires_grad_(trains)
        compiled = torch.compile(model, backend="protrain", options={"compiler": "eager"})
        with torch.no_grad():
            compiled(input_ids=data(1)[0])
        params = list(model.parameters())
        assert replacement.may_offload(params, None) is not trains
        if not trains:
            chunks, _ = replacement.make_room(params, 1)
            assert chunks >= 1
            x = data(1)[0]
            with torch.no_grad():
                expected = hf_llama(seed=0, num_hidden_layers=2)(input_ids=x).logits
                assert torch.equal(compiled(input_ids=x).logits, expected)


def test_regional_compilation_of_a_frozen_model_gives_the_minimum_in_the_budgets_terms():
    """Each of the 3 blocks compiled on its own gets 1/3 of ``memory_budget``: the minimum
    NoPlanFits names is for the whole budget (3 x a block's need), and that budget compiles every
    block."""
    model, ref = frozen(), frozen()
    x = data(1)[0]

    def compile_blocks(budget):
        for b in model.model.layers:
            b.compile(backend="protrain", options={"compiler": "eager", "memory_budget": budget})

    compile_blocks(300_000)
    with pytest.raises(Exception) as info, torch.no_grad():
        model(input_ids=x)
    err = cause_of(info.value, NoPlanFits)
    assert err is not None and "3 blocks x" in str(err), info.value
    torch._dynamo.reset()
    compile_blocks(err.min_device_bytes)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
    for b in model.model.layers:
        plan = protrain_fx.get_plan(b)
        assert plan.predicted["peak_bytes"] * 3 <= err.min_device_bytes


def test_a_frozen_model_a_gradient_flows_through_keeps_its_chunks_and_says_so():
    """Prompt tuning: a trainable soft prompt before a frozen model. Its graph saves activations
    for the backward to the prompt, which a forward-only placement does not count: every chunk
    stays resident, the plan says that the budget is not applied, and the prompt's gradient is
    eager's."""
    prompts = [
        torch.nn.Parameter(torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(0)))
        for _ in range(2)
    ]
    ref, model = frozen(), frozen()
    compiled = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "memory_budget": BUDGET}
    )
    x = data(1)[0]
    for call, m, prompt in ((ref, ref, prompts[0]), (compiled, model, prompts[1])):
        embeds = torch.cat([prompt.expand(2, -1, -1), m.model.embed_tokens(x)], 1)
        call(inputs_embeds=embeds).logits.logsumexp(-1).mean().backward()
    assert torch.equal(prompts[1].grad, prompts[0].grad)
    plan = protrain_fx.get_plan(compiled)
    assert plan.n_persist == len(plan.chunks)
    assert any(n.startswith("memory_budget not applied") for n in plan.notes), plan.notes


@pytest.mark.parametrize("grad_mode", ["no_grad", "grad_enabled"])
def test_a_frozen_teachers_forward_that_runs_out_of_memory_moves_chunks_and_is_redone(
    monkeypatch, caplog, grad_mode
):
    """The placement's estimate is not a measurement: a forward that still runs out of device
    memory moves resident chunks to the host (no optimizer needed for a frozen model) and is redone
    on the same inputs, also when the loop forgot ``torch.no_grad()``."""
    from test_never_oom import inject_oom

    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
    ref, model = frozen(), frozen()
    teacher = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "memory_budget": BUDGET}
    )
    x, later = data(2)
    context = torch.no_grad if grad_mode == "no_grad" else torch.enable_grad
    with context():
        assert torch.equal(teacher(input_ids=x).logits, ref(input_ids=x).logits)
        first = protrain_fx.get_plan(teacher).n_persist
        calls = inject_oom(monkeypatch, "gather", 1)
        with caplog.at_level("WARNING", logger="protrain_fx"):
            assert torch.equal(teacher(input_ids=later).logits, ref(input_ids=later).logits)
    assert calls["raised"] == 1
    assert "moved to the host" in caplog.text and "redoing the call" in caplog.text, caplog.text
    assert protrain_fx.get_plan(teacher).n_persist < first


def test_training_after_an_evaluation_places_the_parameters_afresh():
    """The evaluation before the first training step runs on a large batch, so its placement keeps
    few chunks resident; the training graph releases that placement (no optimizer state yet) and
    places the parameters for training, keeping more resident than the evaluation did (its profile
    ran with every chunk offloaded: on a GPU, the evaluation's resident chunks beside it ran out of
    memory). The evaluation graph is planned again at its next call; everything is eager's."""
    held_out = random_batches(1, 32, 64, vocab=HF_VOCAB, seed=5)[0][0]  # 32 x 64: large logits
    first, trained = evaluate_train_evaluate(13_000_000, held_out, lr=1e-3, tol=1e-6)
    assert first.inference and first.n_persist < len(first.chunks)
    assert not trained.inference and trained.n_persist > first.n_persist
    assert any("was released" in n for n in trained.notes), trained.notes


@pytest.mark.parametrize(
    "order", ["teacher_first", "student_first", "teacher_in_regions", "host_runs_out"]
)
def test_a_frozen_teacher_shares_the_device_with_the_student_it_teaches(
    shared_cpu, order, monkeypatch, caplog
):
    """Distillation on a device shared by both models' graphs (CUDA without memory_budget, here the
    CPU taken for one). The teacher's forward first placed it whole (1.94 MiB of 5.72 MiB) and the
    student's training plan got what was left. Now its placement is released for the student's plan,
    which leaves the least the teacher needs aside, and made again at its next call beside the
    student's step. The student's forward first, the teacher is placed beside its step from the
    start; where that leaves it less than it needs (made sure of here: the student's step taken for
    larger at the teacher's first placement), the student plans again at its next call and leaves
    room. The teacher compiled block by block (``layer.compile``) is released and placed again as a
    whole. Where host memory runs out while its chunks move there (injected at the second of its
    stores), its placement stays, and the student plans beside it. Losses and
    parameters as eager's."""
    from protrain_fx import inference_placement as ip

    if order == "student_first":
        real, calls = ip._beside_training, []

        def squeezed(opts, device, placed):
            calls.append(1)
            n, why = real(opts, device, placed)
            return (n + shared_cpu if len(calls) == 1 else n), why

        monkeypatch.setattr(ip, "_beside_training", squeezed)
    if order == "host_runs_out":
        real_offload, offloads = replacement.offload_resident, []

        def short_of_host(store, n_persist, optimizer=None):
            offloads.append(store.id)
            if len(offloads) == 2:
                raise ProtrainError("host memory ran out (injected)")
            return real_offload(store, n_persist, optimizer)

        monkeypatch.setattr(replacement, "offload_resident", short_of_host)
    t_ref, t_mine = frozen(), frozen()
    s_ref = hf_llama(seed=0)
    s_mine = copy.deepcopy(s_ref)
    o_ref = torch.optim.AdamW(s_ref.parameters(), lr=1e-3)
    o_mine = torch.optim.AdamW(s_mine.parameters(), lr=1e-3)
    if order == "teacher_in_regions":
        for layer in t_mine.model.layers:
            layer.compile(backend="protrain", options={"compiler": "eager"})
        teacher = t_mine
    else:
        teacher = torch.compile(t_mine, backend="protrain", options={"compiler": "eager"})
    student = torch.compile(s_mine, backend="protrain", options={"compiler": "eager"})

    def step(t, s, opt, x):
        if order == "student_first":
            out = s(input_ids=x, labels=x)
        with torch.no_grad():
            target = F.softmax(t(input_ids=x).logits, -1)
        if order != "student_first":
            out = s(input_ids=x, labels=x)
        loss = out.loss + F.kl_div(F.log_softmax(out.logits, -1), target, reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    with caplog.at_level("WARNING", logger="protrain_fx"):
        for x in data(4):
            a, b = step(t_ref, s_ref, o_ref, x), step(teacher, student, o_mine, x)
            assert abs(a - b) <= 1e-5 * abs(a), (a, b)
    for p, q in zip(s_ref.parameters(), s_mine.parameters()):
        # as in the distillation test above: the KL term's gradient summed in another order
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4)
    t_plan, s_plan = protrain_fx.get_plan(teacher), protrain_fx.get_plan(student)
    released = any("moved to the host before this plan" in n for n in s_plan.notes)
    replanned = "re-planned: leaving room for a frozen model on the device" in s_plan.notes
    if order == "host_runs_out":
        assert not released and any("injected" in m for m in caplog.messages), s_plan.notes
        assert "set aside" not in s_plan.predicted["budget"], s_plan.predicted
        assert s_plan.predicted["peak_bytes"] <= s_plan.predicted["budget_bytes"]
        return
    assert released, s_plan.notes
    assert replanned == (order == "student_first"), s_plan.notes
    said = [m for m in caplog.messages if "a frozen model placed beside it needs room" in m]
    assert len(said) == replanned, caplog.messages
    # the student's budget: the whole device's, less the least the teacher's placement needs
    assert "set aside for 1 frozen model" in s_plan.predicted["budget"], s_plan.predicted
    notes = [n for n in t_plan.notes if n.startswith("inference graph")]
    assert len(notes) == 1 and "left for the steps of 1 other training graph" in notes[0], notes
    # between its calls the teacher holds its resident chunks and chunk buffers, beside the
    # student's whole step
    placed = [s for s in live_stores() if s.for_inference]
    resident = sum(s.layout.used_bytes(c) for s in placed for c in range(s.n_persist))
    offloaded = [s.layout.used_bytes(c) for s in placed for c in s.offloaded_chunks]
    held = resident + int(FRAGMENTATION * 2 * max(offloaded, default=0))  # 2 chunk buffers
    assert held + s_plan.predicted["peak_bytes"] <= shared_cpu, (
        held,
        s_plan.predicted["peak_bytes"],
    )
