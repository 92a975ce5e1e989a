"""Token sampling that is safe to capture into a device graph.

Decode steps are captured once and replayed many times, so sampling runs
*inside* the graph. Capture forbids host synchronisations and data-dependent
shapes, and freezes every Python-side value at capture time. This module keeps
one invariant that makes sampling correct under those rules:

    All randomness is a pure function of device-resident integer counters
    ``(seed, stream, token_index, draw)``.

There is no generator state to advance (a captured ``torch.rand`` would either
replay the same numbers or depend on how many rows share the batch). Instead
:func:`counter_uniform` hashes the counters with two splitmix64 rounds built
from int64 tensor ops (one uniform per row, 26 ops). Because of that:

* replay and eager execution draw the same numbers, token for token;
* a request's tokens do not depend on which other requests share its batch or
  in which row it sits;
* the same values come out on every device (integer arithmetic is exact).

The knobs (temperature, top-p, top-k) decide which filters run (the
:func:`sampling_mode`: greedy or not, top-k on or off, top-p on or off), which
a captured graph freezes and is keyed on. Their values may instead come from
device tensors (:class:`SamplingKnobs`, written before each call), so one graph
per mode serves every temperature, top-p and top-k: a schedule that changes the
temperature at every step recaptures nothing. Everything else is
static-shape tensor work: the pick is an inverse CDF by counting over a
cumulative sum in vocabulary order, so temperature alone sorts nothing; top-k
and top-p find their kept set with one stable sort, then renormalise in
vocabulary order -- no ``.item()``, ``nonzero``, boolean-mask indexing or
``torch.multinomial``. With device knobs (a decode step) the whole pick is one
custom op, ``hybrid_engine::sample_rows`` (:mod:`hybrid_engine.decode.ops.sampler`,
which also holds the counter hash and the filters): those aten ops where no
kernel runs, a sort-free Triton kernel (a bucketed search over the logit
values for the kept set) where one does. The kernel draws from the same
distribution with the same uniform (not the same token for every seed: its
sums round differently), and its logprob agrees with :func:`logprobs_of`
within float rounding rather than bit for bit; the exact mode keeps the
reference (``SamplingKnobs.exact``). Since every row is picked in vocabulary order, a row
whose own setting filters nothing gets the same token in a call whose graph
runs filters for other rows. :func:`sample_tokens` and :func:`logprobs_of`
share one filter (:func:`_filtered_logprobs`), so the two cannot diverge.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from hybrid_engine.accelerator.host_copy import device_tensor
from hybrid_engine.decode.ops.sampler import (  # noqa: F401 -- SAMPLING_DRAW, counter_uniform: public here
    SAMPLING_DRAW,
    as_counter,
    counter_uniform,
    describe,
    filtered_logprobs,
    inverse_cdf,
    sample_rows,
)
from hybrid_engine.decode.ops.sampler import (
    implementation as sampler_implementation,  # the probe, see set_table
)

# IMPLEMENTATION: a module attribute computed on read (__getattr__ below).
__all__ = ["IMPLEMENTATION", "LOGPROB_MODES", "MAX_SETTINGS", "MIN_TEMPERATURE", "RowKnobs", "SAMPLING_DRAW", "SamplingKnobs", "counter_uniform", "logprobs_of",  # noqa: F822, E501
           "sample_tokens", "sample_tokens_and_top", "sampling_mode", "union_mode", "validate_logprobs", "validate_sampling"]

#: The smallest positive temperature (as vLLM's sampling epsilon): below it, scaled logits overflow float32.
MIN_TEMPERATURE = 1e-5


def __getattr__(name: str) -> str:
    # ``IMPLEMENTATION``: what the sampled pick runs where it last ran (``hybrid-engine bench kernels`` reports it).
    if name == "IMPLEMENTATION":
        return describe()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise if the sampling knobs are invalid.

    ``TypeError`` for a non-numeric value; ``ValueError`` (naming the argument)
    for ``temperature`` negative or non-finite, ``top_p`` outside ``(0, 1]``, or
    ``top_k`` not an integer or below ``-1``, and for a positive ``temperature``
    below :data:`MIN_TEMPERATURE`. ``top_k`` of ``-1`` or ``0``
    disables top-k; ``top_p == 1`` disables top-p; ``temperature == 0`` is greedy.
    """
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if 0 < temperature < MIN_TEMPERATURE:  # logits / T would overflow to inf: no distribution left
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature!r}; "
                         "pass temperature=0 for greedy decoding")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, numbers.Integral):  # a number, but not a whole one: a bad value
        raise ValueError(  # noqa: TRY004
            f"top_k must be an integer (-1 or 0 disables it), got {top_k!r}"
        )
    if not -1 <= top_k < 2**63:
        raise ValueError(f"top_k must be in -1..2**63-1 (-1 or 0 disables it), got {top_k!r}")


