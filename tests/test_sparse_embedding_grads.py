"""An offloaded embedding's gradient leaves the device as its lookup's rows
(passes/sparse_embedding_grads.py): no table of the vocabulary's size in the backward graph, the
rows added into the table on the host, and training exactly like eager PyTorch's (tied or untied,
eager or Inductor, a padding index; with accumulation and clipping:
tests/test_oversized_chunks.py)."""

import pytest
import torch
from hf_models import BIG_VOCAB, big_vocab_llama

from protrain_fx import pipeline
from protrain_fx.runtime import ops
from protrain_fx.testing import compare_with_eager, random_batches

VOCAB = BIG_VOCAB
TABLE_OPS = ("embedding_dense_backward", "_unsafe_masked_index_put_accumulate")


def joint_graphs():
    """Record each compiled joint graph's ops after the joint passes."""
    seen = []

    def record(gm, plan):
        seen.append(gm.graph)
        return gm

    return seen, pipeline.probe("joint", record)


def probed_run(tied: bool, options: dict, steps: int = 3):
    """The big-vocabulary Llama trained against eager, and its joint graphs after the passes."""
    seen, probe = joint_graphs()
    with probe:
        r = compare_with_eager(
            big_vocab_llama(tied),
            random_batches(steps, 2, 16, vocab=VOCAB),
            options,
            give_optimizer=True,
        )
    return r, seen


def table_ops(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if any(t in str(n.target) for t in TABLE_OPS)]


def rows_calls(graph) -> list:
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target is ops.CHUNK_GRAD and len(n.args) == 5
    ]


@pytest.mark.parametrize(
    "tied,compiler,whole",
    [
        (True, "eager", False),
        (False, "eager", False),
        (True, "eager", True),  # the tied head's gradient, the dense part, in the same graph
        (True, "inductor", True),
        (False, "inductor", False),
    ],
)
def test_offloaded_embedding_gradient_goes_as_rows_and_trains_like_eager(
    tied, compiler, whole, monkeypatch
):
    if whole:
        monkeypatch.setenv("PROTRAIN_REGIONS", "0")
    r, seen = probed_run(tied, {"compiler": compiler, "n_persist": 0})
    # Inductor's kernels are not bit-exact against eager's (1e-8 per op, grown by Adam)
    param_tol = 1e-5 if compiler == "eager" else 1e-4
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= param_tol and r.max_param_update > 1e-3
    # the table is built nowhere, one chunk_grad hands over rows (the embedding's; in a whole
    # graph a tied one with the head's dense part; in regions the head's region hands that over
    # on its own)
    calls = [c for g in seen for c in rows_calls(g)]
    assert len(calls) == 1 and not any(table_ops(g) for g in seen), [table_ops(g) for g in seen]
    assert len(calls[0].args[0]) == (1 if tied and whole else 0)
    assert any("lookup's rows" in n for n in r.plan.notes), r.plan.notes


def _older_embedding_backward(grad_output, indices, num_weights, padding_idx, scale):
    """``embedding_dense_backward`` as older torch decomposed it: the rows masked beforehand, then
    accumulated into a zero table with ``_unsafe_index_put``."""
    indices = indices.to(torch.long)
    grad = grad_output.masked_fill((indices == padding_idx).unsqueeze(-1), 0)
    table = grad_output.new_zeros((num_weights,) + grad_output.shape[indices.ndim :])
    return torch.ops.aten._unsafe_index_put(table, [indices], grad, accumulate=True)


@pytest.mark.parametrize("tied", [True, False])
def test_the_table_of_an_older_decomposition_goes_as_rows_too(tied, monkeypatch):
    """Whatever form Inductor's decomposition gives the table (an accumulating index put into
    zeros, as older torch builds it), the rows go instead and training is eager's."""
    import torch._inductor.decomposition as inductor_decomp

    monkeypatch.setattr(
        inductor_decomp, "decomp_embedding_dense_backward", _older_embedding_backward
    )
    r, seen = probed_run(tied, {"compiler": "inductor", "n_persist": 0})
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-4 and r.max_param_update > 1e-3
    puts = [str(n.target) for g in seen for n in g.nodes if "index_put" in str(n.target)]
    assert not puts and len([c for g in seen for c in rows_calls(g)]) == 1, puts
    assert any("lookup's rows" in n for n in r.plan.notes), r.plan.notes


def test_a_resident_embedding_keeps_autograd_s_gradient():
    r, seen = probed_run(True, {"compiler": "eager", "n_persist": 1}, steps=2)
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-5
    assert not any(rows_calls(g) for g in seen)


class PaddedLM(torch.nn.Module):
    """An embedding with a padding index (its row gets no gradient) before two blocks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 64, padding_idx=3)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return torch.nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten() % 8)


def test_a_padding_index_gets_no_gradient_as_in_eager():
    data = random_batches(3, 2, 16, vocab=VOCAB)
    data = [(torch.where(x % 4 == 0, 3, x), y) for x, y in data]  # a quarter are padding
    seen, probe = joint_graphs()
    with probe:
        r = compare_with_eager(
            PaddedLM(), data, {"compiler": "eager", "n_persist": 0}, give_optimizer=True
        )
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-5
    assert [len(rows_calls(g)) for g in seen] and sum(len(rows_calls(g)) for g in seen) == 1
    # the padding row never moved (AdamW's decay aside: weight_decay scales it, no gradient step)
    pad_ref = r.ref.emb.weight.detach()[3]
    pad_mine = r.model.state_dict()["emb.weight"][3]
    assert torch.allclose(pad_mine, pad_ref, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_the_profile_knows_a_tied_table_s_gradient_came_as_rows(tied, monkeypatch):
    """The profiling step (every chunk offloaded) sends the table's gradient as rows, so it never
    holds the dense table a resident chunk's backward builds. For a tied table, whose gradient
    holds the head's part by then, that is one table more at the end of backward: the profile
    says so (``StepProfile.tied_row_tables``: the table's fp32 bytes), and the cost model counts it
    where the chunk is resident. An untied table's dense gradient is its gradient: nothing more."""
    from protrain_fx import autoplan

    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
    seen = []
    real = autoplan.profile_frugal

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out[0])
        return out

    monkeypatch.setattr(autoplan, "profile_frugal", spy)
    model = big_vocab_llama(tied)
    budget = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    r = compare_with_eager(
        model,
        random_batches(2, 2, 16, vocab=VOCAB),
        {"compiler": "eager", "memory_budget": budget},
        give_optimizer=True,
    )
    assert r.max_loss_rel <= 1e-5
    (step,) = seen
    table = model.lm.model.embed_tokens.weight
    want = {"lm.model.embed_tokens.weight": table.numel() * 4} if tied else {}
    assert step.tied_row_tables == want
