"""A user's Inductor joint_custom_pre_pass and post_grad_custom_post_pass still run under
backend="protrain"."""

import torch
from models import build
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from protrain_fx.testing import compare_with_eager, random_batches


class Probe(CustomGraphPass):
    """Records the graphs it sees; the post-grad probe also rewrites the graph (x * 1.0 is inserted
    after every mm, which must change nothing numerically but shows the user's rewrite reached
    Inductor)."""

    def __init__(self, tag, calls):
        self.tag, self.calls = tag, calls

    def __call__(self, graph: torch.fx.Graph):
        placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
        self.calls.append((self.tag, any("tangents" in p for p in placeholders), len(graph.nodes)))
        if self.tag == "post_grad":
            for n in list(graph.nodes):
                if n.op == "call_function" and n.target is torch.ops.aten.mm.default:
                    with graph.inserting_after(n):
                        one = graph.call_function(torch.ops.aten.mul.Tensor, (n, 1.0))
                    n.replace_all_uses_with(one, delete_user_cb=lambda u: u is not one)
                    one.meta.update(n.meta)

    def uuid(self):
        return (self.tag, get_hash_for_files((__file__,)))


def test_user_inductor_passes_run_and_training_stays_correct():
    calls = []
    torch.manual_seed(0)
    model = build("llama", n_layer=2, dim=32, n_head=2, n_kv_head=1, ffn_dim=64)
    with torch._inductor.config.patch(
        joint_custom_pre_pass=Probe("joint", calls),
        post_grad_custom_post_pass=Probe("post_grad", calls),
        fx_graph_cache=False,
    ):
        r = compare_with_eager(model, random_batches(3, 2, 8), {})
    tags = [(t, saw_tangents) for t, saw_tangents, _ in calls]
    assert ("joint", True) in tags  # the joint graph (it has tangents)
    # forward and backward graphs
    assert ("post_grad", False) in tags and ("post_grad", True) in tags
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-3
