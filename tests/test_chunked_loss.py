"""The chunked head and loss (issue 24.2, passes/chunked_loss.py): cross-entropy over the output
projection's logits is computed a chunk of rows at a time, in forward and backward, with no change
to the model; the loss and gradients are eager's bit for bit (the fused op's loss within an ulp
where the CPU's BLAS rounds a chunk's matmul otherwise than the whole one's; its gradients, where
the logits' gradient is larger than a chunk, within fp32 rounding: backward sums over slices of the
vocabulary, which these tests force with 16 KiB chunks), and no tensor of the logits' full size
remains in the graphs of a model that returns the loss alone."""

import pytest
import torch
import torch.nn.functional as F
from hf_models import HF_VOCAB, LossOnly, hf_llama, offloaded

from protrain_fx.plan.plan import get_plan
from protrain_fx.runtime import loss_ops  # noqa: F401
from protrain_fx.runtime.chunk_store import store_of
from protrain_fx.testing import compare_with_eager, random_batches


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # 8 rows of a 512 vocabulary per chunk: the 32-token batches take 4 chunks
    monkeypatch.setenv("PROTRAIN_LOSS_CHUNK_BYTES", "16KiB")


# ------------------------------------------------------------------------------------- the ops
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fused", [False, True, "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_chunked_ops_give_eagers_loss_and_gradients(monkeypatch, reduction, fused, dtype):
    """fused=True: the fused op's backward over vocabulary slices (the logits' gradient, 37 x 50,
    larger than a chunk of 8 rows; slices of any width here, not multiples of 128 columns);
    "whole": chunks of 64 rows, where it is built whole."""
    monkeypatch.setattr(loss_ops, "SLICE_ALIGN", 1)
    g = torch.Generator().manual_seed(0)
    n, width, vocab = 37, 16, 50  # 37 rows in chunks of 8: a ragged last chunk
    # fp64: a model in fp64 (its projection and gradients in fp64, the loss in fp32 as eager's)
    like = torch.float64 if dtype == torch.float64 else torch.float32
    hidden = torch.randn(n, width, generator=g, dtype=like).requires_grad_()
    weight = torch.randn(vocab, width, generator=g, dtype=like).requires_grad_()
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::5] = -100
    ref = F.cross_entropy(
        (hidden.to(dtype) @ weight.to(dtype).t()).float(), target, reduction=reduction
    )
    want = torch.autograd.grad(ref, (hidden, weight))
    if fused:
        rows = 64 if fused == "whole" else 8
        loss, _, lse = torch.ops.protrain.linear_cross_entropy(
            hidden, weight, target, -100, reduction, rows, dtype
        )
        logits = (hidden.to(dtype) @ weight.to(dtype).t()).float()
        torch.testing.assert_close(lse, torch.logsumexp(logits, 1), rtol=1e-6, atol=1e-6)
    else:
        logits = hidden.to(dtype) @ weight.to(dtype).t()
        loss, _ = torch.ops.protrain.cross_entropy(logits, target, -100, reduction, 8)
    got = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32
    if not fused:  # eager's kernels a chunk at a time: bit for bit
        assert torch.equal(loss, ref)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    elif fused == "whole":  # a chunk's logits by a matmul of its rows, which some CPUs' BLAS
        # (AMD EPYC) rounds otherwise than the same rows of the whole matmul, by an ulp
        # (fp64: an fp64 ulp of a chunk's logits may move their fp32 cast by one)
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
        for a, b in zip(got, want):
            atol = 1e-6 * b.abs().max().item() if dtype == torch.float64 else 1e-7
            torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)
    else:  # a chunk's logits by a matmul of its rows, which some CPUs' BLAS (AMD EPYC) rounds
        # otherwise than the same rows of the whole matmul, by an ulp; backward over 6 slices of
        # the vocabulary (8 x 50 // 37 = 10 columns each, the last ragged): the hidden states'
        # gradient summed over them in fp32 and rounded once to the projection's dtype (bf16: an
        # element may round to the neighbouring value); an element that sums to almost nothing
        # is within a few ulps of the tensor's largest
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
        for a, b in zip(got, want):
            big = b.abs().max().item()
            if dtype != torch.bfloat16:  # fp64: the loss's fp32 rounding
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * big)
            else:
                torch.testing.assert_close(a, b, rtol=8e-3, atol=8e-3 * big)


