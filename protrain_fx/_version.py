"""The package version (pyproject.toml says the same): part of every plan cache key; with a digest
of the modules that define protrain's custom ops, part of Inductor's (:func:`ops_fingerprint`)."""

import functools
import hashlib
import os

__version__ = "0.1.0"


@functools.lru_cache(maxsize=None)
def ops_fingerprint() -> str:
    """protrain's version and a digest of runtime/ops.py and runtime/loss_ops.py (read as files:
    nothing is imported), for Inductor's cache key (protrain_fx/_compat.py)."""
    digest = hashlib.sha256()
    for name in ("ops.py", "loss_ops.py"):
        with open(os.path.join(os.path.dirname(__file__), "runtime", name), "rb") as f:
            digest.update(f.read())
    return f"protrain-{__version__}-{digest.hexdigest()[:16]}"
