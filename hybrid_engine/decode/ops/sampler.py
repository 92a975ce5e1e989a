"""``hybrid_engine::sample_rows``: a decode step's sampled pick (temperature, top-k, top-p) as one op.

Why one op: in aten ops the pick costs ~70 kernels a step with top-p (26 of them hash the counters into one
uniform per row, and top-k / top-p sort the whole vocabulary). Behind one op it is one node in a captured graph
and one kernel in ``hybrid-engine bench kernels``, and an accelerator runs a kernel that sorts nothing.

The contract every implementation keeps (what :mod:`hybrid_engine.decode.sampling` promises): a row's token
depends only on the seed, its request's counters ``(stream, token_index)`` and its logits; it is drawn from the
tempered softmax restricted by top-k then top-p (ties ranked by vocabulary index, the lower first) by an
inverse CDF in vocabulary order at the counter uniform :func:`counter_uniform`; its logprob is the one
``logprobs_of`` recomputes. Implementations, chosen per device by a capability probe (:func:`implementation`):

* the reference (:func:`reference_sample_rows`): the aten ops the sampler always ran (one stable sort for the
  filters), so CPU tokens keep their bits;
* the Triton kernel (:mod:`hybrid_engine.decode.ops.sampler_triton`): one program per row, the same uniform's
  bits computed in the kernel, the filters' kept set found by bisection over the logit values: the same
  distribution, though not the same token for every seed (its sums round differently). Under
  ``TRITON_INTERPRET=1`` it runs on the CPU too: how CPU CI tests it.

The knob values arrive as the :class:`~hybrid_engine.decode.sampling.SamplingKnobs` tables and each row's index
into them (the op gathers, so a step spends no kernel on it); which filters run (``top_k_on``, ``top_p_on``) is
frozen by a capture, as the sampling mode is.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from hybrid_engine.decode.ops.define import define_op
from hybrid_engine.decode.ops.probe import failure, probe_device, refuse_while_capturing, warn_fallback

__all__ = ["SAMPLING_DRAW", "as_counter", "counter_uniform", "describe", "filtered_logprobs", "implementation",
           "inverse_cdf", "reference_sample_rows", "sample_rows", "seed_lane"]

#: ``draw`` of :func:`counter_uniform` used for the one uniform per sampled token.
SAMPLING_DRAW = 0

_MASK64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """A 64-bit constant as the signed value an int64 tensor holds."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MUL1 = _s64(0xBF58476D1CE4E5B9)
_MUL2 = _s64(0x94D049BB133111EB)
_DOMAIN = _s64(0x5851F42D4C957F2D)  # separates the seed lane from the counters
_STREAM = _s64(0xD6E8FEB86659FD93)  # odd: a stream's multiple in the counter word


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic, so mask the sign fill)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _premix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser without its last xor-shift; int64 multiply wraps modulo 2**64, as intended."""
    x = (x ^ _shr(x, 30)) * _MUL1
    return (x ^ _shr(x, 27)) * _MUL2


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = _premix(x)
    return x ^ _shr(x, 31)


def as_counter(x: torch.Tensor | int, like: torch.Tensor | None) -> torch.Tensor:
    """A counter as an int64 tensor on ``like``'s device."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64)
    # A Python int is a host value: a device fill (not torch.tensor, a host-to-device copy that
    # capture forbids), so it is legal while capturing and frozen into the graph.
    return torch.full((), int(x), dtype=torch.int64, device=None if like is None else like.device)


def seed_lane(draw: int) -> int:
    """The constant the seed is offset by before its round, for ``draw`` (as an unsigned 64-bit value)."""
    return (_DOMAIN + int(draw) * _GOLDEN) & _MASK64


