"""Memory before a child starts, from peers.py's bytes per parameter: what a size certainly cannot
run in (:func:`predicted_failure`: model states alone over the device's cap or the host's memory, by
lower bounds; such a row is written, never run) and what a child claims for admission
(:func:`claims`: generous estimates that only decide which children run side by side,
benchmarks/timeshare.py; a child sharing the device is soft-capped at its claim, and a wrong
estimate costs a rerun alone, never a wrong row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import peers
from peers import SYSTEMS

if TYPE_CHECKING:
    from .scheduler import Ctx

# device memory of one process outside PyTorch's allocator (CUDA context, NCCL, cuBLAS)
CONTEXT_GIB = 1.5
HOST_MARGIN_GIB = 8.0  # host memory admission keeps free
# a child claiming more host memory than this is host-heavy: one at a time (timeshare.py)
HEAVY_HOST_GIB = 10.0


def activation_gib(kind: str, cfg: dict, batch: int, seq: int) -> float:
    """A rough size of one step's saved activations in bf16 (34 bytes per token, width and layer for
    a GPT block without attention scores, 50 for a LLaMA block with SwiGLU) plus the logits and
    their gradient; only for admission (benchmarks/timeshare.py), never for a row."""
    d = cfg.get("n_embd", cfg.get("dim"))
    per = 34 if kind == "gpt" else 50
    return batch * seq * (per * d * cfg["n_layer"] + 10 * cfg["vocab_size"]) / 2**30


def predicted_failure(system: str, row: dict, ctx: Ctx) -> str | None:
    """Why ``system`` certainly cannot run this size, from lower bounds of what it must hold
    (peers.py), or None."""
    args = ctx.args
    if SYSTEMS[system].cuda_only and args.device != "cuda":
        return f"needs CUDA: {system} runs on a GPU only (device {args.device})"
    if args.no_predict or args.device != "cuda":
        return None
    n = row["params"]
    limit = row["cap_gib"] or ctx.device_total_gib
    per = peers.DEVICE_BYTES_LOWER_BOUND.get(system, 0)
    if limit and per * n / 2**30 > limit:
        where = f"the {limit:g} GiB cap" if row["cap_gib"] else f"the device's {limit:.0f} GiB"
        return (
            f"OOM (predicted, not run): its model states alone need {per * n / 2**30:.0f} GiB "
            f"on the device ({per} B/param: see peers.DEVICE_BYTES_LOWER_BOUND), more than "
            f"{where}"
        )
    if ctx.host_avail_gib and system in peers.HOST_BYTES_PER_PARAM:
        need = peers.HOST_BYTES_PER_PARAM[system] * offloaded_params(system, row, ctx) / 2**30
        if need > ctx.host_avail_gib:
            per_host = peers.HOST_BYTES_PER_PARAM[system]
            return (
                f"host OOM (predicted, not run): its offloaded model states alone need "
                f"{need:.0f} GiB of host memory ({per_host} B/param), more than the "
                f"{ctx.host_avail_gib:.0f} GiB available at start"
            )
    return None


def offloaded_params(system: str, row: dict, ctx: Ctx) -> float:
    """At least how many parameters have their model states on the host: all, except for protrain,
    which keeps what the device can hold resident (at 16 B/param, activations aside)."""
    n = row["params"]
    if system == "protrain":
        return max(0.0, n - (row["cap_gib"] or ctx.device_total_gib) * 2**30 / 16)
    return n


def claims(system: str, row: dict, sc: dict, ctx: Ctx) -> tuple[float, float, float | None]:
    """(device GiB, host GiB, soft cap GiB or None) this child claims for admission
    (benchmarks/timeshare.py): generous estimates (peers.py), which only decide what runs side by
    side. An uncapped child that shares the device is capped at its claim; if that (or a neighbour)
    makes it fail for memory, it runs again alone (:func:`scheduler.run_job`), so a wrong estimate
    costs time, never a wrong row."""
    n = row["params"]
    host = peers.HOST_OVERHEAD_GIB
    if ctx.args.device != "cuda":
        return 0.0, host + 16 * n / 2**30, None
    # as if everything were offloaded, except uncapped protrain, which offloads only what the device
    # cannot hold
    uncapped_protrain = system == "protrain" and not row["cap_gib"]
    offloaded = offloaded_params(system, row, ctx) if uncapped_protrain else n
    host += peers.HOST_BYTES_PER_PARAM.get(system, 0) * offloaded / 2**30
    if row["cap_gib"]:
        return row["cap_gib"] + CONTEXT_GIB, host, None
    est = peers.DEVICE_BYTES_ESTIMATE.get(system, 16) * n / 2**30 + activation_gib(
        sc["kind"], sc["cfg"], sc["batch"], sc["seq"]
    )
    soft = 1.3 * est + 4.0
    if ctx.args.jobs <= 1 or soft + CONTEXT_GIB >= ctx.device_total_gib:
        return ctx.device_total_gib, host, None  # the whole device: runs alone on it
    return soft + CONTEXT_GIB, host, soft
