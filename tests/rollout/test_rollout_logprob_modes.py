"""``SamplingConfig(logprobs="sampling" | "full")``: under top-k / top-p the default reports logprobs renormalised
over the kept tokens (the bias TRL tracks in #6789); "full" reports them under the full softmax at the
temperature, as a training forward computes them. Same tokens either way, one captured graph for both."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import left_padded_prompts

from hybrid_engine.decode.sampling import logprobs_of
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model


def forward_logits(model, batch) -> torch.Tensor:
    inputs = batch.training_inputs()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     position_ids=inputs["position_ids"]).logits[:, batch.response_start_idx - 1:-1].float()


@pytest.mark.parametrize("filters", [dict(top_k=5), dict(top_p=0.7), dict(top_k=8, top_p=0.8)])
def test_full_logprobs_are_the_training_forwards_and_the_tokens_do_not_change(filters):
    model = build_model("tiny-llama", seed=4)
    ids, mask = left_padded_prompts(3, 6, seed=2)
    request = RolloutRequest(ids, mask)
    sampled = SamplingConfig(max_new_tokens=8, temperature=0.8, seed=5, n_samples_per_prompt=2, **filters)
    full = dataclasses.replace(sampled, logprobs="full")
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10_000))
    a = rollout.generate(request, sampled)
    captures = rollout.graph_stats.captures
    b = rollout.generate(request, full)
    assert torch.equal(a.input_ids, b.input_ids)  # the same tokens
    assert rollout.graph_stats.captures == captures and rollout.graph_stats.replays > 0  # the same graphs
    logits = forward_logits(model, b)
    responses = b.responses
    want_full = torch.log_softmax(logits / 0.8, -1).gather(-1, responses[..., None])[..., 0]
    assert float((b.response_logprobs - want_full).abs().max()) < 1e-4
    assert float((b.response_logprobs - logprobs_of(logits, responses, temperature=0.8, logprobs="full",
                                                    **filters)).abs().max()) < 1e-4
    want_sampled = logprobs_of(logits, responses, temperature=0.8, **filters)
    assert float((a.response_logprobs - want_sampled).abs().max()) < 1e-4
    assert bool((a.response_logprobs >= b.response_logprobs - 1e-6).all())  # renormalised over fewer tokens
    assert float((a.response_logprobs - b.response_logprobs).max()) > 1e-3
    eager = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=False, pad_token_id=0,
                                                            eos_token_id=10_000)).generate(request, full)
    assert torch.equal(eager.input_ids, b.input_ids) and torch.equal(eager.response_logprobs, b.response_logprobs)


def test_without_filters_the_two_modes_agree_and_a_bad_mode_is_refused_by_name():
    model = build_model("tiny-gpt2", seed=1)
    ids, mask = left_padded_prompts(2, 5, seed=3)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10_000))
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, seed=2)
    a = rollout.generate(RolloutRequest(ids, mask), sampling)
    b = rollout.generate(RolloutRequest(ids, mask), dataclasses.replace(sampling, logprobs="full"))
    assert torch.equal(a.response_logprobs, b.response_logprobs)
    with pytest.raises(ValueError, match='SamplingConfig: logprobs must be "sampling" .* or "full"'):
        SamplingConfig(logprobs="raw")
    with pytest.raises(ValueError, match="logprobs must be one of"):
        logprobs_of(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), temperature=1.0, logprobs="raw")
