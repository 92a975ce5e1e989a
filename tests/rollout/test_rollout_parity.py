"""Graph vs eager: token-identical rollouts (greedy and sampled), continuous batching, EOS, left padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import (
    ARCHS,
    NO_EOS,
    assert_batches_identical,
    assert_same_samples,
    assert_same_tokens,
    left_padded_prompts,
    responses,
    run,
    shared_model,
)
from sampled_close import assert_rollouts_sampled_close

from hybrid_engine.graphs.keys import default_graph_buckets
from hybrid_engine.rollout import RolloutRequest, SamplingConfig

CASES = [
    # (mode, sampling)
    ("greedy-n1", SamplingConfig(max_new_tokens=10, temperature=0.0, n_samples_per_prompt=1, seed=0)),
    ("sampled-n4", SamplingConfig(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=40,
                                  n_samples_per_prompt=4, seed=7)),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode,sampling", CASES, ids=[c[0] for c in CASES])
def test_graph_matches_eager_with_eos_and_budgets(arch, mode, sampling):
    model = shared_model(arch)
    base = left_padded_prompts([5, 3, 7], seed=1)
    request = RolloutRequest(base.prompt_ids, base.prompt_attention_mask, max_new_tokens=[10, 4, 7])
    # Probe without EOS, then force EOS on a token the model emits: request 0 stops at its 3rd token.
    probe, _ = run(model, request, sampling, graphs=False, eos=NO_EOS, max_batch_size=3)
    eos = responses(probe)[0][2]
    eager, es = run(model, request, sampling, graphs=False, eos=eos, max_batch_size=3)
    graph, gs = run(model, request, sampling, graphs=True, eos=eos, max_batch_size=3)

    assert_batches_identical(eager, graph)
    # One capture per bucket the call may reach (rows that finish move down to smaller buckets), made up front.
    assert gs["graph_captures"] == len(default_graph_buckets(3)) and set(gs["bucket_steps"]) <= {1, 2, 4}
    assert gs["graph_replays"] == gs["decode_steps"] and gs["fallbacks"] == 0
    assert es["graph_captures"] == 0 and es["graph_replays"] == 0
    # Continuous batching really happened: more requests than slots.
    assert gs["peak_active_batch"] == 3 and graph.input_ids.shape[0] == 3 * sampling.n_samples_per_prompt
    # Stopping early never changes what came before the stop, whatever the batch composition.
    lengths = graph.response_lengths.tolist()
    assert lengths[0] <= 3 and len(set(lengths)) > 1
    for got, full in zip(responses(graph), responses(probe)):
        assert got == full[: len(got)]
        assert got[-1] == eos or len(got) == len(full)
    # Responses are right-padded: pad with mask 0 after the end.
    start = graph.response_start_idx
    for row, n in enumerate(lengths):
        assert graph.attention_mask[row, start : start + n].all()
        assert not graph.attention_mask[row, start + n :].any()
        assert (graph.input_ids[row, start + n :] == 0).all()
        assert (graph.response_logprobs[row, n:] == 0).all()
        assert torch.isfinite(graph.response_logprobs[row, :n]).all()


@pytest.mark.parametrize("continuous", [True, False])
def test_static_and_continuous_batching_agree(continuous):
    model = shared_model("tiny-llama")
    request = left_padded_prompts([4, 6, 2, 5, 3], seed=2)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, n_samples_per_prompt=2, seed=3)
    reference, _ = run(model, request, sampling, graphs=False, max_batch_size=4, continuous_batching=True)
    batch, stats = run(model, request, sampling, graphs=True, max_batch_size=4, continuous_batching=continuous)
    if continuous:  # graph replay of the eager run's own steps: the same numerics, the same tokens exactly
        assert_same_tokens(reference, batch)
    else:  # other batch compositions: logprobs may differ in the last float bits, so a flip float noise can make
        assert_same_samples(reference, batch, model=model, sampling=sampling)
    assert stats["peak_active_batch"] <= 4 and stats["graph_captures"] == len(default_graph_buckets(4))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(arch):
    model = shared_model(arch)
    request = left_padded_prompts([5, 3, 6], seed=4)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    probe, _ = run(model, request, sampling, graphs=False)
    eos = responses(probe)[1][3]
    batch, _ = run(model, request, sampling, graphs=True, eos=eos)
    for row, got in enumerate(responses(batch)):
        mask = request.prompt_attention_mask[row].bool()
        prompt = request.prompt_ids[row][mask][None]
        with torch.no_grad():
            ref = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8,
                eos_token_id=eos, pad_token_id=0,
            )[0, prompt.shape[1] :].tolist()
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        assert got == ref, f"row {row}"


def test_shared_prefill_matches_per_sample_prefill():
    model = shared_model("tiny-qwen2")
    request = left_padded_prompts([4, 7], seed=5)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=4, seed=11)
    shared, s_stats = run(model, request, sampling, graphs=True, use_shared_prefill=True)
    single, p_stats = run(model, request, sampling, graphs=True, use_shared_prefill=False)
    # One prefill of 2 rows or one of 8: other batch shapes, so the logprobs may differ in the last float bits (with
    # AVX2 kernels they do). The samples are compared as sampled_close compares numerically different paths, not by
    # asking both to round alike: equal tokens, or a flip between inverse-CDF neighbours that float noise can make.
    assert_rollouts_sampled_close(model, shared, single)
    assert s_stats["prefill_rows"] == 2 and p_stats["prefill_rows"] == 8
    assert s_stats["graph_captures"] == 1 and s_stats["bucket_steps"] == {8: s_stats["decode_steps"]}


def test_the_comparison_of_different_paths_accepts_only_a_flip_float_noise_can_make():
    """``assert_rollouts_sampled_close`` (tests/sampled_close.py), which the test above compares with: a sample that
    moved to its neighbour in the inverse CDF passes, and nothing after it is compared (the histories differ from
    there on); a token further away, or a logprob off by more than float noise, fails."""
    model = shared_model("tiny-qwen2")
    request = left_padded_prompts([4, 7], seed=5)
    batch, _ = run(model, request, SamplingConfig(max_new_tokens=6, temperature=1.0, seed=11), graphs=False)
    assert assert_rollouts_sampled_close(model, batch, batch) == [6, 6]
    row, i, start = 1, 2, batch.response_start_idx
    history = batch.input_ids[row, :start + i][batch.attention_mask[row, :start + i].bool()]
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=history[None]).logits[0, -1].float(), -1)
    order = torch.sort(full, descending=True, stable=True).indices.tolist()
    rank = order.index(int(batch.input_ids[row, start + i]))
    step = 1 if rank + 5 < len(order) else -1

    def moved(to_rank: int, logprob_noise: float = 0.0, at: int = i):
        ids, logprobs = batch.input_ids.clone(), batch.response_logprobs.clone()
        ids[row, start + at] = order[to_rank]
        logprobs[row, at] = full[order[to_rank]] + logprob_noise
        ids[row, start + at + 1:] = 7  # past the flip: not compared
        return dataclasses.replace(batch, input_ids=ids, response_logprobs=logprobs)

    assert assert_rollouts_sampled_close(model, batch, moved(rank + step)) == [6, 2]
    with pytest.raises(AssertionError, match="not neighbours in the inverse CDF"):
        assert_rollouts_sampled_close(model, batch, moved(rank + 5 * step))
    with pytest.raises(AssertionError, match="teacher-forced"):
        assert_rollouts_sampled_close(model, batch, moved(rank + step, logprob_noise=1e-2))
    noisy = batch.response_logprobs.clone()
    noisy[row, 1] += 1e-4
    with pytest.raises(AssertionError, match="position 1, token .* logprobs"):
        assert_rollouts_sampled_close(model, batch, dataclasses.replace(batch, response_logprobs=noisy))
