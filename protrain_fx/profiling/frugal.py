"""The profiling plan: the graph compiled under the most frugal plan (every chunk offloaded, every
block recomputed; when its blocks repeat, a copy with three of them whose measurements stand for all
blocks, protrain_fx/graph/shorten.py) and one profiled step on the real inputs
(protrain_fx/profiling/profiler.py), nothing of which reaches training; then the parameters are
given back, so that the chosen plan places them afresh. protrain_fx/autoplan.py calls it when the
graph's profile is not in the profile cache.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import torch

from protrain_fx import config, progress
from protrain_fx.errors import NoPlanFits
from protrain_fx.graph import sizes
from protrain_fx.graph.fx import copy_graph_module
from protrain_fx.graph.shorten import shorten
from protrain_fx.machine import allocator
from protrain_fx.options import Options, format_bytes
from protrain_fx.profiling.profiler import expand_profile, profile_step
from protrain_fx.runtime.chunk_store import store_of
from protrain_fx.runtime.param_values import dissolve_store

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def oom_request_bytes(message: str) -> int:
    """The request that failed, from a CUDA out-of-memory message (0 where it names none)."""
    m = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


def oom_need_bytes(e: BaseException, device: torch.device) -> int:
    """What a step that ran out of device memory needed at least: what was allocated when it failed
    plus the request that failed (from torch's message; what is allocated now where it says
    nothing)."""
    msg = str(e)
    if m := re.search(r"([\d.]+) (B|KiB|MiB|GiB|TiB) is allocated by PyTorch", msg):
        allocated = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    return int(allocated + oom_request_bytes(msg))


def profile_frugal(
    gm,
    example_inputs,
    structure,
    opts: Options,
    fixed: dict,
    default_size: int,
    compile_profiling,
    live: list,
    existing: dict,
    notes: list,
    device: torch.device,
    regions,
    alloc: allocator.AllocatorState,
):
    """Compile the graph under the most frugal plan (on a short copy when its blocks repeat), run
    one profiled step and give the parameters back: ``(step, static, compile seconds, the profiling
    plan, host bytes the plan's store frees as it takes the parameters over)``."""
    n_blocks = len(structure.blocks)
    prog = progress.current()
    short, whole_why = (
        (None, "PROTRAIN_PROFILE_WHOLE=1")
        if config.settings().profile_whole
        else (None, "compiled in regions: each distinct block once")
        if regions is not None
        else shorten(gm, structure)
    )
    profiled = short.structure if short is not None else structure
    n_profiled = len(profiled.blocks)
    if short is not None:
        notes.append(
            f"profiled a copy of the graph with {n_profiled} of its {n_blocks} blocks (the first, "
            "a middle and the last; the others compute the same)"
        )
    elif n_blocks:
        notes.append(f"profiled the whole graph: {whole_why}")
    frugal = dataclasses.replace(
        opts,
        chunk_size=default_size,
        n_persist=0,
        n_shard=0,  # every chunk offloaded, none sharded on the devices (given or not)
        n_buffer=fixed["n_buffer"],
        n_swap=0,
        n_checkpoint=n_profiled,
        dump_dir=opts.dump_dir and os.path.join(opts.dump_dir, "profiling"),
    )
    t0 = time.perf_counter()
    with prog.phase(
        "profiling compile",
        "compiling the profiling plan (every chunk offloaded, every block recomputed"
        + (f"; {n_profiled} of {n_blocks} blocks" if short is not None else "")
        + f"; {opts.compiler})",
    ):
        compiled, plan = compile_profiling(
            short.gm if short is not None else copy_graph_module(gm), frugal, profiled
        )
    compile_s = time.perf_counter() - t0
    stores = list({id(s): s for s in (store_of(p) for p in live) if s is not None}.values())
    try:
        with prog.phase("profiling", "profiling one step (1 + 2 runs)"):
            step = profile_step(
                compiled, sizes.profiled_inputs(example_inputs), stores, n_profiled, device
            )
        grad_elem = {k: v for s in stores for k, v in s.oversized_grad_elems().items()}
        tied = {k: v for s in stores for k, v in s.row_tables(tied=True).items()}
        tables = {k: v for s in stores for k, v in s.row_tables().items()}
    except torch.OutOfMemoryError as e:
        factor, extra = allocator.fragmentation(alloc) or (1.0, 0)
        least = int(oom_need_bytes(e, device) * factor + extra)
        raise NoPlanFits(
            "protrain could not profile this graph: even the most frugal plan (every chunk "
            "offloaded, every block recomputed) ran out of device memory, so every plan needs more "
            f"than {format_bytes(least)} ({str(e).splitlines()[0]}): give a budget (or a device) "
            f"larger than {format_bytes(least)}, or a smaller batch or sequence",
            min_device_bytes=least,
        ) from e
    finally:
        del compiled
    static = plan.static_profile
    if short is not None:
        step, static = expand_profile(step, static, short.expand)
    step = dataclasses.replace(
        step, oversized_grad_elem=grad_elem, tied_row_tables=tied, row_tables=tables
    )
    host_freed = 0  # host bytes the plan's store frees as it takes the parameters over
    if not existing:
        for s in stores:
            host_freed += sum(s.master[c].nbytes for c in s.offloaded_chunks)
            dissolve_store(s)  # its transfer copies are freed here, its masters by the plan's store
    del stores
    if device.type == "cuda":
        torch.cuda.empty_cache()

    return step, static, compile_s, plan, host_freed
