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
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode.model_support import check_model_supported
from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.exact.mode import check_exact_support, exact_kernels
from hybrid_engine.generation.call import empty_call_stats, run_call
from hybrid_engine.generation.call_context import decode_grad_mode, eval_for_generation, exclusive_model_call
from hybrid_engine.generation.plan import plan_rollout
from hybrid_engine.generation.stop_strings import StopStrings
from hybrid_engine.generation.token_ids import MAX_TOKEN_ID, token_ids
from hybrid_engine.graphs import handoff
from hybrid_engine.graphs.runner import DecodeGraphRunner
from hybrid_engine.graphs.stats import GraphStats
from hybrid_engine.model_access import check_device, decode_model, model_device
from hybrid_engine.rollout.episodes import Episodes, TurnRows
from hybrid_engine.rollout.handoff import sleep_optimizer_during_generation
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
        self._graphs_asked = False  # a sleep asked for "graphs" (kept: sleeping_tags says so)

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
        with exclusive_model_call(self.model, "HybridEngineRollout.release"):
            self.runner.release()

    def invalidate_graphs(self) -> None:
        """Drop every graph (the buffers stay); the next call captures again. Needed only after a change the
        graph fingerprint cannot see, such as a module-level function patched (:mod:`hybrid_engine.graphs.fingerprint`)."""
        with exclusive_model_call(self.model, "HybridEngineRollout.invalidate_graphs"):
            self.runner.invalidate()

    # ------------------------------------------------------------ sleep/wake
    def sleep(self, tags: Any = None) -> None:
        """Release this rollout's memory between rollouts, every graph kept: ``"kv_cache"`` (the page pool with
        the rings and linear states, at the same addresses; contents discarded, kept episode pages evicted first;
        a backend without VMM drops them and the graphs, counted in ``graph_stats.sleep_drops``) and ``"graphs"``
        (kept on every backend so far: :attr:`sleeping_tags` says so). ``None``: both. Waits for a running call
        on this model; the next ``generate`` wakes what it needs (``last_stats["wakes"]``). See
        ``docs/memory-handoff.md``."""
        tags = handoff.check_tags(tags, "HybridEngineRollout.sleep", default=handoff.ROLLOUT_TAGS,
                                  allowed=handoff.ROLLOUT_TAGS)
        with exclusive_model_call(self.model, "HybridEngineRollout.sleep"):
            self._graphs_asked = handoff.sleep_runners([self.runner], tags) or self._graphs_asked

    def wake(self, tags: Any = None) -> None:
        """Take back what :meth:`sleep` released (``None``: everything asleep), at the same addresses: the next
        call captures nothing new."""
        handoff.check_tags(tags, "HybridEngineRollout.wake", default=handoff.ROLLOUT_TAGS,
                           allowed=handoff.ROLLOUT_TAGS)
        with exclusive_model_call(self.model, "HybridEngineRollout.wake"):
            handoff.wake_runners([self.runner])
            self._graphs_asked = False

    @property
    def sleeping_tags(self) -> handoff.SleepingTags:
        """The tags asleep now; ``.kept``: those asked to sleep that keep their memory, and why."""
        asleep, kept = handoff.runners_sleeping([self.runner], self._graphs_asked)
        return handoff.SleepingTags(asleep, kept)

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
        with exclusive_model_call(self.model, "HybridEngineRollout.generate"), gathered_for_inference(self.model):
            return self._generate(request, sampling)

    def generate_turn(self, request: RolloutRequest, sampling: SamplingConfig, turn: TurnRows) -> RolloutBatch:
        """An episode turn (:meth:`Episodes.turn` calls it): ``generate`` with one output row per entry of
        ``turn``, each continuing its prompt row on the pages an earlier call kept and keeping its own.
        ``turn.guard`` runs around the work under the model's lock: the episode checks the weights once its turn
        has come (after any training call it waited for) and gives back what a failed call kept."""
        with exclusive_model_call(self.model, "HybridEngineRollout.generate"), gathered_for_inference(self.model), \
                (turn.guard() if turn.guard is not None else contextlib.nullcontext()):
            return self._generate(request, sampling, turn)

    def _generate(self, request: RolloutRequest, sampling: SamplingConfig | None,
                  turn: TurnRows | None = None) -> RolloutBatch:
        """``generate``'s work: check the call into a plan (:mod:`hybrid_engine.generation.plan`), run it
        (:func:`~hybrid_engine.generation.call.run_call`) and assemble the batch. ``turn`` (an episode turn, one
        sample per prompt): the output rows, each continuing a prompt row on the pages an earlier call kept, and
        keeping its own."""
        t_start = time.perf_counter()
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"generate: request must be a RolloutRequest, got {type(request).__name__}")
        request.validate()  # its fields may have changed since construction
        if sampling is None:
            sampling = SamplingConfig()
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"generate: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        model = self.model
        check_device("generate: RolloutRequest.prompt_ids", request.prompt_ids, model)
        check_device("generate: RolloutRequest.prompt_attention_mask", request.prompt_attention_mask, model)
        pad_id, eos_ids = self._special_ids()
        self._check_model()
        stop_strings = self._stop_strings(sampling)
        if request.prompt_ids.shape[0] == 0:  # an empty shard: the call's gather (ZeRO-3) is all it takes part in
            return self._empty_batch(request, t_start)
        plan = plan_rollout(model, self.config, request, sampling, pad_id=pad_id, eos_ids=eos_ids,
                            stop_strings=stop_strings, turn=turn, max_rows=DEFAULT_MAX_BATCH_SIZE,
                            device=model_device(model))
        runner = self.runner
        he = runner.config.hybrid_engine if runner.config is not None else None
        release = he is not None and (he.release_inference_cache or he.sleep_between_phases)
        if he is not None and he.sleep_between_phases:
            sleep_optimizer_during_generation(self.engine)
        with self._inference_mode():
            out = run_call(runner, plan, t_start=t_start, profiling=self.config.enable_profiling, release=release)
            if turn is not None:
                turn.kept = out.kept
            batch = self._assemble(plan.prompt_ids, plan.prompt_mask, out.responses, out.logprobs, out.lengths,
                                   torch.tensor([r.prompt_index for r in plan.requests], device=plan.prompt_ids.device))
            if sampling.top_logprobs:
                real = batch.response_mask[:, batch.response_start_idx:, None]
                width = out.responses.shape[1]
                batch.top_logprob_ids = out.results.top_ids[:, :width].masked_fill(~real, -1)
                batch.top_logprobs = out.results.top_logprobs[:, :width].masked_fill(~real, 0.0)
        self.total_graph_captures += out.stats["graph_captures"]
        self.last_stats = out.stats
        return batch

    def _empty_batch(self, request: RolloutRequest, t_start: float) -> RolloutBatch:
        """The batch of a request with no prompts: no rows, no response columns; ``last_stats`` says so."""
        ids, mask = request.prompt_ids, request.prompt_attention_mask
        empty = torch.zeros(0, dtype=torch.int64, device=ids.device)
        self.last_stats = empty_call_stats(self.runner, t_start, self.config.enable_profiling)
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
