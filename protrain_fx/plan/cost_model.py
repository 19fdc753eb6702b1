"""ProTrain's cost model: predicted iteration time and peak device memory of a plan, from a graph
profile and a hardware profile.

Time (seconds), with per-chunk ``max(compute, transfer)`` terms::

    T = T_fwd + max(T_bwd, T_cpu_done) + T_gpu_optim  (+ the micro-steps before: accumulation.py)

* ``T_fwd``: per chunk in forward order, its compute, or for an offloaded chunk ``max(compute,
  h2d)`` (the gather is prefetched ahead: even one buffer overlaps the copy of the next chunk with
  the compute of this one), and no shorter than what the profiled host took to queue its forward
  with every chunk offloaded (measured on an H100: a resident stretch ran at its kernels' pace, an
  offloaded one at the host's).
* ``T_bwd``: per chunk in reverse, its backward compute plus the recompute of its checkpointed
  blocks, or for an offloaded chunk the max of that and its traffic: the re-gather (none for the
  chunks the last ``n_buffer`` forward gathers left in their buffers) and the fp32 gradient going
  down, at the duplex rate when both run. Swap adds what physics forces: the swapped bytes' copy
  down and up beyond the compute that can hide it (everything between block 0's forward and block
  0's backward), measured to hold on the H200.
* Several ranks (ranks_cost.py): what of the replicated resident chunks' all-reduces backward
  cannot hide, the compute the rest slows (:data:`COLLECTIVE_CONTENTION`); chunks sharded on the
  devices (``n_shard``) gather and reduce-scatter serially and step their shards at ``opt.step()``.
* ``T_cpu_done``: when the host worker's last CPU Adam step ends, a two-stage pipeline: each
  offloaded chunk's step (at the rate measured inside backward on this machine, else a prior:
  ``Hardware._in_step``) starts once its gradient is on the host (after the backward of the code
  after the blocks, ``head_bwd_s``, of the chunks before it and of its own, and its copy down) and
  the step before it is done; all after backward where the loop clips (``steps_at_opt_step``).
  ``T_gpu_optim``: resident parameters at the device Adam rate, at ``opt.step()``, after both.
* The clock under sustained load: a plan that keeps the device busy runs at its power limit, below
  the profiled boost clock: compute times ``Hardware.clock_slowdown`` of the busy share.
* Casts the profiled step does not run (its chunks arrive in the compute dtype, its gradients are
  dropped), at the device's streaming rate (:data:`ADAM_BYTES_PER_PARAM`): autocast's of resident
  parameters (again for checkpointed blocks) and of their gradients back; an offloaded chunk's
  gradient packed into a master-dtype buffer, and each gather's copy out of its device buffer.

Peak (bytes): resident chunks with their two Adam moments, the chunk buffers and the two gradient
buffers (the gathered copies of offloaded chunks in use are part of the profiled step's transient),
and the larger end of backward: at its start the activations each block's policy keeps (keep: what
forward saves; recompute: its input; swap: what stays on the device), the compute-dtype copies of
resident parameters that autocast made, and the largest transient of backward (the non-block working
set such as logits, a recomputed block's activations, the swap reload window of two blocks); at its
end the resident gradients. Times the allocator factor (:data:`FRAGMENTATION` unless calibrated;
:data:`SWAP_FRAGMENTATION` more when blocks swap).

One (chunk size, n_buffer, n_swap, n_checkpoint) costs O(chunks + blocks), each n_persist after
that O(1) (prefix sums): the search evaluates every plan exactly.
"""

from __future__ import annotations

import dataclasses
import math

