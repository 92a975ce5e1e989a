"""``HybridEngineRollout``: RL rollouts from the engine's model, on a decode graph runner of its own.

The rollout owns one :class:`~hybrid_engine.graphs.runner.DecodeGraphRunner`
and keeps it (slots, cache and captured graphs) across ``generate`` calls, so a
decode step is captured once per (batch bucket, page span, sampling mode) and
replayed for every later step of every later call, also after optimizer steps
(in-place updates are read through the same addresses). Scheduling (continuous or static
batching, shared prefill, compaction) is :mod:`hybrid_engine.generation.scheduler`.

Every refusal is raised before any work: invalid inputs (in the value types),
missing pad/EOS ids, a cache capacity below prompt + ``max_new_tokens``,
prompts beyond the model's position limit, attention implementations that
cannot take the decode cache's 4D mask (``flash_attention_2``), and models
whose forward does not accept an external cache. Where graphs are unsafe (see
:mod:`hybrid_engine.graphs.policy`; a rollout built on a ``HybridEngine``
honours its engine's config gates) or a capture fails, one warning is given and
decoding runs eagerly with the same tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode.kv_pool import KVBudget
from hybrid_engine.decode.layout import exact_length
from hybrid_engine.decode.model_support import check_model_supported, max_positions
from hybrid_engine.decode.sampling import MAX_SETTINGS, union_mode
from hybrid_engine.decode.staging import staged_width_within, width_bucket
from hybrid_engine.distributed.ranks import rank_seed
from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.exact.mode import check_exact_support, exact_kernels
from hybrid_engine.generation.call_context import decode_grad_mode, eval_for_generation, exclusive_generation
from hybrid_engine.generation.request import Request
from hybrid_engine.generation.scheduler import Counters, gather_responses, run_schedule
from hybrid_engine.generation.stop_strings import StopStrings
from hybrid_engine.generation.timing import PhaseTimer
from hybrid_engine.generation.token_ids import MAX_TOKEN_ID, token_ids
from hybrid_engine.graphs.runner import DecodeGraphRunner
from hybrid_engine.graphs.stats import CallStats, GraphStats
from hybrid_engine.model_access import check_device, decode_model, model_device
from hybrid_engine.rollout.episodes import Episodes, TurnRows
from hybrid_engine.rollout.types import (
    DEFAULT_MAX_BATCH_SIZE,
    RolloutBatch,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
)

__all__ = ["HybridEngineRollout", "UnsupportedModelError"]


class UnsupportedModelError(ValueError, TypeError):
    """The model cannot run on the paged KV cache (raised before any work)."""


def _unwrap_model(engine: Any) -> PreTrainedModel:
    inference = getattr(engine, "inference_module", None)  # a HybridEngine: the model it generates with
    if isinstance(inference, PreTrainedModel):
        return inference
    model = decode_model(engine) if isinstance(engine, torch.nn.Module) else engine
    if isinstance(model, PreTrainedModel):
        return model
    module = getattr(engine, "module", None)
    module = decode_model(module) if isinstance(module, torch.nn.Module) else module
    if isinstance(module, PreTrainedModel):
        return module
    raise TypeError(
        "HybridEngineRollout: engine must be a HybridEngine (with .module a transformers PreTrainedModel) "
        f"or a transformers PreTrainedModel, got {type(engine).__name__}"
    )


#: A change of a rollout's exact mode after construction (``what``: the assignment, ``value``: the mode asked for).
_EXACT_FIXED = ("{what} on a rollout built with exact_logprobs={built}: the mode is fixed when the rollout is built, "
                "where the model is checked for it (a model the exact kernels do not cover, such as linear attention, "
                "is refused there); build a new rollout for the other mode: "
                "HybridEngineRollout(engine, config=RolloutConfig(exact_logprobs={value}))")


#: The most tokens one call's batch may hold (2**31: a 16 GiB int64 tensor), a guard against a mistyped
#: n_samples_per_prompt exhausting host memory before a single step runs.
MAX_BATCH_ELEMENTS = 2**31


class HybridEngineRollout:
    """Generates RL rollouts (tokens + logprobs) from a ``HybridEngine`` or a transformers model.

    ``tokenizer`` (optional) supplies pad/EOS ids; ``RolloutConfig.pad_token_id``/
    ``eos_token_id`` override them; the model's generation config is the last
    resort. After each :meth:`generate`, :attr:`last_stats` describes the call: the keys of
    :class:`~hybrid_engine.graphs.stats.CallStats`, the same for every call (an empty request's are zeros); a
    call that raises leaves it as it was.
    """

    def __init__(self, engine: Any, tokenizer: Any = None, config: RolloutConfig | None = None) -> None:
        if config is None:
            config = RolloutConfig()
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"HybridEngineRollout: config must be a RolloutConfig, got {type(config).__name__}")
        self.engine = engine
        self.model = _unwrap_model(engine)
        self.tokenizer = tokenizer
        self.config = config
        self.last_stats: dict[str, Any] = {}
        self.total_graph_captures = 0
        engine_config = getattr(engine, "config", None)
        engine_exact = isinstance(engine_config, EngineConfig) and engine_config.hybrid_engine.exact_logprobs
        exact = engine_exact if config.exact_logprobs is None else config.exact_logprobs
        if exact:
            check_exact_support(self.model)
        self._exact_logprobs: bool = exact
        self.runner = DecodeGraphRunner(
            self.model,
            config=engine_config if isinstance(engine_config, EngineConfig) else None,
            buckets=config.graph_batch_sizes,
        )

    @property
    def exact_logprobs(self) -> bool:
        """Whether calls run the exact mode's batch-invariant kernels (:mod:`hybrid_engine.exact`). Fixed at
        construction, where the model was checked for it (and graphs are captured in it)."""
        return self._exact_logprobs

    @exact_logprobs.setter
    def exact_logprobs(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"HybridEngineRollout.exact_logprobs must be True or False, got {type(value).__name__} "
                            f"({value!r})")
        if value != self._exact_logprobs:
            raise ValueError(_EXACT_FIXED.format(what=f"HybridEngineRollout.exact_logprobs = {value}", value=value,
                                                 built=self._exact_logprobs))

    @property
    def config(self) -> RolloutConfig:
        """The :class:`RolloutConfig` calls run with; may be replaced between calls (not its ``exact_logprobs``,
        which is fixed at construction: ``None`` keeps the rollout's mode)."""
        return self._config

    @config.setter
    def config(self, config: RolloutConfig) -> None:
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"HybridEngineRollout: config must be a RolloutConfig, got {type(config).__name__}")
        exact = self.__dict__.get("_exact_logprobs")  # None while the constructor sets it up
        if exact is not None and config.exact_logprobs is not None and config.exact_logprobs != exact:
            value = config.exact_logprobs
            raise ValueError(_EXACT_FIXED.format(
                what=f"HybridEngineRollout.config = RolloutConfig(exact_logprobs={value})", value=value, built=exact))
        self._config = config

    # ---------------------------------------------------------------- setup
    def _special_ids(self) -> tuple[int, tuple[int, ...]]:
        cfg, tok, model = self.config, self.tokenizer, self.model
        gen = getattr(model, "generation_config", None)
        sources = [cfg.pad_token_id, getattr(tok, "pad_token_id", None), getattr(gen, "pad_token_id", None),
                   getattr(model.config, "pad_token_id", None)]
        # A negative id (old Llama configs carry -1) is no token: the next source, or the first EOS, pads.
        pad = next((int(p) for p in sources if isinstance(p, int) and 0 <= p <= MAX_TOKEN_ID), None)
        eos_sources = (cfg.eos_token_id, getattr(tok, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                       getattr(model.config, "eos_token_id", None))
        eos = next((ids for ids in (token_ids(s, "HybridEngineRollout: eos_token_id") for s in eos_sources) if ids),
                   ())
        if pad is None and not eos:
            raise ValueError(
                "HybridEngineRollout: neither a pad nor an EOS token id is known; pass a tokenizer, or "
                "RolloutConfig(pad_token_id=..., eos_token_id=...), or set model.generation_config ids"
            )
        if pad is None:
            pad = eos[0]
        return pad, eos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids a response ends on (from the config, the tokenizer or the model, as ``generate`` reads)."""
        return self._special_ids()[1]

    def _stop_strings(self, sampling: SamplingConfig) -> StopStrings | None:
        if not sampling.stop_strings:
            return None
        if self.tokenizer is None or not callable(getattr(self.tokenizer, "decode", None)):
            raise ValueError("generate: SamplingConfig.stop_strings are matched on decoded text, so the rollout "
                             "needs a tokenizer: HybridEngineRollout(engine, tokenizer=...); or pass token ids as "
                             "stop_token_ids")
        return StopStrings(self.tokenizer, sampling.stop_strings)

    def _check_model(self) -> None:
        try:
            check_model_supported(self.model)
        except (TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"HybridEngineRollout: {exc}") from exc

    def release(self) -> None:
        """Free the decode slots and every graph (the next call re-allocates and recaptures). Waits for a
        ``generate`` running in another thread on this model, as ``generate`` calls wait for each other."""
        with exclusive_generation(self.model, "HybridEngineRollout.release"):
            self.runner.release()

    def invalidate_graphs(self) -> None:
        """Drop every graph (the buffers stay); the next call captures again. Needed only after a change the
        graph fingerprint cannot see, such as a module-level function patched (:mod:`hybrid_engine.graphs.fingerprint`)."""
        with exclusive_generation(self.model, "HybridEngineRollout.invalidate_graphs"):
            self.runner.invalidate()

    @property
    def graph_stats(self) -> GraphStats:
        """The runner's cumulative counters (captures, replays, fallbacks, refusal reason, memory);
        ``enabled``: whether this rollout's next call may replay graphs."""
        stats = self.runner.stats
        stats.enabled = bool(self.config.use_graph_capture) and self.runner.refusal() is None
        return stats

    @contextlib.contextmanager
    def _inference_mode(self) -> Iterator[None]:
        with eval_for_generation(self.model), decode_grad_mode(), exact_kernels(self.model, self.exact_logprobs):
            yield

    # ------------------------------------------------------------- generate
    def open_episodes(self, request: RolloutRequest, n_samples_per_prompt: int = 1, *,
                      reuse_kv: bool = True) -> Episodes:
        """Multi-turn episodes on this rollout, ``n_samples_per_prompt`` rows per prompt, each turn continuing on
        the K/V its row's last turn left (``reuse_kv``): see :class:`~hybrid_engine.rollout.episodes.Episodes`
        (``turn``, ``append``, ``close``)."""
        return Episodes(self, request, n_samples_per_prompt, reuse_kv=reuse_kv)

    def generate(self, request: RolloutRequest, sampling: SamplingConfig | None = None) -> RolloutBatch:
        """Sample ``n_samples_per_prompt`` responses per prompt of ``request``; see :class:`RolloutBatch`.

        Concurrent calls on one model (this rollout, other rollouts or the engine built on it) are
        serialised: each returns exactly what it would alone (:mod:`hybrid_engine.generation.call_context`).
        In a data-parallel run each rank samples with its own seed derived from ``sampling.seed``
        (:func:`hybrid_engine.distributed.ranks.rank_seed`). On a ZeRO-3 model the call gathers the parameters
        once (collective: every rank must call) and decodes eagerly on them.
        """
        with exclusive_generation(self.model, "HybridEngineRollout.generate"), gathered_for_inference(self.model):
            return self._generate(request, sampling)

    def generate_turn(self, request: RolloutRequest, sampling: SamplingConfig, turn: TurnRows) -> RolloutBatch:
        """An episode turn (:meth:`Episodes.turn` calls it): ``generate`` with one output row per entry of
        ``turn``, each continuing its prompt row on the pages an earlier call kept and keeping its own.
        ``turn.guard`` runs around the work under the model's lock: the episode checks the weights once its turn
        has come (after any training call it waited for) and gives back what a failed call kept."""
        with exclusive_generation(self.model, "HybridEngineRollout.generate"), gathered_for_inference(self.model), \
                (turn.guard() if turn.guard is not None else contextlib.nullcontext()):
            return self._generate(request, sampling, turn)

    def _generate(self, request: RolloutRequest, sampling: SamplingConfig | None,
                  turn: TurnRows | None = None) -> RolloutBatch:
        """``generate``'s work; ``turn`` (an episode turn, one sample per prompt): the output rows, each continuing
        a prompt row on the pages an earlier call kept, and keeping its own for the next."""
        t_start = time.perf_counter()
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"generate: request must be a RolloutRequest, got {type(request).__name__}")
        request.validate()  # its fields may have changed since construction
        if sampling is None:
            sampling = SamplingConfig()
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"generate: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        cfg, model = self.config, self.model
        check_device("generate: RolloutRequest.prompt_ids", request.prompt_ids, model)
        check_device("generate: RolloutRequest.prompt_attention_mask", request.prompt_attention_mask, model)
        pad_id, eos_ids = self._special_ids()
        self._check_model()
        stop_strings = self._stop_strings(sampling)
        if request.prompt_ids.shape[0] == 0:  # an empty shard: the call's gather (ZeRO-3) is all it takes part in
            return self._empty_batch(request, t_start)
        prompt_lengths = request.prompt_lengths
        longest = max(prompt_lengths)
        max_new = sampling.max_new_tokens
        limit = max_positions(model.config)
        if limit is not None and longest > limit:
            raise ValueError(
                f"generate: a prompt has {longest} tokens, more than the model's position limit {limit}; "
                "truncate the prompts"
            )
        if limit is not None and longest + max_new > limit:
            # One more than decoding needs (the last token is never fed back): a rollout is for training, and
            # the training forward over prompt + response feeds every token.
            raise ValueError(
                f"generate: the longest prompt ({longest} tokens) plus max_new_tokens ({max_new}) exceeds the "
                f"model's position limit {limit}, so the training forward over prompt + response could not run; "
                "lower max_new_tokens or truncate the prompts"
            )
        if limit is not None and cfg.cache_capacity is not None and cfg.cache_capacity > limit:
            # Prompts are staged within the capacity, so `limit` slots always hold prompt + response.
            raise ValueError(
                f"generate: RolloutConfig.cache_capacity={cfg.cache_capacity} is more than the model's position "
                f"limit {limit}: every slot's KV row is allocated at that length, and no row can use more than "
                f"{limit} positions; use cache_capacity={limit} or less, or None to size the cache per call"
            )
        needed = longest + max_new
        exact = exact_length(model.config)
        if exact is not None and needed > exact.tokens:
            raise ValueError(
                f"generate: the model's {exact.why} makes the paged cache exact only up to {exact.tokens} tokens, "
                f"and the longest prompt ({longest}) + max_new_tokens ({max_new}) = {needed} is more; lower "
                "max_new_tokens or truncate the prompts (engine.generate hands such sequences to transformers' generate)"
            )
        if exact is not None and cfg.cache_capacity is not None and cfg.cache_capacity > exact.tokens:
            raise ValueError(
                f"generate: RolloutConfig.cache_capacity={cfg.cache_capacity} is more than the {exact.tokens} tokens "
                f"the model's {exact.why} lets the paged cache hold exactly; use cache_capacity={exact.tokens} or "
                "less, or None to size the cache per call"
            )
        if cfg.cache_capacity is not None and cfg.cache_capacity < needed:
            raise ValueError(
                f"generate: RolloutConfig.cache_capacity={cfg.cache_capacity} is below the longest prompt "
                f"({longest}) + max_new_tokens ({max_new}) = {needed}; raise cache_capacity or leave it None"
            )
        vocab = getattr(model.config, "vocab_size", None)
        if isinstance(vocab, int) and int(request.prompt_ids.max()) >= vocab:
            raise ValueError(f"generate: prompt_ids hold ids >= the model's vocab_size {vocab}")
        if isinstance(vocab, int) and sampling.top_logprobs > vocab:
            raise ValueError(f"generate: SamplingConfig.top_logprobs={sampling.top_logprobs} is more than the "
                             f"model's vocab_size {vocab}; ask for at most {vocab}")
        if isinstance(vocab, int) and any(i >= vocab for q in sampling.stop_token_ids for i in q):
            raise ValueError(f"generate: SamplingConfig.stop_token_ids hold ids >= the model's vocab_size {vocab}; "
                             "such a sequence could never be generated")
        for i, stops in enumerate(request.stop_token_ids or ()):
            if isinstance(vocab, int) and stops is not None and any(t >= vocab for q in stops for t in q):
                raise ValueError(f"generate: RolloutRequest.stop_token_ids (prompt {i}) hold ids >= the model's "
                                 f"vocab_size {vocab}; such a sequence could never be generated")
        # Prompts are staged for prefill at their padded width, rounded up to a power of two (see
        # hybrid_engine.decode.staging): the cache holds that plus the responses, within a configured capacity.
        prompt_width = width_bucket(request.prompt_ids.shape[1])
        capacity = cfg.cache_capacity
        if capacity is None:
            capacity = prompt_width + max_new
            if exact is not None:
                capacity = min(capacity, exact.tokens)  # a padded stage must not reach past a window
        if prompt_width > capacity - max_new:  # on a coarse grid, so that staged widths (graph keys) stay few
            prompt_width = staged_width_within(longest, capacity - max_new)

        n = sampling.n_samples_per_prompt
        num_prompts = request.prompt_ids.shape[0]
        if num_prompts * n * (request.prompt_ids.shape[1] + max_new) > MAX_BATCH_ELEMENTS:
            raise ValueError(
                f"generate: {num_prompts} prompts x n_samples_per_prompt={n} rows of {request.prompt_ids.shape[1]} "
                f"prompt + {max_new} new tokens would be more than {MAX_BATCH_ELEMENTS} tokens in one batch; lower "
                "n_samples_per_prompt or split the request"
            )
        budgets = request.max_new_tokens or [max_new] * num_prompts
        uids = request.request_ids or list(range(num_prompts))
        if (max(uids) + 1) * n > 2**63:  # each sample's random stream is request_id * n + sample, an int64
            raise ValueError(
                f"generate: RolloutRequest.request_ids up to {max(uids)} with n_samples_per_prompt={n} overflow "
                f"int64 sampler counters (request_id * n + sample); keep request_ids below {2**63 // n}"
            )
        # Per-prompt sampling: the call's distinct settings (and stop sets) go into the knob table, one graph of
        # their union mode.
        settings = request.settings(sampling)
        distinct = list(dict.fromkeys(settings))
        if len(distinct) > MAX_SETTINGS:
            raise ValueError(f"generate: the request mixes {len(distinct)} distinct (temperature, top_p, top_k, stops) "
                             f"settings, more than {MAX_SETTINGS}; split it into several calls")
        knob_values = [s[:3] for s in distinct]
        sampling_key = knob_values[0] if len(distinct) == 1 else union_mode(knob_values)
        knob_of = [distinct.index(s) for s in settings]
        seeds = [None if request.seed is None or s is None else rank_seed(s) for s in request.seed or [None] * num_prompts]
        if turn is None:
            requests = [
                Request(row=i * n + j, prompt_index=i, budget=min(budgets[i], max_new),
                        stream=uids[i] * n + j, prompt_len=prompt_lengths[i], knob=knob_of[i], seed=seeds[i])
                for i in range(num_prompts)
                for j in range(n)
            ]
        else:
            row_budgets = turn.budgets or [max_new] * len(turn.rng)
            requests = [
                Request(row=r, prompt_index=i, budget=min(budgets[i], max_new, b), stream=rng,
                        prompt_len=prompt_lengths[i], knob=knob_of[i], seed=seeds[i], held=held)
                for r, (i, rng, held, b) in enumerate(zip(turn.prompt_of, turn.rng, turn.held, row_budgets))
            ]
        # Concurrency: max_batch_size, else the largest explicit bucket, else DEFAULT_MAX_BATCH_SIZE.
        limit_slots = cfg.max_batch_size or (max(cfg.graph_batch_sizes) if cfg.graph_batch_sizes
                                             else DEFAULT_MAX_BATCH_SIZE)
        max_active = min(limit_slots, len(requests))

        runner = self.runner
        before = runner.stats
        with self._inference_mode():
            budget = KVBudget(cfg.kv_page_size, cfg.kv_cache_tokens, cfg.kv_cache_bytes, "RolloutConfig.kv_cache",
                              longest, max_new, model_device(model))
            state = runner.prepare(rows=max_active, capacity=capacity, num_eos=len(eos_ids),
                                   graphs=cfg.use_graph_capture, budget=budget, prompt_width=prompt_width,
                                   top_logprobs=sampling.top_logprobs)
            counters = Counters(timer=PhaseTimer(runner.accelerator, state.device))
            if turn is not None and state.cache.states is not None:
                # Rows with state layers or windowed rings keep no states between calls: whole histories
                requests = [dataclasses.replace(r, held=None) for r in requests]
                turn.kept = None
            state.set_special_ids(pad_id, eos_ids)
            state.set_stop_sequences([s[3] for s in distinct])
            prompt_ids = request.prompt_ids.to(state.device)
            prompt_mask = request.prompt_attention_mask.to(state.device)
            results = run_schedule(
                runner, requests, prompt_ids, prompt_mask, sampling_key, rank_seed(sampling.seed),
                width=max_new, max_active=max_active, continuous=cfg.continuous_batching,
                shared_prefill=cfg.use_shared_prefill, staged=True,
                sync_interval=cfg.sync_interval, counters=counters, logprobs=sampling.logprobs,
                top_logprobs=sampling.top_logprobs, settings=knob_values,
                stop_strings=stop_strings, kept=turn.kept if turn is not None else None,
            )
            responses, logprobs, lengths = gather_responses(results.tokens, counters.lengths, pad_id,
                                                            results.logprobs)
            prompt_index = torch.tensor([r.prompt_index for r in requests], device=state.device)
            batch = self._assemble(prompt_ids, prompt_mask, responses, logprobs, lengths, prompt_index)
            if sampling.top_logprobs:
                real = batch.response_mask[:, batch.response_start_idx:, None]
                width = responses.shape[1]
                batch.top_logprob_ids = results.top_ids[:, :width].masked_fill(~real, -1)
                batch.top_logprobs = results.top_logprobs[:, :width].masked_fill(~real, 0.0)
        with runner.accelerator.on_device(state.device):  # the model's device, not the current one
            runner.accelerator.synchronize()
        total_s = time.perf_counter() - t_start
        runner.note_call_pages(counters.kv_pages_peak, counters.preemptions)
        graph = runner.stats
        self.total_graph_captures += graph.captures - before.captures
        self.last_stats = self._stats(counters, total_s, before, graph, batch, runner.bucket_for(max_active))
        if runner.config is not None and runner.config.hybrid_engine.release_inference_cache:
            runner.release()  # as the engine does after each generate
        return batch

    def _empty_batch(self, request: RolloutRequest, t_start: float) -> RolloutBatch:
        """The batch of a request with no prompts: no rows, no response columns; ``last_stats`` says so."""
        ids, mask = request.prompt_ids, request.prompt_attention_mask
        empty = torch.zeros(0, dtype=torch.int64, device=ids.device)
        # The schema's defaults (nothing happened), the buffers as they stand, and the call's time.
        held = self.runner.stats
        total_ms = (time.perf_counter() - t_start) * 1e3
        self.last_stats = CallStats(total_ms=total_ms, overhead_ms=total_ms, use_graph_capture=self.runner.use_graphs,
                                    cache_memory_bytes=held.cache_memory_bytes, kv_page_size=held.kv_page_size,
                                    kv_pages_total=held.kv_pages_total,
                                    profile=self._profile(0.0, 0, 0.0, 0, 0.0, held)).to_dict()
        return RolloutBatch(input_ids=ids, attention_mask=mask, response_start_idx=ids.shape[1],
                            response_logprobs=torch.zeros(0, 0, dtype=torch.float32, device=ids.device),
                            response_lengths=empty, prompt_index=empty)

    @staticmethod
    def _assemble(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                  logprobs: torch.Tensor, lengths: torch.Tensor, prompt_index: torch.Tensor) -> RolloutBatch:
        real = torch.arange(responses.shape[1], device=responses.device)[None, :] < lengths[:, None]
        ids = prompt_ids.index_select(0, prompt_index)
        mask = prompt_mask.index_select(0, prompt_index)
        return RolloutBatch(
            input_ids=torch.cat([ids, responses], dim=1),
            attention_mask=torch.cat([mask, real.to(mask.dtype)], dim=1),
            response_start_idx=prompt_ids.shape[1],
            response_logprobs=logprobs,
            response_lengths=lengths,
            prompt_index=prompt_index,
        )

    def _stats(self, c: Counters, total_s: float, before: GraphStats, after: GraphStats, batch: RolloutBatch,
               bucket: int) -> dict[str, Any]:
        tokens = int(sum(c.lengths.values()))
        phases = c.timer.totals_ms()
        slots = self.runner.slots
        prefill_ms, decode_ms = phases.get("prefill", 0.0), phases.get("decode", 0.0)
        capture_ms = (after.capture_seconds - before.capture_seconds) * 1e3
        stats = CallStats(
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            overhead_ms=max(0.0, total_s * 1e3 - prefill_ms - decode_ms),
            total_ms=total_s * 1e3,
            decode_steps=c.decode_steps,
            prefill_forwards=c.prefill_forwards,
            tokens_generated=tokens,
            tokens_per_second=tokens / total_s if total_s > 0 else 0.0,
            graph_replays=after.replays - before.replays,
            graph_captures=after.captures - before.captures,
            admission_graph_replays=after.admission_replays - before.admission_replays,
            admission_graph_captures=after.admission_captures - before.admission_captures,
            fallbacks=after.fallbacks - before.fallbacks,
            peak_active_batch=c.peak_active_batch,
            cache_capacity=slots.capacity,
            cache_memory_bytes=after.cache_memory_bytes,
            kv_page_size=after.kv_page_size,
            kv_pages_total=after.kv_pages_total,
            kv_pages_peak=c.kv_pages_peak,
            kv_pages_held_peak=c.kv_pages_held_peak,
            kv_bytes_peak=after.kv_bytes_peak,
            preemptions=c.preemptions,
            span_buckets=tuple(sorted(c.span_steps)),
            span_steps=dict(c.span_steps),
            host_syncs=c.host_syncs,
            eager_steps=after.eager_steps - before.eager_steps,
            capture_ms=capture_ms,
            graph_batch_size=bucket,
            use_graph_capture=self.runner.use_graphs,
            last_refusal_reason=after.last_refusal_reason,
            prefill_rows=c.prefill_rows,
            prefill_tokens=c.prefill_tokens,
            kv_reused_tokens=c.kv_reused_tokens,
            kv_row_copies=c.kv_row_copies,
            admission_rounds=c.admission_rounds,
            harvests=c.harvests,
            compactions=c.compactions,
            rows_moved=c.rows_moved,
            bucket_steps=dict(c.bucket_steps),
            num_sequences=int(batch.input_ids.shape[0]),
            profile=self._profile(prefill_ms, c.prefill_forwards, decode_ms, c.decode_steps, capture_ms, after),
        )
        return stats.to_dict()

    def _profile(self, prefill_ms: float, prefill_forwards: int, decode_ms: float, decode_steps: int,
                 capture_ms: float, after: GraphStats) -> dict[str, Any] | None:
        """``last_stats["profile"]``: per-forward and per-step times and memory with ``enable_profiling``, else
        ``None``."""
        if not self.config.enable_profiling:
            return None
        slots = self.runner.slots
        return {
            "prefill_ms_per_forward": prefill_ms / max(1, prefill_forwards),
            "decode_ms_per_step": decode_ms / max(1, decode_steps),
            "capture_ms": capture_ms,
            "state_memory_bytes": slots.memory_bytes() if slots is not None else 0,
            "graph_memory_bytes": after.graph_memory_bytes,
        }
