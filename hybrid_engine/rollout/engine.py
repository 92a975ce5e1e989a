"""``HybridEngineRollout``: RL rollouts from the engine's model with captured, reused decode graphs.

The rollout object owns one :class:`~.decode_graph.SlotState` per batch
bucket and keeps it (cache, per-slot state and captured graphs) across
``generate`` calls, so a decode step is captured once per (bucket, sampling
knobs) and replayed for every later step of every later call, also after
optimizer steps (in-place updates are read through the same addresses). A
parameter that was re-allocated changes :func:`~hybrid_engine.graph_safety.weight_fingerprint`
and drops the bucket's graphs, so the next step recaptures instead of reading
stale weights.

Every refusal is raised before any work: invalid inputs (in the value types),
missing pad/EOS ids, a cache capacity below prompt + ``max_new_tokens``,
prompts beyond the model's position limit, attention implementations that
cannot take the static cache's 4D mask (``flash_attention_2``), and models
whose forward does not accept an external cache. An accelerator that cannot
capture, or a capture that fails, gives a warning and the eager path.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.accelerator import get_accelerator
from hybrid_engine.graph_safety import suspended_hooks, weight_fingerprint
from hybrid_engine.model_step import check_model_supported, max_positions, token_ids
from hybrid_engine.timing import PhaseTimer

from .decode_graph import SlotState
from .scheduler import Counters, RequestSpec, run_schedule
from .types import RolloutBatch, RolloutConfig, RolloutRequest, SamplingConfig, default_graph_buckets

__all__ = ["HybridEngineRollout", "UnsupportedModelError"]


class UnsupportedModelError(ValueError, TypeError):
    """The model cannot run on the static cache (raised before any work)."""


def _unwrap_model(engine: Any) -> PreTrainedModel:
    if isinstance(engine, PreTrainedModel):
        return engine
    module = getattr(engine, "module", None)
    if isinstance(module, PreTrainedModel):
        return module
    raise TypeError(
        "HybridEngineRollout: engine must be a HybridEngine (with .module a transformers PreTrainedModel) "
        f"or a transformers PreTrainedModel, got {type(engine).__name__}"
    )


class _StepRunner:
    """Runs one decode step: eagerly, or by replaying the bucket's graph (capturing it on first use)."""

    def __init__(self, model: PreTrainedModel, state: SlotState, key: tuple, use_graph: bool,
                 counters: Counters) -> None:
        self.model = model
        self.state = state
        self.key = key
        self.use_graph = use_graph
        self.counters = counters
        self.accelerator = get_accelerator()

    def __call__(self) -> None:
        state, counters = self.state, self.counters
        if not self.use_graph:
            state.step(self.model, self.key)
            counters.eager_steps += 1
            return
        graph = state.graphs.get(self.key)
        if graph is None:
            if not state.warmed_up:
                # Warm-up is a real step: it initialises lazy kernels/workspaces outside capture.
                state.step(self.model, self.key)
                state.warmed_up = True
                counters.eager_steps += 1
                return
            graph = self._capture()
            if graph is None:
                state.step(self.model, self.key)
                counters.eager_steps += 1
                return
        self.accelerator.replay_graph(graph)
        counters.graph_replays += 1

    def _capture(self) -> Any:
        acc, state = self.accelerator, self.state
        t0 = time.perf_counter()
        graph = acc.create_graph()
        try:
            with suspended_hooks(self.model), acc.capture_to_graph(graph, pool=state.pool):
                state.step(self.model, self.key)
        except Exception as exc:  # a capture failure falls back to eager, as the reference does
            warnings.warn(
                f"HybridEngineRollout: decode-step graph capture failed ({type(exc).__name__}: {exc}); "
                "continuing eagerly for this call",
                RuntimeWarning,
                stacklevel=3,
            )
            self.use_graph = False
            self.counters.fallbacks += 1
            return None
        if state.pool is None:
            state.pool = acc.graph_pool(graph)
        state.graphs[self.key] = graph
        self.counters.graph_captures += 1
        self.counters.capture_s += time.perf_counter() - t0
        return graph


