"""What stepping offloaded chunks on the compute device saves (protrain_fx/runtime/device_steps.py).

Each offloaded parameter's Adam step runs either on the CPU (the hardware profile's rate inside a
step) or on the compute device, streamed: its master, gradient and two moments go up (16 bytes) and
master, moments and the bf16 transfer copy come back (14 bytes). The link also carries backward's
own traffic meanwhile (every offloaded chunk's re-gather up and gradient down). The optimizer's
work is over when both the CPU's share and the link's are done, so the split that ends them
together is best; it is rounded to whole chunks (of the layout's size: an oversized chunk, a large
vocabulary's table, always steps on the CPU) and kept only where it saves more than 5% of the CPU's
time alone. One rank only.

Both ways touch the host's memory as much: the CPU kernel reads and writes 30 bytes per parameter,
the copies of a device step 30 too, and backward's own copies go through it as well. So the work
is never shorter than all of those bytes at the host's memory bandwidth inside a step
(``Hardware.host_s_per_byte``: the slowest of what the CPU kernel reaches alone, the triad, and what
training steps measured on this machine, all taken as bound by memory): device steps only pay where
the CPU steps run below that (the cores shared with the threads that launch the device's work:
``Hardware.cpu_contention``), not where memory bounds them. Once steps on a machine measured the CPU
step, its slowdown is taken as memory's, and device steps are not chosen: on the H200 host, plans
that stepped 41-55% of the offloaded chunks on the device ran 11-31% slower than the same plans
without (benchmarks/results/oom_sweep_h200_run14.md against runs 10 and 13), the CPU kernel no
faster (3.0-3.5 G parameters/s) and the host worker waiting on the link.
"""

from __future__ import annotations

from protrain_fx.plan.profiles import (
    DEVICE_STEP_DOWN_BYTES,
    DEVICE_STEP_UP_BYTES,
    GraphProfile,
    Hardware,
)

MIN_SAVING = 0.05  # below this share of the CPU's time, every chunk steps on the CPU
HOST_BYTES_PER_PARAM = 30  # host memory one parameter's step touches, on the CPU or copied


def device_step_link_s(hw: Hardware) -> float:
    """Link seconds per parameter stepped on the device (up and down overlap)."""
    return max(
        DEVICE_STEP_UP_BYTES / hw.h2d_bytes_per_s, DEVICE_STEP_DOWN_BYTES / hw.d2h_bytes_per_s
    )


def device_step_split(
    prof: GraphProfile,
    hw: Hardware,
    offloaded: int,
    packed: int,
    count: int,
    cpu_per_param: float,
) -> tuple[float, int, float]:
    """``(share of the ``count`` offloaded chunks of the layout's size stepped on the device, their
    parameters, seconds of the optimizer's work)`` for ``offloaded`` offloaded parameters of which
    ``packed`` are in those chunks, at ``cpu_per_param`` CPU seconds each."""
    a = cpu_per_param
    alone = offloaded * a
    forced = hw.device_step_share
    if (not hw.device_steps and not forced) or hw.world_size != 1 or not count or not a:
        return 0.0, 0, alone
    up_base = offloaded * prof.upload_elem / hw.h2d_bytes_per_s
    down_base = offloaded * prof.master_elem / hw.d2h_bytes_per_s
    up = DEVICE_STEP_UP_BYTES / hw.h2d_bytes_per_s
    down = DEVICE_STEP_DOWN_BYTES / hw.d2h_bytes_per_s
    per_chunk = packed / count

    # every step's bytes and backward's copies through the host's memory, at its rate inside a step
    memory = (
        offloaded * HOST_BYTES_PER_PARAM + offloaded * (prof.upload_elem + prof.master_elem)
    ) * hw.host_s_per_byte()

    def work(k: int) -> float:
        x = k * per_chunk
        return (
            max((offloaded - x) * a, up_base + x * up, down_base + x * down, memory) if k else alone
        )

    if forced:  # the user's share, as the runtime picks it (floor: device_steps.pick)
        k = min(count, int(forced * count + 1e-9))
        return (k / count, int(k * per_chunk), work(k)) if k else (0.0, 0, alone)
    x = min((alone - up_base) / (a + up), (alone - down_base) / (a + down))
    k = max(0, min(count, int(x // per_chunk)))
    k = min((k, min(count, k + 1)), key=work)
    if not k or work(k) > (1 - MIN_SAVING) * alone:
        return 0.0, 0, alone
    return k / count, int(k * per_chunk), work(k)


def device_step_table(
    prof: GraphProfile, hw: Hardware, as_is: list[bool], cpu_per_param: float
) -> list[tuple[float, int, float]]:
    """:func:`device_step_split` for every ``n_persist`` (chunks ``n_persist..`` offloaded; those
    ``as_is``, oversized, always step on the CPU). It depends on neither the buffers nor the
    activation policies, so the search computes it once per profile."""
    n = len(prof.chunks)
    table: list[tuple[float, int, float]] = [(0.0, 0, 0.0)] * (n + 1)
    offloaded = packed = count = 0
    for c in range(n, -1, -1):
        if c < n:
            offloaded += prof.chunks[c].numel
            if not as_is[c]:
                packed, count = packed + prof.chunks[c].numel, count + 1
        table[c] = device_step_split(prof, hw, offloaded, packed, count, cpu_per_param)
    return table
