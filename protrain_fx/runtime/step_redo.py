"""What a backward has handed over, so that a backward redone after running out of device memory
hands over only the rest.

An offloaded chunk's gradients leave the device inside backward (``ChunkStore.grad_ready``): once
handed over they are in the host accumulator, and the optimizer may already have queued the chunk's
provisional step behind them. A backward that runs out of device memory half way has handed over
some chunks; the graph's caller (protrain_fx/backend.py, ``ProtrainGraph``) re-plans, replays the
forward on the same inputs and runs the backward again. That second backward produces every
gradient again, and the chunks handed over the first time must not be added twice. So the caller
runs each backward of a step inside :func:`handing_over` with one set for the step: a chunk's
gradients are handed over only if the set does not hold them yet (:func:`first_time`), and are
added to it once they are (:func:`handed_over`). Outside such a backward (a fixed plan, a graph run
by hand) everything is handed over, as always.

A training call whose backward can be redone runs as a :class:`RedoableCall`, which keeps a
:class:`CallRecord` of its inputs, random-number and autocast state (enough to replay the forward)
and where its backward starts.
"""

from __future__ import annotations

import contextlib

import torch

from protrain_fx import _compat
from protrain_fx.errors import ProtrainError

# the set of the backward running now (one at a time: autograd runs a device's backward functions
# on one thread; a backward inside another, the profiler's in a re-plan, runs with None), and how
# often each key was met in it so far
_current: set | None = None
_seen: dict = {}


@contextlib.contextmanager
def handing_over(delivered: set | None):
    """Run a backward recording in ``delivered`` (and skipping what it holds); None: no record."""
    global _current, _seen
    before, _current, _seen = (_current, _seen), delivered, {}
    try:
        yield
    finally:
        _current, _seen = before


def enclosed() -> bool:
    """Inside a redoable call's own backward: the end of the user's backward, which runs it,
    counts (chunk_grads queues its end-of-backward callback there)."""
    return _current is not None


def first_time(key: tuple) -> tuple | None:
    """The hand-over of the gradients ``key`` (store id, chunk, members) that is due now, as the
    record :func:`handed_over` takes: ``key`` with how often this backward met it before (a tied
    weight's chunk gets its gradients from two graphs of a model compiled in regions); None when
    an earlier try of this step's backward handed it over already."""
    if _current is None:
        return key
    n = _seen.get(key, 0)
    _seen[key] = n + 1
    return None if (key, n) in _current else (key, n)


def handed_over(record: tuple) -> None:
    if _current is not None:
        _current.add(record)


class CallRecord:
    """What replaying one training call of a graph needs: its inputs, the random-number and
    autocast state it ran under, where its backward starts (``outputs``: a gradient handle per
    output that needs a gradient, holding the autograd graph but not the output's memory, which goes
    with the caller's last reference as in eager: a logits tensor beside the loss is not kept
    through backward; None for the others), and which chunks' gradients its backward has handed
    over."""

    def __init__(self, args):
        self.args = args
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in ("cpu", "cuda")
            if t == "cpu" or torch.cuda.is_available()
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.outputs = None
        self.handed_over: set = set()
        self.retain = False  # the backward running keeps the graph (retain_graph=True)
        self.inputs = None  # the parameters the user's backward accumulates (None: all)

    @contextlib.contextmanager
    def ambient(self):
        """The forward's grad mode and autocast state (a backward runs on autograd's thread, which
        has neither)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for t, on, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(t, dtype=dtype, enabled=on, cache_enabled=self.autocast_cache)
                )
            yield

    def replay(self, forward):
        """The forward again, on the same inputs and random numbers; the generators left as they
        were."""
        cpu_now = torch.get_rng_state()
        cuda_now = torch.cuda.get_rng_state_all() if self.cuda_rng is not None else None
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        try:
            return handles(forward(self.args))
        finally:
            torch.set_rng_state(cpu_now)
            if cuda_now is not None:
                torch.cuda.set_rng_state_all(cuda_now)


class RedoableCall(torch.autograd.Function):
    """A training call of a ``ProtrainGraph`` (protrain_fx/compiled_graph.py) whose backward can be
    redone (see there): the compiled code's outputs (and autograd graph) stay inside, the caller
    gets them detached, and this function's backward runs theirs."""

    @staticmethod
    def forward(ctx, graph, *args):
        call = CallRecord(args)
        with torch.enable_grad():
            out = graph._forward(args)
        call.outputs = handles(out)
        ctx.graph, ctx.call = graph, call
        ctx.set_materialize_grads(False)
        detached = []
        for o in out:
            if isinstance(o, torch.Tensor):
                d = o.detach()
                if not o.requires_grad:
                    ctx.mark_non_differentiable(d)
                detached.append(d)
            else:
                detached.append(o)
        return tuple(detached)

    @staticmethod
    def backward(ctx, *grads):
        # a backward that keeps the graph (retain_graph=True) keeps the call's for the next one,
        # which hands over its gradients anew
        call = ctx.call
        if call is None:  # the graph went with the last backward, as eager's would
            raise ProtrainError(
                "protrain: trying to backward through the graph a second time (its saved values "
                "were freed by the last backward): pass retain_graph=True to the first one"
            )
        refuse_create_graph()
        call.inputs = parameters_asked_for(ctx, call.args, ctx.graph)
        # the user's backward ends after this inner one: gradients that code outside the graph
        # adds to an offloaded parameter are checked then (chunk_grads), as with a fixed plan
        from protrain_fx.runtime import chunk_grads  # (it imports this module)

        chunk_grads.queue_end_of_backward()
        call.retain = keep_graph()
        if not call.retain:
            ctx.call = None
        call.handed_over = set()
        try:
            ctx.graph._backward(call, grads)
        finally:
            if not call.retain:
                call.outputs = None
        return (None,) * (1 + len(call.args))


