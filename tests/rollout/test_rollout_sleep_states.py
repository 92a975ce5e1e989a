"""Issue 41: ``"kv_cache"`` covers windowed layers' rings and state layers' per-row states, not only the pages.

Rings (a sliding-window layer whose rows reach past twice its window keeps its last tokens per row) and linear
states (gated delta rule: a conv state and a recurrent matrix per row) live in the slots' and the prompt stage's
state stores. They now come from releasable arenas as the page pool does: ``sleep()`` lowers RssAnon by their
bytes too, the stats report what is held (0 for released storage), wake hands them back at the same addresses
(NaN-filled, then zeroed), and the next rollout captures nothing and gives the same tokens.

Negative controls: a shared mapping for the stores keeps its pages (fails the memory check); a wake that skips
the stores' re-zero gives NaN logprobs for rings (their unwritten slots are read with zero weight); a runner whose
pool is awake but whose stores still sleep refuses to step.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import NO_EOS, assert_batches_identical, left_padded_prompts, rss_anon
from transformers import AutoConfig, AutoModelForCausalLM, cache_utils

from hybrid_engine.decode import kv_storage
from hybrid_engine.decode.linear_states import StateStore
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, SamplingConfig

BASE = dict(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: Every layer windowed (8 tokens) with wide heads, so the rings hold a few MiB and the pages none.
WINDOWED = ("mistral", dict(BASE, num_attention_heads=8, num_key_value_heads=8, head_dim=128, sliding_window=8))
#: One gated-delta-rule layer with large recurrent states, one attention layer (paged).
LINEAR = ("qwen3_5_text", dict(BASE, num_key_value_heads=2, head_dim=8, linear_num_value_heads=8,
                               linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                               linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"]))
#: transformers' linear-attention cache API (5.x), through which the engine holds state layers.
LINEAR_CACHE_API = hasattr(cache_utils, "LinearAttentionCacheLayerMixin")
REQUEST = left_padded_prompts([12, 7, 9, 5], seed=2)
#: Rows of up to 12 + 20 tokens: past twice the window, so the windowed layers keep rings.
SAMPLING = SamplingConfig(max_new_tokens=20, temperature=1.0, seed=1, n_samples_per_prompt=2)


def _model(kind: tuple[str, dict]) -> torch.nn.Module:
    model_type, fields = kind
    if kind is LINEAR and not LINEAR_CACHE_API:
        pytest.skip("transformers 4.x has no linear-attention cache API (state layers are refused there)")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).eval()


def _captured(kind: tuple[str, dict]):
    """A rollout whose graphs are all captured (warm-up, capture, replay), its last batch and its state stores."""
    rollout = HybridEngineRollout(_model(kind), config=RolloutConfig(
        use_graph_capture=True, pad_token_id=0, eos_token_id=NO_EOS, max_batch_size=8, kv_cache_tokens=1024))
    for _ in range(3):
        reference = rollout.generate(REQUEST, SAMPLING)
    assert rollout.last_stats["graph_replays"] > 0 and rollout.last_stats["graph_captures"] == 0
    stores = rollout.runner.buffers.state_stores()
    assert len(stores) == 2  # the slots' and the prompt stage's
    return rollout, reference, stores


def _state_bytes(stores: list[StateStore]) -> int:
    return sum(t.nbytes for s in stores for t in s.tensors.values())


def assert_sleep_returns_the_states(rollout, stores) -> None:
    """Sleep lowers RssAnon by the stores' bytes and the pool's, and the stats say the memory is not held."""
    pool_bytes, state_bytes = rollout.runner.kv_pool.memory_bytes(), _state_bytes(stores)
    assert state_bytes >= 2 << 20  # rings or states of a few MiB: what RssAnon is checked against
    held = rollout.graph_stats.cache_memory_bytes
    before = rss_anon()
    rollout.sleep()
    dropped = before - rss_anon()
    assert dropped >= 0.9 * (state_bytes + pool_bytes), (
        f"sleep() returned {dropped} bytes of {state_bytes} bytes of states and a {pool_bytes}-byte pool")
    assert rollout.graph_stats.cache_memory_bytes == held - state_bytes - pool_bytes


@pytest.mark.parametrize("kind", [WINDOWED, LINEAR], ids=["rings", "linear-states"])
def test_sleep_returns_rings_and_linear_states_and_wake_keeps_every_graph(kind):
    rollout, reference, stores = _captured(kind)
    pointers = [t.data_ptr() for s in stores for t in s.tensors.values()]
    epoch = rollout.runner.buffers.epoch
    assert_sleep_returns_the_states(rollout, stores)
    assert all(s.asleep for s in stores) and rollout.sleeping_tags == {"kv_cache"}
    before = rss_anon()
    rollout.wake()
    assert rss_anon() - before >= 0.9 * _state_bytes(stores)  # back, zeroed
    assert not any(s.asleep for s in stores)
    assert rollout.runner.buffers.state_stores() == stores  # the same stores, at the same addresses
    assert [t.data_ptr() for s in stores for t in s.tensors.values()] == pointers
    assert rollout.runner.buffers.epoch == epoch
    batch = rollout.generate(REQUEST, SAMPLING)
    assert rollout.last_stats["graph_captures"] == 0 and rollout.last_stats["admission_graph_captures"] == 0
    assert_batches_identical(batch, reference)
    rollout.sleep()  # a call while asleep wakes the pool and the stores itself
    batch = rollout.generate(REQUEST, SAMPLING)
    assert rollout.last_stats["wakes"] == 1 and rollout.last_stats["graph_captures"] == 0
    assert rollout.last_stats["admission_graph_captures"] == 0
    assert_batches_identical(batch, reference)


def test_a_shared_mapping_for_the_rings_fails_the_memory_check(monkeypatch):
    """Negative control: ``MADV_DONTNEED`` on a shared mapping keeps its pages (and they never were RssAnon)."""
    monkeypatch.setattr(kv_storage, "make_arena", lambda nbytes, device: kv_storage.HostArena(nbytes, shared=True))
    rollout, _, stores = _captured(WINDOWED)
    with pytest.raises(AssertionError, match="sleep\\(\\) returned"):
        assert_sleep_returns_the_states(rollout, stores)


def test_a_wake_that_does_not_zero_the_rings_gives_nan(monkeypatch):
    """Negative control: woken stores are NaN until zeroed; a ring's unwritten slots are read with zero weight, and
    ``0 * NaN`` is NaN."""
    rollout, reference, _ = _captured(WINDOWED)
    monkeypatch.setattr(StateStore, "zero_states", lambda self: None)
    rollout.sleep()
    rollout.wake()
    batch = rollout.generate(REQUEST, SAMPLING)
    assert torch.isnan(batch.response_logprobs).any()
    with pytest.raises(AssertionError):
        assert_batches_identical(batch, reference)


def test_no_linear_state_is_read_across_a_sleep(monkeypatch):
    """Woken linear states are NaN until zeroed; with the re-zero skipped they stay NaN, and the tokens are still
    the same: every state a step reads was written by this call's prefill (nothing relies on kept contents)."""
    rollout, reference, stores = _captured(LINEAR)
    monkeypatch.setattr(StateStore, "zero_states", lambda self: None)
    rollout.sleep()
    rollout.wake()
    assert all(t.isnan().all() for s in stores for t in s.tensors.values() if t.is_floating_point())
    assert_batches_identical(rollout.generate(REQUEST, SAMPLING), reference)


def test_a_step_while_the_states_sleep_raises_even_with_the_pool_awake():
    rollout, _, stores = _captured(LINEAR)
    rollout.sleep()
    runner = rollout.runner
    runner.kv_pool.wake()  # the pages alone: the stores are still released
    assert runner.sleeping and all(s.asleep for s in stores)
    key = next(k for k in runner.graph_keys if hasattr(k, "span"))
    with pytest.raises(RuntimeError, match="asleep"):
        runner.step(key.bucket, key.span, (1.0, 1.0, 0))
    rollout.wake()  # still usable: wakes what still sleeps
    assert not runner.sleeping and not any(s.asleep for s in stores)