def test_the_ops_pass_torchs_custom_op_checks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 7, generator=g, requires_grad=True)
    target = torch.randint(0, 7, (9,), generator=g)
    torch.library.opcheck(torch.ops.protrain.cross_entropy.default, (logits, target, -1, "mean", 4))
    hidden = torch.randn(9, 5, generator=g, requires_grad=True)
    weight = torch.randn(7, 5, generator=g, requires_grad=True)
    torch.library.opcheck(
        torch.ops.protrain.linear_cross_entropy.default,
        (hidden, weight, target, -1, "sum", 4, torch.float32),
    )


# --------------------------------------------------------------------------------- the models
class LossAndLogits(torch.nn.Module):
    """Hugging Face's output as the model returns it: loss and logits (the logits stay)."""

    def __init__(self, lm, num_items=None):
        super().__init__()
        self.lm = lm
        self.num_items = num_items

    def forward(self, x, y):
        kw = {} if self.num_items is None else {"num_items_in_batch": self.num_items}
        out = self.lm(input_ids=x, labels=x, use_cache=False, **kw)
        self.last_logits = out.logits.detach()
        return out.loss


class HandWritten(torch.nn.Module):
    """A hand-written head and loss with ``ignore_index=-1`` and an untied, bias-free head."""

    def __init__(self, vocab=HF_VOCAB, width=64, reduction="mean", label_smoothing=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU()
            )
            for _ in range(4)
        )
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.reduction, self.label_smoothing = reduction, label_smoothing

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        logits = self.head(h)
        y = y.clone()
        y[:, ::3] = -1
        return F.cross_entropy(
            logits.view(-1, logits.shape[-1]),
            y.view(-1),
            ignore_index=-1,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


def rewrite_notes(plan) -> list[str]:
    return [n for n in plan.notes if n.startswith("cross-entropy over")]


def close_to_eager(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within fp32 rounding, after steps whose gradients came from the fused op's backward (over
    vocabulary slices: eager's within fp32 rounding, which AdamW's first steps amplify where a
    gradient is near zero)."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def params_close_to_eager(mine, ref, base) -> None:
    """``mine``'s parameters within 3% of the largest update eager's steps made from ``base``."""
    b, r = base.state_dict(), ref.state_dict()
    update = max((r[k] - b[k]).abs().max().item() for k in r)
    diff = max((v.cpu() - r[k]).abs().max().item() for k, v in mine.state_dict().items())
    assert update > 1e-3 and diff <= 0.03 * update, (diff, update)


@pytest.mark.parametrize(
    "case",
    [
        "hf-tied-loss-only",  # untied and fused: under Inductor and autocast below
        "hf-loss-and-logits",
        "hf-num-items",
        "hand-written",
    ],
)
def test_models_train_like_eager_with_the_chunked_loss_and_offloaded_chunks(case):
    if case == "hf-tied-loss-only":
        model, fused = LossOnly(hf_llama()), True
    elif case == "hf-loss-and-logits":
        model, fused = LossAndLogits(hf_llama()), True
    elif case == "hf-num-items":  # reduction="sum", divided by the trainer's token count
        model, fused = LossAndLogits(hf_llama(tie_word_embeddings=False), num_items=29), True
    else:
        model, fused = HandWritten(reduction="sum"), True
    r = compare_with_eager(
        model,
        random_batches(2, 2, 16, vocab=HF_VOCAB),
        {"compiler": "eager", "n_persist": 0},
        give_optimizer=True,
    )
    notes = rewrite_notes(r.plan)
    assert len(notes) == 1 and "in chunks of 8 rows" in notes[0]
    assert ("head and loss fused" in notes[0]) == fused
    # forward: eager's kernels chunk by chunk (the same losses); backward over vocabulary slices,
    # whose gradients are eager's within fp32 rounding (test above), which AdamW's first steps
    # amplify where a gradient is near zero: the parameters within 3% of an update
    assert r.max_loss_rel <= 1e-6 and r.max_param_update > 1e-3
    assert r.max_param_abs <= 0.03 * r.max_param_update
    if case == "hf-loss-and-logits":  # the logits the model returns are eager's
        x = random_batches(1, 2, 16, vocab=HF_VOCAB, seed=5)[0][0]
        with torch.no_grad():
            r.compiled(x, x)
            r.ref(x, x)
        close_to_eager(r.compiled.last_logits, r.ref.last_logits)


def test_the_chunked_loss_with_inductor_and_autocast_matches_eager():
    r = compare_with_eager(
        LossOnly(hf_llama(tie_word_embeddings=False)),
        random_batches(2, 2, 16, vocab=HF_VOCAB),
        {"compiler": "inductor", "n_persist": 0},
        give_optimizer=True,
        autocast_dtype=torch.bfloat16,
    )
    assert len(rewrite_notes(r.plan)) == 1
    # bf16: Inductor's fused kernels round unlike eager's (as without the pass)
    assert r.max_loss_rel <= 2e-2 and r.max_param_update > 1e-3


def test_what_is_not_exact_to_rewrite_stays_eagers():
    r = compare_with_eager(
        HandWritten(label_smoothing=0.1),
        random_batches(2, 2, 16, vocab=HF_VOCAB),
        {"compiler": "eager", "n_persist": 0},
        give_optimizer=True,
    )
    assert rewrite_notes(r.plan) == [] and r.max_loss_rel == 0.0


def _logits_sized_nodes(monkeypatch, model, step) -> tuple[list, object]:
    """Compile ``model`` (eager compiler, every chunk offloaded), run ``step(compiled, x)`` on 32
    tokens, and return the (stage, node) of every node the backend's graphs hold of the logits' size
    (32 x HF_VOCAB), and the plan."""
    from protrain_fx import pipeline

    run_stage = pipeline.run_stage
    seen = []

    def spy(stage, gm, plan, dump):
        gm = run_stage(stage, gm, plan, dump)
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            for v in val if isinstance(val, (list, tuple)) else [val]:
                if (
                    isinstance(v, torch.Tensor)
                    and v.numel() == 32 * HF_VOCAB
                    and HF_VOCAB in v.shape
                ):
                    seen.append((stage, n.name))
        return gm

    monkeypatch.setattr(pipeline, "run_stage", spy)
    compiled = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "n_persist": 0}
    )
    step(compiled, random_batches(1, 2, 16, vocab=HF_VOCAB)[0][0])
    monkeypatch.setattr(pipeline, "run_stage", run_stage)
    return seen, get_plan(compiled)


