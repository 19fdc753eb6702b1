"""The min-cut partition of a recomputed block keeps RNG-state plumbing out of attention that draws
no random numbers (``_compat.min_cut_partition`` / ``unseeded_while``): SDPA with ``dropout_p`` 0,
recomputed in backward, gets no ``run_and_save_rng_state`` / ``run_with_rng_state`` (on CUDA
``graphsafe_run_with_rng_state``, which Inductor's FX graph cache refuses, so every recomputed block
was compiled again in every run), its ops are the ATen ops again after the partition, and the
gradients equal eager's; with ``dropout_p > 0`` the partitioner still threads the RNG state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx import _compat

RNG_HOPS = ("run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state")


def _partitioned(dropout_p: float):
    graphs = {}

    def partition(joint, joint_inputs, **kwargs):
        for node in joint.graph.nodes:  # recompute every forward op, as the recompute pass does
            if node.op == "call_function" and not any(
                "tangents" in str(a) for a in node.all_input_nodes
            ):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta["ac_graph_id"] = 0
        fw, bw = _compat.min_cut_partition(joint, joint_inputs, **kwargs)
        graphs["joint"], graphs["fw"], graphs["bw"] = joint, fw, bw
        return fw, bw

    def compiler(gm, _):
        return make_boxed_func(gm.forward)

    def attn(q, k, v, w):
        x = torch.tanh(q @ w)
        return F.scaled_dot_product_attention(x, k, v, dropout_p=dropout_p, is_causal=True)

    return aot_function(attn, compiler, compiler, partition_fn=partition), attn, graphs


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, requires_grad=True) for _ in range(3))
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    return q, k, v, w


def _hops(gm):
    return [str(n.target) for n in gm.graph.nodes if any(h in str(n.target) for h in RNG_HOPS)]


def test_recomputed_attention_without_dropout_gets_no_rng_state():
    compiled, attn, graphs = _partitioned(0.0)
    inputs = _inputs()
    out = compiled(*inputs)
    out.square().sum().backward()
    got = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    attn(*inputs).square().sum().backward()
    for a, b in zip(got, (t.grad for t in inputs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not _hops(graphs["fw"]) and not _hops(graphs["bw"])
    sdpa = [
        n
        for g in graphs.values()
        for n in g.graph.nodes
        if "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)
    ]
    # recomputed: in the joint, the forward and the backward, as the ATen op again
    assert len(sdpa) == 3 and all(isinstance(n.target, torch._ops.OpOverload) for n in sdpa)
    assert "unseeded" not in graphs["fw"].code + graphs["bw"].code


def test_recomputed_attention_with_dropout_keeps_its_rng_state():
    compiled, _, graphs = _partitioned(0.25)
    compiled(*_inputs()).sum().backward()
    assert _hops(graphs["fw"]) and _hops(graphs["bw"])


def test_hf_llama_with_sdpa_recomputed_and_offloaded_trains_like_eager(tmp_path):
    """Hugging Face's Llama with its default SDPA attention, every block recomputed and every chunk
    offloaded, under Inductor: eager's losses and weights, and no RNG state in the graphs."""
    from hf_models import LossOnly, hf_llama

    from protrain_fx.testing import compare_with_eager, random_batches

    base = LossOnly(hf_llama(num_hidden_layers=3, attn_implementation="sdpa"))
    r = compare_with_eager(
        base,
        random_batches(3, 2, 16, vocab=512),
        {"compiler": "inductor", "n_persist": 0, "n_checkpoint": 3, "dump_dir": str(tmp_path)},
        give_optimizer=True,
    )
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 5e-5, (r.losses, r.ref_losses)
    assert r.max_param_update > 1e-4
    code = "".join(p.read_text() for p in tmp_path.rglob("*.py") if p.name in ("fw.py", "bw.py"))
    assert "scaled_dot_product" in code
    assert not any(h in code for h in RNG_HOPS)
