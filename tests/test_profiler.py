"""profiler.saved_bytes_by_block: what forward keeps per block, keep and recompute, from two
partitions."""

import pytest
import torch
from models import GPT, GPTConfig

import protrain_fx
from protrain_fx import _compat, backend, pipeline
from protrain_fx.graph.fx import saved_activation_bytes
from protrain_fx.profiling.static import saved_bytes_by_block


@pytest.mark.usefixtures("whole_graph")
def test_saved_bytes_by_block(monkeypatch):
    seen = {}
    partition, run_stage = backend.GraphCompiler.partition, pipeline.run_stage

    def capture_inputs(self, joint, joint_inputs, **kw):
        seen["partition"] = lambda g: _compat.min_cut_partition(g, joint_inputs, **kw)
        return partition(self, joint, joint_inputs, **kw)

    # inside the compile, where it can partition
    def probe_after_joint_passes(stage, gm, plan, dump=None):
        gm = run_stage(stage, gm, plan, dump)
        if stage == "joint":
            seen["bytes"] = saved_bytes_by_block(gm, len(plan.blocks), seen["partition"])
            seen["total"] = saved_activation_bytes(gm, seen["partition"])
        return gm

    monkeypatch.setattr(backend.GraphCompiler, "partition", capture_inputs)
    monkeypatch.setattr(pipeline, "run_stage", probe_after_joint_passes)
    torch.manual_seed(0)
    batch, seq, width = 2, 32, 64
    model = GPT(
        GPTConfig(
            n_layer=4, n_embd=width, n_head=4, vocab_size=256, block_size=seq, tie_embeddings=False
        )
    )
    compiled = torch.compile(model, backend="protrain", options={"compiler": "eager"})
    x = torch.randint(0, 256, (batch, seq))
    compiled(x, x).backward()
    sb = seen["bytes"]
    assert len(sb.keep) == len(sb.recompute) == 4
    assert len(set(sb.keep)) == 1  # identical blocks keep identical bytes
    # a recomputed block restarts from its input: the fp32 residual stream, nothing else
    assert sb.recompute == [batch * seq * width * 4] * 4
    assert sb.keep[0] > 10 * sb.recompute[0]
    # the same partition the planner sizes by
    assert sum(sb.keep) + sb.nonblock_keep == seen["total"]
    assert sb.nonblock_keep > 0 and sb.nonblock_recompute > 0


@pytest.mark.usefixtures("whole_graph")
def test_identical_blocks_share_the_fastest_time(monkeypatch):
    """A GPT's blocks have one signature (same ops, same FLOPs), so a stall that slowed some of them
    in the profiled step does not reach the cost model: every block gets the fastest one's times.
    Blocks that differ keep their own."""
    from protrain_fx.profiling.profiler import StepProfile, identical_block_times
    from protrain_fx.profiling.static import SavedBytes, StaticProfile, block_signatures

    seen = {}
    partition = backend.GraphCompiler.partition

    def capture(self, joint, joint_inputs, **kw):
        seen["fw"], seen["bw"] = fw, bw = partition(self, joint, joint_inputs, **kw)
        seen["n_blocks"] = len(self.plan.blocks)
        return fw, bw

    monkeypatch.setattr(backend.GraphCompiler, "partition", capture)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            n_layer=6, n_embd=64, n_head=4, vocab_size=256, block_size=32, tie_embeddings=False
        )
    )
    compiled = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "n_checkpoint": 4}
    )
    x = torch.randint(0, 256, (2, 32))
    compiled(x, x).backward()
    sigs = block_signatures(seen["fw"], seen["bw"], seen["n_blocks"])
    assert len(sigs) == 6 and sigs[0][0][0] > 0  # forward FLOPs counted
    # recomputed blocks alike, kept blocks alike
    assert sigs[0] == sigs[1] == sigs[2] and sigs[4] == sigs[5]
    # recomputation shows in backward; the last recomputed block restarts next to a kept one (the
    # partitioner saves differently at that boundary): signatures of their own
    assert len({sigs[0], sigs[3], sigs[4]}) == 3

    def step(fwd, bwd):
        return StepProfile(fwd, bwd, 0.0, 0.0, 0, 0, None, 0.0)

    static = StaticProfile(SavedBytes([1] * 6, [1] * 6, 0, 0), [1.0] * 6, sigs)
    fwd, bwd = identical_block_times(
        step([1.0, 3.0, 2.0, 7.0, 2.0, 1.5], [4.0, 3.0, 5.0, 8.0, 5.0, 9.0]), static
    )
    assert fwd == [1.0, 1.0, 1.0, 7.0, 1.5, 1.5] and bwd == [3.0, 3.0, 3.0, 8.0, 5.0, 5.0]
    # no signatures: times as measured
    unknown = StaticProfile(static.saved, static.recomputed_share)
    assert identical_block_times(step([1.0, 3.0, 2.0, 1.5, 1.0, 1.0], [4.0] * 6), unknown)[0] == [
        1.0,
        3.0,
        2.0,
        1.5,
        1.0,
        1.0,
    ]


