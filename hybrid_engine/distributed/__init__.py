"""Scaling out: the world and its ranks, per-rank seeds and shards, ZeRO-3 gathers, the gathered inference
copy, and a local launcher with a hard timeout."""

from hybrid_engine.distributed.ranks import rank_seed, shard
from hybrid_engine.distributed.world import destroy_process_group, rank, world_size

__all__ = ["destroy_process_group", "rank", "rank_seed", "shard", "world_size"]
