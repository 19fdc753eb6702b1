"""Offloaded chunks stepped on the compute device, streamed up and back
(protrain_fx/runtime/device_steps.py): training exactly like eager PyTorch's whatever share of the
chunks steps there, with accumulation, clipping and two param groups; the cost model chooses the
share only where the CPU bounds the step and the link has room, and budgets the scratch."""

import dataclasses

import pytest
import torch
from hf_models import LossOnly, hf_llama

from protrain_fx.options import Options, OptionsError
from protrain_fx.plan.cost_model import LayoutCosts
from protrain_fx.plan.device_step_cost import MIN_SAVING
from protrain_fx.plan.profiles import (
    DEVICE_STEP_SLOT_BYTES,
    DEVICE_STEP_SLOTS,
    BlockProfile,
    ChunkProfile,
    GraphProfile,
    Hardware,
    in_step_host_bytes,
)
from protrain_fx.runtime import device_steps
from protrain_fx.testing import compare_with_eager, random_batches

VOCAB = 512


def model():
    return LossOnly(hf_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=3))


def timers(r):
    from protrain_fx.runtime.hybrid_optim import handle_of

    return handle_of(r.opt).timers


@pytest.mark.parametrize(
    "share,train_kw",
    [
        (1.0, {}),
        (0.5, {}),
        (0.5, {"micro_steps": 2, "clip": 0.05, "groups": "decay_split"}),
        (1.0, {"clip": 0.05, "autocast_dtype": torch.bfloat16}),
    ],
)
def test_device_steps_train_like_eager(share, train_kw):
    n = 6 if train_kw.get("micro_steps") else 4
    r = compare_with_eager(
        model(),
        random_batches(n, 2, 16, vocab=VOCAB),
        {"compiler": "eager", "n_persist": 0, "chunk_size": "48KiB", "device_steps": share},
        give_optimizer=True,
        **train_kw,
    )
    tol = 2e-2 if "autocast_dtype" in train_kw else 1e-5  # bf16: eager's own rounding differs
    assert r.max_loss_rel <= tol and r.max_param_update > 1e-3
    if "autocast_dtype" not in train_kw:
        assert r.max_param_abs <= 1e-5, r.max_param_abs
    t = timers(r)
    assert t.device_steps > 0, t
    # every store's chunks take their share (a store per block: 4 packed chunks each), the
    # embedding's oversized chunk (one step per optimizer step) always steps on the CPU
    opt_steps = n // train_kw.get("micro_steps", 1)
    packed = t.whole_chunk_steps - opt_steps
    assert abs(t.device_steps / packed - share) <= 0.1, (t.device_steps, packed)
    assert r.plan.device_steps == share


def test_pick_spreads_the_chunks_evenly():
    assert device_steps.pick([3, 4, 5, 6, 7, 8], 0.5, start=0) == {4, 6, 8}
    assert device_steps.pick([1, 2, 3], 0.0, start=0) == set()
    assert device_steps.pick([1, 2, 3], 1.0, start=5) == {1, 2, 3}
    assert len(device_steps.pick(list(range(33)), 12 / 33, start=0)) == 12
    # stores of 4 chunks (one per block, compiled in regions): the share holds over all of them,
    # not 2 of 4 in each
    picked = sum(len(device_steps.pick([0, 1, 2, 3], 11 / 27, start=4 * s)) for s in range(27))
    assert picked == 44


def test_option_is_a_share():
    assert Options.from_dict({"device_steps": 0.25}).device_steps == 0.25
    for bad in (1.5, -0.1, True, "half"):
        with pytest.raises(OptionsError):
            Options.from_dict({"device_steps": bad})


def cpu_bound_profile(n_chunks=8, numel=25_000_000):
    """A profile whose offloaded chunks' CPU steps outlast backward (the 3B shape at 24 GiB)."""
    chunks = tuple(ChunkProfile(numel, 2e-3, 2e-3, blocks=(i,)) for i in range(n_chunks))
    blocks = tuple(
        BlockProfile(fwd_s=2e-3, bwd_s=2e-3, keep_bytes=1 << 28, input_bytes=1 << 24)
        for _ in range(n_chunks)
    )
    return GraphProfile(chunk_size=numel * 4, chunks=chunks, blocks=blocks)


HW = Hardware(55e9, 55e9, 100e9, 4.5e9, 120e9)