def counter_uniform(
    seed: torch.Tensor | int,
    stream: torch.Tensor | int,
    token_index: torch.Tensor | int,
    draw: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniform floats in ``[0, 1)`` that are a pure function of integer counters.

    ``seed``, ``stream`` (the request's sampler stream) and ``token_index`` are int64 tensors (scalars or
    any broadcastable shapes; the result has their broadcast shape). ``draw``
    selects an independent draw for the same counters (e.g. ``draw=1`` for a
    second uniform per token). With ``dtype=torch.float32`` the result carries
    24 random bits (every value is exactly ``k / 2**24``); with
    ``torch.float64`` it carries 53.

    Python ints are accepted for the counters but, like any host value, are
    frozen into a captured graph; pass tensors for anything that changes
    between replays.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"counter_uniform: dtype must be float32 or float64, got {dtype}")
    if not isinstance(draw, numbers.Integral) or isinstance(draw, bool):
        raise TypeError(f"counter_uniform: draw must be an int, got {type(draw).__name__}")
    like = next((t for t in (seed, stream, token_index) if isinstance(t, torch.Tensor)), None)
    s, r, t = torch.broadcast_tensors(
        as_counter(seed, like), as_counter(stream, like), as_counter(token_index, like)
    )
    # Two splitmix64 rounds (26 ops on [B]): the seed (with the draw folded into its constant) is mixed into a
    # pseudo-random key, then the key absorbs stream and token index as one word (``add`` with ``alpha``: one
    # multiply-add each, wrapping as the separate ops did). The word is injective for streams apart by under
    # ~2**31 and token indices under 2**32 (golden-ratio multiples of a stream difference keep clear of small
    # token-index differences, by the three-distance theorem).
    h = _mix(s + _s64(seed_lane(draw)))
    h = torch.add(torch.add(h, r, alpha=_STREAM), t, alpha=_GOLDEN)
    if dtype == torch.float32:
        # The last xor-shift (x ^ x >>> 31) changes bits 0..32 only: the top 24 bits are the premix's.
        return _shr(_premix(h), 40).to(dtype) * (2.0**-24)
    return _shr(_mix(h), 11).to(dtype) * (2.0**-53)


# ------------------------------------------------------------------ reference
def _kept_in_sorted_order(sorted_logits: torch.Tensor, k: torch.Tensor | int, p: torch.Tensor | float,
                          top_k: bool, top_p: bool) -> torch.Tensor:
    """Which positions of a row sorted in descending order the filters keep: the first ``k``, then the shortest
    prefix of the top-k-renormalised distribution whose mass reaches ``p`` (the top token always stays)."""
    vocab = sorted_logits.shape[-1]
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k:
        keep = keep & (torch.arange(vocab, device=sorted_logits.device) < k)
    if top_p:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive prefix sum
        drop = mass_before >= p
        drop[..., 0] = False
        keep = keep & ~drop
    return keep


def filtered_logprobs(
    logits: torch.Tensor, inv_t: torch.Tensor | float, p: torch.Tensor | float, k: torch.Tensor | int,
    top_k_on: bool, top_p_on: bool, *, per_row: bool, ranked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logprobs, full, order)``: the sampling distribution over the last dim, in vocabulary order (see
    ``sampling._filtered_logprobs`` for the rules). ``inv_t`` / ``p`` / ``k`` are host values, or per-row
    ``[B, 1]`` tensors (``per_row``: then a row whose own values filter nothing keeps the unfiltered bits)."""
    # Times the float32 reciprocal, with either kind of value: what a device computes for a tensor divided
    # by a host scalar, so a Python temperature and a knob tensor give the same bits everywhere.
    scaled = logits.float() * inv_t
    vocab = scaled.shape[-1]
    full = torch.log_softmax(scaled, dim=-1)
    top_k_on = top_k_on and (per_row or k < vocab)
    order = None
    if top_k_on or top_p_on or ranked:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    if not (top_k_on or top_p_on):
        return full, full, order
    keep_sorted = _kept_in_sorted_order(sorted_logits, k, p, top_k_on, top_p_on)
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    filtered = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    if per_row:
        filtered = torch.where((k >= vocab) & (p > 1), full, filtered)
    return filtered, full, order


def inverse_cdf(lp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: each row's position of ``u [B, 1]`` in the CDF of ``exp(lp)`` taken in vocabulary order.

    Any fixed order gives the same distribution. The first position whose CDF exceeds ``u * total`` (scaling by
    the total absorbs rounding), capped at the first position that reaches the total (a kept token) in case
    ``u * total`` rounds up to it. Non-finite logits (a diverged model) give a NaN CDF: position 0, never an
    index out of range."""
    cdf = torch.cumsum(lp.exp(), dim=-1)
    total = cdf[..., -1:]
    return torch.minimum((cdf <= u * total).sum(dim=-1, keepdim=True), (cdf < total).sum(dim=-1, keepdim=True))


