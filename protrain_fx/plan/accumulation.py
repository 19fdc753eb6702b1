"""Gradient accumulation in the cost model: an optimizer step of ``k`` micro-steps
(``Hardware.micro_steps``: declared with ``protrain_fx.set_grad_accumulation``, or learned by the
loop's last run, plan_cache.micro_steps) runs forward and backward ``k`` times and the optimizers
once, after the last backward (runtime/hybrid_optim.py steps an offloaded chunk when its learned
number of gradients has arrived). From the second micro-step on, an offloaded chunk's gradient is
added to the one its accumulator holds: on the compute device (runtime/grad_add.py) the
accumulator comes up on the host-to-device link beside the chunk's re-gather, 4 bytes a parameter
in the master dtype (on the H100 the 3B shape's backward took 181 ms longer with it,
benchmarks/results/loop_at_scale_h100_run53a.md); on the host the worker adds the staged gradient
(runtime/chunk_grads.py), three master-dtype passes over host memory beside backward. Everything
here is per layout (LayoutCosts) and O(1) per n_persist, as the rest of the cost model.
"""

from __future__ import annotations


def micro_steps_s(lc, first: int, t_fwd: float, t_bwd: float) -> tuple[float, float]:
    """``(before, t_bwd_last)``: the seconds of the micro-steps before the last one (the first with
    backward ``t_bwd``, the middle ones with the add), and the last micro-step's backward (with the
    add); ``(0, t_bwd)`` for one micro-step. ``first``: the first offloaded chunk."""
    k = lc.hw.micro_steps
    if k <= 1:
        return 0.0, t_bwd
    t_add = t_bwd + added_s(lc, first)
    return t_fwd + t_bwd + (k - 2) * (t_fwd + t_add), t_add


def added_s(lc, first: int) -> float:
    """What adding the gradients of the offloaded chunks ``first..`` to their accumulators adds to
    one backward: on the device, per chunk ``max(compute, traffic + accumulator up)`` in place of
    ``max(compute, traffic)``; on the host, the worker's adds where they outlast backward's compute
    of those chunks."""
    table = getattr(lc, "_added", None)
    if table is None:
        table = lc._added = _added_table(lc)
    return table[-1] - table[first]


def _added_table(lc) -> list[float]:
    """Prefix sums over chunks of the extra seconds the add costs in backward (see added_s)."""
    A, hw, me = lc.arrays, lc.hw, lc.prof.master_elem
    on_device = hw.grads_added_on_device and hw.world_size == 1
    out = [0.0]
    for c, ch in enumerate(lc.prof.chunks):
        b = lc.bwd_chunk[c]
        if on_device:
            extra = max(b, A.comm[c] + ch.numel * me / hw.h2d_bytes_per_s) - max(b, A.comm[c])
        elif hw.host_bytes_per_s:
            extra = max(0.0, 3 * ch.numel * me / hw.host_bytes_per_s - max(b, A.comm[c]))
        else:
            extra = 0.0
        out.append(out[-1] + extra)
    return out
