"""Data-parallel ranks: which rank this process is, its shard of the prompts, and its sampling seed.

Under ``torchrun`` or the ``deepspeed`` launcher every rank holds its own
engine, its own decode graphs and its own shard of the prompts. Sampling draws
from counters keyed by ``(seed, request, token index)``
(:mod:`hybrid_engine.decode.sampling`), so two ranks that sampled with the same seed
and the same request indices would draw the same noise. :func:`rank_seed`
derives each rank's seed from the caller's, so a run is reproducible for a
fixed world size and no two ranks share randomness. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from hybrid_engine.distributed.world import rank, world_size

__all__ = ["rank_seed", "shard"]


T = TypeVar("T")


_MASK64 = (1 << 64) - 1


_RANK_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct ranks map to distinct seeds


def rank_seed(seed: int, rank_id: int | None = None, world: int | None = None) -> int:
    """``seed`` for rank ``rank_id`` (default: this rank); unchanged in a single process."""
    world = world_size() if world is None else world
    if world <= 1:
        return seed
    rank_id = rank() if rank_id is None else rank_id
    mixed = (seed + (rank_id + 1) * _RANK_STRIDE) & _MASK64
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed  # stays an int64


def shard(items: Sequence[T], rank_id: int | None = None, world: int | None = None) -> tuple[Sequence[T], int]:
    """This rank's contiguous block of ``items`` and the global index of its first item.

    Blocks differ in length by at most one; use ``offset + i`` as item ``i``'s
    request id to keep ids global across ranks. With fewer items than ranks the
    last ranks get empty blocks; a ``RolloutRequest`` may hold no prompts, so
    those ranks still make each rollout call, as they must under ZeRO-3, where
    the call gathers the parameters collectively (``engine.generate`` needs at
    least one prompt).
    """
    world = world_size() if world is None else world
    rank_id = rank() if rank_id is None else rank_id
    if not 0 <= rank_id < world:
        raise ValueError(f"shard: rank {rank_id} is outside the world of {world} ranks")
    base, extra = divmod(len(items), world)
    start = rank_id * base + min(rank_id, extra)
    stop = start + base + (1 if rank_id < extra else 0)
    return items[start:stop], start
