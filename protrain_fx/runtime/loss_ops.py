"""Cross-entropy over token chunks: the ``protrain::`` ops that passes/chunked_loss.py puts in place
of a model's ``F.cross_entropy`` over the output projection's logits.

The loss of a row (a token) depends on that row alone: ``-log_softmax(x)[target]`` in fp32, and so
does its gradient. So the rows can be taken ``chunk_rows`` at a time, and the fp32 copy of the
logits, the log-softmax eager saves for backward and the fp32 gradient (each ``tokens x vocab x 4``
bytes: 2 GiB for 4 x 1024 tokens of a 128k vocabulary) exist one chunk at a time. Each chunk runs
eager's own kernels (``log_softmax``, ``nll_loss_backward``, ``log_softmax_backward``), whose
results per row do not depend on the other rows; forward keeps one number per row (the picked
log-probability) and reduces them with eager's ``nll_loss``, in the same order; backward computes
each chunk's log-softmax again. From the logits, loss and gradient are therefore eager's bit for
bit (the fused op's backward below: within fp32 rounding).

* ``cross_entropy(logits, target, ignore_index, reduction, chunk_rows) -> (loss, total_weight)``:
  from 2-D logits of any floating dtype, upcast to fp32 per chunk (as Hugging Face's
  ``ForCausalLMLoss`` does with ``logits.float()``); the gradient comes back in the logits' dtype.
* ``linear_cross_entropy(hidden, weight, target, ..., compute_dtype) -> (loss, total_weight,
  lse)``: the same from the hidden states and the output projection's weight (``logits = hidden @
  weight.T`` in ``compute_dtype``, the dtype autocast would run the projection in), for a graph
  whose logits feed the loss alone: the logits exist one chunk of rows at a time in forward, which
  also keeps each row's log-sum-exp (``lse``, 4 bytes a token). Backward recomputes the logits
  (one more matmul of the head's size over the step). Where their gradient whole, in
  ``compute_dtype``, is no larger than a chunk of fp32 logits (a few hundred tokens), it is written
  a chunk of rows at a time by eager's kernels and the projection's two backward matmuls run over
  all rows as eager's: eager's gradients. Otherwise (4096 tokens of a 128k vocabulary: 1 GiB in
  bf16) backward never holds the logits or their gradient whole: it takes the vocabulary a slice
  at a time (as many elements as a chunk of rows), computes the slice's logits again, their fp32
  gradient ``(exp(x - lse) - onehot) * g`` (what eager's ``nll_loss_backward`` and
  ``log_softmax_backward`` compute), and the projection's backward: the weight's gradient for the
  slice's rows is one matmul over every token (eager's reduction), the hidden states' gradient a
  sum over the slices kept in fp32 (``n x width``, small) and rounded once to ``compute_dtype``, as
  eager's. These gradients are eager's within fp32 rounding, not bit for bit. ``weight`` comes in
  ``compute_dtype`` where the graph casts it (passes/chunked_loss.py), and its gradient goes back
  in it. The largest transient is then a slice's fp32 logits (``PROTRAIN_LOSS_CHUNK_BYTES``) beside
  the weight's gradient.

``reduction`` is ``"mean"`` (over the rows whose target is not ``ignore_index``, as eager's) or
``"sum"``. The ops are opaque to Inductor (their kernels are eager ATen calls per chunk).

A graph that returns its logits beside the fused loss returns them without a gradient path (and its
hidden states as one more output): :func:`reattach_logits` wraps the compiled graph so that the
caller gets the outputs it asked for, the logits with a gradient function of their own
(:class:`LogitsOfChunkedLoss`) that connects them to the hidden states and raises, with what to do,
if a gradient ever reaches it.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.library import custom_op

from protrain_fx.errors import ProtrainError

_REDUCTION = {"mean": 1, "sum": 2}  # at::Reduction


def _rows(n: int, chunk_rows: int):
    for start in range(0, n, chunk_rows):
        yield start, min(n, start + chunk_rows)


def _log_probs(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax of some rows of logits, as eager's ``cross_entropy(x.float())`` makes it."""
    return torch.log_softmax(x.float(), 1)


