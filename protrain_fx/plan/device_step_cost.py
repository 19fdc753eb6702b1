"""What stepping offloaded chunks on the compute device saves (protrain_fx/runtime/device_steps.py).

Each offloaded parameter's Adam step runs either on the CPU (the hardware profile's rate inside a
step) or on the compute device, streamed: its master, gradient and two moments go up (16 bytes) and
master, moments and the bf16 transfer copy come back (14 bytes). The link also carries backward's
own traffic meanwhile (every offloaded chunk's re-gather up and gradient down). The optimizer's
work is over when both the CPU's share and the link's are done, so the split that ends them
together is best; it is rounded to whole chunks (of the layout's size: an oversized chunk, a large
vocabulary's table, always steps on the CPU) and kept only where it saves more than 3% of the CPU's
time alone. One rank only.
"""

from __future__ import annotations

from protrain_fx.plan.profiles import (
    DEVICE_STEP_DOWN_BYTES,
    DEVICE_STEP_UP_BYTES,
    GraphProfile,
    Hardware,
)

MIN_SAVING = 0.03  # below this share of the CPU's time, every chunk steps on the CPU


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
    if not hw.device_steps or hw.world_size != 1 or not count or not a:
        return 0.0, 0, alone
    up_base = offloaded * prof.transfer_elem / hw.h2d_bytes_per_s
    down_base = offloaded * prof.master_elem / hw.d2h_bytes_per_s
    up = DEVICE_STEP_UP_BYTES / hw.h2d_bytes_per_s
    down = DEVICE_STEP_DOWN_BYTES / hw.d2h_bytes_per_s
    per_chunk = packed / count

    def work(k: int) -> float:
        x = k * per_chunk
        return max((offloaded - x) * a, up_base + x * up, down_base + x * down) if k else alone

    x = min((alone - up_base) / (a + up), (alone - down_base) / (a + down))
    k = max(0, min(count, int(x // per_chunk)))
    k = min((k, min(count, k + 1)), key=work)
    if not k or work(k) > (1 - MIN_SAVING) * alone:
        return 0.0, 0, alone
    return k / count, int(k * per_chunk), work(k)
