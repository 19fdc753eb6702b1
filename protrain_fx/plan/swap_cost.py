"""What swap blocks' copies make compute wait, block by block (the cost model's swap term beside
its whole-window bound, protrain_fx/plan/cost_model.py).

A swap block's saved activations go to pinned host memory in forward and come back in backward on
the copy streams (passes/swap.py, runtime/swap_pool.py). Copies of one direction run one after
another on their stream, and the graph waits for them at fixed places: block ``b+2``'s forward
for block ``b``'s offload (``offload_wait``), a block's backward for its reload. When a block's
bytes take longer on the bus than the compute they can overlap (a large batch's activations),
compute waits, even if the step as a whole has time to spare: what the whole-window bound alone
missed."""

from __future__ import annotations

from protrain_fx.plan.profiles import GraphProfile, Hardware


def swap_stall_s(prof: GraphProfile, hw: Hardware, n_swap: int, n_checkpoint: int) -> float:
    """What the swap blocks' copies make compute wait, block by block (passes/swap.py,
    runtime/swap_pool.py). Forward: a swap block's saved activations go down on the one
    device-to-host stream, one block's after another's, from the block's start, and block ``b+2``
    waits for block ``b``'s (``offload_wait``). Backward: a swap block's reload starts
    ``reload_lead_blocks`` blocks before its own backward, the reloads one after another on the
    host-to-device stream, and its backward waits for it. Simulated over the blocks' profiled
    compute; the waits are what the steps take beyond that compute. (On the H200, an HF
    Llama-3.2-1B shape at 8 x 2048 with 5 of 16 blocks swapping 1.48 GB each, 27 ms down against
    4.3-4.8 ms of compute per block: forward measured 199 ms against 96 predicted without these
    waits; with them 207.)"""
    blocks = prof.blocks
    n = len(blocks)
    nbytes = [b.keep_bytes - b.swap_resident_bytes for b in blocks[:n_swap]]
    t = down = 0.0
    done: dict[int, float] = {}
    for i in range(n + 2):  # the code after the blocks waits for the last two blocks' offloads
        if i - 2 in done:
            t = max(t, done[i - 2])
        if i >= n:
            continue
        if i < n_swap:
            down = max(t, down) + nbytes[i] / hw.d2h_bytes_per_s
            done[i] = down
        t += blocks[i].fwd_s
    fwd_wait = t - sum(b.fwd_s for b in blocks)
    bwd = [
        b.bwd_s + (b.recompute_cost_s if n_swap <= i < n_swap + n_checkpoint else 0.0)
        for i, b in enumerate(blocks)
    ]
    lead = prof.reload_lead_blocks
    t = up = 0.0
    ready: dict[int, float] = {}

    def reload(j: int, at: float) -> None:
        nonlocal up
        if 0 <= j < n_swap and j not in ready:
            up = max(at, up) + nbytes[j] / hw.h2d_bytes_per_s
            ready[j] = up

    for j in range(n - lead, n):  # reloads issued as backward begins
        reload(j, 0.0)
    for i in range(n - 1, -1, -1):
        reload(i - lead, t)  # issued as block i's backward starts (lead 0: its own)
        reload(i, t)
        t = max(t, ready.get(i, 0.0)) + bwd[i]
    return fwd_wait + (t - sum(bwd))
