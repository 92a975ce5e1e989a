"""Issue 44: inputs that used to fail inside the engine (an allocator error, a ZeroDivisionError, a TypeError from a
tokenizer, a sampler's message without the call) or to slip past a check (the exact mode switched on after
construction) are refused where they enter, by name, and the next normal call gives what a fresh rollout or
engine gives.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers
from conftest import exact_mode_unavailable
from transformers import AutoConfig, AutoModelForCausalLM, cache_utils

from hybrid_engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model, build_tokenizer

NO_EOS = 10**6
#: State-layer models (Qwen3.5, Mamba2) need transformers' linear-attention cache API (5.x); before it they are
#: refused by name (tests/decode/test_model_families.py), so the cases below that build one do not apply.
needs_state_layers = pytest.mark.skipif(
    not hasattr(cache_utils, "LinearAttentionCacheLayerMixin"),
    reason=f"transformers {transformers.__version__} has no linear-attention cache API (state-layer models refused)")
SAMPLED = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=3, n_samples_per_prompt=2)


def prompts(batch: int = 2, width: int = 5, vocab: int = 384) -> RolloutRequest:
    ids = torch.randint(4, vocab, (batch, width), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return RolloutRequest(ids.masked_fill(mask == 0, 0), mask)


def tiny(model_type: str, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).eval()


SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
QWEN3_5 = dict(SMALL, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)
MAMBA2 = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              num_heads=4, head_dim=16, n_groups=1, state_size=8, conv_kernel=4, expand=2, chunk_size=16)


def same_batch(a, b) -> bool:
    return torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_logprobs, b.response_logprobs)


# ------------------------------------------------------------------------------------------- the exact mode
@needs_state_layers
def test_the_exact_mode_cannot_be_switched_on_after_construction():
    """Qwen3.5's linear-attention layers are refused at construction; setting the mode afterwards went past that
    check and decoded with kernels that are not exact."""
    model = tiny("qwen3_5_text", **QWEN3_5)
    config = RolloutConfig(pad_token_id=0, eos_token_id=NO_EOS)
    with pytest.raises(ValueError, match="qwen3_5_text's layers of kind 'linear_attention' have no batch-invariant"):
        HybridEngineRollout(model, config=dataclasses.replace(config, exact_logprobs=True))
    rollout = HybridEngineRollout(model, config=config)
    request = prompts(vocab=128)
    with pytest.raises(ValueError, match=r"HybridEngineRollout.exact_logprobs = True on a rollout built with "
                                         r"exact_logprobs=False: .* build a new rollout"):
        rollout.exact_logprobs = True
    with pytest.raises(ValueError, match=r"HybridEngineRollout.config = RolloutConfig\(exact_logprobs=True\) .* "
                                         r"HybridEngineRollout\(engine, config=RolloutConfig\(exact_logprobs=True\)\)"):
        rollout.config = dataclasses.replace(config, exact_logprobs=True)
    with pytest.raises(TypeError, match="exact_logprobs must be True or False"):
        rollout.exact_logprobs = 1
    with pytest.raises(TypeError, match="config must be a RolloutConfig"):
        rollout.config = {"exact_logprobs": True}
    assert rollout.exact_logprobs is False and rollout.config is config
    rollout.exact_logprobs = False  # the mode it has: nothing changes
    rollout.config = dataclasses.replace(config, exact_logprobs=False, max_batch_size=4)
    rollout.config = config  # None keeps the mode, as every other field may change between calls
    got = rollout.generate(request, SAMPLED)
    assert same_batch(got, HybridEngineRollout(model, config=config).generate(request, SAMPLED))


@needs_state_layers
def test_an_engine_whose_exact_mode_is_switched_on_later_refuses_linear_attention_at_the_next_call():
    model = tiny("qwen3_5_text", **QWEN3_5)
    engine, *_ = initialize(model=model, config={})
    ids = torch.randint(4, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    want = engine.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    engine.config.hybrid_engine.exact_logprobs = True  # no construction check runs for this
    try:
        with pytest.raises(ValueError, match="qwen3_5_text's layers of kind 'linear_attention'"):
            engine.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        with pytest.raises(ValueError, match="qwen3_5_text's layers of kind 'linear_attention'"):
            HybridEngineRollout(engine, config=RolloutConfig(pad_token_id=0))
    finally:
        engine.config.hybrid_engine.exact_logprobs = False
    assert torch.equal(engine.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)


# ------------------------------------------------------------------------------------------- pool sizes
def _exact_params():
    reason = exact_mode_unavailable()
    return [False, pytest.param(True, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))]


@pytest.mark.parametrize("exact", _exact_params(), ids=lambda e: "exact" if e else "default")
@pytest.mark.parametrize("knob,value", [("kv_cache_tokens", 2**45), ("kv_cache_bytes", 2**50)])
def test_a_pool_larger_than_the_machine_is_refused_before_anything_is_allocated(knob, value, exact):
    model = build_model("tiny-llama", seed=1)
    config = RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=NO_EOS, exact_logprobs=exact)
    rollout = HybridEngineRollout(model, config=config)
    request = prompts()
    first = rollout.generate(request, SAMPLED)
    held = rollout.graph_stats
    rollout.config = dataclasses.replace(config, **{knob: value})
    with pytest.raises(ValueError, match=rf"RolloutConfig.{knob}={value} asks for a pool of \d+ pages .* bytes "
                                         r".* on cpu, more than the \d+ bytes .* it has in all; lower "
                                         rf"RolloutConfig.{knob}"):
        rollout.generate(request, SAMPLED)
    rollout.config = config
    again = rollout.generate(request, SAMPLED)
    # The refusal came before the pool was rebuilt: the same pool, and the graphs captured before replay.
    assert rollout.last_stats["graph_captures"] == 0 and rollout.last_stats["graph_replays"] > 0
    assert rollout.graph_stats.cache_memory_bytes == held.cache_memory_bytes
    assert same_batch(again, first)
    assert same_batch(again, HybridEngineRollout(model, config=config).generate(request, SAMPLED))


def test_an_engine_pool_larger_than_the_machine_is_refused_by_name():
    config = {"hybrid_engine": {"enable_graph_capture": True, "kv_cache_tokens": 2**45}}
    engine, *_ = initialize(model=build_model("tiny-qwen2", seed=2), config=config)
    ids = torch.randint(4, 384, (2, 5), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"hybrid_engine.kv_cache_tokens=35184372088832 asks for a pool .* it has "
                                         "in all"):
        engine.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    engine.config.hybrid_engine.kv_cache_tokens = None
    fresh, *_ = initialize(model=build_model("tiny-qwen2", seed=2), config={"hybrid_engine": {
        "enable_graph_capture": True}})
    assert torch.equal(engine.generate(input_ids=ids, max_new_tokens=6, do_sample=False),
                       fresh.generate(input_ids=ids, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("family", [pytest.param("mamba2", marks=needs_state_layers), "mistral-rings"])
def test_a_byte_budget_on_a_model_without_kv_pages_is_refused_and_a_token_budget_works(family):
    """A pure Mamba2 keeps per-row states, and a model whose layers are all windowed keeps rings where its rows
    reach past twice the window: no K/V pages, so a byte budget divided by 0 bytes a page."""
    if family == "mamba2":
        model, vocab, width, new = tiny("mamba2", **MAMBA2), 128, 5, 8
    else:
        model, vocab, width, new = build_model("tiny-mistral", seed=1, sliding_window=4), 384, 5, 8
    config = RolloutConfig(pad_token_id=0, eos_token_id=NO_EOS)
    rollout = HybridEngineRollout(model, config=config)
    request = prompts(width=width, vocab=vocab)
    sampling = dataclasses.replace(SAMPLED, max_new_tokens=new)
    want = rollout.generate(request, sampling)
    rollout.config = dataclasses.replace(config, kv_cache_bytes=2**20)
    with pytest.raises(ValueError, match=r"RolloutConfig.kv_cache_bytes=1048576: the model keeps no K/V in pages "
                                         r"in this call .* leave RolloutConfig.kv_cache_bytes unset"):
        rollout.generate(request, sampling)
    rollout.config = dataclasses.replace(config, kv_cache_tokens=4, kv_page_size=4)
    with pytest.raises(ValueError, match="raise RolloutConfig.kv_cache_tokens to at least") as info:
        rollout.generate(request, sampling)
    assert "0 bytes" not in str(info.value) and "kv_cache_bytes" not in str(info.value)
    rollout.config = dataclasses.replace(config, kv_cache_tokens=256)
    assert same_batch(rollout.generate(request, sampling), want)
    rollout.config = config
    assert same_batch(rollout.generate(request, sampling), want)


# ------------------------------------------------------------------------------------------- stop strings
class IdsOnlyTokenizer:
    """A tokenizer whose ``decode`` takes the ids and nothing else (not a transformers tokenizer)."""

    def __init__(self) -> None:
        self._tok = build_tokenizer()

    def decode(self, ids):
        return self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_stop_strings_work_with_a_decode_that_takes_only_ids():
    model = build_model("tiny-llama", seed=1)
    config = RolloutConfig(pad_token_id=0, eos_token_id=NO_EOS)
    request = prompts()
    plain = HybridEngineRollout(model, build_tokenizer(), config).generate(request, SAMPLED)
    tok = build_tokenizer()
    word = tok.decode([int(plain.responses[0, 3])])  # row 0 has a stop string at its 4th token or earlier
    sampling = dataclasses.replace(SAMPLED, stop_strings=(word,))
    want = HybridEngineRollout(model, tok, config).generate(request, sampling)
    assert int(want.response_lengths.min()) <= 4 < sampling.max_new_tokens
    got = HybridEngineRollout(model, IdsOnlyTokenizer(), config).generate(request, sampling)
    assert same_batch(got, want)


def test_a_decode_that_cannot_take_ids_is_refused_by_name_before_any_work():
    class Broken:
        def decode(self, text: str) -> str:
            return text.upper()  # a list has no upper()

    model = build_model("tiny-llama", seed=1)
    config = RolloutConfig(pad_token_id=0, eos_token_id=NO_EOS)
    rollout = HybridEngineRollout(model, Broken(), config)
    request = prompts()
    with pytest.raises(TypeError, match=r"SamplingConfig.stop_strings .* Broken.decode\(\[\]\) raised "
                                        "AttributeError"):
        rollout.generate(request, dataclasses.replace(SAMPLED, stop_strings=("x",)))
    assert same_batch(rollout.generate(request, SAMPLED),
                      HybridEngineRollout(model, config=config).generate(request, SAMPLED))


# ------------------------------------------------------------------------------- engine.generate's sampling
@pytest.mark.parametrize("kwargs,exc,match", [
    ({"temperature": math.nan}, ValueError, r"engine.generate\(temperature=nan\): do_sample=True needs "
                                            r"temperature > 0"),
    ({"temperature": -1.0}, ValueError, r"engine.generate\(temperature=-1.0\): do_sample=True needs temperature > 0"),
    ({"temperature": 1e-7}, ValueError, r"engine.generate\(temperature=1e-07\): a sampling temperature must be 0 "
                                        r"\(greedy\) or at least 1e-05 .* do_sample=False"),
    ({"temperature": math.inf}, ValueError, r"engine.generate\(temperature=inf\): the temperature must be finite"),
    ({"temperature": "1"}, TypeError, r"engine.generate\(temperature='1'\): temperature must be a number"),
    ({"top_p": math.nan}, ValueError, r"engine.generate\(top_p=nan\): top_p must be a probability in \[0, 1\]"),
    ({"top_p": -0.1}, ValueError, r"engine.generate\(top_p=-0.1\): top_p must be a probability"),
    ({"top_k": -3}, ValueError, r"engine.generate\(top_k=-3\): top_k must be a whole number >= 0"),
    ({"top_k": 2.5}, ValueError, r"engine.generate\(top_k=2.5\): top_k must be a whole number >= 0"),
])
def test_engine_generate_refuses_sampling_arguments_by_the_calls_name(kwargs, exc, match):
    model = build_model("tiny-opt", seed=3)
    engine, *_ = initialize(model=model, config={})
    ids = torch.randint(4, 384, (2, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(exc, match=match):
        engine.generate(input_ids=ids, max_new_tokens=3, do_sample=True, **kwargs)
    fresh, *_ = initialize(model=build_model("tiny-opt", seed=3), config={})
    torch.manual_seed(5)
    got = engine.generate(input_ids=ids, max_new_tokens=3, do_sample=True)
    torch.manual_seed(5)
    assert torch.equal(got, fresh.generate(input_ids=ids, max_new_tokens=3, do_sample=True))


def test_a_bad_knob_from_the_generation_config_is_named_there():
    model = build_model("tiny-opt", seed=3)
    engine, *_ = initialize(model=model, config={})
    model.generation_config.top_p = 1.5
    ids = torch.randint(4, 384, (1, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"model.generation_config.top_p=1.5 \(engine.generate\(do_sample=True\) "
                                         r"samples with it when the call passes no top_p\): top_p must be"):
        engine.generate(input_ids=ids, max_new_tokens=3, do_sample=True)


def test_top_p_zero_keeps_only_the_most_likely_token_as_in_transformers():
    """transformers takes ``top_p=0`` (its top-p filter keeps at least one token): greedy, not an error."""
    model = build_model("tiny-opt", seed=3)
    engine, *_ = initialize(model=model, config={})
    ids = torch.randint(4, 384, (2, 4), generator=torch.Generator().manual_seed(0))
    greedy = engine.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(engine.generate(input_ids=ids, max_new_tokens=5, do_sample=True, top_p=0.0), greedy)
