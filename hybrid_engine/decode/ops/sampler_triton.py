"""The Triton kernel behind ``hybrid_engine::sample_rows`` (imported lazily: only where Triton is installed).

One program per row, no sort and no per-row temporaries in memory: every step is a pass over the row's logits.

* The uniform is computed in the kernel from the row's counters with :func:`counter_uniform`'s splitmix64
  constants, in uint64 arithmetic (which wraps as the int64 reference does): the same bits.
* Pass 1: an online max and sum of the tempered softmax (``x = logit * inv_t``, EOS at ``-inf`` where the row
  suppresses it), and the range of the values' order keys (a float's bits mapped to an integer of the same order).
* top-k: a bucketed search over the keys for the k-th largest value (each pass counts the keys at or above ``NB``
  pivots spread over the current range and keeps the bucket the cut lies in, its bounds snapped to the nearest
  keys present, so it ends when they meet: about log_NB of the vocabulary passes): the kept set is every value
  above the cut and the first ``k - count above`` of the values equal to it, in vocabulary order (the
  reference's stable sort).
* top-p: the same search over the keys at or above the top-k cut for the smallest value whose mass above it is
  under ``p`` times the top-k mass (the reference's "mass before a position is under p"); ties at the cut are kept
  in vocabulary order while the mass before them stays under that.
* Then one pass for the kept mass and one for the pick: the first position, in vocabulary order, whose running
  kept mass exceeds ``u * total`` (the reference's inverse CDF), capped at the last kept token. A row whose own
  knobs filter nothing takes the temperature-only sums, so it picks what a temperature-only launch picks.

The logprob is ``x - max - log(total)`` under the kept set (or the full softmax where the row's ``full`` flag is
set). Non-finite logits give position 0 or a finite-mass position and a NaN logprob, never an index out of range.
"""

from __future__ import annotations

import triton
import triton.language as tl

_MUL1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MUL2 = tl.constexpr(0x94D049BB133111EB)
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_STREAM = tl.constexpr(0xD6E8FEB86659FD93)
_INF = tl.constexpr(float("inf"))
_KEY_LOW = tl.constexpr(-(2**40))  # below every key
_KEY_HIGH = tl.constexpr(2**40)  # above every key


@triton.jit
def counter_uniform_at(seed, stream, index, K0: tl.constexpr):
    """:func:`~hybrid_engine.decode.ops.sampler.counter_uniform`'s float32 value for int64 counters; ``K0`` is
    its seed-lane constant for the draw (``_DOMAIN + draw * _GOLDEN`` modulo 2**64)."""
    s = seed.to(tl.uint64, bitcast=True)
    r = stream.to(tl.uint64, bitcast=True)
    t = index.to(tl.uint64, bitcast=True)
    h = s + K0
    for i in tl.static_range(2):  # two rounds of splitmix64's finaliser (wrapping multiplies, logical shifts)
        if i == 1:
            h = h + r * _STREAM + t * _GOLDEN
        h = (h ^ (h >> 30)) * _MUL1
        h = (h ^ (h >> 27)) * _MUL2
        h = h ^ (h >> 31)
    return (h >> 40).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _uniform_kernel(seed_ptr, stream_ptr, index_ptr, out_ptr, n, K0: tl.constexpr, BLOCK: tl.constexpr):
    """The in-kernel uniform alone, for the test that compares its bits with the reference's."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    u = counter_uniform_at(tl.load(seed_ptr + i, mask=ok, other=0), tl.load(stream_ptr + i, mask=ok, other=0),
                           tl.load(index_ptr + i, mask=ok, other=0), K0)
    tl.store(out_ptr + i, u, mask=ok)


@triton.jit
def _values(base, eos_ptr, idx, V, inv_t, suppress, HAS_EOS: tl.constexpr):
    """``(x, key, valid)`` of one block: the tempered logits (``-inf`` for a suppressed EOS and past the row), their
    order keys (int64; -0 is +0) and which positions are in the row."""
    valid = idx < V
    x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
    if HAS_EOS:
        eos = tl.load(eos_ptr + idx, mask=valid, other=0) != 0
        x = tl.where(eos & suppress, -_INF, x)
    x = tl.where(x == 0.0, 0.0, x)  # -0 compares equal to +0: one key for both
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return x, key, valid


@triton.jit
def _value_of(key):
    """The float32 whose order key is ``key``."""
    k = key.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _softmax_pass(base, eos_ptr, V, inv_t, suppress, HAS_EOS: tl.constexpr, KEYS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Pass 1: ``(max, sum of exp(x - max), smallest key, largest key)`` of the row (the keys with ``KEYS``)."""
    offs = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    lo = tl.max(tl.full([BLOCK], _KEY_HIGH, tl.int64), 0)
    hi = tl.max(tl.full([BLOCK], _KEY_LOW, tl.int64), 0)
    for start in range(0, V, BLOCK):
        x, key, valid = _values(base, eos_ptr, start + offs, V, inv_t, suppress, HAS_EOS)
        new_m = tl.maximum(m, tl.max(x, 0))
        safe = tl.where(new_m == -_INF, 0.0, new_m)
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), 0)
        m = new_m
        if KEYS:
            lo = tl.minimum(lo, tl.min(tl.where(valid, key, _KEY_HIGH), 0))
            hi = tl.maximum(hi, tl.max(tl.where(valid, key, _KEY_LOW), 0))
    return m, s, lo, hi


