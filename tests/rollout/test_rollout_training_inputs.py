"""``RolloutBatch.training_inputs()``: the training forward over a rollout gives the rollout's logprobs, for
absolute-position models on left-padded rows too (issue 28: without position ids GPT-2's were 0.02-0.5 nats off)."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts

from hybrid_engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model


def forward_logprobs(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token logprobs of ``input_ids[:, 1:]`` under the training forward (full softmax, temperature 1)."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_the_training_forward_on_training_inputs_gives_the_rollouts_logprobs(arch):
    model = build_model(f"tiny-{arch}", seed=2)
    ids, mask = left_padded_prompts(4, 7, seed=5)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10_000))
    batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3,
                                                                       n_samples_per_prompt=2))
    inputs = batch.training_inputs()
    response = batch.response_mask
    assert torch.equal(response.sum(-1), batch.response_lengths)
    assert torch.equal(inputs["labels"][response], batch.input_ids[response])
    assert bool((inputs["labels"][~response] == -100).all())
    got = forward_logprobs(model, inputs)[response[:, 1:]]
    want = batch.response_logprobs[batch.response_logprobs != 0]
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-4
    if arch == "gpt2":  # absolute positions: counting positions from the padded start is what goes wrong
        no_positions = {k: v for k, v in inputs.items() if k != "position_ids"}
        drift = (forward_logprobs(model, no_positions)[response[:, 1:]] - want).abs().max()
        assert float(drift) > 1e-3


def test_the_engine_trains_on_training_inputs_over_the_responses_only():
    model = build_model("tiny-gpt2", seed=2)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    ids, mask = left_padded_prompts(2, 5, seed=6)
    batch = HybridEngineRollout(engine, config=RolloutConfig(pad_token_id=0, eos_token_id=10_000)).generate(
        RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4, temperature=1.0))
    with torch.no_grad():
        loss = engine(**batch.training_inputs()).loss  # eval mode: no dropout
    want = -forward_logprobs(model, batch.training_inputs())[batch.response_mask[:, 1:]].mean()
    assert float((loss - want).abs()) < 1e-5  # the mean NLL of the response tokens, nothing else
    engine.train()
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(**batch.training_inputs()).loss)
    engine.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
