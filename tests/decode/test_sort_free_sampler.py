"""The sampler picks by an inverse CDF in vocabulary order: temperature alone sorts nothing, a row whose setting
filters nothing picks the same token whatever filters its call's graph runs for other rows, the teacher-forced
logprob is the reported one, and the counter uniforms cost few ops."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_engine.decode.sampling import (
    SamplingKnobs,
    counter_uniform,
    logprobs_of,
    sample_tokens,
    sample_tokens_and_top,
    union_mode,
)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_temperature_alone_sorts_nothing_and_filters_sort_once():
    logits = _logits()
    for knobs in (None, SamplingKnobs(torch.device("cpu"))):
        rows = None
        if knobs is not None:
            knobs.set(0.7, 1.0, -1)
            rows = knobs.for_rows(torch.zeros(6, dtype=torch.long), (0.7, 1.0, -1))
        with _Ops() as ops:
            sample_tokens(logits, temperature=0.7, seed=1, stream=torch.arange(6), token_index=3, knobs=rows)
        assert not [n for n in ops.names if "sort" in n or "topk" in n], ops.names
    with _Ops() as ops:
        sample_tokens(logits, temperature=0.7, top_p=0.8, top_k=5, seed=1, stream=torch.arange(6), token_index=3)
    assert sum("sort" in n for n in ops.names) == 1


def test_counter_uniform_costs_few_ops():
    with _Ops() as ops:
        counter_uniform(torch.full((4,), 3), torch.arange(4), torch.arange(4))
    assert len(ops.names) <= 36  # two splitmix64 rounds and the float conversion (the old hash took 54 kernels)


@pytest.mark.parametrize("other", [(1.0, 0.5, -1), (0.8, 1.0, 4), (1.3, 0.9, 7)])
def test_a_row_without_filters_picks_alike_in_a_call_that_filters_other_rows(other):
    """Temperature alone picks in vocabulary order, so the filtered path must too: the union graph's filters leave
    a no-filter row's token and logprob bits as they are in a call of its own."""
    logits = _logits(rows=64, vocab=40, seed=3)
    stream, index = torch.arange(64), torch.arange(64) % 5
    alone_knobs = SamplingKnobs(torch.device("cpu"))
    alone_knobs.set(1.0, 1.0, -1)
    key = (1.0, 1.0, -1)
    alone = sample_tokens_and_top(logits, temperature=1.0, seed=9, stream=stream, token_index=index,
                                  knobs=alone_knobs.for_rows(torch.zeros(64, dtype=torch.long), key))
    mixed_knobs = SamplingKnobs(torch.device("cpu"))
    settings = [(1.0, 1.0, -1), other]
    mixed_knobs.set_table(settings)
    union = union_mode(settings)
    which = torch.arange(64) % 2
    mixed = sample_tokens_and_top(logits, temperature=union[0], top_p=union[1], top_k=union[2], seed=9,
                                  stream=stream, token_index=index, knobs=mixed_knobs.for_rows(which, union))
    plain = which == 0
    assert torch.equal(mixed[0][plain], alone[0][plain])
    assert torch.equal(mixed[1][plain], alone[1][plain])


@pytest.mark.parametrize("setting", [(1.0, 1.0, -1), (0.7, 0.8, -1), (1.2, 1.0, 5), (0.9, 0.6, 8)])
@pytest.mark.parametrize("mode", ["sampling", "full"])
def test_teacher_forced_logprobs_are_the_reported_ones(setting, mode):
    t, p, k = setting
    logits = _logits(rows=32, vocab=30, seed=5)
    tokens, chosen = sample_tokens(logits, temperature=t, top_p=p, top_k=k, seed=2, stream=torch.arange(32),
                                   token_index=1, logprobs=mode)
    again = logprobs_of(logits, tokens, temperature=t, top_p=p, top_k=k, logprobs=mode)
    assert torch.equal(again, chosen)
    assert torch.isfinite(chosen).all()  # a sampled token is always a kept one


def test_temperature_alone_matches_the_softmax_over_many_draws():
    """Chi-square over 40k rows of one logit vector: the vocabulary-order inverse CDF samples softmax(l / T)."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -2.0, 0.7])
    n, t = 40_000, 0.8
    tokens, _ = sample_tokens(logits.expand(n, -1), temperature=t, seed=11, stream=torch.arange(n) // 7,
                              token_index=torch.arange(n) % 7)
    counts = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits.double() / t, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    a = 2.0 / (9.0 * 7)
    assert chi2 < 7 * (1.0 - a + 3.719 * math.sqrt(a)) ** 3
