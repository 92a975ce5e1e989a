"""Graph vs eager: token-identical rollouts (greedy and sampled), continuous batching, EOS, left padding."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import (
    ARCHS,
    NO_EOS,
    assert_batches_identical,
    assert_same_samples,
    left_padded_prompts,
    responses,
    run,
    shared_model,
)

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
    # Tokens are identical; logprobs may differ in the last float bits (different batch compositions).
    assert_same_samples(reference, batch)
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
    assert_same_samples(shared, single)
    assert s_stats["prefill_rows"] == 2 and p_stats["prefill_rows"] == 8
    assert s_stats["graph_captures"] == 1 and s_stats["bucket_steps"] == {8: s_stats["decode_steps"]}
