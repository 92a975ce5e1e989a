"""Bad input and unsupported setups: a clear error before any work, and the next valid call still works."""

from __future__ import annotations

import warnings

import pytest
import torch
from rollout_helpers import assert_batches_identical, left_padded_prompts, run
from transformers import GPT2Config, PreTrainedModel

import hybrid_engine.decode.slots as decode_state
from hybrid_engine.accelerator import CPUAccelerator, set_accelerator
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.rollout import (
    HybridEngineRollout,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
    UnsupportedModelError,
)
from hybrid_engine.tiny_models import build_model

SAMPLING = SamplingConfig(max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-gpt2", seed=1)


@pytest.fixture
def rollout(model):
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=2))


def _good_request():
    return left_padded_prompts([3, 5], seed=2)


def _check_still_works(rollout, baseline=None):
    batch = rollout.generate(_good_request(), SAMPLING)
    assert batch.input_ids.shape[0] == 2
    if baseline is not None:
        assert_batches_identical(batch, baseline)
    return batch


def test_bad_requests_raise_then_next_call_works(rollout):
    baseline = _check_still_works(rollout)
    ids = torch.randint(4, 100, (2, 5))
    bad = [
        (lambda: RolloutRequest(ids, torch.ones(2, 4, dtype=torch.int64)), ValueError, "does not match"),
        (lambda: RolloutRequest(ids, torch.tensor([[1] * 5, [0] * 5])), ValueError, "all zero"),
        (lambda: RolloutRequest(ids[0], torch.ones(5, dtype=torch.int64)), ValueError, "2-D"),
        (lambda: RolloutRequest(ids, torch.tensor([[1, 1, 0, 1, 1]] * 2)), ValueError, "left-padded"),
        (lambda: RolloutRequest(ids, torch.tensor([[0.5, 1, 1, 1, 1]] * 2)), ValueError, "only 0 and 1"),
        (lambda: RolloutRequest(ids, torch.tensor([[1, 1, 1, 1, 1.7]] * 2)), ValueError, "only 0 and 1"),
        (lambda: RolloutRequest(ids.float()), TypeError, "integer"),
        (lambda: SamplingConfig(max_new_tokens=0), ValueError, "max_new_tokens"),
        (lambda: SamplingConfig(max_new_tokens=-3), ValueError, "max_new_tokens"),
        (lambda: SamplingConfig(temperature=-0.5), ValueError, "temperature"),
        (lambda: SamplingConfig(top_p=0.0), ValueError, "top_p"),
        (lambda: SamplingConfig(top_p=1.5), ValueError, "top_p"),
        (lambda: SamplingConfig(n_samples_per_prompt=0), ValueError, "n_samples_per_prompt"),
        (lambda: SamplingConfig(top_k=-2), ValueError, "top_k"),
        (lambda: SamplingConfig(top_k=2**63), ValueError, "top_k must be in -1..2..63-1"),
        (lambda: SamplingConfig(temperature=1e-300), ValueError, "temperature must be 0 .greedy. or at least"),
        (lambda: RolloutRequest(ids, request_ids=[2**63, 1]), ValueError, "request_ids must be below 2..63"),
        (lambda: rollout.generate(RolloutRequest(ids, request_ids=[2**62, 7]),
                                  SamplingConfig(max_new_tokens=3, temperature=1.0, n_samples_per_prompt=4)),
         ValueError, "request_ids up to .* n_samples_per_prompt=4 overflow"),
        (lambda: RolloutConfig(max_batch_size=0), ValueError, "max_batch_size"),
        (lambda: RolloutConfig(graph_batch_sizes=[1, 2], max_batch_size=4), ValueError, "graph_batch_sizes"),
        (lambda: rollout.generate(ids, SAMPLING), TypeError, "RolloutRequest"),
        (lambda: rollout.generate(RolloutRequest(ids + 1000), SAMPLING), ValueError, "vocab_size"),
        (lambda: RolloutConfig(pad_token_id=2**70), ValueError, "pad_token_id must be <= 9223372036854775807"),
        (lambda: RolloutConfig(eos_token_id=[2, 2**64]), ValueError, "eos_token_id must be <= 9223372036854775807"),
        (lambda: rollout.generate(RolloutRequest(ids), SamplingConfig(max_new_tokens=4, n_samples_per_prompt=2**40)),
         ValueError, "n_samples_per_prompt=1099511627776 rows .* lower n_samples_per_prompt"),
    ]
    for make, exc, text in bad:
        with pytest.raises(exc, match=text):
            make()
        _check_still_works(rollout, baseline)
    # Captured once, by the first call (one graph per bucket it may reach), never again after the errors.
    assert rollout.total_graph_captures == len(rollout.graph_stats.buckets) == rollout.graph_stats.captures


def _mutated(field, value):
    request = _good_request()
    setattr(request, field, value)
    return request


