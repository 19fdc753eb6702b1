"""cost_model + search: the search is exact (matches brute force), its plan fits, and no fit is a
clear error."""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protrain_fx.errors import NoPlanFits
from protrain_fx.plan.cost_model import predict
from protrain_fx.plan.profiles import (
    UPLOAD_PIECE,
    BlockProfile,
    ChunkProfile,
    GraphProfile,
    Hardware,
    Knobs,
)
from protrain_fx.plan.search import brute_force, search

HW = Hardware(
    h2d_bytes_per_s=50e9,
    d2h_bytes_per_s=50e9,
    duplex_bytes_per_s=90e9,
    cpu_adam_params_per_s=4e9,
    gpu_adam_params_per_s=120e9,
)
MiB = 2**20


@st.composite
def profiles(draw):
    n_blocks = draw(st.integers(0, 4))
    blocks = tuple(
        BlockProfile(
            fwd_s=draw(st.floats(1e-4, 5e-3)),
            bwd_s=draw(st.floats(2e-4, 1e-2)),
            keep_bytes=(k := draw(st.integers(1, 600)) * MiB),
            input_bytes=draw(st.integers(0, k // MiB)) * MiB,
            swap_resident_bytes=draw(st.integers(0, 2)) * MiB,
        )
        for _ in range(n_blocks)
    )
    out = []
    for chunk_size in draw(
        st.lists(st.sampled_from([64, 128, 256]), min_size=1, max_size=2, unique=True)
    ):
        n_chunks = draw(st.integers(1, 4))
        chunks = tuple(
            ChunkProfile(
                # up to twice the chunk size: a parameter larger than it has a chunk of its own
                numel=draw(st.integers(1, 2 * chunk_size)) * MiB // 4,
                fwd_s=draw(st.floats(0, 5e-3)),
                bwd_s=draw(st.floats(0, 1e-2)),
                blocks=tuple(b for b in range(n_blocks) if b % n_chunks == c),
            )
            for c in range(n_chunks)
        )
        out.append(
            GraphProfile(
                chunk_size=chunk_size * MiB,
                chunks=chunks,
                blocks=blocks,
                nonblock_fwd_s=draw(st.floats(0, 2e-3)),
                nonblock_bwd_s=(nb := draw(st.floats(0, 4e-3))),
                head_bwd_s=draw(st.floats(0, nb)),
                nonblock_saved_bytes=draw(st.integers(0, 100)) * MiB,
                transient_bytes=draw(st.integers(0, 500)) * MiB,
                tail_bytes=draw(st.integers(0, 300)) * MiB,
                # autocast's casts priced
                resident_cast_elem=draw(st.sampled_from([0, 2])),
                fragmentation=draw(st.sampled_from([1.0, 1.1])),
            )
        )
    return out


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# two ranks over a 100 GB/s bus: collectives priced, offloaded states sharded
HW2 = dataclasses.replace(HW, world_size=2, collective_bytes_per_s=100e9)
# gradient accumulation (plan/accumulation.py): added on the device, or by the host worker
HW_MICRO = dataclasses.replace(HW, micro_steps=3, grads_added_on_device=True)
HW_MICRO_HOST = dataclasses.replace(HW, micro_steps=2, host_bytes_per_s=20e9)
# one of 4 blocks compiled alike (regional compilation): a share of what they share
HW_SHARES = dataclasses.replace(HW, budget_shares=4)


@SETTINGS
@given(
    profs=profiles(),
    budget_mib=st.integers(100, 12000),
    host_gib=st.one_of(st.none(), st.integers(1, 40)),
    hw=st.sampled_from([HW, HW2, HW_MICRO, HW_MICRO_HOST, HW_SHARES]),
    copies=st.booleans(),
)
def test_search_matches_brute_force_and_fits(profs, budget_mib, host_gib, hw, copies):
    profs = [dataclasses.replace(p, transfer_copies=copies) for p in profs]
    budget = budget_mib * MiB
    host = None if host_gib is None else host_gib * 2**30
    expected = brute_force(profs, hw, budget, host)
    if expected is None:
        with pytest.raises(NoPlanFits):
            search(profs, hw, budget, host)
        return
    got = search(profs, hw, budget, host).best
    assert got.knobs == expected.knobs
    assert got.time_s == pytest.approx(expected.time_s, rel=1e-12)
    assert got.peak_bytes <= budget  # the chosen plan's predicted peak always fits
    assert host is None or got.host_bytes <= host


@SETTINGS
@given(profs=profiles(), budget_mib=st.integers(100, 6000), extra_mib=st.integers(1, 6000))
def test_more_memory_is_never_slower(profs, budget_mib, extra_mib):
    try:
        small = search(profs, HW, budget_mib * MiB).best
    except NoPlanFits:
        return
    large = search(profs, HW, (budget_mib + extra_mib) * MiB).best
    assert large.time_s <= small.time_s


@SETTINGS
@given(profs=profiles())
def test_one_byte_budget_names_the_smallest_budget_that_works(profs):
    with pytest.raises(NoPlanFits, match="smallest budget that would work") as e:
        search(profs, HW, 1)
    need = e.value.min_device_bytes
    assert need > 1
    # the message says what that peak is made of: its parts add up to it
    listed = str(e.value).split("holds at its peak: ")[1]
    units = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
    total = 0.0
    for part in listed.split("; "):
        *_, number, unit = part.split(" ")
        total += float(number) * units[unit]
    assert abs(total - need) <= 0.01 * need + 2**10 * len(listed.split("; "))
    assert search(profs, HW, need).best.peak_bytes == need  # exactly that budget is enough
    with pytest.raises(NoPlanFits):
        search(profs, HW, need - 1)


def test_host_memory_too_small_names_what_is_needed():
    prof = GraphProfile(
        chunk_size=256 * MiB,
        blocks=(BlockProfile(1e-3, 2e-3, 100 * MiB, 10 * MiB),) * 2,
        chunks=tuple(ChunkProfile(64 * MiB, 1e-3, 2e-3, (i,)) for i in range(2)),
    )
    # a device budget that forces offloading, and no host memory for it
    only_offloaded = predict(prof, HW, Knobs(prof.chunk_size, 0, 1, 0, 2)).peak_bytes
    with pytest.raises(NoPlanFits, match="pinned host memory") as e:
        search([prof], HW, only_offloaded, host_budget=1)
    assert e.value.min_host_bytes > 1
    # it names the device budget at which a plan needs no more pinned memory than the host has
    # (every chunk resident), and that budget works
    need = e.value.min_device_bytes
    assert need is not None and need > only_offloaded and f"{need} bytes" in str(e.value)
    got = search([prof], HW, need, host_budget=1).best
    assert got.peak_bytes <= need and got.host_bytes <= 1
    with pytest.raises(NoPlanFits, match="smallest device budget"):
        search([prof], HW, need - 1, host_budget=1)


def test_given_knobs_are_honoured():
    prof = GraphProfile(
        chunk_size=256 * MiB,
        blocks=(BlockProfile(1e-3, 2e-3, 100 * MiB, 10 * MiB),) * 4,
        chunks=tuple(ChunkProfile(32 * MiB, 2e-3, 4e-3, (i,)) for i in range(4)),
    )
    free = search([prof], HW, 100 * 2**30).best
    everything_resident = predict(prof, HW, Knobs(prof.chunk_size, 4, 1, 0, 0))
    assert free.time_s <= everything_resident.time_s
    fixed = search([prof], HW, 100 * 2**30, n_persist=1, n_checkpoint=2, n_buffer=3).best.knobs
    assert (fixed.n_persist, fixed.n_checkpoint, fixed.n_buffer) == (1, 2, 3)


def test_the_end_of_backward_holds_the_resident_gradients_and_what_follows_the_blocks():
    """The peak's second end: resident gradients plus ``tail_bytes`` (the embedding's dense
    gradient and a tied head's held one, measured after the last block's backward), which the
    H200 showed missing: Llama-3.2-3B's shape at 24 and 40 GiB ran out of memory allocating the
    1.47 GiB embedding gradient 1.2-2.5 GiB above the predicted peak."""

    def peak(tail):
        prof = _blocks_profile(10 * MiB, tail)
        return predict(prof, HW, Knobs(prof.chunk_size, 2, 1, 0, 0)).peak_bytes

    states = 2 * 256 * MiB * 3  # parameters and two moments, fp32, both chunks resident
    grads = 2 * 256 * MiB
    # small tail: the start of backward (activations + transient) is not the larger end either
    assert peak(0) == states + max(20 * MiB + 50 * MiB, grads)
    assert peak(1024 * MiB) == states + grads + 1024 * MiB


def _blocks_profile(keep: int, tail: int, table: int = 0, **table_chunk) -> GraphProfile:
    """Two blocks of a 256 MiB chunk each, each keeping ``keep`` bytes, after an embedding table's
    chunk of ``table`` bytes (none for 0; its ChunkProfile's fields ``table_chunk``)."""
    blk = BlockProfile(fwd_s=1e-3, bwd_s=2e-3, keep_bytes=keep, input_bytes=1 * MiB)
    chunks = ((ChunkProfile(table // 4, 1e-3, 2e-3, (), **table_chunk),) if table else ()) + tuple(
        ChunkProfile(256 * MiB // 4, 1e-3, 2e-3, (i,)) for i in range(2)
    )
    return GraphProfile(
        chunk_size=256 * MiB,
        blocks=(blk, blk),
        chunks=chunks,
        transient_bytes=50 * MiB,
        tail_bytes=tail,
        fragmentation=1.0,
    )


def test_a_resident_tied_table_builds_its_dense_gradient_beside_the_head_s_part():
    """A tied embedding's chunk whose gradient the profiled step (the chunk offloaded) sent as rows:
    resident, backward builds the dense table while the gradient holds the head's part, one table
    more at the end of backward (H200 run 29: the 1B Llama shape's three 1 GiB tensors at the peak,
    1.01 GiB over the prediction). Only where that chunk is resident."""
    table = 512 * MiB

    def peak(n_persist, table_grad):
        prof = _blocks_profile(10 * MiB, 64 * MiB, table, table_grad_bytes=table_grad)
        return predict(prof, HW, Knobs(prof.chunk_size, n_persist, 1, 0, 0)).peak_bytes

    assert peak(3, table) == peak(3, 0) + table  # the end of backward is the larger end
    assert peak(1, table) == peak(1, 0) + table
    assert peak(0, table) == peak(0, 0)  # offloaded: its rows go to the host


def test_gradients_kept_between_steps_count_through_the_whole_step():
    """A loop that keeps gradients from one backward to the next forward (accumulation,
    ``zero_grad(set_to_none=False)``): the resident gradients are there at the start of backward
    beside the activations (the plan for a loop that frees them counts them at its end only), and
    any resident table whose gradient the profiled step sent as rows is built beside one."""
    table = 512 * MiB
    prof = _blocks_profile(200 * MiB, 0, table, row_table_bytes=table)
    knobs = Knobs(prof.chunk_size, 3, 1, 0, 0)
    freed = predict(prof, HW, knobs).peak_bytes
    held = predict(prof, dataclasses.replace(HW, grads_held=True), knobs).peak_bytes
    states = (table + 2 * 256 * MiB) * 3  # parameters and two moments, fp32, all resident
    grads = table + 2 * 256 * MiB
    saved = 2 * 200 * MiB + 50 * MiB
    assert freed == states + max(saved, grads)  # an untied table: its gradient is the dense one
    assert held == states + max(saved + grads, grads + table)
    assert held > freed


def test_blocks_compiled_alike_count_their_share_of_what_they_share():
    """Regional compilation: each of ``n`` blocks compiled alike is planned for 1/n of the budget.
    The chunk and gradient buffers (one pool per chunk size), the working set of the one block
    running and the allocator's fixed bytes are the n blocks' together: each counts 1/n of them,
    its own resident states, saved activations and gradients in full, so n shares add up to the
    process's peak. Before, each counted them whole (an H100 regional run's re-plan found no plan
    within 835 MiB per layer: its process peaked at 16.4 of 24 GiB)."""
    from protrain_fx.plan.cost_model import LayoutCosts
    from protrain_fx.plan.timeline import peak_parts

    n = 8
    prof = dataclasses.replace(_blocks_profile(10 * MiB, 0), fragmentation_bytes=8 * MiB)
    shared = dataclasses.replace(HW, budget_shares=n)
    for n_persist in (0, 1, 2):  # the start of backward the larger end, then its end
        parts = peak_parts(LayoutCosts(prof, HW, 2, 0, 0), n_persist)
        theirs = (
            parts["chunk and gradient buffers"]
            + parts["other buffers (device steps' scratch, upload staging)"]
        )
        at_start = "saved activations" in parts
        if at_start:
            theirs += parts["backward's largest working set (beyond what forward saved)"]
        theirs += 8 * MiB  # the allocator's fixed bytes (fragmentation 1.0)
        knobs = Knobs(prof.chunk_size, n_persist, 2, 0, 0)
        whole = predict(prof, HW, knobs).peak_bytes
        share = predict(prof, shared, knobs).peak_bytes
        assert theirs > 0 and at_start == (n_persist == 0)
        assert share == pytest.approx(whole - theirs + theirs / n, abs=n)
        # the search plans one block's share: it fits where the whole would not
        assert search([prof], shared, share, n_persist=n_persist).best.peak_bytes <= share < whole


def test_prediction_terms():
    """Hand-checkable numbers: one block per chunk, two chunks, the second offloaded."""
    blk = BlockProfile(fwd_s=0.010, bwd_s=0.020, keep_bytes=100 * MiB, input_bytes=10 * MiB)
    ch = ChunkProfile(numel=50 * 10**6, fwd_s=0.010, bwd_s=0.020)
    prof = GraphProfile(
        chunk_size=256 * MiB,
        blocks=(blk, blk),
        transient_bytes=0,
        chunks=(
            ChunkProfile(ch.numel, ch.fwd_s, ch.bwd_s, (0,)),
            ChunkProfile(ch.numel, ch.fwd_s, ch.bwd_s, (1,)),
        ),
    )
    p = predict(prof, HW, Knobs(prof.chunk_size, 1, 2, 0, 1))  # block 0 recomputes, block 1 keeps
    h2d = 50e6 * 2 / 50e9  # 2 ms, hidden behind 10 ms of compute
    assert p.breakdown["fwd_s"] == pytest.approx(0.010 + max(0.010, h2d))
    # chunk 0 resident: its backward plus block 0's recompute; chunk 1 (offloaded, left in a buffer
    # by forward: no re-gather) backward against its 200 MB fp32 gradient going down (4 ms) plus the
    # packing of chunk 1's bf16 gradients into its fp32 buffer and the on-device copies out of its
    # chunk buffer of its two gathers (forward and backward: 2 bf16 bytes read and written each), at
    # the device's streaming rate (the Adam rate times 28 bytes); no autocast here
    # (resident_cast_elem 0)
    pack = 50e6 * (2 + 4 + 4 * 2) / (HW.gpu_adam_params_per_s * 28)
    assert p.breakdown["cast_s"] == pytest.approx(pack)
    assert p.breakdown["bwd_s"] == pytest.approx(
        (0.020 + 0.010) + max(0.020, 50e6 * 4 / 50e9) + pack
    )
    assert p.breakdown["cpu_optim_s"] == pytest.approx(50e6 / 4e9 * 1.25)
    # the device optimizer runs at opt.step(), after backward() waited for the CPU steps: it
    # follows both sides, the CPU-bound one here (12.5 ms + the first gradient against 30 ms + 24
    # ms of backward compute... whichever is longer), it is never hidden behind the CPU optimizer
    b = p.breakdown
    assert b["gpu_optim_s"] == pytest.approx(50e6 / 120e9)
    assert p.time_s == pytest.approx(
        b["fwd_s"] + max(b["bwd_s"], b["first_grad_s"] + b["cpu_optim_s"]) + b["gpu_optim_s"]
    )
    slow_cpu = predict(
        prof, dataclasses.replace(HW, cpu_adam_params_per_s=1e9), Knobs(prof.chunk_size, 1, 2, 0, 1)
    )
    sb = slow_cpu.breakdown
    assert sb["first_grad_s"] + sb["cpu_optim_s"] > sb["bwd_s"]  # CPU-bound
    assert slow_cpu.time_s == pytest.approx(
        sb["fwd_s"] + sb["first_grad_s"] + sb["cpu_optim_s"] + sb["gpu_optim_s"]
    )
    assert p.breakdown["activation_bytes"] == 10 * MiB + 100 * MiB
    # block 0's activations come back during its recompute
    assert p.breakdown["transient_bytes"] == 100 * MiB
    states = 50e6 * 4 * 3  # params, two moments
    # two bf16 chunk buffers, two fp32 gradient buffers, each holding a chunk of the layout's size
    # (256 MiB of fp32: stores of one chunk size share them, protrain_fx/runtime/chunk_store.py)
    cap = 256 * MiB // 4
    buffers = 2 * cap * 2 + 2 * cap * 4
    # backward's start (activations, transient) or end (gradients)
    live = max(110 * MiB + 100 * MiB, 50e6 * 4)
    assert p.peak_bytes == pytest.approx((states + buffers + live) * 1.10, abs=1)


def test_without_transfer_copies_gathers_move_masters_and_the_host_holds_less():
    """transfer_copies=False: a gather moves the fp32 master (4 bytes, not 2) through a staging
    piece on the device, and the host holds no bf16 copy of the offloaded chunk."""
    ch = ChunkProfile(numel=50 * 10**6, fwd_s=0.001, bwd_s=0.020)
    prof = GraphProfile(
        chunk_size=256 * MiB,
        blocks=(),
        chunks=(
            ChunkProfile(ch.numel, ch.fwd_s, ch.bwd_s, ()),
            ChunkProfile(ch.numel, ch.fwd_s, ch.bwd_s, ()),
        ),
    )
    knobs = Knobs(prof.chunk_size, 1, 2, 0, 0)
    copies = predict(prof, HW, knobs)
    lean = predict(prof, HW, dataclasses.replace(knobs, transfer_copies=False))
    assert lean.knobs.transfer_copies is False and copies.knobs.transfer_copies is True
    # chunk 1's forward: its gather (2 ms as bf16, 4 ms as fp32) is longer than its 1 ms compute
    assert copies.breakdown["fwd_s"] == pytest.approx(0.001 + 50e6 * 2 / 50e9)
    assert lean.breakdown["fwd_s"] == pytest.approx(0.001 + 50e6 * 4 / 50e9)
    # what of it forward waits for the copy (backward's gradient copy hides behind its 20 ms)
    assert copies.breakdown["copy_waits_s"] == pytest.approx(50e6 * 2 / 50e9 - 0.001)
    assert lean.breakdown["copy_waits_s"] == pytest.approx(50e6 * 4 / 50e9 - 0.001)
    # the masters went up at half the copies' rate inside earlier steps: gathers priced so
    slow_up = dataclasses.replace(HW, observed_upload_masters=25e9)
    lean_slow = predict(prof, slow_up, dataclasses.replace(knobs, transfer_copies=False))
    assert lean_slow.breakdown["fwd_s"] == pytest.approx(0.001 + 50e6 * 4 / 25e9)
    assert predict(prof, slow_up, knobs).breakdown["fwd_s"] == copies.breakdown["fwd_s"]
    assert copies.host_bytes - lean.host_bytes == 50e6 * 2
    staging = min(UPLOAD_PIECE, 50 * 10**6) * 4
    assert lean.peak_bytes - copies.peak_bytes == pytest.approx(staging * 1.10, abs=2)
    # nothing offloaded: no staging, nothing on the host
    everything = dataclasses.replace(knobs, n_persist=2, transfer_copies=False)
    resident = dataclasses.replace(knobs, n_persist=2)
    assert predict(prof, HW, everything).peak_bytes == predict(prof, HW, resident).peak_bytes


def test_the_automatic_plan_keeps_no_copies_where_that_is_faster():
    """Two chunks, the first resident, the second offloaded (given), bf16 transfers.
    The CPU step without the bf16 copy measured as fast as with it: the copies' plan is kept (a
    shorter gather, a tie elsewhere). Measured twice as fast, in a plan bound by the CPU step: the
    plan without copies is chosen, and its note says why with both predictions."""
    from protrain_fx.plan.search import search_or_without_copies

    ch = ChunkProfile(numel=50 * 10**6, fwd_s=0.010, bwd_s=0.002)
    prof = GraphProfile(
        chunk_size=256 * MiB,
        blocks=(),
        chunks=(ch, ch),
        transfer_elem=2,
        resident_cast_elem=2,
    )
    budget = 2**40
    res, why = search_or_without_copies([prof], HW, budget, None, True, n_persist=1)
    assert res.best.knobs.transfer_copies and why is None and res.best.knobs.n_persist == 1
    fast = dataclasses.replace(HW, cpu_adam_masters_params_per_s=2 * HW.cpu_adam_params_per_s)
    res2, why = search_or_without_copies([prof], fast, budget, None, True, n_persist=1)
    assert not res2.best.knobs.transfer_copies and res2.best.knobs.n_persist == 1
    assert res2.best.time_s < res.best.time_s
    assert res2.best.breakdown["cpu_optim_s"] == pytest.approx(
        res.best.breakdown["cpu_optim_s"] / 2
    )
    assert "transfer_copies=False" in why and f"{1e3 * res.best.time_s:.1f} ms" in why
    assert res2.evaluated > res.evaluated / 2
    # copies given: never dropped
    res3, why = search_or_without_copies([prof], fast, budget, None, False, n_persist=1)
    assert res3.best.knobs.transfer_copies and why is None


def test_a_host_that_fits_only_plans_without_copies():
    """The host holds the offloaded chunk at 16 bytes a parameter, not 18 with its bf16 copy: the
    plan keeps no copies and says why (the copies' search failed fast, without the budgets that
    would do); a host too small for either raises the copies' error naming the smallest pinned
    memory, as the search alone does."""
    from protrain_fx.plan.search import search_or_without_copies

    ch = ChunkProfile(numel=50 * 10**6, fwd_s=0.010, bwd_s=0.002)
    prof = GraphProfile(
        chunk_size=256 * MiB, blocks=(), chunks=(ch, ch), transfer_elem=2, resident_cast_elem=2
    )
    budget = 2**40
    lean = search([dataclasses.replace(prof, transfer_copies=False)], HW, budget, None, n_persist=1)
    host = lean.best.host_bytes  # 16 bytes a parameter and the staging: not the copies' 18
    res, why = search_or_without_copies([prof], HW, budget, host, True, n_persist=1)
    assert not res.best.knobs.transfer_copies and res.best.host_bytes <= host
    assert "no plan with host transfer copies" in why and "transfer_copies=False" in why
    with pytest.raises(NoPlanFits) as alone:
        search([prof], HW, budget, host - 1, n_persist=1)
    with pytest.raises(NoPlanFits) as both:
        search_or_without_copies([prof], HW, budget, host - 1, True, n_persist=1)
    assert str(both.value) == str(alone.value) and "smallest needs" in str(both.value)
    assert both.value.min_host_bytes == alone.value.min_host_bytes


def test_micro_steps_repeat_forward_and_backward_with_the_gradient_add():
    """Hand-checked: two chunks of 50 M fp32 parameters (10 ms forward, 2 ms backward each), the
    second offloaded, CPU steps at opt.step() (so the step adds up). Its gradient's 200 MB going
    down at 50 GB/s keeps the link busy 4 ms of its backward; from the second micro-step on, the
    accumulator's 200 MB come up beside it, 4 ms more (runtime/grad_add.py). Each micro-step after
    the first adds a forward, a backward and that add; the optimizers run once."""
    from protrain_fx.plan.cost_model import LayoutCosts

    ch = ChunkProfile(numel=50 * 10**6, fwd_s=0.010, bwd_s=0.002)
    prof = GraphProfile(chunk_size=256 * MiB, blocks=(), chunks=(ch, ch), transfer_elem=2)
    at_step = dataclasses.replace(HW, steps_at_opt_step=True, grads_added_on_device=True)
    t1, one = LayoutCosts(prof, at_step, 1, 0, 0).time_s(1, detail=True)
    assert one["micro_steps"] == 1 and one["before_last_micro_step_s"] == 0
    for k in (2, 3):
        hw = dataclasses.replace(at_step, micro_steps=k)
        t, parts = LayoutCosts(prof, hw, 1, 0, 0).time_s(1, detail=True)
        assert t == pytest.approx(t1 + (k - 1) * (one["fwd_s"] + one["bwd_s"] + 0.004))
        assert parts["cpu_optim_s"] == one["cpu_optim_s"]  # once per optimizer step
        assert parts["bwd_s"] == pytest.approx(one["bwd_s"] + 0.004)  # the last one adds too
    # every chunk resident: nothing to add, the micro-steps are forward and backward again
    hw = dataclasses.replace(at_step, micro_steps=2)
    resident = LayoutCosts(prof, hw, 1, 0, 0).time_s(2, detail=True)[1]
    alone = LayoutCosts(prof, at_step, 1, 0, 0).time_s(2, detail=True)[1]
    assert resident["before_last_micro_step_s"] == pytest.approx(alone["fwd_s"] + alone["bwd_s"])


def test_autocast_casts_are_priced():
    """With autocast (resident_cast_elem 2: fp32 resident parameters cast to bf16), forward pays one
    cast of each resident parameter, backward the gradients' cast back plus the recast of
    checkpointed blocks'."""
    blk = BlockProfile(fwd_s=0.010, bwd_s=0.020, keep_bytes=100 * MiB, input_bytes=10 * MiB)
    chunks = tuple(ChunkProfile(50 * 10**6, 0.010, 0.020, (i,)) for i in range(2))
    prof = GraphProfile(
        chunk_size=256 * MiB, blocks=(blk, blk), chunks=chunks, resident_cast_elem=2
    )
    rate = HW.gpu_adam_params_per_s * 28
    cast = 100e6 * (4 + 2) / rate  # both chunks resident
    p = predict(prof, HW, Knobs(prof.chunk_size, 2, 1, 0, 1))  # block 0 recomputes: half the blocks
    assert p.breakdown["cast_s"] == pytest.approx(cast + cast + cast / 2)
    plain = predict(
        dataclasses.replace(prof, resident_cast_elem=0), HW, Knobs(prof.chunk_size, 2, 1, 0, 1)
    )
    assert p.breakdown["fwd_s"] - plain.breakdown["fwd_s"] == pytest.approx(cast)
    assert p.time_s - plain.time_s == pytest.approx(2.5 * cast)


def test_data_parallel_resident_all_reduce_overlaps_backward():
    """Resident chunks' all-reduces start as each chunk's backward ends: only what the backward of
    the chunks before it cannot hide is exposed (chunk 0's, the last, at least)."""
    blk = BlockProfile(fwd_s=0.010, bwd_s=0.020, keep_bytes=100 * MiB, input_bytes=10 * MiB)
    ch = 50 * 10**6
    allreduce = 2 * ch * 4 / 2 / 100e9  # one chunk's fp32 gradients: 4 ms
    for bwd in (0.020, 0.001):  # chunk 0's backward hides chunk 1's all-reduce, or does not
        prof = GraphProfile(
            chunk_size=256 * MiB,
            blocks=(blk, blk),
            chunks=(ChunkProfile(ch, 0.010, bwd, (0,)), ChunkProfile(ch, 0.010, bwd, (1,))),
        )
        knobs = Knobs(prof.chunk_size, 2, 0, 0, 0)  # both chunks resident
        one, two = predict(prof, HW, knobs), predict(prof, HW2, knobs)
        exposed = max(allreduce, 2 * allreduce - bwd)
        # the overlapped rest slows the compute beside it
        slowed = (2 * allreduce - exposed) * HW2.collective_contention
        assert two.breakdown["bwd_s"] == pytest.approx(one.breakdown["bwd_s"] + exposed + slowed)
        assert two.breakdown["collective_contention_s"] == pytest.approx(slowed)
        # backward ends with the resident gradients (400 MB, more than the activations here); with
        # two ranks the same: they are averaged in place (no flat copy)
        states, grads = 2 * ch * 4 * 3, 2 * ch * 4
        assert one.peak_bytes == two.peak_bytes == math.ceil((states + grads) * 1.10)


def _two_chunks() -> tuple[int, GraphProfile]:
    """Two blocks, a chunk of 50 M parameters each, with little backward compute."""
    blk = BlockProfile(fwd_s=0.010, bwd_s=0.020, keep_bytes=100 * MiB, input_bytes=10 * MiB)
    ch = 50 * 10**6
    return ch, GraphProfile(
        chunk_size=256 * MiB,
        blocks=(blk, blk),
        chunks=(ChunkProfile(ch, 0.010, 0.001, (0,)), ChunkProfile(ch, 0.010, 0.001, (1,))),
    )


def test_data_parallel_terms():
    """Two ranks: a rank steps and keeps half of the offloaded states, and pays the collectives: an
    all-gather per offloaded chunk gathered, a reduce-scatter per offloaded gradient, an all-reduce
    of the resident gradients."""
    ch, prof = _two_chunks()  # backward compute under the traffic
    # chunk 1 offloaded, one buffer (still prefetched: a gather
    knobs = Knobs(prof.chunk_size, 1, 1, 0, 0)
    # copies its chunk out, so the buffer is free for the next chunk at once)
    one, two = predict(prof, HW, knobs), predict(prof, HW2, knobs)
    assert two.breakdown["cpu_optim_s"] == pytest.approx(one.breakdown["cpu_optim_s"] / 2)
    offloaded_host = ch * (4 * 4 + 2)  # master, accumulator, two moments, bf16 copy
    assert one.host_bytes - two.host_bytes == pytest.approx(offloaded_host / 2, abs=64)
    gather = ch * 2 / 2 / 100e9  # the half of the bf16 chunk that comes from the other rank
    h2d_half = ch * 2 / 2 / 50e9
    assert two.breakdown["fwd_s"] == pytest.approx(0.010 + max(0.010, h2d_half + gather))
    allreduce = 2 * ch * 4 / 2 / 100e9  # resident chunk 0's fp32 gradients
    reduce_scatter = ch * 4 / 2 / 100e9
    # chunk 1 stays in its buffer from forward (no re-gather); its gradient's half goes down
    down = ch * 4 / 2
    comm = down / 50e9 + reduce_scatter
    # chunk 1's gradients packed into its fp32 buffer (test_prediction_terms)
    pack = one.breakdown["cast_s"]
    assert two.breakdown["cast_s"] == pack
    assert two.breakdown["bwd_s"] == pytest.approx(0.001 + max(0.001, comm) + allreduce + pack)
    assert one.breakdown["bwd_s"] == pytest.approx(0.001 + max(0.001, 2 * down / 50e9) + pack)


def test_chunks_sharded_on_the_devices_terms():
    """Two ranks, chunk 1 sharded on the devices instead of offloaded: its gather is an all-gather
    started ahead (passes/shard_prefetch.py), so it hides behind compute as far as compute lasts;
    backward re-gathers it unless it stayed in a buffer and reduce-scatters its gradient beside
    backward's compute; its shard is stepped on the device at opt.step(), nothing of it is on the
    host or on the CPU, and the device holds half of its fp32 master, gradient and moments."""
    ch, prof = _two_chunks()
    for n_buffer, bus in ((0, 100e9), (1, 100e9), (0, 2e9)):
        hw = dataclasses.replace(HW2, collective_bytes_per_s=bus)
        off = predict(prof, hw, Knobs(prof.chunk_size, 1, n_buffer, 0, 0))
        sh = predict(prof, hw, Knobs(prof.chunk_size, 1, n_buffer, 0, 0, n_shard=1))
        assert sh.knobs.n_shard == 1 and sh.breakdown["cpu_optim_s"] == 0
        gather = ch * 2 / 2 / bus  # the other rank's half of the bf16 chunk
        reduce_scatter = ch * 4 / 2 / bus
        regather = gather if n_buffer == 0 else 0.0  # the last chunk stays in its buffer
        allreduce = 2 * ch * 4 / 2 / bus  # resident chunk 0's
        exposed = max(allreduce, allreduce - 0.001)  # chunk 0's all-reduce, after its backward
        slowed = (allreduce - exposed) * HW2.collective_contention
        assert sh.breakdown["fwd_s"] == pytest.approx(0.010 + max(0.010, gather))
        pack = sh.breakdown["cast_s"]  # chunk 1's gradients packed, as an offloaded chunk's
        assert pack == off.breakdown["cast_s"]
        assert sh.breakdown["bwd_s"] == pytest.approx(
            0.001 + max(0.001, regather + reduce_scatter) + exposed + slowed + pack
        )
        assert sh.breakdown["gpu_optim_s"] == pytest.approx(
            off.breakdown["gpu_optim_s"] + (ch // 2) / HW2.gpu_adam_params_per_s
        )
        # the host holds nothing of it; the device half of its four fp32 states
        assert sh.host_bytes < off.host_bytes - ch * 4 * 4 // 2 + 64
        assert sh.peak_bytes - off.peak_bytes == math.ceil(ch // 2 * 4 * 4 * 1.10)
    with pytest.raises(ValueError, match="several ranks"):
        predict(prof, HW, Knobs(prof.chunk_size, 1, 1, 0, 0, n_shard=1))


def _cpu_bound_profile(n_chunks: int = 8) -> GraphProfile:
    blk = BlockProfile(fwd_s=0.002, bwd_s=0.004, keep_bytes=10 * MiB, input_bytes=1 * MiB)
    ch = 100 * 10**6  # 400 MB of fp32 per chunk
    return GraphProfile(
        chunk_size=512 * MiB,
        blocks=(blk,) * n_chunks,
        chunks=tuple(ChunkProfile(ch, 0.002, 0.004, (c,)) for c in range(n_chunks)),
    )


def test_the_search_shards_chunks_where_the_cpu_optimizer_bounds_the_step():
    """With several ranks, a budget too small for every chunk resident but large enough for the
    shards of some, and a step bound by the CPU optimizer: the search shards chunks on the devices
    (as many as pay), and still matches brute force. With one rank it does not."""
    prof = _cpu_bound_profile()
    budget = 6 * 2**30  # 3.2 GB of fp32 parameters: 12.8 GB all resident with grads and moments
    one = search([prof], HW, budget).best
    two = search([prof], HW2, budget).best
    assert one.knobs.n_shard == 0 and one.knobs.n_persist < len(prof.chunks)
    assert two.knobs.n_shard > 0 and two.time_s < one.time_s
    assert two.peak_bytes <= budget
    assert two.knobs == brute_force([prof], HW2, budget, n_buffers=(1, 2, 3)).knobs
    # the CPU's share shrinks with every chunk the devices hold
    assert two.breakdown["cpu_optim_s"] < one.breakdown["cpu_optim_s"] / 2
    # with a slow bus the offloaded chunks' gathers are slow too (a rank uploads its shard and
    # all-gathers the rest), so shards still pay: the plan is as slow as the bus makes every plan
    slow = dataclasses.replace(HW2, collective_bytes_per_s=1e8)
    assert search([prof], slow, budget).best.time_s > 10 * two.time_s
    # given, it is honoured (clamped to the chunks left)
    assert search([prof], HW2, budget, n_shard=1, n_persist=2).best.knobs.n_shard == 1
    assert search([prof], HW2, budget, n_shard=0).best.knobs.n_shard == 0


@SETTINGS
@given(profs=profiles(), budget_mib=st.integers(100, 12000), bus=st.sampled_from([1e8, 1e10, 1e12]))
def test_the_lower_bound_holds_with_chunks_sharded_on_the_devices(profs, budget_mib, bus):
    """The search skips a layout whose bound exceeds the best plan: with several ranks the bound
    must stay under every plan of the layout that fits, sharded ones included."""
    from protrain_fx.plan.cost_model import LayoutCosts, _ProfileArrays

    hw, budget = dataclasses.replace(HW2, collective_bytes_per_s=bus), budget_mib * MiB
    for prof in profs:
        n_blocks, n = len(prof.blocks), len(prof.chunks)
        arrays = _ProfileArrays(prof, hw, 1)
        for n_swap in range(n_blocks + 1):
            for n_ckpt in range(n_blocks - n_swap + 1):
                bound = arrays.lower_bound_s(n_swap, n_ckpt, budget, True)
                lc = LayoutCosts(prof, hw, 1, n_swap, n_ckpt, arrays)
                times = [
                    lc.time_s(p, n_shard=sh)
                    for p in range(n + 1)
                    for sh in range(n - p + 1)
                    if lc.peak_bytes(p, sh) <= budget
                ]
                assert not times or bound <= min(times) * (1 + 1e-9)


@SETTINGS
@given(
    profs=profiles(),
    budget_mib=st.integers(100, 12000),
    host_mib=st.integers(0, 40000),
    copies=st.booleans(),
)
def test_the_lower_bound_holds_under_a_host_budget(profs, budget_mib, host_mib, copies):
    """With a host budget the bound also counts the resident parameters the host forces (what the
    offloaded ones' pinned states leave): still under every plan of the layout that fits the device
    and the host, and infinite (the layout skipped unpriced) only where no plan fits both."""
    from protrain_fx.plan.cost_model import LayoutCosts, _ProfileArrays

    budget, host = budget_mib * MiB, host_mib * MiB
    for prof in (dataclasses.replace(p, transfer_copies=copies) for p in profs):
        n_blocks, n = len(prof.blocks), len(prof.chunks)
        arrays = _ProfileArrays(prof, HW, 1)
        for n_swap in range(n_blocks + 1):
            for n_ckpt in range(n_blocks - n_swap + 1):
                bound = arrays.lower_bound_s(n_swap, n_ckpt, budget, False, host)
                lc = LayoutCosts(prof, HW, 1, n_swap, n_ckpt, arrays)
                times = [
                    lc.time_s(p)
                    for p in range(n + 1)
                    if lc.peak_bytes(p) <= budget and lc.host_bytes(p) <= host
                ]
                assert not times or bound <= min(times) * (1 + 1e-9)
                # and never looser than without the host: it only adds a constraint
                assert bound >= arrays.lower_bound_s(n_swap, n_ckpt, budget) * (1 - 1e-12)


def test_swap_waits_block_by_block():
    """Hand-checked: four blocks of 1 ms forward and 2 ms backward, the first two swapping 100 MB
    each at 50 GB/s (2 ms a copy). Forward: block 2 waits for block 0's offload (done at 2 ms),
    block 3 for block 1's, queued behind it (done at 4 ms): 1 ms of waiting. Backward with the
    reload one block ahead (a whole graph): hidden; with no lead (compiled in regions: a block's
    own code starts its reload): blocks 1 and 0 wait 2 ms each."""
    from protrain_fx.plan.swap_cost import swap_stall_s

    blk = BlockProfile(fwd_s=1e-3, bwd_s=2e-3, keep_bytes=100 * 10**6, input_bytes=0)
    ahead = GraphProfile(chunk_size=MiB, chunks=(), blocks=(blk,) * 4)
    own = dataclasses.replace(ahead, reload_lead_blocks=0)
    assert swap_stall_s(ahead, HW, 2, 0) == pytest.approx(1e-3)
    assert swap_stall_s(own, HW, 2, 0) == pytest.approx(1e-3 + 4e-3)
    # the step prices the larger of these waits and the copies beyond the whole window
    ch = ChunkProfile(numel=1000, fwd_s=4e-3, bwd_s=8e-3, blocks=(0, 1, 2, 3))
    p = predict(dataclasses.replace(own, chunks=(ch,)), HW, Knobs(MiB, 1, 1, 2, 0))
    assert p.breakdown["swap_exposed_s"] == pytest.approx(5e-3)


@SETTINGS
@given(profs=profiles(), n_buffer=st.integers(1, 3), slow=st.sampled_from([0.05e9, 0.5e9, 4e9]))
def test_cpu_steps_wait_for_their_gradients_like_a_pipeline(profs, n_buffer, slow):
    """The host worker steps offloaded chunks one after another, each once its gradient is on the
    host: the cost model's end of the CPU steps equals that, chunk by chunk (backward reaches the
    last chunk first, after the code after the blocks)."""
    from protrain_fx.plan.cost_model import LayoutCosts

    hw = dataclasses.replace(HW, cpu_adam_params_per_s=slow)
    prof = profs[0]
    lc = LayoutCosts(prof, hw, n_buffer, 0, 0)
    n = len(prof.chunks)
    k = hw.cpu_contention / hw.cpu_adam_params_per_s
    for n_persist in range(n + 1):
        _, parts = lc.time_s(n_persist, detail=True)
        if n_persist == n:
            assert parts["cpu_optim_s"] == parts["first_grad_s"] == 0.0
            continue
        t_gpu, done = prof.head_bwd_s, 0.0
        for c in range(n - 1, n_persist - 1, -1):  # backward order
            ch = prof.chunks[c]
            up = 0 if c >= n - n_buffer else ch.numel * prof.transfer_elem
            down = ch.numel * prof.master_elem
            if ch.numel * prof.master_elem > prof.chunk_size:
                # one large parameter: its gradient goes down on the compute stream, after its
                # backward (and its re-gather)
                t_gpu += max(ch.bwd_s, up / hw.h2d_bytes_per_s) + down / hw.d2h_bytes_per_s
                arrival = t_gpu
            else:
                comm = max(up / hw.h2d_bytes_per_s, down / hw.d2h_bytes_per_s, (up + down) / 90e9)
                t_gpu += max(ch.bwd_s, comm)  # its backward, or its copies if longer
                arrival = t_gpu + down / hw.d2h_bytes_per_s
            done = max(done, arrival) + ch.numel * k
        assert parts["first_grad_s"] + parts["cpu_optim_s"] == pytest.approx(done, rel=1e-9)
        offloaded = sum(ch.numel for ch in prof.chunks[n_persist:])
        assert parts["cpu_optim_s"] == pytest.approx(offloaded * k, rel=1e-9)


def test_a_chunk_larger_than_the_chunk_size_needs_no_gradient_buffer():
    """A large vocabulary's embedding (a chunk of its own, larger than the chunk size) sends its
    gradient down as autograd made it, on the compute stream: offloading it adds no device
    gradient buffers of its size (two of them before), and its copy adds to backward."""
    from protrain_fx.plan.cost_model import LayoutCosts

    cap = 64 * MiB // 4
    chunks = (
        ChunkProfile(numel=5 * cap, fwd_s=1e-3, bwd_s=2e-3),  # the embedding: 320 MiB
        ChunkProfile(numel=cap, fwd_s=2e-3, bwd_s=4e-3, blocks=(0,)),
        ChunkProfile(numel=cap, fwd_s=2e-3, bwd_s=4e-3, blocks=(0,)),
    )
    block = BlockProfile(fwd_s=4e-3, bwd_s=8e-3, keep_bytes=10 * MiB, input_bytes=MiB)
    prof = GraphProfile(chunk_size=64 * MiB, chunks=chunks, blocks=(block,))
    lc = LayoutCosts(prof, HW, 1, 0, 0)
    # only the block's chunks offloaded: two gradient buffers of the chunk size
    # everything offloaded: still two of the chunk size, none of the embedding's
    assert lc.grad_numel[1] == lc.grad_numel[0] == cap
    assert lc.buffer_numel[0] == 5 * cap  # the transfer buffer holds it (bf16: half the bytes)
    # everything offloaded: one bf16 transfer buffer of the embedding's size, two fp32 gradient
    # buffers of the chunk size (not of the embedding's: 2 x 320 MiB before), the activations
    buffers = 5 * cap * 2 + 2 * cap * 4
    assert lc.peak_bytes(0) == math.ceil((buffers + 10 * MiB) * prof.fragmentation)
    # offloaded, its backward waits for its re-gather (up) and its gradient's copy down is serial
    # with backward (320 MiB at 50 GB/s), where resident it was its 2 ms of compute
    _, parts = lc.time_s(0, detail=True)
    _, parts1 = lc.time_s(1, detail=True)
    assert parts["bwd_s"] - parts1["bwd_s"] == pytest.approx(
        max(2e-3, 5 * cap * 2 / HW.h2d_bytes_per_s)
        + 5 * cap * 4 / HW.d2h_bytes_per_s
        + 5 * cap * (4 + 2 + 4 * 2) / (HW.gpu_adam_params_per_s * 28)  # its pack and gathers
        - 2e-3,
        rel=1e-6,
    )


@SETTINGS
@given(profs=profiles(), n_buffer=st.integers(1, 3), slowdown=st.sampled_from([1.0, 1.05, 1.2]))
def test_a_busy_device_runs_its_compute_at_the_sustained_clock(profs, n_buffer, slowdown):
    """Forward and backward are scaled by the clock under sustained load, by the step's busy share:
    not at all up to THROTTLE_BUSY_FROM, fully when the device never waits; the CPU's and the
    device optimizer's terms are left as they were."""
    from protrain_fx.plan.cost_model import LayoutCosts
    from protrain_fx.plan.profiles import THROTTLE_BUSY_FROM

    prof = profs[0]
    base = LayoutCosts(prof, HW, n_buffer, 0, 0)
    hot = LayoutCosts(prof, dataclasses.replace(HW, sustained_slowdown=slowdown), n_buffer, 0, 0)
    for n_persist in range(len(prof.chunks) + 1):
        t0, p0 = base.time_s(n_persist, detail=True)
        t1, p1 = hot.time_s(n_persist, detail=True)
        busy = (p0["fwd_s"] + p0["bwd_s"]) / t0
        ramp = min(1.0, max(0.0, (busy - THROTTLE_BUSY_FROM) / (1 - THROTTLE_BUSY_FROM)))
        f = 1 + (slowdown - 1) * ramp
        assert p0["clock_slowdown"] == 1.0
        assert p1["clock_slowdown"] == pytest.approx(f)
        assert p1["fwd_s"] == pytest.approx(p0["fwd_s"] * f)
        assert p1["bwd_s"] == pytest.approx(p0["bwd_s"] * f)
        assert p1["cpu_optim_s"] == p0["cpu_optim_s"] and p1["gpu_optim_s"] == p0["gpu_optim_s"]
        # never faster, and never more than the whole step scaled
        assert t0 <= t1 <= t0 * f * (1 + 1e-12)
        if busy >= 1 - 1e-9:  # nothing but compute: the step scales with it
            assert t1 == pytest.approx(t0 * slowdown)


@SETTINGS
@given(
    profs=profiles(),
    budget_mib=st.integers(100, 12000),
    host_mib=st.integers(1, 40 * 1024),
    hw=st.sampled_from([HW, HW2]),
)
def test_the_host_floor_before_profiling_never_refuses_a_plan_the_search_finds(
    profs, budget_mib, host_mib, hw
):
    """check_host_floor (autoplan runs it before profiling) is a bound: whenever the search finds
    a plan under the device and host budgets, the floor lets it through."""
    from protrain_fx.plan.search import check_host_floor

    budget, host = budget_mib * MiB, host_mib * MiB
    try:
        found = search(profs, hw, budget, host).best
    except NoPlanFits:
        return
    prof = next(p for p in profs if p.chunk_size == found.knobs.chunk_size)
    param_bytes = sum(c.numel for c in prof.chunks) * prof.master_elem
    check_host_floor(param_bytes, budget, host, hw.world_size)


def test_the_host_floor_names_the_device_budget_that_could_fit():
    """1 GiB of parameters, a 64 MiB device budget, 100 MiB of host: refused before profiling,
    with the budget below which no plan fits; at that budget the floor passes."""
    from protrain_fx.plan.search import check_host_floor

    with pytest.raises(NoPlanFits) as info:
        check_host_floor(2**30, 64 * MiB, 100 * MiB, 1)
    err = info.value
    assert "before profiling" in str(err) and "host memory" in str(err)
    assert err.min_host_bytes > 100 * MiB
    check_host_floor(2**30, err.min_device_bytes, 100 * MiB, 1)
    with pytest.raises(NoPlanFits):
        check_host_floor(2**30, err.min_device_bytes - 4 * MiB, 100 * MiB, 1)
    check_host_floor(2**30, 64 * MiB, 4 * 2**30, 1)  # a host large enough: no refusal
