"""The CPU optimizer's rate inside backward, measured in training steps and priced by later plans on
the same machine (issue 21: the step time a plan predicts; protrain_fx/machine/step_rates.py)."""

import dataclasses

import pytest
import torch
from models import build

import protrain_fx
from protrain_fx.machine import measure, step_rates
from protrain_fx.plan.cost_model import predict
from protrain_fx.plan.profiles import (
    ChunkProfile,
    GraphProfile,
    Hardware,
    Knobs,
    in_step_alone_slowdown,
    in_step_host_bytes,
)
from protrain_fx.runtime import hybrid_optim
from protrain_fx.testing import random_batches

MiB = 2**20


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    """A cache folder of the test's own, and CPU runs recording as CUDA runs do."""
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(step_rates, "DEVICES", ("cuda", "cpu"))
    return tmp_path


def train_gpt(steps: int, clip: bool = False, micro: int = 1, declare: bool = False):
    """A small GPT, every chunk offloaded, trained ``steps`` steps of ``micro`` micro-steps each
    (declared to protrain with ``declare``) under an automatic plan with those knobs fixed (a fresh
    compile): its plan, the optimizer's protrain handle, the losses."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("gpt", n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if declare:
        protrain_fx.set_grad_accumulation(opt, micro)
    options = {"compiler": "eager", "optimizer": opt, "memory_budget": 10**9}
    options.update(n_persist=0, n_swap=0, n_checkpoint=0)
    compiled = torch.compile(model, backend="protrain", options=options)
    losses = []
    for i, (x, y) in enumerate(random_batches(steps * micro, 2, 16, vocab=64)):
        loss = compiled(x, y)
        (loss / micro).backward()
        losses.append(loss.item())
        if (i + 1) % micro:
            continue
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return protrain_fx.get_plan(compiled), hybrid_optim.handle_of(opt), losses


def test_observations_are_kept_per_kind_for_the_profile_they_were_measured_with(own_cache):
    profile = measure.hardware_profile("cpu")
    assert step_rates.read(profile, "cpu") == {}
    for s in (3.0, 1.0, 2.0):
        step_rates.record(profile, "copies", s, 10**9)
    step_rates.record(profile, "masters", 0.5, 10**9)
    step_rates.record(profile, "copies", 1.0, 0)  # nothing stepped: not an observation
    assert step_rates.read(profile, "cpu") == {"copies": 2e-9, "masters": 0.5e-9}
    assert step_rates.read(profile, "mps") == {}  # a device type that does not record
    for s in range(step_rates.KEEP + 2):
        step_rates.record(profile, "masters", 10.0, 10**9)
    assert step_rates.read(profile, "cpu")["masters"] == 10e-9  # the last KEEP only
    # a re-measured profile starts over
    again = dataclasses.replace(profile, measured_at="2099-01-01T00:00:00+00:00")
    assert step_rates.read(again, "cpu") == {}
    step_rates.record(again, "copies", 4.0, 10**9)
    assert step_rates.read(again, "cpu") == {"copies": 4e-9}
    assert step_rates.read(profile, "cpu") == {}


def test_the_cost_model_prices_the_cpu_step_at_the_measured_rate_of_its_kind():
    """One chunk resident, one offloaded (50 M parameters): the CPU optimizer's time is those
    parameters at the alone rate times the contention constant, until a measured rate of the plan's
    kind (with or without transfer copies) replaces it; the step time follows."""
    hw = Hardware(50e9, 50e9, 80e9, 4e9, 120e9)
    ch = ChunkProfile(numel=50 * 10**6, fwd_s=0.010, bwd_s=0.020)
    prof = GraphProfile(
        chunk_size=256 * MiB,
        blocks=(),
        transient_bytes=0,
        chunks=(ch, ch),
        transfer_elem=2,
        resident_cast_elem=2,
    )
    knobs = Knobs(prof.chunk_size, 1, 1, 0, 0)
    # before any measurement, no triad known (a hand-made Hardware): the alone rate / contention
    alone = predict(prof, hw, knobs).breakdown["cpu_optim_s"]
    assert alone == pytest.approx(50e6 / 4e9 * hw.cpu_contention)
    seen = dataclasses.replace(hw, observed_s_per_param_copies=1 / 2e9)
    p = predict(prof, seen, knobs)
    assert p.breakdown["cpu_optim_s"] == pytest.approx(50e6 / 2e9)
    assert p.time_s > predict(prof, hw, knobs).time_s  # CPU-bound at the slower measured rate
    # the kind not seen yet: the other kind's measured time per parameter, scaled by the host memory
    # bytes each moves inside a step, never faster than its alone rate allows
    no_copies = dataclasses.replace(knobs, transfer_copies=False)
    masters = dataclasses.replace(hw, cpu_adam_masters_params_per_s=8e9)
    assert predict(prof, masters, no_copies).breakdown["cpu_optim_s"] == pytest.approx(
        50e6 / 8e9 * hw.cpu_contention
    )
    carried = dataclasses.replace(masters, observed_s_per_param_copies=1 / 2e9)
    ratio = in_step_host_bytes(False) / in_step_host_bytes(True)
    assert ratio < 1
    assert predict(prof, carried, no_copies).breakdown["cpu_optim_s"] == pytest.approx(
        50e6 / 2e9 * ratio
    )
    fast = dataclasses.replace(masters, observed_s_per_param_copies=1 / 20e9)
    assert predict(prof, fast, no_copies).breakdown["cpu_optim_s"] == pytest.approx(
        50e6 / 8e9 * hw.cpu_contention
    )
    both = dataclasses.replace(carried, observed_s_per_param_masters=1 / 5e9)
    assert predict(prof, both, no_copies).breakdown["cpu_optim_s"] == pytest.approx(50e6 / 5e9)
    assert "as measured inside backward" in seen.cpu_step_rate_note(True)
    assert "as the other kind measured" in carried.cpu_step_rate_note(False)
    assert f"{4 * ratio:.2f}x the alone rate's time" in carried.cpu_step_rate_note(False)
    # before any measurement, with the triad known: the faster of what host memory carries (the
    # triad's rate over in_step_host_bytes) and the alone rate slowed as inside backward, no faster
    # than the alone rate / cpu_contention
    by_kernel = 1 / (4e9 / in_step_alone_slowdown(True))
    triad = dataclasses.replace(hw, host_bytes_per_s=in_step_host_bytes(True) * 3.15e9)
    assert 1 / 3.15e9 < by_kernel
    assert predict(prof, triad, knobs).breakdown["cpu_optim_s"] == pytest.approx(50e6 / 3.15e9)
    assert "host memory's bandwidth" in triad.cpu_step_rate_note(True)
    # a triad measured low (run 19's host: 80.7 GB/s where its kernel and steps ran as on hosts of
    # 116-137) does not price the step slower than the kernel's own rate says
    low = dataclasses.replace(hw, host_bytes_per_s=in_step_host_bytes(True) * 1e9)
    assert predict(prof, low, knobs).breakdown["cpu_optim_s"] == pytest.approx(50e6 * by_kernel)
    assert "the alone rate / 1.3 inside backward" in low.cpu_step_rate_note(True)
    # two ranks on the host, each stepping half the offloaded parameters at once: the bandwidth is
    # shared, so the CPU step takes as long as one rank's would for all of them
    ranks = dataclasses.replace(triad, world_size=2)
    assert ranks.cpu_s_per_param(True) == pytest.approx(triad.cpu_s_per_param(True))
    assert "over 2 rank(s)" in ranks.cpu_step_rate_note(True)
    roomy = dataclasses.replace(hw, host_bytes_per_s=in_step_host_bytes(True) * 100e9)
    assert predict(prof, roomy, knobs).breakdown["cpu_optim_s"] == pytest.approx(alone)
    assert "the alone rate / 1.25" in roomy.cpu_step_rate_note(True)
    assert "the alone rate / 1.25" in hw.cpu_step_rate_note(False)
    low_masters = dataclasses.replace(masters, host_bytes_per_s=in_step_host_bytes(False) * 1e9)
    assert "the alone rate / 1.55 inside backward" in low_masters.cpu_step_rate_note(False)
    # a loop that clips: the CPU steps run at opt.step(), after backward, alone on the host (no
    # rate measured inside backward applies), and the step is the sum of its parts
    clipping = dataclasses.replace(seen, steps_at_opt_step=True)
    p = predict(prof, clipping, knobs)
    b = p.breakdown
    assert b["cpu_optim_s"] == pytest.approx(alone)
    assert p.time_s == pytest.approx(b["fwd_s"] + b["bwd_s"] + b["cpu_optim_s"] + b["gpu_optim_s"])
    assert p.time_s > predict(prof, hw, knobs).time_s
    assert "G params/s, at opt.step(): the alone rate / 1.25" in clipping.cpu_step_rate_note(True)


def test_training_steps_record_the_rate_and_the_next_plan_prices_it(own_cache):
    """Every chunk offloaded: from the second step on, each one steps on the host worker inside
    backward. Steps 4 to 8 are recorded as one observation: five times the offloaded parameters, in
    the worker's seconds. The next automatic plan on this machine prices its CPU optimizer at that
    rate and says so; training is unchanged."""

    profile = measure.hardware_profile("cpu")
    plan, handle, losses = train_gpt(step_rates.AT_STEPS[0])
    # priced by the prior (protrain_fx/plan/profiles.py: Hardware._in_step), nothing measured yet
    assert "as measured inside backward" not in plan.summary()
    assert any(
        prior in plan.summary()
        for prior in (
            "the alone rate / 1.3 inside",
            "host memory's bandwidth",
            "the alone rate / 1.25",
        )
    )
    offloaded = sum(st.exp_avg.numel() for st in handle.states.values())
    assert offloaded and handle.timers.cpu_in_backward_params == (len(losses) - 1) * offloaded
    seen = step_rates._load(step_rates.path_of(profile))["copies"]
    assert len(seen) == 1
    assert seen[0]["params"] == (step_rates.AT_STEPS[0] - step_rates.FROM_STEP) * offloaded
    # the worker's seconds of steps 4 to 8 (its steps and the waits between them): part of all
    seconds = seen[0]["s_per_param"] * seen[0]["params"]
    assert 0 < seconds < handle.timers.span.total(len(losses))
    # the mean span a step since FROM_STEP, what the step meter judges a busy device by
    since = len(losses) - step_rates.FROM_STEP
    assert handle.cpu_span_per_step() == pytest.approx(seconds / since, rel=1e-9)
    plan2, _, losses2 = train_gpt(2)
    assert plan2.predicted["breakdown"]["cpu_optim_s"] == pytest.approx(
        offloaded * seen[0]["s_per_param"], rel=1e-9
    )
    assert "as measured inside backward on this machine" in plan2.summary()
    assert losses2 == losses[:2]


def test_training_steps_record_how_fast_chunks_went_up_and_later_plans_price_gathers_so(
    own_cache, monkeypatch
):
    """The chunk buffers sum their copies' durations and bytes (a CPU device's copies are
    synchronous; on CUDA each copy's own events on the copy stream); steps 4 to 8 record that rate
    for the plan's kind of upload, and later plans on the machine price the gathers of that kind
    at it (``Hardware.upload_bytes_per_s``), the other kind still at the profile's copies."""
    from protrain_fx.plan.profiles import Hardware

    monkeypatch.setattr(step_rates, "UPLOAD_LEAST_BYTES", 1)  # the test model moves little
    profile = measure.hardware_profile("cpu")
    plan, handle, losses = train_gpt(step_rates.AT_STEPS[0])
    (seen,) = step_rates._load(step_rates.path_of(profile))["upload_copies"]
    moved = sum(b.upload_bytes for b in {id(s.buffers): s.buffers for s in handle.stores}.values())
    assert 0 < seen["bytes"] < moved and seen["bytes_per_s"] > 0
    hw = Hardware.of(profile, step_rates.read(profile, "cpu"))
    assert hw.upload_bytes_per_s(True) == pytest.approx(seen["bytes_per_s"])
    assert hw.upload_bytes_per_s(False) == profile.h2d_bytes_per_s


