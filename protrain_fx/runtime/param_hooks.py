"""Gradient hooks on offloaded parameters (``p.register_hook(fn)``).

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
"""

from __future__ import annotations

import functools

from protrain_fx.errors import ProtrainError


def hooked(p) -> bool:
    return bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))


def prepare(params: list) -> None:
    """Wrap the gradient hooks of the offloaded ones among ``params`` (once each)."""
    from protrain_fx.runtime.chunk_store import store_of

    for p in params:
        s = store_of(p)
        if not hooked(p) or s is None or not s.param_is_offloaded(p):
            continue
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise ProtrainError(
                f"protrain: parameter {s.entry(p).fqn!r} is offloaded to the host and has a "
                "post-accumulate-grad hook: its gradient is accumulated on the host after "
                "backward has moved on; use p.register_hook(fn) (fn gets the gradient) or change "
                "p.grad after backward()"
            )
        hooks = p._backward_hooks
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
