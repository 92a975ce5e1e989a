"""The paged K/V pool through rollouts and engine.generate: a budget instead of slots x capacity, pages on
demand, preemption that loses nothing, shared prompt pages, attention over the live span, and the stats."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import (
    NO_EOS,
    assert_batches_identical,
    assert_same_samples,
    assert_same_tokens,
    left_padded_prompts,
    run,
)

from hybrid_engine.decode.kv_pool import pages_for
from hybrid_engine.engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

SAMPLED = SamplingConfig(max_new_tokens=24, temperature=0.9, top_p=0.95, n_samples_per_prompt=2, seed=5)
GREEDY = SamplingConfig(max_new_tokens=24, temperature=0.0, n_samples_per_prompt=2)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama", seed=6)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_pool_too_small_for_every_row_preempts_and_resumes_with_the_same_tokens(model, sampling, graphs):
    """8 rows of up to 7 + 24 tokens need 16 pages of 16 at once; a 160-token pool (10 pages) runs them by
    preempting the newest rows and resuming them later by prefilling what they had: same tokens as with no
    memory pressure, never an error, no request lost."""
    request = left_padded_prompts([7, 4, 6, 5], seed=3)
    free, _ = run(model, request, sampling, graphs=False, max_batch_size=8)
    tight, stats = run(model, request, sampling, graphs=graphs, max_batch_size=8, kv_cache_tokens=160,
                       kv_page_size=16)
    assert stats["preemptions"] > 0 and stats["kv_pages_total"] == 10 and stats["kv_pages_peak"] <= 10
    # A resumed row's K/V was prefilled again, in other batch shapes than its decode steps wrote it: the logprobs
    # may differ in the last float bits, so the samples (and greedy tokens) are compared as numerically different
    # paths are (a flip float noise can make, teacher-forced), not by asking both to round alike.
    assert_same_samples(tight, free, model=model, sampling=sampling)
    assert stats["tokens_generated"] == 8 * 24 and tight.input_ids.shape[0] == 8
    if graphs:
        assert stats["graph_replays"] > 0 and stats["fallbacks"] == 0


def test_preemption_under_graphs_equals_preemption_eagerly(model):
    request = left_padded_prompts([7, 4, 6, 5], seed=4)
    cfg = dict(max_batch_size=8, kv_cache_tokens=160)
    eager, es = run(model, request, SAMPLED, graphs=False, **cfg)
    graph, gs = run(model, request, SAMPLED, graphs=True, **cfg)
    assert es["preemptions"] == gs["preemptions"] > 0
    assert_batches_identical(graph, eager)


def test_a_budget_too_small_for_one_request_is_a_value_error_up_front_and_the_rollout_stays_usable(model):
    request = left_padded_prompts([7, 4], seed=1)
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=NO_EOS,
                                                              kv_cache_tokens=32))
    with pytest.raises(ValueError, match=r"RolloutConfig\.kv_cache_tokens=32 holds 2 pages of 16 tokens .* needs "
                                         r"up to 3 pages: raise RolloutConfig\.kv_cache_tokens to at least 48"):
        rollout.generate(request, GREEDY)
    small = SamplingConfig(max_new_tokens=8, temperature=0.0)  # 7 + 8 tokens: one page a row, and its prompt's
    batch = rollout.generate(request, small)
    want, _ = run(model, request, small, graphs=False)
    assert_batches_identical(batch, want)


def test_n_samples_share_their_prompts_full_pages():
    """One 64-token prompt (4 full pages) and 16 samples of 8 tokens: the prompt is held once, each sample holds
    the one page its response starts (the prompt fills its last page), 4 + 16 pages at the peak, not 16 x 5."""
    model = build_model("tiny-gpt2", n_positions=256, seed=2)
    request = left_padded_prompts([64], seed=9)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, n_samples_per_prompt=16, seed=1)
    batch, stats = run(model, request, sampling, graphs=True, max_batch_size=16)
    assert stats["kv_pages_peak"] == 4 + 16
    assert stats["prefill_rows"] == 1 and batch.input_ids.shape[0] == 16
    single, sstats = run(model, request, sampling, graphs=True, max_batch_size=16, use_shared_prefill=False)
    assert sstats["kv_pages_peak"] > 16 * 4  # each sample's own prompt copy
    assert_same_samples(batch, single, model=model, sampling=sampling)  # one prefill of 1 row or of 16


def test_a_partly_filled_prompt_page_is_copied_for_all_but_the_last_sample():
    model = build_model("tiny-gpt2", n_positions=256, seed=2)
    request = left_padded_prompts([40], seed=9)  # 2 full pages and 8 tokens on a third
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, n_samples_per_prompt=4, seed=2)
    batch, stats = run(model, request, sampling, graphs=True, max_batch_size=4)
    assert stats["kv_pages_peak"] == 2 + 4  # the full pages once, then one last page each (one is the prompt's)
    unshared, _ = run(model, request, sampling, graphs=False, max_batch_size=4, use_shared_prefill=False)
    assert_same_samples(batch, unshared, model=model, sampling=sampling)  # one prefill of 1 row or of 4


def test_step_cost_follows_the_tokens_not_the_capacity():
    """At cache_capacity 2048 the rows (prompts of up to 7 and 24 new tokens) read 2 pages a step, as at 64."""
    model = build_model("tiny-llama", seed=6, max_position_embeddings=2048)
    request = left_padded_prompts([7, 4, 6], seed=2)
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.0)
    small, s_small = run(model, request, sampling, graphs=True, cache_capacity=64)
    large, s_large = run(model, request, sampling, graphs=True, cache_capacity=2048)
    assert s_small["span_buckets"] == s_large["span_buckets"] == (1, 2)
    assert s_large["cache_capacity"] >= 2048
    # The same pages read in the same span buckets: the same numerics, so the same tokens exactly.
    assert_same_tokens(large, small)
    ref = model.generate(request.prompt_ids, attention_mask=request.prompt_attention_mask, do_sample=False,
                         max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
    assert torch.equal(large.input_ids[:, request.prompt_ids.shape[1]:], ref[:, request.prompt_ids.shape[1]:])


def test_pages_stats_and_graph_keys_stay_within_their_stated_bound(model):
    request = left_padded_prompts([7, 4, 6, 5], seed=8)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=NO_EOS, kv_page_size=8))
    for max_new in (4, 40, 12, 64):
        rollout.generate(request, SamplingConfig(max_new_tokens=max_new, temperature=0.7, n_samples_per_prompt=2,
                                                 seed=max_new))
        s = rollout.last_stats
        lengths = rollout.last_stats["tokens_generated"]
        assert s["kv_page_size"] == 8 and s["kv_bytes_peak"] > 0 and s["preemptions"] == 0
        assert s["kv_pages_peak"] <= s["kv_pages_total"] and lengths > 0
        # Peak pages follow the tokens held: every row's prompt and response, page-rounded, plus staged prompts.
        held = sum(pages_for(n + max_new - 1, 8) for n in request.prompt_lengths) * 2
        assert s["kv_pages_peak"] <= held + sum(pages_for(n, 8) for n in request.prompt_lengths)
    g = rollout.graph_stats
    assert g.graph_keys <= g.graph_key_bound * 1  # one sampling mode
    whole = rollout.runner.slots.cache.max_pages  # a span is a power of two pages, or a row's whole table
    assert all(span & (span - 1) == 0 or span == whole for span in g.span_buckets) and g.kv_pages_total > 0


def test_engine_generate_under_a_kv_budget_preempts_and_equals_transformers():
    model = build_model("tiny-qwen2", seed=4)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {
        "enable_graph_capture": True, "max_out_tokens": 64, "kv_cache_tokens": 96, "kv_page_size": 16}})
    ids = torch.randint(4, 384, (6, 10), generator=torch.Generator().manual_seed(3))
    out = engine.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    s = engine.graph_stats
    assert s.preemptions > 0 and s.kv_pages_total == 6 and s.kv_pages_peak <= 6 and s.kv_page_size == 16
    small, *_ = initialize(model=model, config={"hybrid_engine": {
        "enable_graph_capture": True, "max_out_tokens": 64, "kv_cache_tokens": 48}})
    with pytest.raises(ValueError, match=r"hybrid_engine\.kv_cache_tokens=48 holds 3 pages .* raise "
                                         r"hybrid_engine\.kv_cache_tokens to at least 64"):
        small.generate(ids, max_new_tokens=50, do_sample=False, pad_token_id=0)
    assert torch.equal(small.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                      pad_token_id=0), ref)  # usable afterwards


@pytest.mark.parametrize("bad,match", [
    (dict(kv_page_size=0), "kv_page_size"), (dict(kv_cache_tokens=0), "kv_cache_tokens"),
    (dict(kv_cache_bytes=-1), "kv_cache_bytes"), (dict(kv_cache_tokens=64, kv_cache_bytes=64), "not both"),
    (dict(kv_page_size=True), "kv_page_size"),
])
def test_kv_settings_are_checked_by_name(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RolloutConfig(**bad)
    engine_bad = {k: v for k, v in bad.items()}
    with pytest.raises(ValueError, match=match):
        initialize(model=build_model("tiny-gpt2"), config={"hybrid_engine": engine_bad})


def test_an_empty_request_reports_empty_page_stats(model):
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=NO_EOS))
    empty = RolloutRequest(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64))
    rollout.generate(empty, GREEDY)
    assert rollout.last_stats["kv_pages_peak"] == 0 and rollout.last_stats["preemptions"] == 0
