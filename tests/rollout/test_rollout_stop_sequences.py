"""``SamplingConfig(stop_token_ids=...)``: a response ends once it ends in a stop sequence, matched on the device
inside the captured step (no host read per token). The oracle: the same rollout without stops, cut after the
first place each row's tokens end in one (sampling is counter-based, so the tokens before it are the same)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import left_padded_prompts

from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model


def cut(response: list[int], stops: tuple[tuple[int, ...], ...], min_tokens: int = 0) -> list[int]:
    for end in range(1, len(response) + 1):
        if end > min_tokens and any(tuple(response[max(0, end - len(q)):end]) == q for q in stops):
            return response[:end]
    return response


def responses(batch) -> list[list[int]]:
    return [batch.responses[i, : int(n)].tolist() for i, n in enumerate(batch.response_lengths)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_stop_after_the_first_stop_sequence_they_end_in_with_graphs_as_eagerly(temperature):
    model = build_model("tiny-llama", seed=3)
    ids, mask = left_padded_prompts(4, 6, seed=7)
    request = RolloutRequest(ids, mask)
    plain = SamplingConfig(max_new_tokens=24, temperature=temperature, seed=9, n_samples_per_prompt=2)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10_000, max_batch_size=4))
    full = responses(rollout.generate(request, plain))
    # Stops taken from what the rows generate: a pair from row 0's middle, one token from row 3, a 3-token one.
    stops = (tuple(full[0][5:7]), (full[3][10],), tuple(full[5][2:5]))
    want = [cut(r, stops) for r in full]
    assert len(want[0]) <= 7 and want != full  # the stops do cut rows here
    stopping = dataclasses.replace(plain, stop_token_ids=stops)
    got = rollout.generate(request, stopping)
    assert responses(got) == want
    assert rollout.graph_stats.replays > 0 and rollout.last_stats["fallbacks"] == 0
    eager = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=False, pad_token_id=0,
                                                            eos_token_id=10_000, max_batch_size=4))
    assert torch.equal(eager.generate(request, stopping).input_ids, got.input_ids)
    assert responses(rollout.generate(request, plain)) == full  # the next call without stops has none


def test_a_stop_sequence_on_the_first_token_ends_the_row_at_once():
    model = build_model("tiny-gpt2", seed=1)
    ids, mask = left_padded_prompts(2, 5, seed=2)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10_000))
    plain = SamplingConfig(max_new_tokens=6)
    first = responses(rollout.generate(RolloutRequest(ids, mask), plain))[0][0]
    got = responses(rollout.generate(RolloutRequest(ids, mask), dataclasses.replace(plain, stop_token_ids=[[first]])))
    assert got[0] == [first]


@pytest.mark.parametrize("value,exc,match", [
    ("\\n", TypeError, "must be a list of token-id lists"),
    ([[]], TypeError, "non-empty list of token ids"),
    ([[1, -2]], TypeError, "non-empty list of token ids >= 0"),
    ([[1]] * 17, ValueError, "at most 16 of 1 to 16 ids"),
    ([list(range(17))], ValueError, "at most 16 of 1 to 16 ids"),
])
def test_bad_stop_sequences_are_refused_by_name(value, exc, match):
    with pytest.raises(exc, match=rf"SamplingConfig: .*{match}"):
        SamplingConfig(stop_token_ids=value)


def test_a_stop_id_outside_the_vocabulary_is_refused_and_the_rollout_stays_usable():
    model = build_model("tiny-gpt2", seed=1)
    ids, mask = left_padded_prompts(2, 5, seed=2)
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=10_000))
    with pytest.raises(ValueError, match="stop_token_ids hold ids >= the model's vocab_size"):
        rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=3, stop_token_ids=[[10**6]]))
    with pytest.raises(ValueError, match=r"RolloutRequest.stop_token_ids \(prompt 1\) hold ids >= the model's"):
        rollout.generate(RolloutRequest(ids, mask, stop_token_ids=[None, [[10**6]]]), SamplingConfig(max_new_tokens=3))
    assert rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=3)).responses.shape[1] == 3


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_each_prompt_stops_on_its_own_sequences(graphs):
    """RolloutRequest(stop_token_ids=[...]) per prompt (None: the SamplingConfig's), mixed with per-prompt
    sampling in one call: each row is cut where its own stops say."""
    model = build_model("tiny-llama", seed=3)
    ids, mask = left_padded_prompts(4, 6, seed=7)
    plain = SamplingConfig(max_new_tokens=20, temperature=1.0, seed=9)
    full = responses(rollout_of(model, graphs=False).generate(RolloutRequest(ids, mask), plain))
    own = [[list(full[0][3:5])], None, [[full[2][6]], list(full[2][1:4])], None]
    default = ((full[3][8],),)
    request = RolloutRequest(ids, mask, stop_token_ids=own, temperature=[None, None, None, 1.0])
    got = rollout_of(model, graphs).generate(request, dataclasses.replace(plain, stop_token_ids=default))
    want = [cut(r, tuple(map(tuple, own[i])) if own[i] is not None else default) for i, r in enumerate(full)]
    assert responses(got) == want and want != full
    with pytest.raises(TypeError, match="RolloutRequest: prompt 1's: each stop_token_ids entry"):
        RolloutRequest(ids, mask, stop_token_ids=[None, [[]], None, None])


def rollout_of(model, graphs: bool) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=10_000, max_batch_size=4))


@pytest.mark.parametrize("graphs", [False, True])
def test_a_smaller_bucket_used_before_without_stops_honours_the_next_calls_stops(graphs):
    """The slots of a bucket below the largest are a view kept across calls: what a call sets up (its stop
    sequences, whether it reads logprobs) must reach the views made by earlier calls too."""
    model = build_model("tiny-llama", seed=3)
    ids, mask = left_padded_prompts(4, 6, seed=7)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                              eos_token_id=10_000, max_batch_size=4))
    plain = SamplingConfig(max_new_tokens=16, temperature=1.0, seed=9)
    rollout.generate(RolloutRequest(ids, mask), plain)  # 4 slots
    two = RolloutRequest(ids[:2], mask[:2])
    full = responses(rollout.generate(two, plain))  # bucket 2: a view of the 4 slots, made without stops
    stops = (tuple(full[0][4:6]), (full[1][7],))
    want = [cut(r, stops) for r in full]
    assert want != full
    assert responses(rollout.generate(two, dataclasses.replace(plain, stop_token_ids=stops))) == want
    assert responses(rollout.generate(two, plain)) == full
