"""Configuration in one place: process-wide default options and every environment variable protrain
reads.

Options come, highest first, from the ``options`` dict of the ``torch.compile`` call, from
:func:`configure` (for frameworks that compile the model themselves, where a script cannot pass a
dict), and from the environment (``PROTRAIN_MEMORY_BUDGET``, e.g. ``24GiB``). Every value is
validated like the dict's (protrain_fx/options.py) when a graph is compiled.

The environment is read here and nowhere else (a test keeps it so): :func:`settings` parses every
variable protrain knows, with one reading of true and false, into a typed :class:`Settings`, each
time it is called, so a variable set before a compile is seen by that compile. The debugging
switches (``PROTRAIN_DEBUG_*``) are read once, when the runtime module that uses them is imported.
:data:`VARIABLES` documents each one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from protrain_fx.errors import OptionsError

# name -> what it does (README and docs/design.md list the same)
VARIABLES = {
    "PROTRAIN_MEMORY_BUDGET": "default memory_budget (e.g. 24GiB): the device memory the automatic "
    "plan may use",
    "PROTRAIN_AUTOPLAN": "0: no automatic plan (knobs not given mean everything resident, "
    "activations kept)",
    "PROTRAIN_PLAN_CACHE": "0: never read or write the plan cache",
    "PROTRAIN_CACHE_DIR": "where the hardware profile, plan cache, CPU Adam kernel and compiled "
    "codes' sidecars are kept",
    "PROTRAIN_REFRESH_HARDWARE": "1: measure the hardware again instead of reading its cached "
    "profile",
    "PROTRAIN_HOST_MEMORY": "host memory protrain may plan with (e.g. 100GiB), instead of what the "
    "host reports",
    "PROTRAIN_DUMP_DIR": "default dump_dir: graph dumps per stage and the plan",
    "PROTRAIN_CPU_ADAM": "torch: the CPU optimizer step uses torch's AdamW instead of protrain's "
    "one-pass kernel",
    "PROTRAIN_DEVICE_STEPS": "0: the automatic plan steps every offloaded chunk on the CPU (none "
    "on the device, streamed: protrain_fx/runtime/device_steps.py)",
    "PROTRAIN_PROFILE_BLOCKS": "1: time every block in the chosen plan's steps too (block marks in "
    "the graph)",
    "PROTRAIN_PROFILE_WHOLE": "1: profile the whole graph, not a copy of it with three of its "
    "blocks (protrain_fx/graph/shorten.py)",
    "PROTRAIN_REGIONS": "0: compile a training graph whole instead of one region per block, each "
    "distinct block compiled once (protrain_fx/graph/regions.py)",
    "PROTRAIN_COMPILE_CACHE": "0: compile every graph's code again in every run instead of "
    "serving it from aot_autograd's cache with what its compile did (protrain_fx/code_cache.py)",
    "PROTRAIN_TRIM_HOLES": "0: never give the CUDA allocator's free pages back at a step boundary "
    "where it holds more than the plan's predicted peak (protrain_fx/machine/allocator.py)",
    "PROTRAIN_DEVICE_GRAD_ADD": "0: add an offloaded chunk's later gradients (accumulation) into "
    "its host accumulator on the host worker instead of on the compute device "
    "(protrain_fx/runtime/grad_add.py)",
    "PROTRAIN_PROFILE_SPIN_S": "seconds of device-side spin ahead of the profiled step (default "
    "0.003)",
    "PROTRAIN_DEBUG_SYNC": "1: synchronize the device around every chunk and swap copy; offload / "
    "reload: "
    "after those swap copies only",
    "PROTRAIN_DEBUG_POISON": "1: fill a chunk buffer with NaN once its gather has copied it out",
    "PROTRAIN_DEBUG_DEFER_OFFLOAD": "1: on the CPU, copy a swapped activation only at its "
    "offload_wait",
    "PROTRAIN_LOSS_CHUNK_BYTES": "fp32 bytes of logits per chunk of the chunked cross-entropy "
    "(default 128MiB; passes/chunked_loss.py)",
    "PROTRAIN_DISABLE_PASSES": "comma-separated graph passes to skip (debugging; "
    "protrain_fx/pipeline.py)",
}
# the chunked cross-entropy's fp32 logits per chunk (passes/chunked_loss.py)
LOSS_CHUNK_BYTES = 128 << 20
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise OptionsError(f"{name}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def _choice(name: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, "").strip().lower()
    if value not in choices:
        raise OptionsError(
            f"{name}={value!r}: expected one of {', '.join(repr(c) for c in choices)}"
        )
    return value


def cpu_adam_choice() -> str:
    """``PROTRAIN_CPU_ADAM`` alone ("" or "torch"): read on the per-chunk optimizer path, where
    parsing every variable each time would be wasted work."""
    return _choice("PROTRAIN_CPU_ADAM", ("", "torch"))


def _float(name: str) -> float | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return float(raw)
    except ValueError:
        raise OptionsError(f"{name}={raw!r}: expected a number of seconds") from None


def _bytes(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    from protrain_fx.options import parse_bytes

    value = parse_bytes(raw, what=name)
    if value < 1:
        raise OptionsError(f"{name}={raw!r}: expected a positive size (e.g. 64MiB)")
    return value


def _text(name: str) -> str | None:
    return os.environ.get(name) or None


@dataclass(frozen=True)
class Settings:
    """The environment as protrain reads it (see :data:`VARIABLES`)."""

    memory_budget: str | None
    autoplan: bool
    plan_cache: bool
    cache_dir: str | None
    refresh_hardware: bool
    # parsed by protrain_fx.machine.memory, which names the variable in its error
    host_memory: str | None
    dump_dir: str | None
    cpu_adam: str  # "" or "torch"
    device_steps: bool
    profile_blocks: bool
    profile_whole: bool
    regions: bool
    compile_cache: bool
    trim_holes: bool
    device_grad_add: bool
    profile_spin_s: float | None
    debug_sync: str  # "", "1", "offload" or "reload"
    debug_poison: bool
    debug_defer_offload: bool
    disable_passes: tuple[str, ...]
    loss_chunk_bytes: int
    # not protrain's, read here too so that no other module touches os.environ
    xdg_cache_home: str | None
    cc: str | None
    pytorch_alloc_conf: str  # PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF, comma-joined

    @property
    def sync_chunks(self) -> bool:
        return self.debug_sync == "1"

    @property
    def sync_offload(self) -> bool:
        return self.debug_sync in ("1", "offload")

    @property
    def sync_reload(self) -> bool:
        return self.debug_sync in ("1", "reload")


def settings() -> Settings:
    """The environment now, parsed (a bad value is an OptionsError that names the variable)."""
    return Settings(
        memory_budget=_text("PROTRAIN_MEMORY_BUDGET"),
        autoplan=_flag("PROTRAIN_AUTOPLAN", True),
        plan_cache=_flag("PROTRAIN_PLAN_CACHE", True),
        cache_dir=_text("PROTRAIN_CACHE_DIR"),
        refresh_hardware=_flag("PROTRAIN_REFRESH_HARDWARE", False),
        host_memory=_text("PROTRAIN_HOST_MEMORY"),
        dump_dir=_text("PROTRAIN_DUMP_DIR"),
        cpu_adam=cpu_adam_choice(),
        device_steps=_flag("PROTRAIN_DEVICE_STEPS", True),
        profile_blocks=_flag("PROTRAIN_PROFILE_BLOCKS", False),
        profile_whole=_flag("PROTRAIN_PROFILE_WHOLE", False),
        regions=_flag("PROTRAIN_REGIONS", True),
        compile_cache=_flag("PROTRAIN_COMPILE_CACHE", True),
        trim_holes=_flag("PROTRAIN_TRIM_HOLES", True),
        device_grad_add=_flag("PROTRAIN_DEVICE_GRAD_ADD", True),
        profile_spin_s=_float("PROTRAIN_PROFILE_SPIN_S"),
        debug_sync=_choice("PROTRAIN_DEBUG_SYNC", ("", "0", "1", "offload", "reload")).replace(
            "0", ""
        ),
        debug_poison=_flag("PROTRAIN_DEBUG_POISON", False),
        debug_defer_offload=_flag("PROTRAIN_DEBUG_DEFER_OFFLOAD", False),
        disable_passes=tuple(
            p.strip() for p in os.environ.get("PROTRAIN_DISABLE_PASSES", "").split(",") if p.strip()
        ),
        loss_chunk_bytes=_bytes("PROTRAIN_LOSS_CHUNK_BYTES", LOSS_CHUNK_BYTES),
        xdg_cache_home=_text("XDG_CACHE_HOME"),
        cc=_text("CC"),
        pytorch_alloc_conf=",".join(
            os.environ.get(k, "") for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
        ),
    )


# ------------------------------------------------------------------------------ default options
_configured: dict[str, Any] = {}


def configure(**options: Any) -> None:
    """Set default options for every later protrain compile in this process (``None`` unsets one),
    e.g. ``protrain_fx.configure(memory_budget="24GiB")``. The optimizer cannot be a default:
    protrain finds the user's Adam/AdamW by itself, or it is given per compile."""
    from protrain_fx.options import Options

    valid = [k for k in Options.valid_keys() if k != "optimizer"]
    unknown = sorted(k for k in options if k not in valid)
    if unknown:
        raise OptionsError(
            f"configure(): unknown option(s) {unknown}; valid options are: {', '.join(valid)}"
        )
    Options.from_dict({k: v for k, v in options.items() if v is not None})  # validated now
    for k, v in options.items():
        if v is None:
            _configured.pop(k, None)
        else:
            _configured[k] = v


def defaults() -> dict[str, Any]:
    """The default options: the environment's, then configure()'s over them."""
    out: dict[str, Any] = {}
    budget = settings().memory_budget
    if budget:
        out["memory_budget"] = budget
    out.update(_configured)
    return out


def with_defaults(options: dict | None) -> dict | None:
    """``options`` over the defaults (a new dict; ``options`` itself when there are no defaults, so
    that a non-dict is still refused by Options.from_dict)."""
    base = defaults()
    if not base or not isinstance(options, (dict, type(None))):
        return options
    return {**base, **(options or {})}