def _picked(logp: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``logp[i, target[i]]`` (0 on ignored rows), by eager's ``nll_loss`` without reduction: a
    target out of range is its error too."""
    return -torch.ops.aten.nll_loss_forward(logp, target, None, 0, ignore_index)[0]


def _reduce(picked, target, ignore_index: int, reduction: str):
    """(loss, total weight): eager's ``nll_loss`` over the picked log-probabilities, as an
    ``(n, 1)`` input whose class 0 holds them, so the reduction adds the same values in the same
    order as eager's over ``(n, vocab)``."""
    classes = torch.where(target != ignore_index, 0, ignore_index)
    return torch.ops.aten.nll_loss_forward(
        picked.unsqueeze(1), classes, None, _REDUCTION[reduction], ignore_index
    )


def _grad_rows(grad, logp, target, ignore_index: int, reduction: str, total_weight):
    """The fp32 gradient of some rows' logits: eager's ``nll_loss_backward`` then
    ``log_softmax_backward`` on those rows (``total_weight`` counts every row of the loss)."""
    g = torch.ops.aten.nll_loss_backward(
        grad, logp, target, None, _REDUCTION[reduction], ignore_index, total_weight
    )
    return torch._log_softmax_backward_data(g, logp, 1, torch.float32)


# ------------------------------------------------------------------------------ from the logits
@custom_op("protrain::cross_entropy", mutates_args=())
def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, chunk_rows: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    picked = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for a, b in _rows(logits.shape[0], chunk_rows):
        picked[a:b] = _picked(_log_probs(logits[a:b]), target[a:b], ignore_index)
    return _reduce(picked, target, ignore_index, reduction)


@cross_entropy.register_fake
def _(logits, target, ignore_index, reduction, chunk_rows):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty((), dtype=torch.float32)


@custom_op("protrain::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    total_weight: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
) -> torch.Tensor:
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    for a, b in _rows(logits.shape[0], chunk_rows):
        logp = _log_probs(logits[a:b])
        out[a:b] = _grad_rows(grad, logp, target[a:b], ignore_index, reduction, total_weight)
    return out


@cross_entropy_backward.register_fake
def _(grad, logits, target, total_weight, ignore_index, reduction, chunk_rows):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _ce_setup(ctx, inputs, output):
    logits, target, ignore_index, reduction, chunk_rows = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.args = (ignore_index, reduction, chunk_rows)


def _ce_backward(ctx, grad_loss, grad_total_weight):
    logits, target, total_weight = ctx.saved_tensors
    dlogits = cross_entropy_backward(grad_loss, logits, target, total_weight, *ctx.args)
    return dlogits, None, None, None, None


cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)


# --------------------------------------------------------------- from the hidden states and weight
@custom_op("protrain::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
    compute_dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = hidden.shape[0]
    picked = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    wt = weight.to(compute_dtype).t()
    for a, b in _rows(n, chunk_rows):
        x = (hidden[a:b].to(compute_dtype) @ wt).float()
        logp = torch.log_softmax(x, 1)
        t = target[a:b]
        picked[a:b] = _picked(logp, t, ignore_index)
        # each row's log-sum-exp from one of its columns, x - log_softmax(x) (the target's; column
        # 0 on an ignored row): no pass over the chunk beyond log_softmax's (torch.logsumexp took
        # 17 ms of the 1B shape's forward at 8 x 2048 on the H200), within the rounding of the
        # log-probability eager's backward exponentiates
        col = torch.where(t == ignore_index, 0, t).unsqueeze(1)
        lse[a:b] = (x.gather(1, col) - logp.gather(1, col)).squeeze(1)
        del x, logp
    loss, total_weight = _reduce(picked, target, ignore_index, reduction)
    return loss, total_weight, lse


@linear_cross_entropy.register_fake
def _(hidden, weight, target, ignore_index, reduction, chunk_rows, compute_dtype):
    scalar = hidden.new_empty((), dtype=torch.float32)
    return scalar, torch.empty_like(scalar), hidden.new_empty(hidden.shape[0], dtype=torch.float32)


def _mm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with the product accumulated in ``acc``'s dtype (fp32, or fp64 for fp64
    inputs): where ``a`` and ``b`` are bf16 or fp16 on CUDA, by cuBLAS with an fp32 output (no
    rounding of the partial sum to the inputs' dtype; torch 2.11's CUDA build has it, measured on
    the H200: benchmarks/results/fused_loss_check_h200.md); elsewhere by a matmul of the upcast
    inputs (whose products are exact in fp32), also where a build has the overload but no kernel
    for these dtypes (torch's NotImplementedError: known once, not tried again). Any other error
    of the matmul (out of memory) is the caller's."""
    global _MM_OUT_DTYPE
    if a.dtype == acc.dtype:
        acc.add_(a @ b)
        return
    if a.is_cuda and _MM_OUT_DTYPE and acc.dtype == torch.float32:
        try:
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))
            return
        except NotImplementedError:  # no kernel here: the upcast matmul from now on
            _MM_OUT_DTYPE = False
    acc.add_(a.to(acc.dtype) @ b.to(acc.dtype))


