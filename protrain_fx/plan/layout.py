"""Packing parameters into chunks, in first-use order.

A chunk is a contiguous range of ``chunk_size`` bytes holding whole parameters (a parameter never
spans two chunks), filled greedily in the order the graph first uses the parameters, so a chunk's
parameters are needed at about the same time. Tied parameters appear once (dynamo gives a shared
parameter one placeholder). A parameter larger than ``chunk_size`` (a large vocabulary's embedding
or head) gets a chunk of its own, exactly its size: chunks are sized for the transformer blocks,
not for the largest parameter (issue 24: Llama-3.2-3B's 1.47 GiB embedding had made every chunk
1.5 GiB, 8 chunks for 3.2 B parameters). Without a given ``chunk_size`` the size is chosen to waste
the least padding, in the manner of ProTrain's appendix B.1: candidates from the largest parameter
of the blocks (of all parameters when there are no blocks) upwards, scaled to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from protrain_fx.errors import OptionsError

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

    def capacity(self, chunk: int) -> int:
        """The chunk's bytes: ``chunk_size``, or its one oversized parameter's (aligned)."""
        return max(
            self.chunk_size,
            max((s.offset + _align(s.nbytes) for s in self.slots if s.chunk == chunk), default=0),
        )

    @property
    def oversized(self) -> list[int]:
        """Chunks holding one parameter larger than ``chunk_size`` (each alone in its chunk)."""
        return [s.chunk for s in self.slots if _align(s.nbytes) > self.chunk_size]

    @property
    def waste_bytes(self) -> int:
        # one pass (choose_chunk_size packs 256 candidates): an oversized chunk's capacity is its
        # one parameter's aligned size
        capacity, used = self.n_chunks * self.chunk_size, 0
        for s in self.slots:
            capacity += max(0, _align(s.nbytes) - self.chunk_size)
            used += s.nbytes
        return capacity - used


def pack(params: list[tuple[str, int]], chunk_size: int, groups: list | None = None) -> ChunkLayout:
    """Greedy first-use-order packing of ``(fqn, nbytes)`` into chunks of ``chunk_size`` bytes; a
    parameter larger than that gets a chunk of its own. ``groups`` (one key per parameter): a
    parameter whose group differs from the one before it starts a new chunk, so no chunk spans two
    groups (the regions a graph is compiled in, protrain_fx/graph/regions.py: each region's
    parameters are chunked by its own store)."""
    if chunk_size < ALIGN_BYTES:
        raise OptionsError(
            f"chunk_size {chunk_size} B is smaller than the {ALIGN_BYTES} B alignment of a "
            "parameter inside a chunk"
        )
    slots, chunk, used, open_chunk = [], 0, 0, False
    for i, (fqn, nbytes) in enumerate(params):
        need = _align(nbytes)
        new_group = groups is not None and i > 0 and groups[i] != groups[i - 1]
        if open_chunk and (used + need > chunk_size or need > chunk_size or new_group):
            chunk, used = chunk + 1, 0
        slots.append(ParamSlot(fqn, chunk, used, nbytes))
        used += need
        open_chunk = True
        if need > chunk_size:  # an oversized parameter's chunk is closed after it
            chunk, used, open_chunk = chunk + 1, 0, False
    return ChunkLayout(chunk_size, tuple(slots), chunk + open_chunk)


def choose_chunk_size(
    params: list[tuple[str, int]],
    *,
    block_params: list[tuple[str, int]] | None = None,
    min_chunks: int = 4,
    n_candidates: int = 256,
    groups: list | None = None,
) -> int:
    """The chunk size with the least padding waste among candidates between the largest (aligned)
    parameter of the blocks (``block_params``; of ``params`` when none are given) and the larger of
    twice that and ``total / min_chunks``; ties go to the smaller size (finer placement
    granularity). Larger parameters get chunks of their own (:func:`pack`). ``min_chunks`` keeps
    small models from collapsing into one chunk. ``groups``: as :func:`pack`'s."""
    if not params:
        return ALIGN_BYTES
    sizing = block_params or params
    largest = max(_align(b) for _, b in sizing)
    total = sum(_align(b) for _, b in params if _align(b) <= largest)
    upper = max(largest, min(2 * largest, max(largest, total // min_chunks)))
    step = max(
        ALIGN_BYTES, _align((upper - largest) // n_candidates) if upper > largest else ALIGN_BYTES
    )
    best = None
    size = largest
    while size <= upper:
        waste = pack(params, size, groups).waste_bytes
        if best is None or waste < best[0]:
            best = (waste, size)
        size += step
    return best[1]