def test_the_worker_span_counts_the_waits_between_steps_unless_it_waited_on_the_device():
    """A backward whose worker was busy most of its span (CPU-bound) counts the span, the waits
    between its steps included; one whose worker mostly waited (for the device's gradients) counts
    its steps alone; a step's span is complete once the next optimizer step begins."""
    span = step_rates.WorkerSpan()
    for start, end in ((0.0, 1.0), (1.1, 2.0), (2.05, 3.0)):  # busy 2.85 s of a 3 s span
        span.mark(0, start, end)
    assert span.total(0) == 0.0 and span.total(1) == pytest.approx(3.0)
    for start, end in ((10.0, 10.5), (12.0, 12.5)):  # busy 1 s of a 2.5 s span: waited
        span.mark(1, start, end)
    assert span.total(2) == pytest.approx(4.0)
    span.mark(2, 20.0, 20.2)  # one step: its span is itself
    assert span.total(2) == pytest.approx(4.0) and span.total(3) == pytest.approx(4.2)


def test_a_loop_that_clips_is_planned_with_its_cpu_steps_after_backward(own_cache, monkeypatch):
    """Clipping between backward() and opt.step() makes the offloaded chunks step at opt.step(),
    after backward (runtime/hybrid_optim.py), where the plan priced them beside it. The step meter
    keeps that in the plan's cache entry and the summary says so; the next compile of the graph is
    not served that plan but planned anew with the CPU steps after backward
    (``Hardware.steps_at_opt_step``), and that plan is served to the compile after it. Training is
    the same every time."""
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "1")

    first, _, losses = train_gpt(6, clip=True)
    assert "clipping" in first.measured["cpu_steps_at_opt_step"]
    assert first.predicted["cpu_steps_at_opt_step"] is False
    assert "CPU steps ran at opt.step(), after backward" in first.summary()
    second, _, losses2 = train_gpt(6, clip=True)
    assert not second.predicted["from_cache"], second.notes
    assert second.predicted["cpu_steps_at_opt_step"], second.notes
    assert any("training loop ran them at opt.step()" in n for n in second.notes), second.notes
    text = second.summary()
    assert "(after backward; " in text and "at opt.step(): the alone rate / 1.25" in text, text
    assert "CPU steps ran at opt.step(), after backward" not in text
    third, _, losses3 = train_gpt(6, clip=True)
    assert third.predicted["from_cache"] and third.predicted["cpu_steps_at_opt_step"]
    assert losses2 == losses and losses3 == losses
    # the loop changed: it no longer clips, its steps ran beside backward, and the next plan says so
    fourth, _, _ = train_gpt(6)
    assert fourth.predicted["from_cache"] and not fourth.measured.get("cpu_steps_at_opt_step")
    fifth, _, _ = train_gpt(2)
    assert not fifth.predicted["from_cache"] and not fifth.predicted["cpu_steps_at_opt_step"]
    assert any(
        "CPU steps after backward, but the training loop ran them beside it" in n
        for n in fifth.notes
    )


