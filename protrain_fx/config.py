"""Process-wide defaults for protrain's options: where ``torch.compile(model, backend="protrain")`` is called
with no options (a training framework compiles the model, a script cannot pass a dict), the options come
from here.

Precedence, highest first: the ``options`` dict of the ``torch.compile`` call, :func:`configure`, the
environment (``PROTRAIN_MEMORY_BUDGET``, e.g. ``24GiB``: the device memory the automatic plan may use).
Every value is validated like the dict's (protrain_fx/options.py) when a graph is compiled.
"""
from __future__ import annotations

import os
from typing import Any

ENV_MEMORY_BUDGET = "PROTRAIN_MEMORY_BUDGET"
_configured: dict[str, Any] = {}


def configure(**options: Any) -> None:
    """Set default options for every later protrain compile in this process (``None`` unsets one), e.g.
    ``protrain_fx.configure(memory_budget="24GiB")``. The optimizer cannot be a default: protrain finds the
    user's Adam/AdamW by itself, or it is given per compile."""
    from protrain_fx.options import Options
    from protrain_fx.errors import OptionsError

    valid = [k for k in Options.valid_keys() if k != "optimizer"]
    unknown = sorted(k for k in options if k not in valid)
    if unknown:
        raise OptionsError(f"configure(): unknown option(s) {unknown}; valid options are: {', '.join(valid)}")
    Options.from_dict({k: v for k, v in options.items() if v is not None})  # validated now, not at compile
    for k, v in options.items():
        if v is None:
            _configured.pop(k, None)
        else:
            _configured[k] = v


def defaults() -> dict[str, Any]:
    """The default options: the environment's, then configure()'s over them."""
    out: dict[str, Any] = {}
    budget = os.environ.get(ENV_MEMORY_BUDGET)
    if budget:
        out["memory_budget"] = budget
    out.update(_configured)
    return out


def with_defaults(options: dict | None) -> dict | None:
    """``options`` over the defaults (a new dict; ``options`` itself when there are no defaults, so that a
    non-dict is still refused by Options.from_dict)."""
    base = defaults()
    if not base or not isinstance(options, (dict, type(None))):
        return options
    return {**base, **(options or {})}