def reference_sample_rows(logits: torch.Tensor, eos_mask: torch.Tensor | None, suppress_eos: torch.Tensor | None,
                          knob: torch.Tensor, inv_temperature: torch.Tensor, top_p: torch.Tensor,
                          top_k: torch.Tensor, full: torch.Tensor, seed: torch.Tensor, stream: torch.Tensor,
                          token_index: torch.Tensor, top_k_on: bool,
                          top_p_on: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The aten ops the sampled pick always ran: EOS masked where suppressed, the knob values gathered, the
    filters (one stable sort), the counter uniform and the inverse CDF in vocabulary order."""
    if eos_mask is not None and suppress_eos is not None:
        logits = logits.masked_fill(suppress_eos[:, None] & eos_mask, float("-inf"))
    filters = top_k_on or top_p_on
    inv_t = inv_temperature[knob][:, None]
    p, k = (top_p[knob][:, None], top_k[knob][:, None]) if filters else (None, None)
    lp, full_lp, _ = filtered_logprobs(logits, inv_t, p, k, top_k_on, top_p_on, per_row=True)
    u = counter_uniform(seed, stream, token_index, SAMPLING_DRAW).expand(logits.shape[0]).unsqueeze(-1)
    pos = inverse_cdf(lp, u)
    chosen = lp.gather(-1, pos).squeeze(-1)
    if full_lp is not lp:  # a filter ran: the two distributions differ (a device flag picks per row)
        chosen = torch.where(full[knob], full_lp.gather(-1, pos).squeeze(-1), chosen)
    return pos.squeeze(-1), chosen


# ------------------------------------------------------------------ the op
def _check(logits: torch.Tensor, eos_mask: torch.Tensor | None, suppress_eos: torch.Tensor | None,
           knob: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sample_rows: logits must be [B, V], got shape {tuple(logits.shape)}")
    if knob.shape != (logits.shape[0],):
        raise ValueError(f"sample_rows: knob must be [B] (one knob-table index per row), got {tuple(knob.shape)}")
    if (eos_mask is None) != (suppress_eos is None):
        raise ValueError("sample_rows: pass eos_mask and suppress_eos together (or neither)")
    if eos_mask is not None and (eos_mask.shape != (logits.shape[1],) or suppress_eos.shape != knob.shape):
        raise ValueError(f"sample_rows: eos_mask must be [V] and suppress_eos [B], got {tuple(eos_mask.shape)} "
                         f"and {tuple(suppress_eos.shape)}")


def _sample_rows(logits: torch.Tensor, eos_mask: torch.Tensor | None, suppress_eos: torch.Tensor | None,
                 knob: torch.Tensor, inv_temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                 full: torch.Tensor, seed: torch.Tensor, stream: torch.Tensor, token_index: torch.Tensor,
                 top_k_on: bool, top_p_on: bool, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B] int64, logprobs [B] float32)`` sampled from ``logits [B, V]`` (see the module docstring).

    ``knob [B]`` indexes each row's values in the tables ``inv_temperature``, ``top_p``, ``top_k`` and ``full``
    (report the logprob under the full softmax at the temperature); ``seed``, ``stream``, ``token_index``:
    int64 counters broadcastable to ``[B]``; ``eos_mask [V]`` / ``suppress_eos [B]`` (both or neither): EOS
    masked out of the rows that suppress it. ``top_k_on`` / ``top_p_on``: which filters run (a row's values may
    still make its filter a no-op: top-k at or past the vocabulary, top-p past 1). ``exact``: the exact mode's
    call, which keeps the reference (its logprobs are the training forward's ``log_softmax`` bits)."""
    _check(logits, eos_mask, suppress_eos, knob)  # shapes only: no host read
    global _last_device
    _last_device = logits.device
    if not exact and implementation(logits.device) == "triton":
        return _triton_sample_rows(logits, eos_mask, suppress_eos, knob, inv_temperature, top_p, top_k, full,
                                   seed, stream, token_index, top_k_on, top_p_on)
    return reference_sample_rows(logits, eos_mask, suppress_eos, knob, inv_temperature, top_p, top_k, full, seed,
                                 stream, token_index, top_k_on, top_p_on)


def _sample_rows_fake(logits, eos_mask, suppress_eos, knob, inv_temperature, top_p, top_k, full, seed, stream, token_index,
                      top_k_on, top_p_on, exact=False):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32)


sample_rows = define_op(_sample_rows, _sample_rows_fake)


# ------------------------------------------------------------------ choice
_last_device = torch.device("cpu")


def _probe_inputs(device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 37, generator=g) * 2).to(device)
    eos = torch.zeros(37, dtype=torch.bool, device=device)
    eos[int(logits[0].argmax())] = True  # row 0's best token is a suppressed EOS
    suppress = torch.tensor([True, False, True, False, False, False], device=device)
    knob = torch.arange(6, device=device)
    inv_t = torch.tensor([1.0, 1.0, 1.25, 0.8, 1.0, 2.0], device=device)
    top_p = torch.tensor([2.0, 2.0, 0.7, 0.9, 2.0, 0.5], device=device)
    top_k = torch.tensor([1, 2**62, 5, 2**62, 3, 7], device=device)
    full = torch.tensor([False, False, True, False, False, False], device=device)
    counters = torch.full((6,), 3, device=device), torch.arange(6, device=device), torch.arange(6, device=device)
    return logits, eos, suppress, knob, inv_t, top_p, top_k, full, *counters