def sampling_mode(temperature: float, top_p: float, top_k: int) -> tuple[bool, bool, bool]:
    """Which filters run: ``(sampled, top-k on, top-p on)``; greedy is ``(False, False, False)``.

    What a captured graph freezes of the knobs (their values can live in :class:`SamplingKnobs`).
    A ``top_k`` at or above the vocabulary masks nothing, so the same ops give the same result.
    """
    if temperature == 0:
        return (False, False, False)
    return (True, top_k > 0, top_p < 1)


#: Distinct (temperature, top-p, top-k) settings one call may mix across its requests.
MAX_SETTINGS = 64


def union_mode(settings: list[tuple[float, float, int]]) -> tuple[float, float, int]:
    """A sampling key whose :func:`sampling_mode` runs every filter some of ``settings`` needs: the key of the
    one graph a call mixing them replays. A greedy setting among sampled ones is a top-1 pick, so top-k runs."""
    sampled = any(t > 0 for t, _, _ in settings)
    if not sampled:
        return (0.0, 1.0, -1)
    top_k_on = any(k > 0 for _, _, k in settings) or any(t == 0 for t, _, _ in settings)
    top_p_on = any(t > 0 and p < 1 for t, p, _ in settings)
    return (1.0, 0.5 if top_p_on else 1.0, 1 if top_k_on else -1)


class RowKnobs:
    """Each row's knob values: setting ``index[b]`` of a :class:`SamplingKnobs` table for row ``b``. The values
    (``[B, 1]``; ``full`` ``[B]``) are device gathers made on first read; ``None`` where the mode that runs reads
    them not (``filters`` False). The sampled pick reads the table and the index instead (one op, no gathers)."""

    def __init__(self, table: SamplingKnobs, index: torch.Tensor, filters: bool = True) -> None:
        self.table, self.index, self.filters = table, index, filters

    @functools.cached_property
    def inv_temperature(self) -> torch.Tensor:
        return self.table.inv_temperature[self.index][:, None]

    @functools.cached_property
    def top_p(self) -> torch.Tensor | None:
        return self.table.top_p[self.index][:, None] if self.filters else None

    @functools.cached_property
    def top_k(self) -> torch.Tensor | None:
        return self.table.top_k[self.index][:, None] if self.filters else None

    @functools.cached_property
    def full(self) -> torch.Tensor | None:
        return self.table.full[self.index] if self.filters else None


