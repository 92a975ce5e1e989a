"""Episodes keep their K/V between turns (issue 31): a turn prefills only the tokens after the pages its row kept.

Every test compares with what the same turn gives without reuse (a single-turn rollout on the concatenated
history, or a row whose pages were evicted or dropped). K/V kept from decode steps and K/V prefilled again are
computed in other batch shapes, so their logprobs may differ in the last float bits; outside the exact mode the
tokens are compared as ``sampled_close`` compares numerically different paths (equal tokens with logprobs equal
to 1e-5, or a flip between inverse-CDF neighbours, the only one such noise can make), not by asking both paths
to round alike on every CPU (issue 38). The exact mode's continued turn is compared bit for bit.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import exact_mode_unavailable
from rollout_helpers import NO_EOS, left_padded_prompts
from sampled_close import assert_sampled_close

from hybrid_engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

TOOL = [[40, 41, 42], [50, 51], [60]]  # environment tokens after each turn (row r: TOOL[r % 3])
PROMPT_LENGTHS = [5, 3, 6]
ROWS = 6  # 3 prompts x 2 samples


def _rollout(model, graphs: bool = True, **config) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=NO_EOS, **config))


def _sampling(turn: int, max_new: int = 5) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new, temperature=1.0, seed=11 + turn)


def _run(rollout, turns: int = 3, between=None, max_new=(5, 5, 5)):
    """Three turns on every row, the tool tokens appended after each; ``between(t)`` runs after turn ``t``.
    Returns (closed batch, the last_stats of each turn)."""
    episodes = rollout.open_episodes(left_padded_prompts(PROMPT_LENGTHS, seed=7), n_samples_per_prompt=2)
    stats = []
    for t in range(turns):
        episodes.turn(_sampling(t, max_new[t]))
        stats.append(dict(rollout.last_stats))
        for r in range(ROWS):
            episodes.append(r, TOOL[r % 3])
        if between is not None:
            between(t)
    return episodes.close(), stats


def _single_turn_rows(rollout, batch, turn: int, max_new=(5, 5, 5)):
    """Each row's ``turn`` again, as a single-turn rollout on its concatenated history (same request ids)."""
    out = []
    n_new = max_new[turn]
    for r in range(ROWS):
        n = int(batch.completion_mask[r].sum())
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
        after = batch.completion_ids[r, :n].tolist()
        start = sum(max_new[k] + len(TOOL[r % 3]) for k in range(turn))
        history = prompt + after[:start]
        single = rollout.generate(RolloutRequest(torch.tensor([history]), request_ids=[turn * ROWS + r]),
                                  _sampling(turn, n_new))
        out.append((after[start:start + n_new], batch.completion_logprobs[r, start:start + n_new],
                    single.responses[0].tolist(), single.response_logprobs[0], history))
    return out


def _assert_turn_as_single_turn(rollout, batch, turn: int, max_new=(5, 5, 5)) -> None:
    rows = _single_turn_rows(rollout, batch, turn, max_new)
    for r, (tokens, logprobs, single_tokens, single_logprobs, history) in enumerate(rows):
        assert_sampled_close(rollout.model, history, tokens, logprobs, single_tokens, single_logprobs,
                             name=f"turn {turn}, row {r}")


def _assert_same_completions(model, batch, reference) -> None:
    """Every row's whole completion (turns and tool tokens) against ``reference``'s, as sampled_close compares."""
    assert torch.equal(batch.prompt_ids, reference.prompt_ids)
    for r in range(ROWS):
        n = int(reference.completion_mask[r].sum())
        assert int(batch.completion_mask[r].sum()) == n
        assert_sampled_close(model, batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist(),
                             batch.completion_ids[r, :n].tolist(), batch.completion_logprobs[r, :n].tolist(),
                             reference.completion_ids[r, :n].tolist(), reference.completion_logprobs[r, :n].tolist(),
                             name=f"row {r}")