@pytest.mark.parametrize("field,value,exc,text", [
    ("max_new_tokens", [0, 3], ValueError, "max_new_tokens must be"),
    ("max_new_tokens", [2], ValueError, "max_new_tokens must be a list of 2 ints"),
    ("request_ids", [4, 4], ValueError, "request_ids must be distinct"),
    ("prompt_attention_mask", torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), ValueError, "left-padded"),
    ("prompt_ids", torch.ones(2, 5), TypeError, "integer token ids"),
])
def test_a_request_changed_after_construction_is_checked_again(rollout, field, value, exc, text):
    baseline = _check_still_works(rollout)
    with pytest.raises(exc, match=text):
        rollout.generate(_mutated(field, value), SAMPLING)
    _check_still_works(rollout, baseline)


def test_a_negative_pad_id_in_the_model_config_is_not_used():
    """Old Llama configs carry pad_token_id=-1: responses are padded with the first EOS instead, so the
    batch can be fed back to the model."""
    model = build_model("tiny-llama", seed=1)
    model.config.pad_token_id, model.generation_config.pad_token_id = -1, None
    good = _good_request()
    request = RolloutRequest(good.prompt_ids, good.prompt_attention_mask, max_new_tokens=[1, 4])
    batch = HybridEngineRollout(model, config=RolloutConfig(eos_token_id=2)).generate(request, SAMPLING)
    assert int(batch.input_ids.min()) >= 0 and batch.responses[0, 1:].tolist() == [2, 2, 2]
    model(batch.input_ids, attention_mask=batch.attention_mask)


@pytest.mark.parametrize("eos,exc,text", [(2**64, ValueError, "does not fit in int64"),
                                           ("abc", TypeError, "must hold integer token ids, got str"),
                                           (2.7, TypeError, "must hold integer token ids, got float")])
def test_an_eos_id_from_the_tokenizer_that_is_no_token_id_is_refused_by_name(model, eos, exc, text):
    """Before: an int64 overflow naming nothing, a bare int() error, or 2.7 silently taken as EOS 2."""

    class Tokenizer:
        pad_token_id = 0
        eos_token_id = eos

    bad = HybridEngineRollout(model, tokenizer=Tokenizer(), config=RolloutConfig(use_graph_capture=True))
    with pytest.raises(exc, match=f"HybridEngineRollout: eos_token_id.*{text}"):
        bad.generate(_good_request(), SAMPLING)
    Tokenizer.eos_token_id = 2
    assert_batches_identical(bad.generate(_good_request(), SAMPLING), _check_still_works(
        HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=2))))


def test_cache_capacity_and_position_limit(model):
    request = _good_request()
    small = HybridEngineRollout(model, config=RolloutConfig(cache_capacity=6, pad_token_id=0, eos_token_id=2))
    with pytest.raises(ValueError, match="cache_capacity"):
        small.generate(request, SAMPLING)  # 5 + 4 > 6
    ok = HybridEngineRollout(model, config=RolloutConfig(cache_capacity=9, pad_token_id=0, eos_token_id=2))
    assert ok.generate(request, SAMPLING).input_ids.shape == (2, 9)
    assert ok.last_stats["cache_capacity"] == 9

    limit = model.config.n_positions
    long_prompt = RolloutRequest(torch.randint(4, 100, (1, limit + 1)))
    with pytest.raises(ValueError, match="position limit"):
        ok.generate(long_prompt, SAMPLING)
    with pytest.raises(ValueError, match="position limit"):
        ok.generate(RolloutRequest(torch.randint(4, 100, (1, limit - 2))), SAMPLING)
    _check_still_works(ok)


@pytest.mark.parametrize("config,text", [
    (dict(cache_capacity=10**12), r"cache_capacity must be <= 16777216, got 1000000000000 \(2\*\*24\)"),
    (dict(graph_batch_sizes=(10**9,)), r"graph_batch_sizes must be <= 65536, got 1000000000 \(2\*\*16\)"),
    (dict(graph_batch_sizes=(1, 2, 65537)), r"graph_batch_sizes must be <= 65536"),
    (dict(max_batch_size=10**9), r"max_batch_size must be <= 65536"),
])
def test_capacities_past_sane_bounds_are_refused_on_construction(config, text):
    """Each was an allocator RuntimeError at the first generate (2 PB of KV cache for cache_capacity=10**12, a
    10**9-row bucket for graph_batch_sizes=(10**9,))."""
    with pytest.raises(ValueError, match=text):
        RolloutConfig(**config)
    RolloutConfig(cache_capacity=2**24, graph_batch_sizes=(1, 2**16), max_batch_size=2**16)  # the bounds themselves


