"""Rollouts at RL sizes: what admission and prefill keep in the graph pool, how big the stage gets, the output
buffers, and the host-side scheduling cost in the number of slots.

A captured graph keeps its intermediates in the graph pool for good, so what a captured prefill batch or
admission round computes on the side must stay bounded whatever the slot count: the K/V an admission round
gathers is one layer's at a time, and a prefill batch holds at most ``PREFILL_TOKEN_BUDGET`` prompt tokens
(at least ``EXACT_PROMPT_ROWS`` prompts). Each prompt is still prefilled once per call, and tokens and
logprobs are those of graphs off and of static batching.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import NO_EOS, assert_batches_identical

from hybrid_engine.generation.schedule_policy import ADMISSION_COST, _steps_to_admission
from hybrid_engine.generation.scheduler import gather_responses
from hybrid_engine.graphs.keys import AdmissionKey, PrefillKey
from hybrid_engine.graphs.runner import EXACT_PROMPT_ROWS, PREFILL_TOKEN_BUDGET
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model


def _prompts(num: int, width: int, seed: int, shortest: int = 1) -> RolloutRequest:
    """``num`` left-padded prompts of ``shortest``..``width`` real tokens (one of them ``width`` long)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, width + 1, (num,), generator=gen)
    lengths[0] = width
    ids = torch.randint(4, 384, (num, width), generator=gen)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    return RolloutRequest(ids * mask, mask)


def _rollout(model, graphs: bool, slots: int, **config) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, max_batch_size=slots,
                                                           pad_token_id=0, eos_token_id=NO_EOS, **config))


def _graph_bytes(graph) -> int:
    """What one captured graph holds in the pool (the CPU emulation's count: static outputs + peak intermediates)."""
    return graph.static_bytes + graph.workspace_bytes


@pytest.mark.slow
def test_a_captured_admission_round_keeps_one_layers_kv_in_the_graph_pool():
    """8 layers: an admission round used to gather every layer's K/V of its rows at once, and its capture kept
    that (8x one layer's) in the pool; now it copies one page per request (the sample's own last page), one
    layer at a time, with the same tokens and logprobs as graphs off."""
    model = build_model("tiny-gpt2", n_layer=8, seed=1)
    request = _prompts(16, 60, seed=0)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=4, seed=3)
    eager = _rollout(model, False, 32).generate(request, sampling)
    rollout = _rollout(model, True, 32)
    for _ in range(3):  # warm-up, capture, replay
        assert_batches_identical(rollout.generate(request, sampling), eager)
    assert rollout.last_stats["admission_graph_replays"] >= 2
    stage = rollout.runner.stage.cache
    admissions = {k: rollout.runner.graph(k) for k in rollout.runner.graph_keys if isinstance(k, AdmissionKey)}
    assert admissions
    for key, graph in admissions.items():
        one_layer = key.requests * 2 * stage.num_kv_heads * stage.page_size * stage.head_dim * 4  # float32 K and V
        assert _graph_bytes(graph) <= one_layer * 5 // 4, (key, _graph_bytes(graph), one_layer)


@pytest.mark.slow
def test_with_samples_per_prompt_a_prefill_batch_fills_a_stage_bounded_by_the_token_budget():
    """64 slots, 8 samples per prompt, prompts staged 512 wide: the stage has 8192 // 512 = 16 prompt rows, not
    one per slot (it had 64 and only 8 were ever used: a batch held the prompts of the next 64 requests). A
    batch holds 16 distinct prompts, and each prompt is still prefilled once per call."""
    model = build_model("tiny-gpt2", n_positions=1024, seed=2)
    request = _prompts(24, 300, seed=1, shortest=200)
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, n_samples_per_prompt=8, seed=5)
    eager_rollout = _rollout(model, False, 64)
    eager = eager_rollout.generate(request, sampling)
    rows = PREFILL_TOKEN_BUDGET // 512
    assert eager_rollout.runner.stage.rows == rows == 16 and eager_rollout.runner.stage.width == 512
    assert eager_rollout.runner.stage.requests == 64  # a round still admits up to a slot per request
    stats = eager_rollout.last_stats
    assert stats["prefill_rows"] == 24 and stats["prefill_forwards"] == 2  # 16 prompts, then 8
    assert stats["kv_row_copies"] == 24 * 8 - 24
    rollout = _rollout(model, True, 64)
    for _ in range(3):
        assert_batches_identical(rollout.generate(request, sampling), eager)
        assert rollout.last_stats["prefill_rows"] == 24 and rollout.last_stats["prefill_forwards"] == 2
    prefills = [k for k in rollout.runner.graph_keys if isinstance(k, PrefillKey)]
    assert max(k.prompts for k in prefills) * max(k.width for k in prefills) <= PREFILL_TOKEN_BUDGET
    assert rollout.last_stats["admission_graph_captures"] == 0  # replayed throughout

    # A narrower call after it reuses the stage (so it never shrinks and grows back): batches of at most its 16
    # rows, the same as graphs off with the same history (a fresh rollout's cache would be shorter).
    stage, invalidations = rollout.runner.stage, rollout.graph_stats.invalidations
    narrow = _prompts(40, 60, seed=2)
    batch = rollout.generate(narrow, sampling)
    assert rollout.runner.stage is stage and rollout.graph_stats.invalidations == invalidations
    assert rollout.last_stats["prefill_rows"] == 40 and rollout.last_stats["prefill_forwards"] == 3
    assert_batches_identical(batch, eager_rollout.generate(narrow, sampling))


