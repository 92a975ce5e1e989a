"""``hybrid_engine::sample_rows``: the reference is today's sampler bit for bit (mixed settings, EOS suppression,
the full-logprob flag), the counter hash is splitmix64's (pinned against Python integers), the op is one node of
a captured CPU graph that replays as eager, and the sort-free Triton kernel under ``TRITON_INTERPRET=1`` computes
the same uniform bits and draws each token as the inverse CDF of the exact filtered distribution at that uniform
(skipped where Triton is not installed: ``pip install 'hybrid-engine[dev]'``)."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.decode.ops import sampler as so
from hybrid_engine.decode.sampling import SamplingKnobs, counter_uniform, sample_tokens, union_mode
from hybrid_engine.decode.slots import choose_tokens

op = torch.ops.hybrid_engine.sample_rows
M64 = (1 << 64) - 1


def _splitmix_uniform(seed: int, stream: int, index: int, draw: int, bits: int) -> float:
    """The counter hash written with Python integers: two splitmix64 finaliser rounds."""
    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
        return x ^ (x >> 31)

    h = mix((seed + 0x5851F42D4C957F2D + draw * 0x9E3779B97F4A7C15) & M64)
    h = mix((h + stream * 0xD6E8FEB86659FD93 + index * 0x9E3779B97F4A7C15) & M64)
    return (h >> (64 - bits)) / 2.0**bits


def test_counter_uniform_is_splitmix64_of_the_counters():
    g = torch.Generator().manual_seed(5)
    seed = torch.randint(-2**63, 2**63 - 1, (64,), generator=g)
    stream = torch.randint(-2**40, 2**40, (64,), generator=g)
    index = torch.randint(0, 2**32, (64,), generator=g)
    for draw in (0, 3):
        for dtype, bits in ((torch.float32, 24), (torch.float64, 53)):
            got = counter_uniform(seed, stream, index, draw, dtype=dtype).tolist()
            want = [_splitmix_uniform(int(s) & M64, int(r) & M64, int(t), draw, bits)
                    for s, r, t in zip(seed, stream, index)]
            assert got == want, (draw, dtype)


# (temperature, top_p, top_k): every filter combination, a greedy row among sampled ones, a no-filter row
SETTINGS = [(1.0, 1.0, -1), (0.7, 0.8, -1), (1.3, 1.0, 5), (0.9, 0.6, 8), (0.0, 1.0, -1), (0.5, 0.95, 40)]


def _mixed_call(settings, rows=48, vocab=40, seed=3, logprobs="sampling"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(torch.bfloat16)
    knobs = SamplingKnobs(torch.device("cpu"))
    knobs.set_table(settings, logprobs)
    which = torch.arange(rows) % len(settings)
    eos_mask = torch.zeros(vocab, dtype=torch.bool)
    eos_mask[logits.float().argmax(-1)[:4]] = True  # the best tokens of a few rows are EOS ids
    suppress = torch.arange(rows) % 3 == 0
    counters = torch.tensor(11), torch.arange(rows) * 7, torch.arange(rows) % 5
    return logits, knobs, which, eos_mask, suppress, counters


@pytest.mark.parametrize("settings", [SETTINGS, SETTINGS[:1], SETTINGS[1:2], SETTINGS[2:3]])
@pytest.mark.parametrize("logprobs", ["sampling", "full"])
def test_the_reference_op_is_todays_sampler_bit_for_bit(settings, logprobs):
    """Each row as a call of its own setting with host values (today's aten path, EOS masked first) gives the bits
    the op gives for it in one mixed call."""
    logits, knobs, which, eos_mask, suppress, (seed, stream, index) = _mixed_call(settings, logprobs=logprobs)
    key = union_mode(settings)
    tokens, chosen, _, _ = choose_tokens(logits, key, eos_mask=eos_mask, suppress_eos=suppress, seed=seed,
                                         stream=stream, token_index=index, knobs=knobs.for_rows(which, key))
    masked = logits.masked_fill(suppress[:, None] & eos_mask, float("-inf"))
    for i, (t, p, k) in enumerate(settings):
        rows = which == i
        if t == 0:  # greedy among sampled rows: the top-1 pick, its logprob under the full softmax
            want = sample_tokens(masked[rows], temperature=0.0, seed=seed, stream=stream[rows], token_index=0)
        else:
            want = sample_tokens(masked[rows], temperature=t, top_p=p, top_k=k, seed=seed, stream=stream[rows],
                                 token_index=index[rows], logprobs=logprobs)
        assert torch.equal(tokens[rows], want[0]) and torch.equal(chosen[rows], want[1]), (t, p, k)


def test_counter_uniform_and_the_decode_pick_cost_few_ops():
    from hybrid_engine.benchmarks.kernels import Counter

    counters = torch.full((4,), 3), torch.arange(4), torch.arange(4)
    with Counter() as ops:
        counter_uniform(*counters)
    assert len(ops.ops) <= 26  # two splitmix64 rounds with the constants folded (31 before)
    logits, knobs, which, eos_mask, suppress, (seed, stream, index) = _mixed_call(SETTINGS)
    key = union_mode(SETTINGS)
    with torch.no_grad(), Counter() as ops:
        choose_tokens(logits, key, eos_mask=eos_mask, suppress_eos=suppress, seed=seed, stream=stream,
                      token_index=index, knobs=knobs.for_rows(which, key))
    assert [o[2] for o in ops.ops] == ["hybrid_engine::sample_rows"]  # EOS, knob gathers, filters, pick: one op


def test_the_op_is_one_node_of_a_captured_cpu_graph_and_replays_as_eager():
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    logits, knobs, which, eos_mask, suppress, (seed, stream, index) = _mixed_call(SETTINGS)
    key = union_mode(SETTINGS)
    out = {}

    def step():
        out["o"] = choose_tokens(logits, key, eos_mask=eos_mask, suppress_eos=suppress, seed=seed, stream=stream,
                                 token_index=index, knobs=knobs.for_rows(which, key), checked=True)

    step()
    graph = CPUGraph()
    with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(graph):
        step()
    alone = CPUGraph()
    tables = knobs.inv_temperature, knobs.top_p, knobs.top_k, knobs.full
    with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(alone):
        op(logits, eos_mask, suppress, which, *tables, seed, stream, index, True, True)
    assert alone.num_ops == 1
    g = torch.Generator().manual_seed(9)
    seen = set()
    for _ in range(3):
        logits.copy_(torch.randn(logits.shape, generator=g) * 2)
        index.add_(1)
        suppress.copy_(torch.rand(suppress.shape, generator=g) < 0.5)
        knobs.set_table([(t * 1.1, p, k) for t, p, k in SETTINGS])
        graph.replay()
        eager = choose_tokens(logits, key, eos_mask=eos_mask, suppress_eos=suppress, seed=seed, stream=stream,
                              token_index=index, knobs=knobs.for_rows(which, key))
        assert torch.equal(out["o"][0], eager[0]) and torch.equal(out["o"][1], eager[1])
        seen.add(tuple(eager[0].tolist()))
    assert len(seen) == 3  # the replays read the new inputs


def test_cpu_without_the_interpreter_runs_the_reference(monkeypatch):
    from hybrid_engine.decode import sampling

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    so._probe.cache_clear()
    so._kernel.cache_clear()
    try:
        assert so.implementation("cpu") == "reference"
        assert sampling.IMPLEMENTATION.startswith("hybrid_engine::sample_rows, reference")
    finally:
        so._probe.cache_clear()
        so._kernel.cache_clear()


def test_the_exact_mode_keeps_the_reference_where_a_kernel_runs(monkeypatch):
    """Exact-mode calls report the training forward's ``log_softmax`` bits, so their pick stays on the reference
    even on a device whose probe chose the kernel. Mocked hardware boundary: the probe says "triton" and the
    kernel records that it ran (returning the reference's result)."""
    ran = []

    def kernel(*args):
        ran.append(True)
        return so.reference_sample_rows(*args)

    monkeypatch.setattr(so, "_probe", lambda device: "triton")
    monkeypatch.setattr(so, "_triton_sample_rows", kernel)
    logits, knobs, which, eos_mask, suppress, (seed, stream, index) = _mixed_call(SETTINGS)
    key = union_mode(SETTINGS)
    for exact in (True, False):
        knobs.exact = exact
        choose_tokens(logits, key, eos_mask=eos_mask, suppress_eos=suppress, seed=seed, stream=stream,
                      token_index=index, knobs=knobs.for_rows(which, key))
        assert ran == ([] if exact else [True])


def test_bad_shapes_are_named():
    logits, knobs, which, eos_mask, suppress, (seed, stream, index) = _mixed_call(SETTINGS)
    tables = knobs.inv_temperature, knobs.top_p, knobs.top_k, knobs.full
    with pytest.raises(ValueError, match="logits must be"):
        op(logits[0], eos_mask, suppress, which, *tables, seed, stream, index, True, True)
    with pytest.raises(ValueError, match="knob must be"):
        op(logits, eos_mask, suppress, which[:3], *tables, seed, stream, index, True, True)
    with pytest.raises(ValueError, match="together"):
        op(logits, eos_mask, None, which, *tables, seed, stream, index, True, True)
    with pytest.raises(ValueError, match="eos_mask must be"):
        op(logits, eos_mask[:5], suppress, which, *tables, seed, stream, index, True, True)


_KERNEL_CHECK = r"""
import math, sys, torch
sys.path.insert(0, {tests!r})
from test_sampling import _chi2_critical, _expected_probs
from hybrid_engine.decode.ops import sampler as so
from hybrid_engine.decode.sampling import SamplingKnobs, counter_uniform
assert so.implementation("cpu") == "triton", "the probe did not choose the kernel"

# 1. The in-kernel uniform has counter_uniform's bits.
g = torch.Generator().manual_seed(0)
n = 300
seed = torch.randint(-2**63, 2**63 - 1, (n,), generator=g)
stream = torch.randint(-2**40, 2**40, (n,), generator=g)
index = torch.randint(0, 2**32, (n,), generator=g)
out = torch.empty(n)
so._kernel()._uniform_kernel[(2,)](seed, stream, index, out, n, K0=so.seed_lane(0), BLOCK=256)
assert torch.equal(out, counter_uniform(seed, stream, index)), "in-kernel uniform differs"

def launch(logits, settings, which, index, modes, eos=None, suppress=None, logprobs="sampling"):
    knobs = SamplingKnobs(torch.device("cpu"))
    knobs.set_table(settings, logprobs)
    return so._triton_sample_rows(logits, eos, suppress, which, knobs.inv_temperature, knobs.top_p, knobs.top_k,
                                  knobs.full, torch.tensor(5), torch.tensor(0), index, *modes)

def check_inverse_cdf(logits, settings, which, index, tokens, lp, logprobs="sampling"):
    # Each token is the inverse CDF (vocabulary order) of the exact filtered distribution at its uniform.
    u = counter_uniform(torch.tensor(5), torch.tensor(0), index).double()
    for b in range(len(tokens)):
        t, p, k = settings[int(which[b])]
        q = _expected_probs(logits[b].float(), t, p, k)
        cdf = torch.cumsum(q, 0)
        tok = int(tokens[b])
        lo = float(cdf[tok - 1]) if tok else 0.0
        assert q[tok] > 0 and lo - 1e-5 <= float(u[b]) <= float(cdf[tok]) + 1e-5, (b, tok, float(u[b]), lo)
        want = torch.log_softmax(logits[b].double() / t, -1)[tok] if logprobs == "full" else math.log(q[tok])
        assert abs(float(lp[b]) - float(want)) <= 1e-5, (b, float(lp[b]), float(want))

# 2. Chi-square and exact inverse CDF over many draws of one row: temperature, top-k, top-p, top-k + top-p.
vocab = 50
row = torch.full((vocab,), -3.0)
row[[3, 11, 17, 29, 40, 47]] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, 3.0])
settings = [(0.8, 1.0, -1), (1.0, 1.0, 3), (1.0, 0.8, -1), (0.7, 0.9, 4)]
draws = {draws}
which = torch.arange(len(settings)).repeat_interleave(draws)
index = torch.arange(len(which))
logits = row.expand(len(which), -1).contiguous()
tokens, lp = launch(logits, settings, which, index, (True, True))
check_inverse_cdf(logits, settings, which, index, tokens, lp)
for i, (t, p, k) in enumerate(settings):
    got = torch.bincount(tokens[which == i], minlength=vocab).double()
    q = _expected_probs(row, t, p, k)
    assert (got[q == 0] == 0).all(), "a filtered-out token was sampled"
    big = q * draws >= 5
    exp = torch.cat([q[big] * draws, (q[~big] * draws).sum()[None]])
    obs = torch.cat([got[big], got[~big].sum()[None]])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert chi2 < _chi2_critical(int(keep.sum()) - 1), (t, p, k, chi2)

# 3. Random rows, mixed settings, EOS suppression, the full-logprob flag: the exact inverse CDF again.
mixed = [(1.0, 1.0, -1), (0.7, 0.8, -1), (1.3, 1.0, 5), (0.9, 0.6, 8), (0.5, 0.95, 40)]
rows = 25
logits = (torch.randn(rows, 37, generator=g) * 2).to(torch.bfloat16)
which = torch.arange(rows) % len(mixed)
index = torch.arange(rows)
eos = torch.zeros(37, dtype=torch.bool)
eos[logits.float().argmax(-1)[:6]] = True
suppress = torch.arange(rows) % 2 == 0
masked = logits.float().masked_fill(suppress[:, None] & eos, float("-inf"))
got = {{}}
for logprobs in ("sampling", "full"):
    got[logprobs] = launch(logits, mixed, which, index, (True, True), eos, suppress, logprobs)
    check_inverse_cdf(masked, mixed, which, index, *got[logprobs], logprobs)
assert torch.equal(got["sampling"][0], got["full"][0])  # the flag changes the logprob, not the token

# 4. A row whose knobs filter nothing picks as the temperature-only launch does, bit for bit.
plain = which == 0
alone = launch(logits[plain], mixed, which[plain], index[plain], (False, False), eos, suppress[plain])
assert torch.equal(got["sampling"][0][plain], alone[0]) and torch.equal(got["sampling"][1][plain], alone[1])

# 5. Ties rank by vocabulary index at the top-k and the top-p cut.
tie = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0])
logits = tie.expand(36, -1).contiguous()
which = torch.arange(36) % 3
index = torch.arange(36)
ties = [(1.0, 1.0, 2), (1.0, 0.4, -1), (1.0, 0.9, 3)]  # top-p 0.9 within top-3: the tie at index 5 stays out
tokens, lp = launch(logits, ties, which, index, (True, True))
assert set(tokens[which == 0].tolist()) == {{1, 2}} and set(tokens[which == 1].tolist()) == {{1, 2}}
assert set(tokens[which == 2].tolist()) == {{1, 2, 3}}
check_inverse_cdf(logits, ties, which, index, tokens, lp)

# 6. Non-finite logits: an index in range and a NaN logprob; a healthy row in the same launch as ever.
bad = torch.full((4, 16), float("nan"))
bad[1] = torch.arange(16.0)
bad[2] = float("-inf")
bad[3, 5] = float("inf")
for modes in ((True, True), (False, False)):
    tokens, lp = launch(bad, [(1.0, 0.9, 5)], torch.zeros(4, dtype=torch.long), torch.arange(4), modes)
    assert ((tokens >= 0) & (tokens < 16)).all(), tokens
    assert torch.isnan(lp[[0, 2]]).all() and torch.isfinite(lp[1]), lp
print("kernel ok")
"""


@pytest.mark.slow  # a process of its own, and the interpreter runs each program in Python (tests/tiers.py)
def test_triton_kernel_draws_the_reference_distribution_under_the_interpreter():
    """In a process of its own: Triton reads ``TRITON_INTERPRET`` when it is imported."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _KERNEL_CHECK.format(tests=str(pathlib.Path(__file__).parent), draws=60)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]