class HybridEngineRollout:
    """Generates RL rollouts (tokens + logprobs) from a ``HybridEngine`` or a transformers model.

    ``tokenizer`` (optional) supplies pad/EOS ids; ``RolloutConfig.pad_token_id``/
    ``eos_token_id`` override them; the model's generation config is the last
    resort. After each :meth:`generate`, :attr:`last_stats` describes the call.
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
        self._states: dict[int, SlotState] = {}
        self._warned_no_graphs = False

    # ---------------------------------------------------------------- setup
    def _special_ids(self) -> tuple[int, tuple[int, ...]]:
        cfg, tok, model = self.config, self.tokenizer, self.model
        gen = getattr(model, "generation_config", None)
        sources = [cfg.pad_token_id, getattr(tok, "pad_token_id", None), getattr(gen, "pad_token_id", None),
                   getattr(model.config, "pad_token_id", None)]
        pad = next((int(p) for p in sources if isinstance(p, int)), None)
        eos_sources = (cfg.eos_token_id, getattr(tok, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                       getattr(model.config, "eos_token_id", None))
        eos = next((ids for ids in map(token_ids, eos_sources) if ids), ())
        if pad is None and not eos:
            raise ValueError(
                "HybridEngineRollout: neither a pad nor an EOS token id is known; pass a tokenizer, or "
                "RolloutConfig(pad_token_id=..., eos_token_id=...), or set model.generation_config ids"
            )
        if pad is None:
            pad = eos[0]
        return pad, eos

    def _graphs_available(self) -> bool:
        if not self.config.use_graph_capture:
            return False
        acc = get_accelerator()
        if acc.create_graph() is None:
            if not self._warned_no_graphs:
                reason = getattr(acc, "graph_unavailable_reason", None) or "no graph API"
                warnings.warn(
                    f"HybridEngineRollout: use_graph_capture=True but the accelerator cannot capture graphs "
                    f"({reason}); decoding eagerly",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._warned_no_graphs = True
            return False
        return True

    def _check_model(self) -> None:
        try:
            check_model_supported(self.model)
        except (TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"HybridEngineRollout: {exc}") from exc

    def _bucket(self, active: int) -> int:
        """The smallest bucket holding ``active`` slots (buckets derive from ``max_batch_size``)."""
        sizes = self.config.graph_batch_sizes or default_graph_buckets(self.config.max_batch_size or active)
        return next((s for s in sizes if s >= active), active)

    def _state(self, batch: int, capacity: int, width: int, num_eos: int) -> SlotState:
        model = self.model
        param = next(model.parameters())
        state = self._states.get(batch)
        same_layout = state is not None and state.cache.device == param.device and state.cache.dtype == param.dtype
        fixed = self.config.cache_capacity is not None
        if not (same_layout and state.fits(batch, capacity, width, num_eos)
                and (not fixed or state.capacity == capacity)):
            if state is not None and same_layout and not fixed:
                capacity = max(capacity, state.capacity)
                width = max(width, state.width)
            state = SlotState(
                model, batch, capacity, width, position_limit=max_positions(model.config),
                device=param.device, dtype=param.dtype, num_eos=num_eos,
            )
            self._states[batch] = state
        fingerprint = weight_fingerprint(model)
        if state.fingerprint != fingerprint:
            state.graphs.clear()  # re-allocated weights: a replay would read the old storage
            state.pool = None
            state.fingerprint = fingerprint
        return state

    def release(self) -> None:
        """Free every cached decode state and graph (the next call re-allocates and recaptures)."""
        self._states.clear()

    @contextlib.contextmanager
    def _inference_mode(self) -> Iterator[None]:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            model.train(was_training)

    # ------------------------------------------------------------- generate
    def generate(self, request: RolloutRequest, sampling: SamplingConfig | None = None) -> RolloutBatch:
        """Sample ``n_samples_per_prompt`` responses per prompt of ``request``; see :class:`RolloutBatch`."""
        t_start = time.perf_counter()
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"generate: request must be a RolloutRequest, got {type(request).__name__}")
        if sampling is None:
            sampling = SamplingConfig()
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"generate: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        cfg, model = self.config, self.model
        pad_id, eos_ids = self._special_ids()
        self._check_model()
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
            raise ValueError(
                f"generate: the longest prompt ({longest} tokens) plus max_new_tokens ({max_new}) exceeds the "
                f"model's position limit {limit}; lower max_new_tokens or truncate the prompts"
            )
        needed = longest + max_new
        if cfg.cache_capacity is not None and cfg.cache_capacity < needed:
            raise ValueError(
                f"generate: RolloutConfig.cache_capacity={cfg.cache_capacity} is below the longest prompt "
                f"({longest}) + max_new_tokens ({max_new}) = {needed}; raise cache_capacity or leave it None"
            )
        vocab = getattr(model.config, "vocab_size", None)
        if isinstance(vocab, int) and int(request.prompt_ids.max()) >= vocab:
            raise ValueError(f"generate: prompt_ids hold ids >= the model's vocab_size {vocab}")
        capacity = cfg.cache_capacity if cfg.cache_capacity is not None else needed

        n = sampling.n_samples_per_prompt
        num_prompts = request.prompt_ids.shape[0]
        budgets = request.max_new_tokens or [max_new] * num_prompts
        uids = request.request_ids or list(range(num_prompts))
        requests = [
            RequestSpec(request_index=i * n + j, prompt_index=i, budget=min(budgets[i], max_new),
                        rng_index=uids[i] * n + j)
            for i in range(num_prompts)
            for j in range(n)
        ]
        # Concurrency: max_batch_size, else the largest explicit bucket, else the whole request.
        limit_slots = cfg.max_batch_size or (max(cfg.graph_batch_sizes) if cfg.graph_batch_sizes else len(requests))
        max_active = min(limit_slots, len(requests))
        bucket = self._bucket(max_active)
        use_graph = self._graphs_available()

        counters = Counters(timer=PhaseTimer(get_accelerator()))
        if cfg.use_graph_capture and not use_graph:
            counters.fallbacks += 1
        with self._inference_mode():
            state = self._state(bucket, capacity, max_new, len(eos_ids))
            device = state.tokens.device
            state.set_special_ids(pad_id, eos_ids)
            prompt_ids = request.prompt_ids.to(device)
            prompt_mask = request.prompt_attention_mask.to(device)
            runner = _StepRunner(model, state, sampling.sampling_key, use_graph, counters)
            out_tokens, out_logprobs = run_schedule(
                model, state, runner, requests, prompt_ids, prompt_mask, sampling,
                max_active=max_active, continuous=cfg.continuous_batching,
                shared_prefill=cfg.use_shared_prefill, sync_interval=cfg.sync_interval, counters=counters,
            )
            batch = self._assemble(prompt_ids, prompt_mask, out_tokens, out_logprobs, counters, n, pad_id)
        get_accelerator().synchronize()
        total_s = time.perf_counter() - t_start
        self.total_graph_captures += counters.graph_captures
        self.last_stats = self._stats(counters, total_s, state, batch, use_graph, bucket)
        return batch

    @staticmethod
    def _assemble(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, out_tokens: torch.Tensor,
                  out_logprobs: torch.Tensor, counters: Counters, n: int, pad_id: int) -> RolloutBatch:
        num = out_tokens.shape[0]
        device = out_tokens.device
        lengths = torch.tensor([counters.lengths[r] for r in range(num)], dtype=torch.int64, device=device)
        width = max(1, max(counters.lengths.values()))
        real = torch.arange(width, device=device)[None, :] < lengths[:, None]
        responses = torch.where(real, out_tokens[:, :width], torch.full_like(out_tokens[:, :width], pad_id))
        logprobs = torch.where(real, out_logprobs[:, :width], torch.zeros_like(out_logprobs[:, :width]))
        prompt_index = torch.arange(num, device=device) // n
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

    def _stats(self, c: Counters, total_s: float, state: SlotState, batch: RolloutBatch, use_graph: bool,
               bucket: int) -> dict[str, Any]:
        tokens = int(sum(c.lengths.values()))
        phases = c.timer.totals_ms()
        stats: dict[str, Any] = {
            "prefill_ms": phases.get("prefill", 0.0),
            "decode_ms": phases.get("decode", 0.0),
            "overhead_ms": max(0.0, total_s * 1e3 - phases.get("prefill", 0.0) - phases.get("decode", 0.0)),
            "total_ms": total_s * 1e3,
            "decode_steps": c.decode_steps,
            "prefill_forwards": c.prefill_forwards,
            "tokens_generated": tokens,
            "tokens_per_second": tokens / total_s if total_s > 0 else 0.0,
            "graph_replays": c.graph_replays,
            "graph_captures": c.graph_captures,
            "fallbacks": c.fallbacks,
            "peak_active_batch": c.peak_active_batch,
            "cache_capacity": state.capacity,
            "cache_memory_bytes": int(state.cache.memory_bytes()),
            "host_syncs": c.host_syncs,
            # extras
            "eager_steps": c.eager_steps,
            "capture_ms": c.capture_s * 1e3,
            "graph_batch_size": bucket,
            "use_graph_capture": use_graph,
            "prefill_rows": c.prefill_rows,
            "kv_row_copies": c.kv_row_copies,
            "admission_rounds": c.admission_rounds,
            "harvests": c.harvests,
            "num_sequences": int(batch.input_ids.shape[0]),
        }
        if self.config.enable_profiling:
            stats["profile"] = {
                "prefill_ms_per_forward": stats["prefill_ms"] / max(1, c.prefill_forwards),
                "decode_ms_per_step": stats["decode_ms"] / max(1, c.decode_steps),
                "capture_ms": stats["capture_ms"],
                "state_memory_bytes": state.memory_bytes(),
            }
        return stats