def test_device_steps_do_not_pay_where_host_memory_bounds_the_cpu_steps():
    """At the default in-step slowdown (1.25x the kernel's rate alone) the CPU steps are within 4%
    of what the host's memory allows for all the bytes, so no chunk steps on the device."""
    on = LayoutCosts(cpu_bound_profile(), dataclasses.replace(HW, device_steps=True), 1, 0, 0)
    assert on.device_steps(0)[0] == 0


def test_device_steps_are_not_chosen_once_steps_measured_the_cpu_step():
    """The same slowdown as the next test's (the CPU step inside backward at half its rate alone),
    but measured in training steps on the machine (machine/step_rates.py) rather than assumed: it is
    taken as host memory's, which device steps load as much, so every chunk steps on the CPU (on the
    H200 host device steps made plans 11-31% slower: benchmarks/results/oom_sweep_h200_run14.md).
    The host's triad bandwidth bounds the same way before any measurement."""
    prof = cpu_bound_profile()
    assumed = dataclasses.replace(HW, cpu_contention=2.0, device_steps=True)
    assert LayoutCosts(prof, assumed, 1, 0, 0).device_steps(0)[0] > 0
    measured = dataclasses.replace(HW, device_steps=True, observed_s_per_param_copies=2 / 4.5e9)
    costs = LayoutCosts(prof, measured, 1, 0, 0)
    assert costs.cpu_per_param == pytest.approx(LayoutCosts(prof, assumed, 1, 0, 0).cpu_per_param)
    assert costs.device_steps(0)[0] == 0
    triad = dataclasses.replace(assumed, host_bytes_per_s=in_step_host_bytes(True) * 4.5e9 / 2)
    assert LayoutCosts(prof, triad, 1, 0, 0).device_steps(0)[0] == 0


@pytest.mark.parametrize("forced", [None, 0.4])
def test_the_per_profile_table_is_the_split_of_each_n_persist(forced):
    """The search prices device steps from one table per profile (device_step_table): entry
    ``n_persist`` is the split of the chunks ``n_persist..`` computed on its own, with an oversized
    chunk (stepped on the CPU) among them."""
    from protrain_fx.plan.cost_model import _ProfileArrays
    from protrain_fx.plan.device_step_cost import device_step_split

    base = cpu_bound_profile()
    big = ChunkProfile(80_000_000, 2e-3, 2e-3, blocks=())  # larger than the chunk size
    prof = dataclasses.replace(base, chunks=(big,) + base.chunks)
    hw = dataclasses.replace(HW, cpu_contention=2.0, device_steps=True, device_step_share=forced)
    arrays = _ProfileArrays(prof, hw, 1)
    assert arrays.as_is[0] and not any(arrays.as_is[1:])
    table = arrays.device_steps()
    n = len(prof.chunks)
    for p in range(n + 1):
        rest = range(p, n)
        packed = [c for c in rest if not arrays.as_is[c]]
        expect = device_step_split(
            prof,
            hw,
            sum(prof.chunks[c].numel for c in rest),
            sum(prof.chunks[c].numel for c in packed),
            len(packed),
            arrays.cpu_per_param,
        )
        assert table[p] == expect, p
    assert any(share for share, _, _ in table)  # the case exercises device steps


def test_cost_model_steps_some_chunks_on_the_device_when_the_cpu_bounds_the_step():
    """A host whose CPU steps run at half the kernel's rate alone inside a step (cores shared with
    the threads that drive the device): the link takes a share."""
    prof = cpu_bound_profile()
    hw = dataclasses.replace(HW, cpu_contention=2.0)
    off = LayoutCosts(prof, hw, 1, 0, 0)
    on = LayoutCosts(prof, dataclasses.replace(hw, device_steps=True), 1, 0, 0)
    share, params, work = on.device_steps(0)
    assert 0 < share < 1 and params > 0 and work < 0.7 * off.device_steps(0)[2]
    assert on.time_s(0) < 0.8 * off.time_s(0)  # CPU and link share the optimizer's work
    scratch = DEVICE_STEP_SLOTS * DEVICE_STEP_SLOT_BYTES * 25_000_000
    assert on.peak_bytes(0) - off.peak_bytes(0) == pytest.approx(
        scratch * prof.fragmentation, rel=1e-6
    )
    assert on.predict(0).knobs.device_steps == share
    # every chunk resident: nothing to step on the host, no scratch
    n = len(prof.chunks)
    assert on.device_steps(n)[0] == 0 and on.peak_bytes(n) == off.peak_bytes(n)
    # a slow link: the CPU alone is faster
    slow = LayoutCosts(
        prof, dataclasses.replace(hw, device_steps=True, h2d_bytes_per_s=1e9), 1, 0, 0
    )
    assert slow.device_steps(0)[0] == 0
    # the search's lower bound stays a lower bound
    from protrain_fx.plan.cost_model import _ProfileArrays

    arrays = _ProfileArrays(prof, dataclasses.replace(hw, device_steps=True), 1)
    assert arrays.lower_bound_s(0, 0) <= min(on.time_s(p) for p in range(n + 1)) + 1e-9


