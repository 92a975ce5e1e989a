"""Admission under a tight K/V budget always makes progress (issue 44).

A configured budget that the front end accepts holds one request: its staged prompt and its row
(:func:`~hybrid_engine.decode.kv_pool.pool_pages`). The stage used to prefill as many distinct prompts as the
pool had pages for; the first sample of a prompt then needed a fresh page for its own copy of the prompt's
partial last page, none was free and nothing ran, so the scheduler dropped the stage, staged the same prompts
again, and spun at 100% CPU forever. Now the stage leaves the pages its prompts' first samples need.

Every call runs in a daemon thread joined with a timeout, so a regression fails here instead of hanging CI.
Every tight run must give what an ample pool gives for the same requests and seeds. The two runs batch rows
differently, so their logprobs may differ in the last float bits: sampled runs are compared as
``sampled_close`` compares numerically different paths, greedy runs alike (equal tokens with equal logprobs,
or, where they first differ, two tokens the teacher-forced logits tie), never by asking both to round alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from rollout_helpers import NO_EOS, left_padded_prompts
from sampled_close import assert_rollouts_sampled_close, assert_sampled_close

from hybrid_engine.decode.kv_pool import PageLedger, pages_for
from hybrid_engine.generation.pages import PagePlan
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

#: A call that has not returned by then is taken for the livelock (each returns in well under a second).
CALL_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama", seed=6)


def _within(what: str, call: Callable[[], Any]) -> Any:
    """``call()`` in a daemon thread, failing the test if it has not returned within :data:`CALL_TIMEOUT_S`."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # re-raised in the test's thread
            box["error"] = err

    thread = threading.Thread(target=body, name=f"issue-44 {what}", daemon=True)
    thread.start()
    thread.join(CALL_TIMEOUT_S)
    if thread.is_alive():
        pytest.fail(f"{what}: the call did not return within {CALL_TIMEOUT_S:.0f} s (admission livelock)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _rollout(model, *, graphs: bool = False, kv: int | None = None, page: int = 16) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=NO_EOS, kv_cache_tokens=kv,
                                                           kv_page_size=page))


def _generate(model, request: RolloutRequest, sampling: SamplingConfig, *, graphs: bool = False,
              kv: int | None = None, page: int = 16):
    rollout = _rollout(model, graphs=graphs, kv=kv, page=page)
    batch = _within(f"kv_cache_tokens={kv}", lambda: rollout.generate(request, sampling))
    return batch, dict(rollout.last_stats)


def _minimum_tokens(request: RolloutRequest, max_new: int, page: int) -> int:
    """The smallest ``kv_cache_tokens`` the front end accepts: one request's row and its staged prompt."""
    longest = max(request.prompt_lengths)
    return (pages_for(longest + max_new - 1, page) + pages_for(longest, page)) * page


def _greedy_close(model, context: list[int], tokens_a: list[int], logprobs_a: list[float], tokens_b: list[int],
                  logprobs_b: list[float], *, name: str, atol: float = 1e-5, tie: float = 1e-4) -> None:
    """Two greedy continuations of ``context`` by numerically different paths: equal tokens with equal logprobs
    (full softmax), or, where they first differ, two tokens whose teacher-forced logprobs tie within ``tie`` at
    the top (the only flip float noise can make), each reported with its teacher-forced logprob."""
    assert len(tokens_a) == len(tokens_b), name
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        if a == b:
            assert abs(logprobs_a[i] - logprobs_b[i]) <= atol, f"{name}: position {i}: {logprobs_a[i]} {logprobs_b[i]}"
            continue
        with torch.no_grad():
            ids = torch.tensor([context + tokens_a[:i]])
            full = torch.log_softmax(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float(),
                                     -1)
        top = float(full.max())
        assert top - float(full[a]) <= tie and top - float(full[b]) <= tie, (
            f"{name}: position {i}: greedy tokens {a} and {b} do not tie at the top of the teacher-forced "
            f"logprobs ({float(full[a])}, {float(full[b])}, best {top})")
        for token, lp in ((a, logprobs_a[i]), (b, logprobs_b[i])):
            assert abs(lp - float(full[token])) <= 1e-4, f"{name}: position {i}, token {token}: {lp}"
        return


def _assert_same_rollout(model, tight, ample, sampling: SamplingConfig) -> None:
    if sampling.temperature > 0:
        assert_rollouts_sampled_close(model, tight, ample, temperature=sampling.temperature)
        return
    start = ample.response_start_idx
    assert torch.equal(tight.input_ids[:, :start], ample.input_ids[:, :start])
    assert torch.equal(tight.response_lengths, ample.response_lengths)
    for row, n in enumerate(ample.response_lengths.tolist()):
        context = ample.input_ids[row, :start][ample.attention_mask[row, :start].bool()].tolist()
        _greedy_close(model, context, tight.responses[row, :n].tolist(), tight.response_logprobs[row, :n].tolist(),
                      ample.responses[row, :n].tolist(), ample.response_logprobs[row, :n].tolist(),
                      name=f"row {row}")


def _sampling(max_new: int, n: int, temperature: float) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new, temperature=temperature, n_samples_per_prompt=n, seed=3)


# The issue's cases: (prompt lengths, samples per prompt, max_new_tokens, kv_cache_tokens); the default page of 16.
ISSUE_CASES = {
    "2-prompts-n2-at-the-minimum": ([3, 5], 2, 6, 32),
    "5-prompts-n2-in-80": ([2, 4, 7, 5, 3], 2, 6, 80),
    "14-prompts-n4-in-14-pages": ([20] * 14, 4, 6, 14 * 16),
    "8-long-prompts-at-3.7x-their-need": ([100] * 8, 2, 6, 896),
}


