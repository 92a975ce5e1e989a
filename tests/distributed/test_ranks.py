"""Data-parallel helpers and the DeepSpeed config mapping, in one process (no launch, no DeepSpeed needed)."""

from __future__ import annotations

import pytest

from hybrid_engine.config.loading import load_config
from hybrid_engine.distributed.ranks import rank_seed, shard
from hybrid_engine.distributed.world import rank
from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.model_access import is_zero3_partitioned
from hybrid_engine.tiny_models import build_model
from hybrid_engine.training.deepspeed import deepspeed_config


def test_shards_cover_every_item_once_with_global_offsets():
    items = list(range(11))
    seen = []
    for r in range(4):
        block, offset = shard(items, rank_id=r, world=4)
        assert list(block) == items[offset:offset + len(block)]
        seen.extend(block)
    assert seen == items
    assert [len(shard(items, rank_id=r, world=4)[0]) for r in range(4)] == [3, 3, 3, 2]
    with pytest.raises(ValueError, match="outside the world of 2 ranks"):
        shard(items, rank_id=2, world=2)


def test_rank_seeds_differ_per_rank_and_are_stable():
    assert rank_seed(5, rank_id=0, world=1) == 5  # a single process keeps the caller's seed
    seeds = [rank_seed(5, rank_id=r, world=8) for r in range(8)]
    assert len(set(seeds)) == 8 and seeds == [rank_seed(5, rank_id=r, world=8) for r in range(8)]
    assert all(-(1 << 63) <= s < (1 << 63) for s in seeds)  # still an int64 for the sampler
    assert rank_seed(6, rank_id=0, world=2) != rank_seed(5, rank_id=0, world=2)


def test_rank_and_world_come_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank() == 3
    assert rank_seed(5) == rank_seed(5, rank_id=3, world=4)
    assert shard(list(range(8)))[1] == 6
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK environment variable"):
        rank()


def test_the_deepspeed_config_is_ours_without_our_section_and_with_torch_adam():
    cfg = load_config({"zero_optimization": {"stage": 2, "overlap_comm": True},
                       "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
                       "hybrid_engine": {"enable_graph_capture": True}})
    ds = deepspeed_config(cfg)
    assert "hybrid_engine" not in ds  # DeepSpeed would build its own hybrid engine from that section
    # torch's AdamW stands in for DeepSpeed's fused Adam, with the fused one's default weight decay (0, not 0.01)
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "weight_decay": 0.0}}
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert ds["bf16"]["enabled"] is True and ds["gradient_clipping"] == 1.0  # DeepSpeed's own default
    assert "steps_per_print" not in ds  # unset: DeepSpeed's default (no progress lines)
    chosen = load_config({"optimizer": {"type": "Adam", "params": {"torch_adam": False}}})
    assert deepspeed_config(chosen)["optimizer"]["params"] == {"torch_adam": False}  # the user's choice stands
    torch_chosen = load_config({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    assert deepspeed_config(torch_chosen)["optimizer"]["params"] == {"torch_adam": True}  # torch's own defaults
    assert deepspeed_config(load_config({"optimizer": {"type": "SGD"}}))["optimizer"]["params"] == {}


def test_gathering_an_unpartitioned_model_changes_nothing():
    model = build_model("tiny-gpt2")
    assert not is_zero3_partitioned(model)
    before = [p.data_ptr() for p in model.parameters()]
    with gathered_for_inference(model):
        assert [p.data_ptr() for p in model.parameters()] == before
