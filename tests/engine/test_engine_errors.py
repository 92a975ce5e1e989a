"""Bad generate() input gets a clear error, and the engine keeps working afterwards."""

import pytest
import torch
from transformers import GenerationConfig

from hybrid_engine.engine import initialize
from hybrid_engine.tiny_models import build_model


@pytest.fixture(scope="module")
def setup():
    model = build_model("tiny-gpt2", seed=1)
    engine, *_ = initialize(
        model=model, config={"hybrid_engine": {"enable_graph_capture": True, "max_out_tokens": 64}}
    )
    ids = torch.randint(4, 384, (2, 4))
    mask = torch.ones_like(ids)
    good = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3)
    ref = engine.generate(**good)
    return engine, good, ref


CASES = [
    ({"input_ids": torch.rand(2, 4)}, TypeError, "input_ids must hold integer token ids"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.bool)}, TypeError, "input_ids must hold integer"),
    ({"input_ids": [[5, 6]]}, TypeError, "input_ids must be a torch.Tensor"),
    ({"input_ids": torch.ones(4, dtype=torch.long)}, ValueError, "must be 2-D"),
    ({"input_ids": torch.ones(0, 4, dtype=torch.long), "attention_mask": None}, ValueError, "empty batch"),
    ({"input_ids": torch.ones(2, 0, dtype=torch.long), "attention_mask": None}, ValueError, "prompt length 0"),
    ({"input_ids": torch.full((2, 4), 999)}, ValueError, "outside the vocabulary"),
    ({"attention_mask": torch.ones(2, 5, dtype=torch.long)}, ValueError, "attention_mask shape"),
    ({"attention_mask": torch.ones(3, 4, dtype=torch.long)}, ValueError, "attention_mask shape"),
    ({"max_new_tokens": 0, "min_new_tokens": 0}, ValueError, "max_new_tokens must be > 0"),
    ({"max_new_tokens": -2, "min_new_tokens": None}, ValueError, "max_new_tokens must be > 0"),
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int"),
    ({"max_new_tokens": 3, "min_new_tokens": -1}, ValueError, "min_new_tokens must be >= 0"),
    ({"max_new_tokens": 61, "min_new_tokens": 61}, ValueError, "max_out_tokens=64"),
    ({"input_ids": None}, ValueError, "input_ids is required"),
    # Other mask values became out-of-range positions (an IndexError on CPU, a device-side assert on a GPU).
    ({"attention_mask": torch.tensor([[1, 1, 1, 30]] * 2)}, ValueError, "attention_mask must hold only 0"),
    ({"attention_mask": torch.tensor([[-10, 1, 1, 1]] * 2)}, ValueError, "attention_mask must hold only 0"),
    ({"attention_mask": torch.tensor([[0.5, 1, 1, 1]] * 2)}, ValueError, "attention_mask must hold only 0"),
    ({"generation_config": "greedy"}, TypeError, "generation_config .* must be a transformers GenerationConfig"),
    ({"generation_config": {"max_new_tokens": 3}}, TypeError, "must be a transformers GenerationConfig, got dict"),
    ({"eos_token_id": 2**70}, ValueError, "eos_token_id: token id .* does not fit in int64"),
    ({"eos_token_id": [2, "abc"]}, TypeError, "eos_token_id must hold integer token ids, got str"),
    ({"eos_token_id": 2.7}, TypeError, "eos_token_id must hold integer token ids, got float"),
    ({"pad_token_id": 2**70}, ValueError, "pad_token_id: token id .* does not fit in int64"),
    # Counts transformers divides by or allocates with, checked before a call is delegated to it (num_beams=0
    # was a ZeroDivisionError inside transformers, -1 a negative dimension, 10**9 an allocator error, and
    # num_return_sequences=0 silently one sequence per prompt).
    ({"num_beams": 0}, ValueError, r"num_beams must be >= 1, got 0"),
    ({"num_beams": -1}, ValueError, r"num_beams must be >= 1, got -1"),
    ({"num_beams": True}, TypeError, r"num_beams must be an int >= 1, got True"),
    ({"num_beams": 2.5}, TypeError, r"num_beams must be an int, got float"),
    ({"num_return_sequences": 0}, ValueError, r"num_return_sequences must be >= 1, got 0"),
    ({"num_beams": 2, "num_return_sequences": -1}, ValueError, r"num_return_sequences must be >= 1"),
    ({"num_beams": 2, "num_beam_groups": 0}, ValueError, r"num_beam_groups must be >= 1, got 0"),
    ({"num_beams": 2, "num_beam_groups": 3}, ValueError, r"num_beam_groups \(3\) must not exceed num_beams \(2\)"),
    ({"generation_config": GenerationConfig(num_beams=0, max_new_tokens=3)}, ValueError, r"num_beams must be >= 1"),
    ({"num_beams": 10**9}, ValueError, r"num_beams 1000000000 .* more than 2147483648 tokens in one call"),
    ({"num_return_sequences": 10**9, "do_sample": True}, ValueError, r"num_return_sequences 1000000000 .* tokens"),
    ({"num_beams": 2, "max_new_tokens": 10**12}, ValueError, r"needs 1000000000003 positions, more than the model's 512"),
    ({"num_beams": 2, "min_new_tokens": -1}, ValueError, r"min_new_tokens must be >= 0, got -1"),
]


