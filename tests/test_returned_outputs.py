"""What a training call under an automatic plan keeps of its outputs: a backward that runs out of
memory is redone (compiled_graph._RedoableCall), for which the call keeps where its backward starts
(gradient handles), not the outputs themselves. An output the caller drops is freed then, as in
eager: Hugging Face's causal LMs return their logits beside the loss, and on the H200 the 1B Llama
shape's 1 GiB of logits stayed alive to the end of backward (benchmarks/results, run 29), a table's
worth of memory more than the plan had predicted."""

from __future__ import annotations

import gc
import warnings

import torch
from hf_models import HF_VOCAB, hf_llama

import protrain_fx
from protrain_fx import _compat
from protrain_fx.testing import make_adamw, random_batches


def _holders(ptr: int) -> list:
    """Every live tensor over the storage at ``ptr``."""
    gc.collect()
    out = []
    with warnings.catch_warnings():  # objects whose attributes warn when looked at
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == ptr:
                    out.append(o)
            except (RuntimeError, NotImplementedError):  # fake or meta tensors of a compile
                continue
    return out


def _offloaded(model):
    """``(model, its AdamW, model compiled)`` under a budget of 3x its parameters, every chunk
    offloaded, eager kernels."""
    opt = make_adamw(model)
    budget = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    compiled = torch.compile(
        model,
        backend="protrain",
        options=dict(compiler="eager", optimizer=opt, memory_budget=budget, n_persist=0),
    )
    return model, opt, compiled


def test_logits_returned_beside_the_loss_are_freed_when_the_caller_drops_them(monkeypatch):
    """HF Llama (tied embeddings) under a memory budget, every chunk offloaded, its own loss: the
    caller takes ``.loss`` and drops the output before backward; no tensor over the logits' memory
    is left (before the fix the call's record held the graph's own output). Training then goes on
    (two steps, finite losses), and the logits a caller keeps stay valid."""
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
    model, opt, compiled = _offloaded(hf_llama())
    data = random_batches(2, 2, 16, vocab=HF_VOCAB)
    losses = []
    for i, (x, _) in enumerate(data):
        out = compiled(input_ids=x, labels=x, use_cache=False)
        loss, logits = out.loss, out.logits
        ptr, shape = logits.untyped_storage().data_ptr(), tuple(logits.shape)
        if i == 0:  # a caller that keeps them: still there, and readable after backward
            kept = logits
        del out, logits
        if i == 1:
            assert _holders(ptr) == [], "the call kept the logits the caller dropped"
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert protrain_fx.get_plan(compiled).predicted  # the automatic plan ran the steps
    assert tuple(kept.shape) == shape and torch.isfinite(kept).all()
    assert all(torch.isfinite(torch.tensor(losses)))


def test_gradient_handles_start_a_backward_without_the_output():
    """``_compat.gradient_handle``: a backward started from the handle of an output that is gone
    gives the gradients the output would have (on this torch: a ``GradientEdge``)."""
    x = torch.randn(4, requires_grad=True)
    with torch.enable_grad():
        y = x.exp()
    handle = _compat.gradient_handle(y)
    if _compat.backward_takes_gradient_edges():
        del y
    torch.autograd.backward([handle], [torch.ones(4)])
    assert torch.equal(x.grad, x.detach().exp())


def test_the_plan_predicts_the_peak_of_a_loop_that_drops_the_output_too(monkeypatch):
    """The predicted peak keeps the logits a model returns beside its loss through backward (the
    profiled step holds them, as ``out = model(...); out.loss.backward()`` does), and the plan
    also says what a loop that drops the output first peaks at: that less the logits' bytes (times
    the allocator's factor). A model that returns the loss alone: the same."""
    from hf_models import LossOnly

    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
    batch, seq = 2, 16
    for wrap in (False, True):
        torch._dynamo.reset()
        model, opt, compiled = _offloaded(LossOnly(hf_llama()) if wrap else hf_llama())
        (x, _) = random_batches(1, batch, seq, vocab=HF_VOCAB)[0]
        loss = compiled(x, x) if wrap else compiled(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        plan = protrain_fx.get_plan(compiled)
        peak, dropped = plan.predicted["peak_bytes"], plan.predicted["peak_bytes_output_dropped"]
        if wrap:
            assert dropped == peak
            assert "drops the model's output" not in plan.summary()
        else:
            logits = batch * seq * HF_VOCAB * 4  # fp32 logits (no autocast)
            factor = plan.predicted["profiled"]["fragmentation"]  # no block swapped here
            assert plan.n_swap == 0 and peak - dropped == int(logits * factor), (peak, dropped)
            assert "if the loop drops the model's output before backward" in plan.summary()
