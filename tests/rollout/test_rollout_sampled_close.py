"""The comparison of numerically different paths (tests/sampled_close.py) accepts only what float noise can make.

On scripted logits (fixed whatever the history, so every case is exact by construction): under top-k and
top-p, a cut that the noise can move by one token or a tie at the top-k cut lets each path's token and
logprob come from either kept set, where the two draws can be one ``u``; a cut that cannot move, or tokens
that one ``u`` cannot pick, fails. Greedy: a tie for the argmax may go either way, a margin may not. On a
tiny model's top-k and top-p rollout: a sample moved to its neighbour in the filtered distribution passes,
one moved further, or out of the kept set, fails (so the filter is the sampler's: ``logprobs_of``'s values).
The unfiltered cases are tested beside the rollouts that use them (test_rollout_parity).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import NO_EOS, left_padded_prompts, run, shared_model
from sampled_close import assert_greedy_close, assert_rollouts_sampled_close, assert_sampled_close

from hybrid_engine.decode.sampling import logprobs_of
from hybrid_engine.rollout import SamplingConfig


def scripted(logits):
    """A model whose next-token logits are ``logits`` after any history."""
    row = torch.tensor(logits, dtype=torch.float32)

    def model(input_ids, attention_mask):
        return SimpleNamespace(logits=row.expand(1, input_ids.shape[1], -1))

    return model


#: Probabilities 0.4, 0.3, 0.2, 0.1: the mass before the third token is 0.7, so a top-p of 0.7 is a cut that
#: float noise can put before it or after it; a top-p of 0.8 cuts after it by a margin of 0.1.
MODEL = scripted([math.log(p) for p in (0.4, 0.3, 0.2, 0.1)])


def lp(p: float) -> float:
    return math.log(p)


def test_a_top_p_cut_within_noise_may_differ_between_the_paths():
    # The same token, renormalised over two tokens in one path and three in the other: equal histories, so the
    # rows go on being compared (and the next position's tokens are equal).
    assert assert_sampled_close(MODEL, [5], [0, 1], [lp(.4 / .7), lp(.3 / .7)], [0, 1], [lp(.4 / .9), lp(.3 / .7)],
                                top_p=0.7) == 2
    # Other tokens, one u: token 1 ends the two-token kept set, token 2 the three-token one.
    assert assert_sampled_close(MODEL, [5], [1, 3], [lp(.3 / .7), 0.0], [2], [lp(.2 / .9)], top_p=0.7) == 0
    # Token 0 in one, token 2 in the other: no u picks both.
    with pytest.raises(AssertionError, match="not neighbours in the inverse CDF"):
        assert_sampled_close(MODEL, [5], [0], [lp(.4 / .7)], [2], [lp(.2 / .9)], top_p=0.7)
    # A cut 0.1 away from the top-p mass cannot move: two tokens kept is no distribution the noise can make.
    with pytest.raises(AssertionError, match="teacher-forced"):
        assert_sampled_close(MODEL, [5], [0], [lp(.4 / .7)], [0], [lp(.4 / .9)], top_p=0.8)
    # The same token under the same kept set, logprobs apart by more than atol: not a moved cut.
    with pytest.raises(AssertionError, match="position 0, token 0: logprobs"):
        assert_sampled_close(MODEL, [5], [0], [lp(.4 / .9)], [0], [lp(.4 / .9) + 5e-5], top_p=0.8)


def test_a_tie_at_the_top_k_cut_may_keep_either_token():
    tie = scripted([3.0, 2.0, 1.0, 1.0, 0.0])
    p = torch.softmax(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64), 0).tolist()
    # Token 2 or token 3 (tied) ends the kept set of three; each path kept one of them and drew the last interval.
    assert assert_sampled_close(tie, [5], [2], [lp(p[2])], [3], [lp(p[2])], top_k=3) == 0
    untied = scripted([3.0, 2.0, 1.0, 0.9, 0.0])
    with pytest.raises(AssertionError, match="token 3: logprob .* teacher-forced -inf"):
        assert_sampled_close(untied, [5], [2], [lp(p[2])], [3], [lp(p[2])], top_k=3)


def test_greedy_paths_may_break_only_a_tie_for_the_argmax_either_way():
    tie = scripted([2.0, 2.0, 1.0])
    full = torch.log_softmax(torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64), 0).tolist()
    assert assert_sampled_close(tie, [5], [0, 2], [full[0], 0.0], [1], [full[1]], temperature=0.0) == 0
    assert assert_greedy_close(tie, [5], [0, 2], [1, 1]) == 0
    margin = scripted([2.0, 1.99, 1.0])
    full = torch.log_softmax(torch.tensor([2.0, 1.99, 1.0], dtype=torch.float64), 0).tolist()
    with pytest.raises(AssertionError, match="not a tie that float noise can break"):
        assert_sampled_close(margin, [5], [0], [full[0]], [1], [full[1]], temperature=0.0)
    with pytest.raises(AssertionError, match="not a tie that float noise can break"):
        assert_greedy_close(margin, [5], [0], [1])
    with pytest.raises(AssertionError, match="position 0, token 0: logprobs"):
        assert_sampled_close(margin, [5], [0], [full[0]], [0], [full[0] + 5e-5], temperature=0.0)
    # Equal tokens: equal lengths (no flip could have ended one row earlier).
    with pytest.raises(AssertionError, match="1 and 2 tokens, all equal"):
        assert_greedy_close(margin, [5], [0], [0, 0])


def test_a_filtered_rollout_moved_only_to_its_neighbour_passes():
    model = shared_model("tiny-llama")
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=12, seed=3)
    batch, _ = run(model, left_padded_prompts([4, 7], seed=5), sampling, graphs=False, eos=NO_EOS)
    close = dict(temperature=0.8, top_p=0.9, top_k=12)
    assert assert_rollouts_sampled_close(model, batch, batch, **close) == [6, 6]
    start = batch.response_start_idx
    for row in range(2):  # the first position whose filtered distribution keeps 6 tokens or more
        for i in range(6):
            history = batch.input_ids[row, :start + i][batch.attention_mask[row, :start + i].bool()]
            with torch.no_grad():
                logits = model(input_ids=history[None]).logits[0, -1]
            every = torch.arange(logits.shape[-1])
            filtered = logprobs_of(logits[None].expand(len(every), -1), every, **close)
            kept = torch.sort(filtered, descending=True, stable=True).indices[:int(filtered.isfinite().sum())]
            if len(kept) >= 6:
                break
        else:
            continue
        break
    rank = kept.tolist().index(int(batch.input_ids[row, start + i]))
    step = 1 if rank + 3 < len(kept) else -1

    def moved(token: int, logprob: float):
        ids, logprobs = batch.input_ids.clone(), batch.response_logprobs.clone()
        ids[row, start + i], logprobs[row, i] = token, logprob
        ids[row, start + i + 1:] = 7  # past the flip: not compared
        return dataclasses.replace(batch, input_ids=ids, response_logprobs=logprobs)

    neighbour = int(kept[rank + step])
    firsts = assert_rollouts_sampled_close(model, batch, moved(neighbour, float(filtered[neighbour])), **close)
    assert firsts[row] == i
    further = int(kept[rank + 3 * step])
    with pytest.raises(AssertionError, match="not neighbours in the inverse CDF"):
        assert_rollouts_sampled_close(model, batch, moved(further, float(filtered[further])), **close)
    dropped = int(torch.nonzero(~filtered.isfinite())[0, 0])  # a token the filters remove, at its full logprob
    full = torch.log_softmax(logits.float() / 0.8, -1)
    with pytest.raises(AssertionError, match="teacher-forced"):
        assert_rollouts_sampled_close(model, batch, moved(dropped, float(full[dropped])), **close)
