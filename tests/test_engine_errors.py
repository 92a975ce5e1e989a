"""Bad generate() input gets a clear error, and the engine keeps working afterwards."""

import pytest
import torch

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
    ({"max_new_tokens": 3, "min_new_tokens": 5}, ValueError, "min_new_tokens"),
    ({"max_new_tokens": 61, "min_new_tokens": 61}, ValueError, "max_out_tokens=64"),
    ({"input_ids": None}, ValueError, "input_ids is required"),
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
    with pytest.raises(ValueError, match="exceeds the model's 16 positions"):
        engine.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3)
    out = engine.generate(input_ids=ids, max_new_tokens=2, min_new_tokens=2)
    assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=2, min_new_tokens=2, do_sample=False))


def test_bad_sampling_params():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={})
    ids = torch.randint(4, 384, (1, 3))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(input_ids=ids, max_new_tokens=2, do_sample=True, top_p=1.5)
    assert engine.generate(input_ids=ids, max_new_tokens=2).shape == (1, 5)


def test_two_prompts_given_and_extra_positional():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={})
    ids = torch.randint(4, 384, (1, 3))
    with pytest.raises(ValueError, match="pass the prompt once"):
        engine.generate(ids, input_ids=ids, max_new_tokens=2)
    with pytest.raises(TypeError, match="at most one positional"):
        engine.generate(ids, ids, max_new_tokens=2)
