"""What a training call under an automatic plan keeps of its outputs: a backward that runs out of
memory is redone (runtime/step_redo.py, RedoableCall), for which the call keeps where its backward
starts (gradient handles), not the outputs themselves. An output the caller drops is freed then, as
in eager: Hugging Face's causal LMs return their logits beside the loss, and on the H200 the 1B
Llama shape's 1 GiB of logits stayed alive to the end of backward (benchmarks/results, run 29), a
table's worth of memory more than the plan had predicted."""

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
    the allocator's factor), but not under the end of forward, where the logits exist in any loop
    (timeline.output_dropped_peak, checked below). A model that returns the loss alone: the
    same."""
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
            assert plan.n_swap == 0 and peak - int(logits * factor) <= dropped <= peak
            # said where lower (this small model peaks at the end of forward: the same)
            said = "if the loop drops the model's output before backward" in plan.summary()
            assert said == (dropped < peak)


def test_a_loop_that_drops_the_output_peaks_no_lower_than_the_end_of_forward():
    """timeline.output_dropped_peak: the held peak less the logits where backward's start is the
    peak without them, the end of forward (every saved activation and the logits) where that is
    higher: on the H200 the 1B shape at 8 x 2048 (4 GiB of logits) peaked at 35.36 GiB allocated
    against 31.78 predicted without the forward's end, once the head's backward no longer built
    the logits' gradient whole (oom_sweep_h200_run33.md)."""
    from types import SimpleNamespace

    from protrain_fx.plan.timeline import output_dropped_peak

    def layout(activations, held_peak):
        return SimpleNamespace(
            prof=SimpleNamespace(resident_cast_elem=0),
            fragmentation=1.0,
            fragmentation_bytes=0,
            numel=[0],
            keep_fraction=1.0,
            resident_bytes=[0],
            hw=SimpleNamespace(grads_held=False),
            static=[100],
            activation_bytes=activations,
            peak_bytes=lambda p: held_peak,
        )

    knobs = SimpleNamespace(n_persist=0, n_shard=0)
    step = SimpleNamespace(returned_logits_bytes=40)
    # backward's start: static 100 + activations 500 + a 200-byte transient + the logits 40
    assert output_dropped_peak(layout(500, 840), knobs, step) == 800
    # a 30-byte transient, below the logits: the end of forward, 100 + 500 + 40, is the peak
    assert output_dropped_peak(layout(500, 670), knobs, step) == 640
    # nothing returned: the held peak
    none = SimpleNamespace(returned_logits_bytes=0)
    assert output_dropped_peak(layout(500, 670), knobs, none) == 670