from protrain_fx.plan.accumulation import micro_steps_s
from protrain_fx.plan.device_step_cost import device_step_link_s, device_step_table
from protrain_fx.plan.profiles import (
    ADAM_BYTES_PER_PARAM,
    ADAM_STATES,
    DEVICE_STEP_SLOT_BYTES,
    DEVICE_STEP_SLOTS,
    GRAD_BUFFERS,
    N_OVERSIZED_STAGING,
    STAGING,
    SWAP_FRAGMENTATION,
    GraphProfile,
    Hardware,
    Knobs,
    Prediction,
)
from protrain_fx.plan.ranks_cost import ShardedChunks, allreduce_terms, least_step_bound
from protrain_fx.plan.swap_cost import swap_stall_s
from protrain_fx.plan.timeline import memory_timeline, peaks


class _ProfileArrays:
    """What LayoutCosts needs of a (profile, hardware, n_buffer) whatever the activation knobs:
    built once."""

    def __init__(self, prof: GraphProfile, hw: Hardware, n_buffer: int):
        blocks, chunks = prof.blocks, prof.chunks
        n = len(chunks)
        me, te = prof.master_elem, prof.transfer_elem
        # a block spread over several chunks recomputes once, split
        self.block_chunks = [sum(b in ch.blocks for ch in chunks) for b in range(len(blocks))]
        self.fwd_res, self.fwd_off, self.comm, self.down_s = [0.0], [0.0], [], []
        # a chunk larger than the layout's size (one parameter) sends its gradient down on the
        # compute stream, not beside it (runtime/chunk_grads.py, grad_goes_as_is): the copy adds to
        # backward (serial) and needs no gradient buffer; with several ranks it is packed
        capacity = prof.chunk_size // me
        self.as_is = [hw.world_size == 1 and ch.numel > capacity for ch in chunks]
        self.serial, shard = [], 1 / hw.world_size  # with several ranks a rank moves its shard
        ue, up_rate = prof.upload_elem, hw.upload_bytes_per_s(prof.transfer_copies)  # te, or me
        for c, ch in enumerate(chunks):
            h2d = ch.numel * ue * shard / up_rate + hw.collective_s(ch.numel * te)
            self.fwd_res.append(self.fwd_res[-1] + ch.fwd_s)
            # offloaded: no faster than the profiled host queued it with its gathers
            self.fwd_off.append(self.fwd_off[-1] + max(ch.fwd_s, ch.host_fwd_s, h2d))
            # the last n_buffer chunks stay in their buffers
            up = 0 if c >= n - n_buffer else ch.numel * ue
            # its gradient's copy to the host (and reduce-scatter): what the CPU step waits for;
            # in the master dtype (an oversized one's may go in the transfer dtype: optimizer_calls)
            down = ch.numel * me
            down_s = down * shard / hw.d2h_bytes_per_s + hw.collective_s(down)
            if self.as_is[c]:
                self.serial.append(down_s)
                self.down_s.append(0.0)  # in the chunk's backward already
                self.comm.append(up / up_rate)
                continue
            self.serial.append(0.0)
            self.down_s.append(down_s)
            self.comm.append(
                max(
                    up * shard / up_rate,
                    down * shard / hw.d2h_bytes_per_s,
                    (up + down) * shard / hw.duplex_bytes_per_s,
                )
                + hw.collective_s(up)
                + hw.collective_s(down)
            )
        self.numel, self.resident_bytes, self.table_grad = [0], [0], [0]
        for ch in chunks:
            self.numel.append(self.numel[-1] + ch.numel)
            self.resident_bytes.append(self.resident_bytes[-1] + ch.numel * me)
            # a resident table built beside a held gradient (a tied one's; with gradients kept
            # between steps, any one's): one table more at the end of backward
            more = ch.row_table_bytes if hw.grads_held else ch.table_grad_bytes
            self.table_grad.append(self.table_grad[-1] + more)
        # elements of the device chunk buffers (and host staging) when chunks c.. are offloaded:
        # each store's hold a chunk of the layout's size, or its largest offloaded one, stores of
        # one such size share them (runtime/chunk_store.py); gradient buffers likewise (grad_numel)
        self.buffer_numel, self.grad_numel = [0] * (n + 1), [0] * (n + 1)
        self.oversized_staging = [0] * (n + 1)  # host staging of oversized chunks' gradients
        largest_in: dict[int, int] = {}
        packed_in: dict[int, int] = {}
        oversized: set[tuple[int, int]] = set()
        for c in range(n - 1, -1, -1):
            g = chunks[c].group
            largest_in[g] = max(largest_in.get(g, 0), chunks[c].numel)
            if not self.as_is[c]:
                packed_in[g] = max(packed_in.get(g, 0), chunks[c].numel)
            else:  # in the dtype the profiled step's gradient came in, else the master's (at most)
                oversized.add((chunks[c].numel, me if (e := chunks[c].grad_elem) is None else e))
            self.buffer_numel[c] = sum({max(capacity, v) for v in largest_in.values()})
            self.grad_numel[c] = sum({max(capacity, v) for v in packed_in.values()})
            self.oversized_staging[c] = N_OVERSIZED_STAGING * sum(k * e for k, e in oversized)
        self.hw, self.prof, self.up_rate = hw, prof, up_rate  # bytes/s a gather goes up at
        self.cpu_per_param = hw.cpu_s_per_param(prof.transfer_copies)  # per parameter, this rank
        self._device_step_table = self._static = None
        self.n_buffer = n_buffer
        self.device_step_scratch = (
            DEVICE_STEP_SLOTS * DEVICE_STEP_SLOT_BYTES * (prof.chunk_size // prof.master_elem)
        )
        # the casts' seconds per resident parameter (forward's cast to the compute dtype) and per
        # offloaded one (its gradient packed), at the device's streaming rate
        rate = hw.gpu_adam_params_per_s * ADAM_BYTES_PER_PARAM  # bytes per second
        ce = prof.resident_cast_elem
        self.cast_per_param = (me + ce) / rate if ce else 0.0
        self.pack_per_param = (te + me + 4 * te) / rate  # gradient packing, two gathers' copies
        self.compute_s = (
            sum(ch.fwd_s + ch.bwd_s for ch in chunks) + prof.nonblock_fwd_s + prof.nonblock_bwd_s
        )
        self.swap_window_s = self.compute_s - (blocks[0].fwd_s + blocks[0].bwd_s if blocks else 0.0)
        # by block: prefix sums of what each policy keeps on the device, of the swappable bytes, of
        # recompute
        self.keep, self.inp, self.swap_res, self.swappable = [0], [0], [0], [0]
        self.recompute = [0.0]
        for blk in blocks:
            self.keep.append(self.keep[-1] + blk.keep_bytes)
            self.inp.append(self.inp[-1] + blk.input_bytes)
            self.swap_res.append(self.swap_res[-1] + blk.swap_resident_bytes)
            self.swappable.append(self.swappable[-1] + blk.keep_bytes - blk.swap_resident_bytes)
            self.recompute.append(self.recompute[-1] + blk.recompute_cost_s)

    def device_steps(self) -> list[tuple[float, int, float]]:
        """The device-step split of every n_persist (device_step_cost.device_step_table), built at
        the first layout that asks."""
        if self._device_step_table is None:
            self._device_step_table = device_step_table(
                self.prof, self.hw, self.as_is, self.cpu_per_param
            )
        return self._device_step_table

    def static_parts(self, p: int) -> dict[str, int]:
        """The model states and buffers with ``p`` resident chunks, by part (timeline.py adds the
        rest): resident parameters and their moments, chunk and gradient buffers, the rest. The
        buffers are shared by the stores of one chunk size: one of ``hw.budget_shares`` blocks
        compiled alike counts its share of them."""
        te, me, n = self.prof.transfer_elem, self.prof.master_elem, self.hw.budget_shares
        scratch = self.device_step_scratch if self.device_steps()[p][0] else 0
        staging = self.prof.upload_staging_bytes if p < len(self.numel) - 1 else 0
        buffers = self.n_buffer * self.buffer_numel[p] * te + GRAD_BUFFERS * self.grad_numel[p] * me
        return {
            "resident states": self.resident_bytes[p] * (1 + ADAM_STATES),
            "chunk and gradient buffers": buffers // n,
            "other buffers (device steps' scratch, upload staging)": (scratch + staging) // n,
        }

    def static_bytes(self) -> list[int]:
        """:meth:`static_parts` summed, for every n_persist."""
        if self._static is None:
            self._static = [sum(self.static_parts(p).values()) for p in range(len(self.numel))]
        return self._static

    def activation_bytes(self, n_swap: int, n_checkpoint: int) -> int:
        """What forward leaves on the device for backward: non-block saves, what swap blocks cannot
        swap, recomputed blocks' inputs, kept blocks' activations."""
        end_rc, n_blocks = n_swap + n_checkpoint, len(self.keep) - 1
        return (
            self.prof.nonblock_saved_bytes
            + self.swap_res[n_swap]
            + (self.inp[end_rc] - self.inp[n_swap])
            + (self.keep[n_blocks] - self.keep[end_rc])
        )

    def peak_lower_bound(self, n_swap: int, n_checkpoint: int) -> int:
        """A peak no plan of this (n_swap, n_checkpoint) goes under, in O(1): the activations its
        policies keep plus backward's transient, times the profile's allocator factor (every
        n_persist adds to it)."""
        act, prof, n = self.activation_bytes(n_swap, n_checkpoint), self.prof, self.hw.budget_shares
        return int(
            (act + prof.transient_bytes // n) * prof.fragmentation + prof.fragmentation_bytes // n
        )

    def lower_bound_s(
        self, n_swap: int, n_checkpoint: int, device_budget=None, shards=False, host_budget=None
    ) -> float:
        """A time no plan of this (n_swap, n_checkpoint) can beat, in O(1): forward's and backward's
        compute, the recompute of its checkpointed blocks, the swap copy it cannot hide even with no
        cast copies among the bytes, and, at the best resident share, the casts and the optimizers.
        With ``R`` resident parameters out of ``P`` the step is at least ``F + cf(R) + max(B +
        cb(R), (P - R) / cpu) + R / gpu`` (transfers, the first gradient and collectives only add):
        the larger of two lines in ``R``, least at an end or where they cross (a real ``R`` between
        chunk boundaries only lowers it). With a ``device_budget``, ``R`` goes no higher than what
        fits next to the layout's activations: resident parameters and their two moments,
        activations and transient, times the allocator factor, are part of every peak. With
        ``shards`` (chunks may be sharded on the devices) a parameter may be sharded instead
        (ranks_cost.least_step_bound). With a ``host_budget`` (one rank) ``R`` is at least what
        leaves the offloaded parameters' pinned bytes within it; ``math.inf`` where no ``R`` fits
        both (a search at the host's edge skips the layout unpriced)."""
        prof, hw = self.prof, self.hw
        nbytes = self.swappable[n_swap]
        copy = nbytes / hw.d2h_bytes_per_s + nbytes / hw.h2d_bytes_per_s
        exposed = max(0.0, copy - self.swap_window_s) if nbytes else 0.0
        fwd = self.fwd_res[-1] + prof.nonblock_fwd_s
        recompute = self.recompute[n_swap + n_checkpoint] - self.recompute[n_swap]
        bwd = self.compute_s - fwd + recompute + exposed
        total = self.numel[-1]
        if not total:
            return fwd + bwd
        n_blocks = len(self.keep) - 1
        cast, pack, me = self.cast_per_param, self.pack_per_param, prof.master_elem
        ckpt = n_checkpoint / n_blocks if n_blocks else 0.0
        # per offloaded parameter
        cpu = hw.cpu_s_per_param(prof.transfer_copies)
        if hw.device_steps or hw.device_step_share:  # the CPU and the link, each at its best
            cpu = 1 / (1 / cpu + 1 / device_step_link_s(hw))
        gpu = 1 / hw.gpu_adam_params_per_s
        # a = a0 + a1 R: the device side; b = b0 + b1 R: the CPU optimizer's side
        device = (fwd + bwd + total * pack, cast * (2 + ckpt) - pack + gpu)
        host = (fwd + total * cpu, cast - cpu + gpu)
        room = math.inf
        if device_budget is not None:
            shares = hw.budget_shares  # of what the blocks compiled alike share
            act = self.activation_bytes(n_swap, n_checkpoint) + prof.transient_bytes // shares
            room = (device_budget - prof.fragmentation_bytes // shares) / prof.fragmentation - act
        # a sharded parameter: its device step on the device's side (its collectives may hide
        # behind compute), no CPU step (ranks_cost.py)
        n = hw.world_size
        shard = (gpu / n, gpu / n - cpu, (2 + ADAM_STATES) * me / n) if shards else None
        resident_b = (1 + ADAM_STATES) * me
        hb = math.inf if host_budget is None or n > 1 else host_budget  # the host forces R up
        low = total - hb / prof.host_bytes_per_offloaded
        return least_step_bound(device, host, total, room, resident_b, shard, low)


class LayoutCosts:
    """Every cost of one (profile, n_buffer, n_swap, n_checkpoint) that does not depend on
    n_persist, and prefix sums to price each n_persist in O(1)."""

    def __init__(
        self,
        prof: GraphProfile,
        hw: Hardware,
        n_buffer: int,
        n_swap: int,
        n_checkpoint: int,
        arrays: _ProfileArrays | None = None,
    ):
        self.prof, self.hw = prof, hw
        self.n_buffer, self.n_swap, self.n_checkpoint = n_buffer, n_swap, n_checkpoint
        blocks, chunks = prof.blocks, prof.chunks
        n_blocks = len(blocks)
        if n_swap + n_checkpoint > n_blocks:
            raise ValueError(f"n_swap + n_checkpoint = {n_swap + n_checkpoint} > {n_blocks} blocks")
        A = arrays or _ProfileArrays(prof, hw, n_buffer)
        self.fwd_res, self.fwd_off = A.fwd_res, A.fwd_off
        self.numel, self.resident_bytes, self.table_grad = A.numel, A.resident_bytes, A.table_grad
        self.buffer_numel, self.grad_numel = A.buffer_numel, A.grad_numel
        self.oversized_staging, self.swap_window_s = A.oversized_staging, A.swap_window_s
        first_rc, end_rc = n_swap, n_swap + n_checkpoint
        # ---- backward terms per chunk (its compute plus the recompute of its checkpointed blocks)
        bwd_res, bwd_off, bwd_chunk = [0.0], [0.0], []
        for c, ch in enumerate(chunks):
            b = ch.bwd_s
            for i in ch.blocks:
                if first_rc <= i < end_rc:
                    b += blocks[i].recompute_cost_s / A.block_chunks[i]
            bwd_chunk.append(b)
            bwd_res.append(bwd_res[-1] + b)
            bwd_off.append(bwd_off[-1] + max(b, A.comm[c]) + A.serial[c])
        self.bwd_res, self.bwd_off, self.bwd_chunk, self.arrays = bwd_res, bwd_off, bwd_chunk, A
        # ---- the CPU optimizer, the second stage of a pipeline: offloaded chunk c's step starts
        # when its gradient is on the host and the step before it is done. Offloaded chunks are the
        # last in first-use order, so backward reaches them first, whatever n_persist: chunk c's
        # gradient arrives after the code after the blocks (head, loss), the backward of chunks
        # c.. and its copy down. With k seconds per parameter, the last step of chunks
        # n_persist.. ends at max over c >= n_persist of (arrival_c + k * numel[n_persist..c]):
        # a suffix maximum prices every n_persist in O(1) (cpu_done[n_persist])
        n = len(chunks)
        self.cpu_per_param = k = A.cpu_per_param
        numel = A.numel
        self.cpu_done = [0.0] * (n + 1)
        latest = -math.inf
        for c in range(n - 1, -1, -1):
            arrival = prof.head_bwd_s + (bwd_off[n] - bwd_off[c]) + A.down_s[c]
            latest = max(latest, arrival + k * numel[c + 1])
            self.cpu_done[c] = latest - k * numel[c]
        # ---- steps on the device (protrain_fx/runtime/device_steps.py), per n_persist; the scratch
        self._device_steps, self._peaks = A.device_steps, None
        self.device_step_scratch = A.device_step_scratch
        self.static, self.static_parts = A.static_bytes(), A.static_parts  # of each n_persist
        # ---- several ranks: the resident chunks' all-reduces, chunks sharded on the devices
        self.allreduce_exposed, self.allreduce_s = allreduce_terms(prof, hw, bwd_res)
        self.sharded = (
            ShardedChunks(prof, hw, n_buffer, [ch.fwd_s for ch in chunks], bwd_chunk)
            if hw.world_size > 1
            else None
        )
        # ---- swap and memory that do not depend on n_persist
        self.swap_fraction = n_swap / n_blocks if n_blocks else 0.0
        self.swapped_bytes = A.swappable[n_swap]
        self.activation_bytes = A.activation_bytes(n_swap, n_checkpoint)
        swap_window = (
            sum(sorted((blocks[i].keep_bytes for i in range(n_swap)), reverse=True)[:2])
            if n_swap
            else 0
        )
        recompute_peak = max((blocks[i].keep_bytes for i in range(first_rc, end_rc)), default=0)
        # the cast copies are saved by blocks that keep (recompute redoes the cast, swap moves it to
        # the host)
        self.keep_fraction = (n_blocks - n_swap - n_checkpoint) / n_blocks if n_blocks else 1.0
        self.checkpoint_fraction = n_checkpoint / n_blocks if n_blocks else 0.0
        # the one block running's working set and the allocator's fixed bytes: one of several
        # blocks compiled alike counts its share (Hardware.budget_shares)
        shares = hw.budget_shares
        self.transient_bytes = max(prof.transient_bytes, recompute_peak, swap_window) // shares
        self.cast_per_param, self.pack_per_param = A.cast_per_param, A.pack_per_param
        self.fragmentation = prof.fragmentation * (SWAP_FRAGMENTATION if n_swap else 1.0)
        self.fragmentation_bytes = prof.fragmentation_bytes // shares
        self.swap_stall_s = swap_stall_s(prof, hw, n_swap, n_checkpoint) if n_swap else 0.0

    # ------------------------------------------------------------------------------ per n_persist
    def peak_bytes(self, n_persist: int, n_shard: int = 0) -> int:
        """The predicted peak (timeline.peaks: computed for every n_persist at once); chunks
        sharded on the devices are not resident there and add their shards' states."""
        if self._peaks is None:
            self._peaks = peaks(self)
        peak = self._peaks[n_persist]
        return peak + self.shard_bytes(n_persist, n_shard) if n_shard else peak

    def shard_bytes(self, n_persist: int, n_shard: int) -> int:
        """What ``n_shard`` chunks sharded on the devices keep there, scaled for the allocator."""
        shards = self.sharded.states(n_persist, n_shard) if n_shard else 0
        return int(math.ceil(shards * self.fragmentation))

    def host_bytes(self, n_persist: int, n_shard: int = 0) -> int:
        """Pinned host bytes of one rank (its shards; none of the chunks sharded on the devices)."""
        prof, first = self.prof, n_persist + n_shard  # the first chunk on the host
        offloaded = (self.numel[-1] - self.numel[first]) // self.hw.world_size
        packed = 0 if self.hw.grads_added_on_device else self.grad_numel[first]
        # master, accumulator, moments, copy; the staging of packed gradients (none where summed
        # on the device, runtime/grad_add.py) and of oversized ones (their dtype); the swap pool
        return (
            offloaded * prof.host_bytes_per_offloaded
            + (STAGING * packed * prof.master_elem if packed else 0)
            + self.oversized_staging[first]
            + self.swapped_total(n_persist)
        )

    def swapped_total(self, n_persist: int) -> int:
        """Swapped activations plus the cast copies of resident parameters that swap blocks save."""
        casts = int(self.numel[n_persist] * self.prof.resident_cast_elem * self.swap_fraction)
        return self.swapped_bytes + casts if self.swapped_bytes else 0

    def swap_exposed_s(self, n_persist: int) -> float:
        """The swapped bytes' copies that compute cannot hide: the larger of what the block-by-block
        waits cost (:func:`swap_stall_s`) and the copy down and up beyond all the compute between
        block 0's forward and backward."""
        nbytes = self.swapped_total(n_persist)
        if not nbytes:
            return 0.0
        copy = nbytes / self.hw.d2h_bytes_per_s + nbytes / self.hw.h2d_bytes_per_s
        return max(self.swap_stall_s, copy - self.swap_window_s, 0.0)

    def device_steps(self, n_persist: int) -> tuple[float, int, float]:
        """``(share, parameters, seconds)`` of the offloaded chunks stepped on the compute device
        (protrain_fx/plan/device_step_cost.py) when chunks from ``n_persist`` on are offloaded."""
        return self._device_steps()[n_persist]

    def time_s(self, n_persist: int, detail: bool = False, n_shard: int = 0):
        n = len(self.prof.chunks)
        prof, hw, first = self.prof, self.hw, n_persist + n_shard  # the first chunk on the host
        sh = self.sharded if n_shard else None
        t_fwd = (
            self.fwd_res[n_persist]
            + (sh.fwd_s(n_persist, n_shard) if sh else 0.0)
            + (self.fwd_off[n] - self.fwd_off[first])
            + prof.nonblock_fwd_s
        )
        swap_exposed = self.swap_exposed_s(n_persist) if self.swapped_bytes else 0.0
        t_bwd = (
            self.bwd_res[n_persist]
            + (sh.bwd_s(n_persist, n_shard) if sh else 0.0)
            + (self.bwd_off[n] - self.bwd_off[first])
            + prof.nonblock_bwd_s
            + swap_exposed
        )
        resident = self.numel[n_persist]
        offloaded = self.numel[n] - self.numel[first]
        # replicated resident chunks: what of their gradients' all-reduce backward cannot hide, and
        # the compute the rest of it slows down
        exposed = self.allreduce_exposed[n_persist]
        contention = (self.allreduce_s[n_persist] - exposed) * hw.collective_contention
        t_bwd += exposed + contention
        cast_fwd, cast_bwd = self.cast_s(n_persist)
        t_fwd += cast_fwd
        t_bwd += cast_bwd
        # the resident chunks' step and the shards' (chunks sharded on the devices) at opt.step()
        t_gpu = resident / hw.gpu_adam_params_per_s + (sh.step_s(n_persist, n_shard) if sh else 0)
        t_cpu = offloaded * self.cpu_per_param
        # the CPU steps end at cpu_done (they wait for the gradients: before the first arrives and
        # wherever backward is slower than the CPU): first_grad_s is that wait
        t_first = max(0.0, self.cpu_done[first] - t_cpu) if offloaded else 0.0
        # some of them may run on the device, streamed, beside the CPU's (device_steps)
        device_share, device_params, t_cpu = self.device_steps(first)

        # the device optimizer follows backward and the CPU steps (H200: a 3B plan's step within
        # 1.4% of it), all after the micro-steps before the last one (accumulation.py)
        serial = hw.shared_compute or hw.steps_at_opt_step
        after = (lambda b: b + t_cpu) if serial else (lambda b: max(b, t_first + t_cpu))
        before, t_bwd = micro_steps_s(self, first, t_fwd, t_bwd)
        # a step that keeps the device busy runs it at its power limit, below the profiled clock
        busy = (before + t_fwd + t_bwd) / (before + t_fwd + after(t_bwd) + t_gpu or 1.0)
        slowdown = hw.clock_slowdown(busy)
        before, t_fwd, t_bwd = before * slowdown, t_fwd * slowdown, t_bwd * slowdown
        t = before + t_fwd + after(t_bwd) + t_gpu
        if not detail:
            return t
        pairs = ((self.fwd_off, self.fwd_res), (self.bwd_off, self.bwd_res))  # waits for copies
        waits = sum(o[n] - o[first] - r[n] + r[first] for o, r in pairs)
        return t, {
            "fwd_s": t_fwd,
            "bwd_s": t_bwd,
            "gpu_optim_s": t_gpu,
            "cpu_optim_s": t_cpu,
            "first_grad_s": t_first,
            "device_step_share": device_share,
            "device_step_params": device_params,
            "swap_exposed_s": swap_exposed,
            "copy_waits_s": waits,
            "upload_bytes_per_s": self.arrays.up_rate,
            "cast_s": cast_fwd + cast_bwd,
            "allreduce_exposed_s": exposed,
            "collective_contention_s": contention,
            "clock_slowdown": slowdown,
            "micro_steps": hw.micro_steps,
            "before_last_micro_step_s": before,
        }

    def cast_s(self, n_persist: int) -> tuple[float, float]:
        """Forward's and backward's dtype casts that the profiled step did not run (module
        docstring)."""
        resident, pack = self.numel[n_persist], self.pack_per_param
        cast = resident * self.cast_per_param
        return cast, cast * (1 + self.checkpoint_fraction) + (self.numel[-1] - resident) * pack

    def timeline(self, n_persist: int, n_shard: int = 0) -> list[list]:
        """Predicted device memory over one step (protrain_fx/plan/timeline.py)."""
        return memory_timeline(self, n_persist, n_shard)

    def predict(self, n_persist: int, n_shard: int = 0) -> Prediction:
        t, parts = self.time_s(n_persist, detail=True, n_shard=n_shard)
        parts.update(
            activation_bytes=self.activation_bytes,
            transient_bytes=self.transient_bytes,
            tail_bytes=self.prof.tail_bytes,
            swapped_bytes=self.swapped_total(n_persist),
        )
        p, steps = self.prof, self.device_steps(n_persist + n_shard)[0]
        layout = (p.chunk_size, n_persist, self.n_buffer, self.n_swap, self.n_checkpoint)
        knobs = Knobs(*layout, steps, p.transfer_copies, n_shard)
        peak, host = self.peak_bytes(n_persist, n_shard), self.host_bytes(n_persist, n_shard)
        return Prediction(knobs, t, peak, host, parts)


def predict(prof: GraphProfile, hw: Hardware, knobs: Knobs) -> Prediction:
    """The predicted time, peak and pinned host bytes of one plan."""
    if knobs.chunk_size != prof.chunk_size:
        raise ValueError(
            f"profile is for chunk size {prof.chunk_size}, knobs ask {knobs.chunk_size}"
        )
    if not 0 <= knobs.n_persist <= knobs.n_persist + knobs.n_shard <= len(prof.chunks):
        raise ValueError(
            f"n_persist {knobs.n_persist} + n_shard {knobs.n_shard} outside 0..{len(prof.chunks)}"
        )
    if knobs.n_shard and hw.world_size == 1:
        raise ValueError("n_shard needs several ranks (with one, those chunks are resident)")
    prof = dataclasses.replace(prof, transfer_copies=knobs.transfer_copies)
    return LayoutCosts(prof, hw, knobs.n_buffer, knobs.n_swap, knobs.n_checkpoint).predict(
        knobs.n_persist, knobs.n_shard
    )