def test_a_loop_that_clips_records_the_rate_at_opt_step_and_the_next_plan_prices_it(
    own_cache, monkeypatch
):
    """Clipping makes the offloaded chunks step inside ``opt.step()`` (after the first steps, in
    the main thread, alone on the host but after backward): steps 4 to 8 are recorded as one
    observation of that kind, apart from the rate inside backward. The next plan of a loop that
    clips prices its CPU optimizer at that rate and says so; training is unchanged."""
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "1")  # which keeps that the loop clips
    profile = measure.hardware_profile("cpu")
    plan, handle, losses = train_gpt(step_rates.AT_STEPS[0], clip=True)
    seen = step_rates.read(profile, "cpu")
    kinds = [k for k in seen if k.endswith("_at_step")]
    assert len(kinds) == 1, seen
    offloaded = sum(st.exp_avg.numel() for st in handle.states.values())
    assert offloaded and handle.timers.deferred_params >= 5 * offloaded
    plan2, _, losses2 = train_gpt(2, clip=True)
    assert plan2.predicted["cpu_steps_at_opt_step"]
    assert plan2.predicted["breakdown"]["cpu_optim_s"] == pytest.approx(
        offloaded * seen[kinds[0]], rel=1e-9
    )
    assert "at opt.step(), as measured there on this machine" in plan2.summary()
    assert losses2 == losses[:2]


