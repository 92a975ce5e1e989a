"""Per-prompt temperature, top-p and top-k (``RolloutRequest(temperature=[...], top_p=[...], top_k=[...])``): one
call mixing them replays one graph of the filters any of them needs, and each prompt samples what it samples in
a call of its own (issue 31, part 3)."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import left_padded_prompts
from sampled_close import assert_sampled_close

from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

#: (temperature, top_p, top_k) per prompt: greedy, greedy, top-k, top-p, top-k and top-p, plain sampling
SETTINGS = [(0.0, 1.0, -1), (0.0, 1.0, -1), (0.8, 1.0, 5), (1.0, 0.9, -1), (0.7, 0.8, 12), (1.2, 1.0, -1)]


def rollout(model, graphs: bool) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=10_000, max_batch_size=8))


def one_prompt(request: RolloutRequest, i: int) -> RolloutRequest:
    return RolloutRequest(request.prompt_ids[i:i + 1], request.prompt_attention_mask[i:i + 1], request_ids=[i])


def assert_prompt_samples_alike(model, mixed, alone, i: int, temperature: float, top_p: float = 1.0,
                                top_k: int = -1) -> None:
    """Prompt ``i``'s rows of ``mixed`` against ``alone`` (a call of its own): other batch shapes, so logprobs
    that may differ in the last float bits; compared as ``sampled_close`` compares numerically different paths
    (equal tokens with logprobs to 1e-5, or at a row's first difference a flip float noise can make under the
    prompt's own filtered distribution, teacher-forced; greedy: a tie for the argmax), not by asking both to
    round alike (issue 38)."""
    n, start = alone.responses.shape[0], alone.response_start_idx
    for j in range(n):
        row = n * i + j
        prompt = alone.input_ids[j, :start][alone.attention_mask[j, :start].bool()].tolist()
        k, m = int(mixed.response_lengths[row]), int(alone.response_lengths[j])
        assert_sampled_close(model, prompt, mixed.responses[row, :k].tolist(),
                             mixed.response_logprobs[row, :k].tolist(), alone.responses[j, :m].tolist(),
                             alone.response_logprobs[j, :m].tolist(),
                             temperature=temperature, top_p=top_p, top_k=top_k, name=f"prompt {i}, sample {j}")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_mixed_call_gives_each_prompt_what_a_call_of_its_own_gives(graphs):
    model = build_model("tiny-llama", seed=2)
    base = left_padded_prompts([5, 7, 4, 6, 5, 7], seed=8)
    t, p, k = (list(x) for x in zip(*SETTINGS))
    request = RolloutRequest(base.prompt_ids, base.prompt_attention_mask, request_ids=list(range(6)),
                             temperature=t, top_p=p, top_k=k)
    sampling = SamplingConfig(max_new_tokens=10, seed=4, n_samples_per_prompt=2)
    r = rollout(model, graphs)
    mixed = r.generate(request, sampling)
    if graphs:
        assert r.last_stats["graph_replays"] > 0 and r.last_stats["fallbacks"] == 0
    for i, (temperature, top_p, top_k) in enumerate(SETTINGS):
        alone = rollout(model, graphs=False).generate(one_prompt(base, i), SamplingConfig(
            max_new_tokens=10, seed=4, n_samples_per_prompt=2, temperature=temperature, top_p=top_p, top_k=top_k))
        assert_prompt_samples_alike(model, mixed, alone, i, temperature, top_p, top_k)
    if graphs:  # graph replay of the eager run's own steps: the same numerics, the same tokens exactly
        assert torch.equal(mixed.input_ids, rollout(model, graphs=False).generate(request, sampling).input_ids)


def test_bad_per_prompt_values_are_refused_by_name():
    model = build_model("tiny-gpt2", seed=1)
    base = left_padded_prompts([3, 4], seed=1)
    with pytest.raises(ValueError, match="RolloutRequest: temperature must be a list of 2 values"):
        RolloutRequest(base.prompt_ids, base.prompt_attention_mask, temperature=[1.0])
    bad = RolloutRequest(base.prompt_ids, base.prompt_attention_mask, top_p=[0.0, None])
    with pytest.raises(ValueError, match="RolloutRequest: prompt 0's sampling: .*top_p"):
        rollout(model, graphs=True).generate(bad, SamplingConfig(max_new_tokens=2, temperature=1.0))
    ok = RolloutRequest(base.prompt_ids, base.prompt_attention_mask, temperature=[None, 0.0])
    assert rollout(model, graphs=True).generate(ok, SamplingConfig(max_new_tokens=2)).responses.shape == (2, 2)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_prompt_with_its_own_seed_samples_what_a_call_with_that_seed_samples(graphs):
    model = build_model("tiny-llama", seed=2)
    base = left_padded_prompts([5, 7, 4], seed=8)
    seeds = [11, None, 12]
    request = RolloutRequest(base.prompt_ids, base.prompt_attention_mask, request_ids=[0, 1, 2], seed=seeds)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=4, n_samples_per_prompt=2)
    mixed = rollout(model, graphs).generate(request, sampling)
    for i, seed in enumerate(seeds):
        alone = rollout(model, graphs=False).generate(
            one_prompt(base, i), SamplingConfig(max_new_tokens=8, temperature=1.0, n_samples_per_prompt=2,
                                                seed=4 if seed is None else seed))
        assert_prompt_samples_alike(model, mixed, alone, i, temperature=1.0)
    other = rollout(model, graphs).generate(RolloutRequest(base.prompt_ids, base.prompt_attention_mask,
                                                           request_ids=[0, 1, 2], seed=[13, None, 12]), sampling)
    assert not torch.equal(other.responses[:2], mixed.responses[:2])  # its seed decides its tokens
    # The same call but for prompt 0's seed: the same batch shapes (no EOS), so the same numerics for the other
    # rows (a row's logits do not depend on the other rows' tokens), and their very tokens.
    assert torch.equal(other.responses[2:], mixed.responses[2:])
    with pytest.raises(TypeError, match="RolloutRequest: seed must be an int"):
        RolloutRequest(base.prompt_ids, base.prompt_attention_mask, seed=[1.5, None, None])