@functools.lru_cache(maxsize=16)
def _probe(device: torch.device) -> str:
    """``"triton"`` where the kernel runs on ``device`` and agrees with the reference: the top-1 row picks the
    reference's token, and every row's token is a kept one with the reference's logprob for it."""
    refuse_while_capturing("sampler", device)
    if _kernel() is None:
        return "reference"
    args = _probe_inputs(device)
    try:
        for top_k_on, top_p_on in ((True, True), (False, False)):
            tokens, lp = _triton_sample_rows(*args, top_k_on, top_p_on)
            want_tokens, _ = reference_sample_rows(*args, top_k_on, top_p_on)
            logits, eos, suppress, knob, inv_t, p, k, full = args[:8]
            masked = logits.masked_fill(suppress[:, None] & eos, float("-inf"))
            ref_lp, ref_full, _ = filtered_logprobs(masked, inv_t[:, None], p[:, None], k[:, None], top_k_on,
                                                    top_p_on, per_row=True)
            want = torch.where(full & (top_k_on or top_p_on), ref_full.gather(-1, tokens[:, None])[:, 0],
                               ref_lp.gather(-1, tokens[:, None])[:, 0])
            if top_k_on and int(tokens[0]) != int(want_tokens[0]):
                warn_fallback("sampler", device, "triton", "its top-1 row drew another token than the reference")
                return "reference"
            if not (torch.isfinite(lp).all() and torch.allclose(lp, want, atol=1e-4, rtol=1e-4)):
                warn_fallback("sampler", device, "triton", "its logprobs differ from the reference's")
                return "reference"
        return "triton"
    except Exception as exc:  # noqa: BLE001 -- any failure to compile or run means: not on this device
        warn_fallback("sampler", device, "triton", failure(exc))
        return "reference"


def implementation(device: torch.device | str) -> str:
    """The implementation :func:`sample_rows` runs on ``device``: ``"triton"`` or ``"reference"``."""
    return _probe(probe_device(device))


def describe(device: torch.device | str | None = None) -> str:
    """What the sampled pick runs on ``device`` (default: where the op last ran), in words."""
    if implementation(_last_device if device is None else device) == "triton":
        return ("hybrid_engine::sample_rows, Triton kernel: one program per row, the counter uniform in the kernel, "
                "inverse CDF in vocabulary order; top-k / top-p by bisection over the logit values (no sort)")
    return ("hybrid_engine::sample_rows, reference: inverse CDF over a vocabulary-order cumsum, one counter-based "
            "uniform per row (2 splitmix64 rounds); no sort at temperature alone, one stable sort for top-k / top-p")


# ------------------------------------------------------------------ kernel
#: Pivots per pass of the kernel's threshold search (a pass narrows the range of keys about this many times).
_BUCKETS = 16


@functools.lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel module (imported on first use, so ``TRITON_INTERPRET`` is read then); ``None`` without
    Triton."""
    try:
        from hybrid_engine.decode.ops import sampler_triton
    except ImportError:
        return None
    return sampler_triton


def _triton_sample_rows(logits: torch.Tensor, eos_mask: torch.Tensor | None, suppress_eos: torch.Tensor | None,
                        knob: torch.Tensor, inv_temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                        full: torch.Tensor, seed: torch.Tensor, stream: torch.Tensor, token_index: torch.Tensor,
                        top_k_on: bool, top_p_on: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row (:func:`~hybrid_engine.decode.ops.sampler_triton.sample_kernel`)."""
    kernels = _kernel()
    rows, vocab = logits.shape
    if rows == 0:
        return logits.new_empty(0, dtype=torch.int64), logits.new_empty(0, dtype=torch.float32)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    counters = [c.to(torch.int64).expand(rows) for c in (seed, stream, token_index)]
    has_eos = eos_mask is not None
    eos = eos_mask.contiguous().view(torch.uint8) if has_eos else tokens
    suppress = suppress_eos.contiguous().view(torch.uint8) if has_eos else tokens
    knob = knob.contiguous()
    block = min(2048, max(16, 1 << math.ceil(math.log2(vocab))))
    kernels.sample_kernel[(rows,)](
        logits, logits.stride(0), eos, suppress, knob, inv_temperature.float(), top_p.float(), top_k,
        full.view(torch.uint8), counters[0], counters[0].stride(0), counters[1], counters[1].stride(0),
        counters[2], counters[2].stride(0), tokens, logprobs, vocab, K0=seed_lane(SAMPLING_DRAW), HAS_EOS=has_eos,
        TOP_K=top_k_on, TOP_P=top_p_on, BLOCK=block, NB=_BUCKETS, SEARCH_BLOCK=max(16, min(block, 4096 // _BUCKETS)),
        num_warps=4 if block <= 1024 else 8)
    return tokens, logprobs