def test_a_loop_that_accumulates_is_planned_for_its_micro_steps(own_cache, monkeypatch):
    """Two micro-steps per ``opt.step()``, not declared: the optimizer learns them at its first
    step, the step meter measures an optimizer step over two calls and keeps the count in the plan's
    cache entry, and the summary says the plan priced one. The next compile of the graph is not
    served that plan: it is planned for two micro-steps (forward and backward twice, the optimizers
    once: plan/accumulation.py), and that plan is served to the compile after it. Declared
    (``set_grad_accumulation``), the first plan prices them. Training is the same every time."""
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "1")

    first, handle, losses = train_gpt(6, micro=2)
    assert handle.micro_steps() == 2 and first.measured["micro_steps"] == 2
    assert first.predicted["breakdown"]["micro_steps"] == 1
    assert "an optimizer step ran 2 micro-steps" in first.summary()
    second, _, losses2 = train_gpt(6, micro=2)
    assert not second.predicted["from_cache"], second.notes
    b = second.predicted["breakdown"]
    assert b["micro_steps"] == 2 and b["before_last_micro_step_s"] > 0
    assert any(
        "2 micro-steps per optimizer step (as the loop's last run" in n for n in second.notes
    )
    assert "an optimizer step ran" not in second.summary()
    third, _, losses3 = train_gpt(6, micro=2)
    assert third.predicted["from_cache"] and third.predicted["breakdown"]["micro_steps"] == 2
    assert losses2 == losses and losses3 == losses
    # declared: priced from the first plan on (another cache: nothing learned)
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(own_cache / "declared"))
    declared, _, losses4 = train_gpt(6, micro=3, declare=True)
    assert declared.predicted["breakdown"]["micro_steps"] == 3
    assert any("3 micro-steps per optimizer step (declared)" in n for n in declared.notes)
    assert declared.measured["micro_steps"] == 3
    eager = train_eager_gpt(6, micro=3)
    assert losses4 == pytest.approx(eager, rel=1e-5)


