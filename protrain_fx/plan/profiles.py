"""What the cost model is given and what it returns: per-block and per-chunk profiles of a graph
(:class:`GraphProfile`), the machine's rates (:class:`Hardware`), the knobs of a plan
(:class:`Knobs`) and the prediction (:class:`Prediction`); and the calibration constants the model
applies, each with the measurement it comes from. protrain_fx/plan/cost_model.py prices a plan from
these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FRAGMENTATION = 1.10  # ProTrain's allocator factor; calibrated per machine when measurements exist
# reserved over allocated when blocks swap: the host-reload buffers come and go in sizes that
# fragment the allocator (H200, expandable segments: 1.06 and 1.08 with swapping, 1.003-1.03
# without; benchmarks/results/autoplan_h200.md), on top of the profile's factor
SWAP_FRAGMENTATION = 1.07
# CPU Adam inside a training step vs alone: the step of CPU-bound plans, less forward and the first
# gradient, over the offloaded parameters at the alone rate (the hardware profile's fastest
# repetition). On the H200 hosts 1.12-1.33 over eight such plans, median 1.25
# (benchmarks/results/autoplan_h200.md, runs 4-7; the chunk issue's per-phase timers measured
# 1.10-1.15 for the step's part inside backward alone)
CPU_CONTENTION = 1.25
# the device's clock under sustained load: a plan keeps the device busy for this share of its step
# before its compute runs slower than profiled, and for all of it at the hardware profile's
# sustained slowdown (Hardware.sustained_slowdown), linearly between. On the H200 (700 W), rows busy
# 98-99% of the step ran forward and backward 5-8% slower than profiled (SM clock 1690 against 1967
# MHz), 73-81% busy 2-3%, 64-67% busy 0-1.6% (benchmarks/results/oom_sweep_h200_runs4to10.md)
THROTTLE_BUSY_FROM = 0.6
# compute kernels slow down while an NCCL collective runs beside them (its kernels take SMs and
# memory bandwidth): the 1.4B GPT's backward on 2 H200s (NVLink) ran 4.8 ms longer over the 19.6 ms
# its resident all-reduces overlapped it (benchmarks/results/dp_h200.md, run 4's trace): 0.24 ms per
# ms of overlap
COLLECTIVE_CONTENTION = 0.24


# host memory's bandwidth bounds the CPU step inside backward: the kernel reads master, fp32
# gradient and two moments and writes three (28 bytes; 30 with the bf16 transfer copy), and
# backward's own copies go through host memory meanwhile. The triad over the rate the host worker
# reaches inside backward, its waits between chunk steps included (machine/step_rates.WorkerSpan),
# was 29.9-34.1 bytes per parameter without transfer copies over 25 rows of the never-OOM sweep on
# four H200 hosts (triad 116-137 GB/s; median 32.5; benchmarks/results/oom_sweep_h200_run16-18.md,
# the span taken as backward less the predicted wait for the first gradient); with copies it was
# 1.17x that where both kinds were measured on the steps alone (13 rows of runs 13-15, medians 32.7
# and 27.9): so these bytes at the triad price the step before steps on the machine measured it
def in_step_host_bytes(transfer_copies: bool) -> int:
    return 37 if transfer_copies else 32


# ... and the same rate from the kernel's own rate alone (the hardware profile's): the span inside
# backward was the alone rate / 1.38-1.69 without transfer copies (29 rows, runs 16-19, median 1.49)
# and / 1.18-1.38 with them (8 rows, runs 15 and 19, median 1.34); the two divisors below minimize
# the largest error of the rule that follows. The triad misjudged one host of five: run 19's
# measured 80.7 GB/s (the others 98-137) while its kernel reached the alone and in-step rates of the
# others (in-step 3.8-4.3 G params/s, the triad's price 2.5: steps 26% slower predicted than run).
# Before steps measured it, the in-step rate is the faster of the two (each can only be misjudged
# low: a triad or a kernel run disturbed), no faster than the alone rate / ``CPU_CONTENTION``:
# within 10% of the span on all 37 rows of runs 15-19 (9.7% at most), 20 within 5% (the triad alone:
# 25 and 12, 47% off at worst)
def in_step_alone_slowdown(transfer_copies: bool) -> float:
    return 1.30 if transfer_copies else 1.55


# fused AdamW moves 28 bytes per fp32 parameter (reads parameter, gradient, two moments; writes
# three), so the device's Adam rate times this is the memory bandwidth its streaming kernels get
# (H200: ~3.4 TB/s), the rate of the dtype casts below
ADAM_BYTES_PER_PARAM = 28
ADAM_STATES = 2
GRAD_BUFFERS = 2  # device gradient buffers of offloaded chunks (runtime/chunk_buffers.py)
STAGING = 4  # pinned staging buffers of packed gradients (runtime/chunk_grads.py: N_STAGING)
N_OVERSIZED_STAGING = 2  # ... of an oversized chunk's gradient, per size (N_OVERSIZED_STAGING)
# offloaded chunks stepped on the compute device (runtime/device_steps.py): slots of one chunk each
# (master, gradient, two moments in fp32 and the bf16 copy), and the bytes each parameter moves
DEVICE_STEP_SLOTS = 2
DEVICE_STEP_SLOT_BYTES = 4 * 4 + 2
DEVICE_STEP_UP_BYTES = 16  # master, gradient, moments
DEVICE_STEP_DOWN_BYTES = 14  # master, moments, bf16 transfer copy
# without host transfer copies (Knobs.transfer_copies False) an offloaded master goes up in pieces
# of this many elements through a device staging buffer of its dtype (runtime/chunk_transfers.py)
UPLOAD_PIECE = 1 << 24


@dataclass(frozen=True)
class BlockProfile:
    fwd_s: float  # forward compute
    bwd_s: float  # backward compute (without recomputation)
    keep_bytes: int  # device bytes forward keeps for backward when the block keeps its activations
    input_bytes: int  # ... when it recomputes (what the partitioner stashes: its input)
    swap_resident_bytes: int = 0  # ... when it swaps (what cannot be swapped: masks, host scalars)
    recompute_s: float | None = None  # what recomputing it in backward costs (default: fwd_s)

    @property
    def recompute_cost_s(self) -> float:
        return self.fwd_s if self.recompute_s is None else self.recompute_s


@dataclass(frozen=True)
class ChunkProfile:
    numel: int  # parameters (padding included: the whole chunk moves)
    fwd_s: float  # forward compute from this chunk's gather to the next chunk's
    bwd_s: float  # backward compute of the same stretch
    # blocks whose compute falls in that stretch (their recompute lands here)
    blocks: tuple[int, ...] = ()
    # the chunk store that holds it: one per region of a graph compiled in regions
    # (protrain_fx/graph/regions.py), all 0 for a whole graph
    group: int = 0
    # an oversized chunk's gradient staging: bytes per element as the profiled step sent it, 0 for
    # none (StepProfile.oversized_grad_elem); None: the master dtype's (not seen: at most that)
    grad_elem: int | None = None
    # a tied embedding's table (its one parameter) whose gradient the profiled step, with the chunk
    # offloaded, sent as rows: resident, its backward builds the dense table while the gradient
    # holds the head's part: these bytes more at the end of backward (cost_model: table_grad)
    table_grad_bytes: int = 0
    # any table whose gradient the profiled step sent as rows (tied or not): what a resident chunk
    # builds beside a gradient kept from the last backward (Hardware.grads_held)
    row_table_bytes: int = 0
    # what the host took to queue the stretch's forward with every chunk offloaded (its gathers'
    # bookkeeping included; profiling/profiler.py): an offloaded chunk's forward takes at least that
    host_fwd_s: float = 0.0


@dataclass(frozen=True)
class GraphProfile:
    """What the cost model needs of one graph for one chunk size."""

    chunk_size: int
    chunks: tuple[ChunkProfile, ...]
    blocks: tuple[BlockProfile, ...]
    nonblock_fwd_s: float = 0.0
    nonblock_bwd_s: float = 0.0
    # the part of nonblock_bwd_s that runs before the blocks' backward (the code after the blocks:
    # final norm, head, loss): no offloaded chunk's gradient reaches the host before it ends
    head_bwd_s: float = 0.0
    nonblock_saved_bytes: int = 0
    # largest working set of backward outside saved activations (logits, loss)
    transient_bytes: int = 0
    # what the end of backward holds beside the resident gradients (after the last block: the
    # embedding's dense gradient, a tied head's gradient, their sum)
    tail_bytes: int = 0
    master_elem: int = 4
    transfer_elem: int = 2
    # whether offloaded chunks keep a host copy in the transfer dtype (the plan's knob, set on the
    # profile the search prices): without one a gather uploads master_elem bytes per element
    transfer_copies: bool = True
    # forward saves a compute-dtype copy of resident parameters that autocast casts (offloaded
    # chunks arrive in that dtype and are re-gathered in backward instead): bytes per resident
    # parameter element
    resident_cast_elem: int = 0
    # the allocator: reserved = allocated * fragmentation + fragmentation_bytes (calibrated from
    # the profiled step where known: protrain_fx/machine/allocator.py)
    fragmentation: float = FRAGMENTATION
    fragmentation_bytes: int = 0

    @property
    def upload_elem(self) -> int:
        """Bytes per element an offloaded chunk's gather moves up: its transfer copy's, or its
        master's without copies."""
        return self.transfer_elem if self.transfer_copies else self.master_elem

    @property
    def host_bytes_per_offloaded(self) -> int:
        """Pinned host bytes an offloaded parameter keeps: fp32 master, gradient accumulator and
        two moments, and the transfer copy where it is kept (cost_model.LayoutCosts.host_bytes)."""
        copy = self.upload_elem if self.upload_elem != self.master_elem else 0
        return self.master_elem * (2 + ADAM_STATES) + copy

    @property
    def upload_staging_bytes(self) -> int:
        """The device staging masters go up through without transfer copies (none needed where
        the two dtypes agree)."""
        if self.transfer_copies or self.transfer_elem == self.master_elem:
            return 0
        largest = max((ch.numel for ch in self.chunks), default=0)
        return min(UPLOAD_PIECE, largest) * self.master_elem

    # how many blocks ahead of its own backward a swap block's reload starts: one in a whole graph
    # (passes/swap.py), none in a graph compiled in regions (the block's own code starts it)
    reload_lead_blocks: int = 1


