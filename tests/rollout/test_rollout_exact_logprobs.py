"""Exact mode (issue 32): a rollout's logprob is bit-for-bit the engine's training forward's, in any batch.

Every comparison here is ``==``, not a tolerance: the default mode differs by ~5e-7 in fp32 (and more in bf16
across batch compositions), which these tests would catch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import exact_mode_unavailable
from rollout_helpers import ARCHS, NO_EOS
from tiers import fast_first

from hybrid_engine import exact_forward, initialize, logprobs_of
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
pytestmark = pytest.mark.skipif(exact_mode_unavailable() is not None, reason=str(exact_mode_unavailable()))


def exact_engine(arch: str, dtype: torch.dtype, lr: float = 0.0):
    model = build_model(arch, seed=2).to(dtype)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": lr}},
                                                 "hybrid_engine": {"exact_logprobs": True}})
    return engine


def prompts(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(4, 384, (n,), generator=gen)
        mask[i, width - n:] = 1
    return ids, mask


def training_logprobs(engine, batch, sampling: SamplingConfig) -> torch.Tensor:
    """The training forward's logprob of every response token, in ``batch.response_logprobs``' layout."""
    inputs = batch.training_inputs()
    with torch.no_grad():
        logits = engine(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    lp = logprobs_of(logits[:, :-1], inputs["input_ids"][:, 1:], temperature=sampling.temperature,
                     top_p=sampling.top_p, top_k=sampling.top_k)
    start = batch.response_start_idx
    out = torch.zeros_like(batch.response_logprobs)
    real = batch.response_mask[:, start:]
    out[real] = lp[:, start - 1:][real]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("arch", fast_first(ARCHS))
def test_rollout_logprobs_are_the_training_forwards_bit_for_bit(arch, temperature, graphs, dtype):
    engine = exact_engine(arch, DTYPES[dtype])
    ids, mask = prompts([3, 9, 5, 1, 7], seed=5)
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                               eos_token_id=7, max_batch_size=4))
    assert rollout.exact_logprobs  # follows hybrid_engine.exact_logprobs
    sampling = SamplingConfig(max_new_tokens=20, temperature=temperature, top_p=0.9 if temperature else 1.0,
                              top_k=50 if arch == "tiny-mistral" and temperature else -1, seed=3, n_samples_per_prompt=2)
    batch = rollout.generate(RolloutRequest(ids, mask), sampling)
    if graphs:
        assert rollout.last_stats["graph_replays"] > 0 and rollout.graph_stats.fallbacks == 0
    real = batch.response_mask[:, batch.response_start_idx:]
    assert int(real.sum()) > 40
    want = training_logprobs(engine, batch, sampling)
    assert torch.equal(batch.response_logprobs, want)



def _trainer_views(engine, batch) -> dict[str, torch.Tensor]:
    """A greedy rollout's response logprobs as a trainer may compute them from ``engine(...)``: ``logprobs_of`` at
    temperature 0 and at 1 (greedy's distribution, as docs/exact.md's example writes it), and a plain
    ``log_softmax``; each in ``batch.response_logprobs``' layout, 0 past a response."""
    inputs = batch.training_inputs()
    with torch.no_grad():
        logits = engine(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    start = batch.response_start_idx
    at = logits[:, start - 1:-1]
    real = batch.response_mask[:, start:]
    views = {"T=0": logprobs_of(at, batch.responses, temperature=0.0),
             "T=1": logprobs_of(at, batch.responses, temperature=1.0),
             "log_softmax": torch.log_softmax(at.float(), dim=-1).gather(-1, batch.responses[..., None])[..., 0]}
    return {name: lp.masked_fill(~real, 0.0) for name, lp in views.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", fast_first(["tiny-llama", "tiny-gpt2", "tiny-qwen3"]))
def test_a_greedy_rollouts_logprobs_are_the_training_forwards_however_the_trainer_spells_greedy(arch, graphs,
                                                                                                 dtype):
    """Issue 38: greedy reported ``log_softmax`` in vocabulary order, ``logprobs_of(temperature=1)`` summed it
    in sorted order: 4.77e-7 apart. Every spelling of greedy's distribution now gives the same bits."""
    engine = exact_engine(arch, DTYPES[dtype])
    ids, mask = prompts([3, 9, 5, 1, 7], seed=5)
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                               eos_token_id=7, max_batch_size=4))
    sampling = SamplingConfig(max_new_tokens=20, temperature=0.0, seed=3)  # temperature 0: greedy
    batch = rollout.generate(RolloutRequest(ids, mask), sampling)
    if graphs:
        assert rollout.last_stats["graph_replays"] > 0 and rollout.graph_stats.fallbacks == 0
    assert int(batch.response_mask.sum()) > 40
    for name, want in _trainer_views(engine, batch).items():
        assert torch.equal(batch.response_logprobs, want), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