# mm with an output dtype (torch.mm(..., out_dtype=)): an overload in torch 2.11 and 2.13
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()
SLICE_ALIGN = 128  # columns of a vocabulary slice (see linear_cross_entropy_backward)


@custom_op("protrain::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    total_weight: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
    compute_dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor]:
    n, vocab = hidden.shape[0], weight.shape[0]
    h = hidden.to(compute_dtype)
    w = weight.to(compute_dtype)
    if n * h.element_size() <= chunk_rows * 4:
        # the logits' gradient whole is no larger than a chunk of fp32 logits: eager's kernels a
        # chunk of rows at a time into it, then the projection's backward as eager runs it (the
        # same two matmuls over every row): eager's gradients bit for bit
        dlogits = torch.empty((n, vocab), dtype=compute_dtype, device=hidden.device)
        for a, b in _rows(n, chunk_rows):
            logp = _log_probs(h[a:b] @ w.t())
            dlogits[a:b] = _grad_rows(
                grad, logp, target[a:b], ignore_index, reduction, total_weight
            )
            del logp
        return (dlogits @ w).to(hidden.dtype), (dlogits.t() @ h).to(weight.dtype)
    # else over slices of the vocabulary, so that the logits' gradient exists one slice at a time:
    # a slice's logits again (from the hidden states and the slice's rows of the weight), their
    # fp32 gradient from the log-sum-exp forward kept per row (what eager's ``nll_loss_backward``
    # then ``log_softmax_backward`` compute: ``(exp(x - lse) - onehot) * g``, g = grad /
    # total_weight on the rows not ignored), and the projection's backward: the weight's gradient
    # for the slice's rows is the slice's whole matmul (a reduction over every token, as eager's),
    # the hidden states' gradient a sum over the slices, accumulated in fp32 (fp64 for fp64) and
    # rounded once to ``compute_dtype`` as eager's
    scale = grad / total_weight if reduction == "mean" else grad
    g = torch.where(target != ignore_index, scale, 0.0).unsqueeze(1)  # fp32, (n, 1)
    # as many elements as a chunk of rows, in a multiple of SLICE_ALIGN columns: a slice's logits
    # and gradient then have a leading dimension cuBLAS's tensor-core kernels take (on the H200,
    # 2043-column slices of the 1B shape's 8 x 2048 tokens took 241 ms of backward against 65)
    cols = max(SLICE_ALIGN, chunk_rows * vocab // n // SLICE_ALIGN * SLICE_ALIGN)
    acc = torch.promote_types(torch.float32, compute_dtype)
    dh = torch.zeros((n, h.shape[1]), dtype=acc, device=hidden.device)
    dw = torch.empty((vocab, h.shape[1]), dtype=compute_dtype, device=hidden.device)
    for a, b in _rows(vocab, cols):
        x = (h @ w[a:b].t()).float()
        x.sub_(lse.unsqueeze(1)).exp_().mul_(g)
        at = (target - a).clamp_(0, b - a - 1).unsqueeze(1)
        hit = ((target >= a) & (target < b)).unsqueeze(1)
        x.scatter_add_(1, at, torch.where(hit, -g, 0.0))
        dl = x.to(compute_dtype)
        del x
        torch.mm(dl.t(), h, out=dw[a:b])
        _mm_into(dh, dl, w[a:b])
        del dl
    return dh.to(compute_dtype).to(hidden.dtype), dw.to(weight.dtype)


@linear_cross_entropy_backward.register_fake
def _(
    grad,
    hidden,
    weight,
    target,
    total_weight,
    lse,
    ignore_index,
    reduction,
    chunk_rows,
    compute_dtype,
):
    return (
        torch.empty_like(hidden, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


def _lce_setup(ctx, inputs, output):
    hidden, weight, target, ignore_index, reduction, chunk_rows, compute_dtype = inputs
    ctx.save_for_backward(hidden, weight, target, output[1], output[2])
    ctx.args = (ignore_index, reduction, chunk_rows, compute_dtype)
    ctx.mark_non_differentiable(output[1], output[2])


def _lce_backward(ctx, grad_loss, grad_total_weight, grad_lse):
    hidden, weight, target, total_weight, lse = ctx.saved_tensors
    dh, dw = linear_cross_entropy_backward(
        grad_loss, hidden, weight, target, total_weight, lse, *ctx.args
    )
    return dh, dw, None, None, None, None, None


linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)


# ------------------------------------------------------------------ logits returned beside the loss
class LogitsOfChunkedLoss(torch.autograd.Function):
    """The logits a graph with the fused head and loss returns: eager's values, and the gradient
    eager's ``linear`` would give for them. The compiled graph computed its loss from the hidden
    states and kept no path through the logits; a loss of the user's that reaches them (a
    distillation term, a z-loss) back-propagates here as eager's projection backward would, in the
    logits' dtype: into the hidden states ``g @ w`` (cast back to theirs; it flows into the
    compiled backward through the graph's hidden-states output) and into the head's weight
    ``g^T @ h``. A resident weight gets that through autograd (cast to its dtype, as autocast's
    cast's backward does); an offloaded one is handed to its chunk here, as the compiled graph
    hands its own gradients over (``protrain::chunk_grad``: the host adds it, upcast, into the
    chunk's gradient; autograd would add it to ``.grad`` only at the end of backward, after
    protrain's hand-overs, which protrain cannot order). The sum with the loss's own part is
    eager's within rounding (eager adds the two logits' gradients first). With several ranks (a
    rank holds only its shard of the head's weight, whose gradient is averaged over the ranks) or
    a weight not known, such a gradient raises a ``ProtrainError`` saying what to do."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight, logits: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden)
        ctx.weight, ctx.dtype = weight, logits.dtype
        return logits.detach()

    @staticmethod
    def backward(ctx, grad):
        from protrain_fx.runtime import distributed
        from protrain_fx.runtime.chunk_store import store_of

        (hidden,) = ctx.saved_tensors
        weight = ctx.weight
        if not isinstance(weight, torch.Tensor) or distributed.world().sharded:
            raise ProtrainError(
                "a gradient reached the logits of a model whose loss protrain computes from the "
                "hidden states a chunk of tokens at a time (passes/chunked_loss.py, so that the "
                "logits need not exist whole in backward), and protrain cannot back-propagate "
                "through them here (with several ranks a rank holds only its shard of the head's "
                "weight, whose gradient is averaged over the ranks). To back-propagate through "
                "the logits, turn the rewrite off with PROTRAIN_DISABLE_PASSES=chunked_loss (the "
                "loss is then computed from the whole logits)"
            )
        g = grad.to(ctx.dtype)
        w = weight.detach().to(ctx.dtype)
        dh = (g @ w).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        if not weight.requires_grad:
            return dh, None, None
        h = hidden.detach().to(ctx.dtype)
        dw = g.reshape(-1, g.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        store = store_of(weight)
        if store is None or not store.param_is_offloaded(weight):
            return dh, dw.to(weight.dtype), None
        entry = store.entry_index(weight)
        store.grad_ready(store.entries[entry].chunk, [dw], [entry])
        return dh, None, None


def is_returned_logits(t: torch.Tensor) -> bool:
    """Whether ``t`` is logits :func:`reattach_logits` returned."""
    return isinstance(t.grad_fn, LogitsOfChunkedLoss._backward_cls)


def reattach_logits(fn, outputs: list[tuple[int, int, int]]):
    """``fn`` (a compiled graph, called as it is) whose outputs at ``outputs``' first positions are
    logits without a gradient path and whose last outputs are the hidden states they came from
    (``outputs``' second positions; the third: the head weight's input position, or -1,
    passes/chunked_loss.py): called, it returns the graph's outputs without those extras, each
    such logits tensor through :class:`LogitsOfChunkedLoss`."""
    extra = len({h for _, h, _ in outputs})

    def fix(outs, weights):
        got = list(outs)
        for (k, h, _), weight in zip(outputs, weights):
            hidden = got[h]
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                got[k] = LogitsOfChunkedLoss.apply(hidden, weight, got[k])
        del got[len(got) - extra :]
        return type(outs)(got) if isinstance(outs, tuple) else got

    def run(*args):
        # boxed (one list of the inputs, which the call may clear: read it first) or not
        inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        weights = [inputs[w] if 0 <= w < len(inputs) else None for _, _, w in outputs]
        return fix(fn(*args), weights)

    # called as ``fn`` is: aot_autograd's forward carries its inner function's ``_boxed_call``
    if hasattr(fn, "_boxed_call"):
        run._boxed_call = fn._boxed_call
    run.__wrapped__ = fn
    return run