def test_an_offloaded_chunk_is_priced_no_faster_than_the_profiled_host_queued_it():
    """The profiled step times the kernels with the host kept ahead (a spin before every mark), and
    beside them what the host took to queue each block, the marks' and copies' own work left out.
    Every chunk is offloaded there, so that host time holds the gathers' bookkeeping: an offloaded
    chunk's forward is priced no faster than it, a resident one's at its kernels (on an H100 the
    1B shape at 4 x 1024 queued 1.9-2.1 ms a block against 1.12 ms of kernels; with every chunk
    resident its forward ran at the kernels' pace, with 27 of 66 offloaded at the host's). The
    plan summary says when the host was the slower."""
    from protrain_fx.plan.cost_model import predict
    from protrain_fx.plan.plan import _host_bound_lines
    from protrain_fx.plan.profiles import Hardware, Knobs
    from protrain_fx.profiling.profiler import StepProfile, graph_profile
    from protrain_fx.profiling.static import SavedBytes, StaticProfile
    from protrain_fx.runtime import block_timer as bt

    # marks as the profiled step makes them (times in seconds): block 0's forward with a copy
    # bracketed inside, then the spin queued by the exit mark (after its call: not counted)
    M = bt.Mark
    marks = [
        M(0, bt.FWD_ENTER, 0.0, 0, 0, host=0.0, host_end=0.1),
        M(bt.STEP, bt.COPY_START, 0.2, 0, 0, host=0.3, host_end=0.35),
        M(bt.STEP, bt.COPY_END, 0.4, 0, 0, host=0.5, host_end=0.55),
        M(bt.STEP, bt.COPY_START, 1.0, 0, 0, host=1.02, host_end=1.03),
        M(bt.STEP, bt.COPY_END, 1.5, 0, 0, host=1.04, host_end=1.05),
        M(0, bt.FWD_EXIT, 1.6, 0, 0, host=1.0, host_end=1.1),
    ]
    t = bt.block_timings(marks)[0]
    assert t["fwd_host_ms"] == pytest.approx((1.0 - 0.1 - (0.55 - 0.3)) * 1e3)
    assert t["fwd_ms"] == pytest.approx((1.6 - 0.2 - 0.5) * 1e3)  # the copies' device time out
    # over the step, block marks lie inside: each one's span holds its spin, left out once
    marks.append(M(bt.STEP, bt.FWD_END, 2.0, 0, 0, host=2.0, host_end=2.1))
    marks.insert(0, M(bt.STEP, bt.STEP_START, 0.0, 0, 0, host=-0.2, host_end=-0.1))
    assert bt._host_interval_ms(marks, 0, len(marks) - 1) == pytest.approx(
        (2.0 + 0.1 - 0.1 - (0.55 - 0.3) - 0.1) * 1e3
    )

    n = 4
    static = StaticProfile(SavedBytes([10] * n, [1] * n, 0, 0), [1.0] * n, [("b",)] * n)

    def profile(host_fwd: list):
        step = StepProfile(
            [0.002] * n, [0.006] * n, 0.001, 0.002, 1000, 0, None, 0.0,
            block_fwd_host_s=host_fwd, block_bwd_host_s=[0.009] * len(host_fwd),
        )  # fmt: skip
        params = [(f"p{i}", 4 * 10**6, i) for i in range(n)]  # a chunk per block
        return graph_profile(
            step, static, params, 4 * 10**6, master_elem=4, transfer_elem=2, resident_cast_elem=0
        )

    fast, slow = profile([]), profile([0.001, 0.003, 0.005, 0.004])
    assert slow.blocks == fast.blocks  # blocks keep the kernels' times
    # each chunk: the group's median host time, 3.5 ms, against 2 ms of kernels
    assert [c.host_fwd_s for c in slow.chunks] == pytest.approx([0.0035] * n)
    assert [c.host_fwd_s for c in fast.chunks] == [0.0] * n
    hw = Hardware(50e9, 50e9, 90e9, 4e9, 120e9)

    def parts(prof, n_persist):
        return predict(prof, hw, Knobs(prof.chunk_size, n_persist, 1, 0, 0)).breakdown

    # all resident: the kernels' pace either way; backward never priced at the host's
    assert parts(slow, n)["fwd_s"] == parts(fast, n)["fwd_s"] == pytest.approx(4 * 0.002 + 0.001)
    assert parts(slow, 0)["bwd_s"] == pytest.approx(parts(fast, 0)["bwd_s"])
    # two offloaded: 3.5 ms each (their 0.16 ms copies hide)
    assert parts(slow, 2)["fwd_s"] == pytest.approx(2 * 0.002 + 2 * 0.0035 + 0.001)
    assert parts(fast, 2)["fwd_s"] == pytest.approx(4 * 0.002 + 0.001)
    # a short copy's profile widened to the full graph (graph/shorten.py) carries the host's too
    from protrain_fx.profiling.profiler import expand_profile

    short = StepProfile(
        [0.002, 0.003], [0.006, 0.007], 0.001, 0.002, 1000, 0, None, 0.0,
        block_fwd_host_s=[0.004, 0.005], block_bwd_host_s=[0.01, 0.011],
    )  # fmt: skip
    two = StaticProfile(SavedBytes([10, 11], [1, 2], 0, 0), [1.0, 1.0], [("a",), ("b",)])
    wide, wide_static = expand_profile(short, two, [0, 1, 1, 1])
    assert wide.block_fwd_host_s == [0.004, 0.005, 0.005, 0.005]
    assert wide.block_bwd_host_s == [0.01, 0.011, 0.011, 0.011]
    params = [(f"p{i}", 4 * 10**6, i) for i in range(n)]
    widened = graph_profile(
        wide, wide_static, params, 4 * 10**6, master_elem=4, transfer_elem=2, resident_cast_elem=0
    )
    assert [c.host_fwd_s for c in widened.chunks] == [0.004, 0.005, 0.005, 0.005]
    line = _host_bound_lines({"block_fwd_host_ms": [3.5] * n, "block_fwd_ms": [2.0] * n})
    assert line and "forward in 14.0 ms" in line[0] and "ran 8.0 ms" in line[0]
    assert _host_bound_lines({"block_fwd_host_ms": [1.0] * n, "block_fwd_ms": [2.0] * n}) == []


