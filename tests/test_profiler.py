"""profiler.saved_bytes_by_block: what forward keeps per block, keep and recompute, from two
partitions."""

import pytest
import torch
from models import GPT, GPTConfig

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
