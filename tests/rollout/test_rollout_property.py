"""Property: where a request runs does not change what it samples.

Over prompt count x samples per prompt x slots x per-prompt budgets x continuous or static batching x
shared prefill x greedy or sampled, a rollout through a few slots (many admission rounds, prompts
prefilled ahead in batches, rounds that straddle two batches) returns the tokens of one wide call that
admits every request at once (compared as ``sampled_close`` compares numerically different paths: equal,
or a flip float noise can make), with lengths equal to the budgets, and prefills every prompt once. Eager
runs only (the graph runner replays these same steps; graph against eager is checked in
test_rollout_parity and test_graph_runner), bounded to stay fast (``MAX_EXAMPLES`` derandomized examples
on one cached tiny model).
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_helpers import assert_same_samples, left_padded_prompts, run, shared_model

from hybrid_engine.rollout import RolloutRequest, SamplingConfig

MAX_EXAMPLES = 40


@st.composite
def cases(draw):
    prompts = draw(st.integers(1, 6))
    lengths = [draw(st.integers(1, 7)) for _ in range(prompts)]
    budgets = [draw(st.integers(1, 6)) for _ in range(prompts)]
    samples = draw(st.integers(1, 5))
    slots = draw(st.integers(1, 5))
    continuous = draw(st.booleans())
    shared = draw(st.booleans())
    sampled = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return lengths, budgets, samples, slots, continuous, shared, sampled, seed


@pytest.mark.slow
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_request_samples_the_same_tokens_whatever_slot_round_and_prefill_batch_it_runs_in(case):
    lengths, budgets, samples, slots, continuous, shared, sampled, seed = case
    model = shared_model("tiny-qwen2")
    prompts = left_padded_prompts(lengths, seed=seed)
    request = RolloutRequest(prompts.prompt_ids, prompts.prompt_attention_mask, max_new_tokens=budgets)
    sampling = SamplingConfig(max_new_tokens=6, n_samples_per_prompt=samples, seed=seed,
                              temperature=0.9 if sampled else 0.0, top_p=0.9 if sampled else 1.0)
    total = len(lengths) * samples
    wide, _ = run(model, request, sampling, graphs=False, max_batch_size=total)
    got, stats = run(model, request, sampling, graphs=False, max_batch_size=slots, continuous_batching=continuous,
                     use_shared_prefill=shared)
    # Other batch compositions: logprobs may differ in the last float bits, so the tokens are compared as
    # numerically different paths are (equal, or a flip float noise can make, teacher-forced), budgets included.
    assert_same_samples(got, wide, model=model, sampling=sampling)
    assert got.response_lengths.tolist() == [b for b in budgets for _ in range(samples)]
    assert stats["admission_rounds"] >= -(-total // slots)
    assert stats["prefill_rows"] == (len(lengths) if shared else total)  # each prompt (or copy) prefilled once
