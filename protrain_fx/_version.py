"""The package version (pyproject.toml says the same): part of every plan cache key; with a digest
of the modules that define protrain's custom ops, part of Inductor's (:func:`ops_fingerprint`); a
digest of all of protrain's source, part of the compile cache's (:func:`source_fingerprint`)."""

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


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """A digest of every module of protrain_fx and its passes (read as files), for the key of code
    served without running the passes again (protrain_fx/code_cache.py)."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.find_spec("protrain_fx.passes")
    folders = [here] + list(spec.submodule_search_locations or []) if spec else [here]
    digest = hashlib.sha256(__version__.encode())
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, folder).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:20]