@dataclass(frozen=True)
class Hardware:
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    cpu_adam_params_per_s: float
    gpu_adam_params_per_s: float
    # data parallelism (protrain_fx/runtime/distributed.py): ranks, and the collectives' bus rate
    # (an all-gather or reduce-scatter of B bytes moves B (N-1)/N per rank; an all-reduce twice
    # that), measured at planning
    world_size: int = 1
    collective_bytes_per_s: float = math.inf
    # CPU Adam inside a training step against ``cpu_adam_params_per_s`` (the hardware profile's rate
    # alone)
    cpu_contention: float = CPU_CONTENTION
    # compute seconds lost per second of a collective overlapping it
    collective_contention: float = COLLECTIVE_CONTENTION
    # the compute device is the host's CPU: the offloaded chunks' CPU optimizer shares the cores
    # that compute, so it adds to the step instead of running beside backward (offloading then only
    # pays under a budget)
    shared_compute: bool = False
    # the training loop clips gradients or sets a hyperparameter between backward() and
    # opt.step(), as its earlier runs showed (plan_cache.steps_at_opt_step): the offloaded chunks'
    # CPU steps run at opt.step(), after backward (runtime/hybrid_optim.py), alone on the host
    steps_at_opt_step: bool = False
    # the training loop keeps gradients from one backward to the next forward (gradient
    # accumulation, zero_grad(set_to_none=False)): resident gradients live through the whole step,
    # and an offloaded table's dense gradient, were its chunk resident, is built beside one
    grads_held: bool = False
    # backward passes per optimizer step (gradient accumulation: plan/accumulation.py)
    micro_steps: int = 1
    # a later gradient of an offloaded chunk is summed on the compute device
    # (protrain_fx/runtime/grad_add.py; one rank), so the host staging of packed gradients is not
    # allocated
    grads_added_on_device: bool = False
    # offloaded chunks may be stepped on the compute device, streamed over the link, beside the CPU
    # steps (protrain_fx/runtime/device_steps.py; one rank, a compute device that is not the host)
    device_steps: bool = False
    # the share the user fixed (Options.device_steps), priced as given; None: chosen as above
    device_step_share: float | None = None
    # compute kept back to back against the profiled (boost-clock) rate (HardwareProfile
    # .gpu_sustained_slowdown), applied by busy share (THROTTLE_BUSY_FROM)
    sustained_slowdown: float = 1.0
    # the CPU step's seconds per parameter inside backward as earlier steps on this machine measured
    # it, with and without the transfer copy (machine/step_rates.py); None: not seen
    observed_s_per_param_copies: float | None = None
    observed_s_per_param_masters: float | None = None
    # the same inside opt.step(), where a loop that clips steps them (steps_at_opt_step)
    observed_at_step_copies: float | None = None
    observed_at_step_masters: float | None = None
    # bytes per second an offloaded chunk went up at inside steps on this machine, with and without
    # the transfer copy (the fp32 master through the staging and a cast; machine/step_rates.py);
    # None: not seen, the profile's h2d_bytes_per_s
    observed_upload_copies: float | None = None
    observed_upload_masters: float | None = None
    # the alone rate of the CPU step without the transfer copy (HardwareProfile
    # .cpu_adam_masters_params_per_s); 0: cpu_adam_params_per_s
    cpu_adam_masters_params_per_s: float = 0.0
    # the host's memory bandwidth (HardwareProfile.host_triad_bytes_per_s); 0: unknown
    host_bytes_per_s: float = 0.0
    # blocks of one structure this graph runs for (regional compilation: graph/regional.py), each
    # planned for its share of the budget: what they share (the chunk, gradient and scratch buffers
    # of one chunk size, the working set of the one block running, the allocator's fixed bytes)
    # counts 1/n in each one's peak, what each holds (resident states, saved activations) in full
    budget_shares: int = 1

    def upload_bytes_per_s(self, transfer_copies: bool = True) -> float:
        """The rate an offloaded chunk's gather goes up at: as steps on this machine measured it
        for the kind, else the profile's copies (on an H100 host 37.9-41.1 GB/s inside steps
        against the profile's 51.2: benchmarks/results/oom_sweep_h100_run70.md)."""
        seen = self.observed_upload_copies if transfer_copies else self.observed_upload_masters
        return seen or self.h2d_bytes_per_s

    def observed_s_per_param(self, transfer_copies: bool = True) -> float | None:
        return (
            self.observed_s_per_param_copies
            if transfer_copies
            else self.observed_s_per_param_masters
        )

    def _alone_s_per_param(self, transfer_copies: bool) -> float:
        rate = (not transfer_copies and self.cpu_adam_masters_params_per_s) or (
            self.cpu_adam_params_per_s
        )
        return 1.0 / rate if rate else 0.0

    def _in_step(self, transfer_copies: bool) -> tuple[float, str]:
        """Seconds per parameter of the CPU step in a training step (all ranks together), and
        where the number comes from: at ``opt.step()`` (a loop that clips), as measured there on
        this machine, else the alone rate times ``cpu_contention``; inside backward, as measured
        for this kind on this machine; else the other kind's measurement carried over by the host
        memory bytes each moves (inside a step host memory bounds both:
        benchmarks/results/oom_sweep_h200_run14.md), no faster than the alone rate allows; else,
        with the triad known, the faster of the host's bandwidth bound (``memory_s_per_param``)
        and the alone rate slowed as inside backward (``in_step_alone_slowdown``), no faster than
        the alone rate times ``cpu_contention``, which is the price without a triad (a hand-made
        Hardware)."""
        alone = self._alone_s_per_param(transfer_copies)
        priced = self.cpu_contention * alone
        if self.steps_at_opt_step:
            seen = (
                self.observed_at_step_copies if transfer_copies else self.observed_at_step_masters
            )
            if seen:
                return seen, "at opt.step(), as measured there on this machine"
            return priced, f"at opt.step(): the alone rate / {self.cpu_contention:g}"
        if seen := self.observed_s_per_param(transfer_copies):
            return seen, "as measured inside backward on this machine"
        if other := self.observed_s_per_param(not transfer_copies):
            ratio = in_step_host_bytes(transfer_copies) / in_step_host_bytes(not transfer_copies)
            if other * ratio >= priced:
                return other * ratio, "as the other kind measured inside backward on this machine"
        # ranks on one host step their shares at once: host memory's bandwidth is shared by them
        ranks = self.world_size
        if memory := self.memory_s_per_param(transfer_copies) * ranks:
            slowdown = in_step_alone_slowdown(transfer_copies)
            prior, where = memory, "host memory's bandwidth"
            if 0 < alone * slowdown * ranks < memory:  # the triad misjudged low: the kernel's rate
                prior, where = alone * slowdown * ranks, f"the alone rate / {slowdown:g}"
            if prior > priced:
                return prior, f"{where} inside backward over {ranks} rank(s)"
        return priced, f"the alone rate / {self.cpu_contention:g}"

    def memory_s_per_param(self, transfer_copies: bool = True) -> float:
        """Seconds per offloaded parameter at which host memory carries its CPU step and
        backward's copies of it (``in_step_host_bytes`` at the triad bandwidth); 0: unknown."""
        if not self.host_bytes_per_s:
            return 0.0
        return in_step_host_bytes(transfer_copies) / self.host_bytes_per_s

    def host_s_per_byte(self) -> float:
        """Seconds per byte host memory moves inside a training step: what the CPU kernel reaches
        alone (its rate times the 30 bytes it touches), the triad, and what steps measured on this
        machine (taken as bound by host memory), whichever is slowest."""
        rates = [self.cpu_adam_params_per_s * 30, self.host_bytes_per_s]
        rates += [
            in_step_host_bytes(k) / s for k in (True, False) if (s := self.observed_s_per_param(k))
        ]
        return max((1 / r for r in rates if r), default=0.0)

    def cpu_s_per_param(self, transfer_copies: bool = True) -> float:
        """CPU seconds per offloaded parameter's Adam step inside a training step, this rank's
        share (``_in_step``)."""
        return self._in_step(transfer_copies)[0] / self.world_size

    def cpu_step_rate_note(self, transfer_copies: bool = True) -> str:
        """The CPU step's rate the plan priced, and where it comes from (the plan summary)."""
        s, where = self._in_step(transfer_copies)
        if not s:
            return "-"
        alone = self._alone_s_per_param(transfer_copies)
        slower = f", {s / alone:.2f}x the alone rate's time" if alone else ""
        return f"{1e-9 / s:.2f} G params/s, {where}{slower}"

    def clock_slowdown(self, busy: float) -> float:
        """How much slower than profiled the compute of a step busy for ``busy`` of its time
        runs."""
        ramp = (busy - THROTTLE_BUSY_FROM) / (1.0 - THROTTLE_BUSY_FROM)
        return 1.0 + (self.sustained_slowdown - 1.0) * min(1.0, max(0.0, ramp))

    def collective_s(self, nbytes: float, passes: int = 1) -> float:
        """Seconds of ``passes`` all-gathers / reduce-scatters of ``nbytes`` (0 with one rank)."""
        n = self.world_size
        return 0.0 if n == 1 else passes * nbytes * (n - 1) / n / self.collective_bytes_per_s

    @classmethod
    def of(cls, profile, observed: dict[str, float] | None = None) -> "Hardware":
        """From a :class:`protrain_fx.machine.profile.HardwareProfile` and what steps measured on
        the machine (``machine.step_rates.read``)."""
        observed = observed or {}
        return cls(
            profile.h2d_bytes_per_s,
            profile.d2h_bytes_per_s,
            profile.duplex_bytes_per_s,
            profile.cpu_adam_params_per_s,
            profile.gpu_adam_params_per_s,
            # as busy steps on the machine measured it, else as the probe did (step_rates.py)
            sustained_slowdown=observed.get("compute") or profile.gpu_sustained_slowdown,
            observed_s_per_param_copies=observed.get("copies"),
            observed_s_per_param_masters=observed.get("masters"),
            observed_at_step_copies=observed.get("copies_at_step"),
            observed_at_step_masters=observed.get("masters_at_step"),
            observed_upload_copies=observed.get("upload_copies"),
            observed_upload_masters=observed.get("upload_masters"),
            cpu_adam_masters_params_per_s=profile.cpu_adam_masters_params_per_s,
            host_bytes_per_s=profile.host_triad_bytes_per_s,
        )


