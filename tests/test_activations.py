"""Block-wise activation management: keep, swap or recompute each block, interleaved, against
eager."""

import copy
import csv

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from models import build
from torch.utils.checkpoint import CheckpointPolicy

import protrain_fx
from protrain_fx import pipeline
from protrain_fx.passes import recompute as recompute_pass
from protrain_fx.runtime import ops, swap_pool
from protrain_fx.testing import compare_with_eager, random_batches, train_steps

LOSS_REL, PARAM_ABS = 1e-5, 1e-3
MUST_SAVE = CheckpointPolicy.MUST_SAVE


def model(kind, dropout=0.0):
    torch.manual_seed(0)
    if kind == "gpt":
        return build("gpt", n_layer=4, n_embd=32, n_head=2, block_size=32, dropout=dropout)
    return build("llama", n_layer=4, dim=32, n_head=2, n_kv_head=1, ffn_dim=64, max_seq_len=32)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["gpt", "llama"]), n_swap=st.integers(0, 4), n_checkpoint=st.integers(0, 4)
)
def test_every_swap_checkpoint_combination_matches_eager(kind, n_swap, n_checkpoint):
    torch._dynamo.reset()
    options = {"compiler": "eager", "n_swap": n_swap, "n_checkpoint": n_checkpoint}
    r = compare_with_eager(model(kind), random_batches(3, 2, 12), options)
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS
    # more than the graph has: it takes what it has, in order, and says so
    if n_swap + n_checkpoint > 4:
        assert any("asked for more blocks than the 4 detected" in n for n in r.plan.notes)
        n_swap, n_checkpoint = min(n_swap, 4), min(n_checkpoint, 4 - min(n_swap, 4))
    expect = (
        ["swap"] * n_swap + ["recompute"] * n_checkpoint + ["keep"] * (4 - n_swap - n_checkpoint)
    )
    assert [b["policy"] for b in r.plan.to_dict()["blocks"]] == expect
    assert (r.plan.to_dict()["n_swap"], r.plan.to_dict()["n_checkpoint"]) == (n_swap, n_checkpoint)
    assert bool(r.plan.swapped) == (n_swap > 0)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_dropout_matches_eager_checkpoint(compiler):
    """Recomputed blocks see the same dropout masks as forward, as torch.utils.checkpoint does."""
    base = model("gpt", dropout=0.1)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    for i in (1, 2):  # the eager reference checkpoints the same blocks
        blk = ref.blocks[i]
        blk.forward = lambda *a, _f=blk.forward: torch.utils.checkpoint.checkpoint(
            _f, *a, use_reentrant=False
        )
    data = random_batches(3, 2, 16)
    # Inductor's own RNG differs from eager's; fallback_random makes it draw the same numbers
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(
            mine, backend="protrain", options={"compiler": compiler, "n_swap": 1, "n_checkpoint": 2}
        )
        torch.manual_seed(1)
        losses = train_steps(mine, compiled, data)
    torch.manual_seed(1)
    ref_losses = train_steps(ref, ref, data)
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= LOSS_REL
    assert (
        max((p - q).abs().max().item() for p, q in zip(mine.parameters(), ref.parameters()))
        <= PARAM_ABS
    )
    no_dropout = train_steps(copy.deepcopy(model("gpt")), copy.deepcopy(model("gpt")), data[:1])
    assert abs(no_dropout[0] - ref_losses[0]) > 1e-4  # dropout really was active


def test_inductor_swap_and_recompute_with_offloaded_chunks():
    stats = swap_pool.swapper(torch.device("cpu")).stats
    before = dict(stats)  # the swapper is per process: other tests' copies are counted there too
    r = compare_with_eager(
        model("llama"),
        random_batches(3, 2, 16),
        {"n_swap": 1, "n_checkpoint": 2, "n_persist": 1, "chunk_size": "40KB"},
        give_optimizer=True,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS
    offloaded = stats["offloaded_bytes"] - before["offloaded_bytes"]
    assert offloaded == stats["reloaded_bytes"] - before["reloaded_bytes"] > 0


def _saved_bytes(monkeypatch, options):
    """Bytes the forward graph returns for backward: (on the compute device, in host memory)."""
    torch._dynamo.reset()
    seen = []

    def record(gm, plan):  # runs after the forward passes: sees what forward really returns
        seen.append((gm, plan))
        return gm

    with pipeline.probe("forward", record):
        m = model("llama")
        compiled = torch.compile(m, backend="protrain", options={"compiler": "eager", **options})
        compiled(*random_batches(1, 4, 32)[0]).backward()
    ((gm, plan),) = seen
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    saved = outputs[len(outputs) - len(plan.saved_names) :]
    device = host = 0
    for node in saved:
        val = node.meta.get("val") if node is not None else None
        if node is None or node.op == "placeholder" or not isinstance(val, torch.Tensor):
            continue
        nbytes = val.numel() * val.element_size()
        if node.target is ops.OFFLOAD:
            host += nbytes
        else:
            device += nbytes
    return device, host


@pytest.mark.usefixtures("whole_graph")
def test_recompute_and_swap_shrink_what_forward_keeps(monkeypatch):
    """All-recompute saves much less on the device than all-keep; all-swap moves the block
    activations to host memory. (The GPU benchmark measures the memory itself.)"""
    keep, keep_host = _saved_bytes(monkeypatch, {})
    recompute, _ = _saved_bytes(monkeypatch, {"n_checkpoint": 4})
    swap_device, swap_host = _saved_bytes(monkeypatch, {"n_swap": 4})
    assert keep_host == 0 and keep > 0
    assert recompute < 0.3 * keep, (recompute, keep)
    assert swap_device < 0.3 * keep and swap_host > 0.7 * keep, (swap_device, swap_host, keep)


def test_no_blocks_with_checkpoint_says_so():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))).sum()

    compiled = torch.compile(Plain(), backend="protrain", options={"n_checkpoint": 1})
    compiled(torch.randn(2, 8)).backward()
    plan = protrain_fx.get_plan(compiled)
    assert any("asked for more blocks than the 0 detected" in n for n in plan.notes), plan.notes