@triton.jit
def _top_k_cut(base, eos_ptr, V, inv_t, suppress, m, lo, hi, k, HAS_EOS: tl.constexpr, NB: tl.constexpr,
               BLOCK: tl.constexpr):
    """``(cut key, ties kept at it, mass above it)`` of the row's top ``k``: the largest key with at least ``k``
    keys at or above it. Each pass counts the keys at or above ``NB`` pivots spread over ``[lo, hi]`` and keeps
    the bucket the cut lies in, its bounds snapped to the keys present: it ends when they meet."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, NB)
    above = k * 0  # keys above hi (int64)
    mass = m * 0.0  # their mass
    while lo < hi:
        piv = lo + (j * (hi - lo + 1)) // NB  # piv[0] == lo: at least k keys at or above it
        count = tl.zeros([NB], tl.int64)
        part = tl.zeros([NB], tl.float32)
        up = tl.full([NB], _KEY_HIGH, tl.int64)  # the smallest key at or above each pivot
        down = tl.full([NB], _KEY_LOW, tl.int64)  # the largest key below each pivot
        for start in range(0, V, BLOCK):
            x, key, valid = _values(base, eos_ptr, start + offs, V, inv_t, suppress, HAS_EOS)
            at = valid[:, None] & (key[:, None] >= piv[None, :])
            count += tl.sum(at.to(tl.int64), 0)
            part += tl.sum(tl.where(at, tl.exp(x - m)[:, None], 0.0), 0)
            up = tl.minimum(up, tl.min(tl.where(at, key[:, None], _KEY_HIGH), 0))
            down = tl.maximum(down, tl.max(tl.where(valid[:, None] & ~at, key[:, None], _KEY_LOW), 0))
        best = tl.sum((count >= k).to(tl.int32), 0) - 1  # the last pivot with k keys at or above (a prefix)
        lo = tl.sum(tl.where(j == best, up, 0), 0)
        nxt = j == best + 1  # none where best is the last pivot: hi stays
        moved = best < NB - 1
        hi = tl.where(moved, tl.sum(tl.where(nxt, down, 0), 0), hi)
        above = tl.where(moved, tl.sum(tl.where(nxt, count, 0), 0), above)
        mass = tl.where(moved, tl.sum(tl.where(nxt, part, 0.0), 0), mass)
    return lo, k - above, mass


@triton.jit
def _top_p_cut(base, eos_ptr, V, inv_t, suppress, m, lo, hi, target, HAS_EOS: tl.constexpr, NB: tl.constexpr,
               BLOCK: tl.constexpr):
    """``(cut key, mass above it)``: the smallest key in ``[lo, hi]`` whose mass above is under ``target``, by
    the same bucketed search (the mass above a pivot falls as the pivot rises)."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, NB)
    mass = m * 0.0  # mass above hi
    while lo < hi:
        piv = lo + (j * (hi - lo + 1)) // NB
        part = tl.zeros([NB], tl.float32)
        up = tl.full([NB], _KEY_HIGH, tl.int64)  # the smallest key above each pivot
        down = tl.full([NB], _KEY_LOW, tl.int64)  # the largest key at or below each pivot
        for start in range(0, V, BLOCK):
            x, key, valid = _values(base, eos_ptr, start + offs, V, inv_t, suppress, HAS_EOS)
            over = valid[:, None] & (key[:, None] > piv[None, :])
            part += tl.sum(tl.where(over, tl.exp(x - m)[:, None], 0.0), 0)
            up = tl.minimum(up, tl.min(tl.where(over, key[:, None], _KEY_HIGH), 0))
            down = tl.maximum(down, tl.max(tl.where(valid[:, None] & ~over, key[:, None], _KEY_LOW), 0))
        first = tl.sum((part >= target).to(tl.int32), 0)  # the first pivot with mass above under target
        found = first < NB
        hi = tl.where(found, tl.sum(tl.where(j == first, down, 0), 0), hi)
        mass = tl.where(found, tl.sum(tl.where(j == first, part, 0.0), 0), mass)
        lo = tl.where(first > 0, tl.sum(tl.where(j == first - 1, up, 0), 0), lo)
    return lo, mass