@pytest.mark.parametrize("change,exc,match", CASES)
def test_bad_input_is_a_clear_error_and_engine_still_works(setup, change, exc, match):
    engine, good, ref = setup
    with pytest.raises(exc, match=match):
        engine.generate(**{**good, **change})
    assert torch.equal(engine.generate(**good), ref)


def test_prompt_longer_than_model_positions():
    model = build_model("tiny-opt", seed=2, max_position_embeddings=16)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    ids = torch.randint(4, 384, (1, 14))
    with pytest.raises(ValueError, match="needs 17 positions, more than the model's 16"):
        engine.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4)
    # The last new token is never fed back: 14 + 3 tokens use positions 0..15, as in transformers.
    out = engine.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3)
    assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False))
    # Padding takes no position: a 14-wide batch whose prompts hold 5 and 3 real tokens has room for 12 more.
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :9], mask[1, :11] = 0, 0
    ids = torch.randint(4, 384, (2, 14)).masked_fill(mask == 0, model.config.pad_token_id)
    out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12)
    assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                                           min_new_tokens=12, do_sample=False))
    assert engine.graph_stats.replays > 0


def test_bad_sampling_params():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={})
    ids = torch.randint(4, 384, (1, 3))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(input_ids=ids, max_new_tokens=2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or at least"):  # logits / T overflows
        engine.generate(input_ids=ids, max_new_tokens=2, do_sample=True, temperature=1e-300)
    assert engine.generate(input_ids=ids, max_new_tokens=2).shape == (1, 5)


def test_two_prompts_given_and_extra_positional():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={})
    ids = torch.randint(4, 384, (1, 3))
    with pytest.raises(ValueError, match="pass the prompt once"):
        engine.generate(ids, input_ids=ids, max_new_tokens=2)
    with pytest.raises(TypeError, match="the second positional argument.* must be a transformers GenerationConfig"):
        engine.generate(ids, ids, max_new_tokens=2)
    with pytest.raises(TypeError, match="at most two positional"):
        engine.generate(ids, None, ids, max_new_tokens=2)
    with pytest.raises(TypeError, match="both as a positional and a keyword"):
        engine.generate(ids, None, generation_config=None, max_new_tokens=2)


def _graph_engine(name="tiny-llama", seed=0):
    model = build_model(name, seed=seed)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    return engine, build_model(name, seed=seed)


def _prompts(rows=3, width=6, seed=0):
    ids = torch.randint(4, 384, (rows, width), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def test_a_call_under_inference_mode_leaves_engine_and_rollout_usable_outside_it():
    # The first call allocates the decode buffers and captures; under inference_mode those would be inference
    # tensors, which no later call outside it could write in place.
    from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig

    engine, _ = _graph_engine()
    ids, mask = _prompts()
    with torch.inference_mode():
        first = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    again = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(first, again) and engine.graph_stats.replays > 0
    rollout = HybridEngineRollout(build_model("tiny-llama"), config=RolloutConfig(use_graph_capture=True))
    request, sampling = RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=5, temperature=1.0, seed=3)
    with torch.inference_mode():
        first = rollout.generate(request, sampling)
    again = rollout.generate(request, sampling)
    assert torch.equal(first.input_ids, again.input_ids) and rollout.last_stats["graph_replays"] > 0
    with torch.inference_mode():  # and back inside it
        assert torch.equal(rollout.generate(request, sampling).input_ids, first.input_ids)


