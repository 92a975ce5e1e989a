"""Rollout logprobs equal a training-style full-sequence forward; the sampled distribution is right."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import ARCHS, left_padded_prompts, responses, run, shared_model

from hybrid_engine.decode.sampling import logprobs_of
from hybrid_engine.rollout import RolloutRequest, SamplingConfig

TOLERANCE = 1e-4


def training_logprobs(model, batch, sampling: SamplingConfig) -> torch.Tensor:
    """Logprobs of the response tokens from one forward over the returned sequences (as a trainer does)."""
    mask = batch.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids).logits
    start = batch.response_start_idx
    tokens = batch.input_ids[:, start:]
    lp = logprobs_of(
        logits[:, start - 1 : -1], tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
    )
    real = torch.arange(tokens.shape[1])[None] < batch.response_lengths[:, None]
    return torch.where(real, lp, torch.zeros_like(lp))


def max_logprob_diff(model, batch, sampling) -> float:
    return float((training_logprobs(model, batch, sampling) - batch.response_logprobs).abs().max())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=8, temperature=0.0),
        SamplingConfig(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=30, n_samples_per_prompt=2, seed=3),
    ],
    ids=["greedy", "sampled"],
)
def test_logprobs_match_training_forward(arch, sampling):
    model = shared_model(arch)
    request = left_padded_prompts([4, 7, 2], seed=6)
    probe, _ = run(model, request, sampling, graphs=False)
    eos = responses(probe)[0][3]  # mixed lengths
    batch, _ = run(model, request, sampling, graphs=True, eos=eos, max_batch_size=2)
    assert batch.response_lengths.min() < batch.response_lengths.max()
    assert max_logprob_diff(model, batch, sampling) <= TOLERANCE


def test_first_token_distribution_end_to_end():
    """Empirical frequencies of many samples match the filtered softmax of the prompt's logits."""
    model = shared_model("tiny-gpt2")
    prompt = torch.tensor([[5, 17, 42, 99]])
    sampling = SamplingConfig(max_new_tokens=1, temperature=1.5, top_k=6, n_samples_per_prompt=2000, seed=9)
    batch, stats = run(model, RolloutRequest(prompt), sampling, graphs=True)
    assert stats["prefill_forwards"] == 1  # one shared prefill for 2000 samples
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[0, -1]
    vocab = torch.arange(logits.shape[0])
    expected = logprobs_of(logits.expand(vocab.shape[0], -1), vocab, temperature=1.5, top_k=6).exp()
    counts = torch.bincount(batch.input_ids[:, -1], minlength=logits.shape[0]).double()
    observed = counts / counts.sum()
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(expected).flatten().tolist())
    # 2000 draws: each frequency within ~4.5 standard deviations.
    sd = (expected * (1 - expected) / 2000).sqrt()
    assert ((observed - expected.double()).abs() <= 4.5 * sd + 1e-9).all()
    torch.testing.assert_close(
        batch.response_logprobs[:, 0], expected.log()[batch.input_ids[:, -1]].float(), rtol=0, atol=1e-5
    )