def test_later_turns_prefill_only_the_new_tokens_and_sample_what_a_full_prefill_does():
    model = build_model("tiny-llama", seed=2)
    rollout = _rollout(model)
    batch, stats = _run(rollout)
    # Turn 0: the three prompts, once each (two samples share each). Later turns: the model's last token and
    # the tool tokens of every row; everything before them is reused.
    assert stats[0]["prefill_tokens"] == sum(PROMPT_LENGTHS) and stats[0]["kv_reused_tokens"] == 0
    new = sum(1 + len(TOOL[r % 3]) for r in range(ROWS))
    for t in (1, 2):
        assert stats[t]["prefill_tokens"] == new
        held = sum(PROMPT_LENGTHS[r // 2] + t * 5 - 1 + (t - 1) * len(TOOL[r % 3]) for r in range(ROWS))
        assert stats[t]["kv_reused_tokens"] == held
        assert stats[t]["graph_replays"] > 0 and stats[t]["fallbacks"] == 0
    for turn in (1, 2):
        _assert_turn_as_single_turn(rollout, batch, turn)
    # Closing gives every page back.
    assert rollout.runner.ledger.held_rows == 0 and rollout.runner.ledger.in_use == 0


def test_graph_and_eager_turns_on_kept_pages_are_identical():
    model = build_model("tiny-qwen2", seed=1)
    eager, _ = _run(_rollout(model, graphs=False))
    graph, stats = _run(_rollout(model, graphs=True))
    assert stats[2]["kv_reused_tokens"] > 0
    assert torch.equal(eager.completion_ids, graph.completion_ids)
    assert torch.equal(eager.completion_logprobs, graph.completion_logprobs)


@pytest.mark.skipif(exact_mode_unavailable() is not None, reason=str(exact_mode_unavailable()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_the_exact_mode_a_continued_turn_equals_the_single_turn_rollout_bit_for_bit(dtype):
    model = build_model("tiny-llama", seed=3).to(dtype)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"exact_logprobs": True}})
    rollout = _rollout(engine)
    batch, stats = _run(rollout)
    assert stats[2]["kv_reused_tokens"] > 0
    for tokens, logprobs, single_tokens, single_logprobs, _ in _single_turn_rows(rollout, batch, 2):
        assert tokens == single_tokens and torch.equal(logprobs, single_logprobs)


def _reference(seed: int = 4):
    model = build_model("tiny-mistral", seed=seed)
    return model, _run(_rollout(model))[0]


@pytest.mark.slow
def test_rows_evicted_by_a_short_pool_are_prefilled_whole_with_the_same_tokens():
    model, ample = _reference()
    # 20 pages of 4 tokens: the six rows' kept pages (about 6 each by the last turn) cannot all stay.
    short = _rollout(model, kv_page_size=4, kv_cache_tokens=80, max_batch_size=2)
    batch, stats = _run(short)
    assert any(s["kv_reused_tokens"] for s in stats[1:])  # some reused...
    evicted = [s["prefill_tokens"] > sum(1 + len(TOOL[r % 3]) for r in range(ROWS)) for s in stats[1:]]
    assert any(evicted)  # ...and some prefilled whole
    _assert_same_completions(model, batch, ample)


def test_a_weight_update_between_turns_drops_the_kept_pages():
    model, _ = _reference()
    rollout = _rollout(model)

    def update(turn):
        if turn == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.01)  # what an optimizer step does: in place

    batch, stats = _run(rollout, between=update)
    assert stats[1]["kv_reused_tokens"] == 0  # K/V of the old weights: prefilled whole
    assert stats[2]["kv_reused_tokens"] > 0
    _assert_turn_as_single_turn(rollout, batch, 1)


@pytest.mark.slow
def test_a_released_rollout_and_a_pool_that_grows_between_turns():
    model, ample = _reference()
    rollout = _rollout(model)
    batch, stats = _run(rollout, between=lambda t: rollout.release() if t == 0 else None)
    assert stats[1]["kv_reused_tokens"] == 0 and stats[2]["kv_reused_tokens"] > 0
    _assert_same_completions(model, batch, ample)
    # A longer third turn grows the slots' capacity and the pool: the kept pages move into the new pool.
    grown = _rollout(model)
    pages_before = []
    batch, stats = _run(grown, max_new=(5, 5, 40),
                        between=lambda t: pages_before.append(grown.runner.kv_pool.num_pages))
    assert grown.runner.kv_pool.num_pages > pages_before[1]
    assert stats[2]["kv_reused_tokens"] > 0
    _assert_turn_as_single_turn(grown, batch, 2, (5, 5, 40))


def test_episodes_dropped_unclosed_give_their_pages_back():
    model = build_model("tiny-gpt2", seed=5)
    rollout = _rollout(model)
    episodes = rollout.open_episodes(left_padded_prompts(PROMPT_LENGTHS, seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    ledger = rollout.runner.ledger
    assert ledger.held_rows == ROWS and ledger.in_use > 0
    episodes.close([0, 1])
    assert ledger.held_rows == ROWS - 2
    del episodes
    gc.collect()
    assert ledger.held_rows == 0 and ledger.in_use == 0


def test_a_sliding_window_model_continues_on_kept_pages_past_its_window():
    # Histories reach ~30 tokens, past the window; rows of under twice the window keep pages, not rings.
    model = build_model("tiny-mistral", seed=6, sliding_window=20)
    rollout = _rollout(model)
    batch, stats = _run(rollout)
    assert stats[2]["kv_reused_tokens"] > 0
    _assert_turn_as_single_turn(rollout, batch, 2)


def test_windowed_rings_are_not_kept_between_turns_and_turns_prefill_whole_histories():
    model = build_model("tiny-mistral", seed=6, sliding_window=4)  # rows past twice the window: rings
    rollout = _rollout(model)
    batch, stats = _run(rollout)
    assert any(s.ring for s in rollout.runner.kv_pool.layers)
    assert all(s["kv_reused_tokens"] == 0 for s in stats)
    _assert_turn_as_single_turn(rollout, batch, 2)


def test_drop_kv_makes_the_next_turn_prefill_whole():
    model = build_model("tiny-gpt2", seed=5)
    rollout = _rollout(model)
    episodes = rollout.open_episodes(left_padded_prompts(PROMPT_LENGTHS, seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    episodes.drop_kv()
    assert rollout.runner.ledger.held_rows == 0
    episodes.turn(_sampling(1))
    assert rollout.last_stats["kv_reused_tokens"] == 0
    assert rollout.last_stats["prefill_tokens"] == sum(len(episodes.history(r)) - 5 for r in range(ROWS))
    episodes.close()
