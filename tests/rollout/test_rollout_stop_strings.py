"""Stop strings (issue 31): a response ends at the token whose decoded text completes a string, also one split
across tokens; the tokens before it, and their logprobs, are what the run without stop strings gave."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import NO_EOS, left_padded_prompts, responses

from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, SamplingConfig
from hybrid_engine.tiny_models import build_model, build_tokenizer


def _rollout(model, tokenizer, graphs: bool) -> HybridEngineRollout:
    return HybridEngineRollout(model, tokenizer, RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                               eos_token_id=NO_EOS, sync_interval=3))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_response_ends_at_the_token_that_completes_a_stop_string_split_across_tokens(graphs):
    model, tokenizer = build_model("tiny-llama", seed=1), build_tokenizer()
    request = left_padded_prompts([5, 3, 7, 4], seed=2)
    plain = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=5)
    full = _rollout(model, tokenizer, graphs).generate(request, plain)
    rows = responses(full)
    # A string made of the end of row 0's token 6 and the start of its token 7: it spans the boundary.
    words = [tokenizer.decode([t]) for t in rows[0]]
    text = tokenizer.decode(rows[0][:8])
    stop = words[6][-2:] + " " + words[7][:2]
    assert stop in text and stop not in tokenizer.decode(rows[0][:7])
    batch = _rollout(model, tokenizer, graphs).generate(request, SamplingConfig(
        max_new_tokens=24, temperature=1.0, seed=5, stop_strings=[stop]))
    for i, (got, want) in enumerate(zip(responses(batch), rows)):
        cut = next((n for n in range(1, len(want) + 1) if stop in tokenizer.decode(want[:n])), len(want))
        assert got == want[:cut], i
        assert torch.equal(batch.response_logprobs[i, :cut], full.response_logprobs[i, :cut])
        assert bool((batch.response_logprobs[i, cut:] == 0).all())
    assert batch.response_lengths[0] == 8


def test_a_stop_string_is_looked_for_only_past_min_tokens_and_an_absent_one_changes_nothing():
    model, tokenizer = build_model("tiny-gpt2", seed=3), build_tokenizer()
    request = left_padded_prompts([4, 6], seed=4)
    full = _rollout(model, tokenizer, False).generate(request, SamplingConfig(max_new_tokens=16, temperature=1.0))
    absent = _rollout(model, tokenizer, False).generate(request, SamplingConfig(
        max_new_tokens=16, temperature=1.0, stop_strings=["\u2603 never"]))
    assert responses(absent) == responses(full)
    first = tokenizer.decode([responses(full)[0][0]])
    early = _rollout(model, tokenizer, False).generate(request, SamplingConfig(
        max_new_tokens=16, temperature=1.0, stop_strings=[first]))
    assert len(responses(early)[0]) == 1  # the string is the first token's text


def test_stop_strings_need_a_tokenizer_and_are_checked_by_name():
    model = build_model("tiny-gpt2")
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=NO_EOS))
    with pytest.raises(ValueError, match="stop_strings are matched on decoded text.*tokenizer"):
        rollout.generate(left_padded_prompts([3]), SamplingConfig(max_new_tokens=4, stop_strings=["a"]))
    assert len(responses(rollout.generate(left_padded_prompts([3]), SamplingConfig(max_new_tokens=4)))[0]) == 4
    with pytest.raises(TypeError, match="stop_strings must be a list of strings"):
        SamplingConfig(stop_strings="</tool>")
    with pytest.raises(ValueError, match="stop_strings must hold at most 16 strings of 1 to 256"):
        SamplingConfig(stop_strings=[""])