@dataclass(frozen=True)
class Knobs:
    chunk_size: int
    n_persist: int
    n_buffer: int
    n_swap: int
    n_checkpoint: int
    # the share of the offloaded chunks (of the layout's size) whose Adam step runs on the compute
    # device (protrain_fx/runtime/device_steps.py)
    device_steps: float = 0.0
    # offloaded chunks keep a host copy in the transfer dtype (False: uploaded as masters, cast on
    # the device; runtime/chunk_transfers.py)
    transfer_copies: bool = True
    # with several ranks: of the chunks after the first n_persist, how many are sharded on the
    # devices (their shards of master, gradient and moments in device memory; plan/ranks_cost.py)
    n_shard: int = 0


@dataclass(frozen=True)
class Prediction:
    knobs: Knobs
    time_s: float
    peak_bytes: int
    host_bytes: int  # pinned host memory the plan allocates
    breakdown: dict = field(default_factory=dict, compare=False)


def block_policy(index: int, n_swap: int, n_checkpoint: int) -> str:
    """ProTrain's interleaved layout: the first n_swap blocks swap (their copies have the most later
    compute to hide behind), the next n_checkpoint recompute, the rest keep their activations."""
    if index < n_swap:
        return "swap"
    if index < n_swap + n_checkpoint:
        return "recompute"
    return "keep"