@pytest.mark.usefixtures("whole_graph")
def test_dumps_show_swap_and_recompute(tmp_path):
    m = model("gpt")
    compiled = torch.compile(
        m,
        backend="protrain",
        options={"compiler": "eager", "n_swap": 1, "n_checkpoint": 1, "dump_dir": str(tmp_path)},
    )
    train_steps(m, compiled, random_batches(1, 2, 8))
    (folder,) = tmp_path.iterdir()
    assert "protrain.offload" in (folder / "fw.py").read_text()
    bw = (folder / "bw.py").read_text()
    assert "protrain.reload_start" in bw and "protrain.reload_take" in bw
    with open(folder / "annotations.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    policies = {(r["block"], r["policy"]) for r in rows if r["stage"] == "joint" and r["block"]}
    assert {("blocks.0", "swap"), ("blocks.1", "recompute"), ("blocks.2", "keep")} <= policies
    # the recomputed block's forward nodes reappear in bw, tagged
    assert any(
        r["stage"] == "bw"
        and r["block"] == "blocks.1"
        and r["recompute"] == "must"
        and r["phase"] == "forward"
        for r in rows
    )


class _BufferBlock(torch.nn.Module):
    """A block that updates buffers in forward and reads them: a scale it grows (a step counter or
    EMA would do the same) and a BatchNorm's running statistics."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)
        self.bn = torch.nn.BatchNorm1d(d)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        self.scale.mul_(1.5)
        h = self.fc(self.norm(x))
        return x + self.scale * self.bn(h.flatten(0, 1)).view_as(h)


class BlockStack(torch.nn.Module):
    """An embedding, ``n`` blocks ``make_block(d)`` and a head; called ``(x, y)``, returns the
    loss."""

    def __init__(self, make_block, vocab=64, d=32, n=3):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab)
        self.blocks = torch.nn.ModuleList(make_block(d) for _ in range(n))

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("policy", ["n_checkpoint", "n_swap"])
def test_blocks_that_update_buffers_in_forward_recomputed_or_swapped(policy, monkeypatch):
    """A recomputed block that reads a buffer it updates: backward's recompute read the buffer as
    forward had left it (the scale grown once more), so the gradients were another function's
    (losses 1% off eager at the second step). Reads of a written input are saved instead;
    buffers, losses and parameters as eager's. A training-mode batch norm, which reads its
    running statistics only to update them, is still recomputed: nothing of an activation's size
    is saved in a recomputed block (its normalized output was)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    saved = []
    tag = recompute_pass.tag_blocks_for_recompute

    def tag_and_record(gm, blocks):
        tag(gm, blocks)
        must_save = [n for n in gm.graph.nodes if n.meta.get("recompute") == MUST_SAVE]
        saved.extend(n.meta["val"].numel() for n in must_save)

    monkeypatch.setattr(recompute_pass, "tag_blocks_for_recompute", tag_and_record)
    options = {"compiler": "eager", "n_persist": 0, policy: 3}
    data = random_batches(3, 2, 12, vocab=64)
    r = compare_with_eager(BlockStack(_BufferBlock), data, options, give_optimizer=True)
    assert [b["policy"] for b in r.plan.to_dict()["blocks"]] == [
        "recompute" if policy == "n_checkpoint" else "swap"
    ] * 3
    assert r.max_loss_rel <= 1e-6 and r.max_param_abs <= 1e-6 and r.max_param_update > 1e-3
    assert r.model.blocks[2].scale.item() == 1.5**3
    if policy == "n_checkpoint":  # the scale's update, batch counts, statistics: no activation
        assert saved and max(saved) <= 32, saved


class _TorchEncoder(torch.nn.Module):
    """torch's own ``nn.TransformerEncoder`` (batch first, pre-norm): its attention saves
    activations with permuted strides for backward."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab)
        layer = torch.nn.TransformerEncoderLayer(
            d, 4, 64, dropout=0.0, batch_first=True, norm_first=True
        )
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x, y):
        logits = self.head(self.enc(self.emb(x)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_swapped_activations_keep_their_strides(compiler):
    """A swapped block's saved activation comes back with the strides it was saved with: it came
    back contiguous, and the eager compiler's backward failed to view it ("view size is not
    compatible with input tensor's size and stride")."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = {"compiler": compiler, "n_persist": 0, "n_swap": 2}
    data = random_batches(3, 2, 12, vocab=64)
    r = compare_with_eager(_TorchEncoder(), data, options, give_optimizer=True)
    assert [b["policy"] for b in r.plan.to_dict()["blocks"]] == ["swap", "swap"]
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS
    assert r.max_param_update > 1e-3