def test_a_resident_parameter_saved_for_backward_is_no_block_activation(monkeypatch):
    """Forward saves views of resident parameters for backward (an HF Llama's regions keep
    ``t(t(weight))`` of projections): no memory of their own, and the cost model prices resident
    chunks itself. A graph profiled beside an earlier graph's placement (a new sequence length
    after a plan that keeps the embedding and block 0's first chunk resident) counted them as
    block 0's activations, 96 KiB over the others' (the same block), so it was priced higher than
    profiled with every chunk offloaded, as a first plan is, and could refuse budgets that fit."""
    from hf_models import HF_VOCAB, hf_llama, hf_loss

    from protrain_fx import autoplan
    from protrain_fx.profiling.profiler import graph_profile

    kept = []

    def spy(step, static, *args, **kw):
        kept.append(static.saved.keep)
        return graph_profile(step, static, *args, **kw)

    monkeypatch.setattr(autoplan, "graph_profile", spy)
    model = hf_llama()
    opt = torch.optim.AdamW(model.parameters())
    options = {"compiler": "eager", "memory_budget": 3_000_000, "optimizer": opt}
    compiled = torch.compile(model, backend="protrain", dynamic=False, options=options)
    for seq in (16, 24):
        kept.clear()
        hf_loss(compiled, torch.randint(0, HF_VOCAB, (2, seq))).backward()
        opt.step()
        opt.zero_grad()
        if seq == 16:
            placements = [c.placement for c in protrain_fx.get_plan(compiled).chunks]
            assert "device" in placements and "host" in placements, placements
        assert kept and all(len(set(k)) == 1 for k in kept), (seq, kept)  # the blocks are alike


def test_the_profiled_backward_holds_no_gradient_of_a_parameter_it_reaches():
    """The profiled step's backward drops a parameter's gradient as it comes, as the stores drop
    an offloaded chunk's: a chunk an earlier graph placed resident gives its parameters gradients
    in autograd's ``.grad``, which the measured peak would otherwise hold (the search prices
    resident gradients itself). The user's gradients are as they were afterwards."""
    from protrain_fx.profiling.profiler import profile_step

    w1, w2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    seen = []

    class Look(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(w1.grad)  # w1's gradient came before this node's backward
            return g

    def step(w1, w2, x):
        return (Look.apply(w2 * x).sum() * w1).sum()

    w1.grad = torch.full((4,), 7.0)
    profile_step(step, [w1, w2, torch.ones(4)], [], 0, torch.device("cpu"))
    assert len(seen) == 3 and all(g is None for g in seen), seen  # warm-up and two timed runs
    assert torch.equal(w1.grad, torch.full((4,), 7.0)) and w2.grad is None
