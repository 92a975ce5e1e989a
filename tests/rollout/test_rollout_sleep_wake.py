"""Issue 41: a rollout's page pool sleeps between rollouts and wakes at the same addresses, every graph kept.

The must-hold: with a 256 MiB ``kv_cache_bytes`` budget and graphs on, ``sleep()`` lowers RssAnon by at least
90% of the budget; after ``wake()`` the next rollout captures nothing new and gives the same tokens, and so does
a call made while asleep (it wakes the pool itself, counted in ``last_stats["wakes"]``). Negative controls show
the checks can fail: a backend that reallocates on wake fails the address check, a shared mapping (whose pages
``MADV_DONTNEED`` does not return) fails the memory check, and a wake that does not re-zero the pages (they come
back NaN-filled) fails the token check.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import NO_EOS, assert_batches_identical, left_padded_prompts, rss_anon
from sampled_close import assert_sampled_close

from hybrid_engine.decode import kv_storage
from hybrid_engine.decode.kv_pool import KVPool
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, SamplingConfig
from hybrid_engine.tiny_models import build_model

BUDGET = 256 << 20
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=2, seed=3)


def _rollout(model, **config) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                           eos_token_id=NO_EOS, max_batch_size=4, **config))


def _captured(budget: int = BUDGET):
    """A rollout whose graphs are all captured (warm-up, capture, replay) and its last batch."""
    rollout = _rollout(build_model("tiny-llama", seed=0), kv_cache_bytes=budget)
    request = left_padded_prompts([5, 9, 3], seed=1)
    for _ in range(3):
        batch = rollout.generate(request, SAMPLING)
    assert rollout.last_stats["graph_replays"] > 0 and rollout.last_stats["graph_captures"] == 0
    return rollout, request, batch


def assert_sleep_returns_memory(rollout, budget: int = BUDGET) -> None:
    before = rss_anon()
    rollout.sleep()
    dropped = before - rss_anon()
    assert dropped >= 0.9 * budget, f"sleep() returned {dropped} bytes of a {budget}-byte pool"


def assert_wake_keeps_addresses(rollout, request, reference) -> None:
    """Sleep and wake: the same storage addresses and epoch, nothing captured, the same tokens."""
    pool = rollout.runner.kv_pool
    pointers = [t.data_ptr() for t in (*pool.keys, *pool.values)]
    epoch = rollout.runner.buffers.epoch
    rollout.sleep()
    rollout.wake()
    pool = rollout.runner.kv_pool
    assert [t.data_ptr() for t in (*pool.keys, *pool.values)] == pointers
    assert rollout.runner.buffers.epoch == epoch
    batch = rollout.generate(request, SAMPLING)
    assert rollout.last_stats["graph_captures"] == 0 and rollout.last_stats["admission_graph_captures"] == 0
    assert rollout.last_stats["wakes"] == 0  # woken by wake(), not by the call
    assert_batches_identical(batch, reference)


def test_sleep_returns_the_pool_and_wake_keeps_every_graph():
    rollout, request, reference = _captured()
    assert rollout.sleeping_tags == frozenset()
    assert_sleep_returns_memory(rollout)
    tags = rollout.sleeping_tags
    assert tags == {"kv_cache"} and "graphs" in tags.kept  # graph memory is kept, and said so
    before = rss_anon()
    rollout.wake()
    assert rss_anon() - before >= 0.9 * BUDGET  # the pages are back (zeroed)
    assert rollout.sleeping_tags == frozenset() and not rollout.sleeping_tags.kept
    assert_wake_keeps_addresses(rollout, request, reference)


def test_a_call_while_asleep_wakes_the_pool_itself_and_gives_the_same_tokens():
    rollout, request, reference = _captured(1 << 20)
    rollout.sleep()
    batch = rollout.generate(request, SAMPLING)
    assert rollout.last_stats["wakes"] == 1 and rollout.last_stats["graph_captures"] == 0
    assert rollout.graph_stats.wakes == 1
    assert_batches_identical(batch, reference)
    rollout.generate(request, SAMPLING)
    assert rollout.last_stats["wakes"] == 0


def test_a_step_on_a_sleeping_pool_raises_instead_of_reading_released_memory():
    rollout, _, _ = _captured(1 << 20)
    rollout.sleep()
    runner = rollout.runner
    key = next(k for k in runner.graph_keys if hasattr(k, "span"))
    with pytest.raises(RuntimeError, match="asleep"):
        runner.step(key.bucket, key.span, (1.0, 1.0, 0))
    rollout.wake()  # still usable
    assert not runner.sleeping


def test_a_reallocating_backend_fails_the_address_check(monkeypatch):
    """Negative control: storage that comes back elsewhere on wake makes the runner recapture."""

    class Reallocating(kv_storage.HostArena):
        def restore(self) -> bool:
            shapes = [(t.shape, t.dtype) for t in self._tensors]
            self._fresh = fresh = kv_storage.HostArena(self.nbytes)
            self._tensors = [fresh.take(tuple(s), d) for s, d in shapes]
            self.released = False
            return True

    monkeypatch.setattr(kv_storage, "make_arena", lambda nbytes, device: Reallocating(nbytes))
    rollout, request, reference = _captured(1 << 20)
    with pytest.raises(AssertionError):
        assert_wake_keeps_addresses(rollout, request, reference)
    for _ in range(2):  # the runner captures its graphs again (a key warms up, then captures), and counts it
        assert_batches_identical(rollout.generate(request, SAMPLING), reference)
    assert rollout.graph_stats.recaptures == rollout.graph_stats.graph_keys + rollout.graph_stats.admission_graph_keys


def test_a_shared_mapping_fails_the_memory_check(monkeypatch):
    """Negative control: ``MADV_DONTNEED`` on a shared mapping keeps its pages (and they never were RssAnon)."""
    monkeypatch.setattr(kv_storage, "make_arena", lambda nbytes, device: kv_storage.HostArena(nbytes, shared=True))
    rollout, _, _ = _captured()
    with pytest.raises(AssertionError, match="sleep\\(\\) returned"):
        assert_sleep_returns_memory(rollout)


def test_a_wake_that_does_not_zero_the_pages_fails_the_token_check(monkeypatch):
    """Negative control: woken pages are NaN until zeroed; attention reads a page's unwritten tail with zero
    weight, so a wake that skipped the re-zero gives NaN logprobs."""
    rollout, request, reference = _captured(1 << 20)
    monkeypatch.setattr(KVPool, "zero_pages", lambda self: None)
    rollout.sleep()
    rollout.wake()
    batch = rollout.generate(request, SAMPLING)
    assert torch.isnan(batch.response_logprobs).any()
    with pytest.raises(AssertionError):
        assert_batches_identical(batch, reference)


def test_sleep_evicts_kept_episode_pages_and_the_next_turn_prefills_again():
    model = build_model("tiny-llama", seed=2)
    request = left_padded_prompts([5, 3], seed=7)

    def turns(sleep: bool):
        rollout = _rollout(model)
        episodes = rollout.open_episodes(request, n_samples_per_prompt=2)
        stats = []
        for t in range(2):
            episodes.turn(SamplingConfig(max_new_tokens=4, temperature=1.0, seed=11 + t))
            stats.append(dict(rollout.last_stats))
            for r in range(4):
                episodes.append(r, [40, 41])
            if sleep:
                rollout.sleep()
                assert rollout.runner.ledger.held_rows == 0  # evicted: their K/V is gone
        return episodes.close(), stats

    kept, kept_stats = turns(False)
    slept, slept_stats = turns(True)
    assert kept_stats[1]["kv_reused_tokens"] > 0 and slept_stats[1]["kv_reused_tokens"] == 0
    assert slept_stats[1]["wakes"] == 1
    for r in range(4):
        n = int(kept.completion_mask[r].sum())
        assert int(slept.completion_mask[r].sum()) == n
        assert_sampled_close(model, kept.prompt_ids[r][kept.prompt_mask[r].bool()].tolist(),
                             slept.completion_ids[r, :n].tolist(), slept.completion_logprobs[r, :n].tolist(),
                             kept.completion_ids[r, :n].tolist(), kept.completion_logprobs[r, :n].tolist(),
                             name=f"row {r}")


def test_bad_tags_are_refused_and_the_rollout_stays_usable():
    rollout, request, reference = _captured(1 << 20)
    with pytest.raises(ValueError, match="unknown tag 'kv'"):
        rollout.sleep("kv")
    with pytest.raises(ValueError, match="unknown tag 'optimizer'"):
        rollout.sleep(["optimizer"])  # a rollout has no optimizer: the engine's sleep takes that tag
    with pytest.raises(TypeError, match="tags must be"):
        rollout.sleep(3)
    assert rollout.sleeping_tags == frozenset()
    rollout.sleep(["graphs"])  # graphs alone: nothing released (kept), the pool stays
    assert rollout.sleeping_tags == frozenset() and not rollout.runner.sleeping
    assert_batches_identical(rollout.generate(request, SAMPLING), reference)


def test_sleep_waits_for_a_running_call_and_refuses_to_nest_inside_one():
    """A sleep from another thread waits for the running generate (its every forward sees the pool awake); a
    sleep from inside the call (a hook) is the call lock's nesting error, and the rollout stays usable."""
    import threading
    import time

    model = build_model("tiny-llama", seed=0)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=False, pad_token_id=0,
                                                              eos_token_id=NO_EOS, max_batch_size=4))
    request = left_padded_prompts([5, 9, 3], seed=1)
    reference = rollout.generate(request, SAMPLING)
    started, go, seen = threading.Event(), threading.Event(), []

    def hook(module, args, output):
        seen.append(rollout.runner.sleeping)
        if not started.is_set():
            started.set()
            go.wait(timeout=60)

    handle = model.register_forward_hook(hook)
    out: dict = {}
    caller = threading.Thread(target=lambda: out.setdefault("batch", rollout.generate(request, SAMPLING)))
    sleeper = threading.Thread(target=rollout.sleep)
    caller.start()
    assert started.wait(timeout=60)
    sleeper.start()
    time.sleep(0.05)  # a nudge, not a measurement: a sleep that did not wait would now run inside the call
    go.set()
    caller.join(timeout=120)
    sleeper.join(timeout=120)
    handle.remove()
    assert not any(seen) and len(seen) > 1  # every forward of the call saw the pool awake
    assert_batches_identical(out["batch"], reference)
    assert rollout.sleeping_tags == {"kv_cache"}  # the sleep ran, after the call

    def nested(module, args, output):
        rollout.sleep()

    handle = model.register_forward_hook(nested)
    with pytest.raises(RuntimeError, match="HybridEngineRollout.sleep: this model is in use"):
        rollout.generate(request, SAMPLING)
    handle.remove()
    assert_batches_identical(rollout.generate(request, SAMPLING), reference)


@pytest.mark.parametrize("name,overrides", [("tiny-gpt2", {}), ("tiny-mistral", {"sliding_window": 8})])
def test_other_layouts_sleep_and_wake_to_the_same_tokens(name, overrides):
    """A learned-position model, and windowed layers whose rows reach past twice the window (rings kept in the
    slots, outside the pages): the pool sleeps and wakes under them with the same tokens, nothing recaptured."""
    model = build_model(name, seed=0, **overrides)
    rollout = _rollout(model, kv_cache_tokens=1024)
    request = left_padded_prompts([12, 7], seed=2)
    sampling = SamplingConfig(max_new_tokens=20, temperature=1.0, seed=1)
    for _ in range(3):
        reference = rollout.generate(request, sampling)
    rollout.sleep()
    batch = rollout.generate(request, sampling)
    assert rollout.last_stats["wakes"] == 1 and rollout.last_stats["graph_captures"] == 0
    assert_batches_identical(batch, reference)
