"""A call is a plan: every check and every size of a generation call, decided once, before any work.

Both front ends (``HybridEngineRollout`` and ``engine.generate``) turn their arguments into one
:class:`CallPlan` here, and :func:`hybrid_engine.generation.call.run_call` runs it. Why one module: the same
rules (the model's position limit, a windowed layer's exact length, the cache capacity, the vocabulary, the
batch's size) used to be checked where each front end, the runner and the scheduler happened to need them,
in up to six places with drifting messages. Here each rule is one function, and a plan that exists has passed
all of them: nothing downstream re-checks (the decode step only checks what capture cannot, outside capture).

What differs between the front ends is data, not code: how a refusal names the caller's knobs
(:class:`CallNames`), whether the last new token is fed back (a rollout's training forward runs over prompt +
response, so a rollout needs one more position than ``generate``), and whether the cache is sized per call (a
rollout's ``cache_capacity=None``) or fixed (``hybrid_engine.max_out_tokens``).

Nothing here touches the device but the prompts' copy to the model's device; the plan holds host values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hybrid_engine.config.schema import HybridEngineConfig
from hybrid_engine.decode.kv_pool import HeldPages, KVBudget
from hybrid_engine.decode.layout import exact_length
from hybrid_engine.decode.model_support import max_positions
from hybrid_engine.decode.sampling import MAX_SETTINGS, union_mode
from hybrid_engine.decode.staging import staged_width_within, width_bucket
from hybrid_engine.distributed.ranks import rank_seed
from hybrid_engine.generation.request import Request
from hybrid_engine.generation.stop_strings import StopStrings

__all__ = ["GENERATE", "MAX_BATCH_ELEMENTS", "ROLLOUT", "CallNames", "CallPlan", "check_batch_size", "check_cache_length",
           "check_generate_length", "check_positions", "knob_table", "plan_generate", "plan_rollout"]


#: The most tokens one call's rows may hold (2**31: a 16 GiB int64 tensor), a guard against a mistyped
#: n_samples_per_prompt (or num_beams) exhausting host memory before a single step runs.
MAX_BATCH_ELEMENTS = 2**31

Settings = tuple[float, float, int]  # (temperature, top_p, top_k); temperature 0 is greedy
StopSet = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class CallNames:
    """How a refusal names the call and its knobs."""

    call: str  # "generate:" (rollouts) or "generate():" (engine.generate)
    capacity: str  # the knob that fixes a row's KV length
    kv_budget: str  # the knob prefix of the pool's budget (``<kv_budget>_tokens``/``_bytes``)


ROLLOUT = CallNames("generate:", "RolloutConfig.cache_capacity", "RolloutConfig.kv_cache")
GENERATE = CallNames("generate():", "hybrid_engine.max_out_tokens", "hybrid_engine.kv_cache")


@dataclasses.dataclass
class CallPlan:
    """One checked call: what to run (prompts, requests, sampling), and how to size and drive the runner.

    ``prompt_width`` is the staged prefill width (``None``: prompts are prefilled eagerly at the batch's width,
    unstaged); ``kept`` receives the pages finished rows keep for a later call (an episode's turn), ``None``:
    none are kept."""

    prompt_ids: torch.Tensor  # [P, T] on the model's device, left-padded
    prompt_mask: torch.Tensor
    requests: list[Request]
    pad_id: int
    eos_ids: tuple[int, ...]
    settings: list[Settings]  # the knob table, request ``knob`` indexes it
    stop_sets: list[StopSet]  # one per setting
    sampling_key: Settings  # the graphs' sampling mode: the setting, or the union of several
    seed: int
    max_new: int  # the output rows' width
    capacity: int  # a slot's KV length
    max_active: int  # concurrent rows
    budget: KVBudget
    graphs: bool
    continuous: bool
    shared_prefill: bool
    staged: bool
    sync_interval: int
    prompt_width: int | None = None
    logprobs: str | None = "sampling"  # None: the caller does not read them
    top_logprobs: int = 0
    stop_strings: StopStrings | None = None
    kept: dict[int, HeldPages] | None = None


# ---------------------------------------------------------------------------------------------- the rules
def check_positions(names: CallNames, longest: int, max_new: int, limit: int | None, *, fed: bool) -> None:
    """The longest prompt and its new tokens within the model's position limit. ``fed``: every new token is fed
    back (a rollout's training forward over prompt + response); else the last one never is (``generate``)."""
    if limit is None:
        return
    if longest > limit:
        raise ValueError(f"{names.call} a prompt has {longest} tokens, more than the model's position limit {limit}; "
                         "truncate the prompts")
    if fed and longest + max_new > limit:
        raise ValueError(
            f"{names.call} the longest prompt ({longest} tokens) plus max_new_tokens ({max_new}) exceeds the "
            f"model's position limit {limit}, so the training forward over prompt + response could not run; "
            "lower max_new_tokens or truncate the prompts"
        )
    if not fed and longest + max_new - 1 > limit:
        raise ValueError(
            f"{names.call} the longest prompt ({longest} tokens) + max_new_tokens {max_new} needs "
            f"{longest + max_new - 1} positions, more than the model's {limit}; shorten the prompt or "
            "lower max_new_tokens"
        )


def check_batch_size(what: str, rows: int, width: int, max_new: int) -> None:
    """``rows`` rows of ``width`` prompt + ``max_new`` tokens within :data:`MAX_BATCH_ELEMENTS` (``what``: the
    refusal, naming the caller's counts and what to lower; it is completed with the totals)."""
    if rows * (width + max_new) > MAX_BATCH_ELEMENTS:
        raise ValueError(what.format(rows=rows, width=width, max_new=max_new, limit=MAX_BATCH_ELEMENTS))


def _check_capacity(names: CallNames, capacity: int | None, longest: int, max_new: int, limit: int | None,
                    exact: Any) -> None:
    """A configured per-row KV length against the model's positions, a windowed layer's exact length, and the
    call's longest prompt + new tokens."""
    if capacity is None:
        return
    if limit is not None and capacity > limit:
        # Prompts are staged within the capacity, so `limit` slots always hold prompt + response.
        raise ValueError(
            f"{names.call} {names.capacity}={capacity} is more than the model's position "
            f"limit {limit}: every slot's KV row is allocated at that length, and no row can use more than "
            f"{limit} positions; use cache_capacity={limit} or less, or None to size the cache per call"
        )
    if exact is not None and capacity > exact.tokens:
        raise ValueError(
            f"{names.call} {names.capacity}={capacity} is more than the {exact.tokens} tokens "
            f"the model's {exact.why} lets the paged cache hold exactly; use cache_capacity={exact.tokens} or "
            "less, or None to size the cache per call"
        )
    if capacity < longest + max_new:
        raise ValueError(
            f"{names.call} {names.capacity}={capacity} is below the longest prompt "
            f"({longest}) + max_new_tokens ({max_new}) = {longest + max_new}; raise cache_capacity or leave it None"
        )


def _check_exact_length(names: CallNames, exact: Any, longest: int, max_new: int) -> None:
    needed = longest + max_new
    if exact is not None and needed > exact.tokens:
        raise ValueError(
            f"{names.call} the model's {exact.why} makes the paged cache exact only up to {exact.tokens} tokens, "
            f"and the longest prompt ({longest}) + max_new_tokens ({max_new}) = {needed} is more; lower "
            "max_new_tokens or truncate the prompts (engine.generate hands such sequences to transformers' generate)"
        )


def _check_vocabulary(names: CallNames, vocab: Any, request: Any, sampling: Any) -> None:
    """Token ids the call names (prompts, stop sequences, how many alternatives to rank) within the vocabulary."""
    if not isinstance(vocab, int):
        return
    if int(request.prompt_ids.max()) >= vocab:
        raise ValueError(f"{names.call} prompt_ids hold ids >= the model's vocab_size {vocab}")
    if sampling.top_logprobs > vocab:
        raise ValueError(f"{names.call} SamplingConfig.top_logprobs={sampling.top_logprobs} is more than the "
                         f"model's vocab_size {vocab}; ask for at most {vocab}")
    if any(i >= vocab for q in sampling.stop_token_ids for i in q):
        raise ValueError(f"{names.call} SamplingConfig.stop_token_ids hold ids >= the model's vocab_size {vocab}; "
                         "such a sequence could never be generated")
    for i, stops in enumerate(request.stop_token_ids or ()):
        if stops is not None and any(t >= vocab for q in stops for t in q):
            raise ValueError(f"{names.call} RolloutRequest.stop_token_ids (prompt {i}) hold ids >= the model's "
                             f"vocab_size {vocab}; such a sequence could never be generated")


def knob_table(names: CallNames, per_prompt: list[tuple[float, float, int, StopSet]]
               ) -> tuple[list[Settings], list[StopSet], Settings, list[int]]:
    """The call's distinct (temperature, top_p, top_k, stops) settings: the knob table, its stop sets, the graphs'
    sampling mode (the setting, or the union mode of several) and each prompt's index into the table."""
    distinct = list(dict.fromkeys(per_prompt))
    if len(distinct) > MAX_SETTINGS:
        raise ValueError(f"{names.call} the request mixes {len(distinct)} distinct (temperature, top_p, top_k, stops) "
                         f"settings, more than {MAX_SETTINGS}; split it into several calls")
    settings = [s[:3] for s in distinct]
    key = settings[0] if len(distinct) == 1 else union_mode(settings)
    return settings, [s[3] for s in distinct], key, [distinct.index(s) for s in per_prompt]


# -------------------------------------------------------------------------------------------- rollouts
def _rollout_sizes(config: Any, longest: int, max_new: int, width: int, exact: Any) -> tuple[int, int]:
    """``(capacity, staged prompt width)`` of a rollout call. Prompts are staged for prefill at their padded width,
    rounded up to a power of two (:mod:`hybrid_engine.decode.staging`): the cache holds that plus the responses,
    within a configured capacity."""
    prompt_width = width_bucket(width)
    capacity = config.cache_capacity
    if capacity is None:
        capacity = prompt_width + max_new
        if exact is not None:
            capacity = min(capacity, exact.tokens)  # a padded stage must not reach past a window
    if prompt_width > capacity - max_new:  # on a coarse grid, so that staged widths (graph keys) stay few
        prompt_width = staged_width_within(longest, capacity - max_new)
    return capacity, prompt_width


def _rollout_requests(request: Any, sampling: Any, turn: Any, knob_of: list[int], max_new: int) -> list[Request]:
    """One request per output row: ``n_samples_per_prompt`` per prompt, or an episode turn's rows (each continuing
    its prompt row on the pages an earlier call kept). A sample's random stream is ``request_id * n + sample``."""
    n, num_prompts = sampling.n_samples_per_prompt, request.prompt_ids.shape[0]
    lengths = request.prompt_lengths
    budgets = request.max_new_tokens or [max_new] * num_prompts
    uids = request.request_ids or list(range(num_prompts))
    if (max(uids) + 1) * n > 2**63:  # each sample's random stream is an int64
        raise ValueError(
            f"generate: RolloutRequest.request_ids up to {max(uids)} with n_samples_per_prompt={n} overflow "
            f"int64 sampler counters (request_id * n + sample); keep request_ids below {2**63 // n}"
        )
    seeds = [None if request.seed is None or s is None else rank_seed(s) for s in request.seed or [None] * num_prompts]
    if turn is None:
        return [Request(row=i * n + j, prompt_index=i, budget=min(budgets[i], max_new),
                        stream=uids[i] * n + j, prompt_len=lengths[i], knob=knob_of[i], seed=seeds[i])
                for i in range(num_prompts) for j in range(n)]
    row_budgets = turn.budgets or [max_new] * len(turn.rng)
    return [Request(row=r, prompt_index=i, budget=min(budgets[i], max_new, b), stream=rng,
                    prompt_len=lengths[i], knob=knob_of[i], seed=seeds[i], held=held)
            for r, (i, rng, held, b) in enumerate(zip(turn.prompt_of, turn.rng, turn.held, row_budgets))]


def plan_rollout(model: Any, config: Any, request: Any, sampling: Any, *, pad_id: int, eos_ids: tuple[int, ...],
                 stop_strings: StopStrings | None, turn: Any = None, max_rows: int, device: torch.device
                 ) -> CallPlan:
    """The plan of a ``HybridEngineRollout`` call: ``config`` a ``RolloutConfig``, ``request`` a validated, non-empty
    ``RolloutRequest``, ``sampling`` a ``SamplingConfig``, ``turn`` an episode's ``TurnRows`` (or ``None``);
    ``max_rows`` the concurrency when the config sets none."""
    names = ROLLOUT
    lengths = request.prompt_lengths
    longest, max_new, width = max(lengths), sampling.max_new_tokens, request.prompt_ids.shape[1]
    limit, exact = max_positions(model.config), exact_length(model.config)
    check_positions(names, longest, max_new, limit, fed=True)
    _check_exact_length(names, exact, longest, max_new)
    _check_capacity(names, config.cache_capacity, longest, max_new, limit, exact)
    _check_vocabulary(names, getattr(model.config, "vocab_size", None), request, sampling)
    capacity, prompt_width = _rollout_sizes(config, longest, max_new, width, exact)
    num_prompts = request.prompt_ids.shape[0]
    n = sampling.n_samples_per_prompt
    check_batch_size(f"generate: {num_prompts} prompts x n_samples_per_prompt={n} rows of {{width}} prompt + "
                     "{max_new} new tokens would be more than {limit} tokens in one batch; lower "
                     "n_samples_per_prompt or split the request", num_prompts * n, width, max_new)
    # Per-prompt sampling: the call's distinct settings (and stop sets) go into the knob table, one graph of
    # their union mode.
    settings, stop_sets, key, knob_of = knob_table(names, request.settings(sampling))
    requests = _rollout_requests(request, sampling, turn, knob_of, max_new)
    # Concurrency: max_batch_size, else the largest explicit bucket, else the default.
    slots = config.max_batch_size or (max(config.graph_batch_sizes) if config.graph_batch_sizes else max_rows)
    return CallPlan(
        prompt_ids=request.prompt_ids.to(device), prompt_mask=request.prompt_attention_mask.to(device),
        requests=requests, pad_id=pad_id, eos_ids=eos_ids, settings=settings, stop_sets=stop_sets,
        sampling_key=key, seed=rank_seed(sampling.seed), max_new=max_new, capacity=capacity,
        max_active=min(slots, len(requests)),
        budget=KVBudget(config.kv_page_size, config.kv_cache_tokens, config.kv_cache_bytes, names.kv_budget, longest,
                        max_new, device),
        graphs=config.use_graph_capture, continuous=config.continuous_batching,
        shared_prefill=config.use_shared_prefill, staged=True, sync_interval=config.sync_interval,
        prompt_width=prompt_width, logprobs=sampling.logprobs, top_logprobs=sampling.top_logprobs,
        stop_strings=stop_strings, kept=turn.kept if turn is not None else None,
    )


# ------------------------------------------------------------------------------------------ engine.generate
#: Host syncs to notice finished rows while some row can still stop on EOS (as rollouts default to).
SYNC_INTERVAL = 4


def check_generate_length(config: Any, width: int, max_new: int, limit: int | None) -> None:
    """``engine.generate``'s fast-path lengths: the prompt + new tokens within ``hybrid_engine.max_out_tokens``
    (``config`` an ``EngineConfig``), itself within the model's positions ``limit``. The longest prompt's positions
    were checked on every path already (:func:`check_positions`, before the path was chosen)."""
    cap = config.hybrid_engine.max_out_tokens
    check_cache_length(cap, limit)
    if width + max_new > cap:
        raise ValueError(
            f"generate(): prompt length {width} + max_new_tokens {max_new} = {width + max_new} exceeds "
            f"hybrid_engine.max_out_tokens={cap}; raise max_out_tokens or generate fewer tokens"
        )


#: ``hybrid_engine.max_out_tokens``'s default, which any model may keep (even one with fewer positions).
DEFAULT_MAX_OUT_TOKENS = HybridEngineConfig.model_fields["max_out_tokens"].default


def check_cache_length(max_out_tokens: int, limit: int | None) -> None:
    """Refuse a ``hybrid_engine.max_out_tokens`` beyond the model's position limit ``limit`` (the default is always
    accepted), before the decode cache is allocated at that length: no row ever uses more positions than that."""
    allowed = None if limit is None else max(limit, DEFAULT_MAX_OUT_TOKENS)
    if allowed is not None and max_out_tokens > allowed:
        default = f" (the default, {DEFAULT_MAX_OUT_TOKENS}, is accepted for any model)" if allowed > limit else ""
        raise ValueError(
            f"hybrid_engine.max_out_tokens={max_out_tokens} is more than the model's position limit {limit}: the "
            f"decode cache is allocated at max_out_tokens per row at the first generate, and no row can use more "
            f"than {limit} positions; set max_out_tokens to the longest prompt plus new tokens you generate, at "
            f"most {allowed}{default}"
        )


def plan_generate(config: Any, input_ids: torch.Tensor, mask: torch.Tensor, *, max_new: int, min_new: int,
                  sampling: Settings, eos: list[int], pad: int | None, seed: int) -> CallPlan:
    """The plan of an ``engine.generate`` call on the fast path (``config`` an ``EngineConfig``; ids and mask on
    the model's device, checked; lengths checked by :func:`check_generate_length`): the whole batch at once, each
    row its own request, prefilled unstaged at the batch's width."""
    he = config.hybrid_engine
    batch = input_ids.shape[0]
    lengths = mask.sum(-1).tolist()
    requests = [Request(row=b, prompt_index=b, budget=max_new, stream=b, prompt_len=lengths[b],
                        min_tokens=min_new) for b in range(batch)]
    return CallPlan(
        prompt_ids=input_ids, prompt_mask=mask, requests=requests, pad_id=pad if pad is not None else 0,
        eos_ids=tuple(eos), settings=[sampling], stop_sets=[()], sampling_key=sampling, seed=seed, max_new=max_new,
        capacity=he.max_out_tokens, max_active=batch,
        budget=KVBudget(he.kv_page_size, he.kv_cache_tokens, he.kv_cache_bytes, GENERATE.kv_budget, max(lengths),
                        max_new, input_ids.device),
        graphs=he.enable_graph_capture, continuous=False, shared_prefill=False, staged=False,
        sync_interval=SYNC_INTERVAL, logprobs=None,
    )
