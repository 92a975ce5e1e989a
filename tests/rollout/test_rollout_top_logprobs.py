"""``SamplingConfig(top_logprobs=k)``: the k most likely ids at each response position and their logprobs, under
the distribution the response's logprobs are under, captured with the step (for on-policy distillation)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import left_padded_prompts
from rollout_helpers import left_padded_prompts as prompts_of_lengths

from hybrid_engine.decode.sampling import logprobs_of
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model


def forward_logits(model, batch) -> torch.Tensor:
    inputs = batch.training_inputs()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     position_ids=inputs["position_ids"]).logits[:, batch.response_start_idx - 1:-1].float()


def rollout(model, graphs: bool = True, **cfg) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=10_000, **cfg))


@pytest.mark.parametrize("mode", ["sampling", "full"])
@pytest.mark.parametrize("knobs", [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_k=6)],
                         ids=["greedy", "sampled", "top-k"])
def test_the_top_ids_and_logprobs_are_the_training_forwards_and_graphs_equal_eager(mode, knobs):
    model = build_model("tiny-llama", seed=5)
    ids, mask = left_padded_prompts(3, 6, seed=4)
    request = RolloutRequest(ids, mask)
    sampling = SamplingConfig(max_new_tokens=7, seed=3, n_samples_per_prompt=2, top_logprobs=4, logprobs=mode,
                              **knobs)
    batch = rollout(model).generate(request, sampling)
    top_ids, top_lp = batch.top_logprob_ids, batch.top_logprobs
    assert top_ids.shape == (6, 7, 4) and top_lp.shape == (6, 7, 4)
    logits = forward_logits(model, batch)
    t = knobs["temperature"] or 1.0
    ranked_lp, ranked_ids = torch.sort(torch.log_softmax(logits / t, -1), dim=-1, descending=True, stable=True)
    assert torch.equal(top_ids, ranked_ids[..., :4])
    if mode == "full" or knobs == dict(temperature=0.0) or "top_k" not in knobs:
        want = ranked_lp[..., :4]
    else:
        want = logprobs_of(logits[..., None, :].expand(-1, -1, 4, -1), top_ids, **knobs)
    assert float((top_lp - want).abs().max()) < 1e-4
    # the sampled token's logprob is its entry in the list whenever it made the list
    hit = top_ids == batch.responses[..., None]
    assert torch.allclose(top_lp[hit], batch.response_logprobs[hit.any(-1)], atol=1e-6)
    if knobs["temperature"] == 0:
        assert bool(hit[..., 0].all())  # greedy takes the first
    eager = rollout(model, graphs=False).generate(request, sampling)
    assert torch.equal(eager.top_logprob_ids, top_ids) and torch.equal(eager.top_logprobs, top_lp)


def test_preempted_rows_keep_their_top_logprobs_and_padding_is_marked():
    model = build_model("tiny-llama", seed=6)
    request = prompts_of_lengths([7, 4, 6, 5], seed=3)
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=2, n_samples_per_prompt=2, top_logprobs=3)
    free = rollout(model, max_batch_size=8).generate(request, sampling)
    tight_rollout = rollout(model, max_batch_size=8, kv_cache_tokens=160, kv_page_size=16)
    tight = tight_rollout.generate(request, sampling)
    assert tight_rollout.last_stats["preemptions"] > 0
    assert torch.equal(tight.top_logprob_ids, free.top_logprob_ids)
    # a resumed row re-prefills its history, so its later logprobs may differ in the last bits, as its own do
    assert torch.allclose(tight.top_logprobs, free.top_logprobs, atol=1e-5, rtol=0)
    stopped = rollout(model).generate(request, dataclasses.replace(
        sampling, max_new_tokens=6, stop_token_ids=[[int(free.responses[0, 1])]]))
    pad = ~stopped.response_mask[:, stopped.response_start_idx:]
    assert bool(pad.any()) and bool((stopped.top_logprob_ids[pad] == -1).all())
    assert bool((stopped.top_logprobs[pad] == 0).all())


def test_none_unless_asked_and_bad_counts_refused_by_name():
    model = build_model("tiny-gpt2", seed=1)
    ids, mask = left_padded_prompts(2, 5, seed=2)
    r = rollout(model)
    plain = r.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=3))
    assert plain.top_logprob_ids is None and plain.top_logprobs is None
    with pytest.raises(ValueError, match="SamplingConfig: top_logprobs must be <= 64"):
        SamplingConfig(top_logprobs=65)
    with pytest.raises(TypeError, match="SamplingConfig: top_logprobs must be an int"):
        SamplingConfig(top_logprobs=2.0)
    with pytest.raises(ValueError, match="top_logprobs=64 is more than the model's vocab_size"):
        HybridEngineRollout(build_model("tiny-gpt2", seed=1, vocab_size=32), config=RolloutConfig(
            pad_token_id=0, eos_token_id=10_000)).generate(
                RolloutRequest(ids % 32, mask), SamplingConfig(max_new_tokens=2, top_logprobs=64))
    assert r.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=3, top_logprobs=2)) \
        .top_logprob_ids.shape == (2, 3, 2)
