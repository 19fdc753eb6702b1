"""Compiled code across runs: aot_autograd's cache behind protrain's compilers.

A warm run (the plan cache and Inductor's caches filled by an earlier run of the same script) still
traced every graph's joint with aot_autograd, ran Inductor's joint passes, protrain's passes and the
partition, and only then got its kernels from Inductor's FX graph cache: 1-3 s per region code,
where torch.compile's own warm run loads the whole model's code from ``AOTAutogradCache``. That
cache serves any compiler whose forward returns Inductor's ``OutputCode``
(``SerializableAOTDispatchCompiler``), which protrain's does; but protrain's compile also *does*
things a cache hit would skip: the partition binds the graph's parameters to chunk stores
(placement, optimizer attachment), the passes write what the runtime and the plan summary read (the
values a swap block sends to the host, the saved values, the chunks gathered at once, notes), and
the compiled graphs are wrapped in protrain's run-time guards. So a graph's code is served from the
cache only with a *sidecar* written when it was compiled, which replays all of it: the stores are
made again from the options (as the partition makes them), the fields the passes declare as writes
(protrain_fx/pipeline.py) come from the sidecar, the chunk buffers are allocated, and the loaded
forward and backward get the guards. The sidecar's key covers the dynamo graph, its inputs and
everything protrain's passes read beyond them (the options, the plan's decision, where parameters
already in stores sit, the autocast dtypes, the environment, a digest of protrain's source); it goes
into aot_autograd's key as a tag, so an entry is never served for another plan. A hit without its
sidecar (deleted) is compiled again with the cache off. The profiling plan's codes are served too,
with the static profile their partitions gave (saved bytes per block and policy, recomputed shares,
block signatures): a run under another budget profiles without compiling again. Not used for dumps,
with several ranks or with the eager compiler; ``PROTRAIN_COMPILE_CACHE=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Callable

import torch

from protrain_fx import _compat, _version, config, placement
from protrain_fx.machine import profile
from protrain_fx.profiling import static
from protrain_fx.runtime.binding import placement_signature
from protrain_fx.runtime.chunk_store import store_of

log = logging.getLogger(__name__)

SIDECAR_VERSION = 2
SERVED_NOTE = "code served from aot_autograd's cache (protrain_fx/code_cache.py)"


@dataclasses.dataclass
class Sidecar:
    """What one graph's compile did beyond its code."""

    stages: list[str]  # the pipeline stages it ran: joint, forward, backward, or inference
    activation_bytes: int  # what the joint graph saves for backward (the placement's estimate)
    gathers: bool  # it gathers offloaded chunks: chunk buffers needed
    saved_names: list[str]
    swapped: dict[str, int]
    chunks_in_use: int
    notes: list[str]  # the notes its passes wrote
    # the profiling plan's: what its partitions say per block (profiling/static.py), as a dict
    static_profile: dict | None = None

    @classmethod
    def of(cls, compiler) -> Sidecar:
        plan = compiler.plan
        return cls(
            list(compiler.stages),
            int(compiler.activation_bytes),
            bool(compiler.gathers),
            list(plan.saved_names),
            dict(plan.swapped),
            int(plan.chunks_in_use),
            list(compiler.pass_notes),
            dataclasses.asdict(plan.static_profile) if plan.static_profile is not None else None,
        )


def compile_graph(compiler, gm, example_inputs, run: Callable):
    """``run(fw_compiler)`` (the aot_autograd call for ``gm`` with ``compiler``'s callbacks and the
    forward compiler given) through the cache, when ``compiler``'s graph may use it."""
    key = _key(compiler, gm, example_inputs)
    if key is None:
        return run(compiler.forward)
    sidecar = _read(key)
    # written once the graph is compiled to its end (a backward compiled at its first call
    # included), before aot_autograd saves the entry
    compiler.on_complete = lambda: _write(key, Sidecar.of(compiler))
    with _compat.aot_cache_served(f"protrain-code-{key}", compiler.guard):
        compiled = run(_compat.serializable_compiler(compiler.forward))
    if compiler.stages:  # compiled (a miss)
        return compiled
    if sidecar is None:  # its sidecar was lost: compile again, keep what that compile does
        log.info("%s: code served without its sidecar, compiled again", compiler.plan.graph_name)
        with _compat.aot_cache_off():
            return run(compiler.forward)
    _replay(compiler, sidecar)
    return compiled