def redoable_call(graph, args) -> tuple:
    """``graph``'s training call on ``args`` as a :class:`RedoableCall`; an output that is an input
    without a gradient (a buffer that forward updates and dynamo assigns back to the module:
    spectral_norm's ``u``) is that input, as in eager, not an output of the call's autograd node
    (the buffer then required a gradient, and the next call compiled again)."""
    out = RedoableCall.apply(graph, *args)
    plain = {_alias_key(a): a for a in args if isinstance(a, torch.Tensor) and not a.requires_grad}
    return tuple(plain.get(_alias_key(o), o) if isinstance(o, torch.Tensor) else o for o in out)


def _alias_key(t: torch.Tensor) -> tuple:
    if t.device.type == "meta" or t.is_sparse or t.numel() == 0:  # (every empty one is at 0)
        return (id(t),)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def parameters_asked_for(node, args, graph) -> list | None:
    """The parameters among ``args`` (the inputs of the autograd ``node`` running now, a call of
    ``graph``) whose
    gradients the user's backward accumulates: None for every one (``loss.backward()``), fewer
    under ``backward(inputs=[...])``. ``torch.autograd.grad`` asking for one is refused, as with a
    fixed plan (runtime/param_hooks.py)."""
    asked, every = [], True
    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for (fn, _), (i, a) in zip(node.next_functions, tensors, strict=True):  # one per tensor
        if fn is None:
            continue
        try:
            run = torch._C._will_engine_execute_node(fn)
        except RuntimeError:  # captured: torch.autograd.grad was asked for it
            names = {gi.index: gi.fqn or gi.node_name for gi in graph._graph_inputs}
            raise ProtrainError(
                f"protrain: torch.autograd.grad was asked for the gradient of "
                f"{names.get(i, f'input {i}')!r}, a parameter of a protrain-compiled graph, whose "
                "gradient protrain makes inside the compiled graph and accumulates into p.grad "
                "(on the host where offloaded), not returned through autograd; use "
                "loss.backward() (or backward(inputs=[...])) and read p.grad"
            ) from None
        if run:
            asked.append(a)
        else:
            every = False
    return None if every else asked


def refuse_create_graph() -> None:
    """Raise inside a backward pass run with ``create_graph=True`` (autograd runs its functions
    with gradients on then)."""
    if torch.is_grad_enabled():
        raise ProtrainError(
            "protrain: backward(create_graph=True) through a protrain-compiled graph: its "
            "parameters' gradients are made inside the compiled graph (offloaded ones on the host) "
            "and carry no graph of their own, so a gradient penalty or a second-order step on them "
            "would be silently wrong; run that loss without protrain, or backward() without "
            "create_graph"
        )


def refused_at_create_graph(outputs) -> None:
    """A training call's ``outputs``: a backward from them with ``create_graph=True`` raises
    (:func:`refuse_create_graph`) before the compiled backward runs."""
    nodes = {
        id(o.grad_fn): o.grad_fn
        for o in (outputs if isinstance(outputs, (list, tuple)) else (outputs,))
        if isinstance(o, torch.Tensor) and o.grad_fn is not None
    }
    for node in nodes.values():  # every one: an output aot_autograd views anew has its own
        node.register_prehook(_refuse_at_create_graph)


def _refuse_at_create_graph(grads) -> None:
    refuse_create_graph()


def keep_graph() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph=True``)."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def run_backward(call: CallRecord, pairs) -> None:
    """The compiled call's own backward from ``pairs`` (gradient handle, gradient), its graph kept
    for another where the caller's backward keeps its own, into the parameters it asks for."""
    torch.autograd.backward(
        [o for o, _ in pairs], [g for _, g in pairs], retain_graph=call.retain, inputs=call.inputs
    )


def handles(outputs) -> list:
    """Per output of a compiled call: where a backward can start from it if it needs a gradient
    (:func:`protrain_fx._compat.gradient_handle`), else None."""
    return [
        _compat.gradient_handle(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
        for o in outputs
    ]
