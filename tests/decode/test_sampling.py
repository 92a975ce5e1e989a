"""Tests for hybrid_engine.decode.sampling: counter RNG, sampling distribution, graph capture parity."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_engine.accelerator import CPUAccelerator
from hybrid_engine.decode.sampling import (
    SamplingKnobs,
    counter_uniform,
    logprobs_of,
    sample_tokens,
    sampling_mode,
    validate_sampling,
)

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0])


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is the 1e-4 normal tail."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _expected_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Reference distribution written independently of the module (plain loops over a small vocab)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i].item(), i))
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i].item() for i in keep)
    kept, cum = [], 0.0
    for i in keep:
        if kept and cum >= top_p:
            break
        kept.append(i)
        cum += probs[i].item() / mass
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def _draw(logits, n, *, temperature, top_p=1.0, top_k=-1, seed=1234, request=0):
    batch = logits.expand(n, -1)
    return sample_tokens(
        batch,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=torch.tensor(seed),
        stream=torch.full((n,), request),
        token_index=torch.arange(n),
    )


# -- counter_uniform -------------------------------------------------------------


def test_counter_uniform_deterministic_and_in_range():
    n = 100_000
    seed, req, tok = torch.tensor(7), torch.arange(n) % 97, torch.arange(n)
    u = counter_uniform(seed, req, tok)
    assert u.dtype == torch.float32 and u.shape == (n,)
    assert torch.equal(u, counter_uniform(seed, req, tok))
    assert (u >= 0).all() and (u < 1).all()
    u64 = counter_uniform(seed, req, tok, dtype=torch.float64)
    assert u64.dtype == torch.float64 and (u64 >= 0).all() and (u64 < 1).all()
    # float32 keeps the top 24 of the same 53 bits.
    assert torch.equal(u, (u64 * 2**24).floor().float() / 2**24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_counter_uniform_is_uniform(dtype):
    n = 100_000
    u = counter_uniform(
        torch.tensor(3), torch.zeros(n, dtype=torch.long), torch.arange(n), dtype=dtype
    ).double()
    # Mean 1/2 and variance 1/12, each within ~5 standard errors.
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    # Kolmogorov-Smirnov: 1.95 / sqrt(n) is the 0.1% critical value.
    s = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = torch.maximum(grid - s, s - (grid - 1 / n)).max().item()
    assert d < 1.95 / math.sqrt(n)
    # Successive counters are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 5 / math.sqrt(n)


def test_counter_uniform_depends_on_every_counter():
    n = 1000
    base = {
        "seed": torch.tensor(1),
        "stream": torch.zeros(n, dtype=torch.long),
        "token_index": torch.arange(n),
    }
    u = counter_uniform(**base)
    variants = [
        counter_uniform(**{**base, "seed": torch.tensor(2)}),
        counter_uniform(**{**base, "stream": torch.ones(n, dtype=torch.long)}),
        counter_uniform(**{**base, "token_index": torch.arange(n) + 1}),
        counter_uniform(**base, draw=1),
    ]
    for v in variants:
        # Independent draws agree only by chance (2**-24 per value).
        assert (u == v).sum().item() <= 1
    # Zero counters do not collapse to a fixed point.
    zero = counter_uniform(torch.tensor(0), torch.tensor(0), torch.tensor(0))
    assert 0 < zero.item() < 1


def test_counter_uniform_independent_of_batch_composition():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (64,), generator=g)
    req = torch.randint(0, 10_000, (64,), generator=g)
    tok = torch.randint(0, 4096, (64,), generator=g)
    full = counter_uniform(seeds, req, tok, draw=3)
    perm = torch.randperm(64, generator=g)
    assert torch.equal(counter_uniform(seeds[perm], req[perm], tok[perm], draw=3), full[perm])
    for r in (0, 17, 63):
        alone = counter_uniform(seeds[r], req[r], tok[r], draw=3)
        assert alone.shape == () and alone.item() == full[r].item()
    # Broadcasting a scalar seed matches an explicit per-row seed.
    assert torch.equal(
        counter_uniform(torch.tensor(5), req, tok), counter_uniform(torch.full((64,), 5), req, tok)
    )


# -- sampling distribution ------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1.0, 1.0, -1), (0.7, 1.0, 0), (1.0, 1.0, 3), (1.0, 0.8, -1), (0.7, 0.8, 5), (1.3, 0.9, 4)],
)
def test_sampling_distribution_chi_square(temperature, top_p, top_k):
    n = 20_000
    tokens, logprobs = _draw(LOGITS, n, temperature=temperature, top_p=top_p, top_k=top_k)
    counts = torch.zeros(LOGITS.numel(), dtype=torch.float64).index_add_(
        0, tokens, torch.ones(n, dtype=torch.float64)
    )
    expected = _expected_probs(LOGITS, temperature, top_p, top_k)
    kept = expected > 0
    assert (counts[~kept] == 0).all(), "a filtered-out token was sampled"
    assert kept.sum() >= 2
    exp_counts = expected[kept] * n
    chi2 = ((counts[kept] - exp_counts) ** 2 / exp_counts).sum().item()
    assert chi2 < _chi2_critical(int(kept.sum()) - 1), chi2
    # Returned logprobs are those of the distribution sampled from.
    torch.testing.assert_close(logprobs.double(), expected.log()[tokens], rtol=0, atol=1e-5)


def test_top_p_always_keeps_top_token():
    tokens, logprobs = _draw(LOGITS, 500, temperature=1.0, top_p=1e-6)
    assert (tokens == 7).all() and torch.allclose(logprobs, torch.zeros(500))
    tokens, _ = _draw(LOGITS, 500, temperature=1.0, top_k=1)
    assert (tokens == 7).all()


def test_ties_are_deterministic():
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    tokens, _ = _draw(logits, 200, temperature=1.0, top_k=2)
    assert set(tokens.tolist()) == {1, 2}  # lower index wins ties at the top-k cut
    greedy, _ = sample_tokens(
        logits[None], temperature=0, top_p=1.0, top_k=-1, seed=0, stream=0, token_index=0
    )
    assert greedy.item() == 1


# -- greedy and log-probabilities ---------------------------------------------------------------


def test_greedy_is_argmax_with_untempered_logprob():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = sample_tokens(
        logits,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        seed=torch.tensor(0),
        stream=torch.arange(16),
        token_index=torch.zeros(16, dtype=torch.long),
    )
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(logprobs_of(logits, tokens, temperature=0.0, top_p=0.5, top_k=3), expected)


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, -1), (0.6, 0.9, 20), (1.5, 0.5, 0), (0.0, 1.0, -1)]
)
def test_logprobs_of_matches_sample_tokens(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(32, 100, generator=g) * 3).to(torch.bfloat16)
    kw = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    tokens, logprobs = sample_tokens(
        logits, **kw, seed=torch.tensor(9), stream=torch.arange(32), token_index=torch.arange(32) * 3
    )
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    torch.testing.assert_close(logprobs_of(logits, tokens, **kw), logprobs, rtol=0, atol=1e-6)
    # Training-style [B, T, V] forward: the same values come back per position.
    seq = logits.view(4, 8, 100)
    torch.testing.assert_close(
        logprobs_of(seq, tokens.view(4, 8), **kw), logprobs.view(4, 8), rtol=0, atol=1e-6
    )


def test_logprobs_of_filtered_token_is_neg_inf():
    lp = logprobs_of(LOGITS[None], torch.tensor([4]), temperature=1.0, top_p=1.0, top_k=3)
    assert lp.item() == float("-inf")


# -- seeds and batch composition ----------------------------------------------------------------


def test_samples_independent_of_batch_order_and_seeded():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 200, generator=g)
    req = torch.randint(0, 1000, (64,), generator=g)
    tok = torch.randint(0, 500, (64,), generator=g)
    kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 50}
    tokens, logprobs = sample_tokens(logits, **kw, seed=torch.tensor(11), stream=req, token_index=tok)
    perm = torch.randperm(64, generator=g)
    t2, lp2 = sample_tokens(
        logits[perm], **kw, seed=torch.tensor(11), stream=req[perm], token_index=tok[perm]
    )
    assert torch.equal(t2, tokens[perm]) and torch.equal(lp2, logprobs[perm])
    for r in (0, 31):
        t1, lp1 = sample_tokens(
            logits[r : r + 1],
            **kw,
            seed=torch.tensor(11),
            stream=req[r : r + 1],
            token_index=tok[r : r + 1],
        )
        assert t1.item() == tokens[r].item() and lp1.item() == logprobs[r].item()
    t3, _ = sample_tokens(logits, **kw, seed=torch.tensor(12), stream=req, token_index=tok)
    assert not torch.equal(t3, tokens)


# -- graph capture ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.8, 0.9, 10), (1.0, 1.0, -1), (0.0, 1.0, -1)])
def test_capture_replay_matches_eager(temperature, top_p, top_k):
    b, v = 8, 64
    g = torch.Generator().manual_seed(4)
    kw = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    seed = torch.tensor(42)
    req = torch.arange(b) * 5
    static_logits = torch.randn(b, v, generator=g)
    static_tidx = torch.zeros(b, dtype=torch.long)
    acc = CPUAccelerator()
    graph = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(graph):
        out_tokens, out_lp = sample_tokens(
            static_logits, **kw, seed=seed, stream=req, token_index=static_tidx
        )
    assert graph.num_ops > 0
    seen = set()
    for step in range(6):
        new_logits = torch.randn(b, v, generator=g) * 2
        new_tidx = torch.full((b,), step) + torch.arange(b)
        static_logits.copy_(new_logits)
        static_tidx.copy_(new_tidx)
        acc.replay_graph(graph)
        eager_tokens, eager_lp = sample_tokens(
            new_logits, **kw, seed=seed, stream=req, token_index=new_tidx
        )
        assert torch.equal(out_tokens, eager_tokens)
        assert torch.equal(out_lp, eager_lp)
        seen.add(tuple(out_tokens.tolist()))
    assert len(seen) == 6  # replays really see the new inputs


KNOB_VALUES = [(0.8, 0.9, 10), (1.3, 0.5, 3), (0.5, 0.99, 63), (2.0, 0.9, 200), (0.7, 0.3, 2)]


def test_one_capture_per_sampling_mode_reads_the_knob_values_of_every_replay():
    # Only which filters run is frozen (the mode); the values live in SamplingKnobs, so one graph serves
    # every temperature, top-p and top-k of its mode, and gives what sample_tokens gives with those values.
    b, v = 6, 64
    g = torch.Generator().manual_seed(7)
    seed, req, tidx = torch.tensor(3), torch.arange(b) * 2, torch.arange(b)
    static_logits = torch.randn(b, v, generator=g)
    knobs = SamplingKnobs(torch.device("cpu"))
    knobs.set(*KNOB_VALUES[0])
    rows = torch.zeros(b, dtype=torch.int64)  # every row reads setting 0 of the knob table
    acc = CPUAccelerator()
    graph = acc.create_graph()
    t, p, k = KNOB_VALUES[0]
    with torch.no_grad(), acc.capture_to_graph(graph):
        out_tokens, out_lp = sample_tokens(static_logits, temperature=t, top_p=p, top_k=k, seed=seed,
                                           stream=req, token_index=tidx, knobs=knobs.for_rows(rows))
    logits = torch.randn(b, v, generator=g) * 3
    static_logits.copy_(logits)
    seen = set()
    for t, p, k in KNOB_VALUES:
        assert sampling_mode(t, p, k) == (True, True, True)
        knobs.set(t, p, k)
        acc.replay_graph(graph)
        tokens, lp = sample_tokens(logits, temperature=t, top_p=p, top_k=k, seed=seed, stream=req,
                                   token_index=tidx)  # host values, no knobs: the same numbers
        assert torch.equal(out_tokens, tokens) and torch.equal(out_lp, lp)
        assert torch.equal(lp, logprobs_of(logits, tokens, temperature=t, top_p=p, top_k=k))
        seen.add(tuple(lp.tolist()))
    assert len(seen) == len(KNOB_VALUES)  # every replay read its own values
    assert sampling_mode(0.0, 0.5, 3) == (False, False, False) and sampling_mode(1.0, 1.0, -1) == (True, False, False)


def test_capture_replay_logprobs_of():
    static_logits = torch.randn(4, 6, 32)
    static_tokens = torch.zeros(4, 6, dtype=torch.long)
    kw = {"temperature": 0.7, "top_p": 0.9, "top_k": 8}
    acc = CPUAccelerator()
    graph = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(graph):
        out = logprobs_of(static_logits, static_tokens, **kw)
    new_logits = torch.randn(4, 6, 32)
    new_tokens = new_logits.argmax(-1)
    static_logits.copy_(new_logits)
    static_tokens.copy_(new_tokens)
    acc.replay_graph(graph)
    assert torch.equal(out, logprobs_of(new_logits, new_tokens, **kw))


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,name",
    [
        ((-0.1, 1.0, -1), "temperature"),
        ((float("nan"), 1.0, -1), "temperature"),
        ((1.0, 0.0, -1), "top_p"),
        ((1.0, 1.5, -1), "top_p"),
        ((1.0, float("nan"), -1), "top_p"),
        ((1.0, 1.0, -2), "top_k"),
        ((1.0, 1.0, 2.5), "top_k"),
    ],
)
def test_validation_value_errors(args, name):
    with pytest.raises(ValueError, match=name):
        validate_sampling(*args)
    with pytest.raises(ValueError, match=name):
        sample_tokens(
            LOGITS[None],
            temperature=args[0],
            top_p=args[1],
            top_k=args[2],
            seed=0,
            stream=0,
            token_index=0,
        )


@pytest.mark.parametrize("args", [("1.0", 1.0, -1), (1.0, None, -1), (1.0, 1.0, "3"), (1.0, 1.0, True)])
def test_validation_type_errors(args):
    with pytest.raises(TypeError):
        validate_sampling(*args)


def test_validation_accepts_valid():
    validate_sampling(0, 1, -1)
    validate_sampling(0.5, 0.01, 0)
    validate_sampling(2.0, 1.0, 100)


@pytest.mark.parametrize("top_p,top_k", [(1.0, -1), (0.9, 5)])
def test_non_finite_logits_sample_an_index_in_range_with_a_nan_logprob(top_p, top_k):
    """A diverged model's NaN logits kept no token, and the sampler gathered index -1: an IndexError here, a
    device-side assert (a CUDA context lost) on a GPU. It picks a token in range now, and its NaN logprob says
    what happened."""
    logits = torch.full((3, 16), float("nan"))
    logits[1] = torch.arange(16.0)  # a healthy row in the same batch is sampled as ever
    tokens, logprobs = sample_tokens(logits, temperature=1.0, top_p=top_p, top_k=top_k, seed=torch.tensor(7),
                                     stream=torch.arange(3), token_index=torch.zeros(3, dtype=torch.int64))
    assert ((tokens >= 0) & (tokens < 16)).all()
    assert torch.isnan(logprobs[0]) and torch.isnan(logprobs[2]) and torch.isfinite(logprobs[1])
