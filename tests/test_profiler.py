"""profiler.saved_bytes_by_block: what forward keeps per block, keep and recompute, from two partitions."""
import torch
from models import GPT, GPTConfig

from protrain_fx import _compat, backend
from protrain_fx.planner import saved_activation_bytes
from protrain_fx.profiler import saved_bytes_by_block


def test_saved_bytes_by_block(monkeypatch):
    seen = {}
    partition, run_passes = backend.GraphCompiler.partition, backend.run_passes

    def capture_inputs(self, joint, joint_inputs, **kw):
        seen["partition"] = lambda g: _compat.min_cut_partition(g, joint_inputs, **kw)
        return partition(self, joint, joint_inputs, **kw)

    def probe_after_joint_passes(stage, gm, plan):  # inside the compile, where the partitioner can run
        gm = run_passes(stage, gm, plan)
        if stage == "joint":
            seen["bytes"] = saved_bytes_by_block(gm, len(plan.blocks), seen["partition"])
            seen["total"] = saved_activation_bytes(gm, seen["partition"])
        return gm

    monkeypatch.setattr(backend.GraphCompiler, "partition", capture_inputs)
    monkeypatch.setattr(backend, "run_passes", probe_after_joint_passes)
    torch.manual_seed(0)
    batch, seq, width = 2, 32, 64
    model = GPT(GPTConfig(n_layer=4, n_embd=width, n_head=4, vocab_size=256, block_size=seq, tie_embeddings=False))
    compiled = torch.compile(model, backend="protrain", options={"compiler": "eager"})
    x = torch.randint(0, 256, (batch, seq))
    compiled(x, x).backward()
    sb = seen["bytes"]
    assert len(sb.keep) == len(sb.recompute) == 4
    assert len(set(sb.keep)) == 1  # identical blocks keep identical bytes
    # a recomputed block restarts from its input: the fp32 residual stream, nothing else
    assert sb.recompute == [batch * seq * width * 4] * 4
    assert sb.keep[0] > 10 * sb.recompute[0]
    assert sum(sb.keep) + sb.nonblock_keep == seen["total"]  # the same partition the planner sizes by
    assert 0 < sb.nonblock_recompute <= sb.nonblock_keep
