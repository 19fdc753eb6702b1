"""``torch.compile(..., backend="protrain", options={...})`` parsed into a validated
:class:`Options`.

Every key is checked: an unknown key is an error that lists the valid ones, and a bad value is an
error that says what was expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from protrain_fx import config
from protrain_fx.errors import OptionsError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, *, what: str = "size") -> int:
    """``24 * 2**30``, ``"24GiB"``, ``"500MB"``, ``"1.5 GiB"`` -> bytes. KB/MB/GB are powers of 10,
    KiB/MiB/GiB powers of 2."""
    if isinstance(value, bool):
        raise OptionsError(
            f"{what}: expected bytes as an int or a string like '24GiB', got {value!r}"
        )
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise OptionsError(
                f"{what}: cannot parse {value!r}; expected an int number of bytes or a number with "
                "a unit "
                f"({', '.join(('B', 'KB', 'MB', 'GB', 'TB', 'KiB', 'MiB', 'GiB', 'TiB'))}), "
                "e.g. '24GiB'"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise OptionsError(
            f"{what}: expected bytes as an int or a string like '24GiB', got {type(value).__name__}"
        )
    if n <= 0:
        raise OptionsError(f"{what}: must be positive, got {value!r}")
    return n


def format_bytes(n: float | int | None) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: ``format_bytes(3 * 2**30) ==
    '3.00 GiB'``."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


COMPILERS = ("inductor", "eager")


class WeakOptimizer:
    """What the user's options dict holds in place of the optimizer once protrain has read it:
    dynamo keeps that dict for the life of its cache (beyond the model), and the optimizer holds the
    model's parameters. Attribute access goes to the optimizer while it lives."""

    def __init__(self, opt):
        import weakref

        self._ref = weakref.ref(opt)

    def __call__(self):
        return self._ref()

    def __getattr__(self, name):
        if name.startswith("__") or name == "_ref":  # copy/pickle probes, an object made bare
            raise AttributeError(name)
        opt = self._ref()
        if opt is None:
            raise AttributeError(f"the optimizer was freed ({name})")
        return getattr(opt, name)

    def __deepcopy__(self, memo):  # a copied compiled model names the same optimizer
        return self

    def __repr__(self) -> str:
        return f"WeakOptimizer({self._ref()!r})"


def _resolve(value):
    return value() if isinstance(value, WeakOptimizer) else value


def forget_optimizer(options) -> None:
    """Replace the optimizer in the user's options dict by a :class:`WeakOptimizer` (see there)."""
    if isinstance(options, dict) and isinstance(options.get("optimizer"), torch.optim.Optimizer):
        options["optimizer"] = WeakOptimizer(options["optimizer"])


PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Options whose feature is not part of this version yet: name -> the feature that will read it.


@dataclass(frozen=True)
class Options:
    """The validated options of one ``torch.compile(..., backend="protrain")`` call.

    ``None`` means "choose automatically". Sizes are bytes.
    """

    optimizer: torch.optim.Optimizer | None = None  # compared by identity
    memory_budget: int | None = None
    chunk_size: int | None = None
    n_persist: int | None = None
    # data parallel: of the chunks after the first n_persist, how many keep their shards of master,
    # gradient and moments on the devices instead of the host (runtime/chunk_store.py); None: as
    # the automatic plan chooses (plan/ranks_cost.py; 0 without one)
    n_shard: int | None = None
    n_buffer: int | None = None
    n_swap: int | None = None
    n_checkpoint: int | None = None
    # the share of offloaded chunks whose Adam step runs on the compute device, streamed
    # (protrain_fx/runtime/device_steps.py); None: as the automatic plan chooses (0 without one)
    device_steps: float | None = None
    param_dtype: torch.dtype | None = None
    # offloaded chunks keep a host copy in param_dtype, written by the CPU step (False: a gather
    # uploads the fp32 master and casts it on the device; None: as the automatic plan chooses,
    # copies unless the host cannot hold them)
    transfer_copies: bool | None = None
    dump_dir: str | None = None
    compiler: str = "inductor"

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "Options":
        """Validate a user's ``options`` dict. ``PROTRAIN_DUMP_DIR`` in the environment sets
        ``dump_dir`` when the dict does not."""
        if options is not None and not isinstance(options, dict):
            raise OptionsError(
                f"options must be a dict such as {{'memory_budget': '24GiB'}}, got "
                f"{type(options).__name__} "
                f"{options!r:.60}"
            )
        raw = {k: _resolve(v) for k, v in (options or {}).items()}
        valid = cls.valid_keys()
        unknown = sorted(k for k in raw if k not in valid)
        if unknown:
            raise OptionsError(
                f"unknown protrain option(s) {unknown}; valid options are: {', '.join(valid)}"
            )
        kw: dict[str, Any] = {}
        for key in ("chunk_size", "memory_budget"):
            if raw.get(key) is not None:
                kw[key] = parse_bytes(raw[key], what=key)
        for key in ("n_persist", "n_shard", "n_buffer", "n_swap", "n_checkpoint"):
            v = raw.get(key)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise OptionsError(
                        f"{key}: expected an int >= 0 (or None for automatic), got {v!r}"
                    )
                kw[key] = v
        v = raw.get("device_steps")
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise OptionsError(
                    f"device_steps: expected a share between 0 and 1 (or None for automatic), got "
                    f"{v!r}"
                )
            kw["device_steps"] = float(v)
        if raw.get("optimizer") is not None:
            opt = raw["optimizer"]
            if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
                raise OptionsError(
                    "optimizer: protrain steps offloaded chunks on the host with its own Adam, so "
                    "it takes torch.optim.Adam and torch.optim.AdamW instances, got "
                    f"{type(opt).__name__}. Use one of those, or leave 'optimizer' out of the "
                    "options: every chunk then stays resident on the device (nothing offloaded) "
                    f"and your {type(opt).__name__} steps as it does in eager"
                )
            kw["optimizer"] = opt
        if raw.get("param_dtype") is not None:
            v = raw["param_dtype"]
            dt = PARAM_DTYPES.get(v) if isinstance(v, str) else v
            if dt not in PARAM_DTYPES.values():
                raise OptionsError(
                    f"param_dtype: expected one of {list(PARAM_DTYPES)} (or the torch dtype), got "
                    f"{v!r}"
                )
            kw["param_dtype"] = dt
        dump_dir = raw.get("dump_dir") or config.settings().dump_dir
        if dump_dir is not None:
            if not isinstance(dump_dir, (str, os.PathLike)):
                raise OptionsError(f"dump_dir: expected a path, got {type(dump_dir).__name__}")
            kw["dump_dir"] = os.fspath(dump_dir)
        v = raw.get("transfer_copies")
        if v is not None:
            if not isinstance(v, bool):
                raise OptionsError(
                    f"transfer_copies: expected True or False (or None for automatic), got {v!r}"
                )
            kw["transfer_copies"] = v
        compiler = raw.get("compiler", "inductor")
        if compiler not in COMPILERS:
            raise OptionsError(f"compiler: expected one of {list(COMPILERS)}, got {compiler!r}")
        kw["compiler"] = compiler
        return cls(**kw)