def test_no_tensor_of_the_logits_size_remains_in_the_graphs(monkeypatch):
    """The joint, forward and backward graphs as the backend builds them: with the fused head and
    loss, no node holds a tensor of tokens x vocab elements; without the pass, eager's graphs hold
    several (the check can fail)."""

    def big_nodes():
        return _logits_sized_nodes(
            monkeypatch,
            LossOnly(hf_llama(tie_word_embeddings=False)),
            lambda compiled, x: compiled(x, x).backward(),
        )

    seen, plan = big_nodes()
    assert len(rewrite_notes(plan)) == 1 and seen == []
    monkeypatch.setenv("PROTRAIN_DISABLE_PASSES", "chunked_loss")
    torch._dynamo.reset()
    seen, plan = big_nodes()
    assert rewrite_notes(plan) == [] and len(seen) >= 3


def test_inductors_cache_key_carries_protrains_ops(monkeypatch):
    """Inductor's FX graph cache keys a graph by its code, not by what protrain's custom ops
    return: a graph compiled against an earlier version of an op failed its output assertion after
    the op changed. protrain adds its version and a digest of its ops' modules to the key's tag,
    beside the user's own tag."""
    import torch._inductor.compile_fx as compile_fx
    import torch.fx as fx

    from protrain_fx import _compat
    from protrain_fx._version import ops_fingerprint as fingerprint

    seen = []

    def inner(gm, example_inputs, **kwargs):
        seen.append(torch.compiler.config.cache_key_tag)
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx_inner", inner)
    # the config module's own patch: setting and restoring its attributes by hand hides them
    with torch.compiler.config.patch(cache_key_tag="user-tag"):
        _compat.compile_fx_inner(fx.symbolic_trace(lambda x: x + 1), [torch.ones(1)])
        assert torch.compiler.config.cache_key_tag == "user-tag"
    assert seen == [f"user-tag;{fingerprint()}"]
    assert fingerprint().startswith("protrain-")


# ------------------------------------------------- logits returned beside the loss (Hugging Face's)
def _hf_steps(ref, compiled, ref_opt, opt, batches):
    """Both models trained as a Hugging Face loop does: the output object, its loss backward."""
    for x, _ in batches:
        outs = []
        for m, o in ((ref, ref_opt), (compiled, opt)):
            out = m(input_ids=x, labels=x)
            out.loss.backward()
            o.step()
            o.zero_grad()
            outs.append(out)
        yield outs