def test_turning_device_steps_off_changes_the_plan_cache_key(monkeypatch):
    """A plan chosen with device steps is never served to a run that turned them off; the graph's
    profile (budget None) is shared by both."""
    from protrain_fx import plan_cache

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    x = [torch.randn(1, 2)]

    def keys():
        return [plan_cache.key(gm, x, Options(), "hw", b, "a") for b in (1 << 30, None)]

    plan_on, profile_on = keys()
    monkeypatch.setenv("PROTRAIN_DEVICE_STEPS", "0")
    plan_off, profile_off = keys()
    assert plan_off != plan_on and profile_off == profile_on


def test_a_share_the_user_fixed_is_priced_as_given():
    """``options={"device_steps": 0.4}`` on a host whose memory bounds the CPU steps (where the
    automatic plan steps none on the device): the prediction is that share's, the chunks the runtime
    picks (floor of 0.4 x the offloaded chunks), the scratch slots counted, and no faster than the
    host's memory allows (H200 run 7: 14% slower than the CPU alone, measured)."""
    prof = cpu_bound_profile()
    auto = LayoutCosts(prof, dataclasses.replace(HW, device_steps=True), 1, 0, 0)
    forced = LayoutCosts(prof, dataclasses.replace(HW, device_step_share=0.4), 1, 0, 0)
    from protrain_fx.plan.cost_model import _ProfileArrays

    arrays = _ProfileArrays(prof, dataclasses.replace(HW, device_step_share=0.4), 1)
    count = sum(not as_is for as_is in arrays.as_is)  # offloaded chunks of the layout's size
    share, params, work = forced.device_steps(0)
    assert share == int(0.4 * count) / count and params > 0
    assert forced.predict(0).knobs.device_steps == share
    assert forced.peak_bytes(0) > auto.peak_bytes(0)  # the scratch slots
    assert work >= auto.device_steps(0)[2] * (1 - MIN_SAVING)  # memory-bound: no real saving
    n = len(prof.chunks)
    assert arrays.lower_bound_s(0, 0) <= min(forced.time_s(p) for p in range(n + 1)) + 1e-9


def test_a_chunk_stepped_on_the_device_pins_its_moments(monkeypatch):
    """Moments are pageable (only the CPU's step reads them); a chunk stepped on the device streams
    them with asynchronous copies, so its first step there replaces them by pinned copies with the
    same values (chunk_adam._pin_moments), and later steps keep those without asking again."""
    import types

    from protrain_fx.runtime import chunk_adam

    made = []

    def host_empty(numel, dtype, pin):
        t = torch.empty(numel, dtype=dtype)
        made.append(pin)
        return t

    monkeypatch.setattr(chunk_adam.pinned, "host_empty", host_empty)
    st = types.SimpleNamespace(
        exp_avg=torch.randn(7), exp_avg_sq=torch.rand(7), moments_pinned=False
    )
    before = (st.exp_avg.clone(), st.exp_avg_sq.clone(), st.exp_avg, st.exp_avg_sq)
    chunk_adam._pin_moments(st)
    assert made == [True, True]
    assert st.exp_avg is not before[2] and st.exp_avg_sq is not before[3]
    assert torch.equal(st.exp_avg, before[0]) and torch.equal(st.exp_avg_sq, before[1])
    kept = st.exp_avg
    chunk_adam._pin_moments(st)  # pinned already: kept, and not asked again
    assert st.moments_pinned and st.exp_avg is kept and made == [True, True]
    # moments found pinned (a checkpoint's, say) are kept as they are
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    other = types.SimpleNamespace(exp_avg=kept, exp_avg_sq=kept, moments_pinned=False)
    chunk_adam._pin_moments(other)
    assert other.exp_avg is kept and other.moments_pinned and made == [True, True]