def train_eager_gpt(steps: int, micro: int) -> list[float]:
    """:func:`train_gpt`'s loop on the eager model (no protrain), for its losses."""
    torch.manual_seed(0)
    model = build("gpt", n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i, (x, y) in enumerate(random_batches(steps * micro, 2, 16, vocab=64)):
        loss = model(x, y)
        (loss / micro).backward()
        losses.append(loss.item())
        if (i + 1) % micro == 0:
            opt.step()
            opt.zero_grad()
    return losses


def test_a_busy_plans_steps_record_how_much_slower_its_compute_ran_and_later_plans_price_it(
    own_cache,
):
    """Where a plan keeps the device busy (its CPU steps hidden in backward), the measured step
    less the device optimizer over the profiled forward and backward is the compute's slowdown under
    sustained load: the step meter records it once per plan, and later plans on the machine price
    it in place of the hardware profile's probe. A plan whose CPU steps or first gradient take most
    of backward says nothing about the clock."""
    import time
    import types

    from protrain_fx.plan.profiles import Hardware
    from protrain_fx.profiling import step_meter

    busy = {
        "breakdown": {
            "fwd_s": 0.1,
            "bwd_s": 0.2,
            "cpu_optim_s": 0.1,
            "first_grad_s": 0.02,
            "gpu_optim_s": 0.01,
            "clock_slowdown": 1.02,
            "device_step_share": 0.0,
        }
    }
    assert step_rates.compute_slowdown(busy, 0.34) == pytest.approx(0.33 / (0.3 / 1.02))
    assert step_rates.compute_slowdown(busy, 10.0) == step_rates.COMPUTE_RANGE[1]
    assert step_rates.compute_slowdown(busy, 0.1) == step_rates.COMPUTE_RANGE[0]
    cpu_bound = {"breakdown": dict(busy["breakdown"], cpu_optim_s=0.2)}
    assert step_rates.compute_slowdown(cpu_bound, 0.34) is None
    streamed = {"breakdown": dict(busy["breakdown"], device_step_share=0.3)}
    assert step_rates.compute_slowdown(streamed, 0.34) is None
    # forward and backward waiting for chunk copies (uploads slower than compute): the link's rate
    waits = {"breakdown": dict(busy["breakdown"], copy_waits_s=0.004)}
    assert step_rates.compute_slowdown(waits, 0.34) is None
    hidden = {"breakdown": dict(busy["breakdown"], copy_waits_s=0.002)}
    assert step_rates.compute_slowdown(hidden, 0.34) == pytest.approx(0.33 / (0.3 / 1.02))
    assert step_rates.compute_slowdown({}, 0.34) is None
    # judged by the worker's measured span where there is one: a plan predicted a hair CPU-bound
    # (first gradient and CPU steps 1% over backward) whose device ran 11% slow, its CPU steps
    # hidden (the H100's 1B row at 8 x 2048), tells the slowdown; a span that outlasted the slowed
    # backward says the step waited on the CPU, whatever the prediction
    hair = {"breakdown": dict(busy["breakdown"], cpu_optim_s=0.182)}
    assert step_rates.compute_slowdown(hair, 0.34) is None
    found = 0.33 / (0.3 / 1.02)
    assert step_rates.compute_slowdown(hair, 0.34, cpu_span_s=0.17) == pytest.approx(found)
    # the slowed backward: 0.2 * found / 1.02 = 0.2157; the first gradient 0.0216 of it
    assert step_rates.compute_slowdown(busy, 0.34, cpu_span_s=0.2) is None
    assert step_rates.compute_slowdown(busy, 0.34, cpu_span_s=0.19) == pytest.approx(found)

    profile = measure.hardware_profile("cpu")
    before = Hardware.of(profile, step_rates.read(profile, "cpu"))
    assert before.sustained_slowdown == profile.gpu_sustained_slowdown
    # a plan predicted 4 ms of compute a step whose steps take at least 5 ms
    b = dict(busy["breakdown"], fwd_s=0.001, bwd_s=0.003, cpu_optim_s=0.0, first_grad_s=0.0)
    b["gpu_optim_s"] = 0.0
    plan = types.SimpleNamespace(
        predicted={"breakdown": dict(b, clock_slowdown=1.0)},
        profiling=False,
        inference=False,
        profile_blocks=False,
        graph_name="g",
        measured=None,
    )
    meter = step_meter.StepMeter(plan, torch.device("cpu"))
    run = meter.wrap(lambda: time.sleep(0.005))
    for _ in range(step_meter.SKIP + step_rates.COMPUTE_INTERVALS + 5):
        run()
    seen = step_rates._load(step_rates.path_of(profile))[step_rates.COMPUTE]
    assert len(seen) == 1  # once per plan
    slowdown = step_rates.read(profile, "cpu")[step_rates.COMPUTE]
    assert 1.2 <= slowdown <= step_rates.COMPUTE_RANGE[1]
    assert plan.measured["iter_s"] >= 0.005
    after = Hardware.of(profile, step_rates.read(profile, "cpu"))
    assert after.sustained_slowdown == slowdown
    # the profiling plan's steps and an evaluation graph's say nothing
    for kind in ("profiling", "inference"):
        other = types.SimpleNamespace(**dict(vars(plan), measured=None, **{kind: True}))
        meter = step_meter.StepMeter(other, torch.device("cpu"))
        run = meter.wrap(lambda: time.sleep(0.002))
        for _ in range(step_meter.SKIP + step_rates.COMPUTE_INTERVALS + 1):
            run()
    assert len(step_rates._load(step_rates.path_of(profile))[step_rates.COMPUTE]) == 1
