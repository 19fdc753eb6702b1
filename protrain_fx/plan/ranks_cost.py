"""What several ranks add to a plan's cost (protrain_fx/plan/cost_model.py): the replicated
resident chunks' gradient all-reduces, and the chunks sharded on the devices (``n_shard``).

With ``N`` ranks a chunk is one of three things (docs/design.md, section 9). *Resident*: replicated,
every rank holds its fp32 value, gradient and moments; its gradient is all-reduced from inside
backward, after the chunk's last gradient, while backward goes on with the chunks before it.
*Offloaded*: a rank holds 1/N of its master, gradient and moments on the host; a gather copies the
shard up and all-gathers the rest, backward reduce-scatters the gradient and sends the shard down,
and the CPU steps it. *Sharded on the devices* (ZeRO-3 on the GPUs): a rank holds 1/N of its fp32
master, gradient accumulator and moments in device memory, ``(2 + ADAM_STATES) * 4 / N`` bytes per
parameter instead of a resident chunk's ``(2 + ADAM_STATES) * 4``; the graph all-gathers it with a
functional collective started one chunk ahead (passes/shard_prefetch.py), so the gather overlaps
the compute before it, backward re-gathers it the same way unless it stayed in a buffer and
reduce-scatters its gradient beside the next chunk's backward, and ``opt.step()`` steps the shard
on the device. The
sharded chunks are the first ``n_shard`` after the resident ones; the search chooses how many.
Everything here is a prefix sum over the chunks, so each ``(n_persist, n_shard)`` is priced in O(1).
"""

from __future__ import annotations

import math

from protrain_fx.plan.profiles import ADAM_STATES, GraphProfile, Hardware


def allreduce_terms(prof: GraphProfile, hw: Hardware, bwd_res: list[float]):
    """``(exposed, total)`` per n_persist: of the resident chunks' all-reduces (one per chunk as
    soon as its backward is done, back to back on the link while backward goes on with the chunks
    before it), what the end of backward waits for, and all of their time. With resident chunks
    ``0..n_persist-1`` (backward reaches chunk 0 last) the last one finishes ``max_k(A_k - B_k)``
    after the end of backward (``A_k``: all-reduce time of chunks ``0..k``, ``B_k``: backward time
    of the chunks before ``k``, ``bwd_res``' prefix sums)."""
    n = len(prof.chunks)
    exposed, total = [0.0] * (n + 1), [0.0] * (n + 1)
    if hw.world_size > 1:
        reduce_s = worst = 0.0
        for c, ch in enumerate(prof.chunks):
            reduce_s += hw.collective_s(ch.numel * prof.master_elem, passes=2)
            worst = max(worst, reduce_s - bwd_res[c])
            exposed[c + 1], total[c + 1] = worst, reduce_s
    return exposed, total


