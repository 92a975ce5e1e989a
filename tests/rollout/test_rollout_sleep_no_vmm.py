"""Issue 41 on a backend whose storage cannot keep its addresses (NPU, XPU, CUDA without ``cuda-bindings``: no VMM
reachable from Python): ``"kv_cache"`` sleep drops the buffers, rings and states included, and the graphs that
read them; the next calls allocate and capture again. That is counted (``graph_stats.sleep_drops`` and
``recaptures``, ``last_stats["recaptures"]``, the engine's ``handoff_stats.kv_cache_drops``/``recaptures``),
reported (``sleeping_tags`` has ``"graphs"`` too, and no cache memory is held), and the tokens are the same.

Stand-in (a mock at the hardware boundary): ``kv_storage.make_arena`` returns ``None`` and ``supports_release``
``False``, as they do on those devices.
"""

from __future__ import annotations

import pytest
from rollout_helpers import NO_EOS, assert_batches_identical, left_padded_prompts

from hybrid_engine import initialize
from hybrid_engine.decode import kv_storage
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, SamplingConfig
from hybrid_engine.tiny_models import build_model

SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=2, seed=3)
REQUEST = left_padded_prompts([5, 9, 3], seed=1)


@pytest.fixture
def no_vmm(monkeypatch):
    """Stand-in for a device without releasable storage at fixed addresses (see the module docstring)."""
    monkeypatch.setattr(kv_storage, "make_arena", lambda nbytes, device: None)
    monkeypatch.setattr(kv_storage, "supports_release", lambda device: False)


def _captured(model_or_engine):
    rollout = HybridEngineRollout(model_or_engine, config=RolloutConfig(
        use_graph_capture=True, pad_token_id=0, eos_token_id=NO_EOS, max_batch_size=4))
    for _ in range(3):
        reference = rollout.generate(REQUEST, SAMPLING)
    stats = rollout.graph_stats
    assert rollout.last_stats["graph_replays"] > 0 and rollout.last_stats["graph_captures"] == 0
    assert not rollout.runner.kv_pool.releasable
    return rollout, reference, stats.graph_keys + stats.admission_graph_keys


def test_sleep_drops_the_buffers_and_graphs_and_the_next_calls_recapture_them_counted(no_vmm):
    rollout, reference, held = _captured(build_model("tiny-llama", seed=0))
    assert held > 0
    rollout.sleep()
    stats = rollout.graph_stats
    assert rollout.runner.dropped and stats.sleep_drops == 1
    assert rollout.sleeping_tags == {"kv_cache", "graphs"} and not rollout.sleeping_tags.kept
    assert stats.cache_memory_bytes == 0 and stats.graph_keys == stats.admission_graph_keys == 0
    rollout.sleep()  # asleep already: nothing more dropped
    assert rollout.graph_stats.sleep_drops == 1
    recaptured = 0
    for _ in range(2):  # a key warms up on its first run and is captured on its next
        assert_batches_identical(rollout.generate(REQUEST, SAMPLING), reference)
        recaptured += rollout.last_stats["recaptures"]
    assert recaptured == rollout.graph_stats.recaptures == held
    assert rollout.sleeping_tags == frozenset()
    assert_batches_identical(rollout.generate(REQUEST, SAMPLING), reference)
    assert rollout.last_stats["recaptures"] == rollout.last_stats["graph_captures"] == 0


def test_an_explicit_wake_after_a_drop_leaves_the_allocation_to_the_next_call(no_vmm):
    rollout, reference, held = _captured(build_model("tiny-llama", seed=0))
    rollout.sleep()
    rollout.wake()
    assert rollout.sleeping_tags == frozenset() and rollout.runner.kv_pool is None  # nothing allocated yet
    assert_batches_identical(rollout.generate(REQUEST, SAMPLING), reference)
    assert rollout.last_stats["wakes"] == 0  # woken by wake(), not by the call


def test_the_engine_counts_the_drops_and_recaptures_of_its_runners(no_vmm):
    engine, *_ = initialize(model=build_model("tiny-llama", seed=0),
                            config={"hybrid_engine": {"enable_graph_capture": True}})
    rollout, reference, held = _captured(engine)
    engine.sleep()
    assert engine.sleeping_tags == {"kv_cache", "graphs"}
    assert engine.handoff_stats.kv_cache_drops == 1 and engine.handoff_stats.recaptures == 0
    for _ in range(2):
        assert_batches_identical(rollout.generate(REQUEST, SAMPLING), reference)
    stats = engine.handoff_stats
    assert stats.recaptures == held and stats.kv_cache_wakes == 1
