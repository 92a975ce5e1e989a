"""Multi-turn episodes (issue 31): model turns and environment tokens on the same rows, closed with an env_mask."""

from __future__ import annotations

import pytest
import torch
from conftest import exact_mode_unavailable
from rollout_helpers import NO_EOS, left_padded_prompts
from sampled_close import assert_sampled_close

from hybrid_engine import initialize, logprobs_of
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

TOOL = [[40, 41, 42], [50, 51], [60]]  # environment tokens appended after each turn (per row: TOOL[row % 3])


def _episode_run(rollout, turns: int = 3, rows_per_turn=None):
    episodes = rollout.open_episodes(left_padded_prompts([5, 3, 6], seed=7), n_samples_per_prompt=2)
    reasons = []
    for t in range(turns):
        rows = None if rows_per_turn is None else rows_per_turn[t]
        reasons.append(episodes.turn(SamplingConfig(max_new_tokens=5, temperature=1.0, seed=11 + t), rows))
        for r in (range(episodes.num_rows) if rows is None else rows):
            episodes.append(r, TOOL[r % 3])
    return episodes, reasons


def _rollout(model, graphs: bool, **config) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=NO_EOS, **config))


def test_graph_and_eager_episodes_are_token_identical_and_env_tokens_are_masked():
    model = build_model("tiny-qwen2", seed=1)
    eager, reasons = _episode_run(_rollout(model, False))
    graph_rollout = _rollout(model, True)
    graph, _ = _episode_run(graph_rollout)
    assert graph_rollout.graph_stats.replays > 0 and graph_rollout.graph_stats.fallbacks == 0
    a, b = eager.close(), graph.close()
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.env_mask, b.env_mask)
    assert torch.equal(a.completion_logprobs, b.completion_logprobs)
    assert reasons == [["length"] * 6] * 3
    for i in range(6):  # turn, tool, turn, tool, turn, tool
        tool = TOOL[i % 3]
        pattern = ([1] * 5 + [0] * len(tool)) * 3
        assert a.env_mask[i, :len(pattern)].tolist() == pattern
        assert a.completion_mask[i].sum() == len(pattern)
        env = (a.env_mask[i] == 0) & (a.completion_mask[i] == 1)
        assert bool((a.completion_logprobs[i][env] == 0).all())
        assert a.completion_ids[i][env].tolist() == tool * 3
    assert a.turns == [3] * 6


def test_a_continued_episode_samples_what_a_single_turn_rollout_on_its_history_does():
    model = build_model("tiny-llama", seed=2)
    rollout = _rollout(model, True)
    episodes, _ = _episode_run(rollout, turns=2)
    # Row 3's third turn, and the same request (id turn * rows + row) on its concatenated history.
    history = episodes.history(3)
    episodes.turn(SamplingConfig(max_new_tokens=6, temperature=1.0, seed=99), rows=[3])
    single = rollout.generate(RolloutRequest(torch.tensor([history]), request_ids=[2 * 6 + 3]),
                              SamplingConfig(max_new_tokens=6, temperature=1.0, seed=99))
    closed = episodes.close([3])
    n = int(closed.completion_mask[0].sum())
    # The turn continued on the K/V its earlier turns' decode steps wrote; the single turn prefilled them, in
    # other batch shapes: logprobs that may differ in the last float bits. So the turns are compared as
    # sampled_close compares numerically different paths (equal tokens with logprobs to 1e-5, or a flip float
    # noise can make, teacher-forced on the history), not by asking both to round alike (issue 38).
    assert_sampled_close(model, history, closed.completion_ids[0, n - 6:n].tolist(),
                         closed.completion_logprobs[0, n - 6:n].tolist(), single.responses[0].tolist(),
                         single.response_logprobs[0].tolist())


@pytest.mark.skipif(exact_mode_unavailable() is not None, reason=str(exact_mode_unavailable()))
def test_model_tokens_logprobs_are_the_training_forwards_and_env_tokens_get_no_loss():
    model = build_model("tiny-llama", seed=3)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"exact_logprobs": True}})
    episodes, _ = _episode_run(_rollout(engine, True))
    batch = episodes.close()
    inputs = batch.training_inputs()
    start = batch.prompt_ids.shape[1]
    model_tokens = batch.env_mask.bool()
    assert torch.equal(inputs["labels"][:, start:][model_tokens], batch.completion_ids[model_tokens])
    assert bool((inputs["labels"][:, :start] == -100).all()) and bool((inputs["labels"][:, start:][~model_tokens]
                                                                       == -100).all())
    with torch.no_grad():
        logits = engine(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    lp = logprobs_of(logits[:, start - 1:-1], batch.completion_ids, temperature=1.0)
    assert torch.equal(lp[model_tokens], batch.completion_logprobs[model_tokens])  # exact mode: bit for bit


def test_episodes_close_at_different_turns_and_rows_wait_untouched():
    model = build_model("tiny-gpt2", seed=4)
    rollout = _rollout(model, False)
    episodes, _ = _episode_run(rollout, turns=2, rows_per_turn=[None, [0, 2, 4]])
    early = episodes.close([1, 3, 5])  # rows 1, 3, 5 sat out turn 2 (a slow tool) and end now
    assert early.turns == [1, 1, 1]
    assert episodes.turn(SamplingConfig(max_new_tokens=3, temperature=1.0), None) == ["length"] * 3
    late = episodes.close()
    assert late.rows == [0, 2, 4] and late.turns == [3, 3, 3]
    with pytest.raises(ValueError, match="row 1 is closed"):
        episodes.append(1, [5])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        rollout.open_episodes(left_padded_prompts([2])).append(0, [10_000])
    with pytest.raises(ValueError, match="n_samples_per_prompt must be 1"):
        rollout.open_episodes(left_padded_prompts([2])).turn(SamplingConfig(n_samples_per_prompt=2))


def test_a_turn_that_ends_on_a_stop_sequence_says_so():
    model = build_model("tiny-gpt2", seed=5)
    rollout = _rollout(model, False)
    episodes = rollout.open_episodes(left_padded_prompts([4, 4], seed=1))
    probe = rollout.open_episodes(left_padded_prompts([4, 4], seed=1))
    probe.turn(SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3))
    second = probe.close().completion_ids[0, 1].item()  # row 0's second token: a stop sequence there
    reasons = episodes.turn(SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3, stop_token_ids=[[second]]))
    assert reasons[0] == "stop"


def test_each_row_may_get_its_own_budget_for_a_turn():
    model = build_model("tiny-gpt2", seed=6)
    rollout = _rollout(model, True)
    full = rollout.open_episodes(left_padded_prompts([4, 6, 3], seed=2))
    full.turn(SamplingConfig(max_new_tokens=6, temperature=1.0, seed=8))
    cut = rollout.open_episodes(left_padded_prompts([4, 6, 3], seed=2))
    reasons = cut.turn(SamplingConfig(max_new_tokens=6, temperature=1.0, seed=8), rows=[2, 0, 1],
                       max_new_tokens=[2, 6, 4])
    assert reasons == ["length"] * 3
    for row, budget in ((0, 6), (1, 4), (2, 2)):  # the same samples, each cut at its own budget
        assert cut.last_turn(row) == full.last_turn(row)[:budget]
    with pytest.raises(ValueError, match=r"max_new_tokens must lie in 1..sampling.max_new_tokens \(6\)"):
        cut.turn(SamplingConfig(max_new_tokens=6), rows=[0], max_new_tokens=[7])
    with pytest.raises(TypeError, match="one per row"):
        cut.turn(SamplingConfig(max_new_tokens=6), rows=[0, 1], max_new_tokens=[3])