@pytest.mark.slow
@pytest.mark.parametrize("continuous", [True, False])
def test_one_sample_per_prompt_on_256_slots_prefills_within_the_token_budget(continuous):
    """256 slots, one sample per prompt, prompts staged 64 wide: a prefill batch used to be one prompt per slot
    (256 x 64 tokens in one captured forward, whose activations stayed in the graph pool: 3x the slots' K/V at
    256 x 256). Now the stage has 8192 // 64 = 128 rows, a round of 256 requests runs as two parts, and tokens
    and logprobs equal graphs off and static batching."""
    model = build_model("tiny-llama", seed=4)
    request = _prompts(300, 64, seed=3)
    budgets = torch.randint(1, 7, (300,), generator=torch.Generator().manual_seed(6)).tolist()
    request = RolloutRequest(request.prompt_ids, request.prompt_attention_mask, max_new_tokens=budgets)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=7)
    static = _rollout(model, False, 256, continuous_batching=False).generate(request, sampling)
    eager = _rollout(model, False, 256, continuous_batching=continuous)
    assert_batches_identical(eager.generate(request, sampling), static)
    rollout = _rollout(model, True, 256, continuous_batching=continuous)
    for _ in range(2):  # warm-up, capture (and replay)
        assert_batches_identical(rollout.generate(request, sampling), static)
    stage = rollout.runner.stage
    assert stage.rows <= PREFILL_TOKEN_BUDGET // 64 and stage.rows >= EXACT_PROMPT_ROWS
    assert stage.requests == 256
    stats = rollout.last_stats
    assert stats["prefill_rows"] == 300 and stats["prefill_forwards"] == 3  # 128 + 128 + 44
    assert stats["admission_graph_replays"] >= stats["prefill_forwards"] + stats["admission_rounds"]
    assert all(k.prompts * k.width <= PREFILL_TOKEN_BUDGET for k in rollout.runner.graph_keys if isinstance(k, PrefillKey))


# ---------------------------------------------------------------------------------------------- output buffers
@pytest.mark.parametrize("longest", [12, 9])
def test_gather_responses_pads_the_result_buffers_in_place(longest):
    """At R = 16384 responses of up to 2048 tokens the result buffers are 384 MB: padding them in place, instead
    of into new ``[R, width]`` tensors, saves one more of each (the tokens are only concatenated after the
    prompts; the logprobs, returned to users, stay contiguous). Same values as a fresh masked copy."""
    gen = torch.Generator().manual_seed(0)
    out_tokens = torch.randint(4, 384, (6, 12), generator=gen)
    out_logprobs = -torch.rand(6, 12, generator=gen)
    lengths = dict(enumerate(torch.randint(0, longest + 1, (6,), generator=gen).tolist()))
    lengths[3] = longest
    n = torch.tensor([lengths[r] for r in range(6)])
    padding = torch.arange(longest)[None, :] >= n[:, None]
    expected_tokens = out_tokens[:, :longest].masked_fill(padding, 1)
    expected_logprobs = out_logprobs[:, :longest].masked_fill(padding, 0.0)
    tokens_at, logprobs_at = out_tokens.data_ptr(), out_logprobs.data_ptr()
    responses, logprobs, got_n = gather_responses(out_tokens, lengths, 1, out_logprobs)
    assert torch.equal(responses, expected_tokens) and torch.equal(logprobs, expected_logprobs)
    assert torch.equal(got_n, n) and logprobs.is_contiguous()
    assert responses.data_ptr() == tokens_at  # a view of the result buffer, padded in place
    assert (logprobs.data_ptr() == logprobs_at) == (longest == 12)  # the buffer itself where it is all kept


# ------------------------------------------------------------------------------------- scheduling in the slots
def test_admission_planning_stays_linear_in_the_slots():
    """The plan walks the live rows' sorted bounds once. Rebuilding the list of later bounds at every freeing
    was quadratic in the slots (ten seconds at 50,000). Counted in comparisons, not timed."""
    compared = [0]

    class Bound(int):  # an int that counts the comparisons the planner makes
        def _count(self, other, op):
            compared[0] += 1
            return op(int(self), int(other))

        __lt__ = lambda self, other: self._count(other, int.__lt__)  # noqa: E731
        __le__ = lambda self, other: self._count(other, int.__le__)  # noqa: E731
        __gt__ = lambda self, other: self._count(other, int.__gt__)  # noqa: E731
        __ge__ = lambda self, other: self._count(other, int.__ge__)  # noqa: E731

    slots = 4000
    left = {s: Bound(s + 1) for s in range(slots)}
    assert _steps_to_admission(1, 10**6, left, slots, ADMISSION_COST, None) == slots // 2 - 1
    assert compared[0] < 10 * slots, compared[0]  # the quadratic plan made millions