def test_a_greedy_request_among_sampled_ones_reports_what_it_reports_alone(arch, graphs, dtype):
    """A greedy prompt in a call that also samples runs as a top-1 pick in the sampled graph: its tokens and
    logprobs are those of a greedy call of its own, and the training forward's."""
    engine = exact_engine(arch, DTYPES[dtype])
    ids, mask = prompts([6, 4, 8], seed=7)
    config = RolloutConfig(use_graph_capture=graphs, pad_token_id=0, eos_token_id=NO_EOS)
    sampling = SamplingConfig(max_new_tokens=14, temperature=0.0, seed=2)
    mixed = HybridEngineRollout(engine, config=config).generate(
        RolloutRequest(ids, mask, temperature=[1.0, 0.0, 0.7], top_p=[0.9, None, None]), sampling)
    alone = HybridEngineRollout(engine, config=config).generate(
        RolloutRequest(ids[1:2], mask[1:2], request_ids=[1]), sampling)
    assert torch.equal(mixed.responses[1], alone.responses[0])
    assert torch.equal(mixed.response_logprobs[1], alone.response_logprobs[0])
    for name, want in _trainer_views(engine, alone).items():
        assert torch.equal(alone.response_logprobs, want), name



def test_every_spelling_of_the_temperature_one_softmax_gives_the_same_bits():
    """The root cause of issue 38, on bare logits: the full softmax is reduced in vocabulary order wherever it is
    computed (greedy, ``logprobs_of`` at T=1, a no-op top-k, ``logprobs="full"``), so the ulp the sorted order
    gave away is gone."""
    from hybrid_engine.decode.sampling import SamplingKnobs, sample_tokens

    logits = torch.randn(64, 384, generator=torch.Generator().manual_seed(0)) * 3
    tokens = torch.randint(0, 384, (64,), generator=torch.Generator().manual_seed(1))
    want = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 1.0, "top_k": 384},
                   {"temperature": 1.0, "top_p": 0.5, "logprobs": "full"},
                   {"temperature": 1.0, "top_k": 5, "logprobs": "full"}):
        assert torch.equal(logprobs_of(logits, tokens, **kwargs), want), kwargs
    greedy, greedy_lp = sample_tokens(logits, temperature=0.0, seed=0, stream=0, token_index=0)
    knobs = SamplingKnobs(torch.device("cpu"))
    knobs.set_table([(0.0, 1.0, -1), (1.0, 0.9, -1)])  # a greedy setting among sampled ones: a top-1 pick
    index = torch.zeros(64, dtype=torch.int64)
    mixed, mixed_lp = sample_tokens(logits, temperature=1.0, top_p=0.5, top_k=1, seed=0, stream=0,
                                    token_index=0, knobs=knobs.for_rows(index))
    assert torch.equal(mixed, greedy) and torch.equal(mixed_lp, greedy_lp)
    assert torch.equal(greedy_lp, torch.log_softmax(logits, dim=-1).gather(-1, greedy[:, None])[:, 0])