def test_a_cache_capacity_past_the_models_position_limit_is_refused_before_anything_is_allocated(model):
    limit = model.config.n_positions
    big = HybridEngineRollout(model, config=RolloutConfig(cache_capacity=limit + 1, pad_token_id=0, eos_token_id=2))
    with pytest.raises(ValueError, match=rf"cache_capacity={limit + 1} is more than the model's position limit "
                                         rf"{limit}.*cache_capacity={limit} or less"):
        big.generate(_good_request(), SAMPLING)
    assert big.runner.slots is None  # nothing was allocated
    at_limit = HybridEngineRollout(model, config=RolloutConfig(cache_capacity=limit, pad_token_id=0, eos_token_id=2))
    baseline = _check_still_works(at_limit)
    assert at_limit.last_stats["cache_capacity"] == limit
    # A prompt padded past the limit still fits a cache of `limit` slots: prompts are staged within it.
    wide = RolloutRequest(torch.cat([torch.zeros(2, limit, dtype=torch.int64), _good_request().prompt_ids], 1),
                          torch.cat([torch.zeros(2, limit, dtype=torch.int64), _good_request().prompt_attention_mask], 1))
    batch = at_limit.generate(wide, SAMPLING)
    assert torch.equal(batch.responses, baseline.responses) and at_limit.last_stats["cache_capacity"] == limit


def test_missing_pad_and_eos_is_an_error_before_work():
    model = build_model("tiny-opt", seed=0, pad_token_id=None, eos_token_id=None, bos_token_id=None)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    rollout = HybridEngineRollout(model)
    with pytest.raises(ValueError, match="pad nor an EOS"):
        rollout.generate(_good_request(), SAMPLING)
    assert rollout.last_stats == {}
    # EOS only: pad defaults to it. A tokenizer supplies both.
    rollout = HybridEngineRollout(model, config=RolloutConfig(eos_token_id=[2, 5]))
    assert rollout.generate(_good_request(), SAMPLING).input_ids.shape[0] == 2
    from hybrid_engine.tiny_models import build_tokenizer

    rollout = HybridEngineRollout(model, tokenizer=build_tokenizer())
    assert rollout.generate(_good_request(), SAMPLING).input_ids.shape[0] == 2


def test_flash_attention_is_refused():
    model = build_model("tiny-llama", seed=0)
    model.config._attn_implementation = "flash_attention_2"
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True))
    with pytest.raises(ValueError, match="flash_attention_2"):
        rollout.generate(_good_request(), SAMPLING)


class _NoCacheLM(PreTrainedModel):
    config_class = GPT2Config

    def __init__(self, config):
        super().__init__(config)
        self.emb = torch.nn.Embedding(config.vocab_size, 8)
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        return self.emb(input_ids)


def test_model_without_external_cache_is_refused():
    model = _NoCacheLM(GPT2Config(vocab_size=384, n_positions=64, pad_token_id=0, eos_token_id=2, bos_token_id=1))
    rollout = HybridEngineRollout(model)
    with pytest.raises(ValueError, match="cache"):
        rollout.generate(_good_request(), SAMPLING)
    with pytest.raises(UnsupportedModelError):
        rollout.generate(_good_request(), SAMPLING)
    with pytest.raises(TypeError, match="HybridEngine"):
        HybridEngineRollout(object())


def test_no_graph_backend_warns_and_runs_eagerly(model):
    eager = run(model, _good_request(), SAMPLING, graphs=False, eos=2)[0]
    set_accelerator(CPUAccelerator(emulate_graphs=False))
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=2))
    with pytest.warns(GraphRefusedWarning, match="cannot capture"):
        batch = rollout.generate(_good_request(), SAMPLING)
    assert_batches_identical(batch, eager)
    assert rollout.last_stats["fallbacks"] == 1 and rollout.last_stats["graph_captures"] == 0


def test_capture_failure_falls_back_to_eager(model, monkeypatch):
    eager = run(model, _good_request(), SAMPLING, graphs=False, eos=2)[0]
    real = decode_state.decode_one_token

    def syncing_decode(m, cache, tokens, live=None, span=None, **kw):
        int(cache.write_pos.max())  # a host read: forbidden while capturing
        return real(m, cache, tokens, live, span, **kw)

    monkeypatch.setattr(decode_state, "decode_one_token", syncing_decode)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=2))
    with pytest.warns(GraphRefusedWarning, match="capture failed"):
        batch = rollout.generate(_good_request(), SAMPLING)
    assert_batches_identical(batch, eager)
    assert rollout.last_stats["fallbacks"] == 1 and rollout.last_stats["graph_captures"] == 0
    monkeypatch.setattr(decode_state, "decode_one_token", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_batches_identical(rollout.generate(_good_request(), SAMPLING), eager)
    assert rollout.last_stats["graph_captures"] == len(rollout.graph_stats.buckets) >= 1


def test_a_request_without_prompts_returns_an_empty_batch(rollout):
    """An empty data-parallel shard still makes the call (under ZeRO-3 it must); it gets no rows back."""
    batch = rollout.generate(RolloutRequest(torch.zeros(0, 5, dtype=torch.int64)), SAMPLING)
    assert batch.input_ids.shape == (0, 5) and batch.response_start_idx == 5
    assert batch.responses.shape == (0, 0) and batch.response_logprobs.shape == (0, 0)
    assert batch.response_lengths.numel() == 0 and rollout.last_stats["num_sequences"] == 0
    ids = torch.randint(4, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    assert rollout.generate(RolloutRequest(ids), SAMPLING).input_ids.shape[0] == 2
