"""Packing parameters into fixed-size chunks, in first-use order.

A chunk is a contiguous range of ``chunk_size`` bytes holding whole parameters (a parameter never
spans two chunks), filled greedily in the order the graph first uses the parameters, so a chunk's
parameters are needed at about the same time. Tied parameters appear once (dynamo gives a shared
parameter one placeholder). Without a given ``chunk_size`` the size is chosen to waste the least
padding, in the manner of ProTrain's appendix B.1: candidates from the largest parameter upwards,
scaled to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from protrain_fx.errors import OptionsError
from protrain_fx.options import format_bytes

# Elements are aligned inside a chunk so every parameter view starts on a 64-byte boundary.
ALIGN_BYTES = 64


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class ParamSlot:
    fqn: str
    chunk: int
    offset: int  # byte offset inside the chunk
    nbytes: int


@dataclass(frozen=True)
class ChunkLayout:
    chunk_size: int
    slots: tuple[ParamSlot, ...]
    n_chunks: int

    def params_of(self, chunk: int) -> list[ParamSlot]:
        return [s for s in self.slots if s.chunk == chunk]

    def used_bytes(self, chunk: int) -> int:
        return sum(s.nbytes for s in self.slots if s.chunk == chunk)

    @property
    def waste_bytes(self) -> int:
        return self.n_chunks * self.chunk_size - sum(s.nbytes for s in self.slots)


def pack(params: list[tuple[str, int]], chunk_size: int) -> ChunkLayout:
    """Greedy first-use-order packing of ``(fqn, nbytes)`` into chunks of ``chunk_size`` bytes."""
    largest = max((_align(b) for _, b in params), default=0)
    if params and chunk_size < largest:
        name = max(params, key=lambda p: p[1])[0]
        raise OptionsError(
            f"chunk_size {format_bytes(chunk_size)} ({chunk_size} B) is smaller than the largest "
            "parameter "
            f"{name!r} ({largest} B aligned); the smallest chunk_size that works is {largest} B"
        )
    slots, chunk, used = [], 0, 0
    for fqn, nbytes in params:
        need = _align(nbytes)
        if used + need > chunk_size and used > 0:
            chunk, used = chunk + 1, 0
        slots.append(ParamSlot(fqn, chunk, used, nbytes))
        used += need
    return ChunkLayout(chunk_size, tuple(slots), chunk + 1 if params else 0)


def choose_chunk_size(
    params: list[tuple[str, int]], *, min_chunks: int = 4, n_candidates: int = 256
) -> int:
    """The chunk size with the least padding waste among candidates between the largest (aligned)
    parameter and the larger of twice that and ``total / min_chunks``; ties go to the smaller size
    (finer placement granularity). ``min_chunks`` keeps small models from collapsing into one chunk.
    """
    if not params:
        return ALIGN_BYTES
    largest = max(_align(b) for _, b in params)
    total = sum(_align(b) for _, b in params)
    upper = max(largest, min(2 * largest, max(largest, total // min_chunks)))
    step = max(
        ALIGN_BYTES, _align((upper - largest) // n_candidates) if upper > largest else ALIGN_BYTES
    )
    best = None
    size = largest
    while size <= upper:
        waste = pack(params, size).waste_bytes
        if best is None or waste < best[0]:
            best = (waste, size)
        size += step
    return best[1]
