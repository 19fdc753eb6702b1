"""Gradient hooks on offloaded parameters (``p.register_hook(fn)``), and backward passes that
do not accumulate into them (``backward(inputs=...)``, ``torch.autograd.grad``).

protrain makes an offloaded parameter's gradient inside the compiled graph (``chunk_grad`` packs it
and sends it to the host) and hands autograd none for it, so autograd calls the parameter's hooks
with ``None``: a hook that scales or clips the gradient crashed on it, one that tolerated it was
skipped, and the training differed from eager's silently. Before a compiled call with gradients,
each such hook is wrapped (:func:`prepare`) so that autograd's call with ``None`` does nothing,
and the chunk's gradient path runs the hooks themselves on the real gradient, in registration
order, taking what they return (:func:`with_param_hooks`), before the gradient is packed: eager's
order (a hook runs on the parameter's whole gradient before it is accumulated).
``register_post_accumulate_grad_hook`` on an offloaded parameter is refused: its accumulation
finishes on the host worker, after backward has moved on.

Eager accumulates into ``p.grad`` only what the backward pass was asked for:
``backward(inputs=[...])`` leaves the other parameters alone and ``torch.autograd.grad``
accumulates nothing. The chunk's gradient path asks autograd's engine whether it runs each
parameter's accumulation in the pass under way (:func:`only_accumulated`): a parameter it does not
is left alone (before, every offloaded parameter got its gradient, 0.01 off after one step at lr
1e-2); one that ``torch.autograd.grad`` was asked for raises a ``ProtrainError`` (its gradient is
made inside the graph, not returned through it).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.graph import get_gradient_edge

from protrain_fx.errors import ProtrainError


def hooked(p) -> bool:
    """Whether ``p`` has gradient hooks (protrain's own post-accumulate hooks, marked
    ``protrain_own``, among them: the profiler's, data parallel's)."""
    return bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))


def prepare(params: list) -> None:
    """Wrap the gradient hooks of the offloaded ones among ``params`` (once each)."""
    from protrain_fx.runtime.chunk_store import store_of

    for p in params:
        s = store_of(p)
        if not hooked(p) or s is None or not s.param_is_offloaded(p):
            continue
        post = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        if any(not getattr(fn, "protrain_own", False) for fn in post.values()):
            raise ProtrainError(
                f"protrain: parameter {s.entry(p).fqn!r} is offloaded to the host and has a "
                "post-accumulate-grad hook: its gradient is accumulated on the host after "
                "backward has moved on; use p.register_hook(fn) (fn gets the gradient) or change "
                "p.grad after backward()"
            )
        hooks = p._backward_hooks or {}
        for key, fn in list(hooks.items()):
            if not getattr(fn, "_protrain_wrapped", False):
                hooks[key] = _on_real_gradient_only(fn)


def _on_real_gradient_only(fn):
    @functools.wraps(fn)
    def wrapper(grad):
        return None if grad is None else fn(grad)

    wrapper._protrain_wrapped = True
    wrapper.user_hook = fn
    return wrapper


def with_param_hooks(params: list, grads: list) -> list:
    """``grads`` (one per parameter of ``params``, None for one gone) with each parameter's
    wrapped hooks run on it, in order, a hook's non-None result replacing it."""
    out = list(grads)
    for k, p in enumerate(params):
        hooks = p._backward_hooks if p is not None else None
        for fn in hooks.values() if hooks else ():
            user = getattr(fn, "user_hook", None)
            if user is not None:
                result = user(out[k])
                if result is not None:
                    out[k] = result
    return out


def only_accumulated(store, members: list, grads: list, rows: bool) -> tuple[list, list]:
    """The store entries ``members`` (with their ``grads``) whose accumulation the backward pass
    under way runs; none where one of several with ``rows`` (an embedding's) is left out."""
    keep = []
    for i in members:
        p = store.param(i)
        if p is None or not p.requires_grad:
            keep.append(False)
            continue
        try:
            keep.append(torch._C._will_engine_execute_node(_accumulate_node(p)))
        except RuntimeError:  # captured: torch.autograd.grad was asked for this parameter
            raise ProtrainError(
                f"protrain: torch.autograd.grad was asked for the gradient of "
                f"{store.entries[i].fqn!r}, an offloaded parameter, whose gradient protrain makes "
                "inside the compiled graph and accumulates into p.grad on the host, not returned "
                "through autograd; use loss.backward() (or backward(inputs=[...])) and read p.grad"
            ) from None
    if all(keep):
        return members, grads
    if rows or not any(keep):
        return [], []
    return [i for i, k in zip(members, keep) if k], [g for g, k in zip(grads, keep) if k]


_NEXT: list = [None, {}]  # the autograd node running last asked about, its inputs' nodes by leaf


def _accumulate_node(p):
    """``p``'s AccumulateGrad node, from the autograd node running now (the compiled graph's
    backward, whose inputs ``p`` is one of): below autograd ``get_gradient_edge`` cannot make
    it. The node's inputs are indexed once per node and backward (every chunk of a graph asks: a
    scan per parameter was quadratic in the graph's inputs)."""
    node = torch._C._current_autograd_node()
    if node is not None and _NEXT[0] is not node:
        by_leaf = {id(fn.variable): fn for fn, _ in node.next_functions if hasattr(fn, "variable")}
        _NEXT[:] = [node, by_leaf]
        # dropped when this backward ends: the nodes hold their parameters
        torch.autograd.Variable._execution_engine.queue_callback(_forget_nodes)
    fn = _NEXT[1].get(id(p)) if node is not None else None
    return fn if fn is not None else get_gradient_edge(p).node


def _forget_nodes() -> None:
    _NEXT[:] = [None, {}]