@pytest.mark.parametrize("pad", [-1, 400])
def test_a_pad_id_outside_the_vocabulary_is_output_but_never_fed_to_the_model(pad):
    # Old Llama configs carry pad_token_id=-1; idle and finished rows are fed a token the embedding has.
    engine, reference = _graph_engine()
    ids, mask = _prompts()
    expected = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                  pad_token_id=pad)
    out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    assert torch.equal(out, expected)
    # With a reachable EOS, rows that stop early are padded with the pad id itself, as transformers does.
    first = int(expected[0, ids.shape[1]])
    out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=pad,
                          eos_token_id=first)
    assert out.shape[1] == ids.shape[1] + 4 and int(out[0, -1]) == pad
    if pad < 0:
        return  # RolloutConfig takes pad ids >= 0 only
    from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig

    rollout = HybridEngineRollout(build_model("tiny-llama"), config=RolloutConfig(
        use_graph_capture=True, pad_token_id=pad, eos_token_id=first))
    batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4))
    assert int(batch.responses[0, 0]) == first and int(batch.response_lengths[0]) == 1
    assert (batch.responses[0, 1:] == pad).all()


def test_negative_eos_ids_never_match_as_in_transformers():
    # A negative id used as an index would alias token vocab - k and suppress it under min_new_tokens.
    engine, reference = _graph_engine()
    ids, mask = _prompts(rows=1)
    first = int(reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                   pad_token_id=0)[0, -1])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=3, do_sample=False,
                  pad_token_id=0, eos_token_id=first - 384)
    assert torch.equal(engine.generate(**kwargs), reference.generate(**kwargs))


@pytest.mark.parametrize("width", [8, 24])
def test_without_a_length_twenty_new_tokens_are_generated_as_in_transformers(width):
    engine, reference = _graph_engine()
    ids, mask = _prompts(rows=2, width=width, seed=width)
    expected = reference.generate(input_ids=ids, attention_mask=mask, do_sample=False)
    out = engine.generate(input_ids=ids, attention_mask=mask)
    assert out.shape == (2, width + 20) and torch.equal(out, expected)
    # A max_length of the model's own generation config is a total length, as there.
    engine.module.generation_config.max_length = reference.generation_config.max_length = width + 5
    assert torch.equal(engine.generate(input_ids=ids, attention_mask=mask),
                       reference.generate(input_ids=ids, attention_mask=mask, do_sample=False))


def test_engine_module_cannot_be_replaced():
    # The optimizer, the training backend and the decode graphs hold the model the engine was built with.
    old, new = build_model("tiny-llama", seed=1), build_model("tiny-qwen2", seed=1)
    engine, *_ = initialize(model=old, config={"hybrid_engine": {"enable_graph_capture": True}})
    with pytest.raises(AttributeError, match="hybrid_engine.initialize"):
        engine.module = new
    assert engine.module is old
    ids = torch.randint(4, 384, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(engine.generate(input_ids=ids, max_new_tokens=4), old.generate(input_ids=ids, max_new_tokens=4))


def test_max_out_tokens_past_the_position_limit_is_refused_before_the_cache_is_allocated():
    """max_out_tokens is every decode cache row's length, allocated at the first generate: 10**7 was a 10 GB
    allocation for a 4-token call, never checked against the model's 512 positions (10**30 an OverflowError)."""
    model = build_model("tiny-gpt2", seed=1)
    with pytest.raises(ValueError, match=r"hybrid_engine.max_out_tokens must be at most 16777216"):
        initialize(model=model, config={"hybrid_engine": {"max_out_tokens": 10**30}})
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"max_out_tokens": 10**7}})
    ids = torch.randint(4, 384, (2, 4))
    with pytest.raises(ValueError, match=r"max_out_tokens=10000000 is more than the model's position limit 512.*"
                                         r"at most 512"):
        engine.generate(ids, max_new_tokens=4)
    assert engine.generate_runner.slots is None  # refused before anything was allocated
    for cap in (512, 513):  # the limit itself, and one past it
        engine, *_ = initialize(model=model, config={"hybrid_engine": {"max_out_tokens": cap}})
        if cap > 512:
            with pytest.raises(ValueError, match="at most 512"):
                engine.generate(ids, max_new_tokens=4)
        else:
            assert engine.generate(ids, max_new_tokens=4).shape == (2, 8)


def test_the_default_max_out_tokens_stays_accepted_for_a_model_with_fewer_positions():
    model = build_model("tiny-gpt2", seed=1, n_positions=64)
    engine, *_ = initialize(model=model, config={})  # max_out_tokens 512 (DeepSpeed's default), 64 positions
    ids = torch.randint(4, 384, (2, 4))
    assert engine.generate(ids, max_new_tokens=4).shape == (2, 8)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"max_out_tokens": 513}})
    with pytest.raises(ValueError, match=r"max_out_tokens=513 is more than the model's position limit 64.*at most 512"):
        engine.generate(ids, max_new_tokens=4)
