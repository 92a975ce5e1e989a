"""``rollout.last_stats`` has one schema (issue 38): every call, empty or not, fills :class:`CallStats`' keys.

An empty request (a data-parallel rank with an empty shard) used to report 19 of a normal call's 40 keys, so
``last_stats["decode_ms"]`` raised ``KeyError`` on exactly the rank a logging loop could not skip.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import NO_EOS, left_padded_prompts

import hybrid_engine
from hybrid_engine.graphs.stats import CallStats
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3, n_samples_per_prompt=2)
KEYS = set(CallStats.keys())
#: What an empty request does nothing of: each is 0 (or empty) in its stats.
CALL_COUNTERS = ("prefill_ms", "decode_ms", "decode_steps", "prefill_forwards", "tokens_generated",
                 "tokens_per_second", "graph_replays", "graph_captures", "admission_graph_replays",
                 "admission_graph_captures", "fallbacks", "peak_active_batch", "kv_pages_peak", "kv_pages_held_peak",
                 "kv_bytes_peak", "preemptions", "host_syncs", "host_ms_overlapped", "host_ms_after_sync",
                 "eager_steps", "capture_ms", "prefill_rows", "prefill_tokens", "kv_reused_tokens", "kv_row_copies",
                 "admission_rounds", "harvests", "compactions", "rows_moved", "num_sequences", "wakes", "recaptures")


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama", seed=3)


def _rollout(model, graphs: bool = False, **config) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=NO_EOS, **config))


def _empty() -> RolloutRequest:
    return RolloutRequest(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64))


def test_the_schema_lists_every_key_once_and_a_call_has_exactly_its_keys(model):
    keys = CallStats.keys()
    # the 40 keys a normal call had, "wakes" and "recaptures" (issue 41), "profile", and the host split around
    # reads (issue 40: "host_ms_overlapped", "host_ms_after_sync")
    assert len(keys) == len(set(keys)) == 45
    rollout = _rollout(model)
    rollout.generate(left_padded_prompts([3, 5], seed=1), SAMPLING)
    assert list(rollout.last_stats) == list(keys)


@pytest.mark.parametrize("profiling", [False, True], ids=["plain", "profiling"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_an_empty_request_reports_the_keys_a_normal_call_does(model, graphs, profiling):
    rollout = _rollout(model, graphs, enable_profiling=profiling)
    rollout.generate(_empty(), SAMPLING)  # first: nothing allocated yet
    first_empty = dict(rollout.last_stats)
    rollout.generate(left_padded_prompts([4, 2, 6], seed=2), SAMPLING)
    normal = dict(rollout.last_stats)
    rollout.generate(_empty(), SAMPLING)  # after a call: the buffers are held, the call still did nothing
    empty = dict(rollout.last_stats)
    assert set(first_empty) == set(empty) == set(normal) == KEYS
    assert normal["decode_ms"] > 0 and normal["num_sequences"] == 6
    for stats in (first_empty, empty):
        assert stats["decode_ms"] == 0.0 and stats["prefill_ms"] == 0.0 and stats["total_ms"] >= 0
        assert all(stats[k] == 0 for k in CALL_COUNTERS), {k: stats[k] for k in CALL_COUNTERS if stats[k]}
        assert stats["span_buckets"] == () and stats["span_steps"] == {} and stats["bucket_steps"] == {}
        assert stats["last_refusal_reason"] is None
        assert stats["cache_capacity"] == 0 and stats["graph_batch_size"] == 0
    assert empty["kv_page_size"] == normal["kv_page_size"] > 0  # the pool the rollout still holds
    if profiling:
        assert set(empty["profile"]) == set(normal["profile"])
        assert empty["profile"]["decode_ms_per_step"] == 0.0
    else:
        assert empty["profile"] is None and normal["profile"] is None


def test_episode_turns_report_the_same_keys(model):
    rollout = _rollout(model, True)
    episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=4), n_samples_per_prompt=2)
    for turn in range(2):
        episodes.turn(SamplingConfig(max_new_tokens=4, temperature=1.0, seed=turn))
        assert set(rollout.last_stats) == KEYS
        assert rollout.last_stats["tokens_generated"] == 4 * 4
        for row in range(episodes.num_rows):
            episodes.append(row, [40, 41])
    assert rollout.last_stats["kv_reused_tokens"] > 0  # the second turn continued on kept pages


def test_a_refused_call_leaves_the_last_calls_stats(model):
    rollout = _rollout(model)
    assert rollout.last_stats == {}  # before any call
    rollout.generate(left_padded_prompts([3], seed=5), SAMPLING)
    before = dict(rollout.last_stats)
    too_long = SamplingConfig(max_new_tokens=10**6)
    with pytest.raises(ValueError, match="position limit"):
        rollout.generate(left_padded_prompts([3], seed=5), too_long)
    assert rollout.last_stats == before


def test_engine_generate_reports_the_rollout_schema():
    """engine.generate's last_stats: the same keys as a rollout's, filled by the one executor."""
    engine = hybrid_engine.initialize(model=build_model("tiny-llama", seed=3), config={"hybrid_engine": {"enabled": True,
                                                                            "max_out_tokens": 64}})[0]
    assert engine.last_stats == {}
    ids = torch.randint(3, 100, (3, 5))
    out = engine.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                          do_sample=False)
    stats = engine.last_stats
    assert set(stats) == KEYS
    assert stats["tokens_generated"] == 3 * 4 == (out.shape[1] - 5) * 3 and stats["num_sequences"] == 3
    assert stats["decode_steps"] == 3 and stats["prefill_forwards"] == 1 and stats["profile"] is None