@triton.jit
def _kept(key, valid, cut, ties, seen):
    """Which positions of a block are kept: keys above ``cut``, and the first ``ties`` keys equal to it in
    vocabulary order (``seen`` of them came in earlier blocks); with the block's tie count."""
    tie = valid & (key == cut)
    t = tie.to(tl.int64)
    rank = seen + tl.cumsum(t, 0) - t
    return (valid & (key > cut)) | (tie & (rank < ties)), tl.sum(t, 0)


@triton.jit
def _kept_mass(base, eos_ptr, V, inv_t, suppress, m, cut, ties, HAS_EOS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    total = m * 0.0
    seen = ties * 0
    for start in range(0, V, BLOCK):
        x, key, valid = _values(base, eos_ptr, start + offs, V, inv_t, suppress, HAS_EOS)
        kept, n = _kept(key, valid, cut, ties, seen)
        seen += n
        total += tl.sum(tl.where(kept, tl.exp(x - m), 0.0), 0)
    return total


@triton.jit
def _pick(base, eos_ptr, V, inv_t, suppress, m, target, cut, ties, filtered, HAS_EOS: tl.constexpr,
          BLOCK: tl.constexpr):
    """The first kept position whose running kept mass (vocabulary order) exceeds ``target``, else the last kept
    position with mass (``target`` rounded up to the total), else 0 (no finite mass). Stops at the block of the
    first."""
    offs = tl.arange(0, BLOCK)
    carry = m * 0.0
    seen = ties * 0
    first = ties * 0 + V
    last = ties * 0 - 1
    start = first * 0
    while (start < V) & (first == V):
        idx = start + offs
        start += BLOCK
        x, key, valid = _values(base, eos_ptr, idx, V, inv_t, suppress, HAS_EOS)
        kept, n = _kept(key, valid, cut, ties, seen)
        seen += n
        e = tl.where(kept | (valid & (filtered == 0)), tl.exp(x - m), 0.0)
        cdf = carry + tl.cumsum(e, 0)
        first = tl.minimum(first, tl.min(tl.where((cdf > target) & (e > 0.0), idx, V), 0).to(tl.int64))
        last = tl.maximum(last, tl.max(tl.where(e > 0.0, idx, -1), 0).to(tl.int64))
        carry += tl.sum(e, 0)
    return tl.maximum(tl.where(first < V, first, last), 0)


@triton.jit
def _cuts(base, eos_ptr, V, inv_t, suppress, m, s, lo, hi, k, p, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
          HAS_EOS: tl.constexpr, NB: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """``(cut key, ties kept at it, filtered)`` for the row's top-k then top-p (``filtered`` 0: keeps all)."""
    cut = lo
    ties = k * 0 + V
    mass = s
    on_k = k < 0  # knob values are positive: False
    on_p = k < 0
    if TOP_K:
        on_k = k < V
        cut, ties, above = _top_k_cut(base, eos_ptr, V, inv_t, suppress, m, lo, tl.where(on_k, hi, lo), k,
                                      HAS_EOS, NB, SEARCH_BLOCK)
        ties = tl.where(on_k, ties, V)
        mass = tl.where(on_k, above + ties.to(tl.float32) * tl.exp(_value_of(cut) - m), s)
    if TOP_P:
        on_p = p <= 1.0
        target = p * mass
        cut_p, above_p = _top_p_cut(base, eos_ptr, V, inv_t, suppress, m, cut, tl.where(on_p, hi, cut), target,
                                    HAS_EOS, NB, SEARCH_BLOCK)
        e = tl.exp(_value_of(cut_p) - m)
        room = tl.where(e > 0.0, tl.ceil((target - above_p) / e), V * 1.0)
        room = tl.where(room < V, room, V * 1.0).to(tl.int64)  # NaN and past the row: every tie
        ties_p = tl.where(cut_p == cut, tl.minimum(ties, room), room)
        cut = tl.where(on_p, cut_p, cut)
        ties = tl.where(on_p, ties_p, ties)
    return cut, ties, (on_k | on_p).to(tl.int32)


@triton.jit
def sample_kernel(logits_ptr, row_stride, eos_ptr, suppress_ptr, knob_ptr, inv_t_ptr, top_p_ptr, top_k_ptr,
                  full_ptr, seed_ptr, seed_stride, stream_ptr, stream_stride, index_ptr, index_stride, tokens_ptr,
                  logprob_ptr, V, K0: tl.constexpr, HAS_EOS: tl.constexpr, TOP_K: tl.constexpr,
                  TOP_P: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * row_stride
    knob = tl.load(knob_ptr + row)
    inv_t = tl.load(inv_t_ptr + knob)
    suppress = (tl.load(suppress_ptr + row) != 0) if HAS_EOS else False
    u = counter_uniform_at(tl.load(seed_ptr + row * seed_stride), tl.load(stream_ptr + row * stream_stride),
                           tl.load(index_ptr + row * index_stride), K0)
    m, s, lo, hi = _softmax_pass(base, eos_ptr, V, inv_t, suppress, HAS_EOS, TOP_K or TOP_P, BLOCK)
    total = s
    cut = lo
    ties = lo * 0 + V
    filtered = row * 0
    full = row * 0
    if TOP_K or TOP_P:
        k = tl.load(top_k_ptr + knob)
        p = tl.load(top_p_ptr + knob)
        full = tl.load(full_ptr + knob).to(tl.int32)
        cut, ties, filtered = _cuts(base, eos_ptr, V, inv_t, suppress, m, s, lo, hi, k, p, TOP_K, TOP_P, HAS_EOS,
                                    NB, SEARCH_BLOCK)
        kept = _kept_mass(base, eos_ptr, V, inv_t, suppress, m, cut, ties, HAS_EOS, BLOCK)
        total = tl.where(filtered != 0, kept, s)
    pos = _pick(base, eos_ptr, V, inv_t, suppress, m, u * total, cut, ties, filtered, HAS_EOS, BLOCK)
    x, _, _ = _values(base, eos_ptr, pos, V, inv_t, suppress, HAS_EOS)
    lp = x - m - tl.log(tl.where(full != 0, s, total))
    lp = tl.where(s == s, lp, s)  # a NaN row says so
    tl.store(tokens_ptr + row, pos)
    tl.store(logprob_ptr + row, lp)