@pytest.mark.parametrize("case", list(ISSUE_CASES), ids=list(ISSUE_CASES))
def test_the_issues_budgets_return_what_an_ample_pool_gives(model, case):
    lengths, n, max_new, kv = ISSUE_CASES[case]
    request = left_padded_prompts(lengths, seed=1)
    sampling = _sampling(max_new, n, 1.0)
    assert kv >= _minimum_tokens(request, max_new, 16)  # the front end accepts it
    tight, stats = _generate(model, request, sampling, kv=kv)
    ample, _ = _generate(model, request, sampling)
    _assert_same_rollout(model, tight, ample, sampling)
    assert stats["tokens_generated"] == len(lengths) * n * max_new
    assert stats["kv_pages_total"] == kv // 16 and stats["kv_pages_peak"] <= kv // 16


def test_the_stage_leaves_the_pages_its_first_samples_need(model):
    """Two prompts of 3 and 5 tokens with 2 samples each in 2 pages: the stage takes one prompt (its first sample
    needs the other page for its copy of the partial page), both samples start, and the second prompt is staged
    once they are done. Each prompt is prefilled once."""
    request = left_padded_prompts([3, 5], seed=1)
    sampling = _sampling(6, 2, 1.0)
    _, stats = _generate(model, request, sampling, kv=32)
    assert stats["prefill_forwards"] == 2 and stats["prefill_rows"] == 2 and stats["preemptions"] == 0
    assert stats["kv_row_copies"] == 2 and stats["kv_pages_peak"] == 2


def test_first_sample_pages_follow_the_prompts_last_page():
    plan = PagePlan(PageLedger(8), 4, 4)
    assert plan.first_sample_pages(5, last=False) == 1  # its copy of the partial page
    assert plan.first_sample_pages(5, last=True) == 0  # it takes the partial page, room for its first token
    assert plan.first_sample_pages(8, last=True) == 1  # the prompt fills its pages: its first token starts one
    assert plan.first_sample_pages(8, last=False) == 1
    assert plan.stage("a", 5, spare=6) is None and plan.ledger.free == 7  # 2 + 6 > 7: nothing taken
    assert plan.stage("a", 5, spare=5) is not None and plan.ledger.free == 5
    plan.close()


# The sweep: (prompt lengths, samples per prompt, temperature, graphs, page size, max_new_tokens).
SWEEP = {
    "n2-sampled-eager": ([3, 5], 2, 1.0, False, 16, 6),
    "n2-greedy-graphs": ([2, 7, 4], 2, 0.0, True, 16, 6),
    "n4-sampled-eager-full-pages": ([8, 3], 4, 0.8, False, 4, 4),
    "n1-sampled-graphs": ([6, 3, 9, 4], 1, 1.0, True, 4, 5),
}


@pytest.mark.parametrize("case", list(SWEEP), ids=list(SWEEP))
def test_every_budget_from_the_minimum_up_returns_what_an_ample_pool_gives(model, case):
    """From the smallest budget the front end accepts up to one page past what an ample pool's run holds at its
    peak, page by page: every call returns, with the ample pool's samples."""
    lengths, n, temperature, graphs, page, max_new = SWEEP[case]
    request = left_padded_prompts(lengths, seed=2)
    sampling = _sampling(max_new, n, temperature)
    ample, ample_stats = _generate(model, request, sampling, graphs=graphs, page=page)
    lowest = _minimum_tokens(request, max_new, page) // page
    below = _rollout(model, kv=(lowest - 1) * page, page=page)
    with pytest.raises(ValueError, match=f"kv_cache_tokens to at least {lowest * page}"):  # the front end's minimum
        _within("one page below the minimum", lambda: below.generate(request, sampling))
    highest = max(lowest, ample_stats["kv_pages_peak"]) + 1
    for pages in range(lowest, highest + 1):
        tight, stats = _generate(model, request, sampling, graphs=graphs, kv=pages * page, page=page)
        _assert_same_rollout(model, tight, ample, sampling)
        assert stats["kv_pages_peak"] <= pages and stats["tokens_generated"] == len(lengths) * n * max_new
        if graphs:
            assert stats["fallbacks"] == 0


@pytest.mark.parametrize("kv,turns", [(32, 1), (48, 2)], ids=["first-turn-at-32", "two-turns-at-48"])
def test_episode_turns_at_the_minimum_return_what_an_ample_pool_gives(model, kv, turns):
    """2 prompts x 2 rows: a first turn in 32 tokens (its rows share each prompt's prefill), and two turns in 48,
    the least the second turn's histories need (its rows continue on the pages their first turn kept)."""
    request = left_padded_prompts([3, 5], seed=1)

    def episode(kv: int | None):
        episodes = _rollout(model, kv=kv).open_episodes(request, n_samples_per_prompt=2)
        for t in range(turns):
            sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3 + t)
            _within(f"Episodes.turn {t}, kv_cache_tokens={kv}", lambda s=sampling: episodes.turn(s))
            if t + 1 < turns:
                for row in range(4):
                    episodes.append(row, [40 + row, 41])
        return episodes.close()

    tight, ample = episode(kv), episode(None)
    assert torch.equal(tight.prompt_ids, ample.prompt_ids) and torch.equal(tight.env_mask, ample.env_mask)
    assert tight.completion_mask.sum(1).tolist() == [6 * turns + 2 * (turns - 1)] * 4
    for row in range(4):
        context = tight.prompt_ids[row][tight.prompt_mask[row].bool()].tolist()
        n = int(tight.completion_mask[row].sum())
        assert_sampled_close(model, context, tight.completion_ids[row, :n].tolist(),
                             tight.completion_logprobs[row, :n].tolist(), ample.completion_ids[row, :n].tolist(),
                             ample.completion_logprobs[row, :n].tolist(), name=f"row {row}")