def _replay(compiler, sidecar: Sidecar) -> None:
    """What the compile of a served code did: placement, the passes' writes, buffers."""
    plan = compiler.plan
    compiler.activation_bytes = sidecar.activation_bytes
    compiler.bind("joint" in sidecar.stages)  # a training graph
    plan.saved_names = list(sidecar.saved_names)
    plan.swapped = {k: int(v) for k, v in sidecar.swapped.items()}
    plan.chunks_in_use = max(plan.chunks_in_use, sidecar.chunks_in_use)
    plan.notes.extend(sidecar.notes)
    if sidecar.static_profile is not None:
        plan.static_profile = _static_profile(sidecar.static_profile)
    plan.notes.append(SERVED_NOTE)
    if sidecar.gathers:
        placement.allocate_buffers(plan, None)
    compiler.stages = list(sidecar.stages)
    if not plan.profiling:
        compiler.progress.ready()


def eligible(compiler) -> bool:
    plan, opts = compiler.plan, compiler.options
    return (
        compiler.use_inductor
        and plan.world_size == 1
        and opts.dump_dir is None
        and config.settings().compile_cache
        and _compat.aot_cache_supported()
        and _compat.aot_cache_enabled()
    )


def _key(compiler, gm, example_inputs) -> str | None:
    if not eligible(compiler):
        return None
    plan = compiler.plan
    # parameters an earlier graph (region) placed: where they sit decides what the passes emit
    live = [p for _, _, p in compiler.params]
    placed = placement_signature(live, unplaced=True)
    stores = sorted(
        {(s.n_buffer, s.n_persist, s.transfer_copies) for s in map(store_of, live) if s}
    )
    decision = (
        plan.chunk_size,
        plan.n_persist,
        plan.n_buffer,
        plan.n_swap,
        plan.n_checkpoint,
        plan.n_shard,
        [dataclasses.astuple(b) if dataclasses.is_dataclass(b) else b for b in plan.blocks],
        plan.profile_blocks,
        plan.world_size,
    )
    parts = [
        f"sidecar {SIDECAR_VERSION}",
        _version.source_fingerprint(),
        torch.__version__,
        gm.code,
        repr([_describe_input(x) for x in example_inputs]),
        # the budget decides the plan before the compile, not the code: the profiling plan's code
        # serves every budget
        repr(dataclasses.replace(compiler.options, memory_budget=None)),
        repr(decision),
        repr(placed),
        repr(stores),
        repr(plan.block_structure),
        repr(sorted((k, str(v)) for k, v in compiler.autocast.items())),
        repr(dataclasses.replace(config.settings(), memory_budget=None)),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _static_profile(d: dict) -> static.StaticProfile:
    def tuples(x):  # the signatures are nested tuples, which JSON made lists
        return tuple(tuples(y) for y in x) if isinstance(x, list) else x

    return static.StaticProfile(
        static.SavedBytes(**d["saved"]),
        list(d["recomputed_share"]),
        [tuples(sig) for sig in d["signatures"]],
    )


def _describe_input(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return (
            tuple(x.shape),
            tuple(x.stride()),
            str(x.dtype),
            x.device.type,
            x.requires_grad,
            isinstance(x, torch.nn.Parameter),
        )
    return (type(x).__name__, repr(x) if isinstance(x, (int, float, bool)) else "")


def _path(key: str) -> str:
    return os.path.join(profile.cache_root(), "codes", f"{key}.json")


def _read(key: str) -> Sidecar | None:
    try:
        with open(_path(key)) as f:
            entry = json.load(f)
        return Sidecar(**entry)
    except (OSError, ValueError, TypeError):
        return None


def _write(key: str, sidecar: Sidecar) -> None:
    try:
        profile.write_json(_path(key), dataclasses.asdict(sidecar), "the compile cache's sidecar")
    except OSError as e:  # an unwritable cache costs the next run a compile, nothing else
        log.info("could not write the compile cache's sidecar: %s", e)