class ShardedChunks:
    """Prefix sums of what chunks sharded on the devices cost (module docstring), built from the
    per-chunk forward and backward compute of one layout."""

    def __init__(
        self,
        prof: GraphProfile,
        hw: Hardware,
        n_buffer: int,
        fwd_s: list[float],
        bwd_s: list[float],
    ):
        n, te, me = len(prof.chunks), prof.transfer_elem, prof.master_elem
        self.world = hw.world_size
        self.gpu_s_per_param = 1 / hw.gpu_adam_params_per_s
        self.fwd, self.bwd, self.state_bytes, self.numel = [0.0], [0.0], [0], [0]
        for c, ch in enumerate(prof.chunks):
            gather = hw.collective_s(ch.numel * te)
            # the last n_buffer chunks forward gathers stay in their buffers for backward
            regather = 0.0 if c >= n - n_buffer else gather
            reduce_scatter = hw.collective_s(ch.numel * me)
            self.fwd.append(self.fwd[-1] + max(fwd_s[c], gather))
            self.bwd.append(self.bwd[-1] + max(bwd_s[c], regather + reduce_scatter))
            shard = -(-ch.numel // self.world)  # a chunk is padded to a multiple of the ranks
            self.state_bytes.append(self.state_bytes[-1] + shard * me * (2 + ADAM_STATES))
            self.numel.append(self.numel[-1] + shard)

    def fwd_s(self, n_persist: int, n_shard: int) -> float:
        return self.fwd[n_persist + n_shard] - self.fwd[n_persist]

    def bwd_s(self, n_persist: int, n_shard: int) -> float:
        return self.bwd[n_persist + n_shard] - self.bwd[n_persist]

    def states(self, n_persist: int, n_shard: int) -> int:
        """Device bytes of one rank's shards of their masters, gradients and moments."""
        return self.state_bytes[n_persist + n_shard] - self.state_bytes[n_persist]

    def step_s(self, n_persist: int, n_shard: int) -> float:
        """Their shards' Adam step on the device at ``opt.step()``."""
        return (self.numel[n_persist + n_shard] - self.numel[n_persist]) * self.gpu_s_per_param


def shard_counts(hw: Hardware, n_shard: int | None, n_chunks: int, n_persist: int) -> range:
    """The ``n_shard`` to price beside ``n_persist`` resident chunks: the given one (clamped), none
    with one rank, else every count up to the chunks left."""
    if hw.world_size <= 1:
        return range(1)
    left = n_chunks - n_persist
    if n_shard is not None:
        return range(min(n_shard, left), min(n_shard, left) + 1)
    return range(left + 1)


def least_step_bound(
    device, cpu, total: float, room: float, resident_b: float, shard=None, r_low: float = 0.0
):
    """The least ``max(a, b)`` of two lines over the plans the memory allows (the search's lower
    bound, cost_model._ProfileArrays.lower_bound_s): ``a = a0 + a1 R (+ sa S)`` the device's side,
    ``b = b0 + b1 R (+ sb S)`` the CPU optimizer's, with ``R`` resident parameters (``resident_b``
    bytes of states each) and, given ``shard = (sa, sb, shard_b)``, ``S`` parameters sharded on the
    devices (``shard_b`` bytes each): ``R, S >= 0``, ``R + S <= total``, ``R resident_b + S
    shard_b <= room``. A convex piecewise-linear function over a convex polygon: least at a vertex
    or where ``a = b`` crosses an edge. ``r_low`` (no shards): ``R`` at least that (what the host
    leaves the device); ``math.inf`` where that does not fit the room."""
    (a0, a1), (b0, b1) = device, cpu
    sa, sb, shard_b = shard if shard is not None else (0.0, 0.0, math.inf)
    r_top = min(total, room / resident_b) if resident_b else total
    s_top = min(total, room / shard_b) if shard_b else total
    if r_low > 0 and shard is None:
        if r_low * resident_b > room:
            return math.inf
        corners = [(r_low, 0.0), (max(r_low, r_top), 0.0)]
    else:
        corners = [(0.0, 0.0), (max(0.0, r_top), 0.0)]
    if shard is not None and s_top > 0 and r_top >= 0:
        # where R + S = total meets the memory line, if inside the first quadrant
        both = (room - total * shard_b) / (resident_b - shard_b) if resident_b != shard_b else -1
        if 0 < both < r_top:
            corners.append((both, total - both))
        corners.append((0.0, s_top))
    if r_top < 0:  # not even the activations fit: the bound of no resident parameter at all
        corners = [(0.0, 0.0)]

    def a(r, s):
        return a0 + a1 * r + sa * s

    def b(r, s):
        return b0 + b1 * r + sb * s

    best = min(max(a(r, s), b(r, s)) for r, s in corners)
    for (r1, s1), (r2, s2) in zip(corners, corners[1:] + corners[:1]):
        d1, d2 = a(r1, s1) - b(r1, s1), a(r2, s2) - b(r2, s2)
        if d1 * d2 < 0:  # the lines cross on this edge
            t = d1 / (d1 - d2)
            r, s = r1 + t * (r2 - r1), s1 + t * (s2 - s1)
            best = min(best, max(a(r, s), b(r, s)))
    return best