def test_exact_forward_on_a_bare_model_is_what_a_rollout_with_exact_logprobs_reports():
    model = build_model("tiny-mistral", seed=4)
    ids, mask = prompts([6, 2, 8], seed=1)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=NO_EOS, exact_logprobs=True))
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=9)
    batch = rollout.generate(RolloutRequest(ids, mask), sampling)
    inputs = batch.training_inputs()
    with torch.no_grad():  # positional input_ids, as a trainer may call it
        logits = exact_forward(model, inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    lp = logprobs_of(logits[:, :-1], inputs["input_ids"][:, 1:], temperature=1.0)
    start = batch.response_start_idx
    assert torch.equal(lp[:, start - 1:], batch.response_logprobs)


COMPOSITIONS = ("alone", "with_7_others", "sample_5_of_8", "later_round", "after_compaction")


def _composition(name: str, target: tuple[torch.Tensor, torch.Tensor]):
    """(request, n, max_batch_size, row of the target) that puts the target prompt's stream 5 in ``name``."""
    tid, tmask = target
    width = 12
    others_ids, others_mask = prompts([4, 11, 2, 8, 6, 10, 3], seed=8)

    def stack(rows):
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, (r_ids, r_mask) in enumerate(rows):
            ids[i, width - r_ids.shape[0]:] = r_ids
            mask[i, width - r_mask.shape[0]:] = r_mask
        return ids, mask

    others = [(others_ids[i], others_mask[i]) for i in range(7)]
    if name == "alone":
        return RolloutRequest(*stack([target]), request_ids=[5]), 1, 8, 0
    if name == "with_7_others":
        return RolloutRequest(*stack(others[:3] + [target] + others[3:]), request_ids=[100, 101, 102, 5, 103, 104,
                                                                                        105, 106]), 1, 8, 3
    if name == "sample_5_of_8":  # request id 0, n = 8: sample 5 draws counter stream 0 * 8 + 5
        return RolloutRequest(*stack([target]), request_ids=[0]), 8, 8, 5
    if name == "later_round":  # two slots: the target waits for two others to finish
        return RolloutRequest(*stack(others[:4] + [target]), request_ids=[100, 101, 102, 103, 5],
                              max_new_tokens=[3, 5, 2, 4, 16]), 1, 2, 4
    # after_compaction: six short rows finish first and the target's row moves down into a smaller bucket
    return RolloutRequest(*stack(others[:6] + [target]), request_ids=[100, 101, 102, 103, 104, 105, 5],
                          max_new_tokens=[2, 3, 2, 4, 3, 2, 16]), 1, 8, 6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_same_request_in_any_batch_composition_gets_the_same_tokens_and_logprobs(graphs, dtype):
    engine = exact_engine("tiny-llama", DTYPES[dtype])
    target_ids, target_mask = prompts([9], seed=21)
    target = (target_ids[0, -9:], target_mask[0, -9:])
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                               eos_token_id=NO_EOS))
    sampling_for = {n: SamplingConfig(max_new_tokens=16, temperature=1.0, seed=11, n_samples_per_prompt=n)
                    for n in (1, 8)}
    seen = {}
    for name in COMPOSITIONS:
        request, n, slots, row = _composition(name, target)
        rollout.config = RolloutConfig(use_graph_capture=graphs, pad_token_id=0, eos_token_id=NO_EOS,
                                       max_batch_size=slots)
        batch = rollout.generate(request, sampling_for[n])
        if name == "after_compaction" and graphs:
            assert len(rollout.graph_stats.buckets) > 1  # the target decoded in more than one bucket
        length = int(batch.response_lengths[row])
        assert length == 16
        seen[name] = (batch.responses[row, :length], batch.response_logprobs[row, :length])
    tokens, logprobs = seen["alone"]
    for name in COMPOSITIONS[1:]:
        assert torch.equal(seen[name][0], tokens), name
        assert torch.equal(seen[name][1], logprobs), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_grpo_step_in_exact_mode_starts_from_an_importance_ratio_of_exactly_one(dtype):
    engine = exact_engine("tiny-qwen2", DTYPES[dtype], lr=0.5)
    ids, mask = prompts([5, 3, 7, 4], seed=2)
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                               eos_token_id=NO_EOS))
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, seed=4, n_samples_per_prompt=4)
    batch = rollout.generate(RolloutRequest(ids, mask), sampling)
    rewards = (batch.responses[:, 0] % 2).float()  # any reward that differs within a group
    groups = rewards.view(-1, 4)
    advantages = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-4)).view(-1)
    inputs = batch.training_inputs()
    start = batch.response_start_idx
    real = batch.response_mask[:, start:]

    def new_logprobs():
        logits = engine(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        return logprobs_of(logits[:, :-1], inputs["input_ids"][:, 1:], temperature=1.0)[:, start - 1:]

    engine.train()  # with grad, in train mode (the tiny configs have no dropout)
    ratio = torch.exp(new_logprobs() - batch.response_logprobs)
    assert bool((ratio[real] == 1.0).all())
    loss = -(ratio * advantages[:, None])[real].mean()
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        moved = torch.exp(new_logprobs() - batch.response_logprobs)[real]
    assert float((moved - 1).abs().max()) > 1e-4  # the update moved the policy: the ratio could differ


def test_exact_mode_is_off_by_default():
    model = build_model("tiny-llama", seed=0)
    engine, *_ = initialize(model=model, config={})
    assert engine.config.hybrid_engine.exact_logprobs is False
    assert RolloutConfig().exact_logprobs is None
    assert HybridEngineRollout(engine, config=RolloutConfig(pad_token_id=0)).exact_logprobs is False
    assert HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0)).exact_logprobs is False
    assert model.config._attn_implementation != "hybrid_exact"


def test_exact_logprobs_must_be_a_bool():
    with pytest.raises(TypeError, match="exact_logprobs"):
        RolloutConfig(exact_logprobs="yes")
    with pytest.raises(ValueError, match="exact_logprobs"):
        initialize(model=build_model("tiny-llama"), config={"hybrid_engine": {"exact_logprobs": 1}})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ["tiny-qwen2", "tiny-gpt2"])
def test_engine_generate_in_exact_mode_picks_the_exact_forwards_argmax(arch, graphs, dtype):
    """``engine.generate`` returns tokens, not logprobs: its greedy tokens are the exact forward's argmax."""
    model = build_model(arch, seed=6).to(DTYPES[dtype])
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"exact_logprobs": True,
                                                                   "enable_graph_capture": graphs}})
    ids, mask = prompts([4, 7, 2], seed=3)
    engine.eval()
    out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    full_mask = torch.cat([mask, torch.ones(3, 12, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = exact_forward(model, input_ids=out, attention_mask=full_mask).logits
    assert torch.equal(logits[:, ids.shape[1] - 1:-1].argmax(-1), out[:, ids.shape[1]:])
    assert engine.graph_stats.replays > 0 if graphs else engine.graph_stats.replays == 0