@pytest.mark.parametrize("regions", ["1", "0"])
def test_a_model_returning_its_logits_gets_the_fused_loss_and_eagers_logits(monkeypatch, regions):
    """Hugging Face returns the logits beside the loss: the loss still comes from the hidden states
    a chunk at a time (the logits leave the graph without a gradient path, so aot_autograd makes no
    zero gradient of their size), and the user gets eager's logits, requiring grad like eager's;
    the first step's loss and logits are eager's bit for bit, the later ones and the parameters
    within fp32 rounding (the fused backward), compiled in regions or whole."""
    import copy

    monkeypatch.setenv("PROTRAIN_REGIONS", regions)
    base = hf_llama()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    compiled, opt = offloaded(mine)
    batches = random_batches(3, 2, 16, vocab=HF_VOCAB)
    for i, (want, got) in enumerate(_hf_steps(ref, compiled, ref_opt, opt, batches)):
        if i == 0:  # forward: eager's kernels, from the same parameters
            assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)
        close_to_eager(got.loss, want.loss)
        close_to_eager(got.logits, want.logits)
        assert got.logits.requires_grad and got.logits.grad_fn is not None
    notes = rewrite_notes(get_plan(compiled))
    assert len(notes) == 1 and "head and loss fused" in notes[0], notes
    assert "logits returned from detached inputs" in notes[0]
    params_close_to_eager(mine, ref, base)
    with torch.no_grad():  # evaluation: the same logits, no gradient function
        x = batches[0][0]
        out, want = compiled(input_ids=x, labels=x), ref(input_ids=x, labels=x)
    close_to_eager(out.logits, want.logits)
    assert not out.logits.requires_grad
    close_to_eager(out.loss, want.loss)


@pytest.mark.parametrize(
    "tied, regions, micro",
    [(True, "1", 1), (False, "1", 2), (True, "0", 2), (False, "0", 1)],
)
def test_a_loss_through_the_returned_logits_trains_like_eager(monkeypatch, tied, regions, micro):
    """A loss of the user's on the returned logits beside the model's own (a z-loss and a
    distillation term against a fixed teacher's logits) back-propagates through them as eager's
    projection backward would: into the hidden states and into the head's weight, which is
    offloaded here (its gradient handed to its chunk beside the compiled graph's own parts: the
    head's, and a tied embedding's rows); tied or untied, in regions or whole, with gradient
    accumulation. Losses and parameters within fp32 rounding of eager's; before, such a backward
    raised a ProtrainError asking for PROTRAIN_DISABLE_PASSES=chunked_loss."""
    import copy

    monkeypatch.setenv("PROTRAIN_REGIONS", regions)
    base = hf_llama(tie_word_embeddings=tied)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    compiled, opt = offloaded(mine)
    head = mine.lm_head.weight
    batches = random_batches(3, 2 * micro, 16, vocab=HF_VOCAB)
    teacher = torch.randn(2 * micro, 16, HF_VOCAB, generator=torch.Generator().manual_seed(5))
    for x, _ in batches:
        losses = []
        for m, o in ((ref, ref_opt), (compiled, opt)):
            total = 0.0
            for xm, tm in zip(x.chunk(micro), teacher.chunk(micro)):
                out = m(input_ids=xm, labels=xm)
                z = out.logits.float().logsumexp(-1).pow(2).mean()
                kd = F.kl_div(out.logits.log_softmax(-1), tm.softmax(-1), reduction="batchmean")
                loss = (out.loss + 1e-2 * z + 0.5 * kd) / micro
                loss.backward()
                total += loss.item()
            o.step()
            o.zero_grad()
            losses.append(total)
        close_to_eager(torch.tensor(losses[1]), torch.tensor(losses[0]))
    store = store_of(head)
    assert store is not None and store.param_is_offloaded(head)  # the weight is offloaded here
    params_close_to_eager(mine, ref, base)


def test_a_gradient_through_the_returned_logits_of_an_unknown_weight_raises():
    """Where the head's weight is not known (or with several ranks, whose shards of it a rank
    cannot read), a gradient reaching the returned logits raises a ProtrainError saying how to turn
    the rewrite off."""
    from protrain_fx.errors import ProtrainError
    from protrain_fx.runtime.loss_ops import LogitsOfChunkedLoss

    hidden = torch.randn(2, 3, 4, requires_grad=True)
    logits = LogitsOfChunkedLoss.apply(hidden, None, torch.randn(2, 3, 5))
    with pytest.raises(ProtrainError, match="PROTRAIN_DISABLE_PASSES=chunked_loss"):
        logits.sum().backward()