class SamplingKnobs:
    """Temperature, top-p and top-k of each of a call's distinct settings, as a device table written in place
    before the call (never during capture): a graph captured for one :func:`sampling_mode` reads, per row, the
    values of its request's setting (:meth:`for_rows`), in every call. A filter a setting does not use gets a
    value that makes it a no-op where the mode runs it (top-k at the vocabulary, top-p past 1)."""

    def __init__(self, device: torch.device) -> None:
        self.inv_temperature = torch.ones(MAX_SETTINGS, dtype=torch.float32, device=device)
        self.top_p = torch.ones(MAX_SETTINGS, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(MAX_SETTINGS, dtype=torch.int64, device=device)
        #: Report logprobs under the full softmax at the temperature instead of the filtered distribution.
        self.full = torch.zeros(MAX_SETTINGS, dtype=torch.bool, device=device)
        #: The exact mode's calls (set before a call, a capture freezes it): the pick keeps the reference ops,
        #: whose logprobs are the training forward's ``log_softmax`` bits.
        self.exact = False

    def set(self, temperature: float, top_p: float, top_k: int, logprobs: str = "sampling") -> None:
        """One setting for every request of the call (index 0)."""
        self.set_table([(temperature, top_p, top_k)], logprobs)

    def set_table(self, settings: list[tuple[float, float, int]], logprobs: str = "sampling") -> None:
        """The call's settings, request knob index ``i`` for ``settings[i]``, as the graph of
        ``union_mode(settings)`` runs them."""
        if not 1 <= len(settings) <= MAX_SETTINGS:
            raise ValueError(f"a call mixes 1 to {MAX_SETTINGS} sampling settings, got {len(settings)}")
        validate_logprobs(logprobs)
        mode = sampling_mode(*union_mode(settings))
        values = []
        for temperature, top_p, top_k in settings:
            validate_sampling(temperature, top_p, top_k)
            if temperature == 0 and mode[0]:  # greedy among sampled rows: the top-1 pick, logprob at T=1
                values.append((1.0, 2.0, 1, True))
                continue
            values.append((1.0 / temperature if temperature > 0 else 1.0,
                           top_p if top_p < 1 else 2.0,  # past 1: top-p keeps everything
                           top_k if top_k > 0 else 2**62,  # past the vocabulary: top-k keeps everything
                           logprobs == "full"))
        values += [values[-1]] * (MAX_SETTINGS - len(values))
        inv_t, p, k, full = zip(*values)
        device = self.top_k.device
        sampler_implementation(device)  # the op's capability probe runs here, before any capture
        self.inv_temperature.copy_(device_tensor(inv_t, device, torch.float32))
        self.top_p.copy_(device_tensor(p, device, torch.float32))
        self.top_k.copy_(device_tensor(k, device))
        self.full.copy_(device_tensor(full, device, torch.bool))

    def for_rows(self, index: torch.Tensor, sampling_key: tuple[float, float, int] | None = None) -> RowKnobs:
        """The values of setting ``index[b]`` for row ``b`` (device gathers: capture-safe). With the graph's
        ``sampling_key``, only the values its :func:`sampling_mode` reads are gathered (the others are ``None``)."""
        _, top_k_on, top_p_on = (True, True, True) if sampling_key is None else sampling_mode(*sampling_key)
        return RowKnobs(self, index, top_k_on or top_p_on)


#: What a reported logprob is under: the distribution sampled from (after top-k / top-p, renormalised), or the
#: full softmax at the temperature (what a training forward's ``log_softmax(logits / T)`` gives).
LOGPROB_MODES = ("sampling", "full")


def validate_logprobs(logprobs: object) -> None:
    if logprobs not in LOGPROB_MODES:
        raise ValueError(f"logprobs must be one of {LOGPROB_MODES}, got {logprobs!r}")


def _filtered_logprobs(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, knobs: RowKnobs | None = None,
    *, ranked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sampling distribution over the last dim, in vocabulary order.

    Filtering order: temperature scaling, then top-k, then top-p on the
    top-k-renormalised distribution (keep the smallest prefix, in
    descending-probability order, whose cumulative probability reaches
    ``top_p``; the top token is always kept), then renormalisation. Ties
    between equal logits are broken by vocabulary index (the lower index ranks
    first).

    Returns ``(logprobs, full, order)``: log-probabilities after temperature, top-k and top-p (removed entries
    are ``-inf``, the rest renormalised), the log-probabilities at the temperature before any filter (the same
    tensor when no filter runs: at temperature 1 ``log_softmax(logits.float())``'s bits, the training forward's),
    and the descending order of the scaled logits (``None`` unless a filter runs or ``ranked``). Every softmax
    reduces in vocabulary order. Only a filter needs the order (one stable sort, which temperature alone does
    not pay). Requires ``temperature > 0``; static shapes, no host read. The Python knobs choose the filters
    (:func:`sampling_mode`); ``knobs``, when given, supplies their values (the float32 values the Python ones
    round to), and a row whose own values filter nothing keeps the unfiltered bits, as in a call of its own.
    """
    _, top_k_on, top_p_on = sampling_mode(temperature, top_p, top_k)
    inv_t, p, k = ((knobs.inv_temperature, knobs.top_p, knobs.top_k) if knobs is not None
                   else (1.0 / temperature, top_p, top_k))
    return filtered_logprobs(logits, inv_t, p, k, top_k_on, top_p_on, per_row=knobs is not None, ranked=ranked)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: torch.Tensor | int,
    stream: torch.Tensor | int,
    token_index: torch.Tensor | int,
    knobs: RowKnobs | None = None,
    logprobs: str = "sampling",
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`sample_tokens_and_top`, without the ranked alternatives."""
    tokens, chosen, _, _ = sample_tokens_and_top(
        logits, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stream=stream,
        token_index=token_index, knobs=knobs, logprobs=logprobs, top=0)
    return tokens, chosen


def sample_tokens_and_top(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: torch.Tensor | int,
    stream: torch.Tensor | int,
    token_index: torch.Tensor | int,
    knobs: RowKnobs | None = None,
    logprobs: str = "sampling",
    top: int = 0,
    checked: bool = False,
    want_logprobs: bool = True,
    eos_mask: torch.Tensor | None = None,
    suppress_eos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``[B, V]``; capture-safe.

    Returns ``(tokens [B] int64, logprobs [B] float32, top_ids [B, top] int64,
    top_logprobs [B, top] float32)``: the ``top`` most likely ids of each row's
    distribution (the one its logprob is under), best first. Row ``b`` uses the
    uniform ``counter_uniform(seed, stream, token_index)[b]`` (draw
    :data:`SAMPLING_DRAW`) and an inverse-CDF pick over the filtered
    distribution, so its token depends only on its own logits and counters.
    ``temperature == 0`` is greedy: ``argmax`` (lowest index on ties); there, with ``want_logprobs=False`` and
    no ``top``, no log-softmax is computed and the logprobs are ``None``. With
    ``knobs`` the filters read their values from those device tensors (see
    :func:`_filtered_logprobs` for the filtering rules): pass knobs set
    to the same values; then, without ``top``, the pick is one op,
    ``hybrid_engine::sample_rows`` (:mod:`hybrid_engine.decode.ops.sampler`:
    the same ops on the reference path, a sort-free kernel where one runs).
    ``eos_mask [V]`` with ``suppress_eos [B]``: EOS is masked out of the rows
    that suppress it (inside that op).

    The returned log-probability, when sampling (``temperature > 0``), is the
    one under the distribution actually sampled from, i.e. ``softmax(logits /
    T)`` restricted by top-k/top-p and renormalised; ``logprobs="full"`` (or
    ``knobs.full``) reports it under the full ``softmax(logits / T)`` instead,
    with the same tokens. When greedy, it is the one under ``softmax(logits)``
    (temperature 1, no filtering), which is what a trainer's forward computes:
    bit for bit ``log_softmax(logits.float())``, and ``logprobs_of`` at
    temperature 0 or 1 (every full softmax here reduces in vocabulary order).
    """
    if not checked:  # ``checked``: the caller's plan checked the knobs once (a decode step's sampler)
        validate_sampling(temperature, top_p, top_k)
        validate_logprobs(logprobs)
    if logits.dim() != 2:
        raise ValueError(f"sample_tokens: logits must be [B, V], got shape {tuple(logits.shape)}")
    if temperature == 0:
        logits = _without_eos(logits, eos_mask, suppress_eos)
        tokens = torch.argmax(logits, dim=-1)
        if not want_logprobs and top == 0:  # ``want_logprobs=False``: the caller reads no logprob (``None``)
            return tokens, None, tokens.new_empty(tokens.shape[0], 0), logits.new_empty(tokens.shape[0], 0).float()
        every = torch.log_softmax(logits.float(), dim=-1)
        chosen = every.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if top == 0:
            return tokens, chosen, tokens.new_empty(tokens.shape[0], 0), chosen.new_empty(tokens.shape[0], 0)
        ranked, ids = torch.sort(every, dim=-1, descending=True, stable=True)  # ties: the lower id first
        return tokens, chosen, ids[:, :top], ranked[:, :top]
    if knobs is not None and top == 0:  # the decode step's pick: one op (EOS, knob gathers, filters, uniform)
        _, top_k_on, top_p_on = sampling_mode(temperature, top_p, top_k)
        like = logits if not isinstance(seed, torch.Tensor) else seed
        table = knobs.table
        tokens, chosen = sample_rows(logits, eos_mask, suppress_eos, knobs.index, table.inv_temperature,
                                     table.top_p, table.top_k, table.full, as_counter(seed, like),
                                     as_counter(stream, like), as_counter(token_index, like), top_k_on, top_p_on,
                                     table.exact)
        return tokens, chosen, tokens.new_empty(tokens.shape[0], 0), chosen.new_empty(tokens.shape[0], 0)
    return _sample_in_aten(_without_eos(logits, eos_mask, suppress_eos), temperature, top_p, top_k, seed, stream,
                           token_index, knobs, logprobs, top)


def _without_eos(logits: torch.Tensor, eos_mask: torch.Tensor | None,
                 suppress_eos: torch.Tensor | None) -> torch.Tensor:
    if eos_mask is None or suppress_eos is None:
        return logits
    return logits.masked_fill(suppress_eos[:, None] & eos_mask, float("-inf"))


def _sample_in_aten(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: torch.Tensor | int,
                    stream: torch.Tensor | int, token_index: torch.Tensor | int, knobs: RowKnobs | None,
                    logprobs: str, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled pick with ``top`` ranked alternatives, or with the knobs as host values: aten ops (the same
    filters, uniform and inverse CDF as the op's reference)."""
    lp, full, order = _filtered_logprobs(logits, temperature, top_p, top_k, knobs, ranked=top > 0)
    u = counter_uniform(seed, stream, token_index, SAMPLING_DRAW)
    pos = inverse_cdf(lp, u.expand(logits.shape[0]).unsqueeze(-1))
    tokens = pos.squeeze(-1)
    chosen = lp.gather(-1, pos).squeeze(-1)
    ids = order[:, :top] if order is not None else tokens.new_empty(tokens.shape[0], 0)
    ranked = lp.gather(-1, ids)
    if full is not lp:  # a filter ran: the two distributions differ
        full_chosen = full.gather(-1, pos).squeeze(-1)
        if knobs is not None:  # a device flag, so one captured graph serves both modes
            chosen = torch.where(knobs.full, full_chosen, chosen)
            if top:
                ranked = torch.where(knobs.full[:, None], full.gather(-1, ids), ranked)
        elif logprobs == "full":
            chosen, ranked = full_chosen, full.gather(-1, ids)
    return tokens, chosen, ids, ranked


def logprobs_of(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    logprobs: str = "sampling",
) -> torch.Tensor:
    """Log-probability of ``tokens`` ``[...]`` under the sampling distribution of ``logits`` ``[..., V]``
    (``logprobs="full"``: under the full softmax at the temperature, as a rollout with that mode reports).

    Uses the same filtering as :func:`sample_tokens`, so a trainer can recompute
    rollout log-probabilities from a full-sequence forward; a token that the
    filters remove gets ``-inf``. ``temperature == 0`` gives the plain
    ``log_softmax(logits)`` value, the same bits as ``temperature=1`` without
    filters. Returns float32 with the shape of ``tokens``.
    """
    validate_sampling(temperature, top_p, top_k)
    validate_logprobs(logprobs)
    index = tokens.long().unsqueeze(-1)
    if temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, index).squeeze(-1)
    lp, full, _ = _filtered_logprobs(logits, temperature, top_p, top_k)
    return (full if logprobs == "full" else lp).gather(-1, index).squeeze(-1)