def test_no_tensor_of_the_logits_size_in_backward_when_the_logits_are_returned(monkeypatch):
    """The graphs of a model that returns its logits: only the forward holds a tensor of their size
    (the logits it returns); the backward none (no zero gradient of the output, no saved logits).
    Without the pass the backward holds several (the check can fail)."""

    def big_nodes():
        seen, _ = _logits_sized_nodes(
            monkeypatch,
            hf_llama(tie_word_embeddings=False),
            lambda compiled, x: compiled(input_ids=x, labels=x).loss.backward(),
        )
        return [stage for stage, _ in seen]

    stages = big_nodes()
    assert "forward" in stages and "backward" not in stages, stages
    monkeypatch.setenv("PROTRAIN_DISABLE_PASSES", "chunked_loss")
    torch._dynamo.reset()
    stages = big_nodes()
    assert stages.count("backward") >= 2, stages


def test_returned_logits_no_longer_raise_the_smallest_budget(monkeypatch):
    """The smallest budget the automatic plan accepts (NoPlanFits names it) for a Hugging Face
    Llama whose 1024 tokens' logits (8192 vocabulary, fp32: 32 MiB) dominate: with the head and
    loss fused although the logits are returned, at least the logits' size below the plan without
    the rewrite (the rewrite of the loss alone, before, changed nothing here: 60.1 MiB both)."""
    from protrain_fx.errors import NoPlanFits

    monkeypatch.setenv("PROTRAIN_LOSS_CHUNK_BYTES", "4MiB")
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
    vocab, tokens = 8192, 1024

    def smallest_budget() -> int:
        model = hf_llama(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            max_position_embeddings=512,
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        compiled = torch.compile(
            model,
            backend="protrain",
            options={"optimizer": opt, "memory_budget": "64KiB", "compiler": "eager"},
        )
        x = torch.randint(0, vocab, (2, tokens // 2))
        with pytest.raises(Exception) as info:
            compiled(input_ids=x, labels=x).loss.backward()
        cause = info.value
        while cause is not None and not isinstance(cause, NoPlanFits):
            cause = cause.__cause__ or cause.__context__
        assert cause is not None, info.value
        return cause.min_device_bytes

    fused = smallest_budget()
    monkeypatch.setenv("PROTRAIN_DISABLE_PASSES", "chunked_loss")
    torch._dynamo.reset()
    eager_loss = smallest_budget()
    assert fused <= eager_loss - tokens * vocab * 4, (fused, eager_loss)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: reaches ``_mm_into``'s cuBLAS branch without a GPU."""

    @property
    def is_cuda(self):
        return True


def test_the_fp32_output_matmul_falls_back_only_where_the_build_has_no_kernel(monkeypatch):
    """``loss_ops._mm_into`` (the fused loss's hidden-state gradient, summed in fp32): where the
    fp32-output matmul has no kernel for the inputs (torch's NotImplementedError) it takes the
    upcast matmul, now and from then on, with the same sum; any other error of the matmul (out of
    memory) is raised as it is and the kernel is kept."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 4, generator=g).to(torch.bfloat16)
    want = a.float() @ b.float()
    real_mm, tried = torch.mm, []

    def mm(x, y, *args, out_dtype=None, **kw):
        if out_dtype is not None:
            tried.append(out_dtype)
            raise failure[0]
        return real_mm(x, y, *args, **kw)

    monkeypatch.setattr(loss_ops, "_MM_OUT_DTYPE", True)
    monkeypatch.setattr(torch, "mm", mm)
    failure = [torch.OutOfMemoryError("CUDA out of memory (injected)")]
    acc = torch.zeros(8, 4)
    with pytest.raises(torch.OutOfMemoryError):
        loss_ops._mm_into(acc, a.as_subclass(_OnCuda), b)
    assert loss_ops._MM_OUT_DTYPE is True and tried == [torch.float32]
    failure[0] = NotImplementedError("no kernel for these dtypes (injected)")
    loss_ops._mm_into(acc, a.as_subclass(_OnCuda), b)
    assert loss_ops._MM_OUT_DTYPE is False and len(tried) == 2
    assert torch.equal(acc.as_subclass(torch.Tensor), want)
    loss_ops._mm_into(acc, a.as_subclass(_OnCuda), b)  # not tried again
    assert len(tried) == 2 and torch.equal(acc.as_subclass(torch.Tensor), 2 * want)
