"""The ``generate()`` front end: validate, choose a path, run it.

Paths, decided once per call before any decode step:

* **delegated** -- arguments the fast path does not cover (beams, scores,
  ``return_dict_in_generate``, logits processors, repetition penalty, a
  non-default ``generation_config``, right-padded prompts, a model that cannot
  use the static cache) go to transformers' ``model.generate``, eagerly; the
  reason is recorded in ``graph_stats.last_refusal_reason``.
* **eager** -- our own loop over :func:`~hybrid_engine.model_step.prefill` and
  :func:`~hybrid_engine.model_step.decode_one_token` on a fresh static cache,
  with transformers' semantics: EOS is suppressed below ``min_new_tokens``;
  rows that emitted EOS are padded with ``pad_token_id`` and the loop stops
  once every row has finished.
* **graphed** -- the same prefill (never captured) and the same decode step,
  but each decode position is captured once (per :class:`GraphKey`) and
  replayed afterwards. Only for pinned lengths (``min_new_tokens ==
  max_new_tokens``): EOS is then suppressed at every step, so no row can finish
  early and the number of steps is known up front. If a capture fails the
  whole call is rerun eagerly from the prefill.

Both of our paths pick tokens with the same function (greedy argmax, or
:func:`~hybrid_engine.sampling.sample_tokens` keyed by a seed drawn from
torch's global generator at the start of the call), so they give identical
tokens. The graph-safety rules are in :mod:`hybrid_engine.decode_graphs`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from transformers import GenerationConfig

from .accelerator import get_accelerator
from .config import EngineConfig, validate_graph_capture_support
from .decode_graphs import CaptureFailed, GraphEntry, GraphKey, GraphStats, PositionGraphs
from .model_step import check_model_supported, decode_one_token, max_positions, prefill, token_ids
from .sampling import sample_tokens, validate_sampling
from .static_cache import StaticKVCache

__all__ = ["Generator", "graph_gate"]

# kwargs our loop implements, with the values it supports (None: any value).
_FAST_KWARGS: dict[str, Any] = {
    "max_new_tokens": None,
    "min_new_tokens": None,
    "max_length": None,
    "do_sample": None,
    "temperature": None,
    "top_k": None,
    "top_p": None,
    "pad_token_id": None,
    "eos_token_id": None,
    "bos_token_id": None,
    "use_cache": True,
    "num_beams": 1,
    "num_return_sequences": 1,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
    "synced_gpus": False,
}
# generation_config fields that change the output if not at their default.
_GEN_CONFIG_FIELDS = (
    "num_beams", "num_beam_groups", "num_return_sequences", "repetition_penalty", "no_repeat_ngram_size",
    "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "min_p", "min_length", "encoder_repetition_penalty",
    "sequence_bias", "renormalize_logits", "guidance_scale", "exponential_decay_length_penalty",
    "return_dict_in_generate", "output_scores", "output_logits", "penalty_alpha", "stop_strings",
    "max_time", "force_words_ids", "constraints", "watermarking_config", "diversity_penalty",
    "length_penalty", "prompt_lookup_num_tokens", "assistant_early_exit", "dola_layers", "cache_implementation",
)
_DEFAULT_GEN_CONFIG = GenerationConfig()
GRAPHS_OFF = "hybrid_engine.enable_graph_capture is off, so decode runs eagerly."


def graph_gate(config: EngineConfig, accelerator: Any, *, pinned: bool, disabled: bool = False) -> str | None:
    """Why a call may not use graphs (``None``: it may). The config/backend part is
    :func:`~hybrid_engine.config.validate_graph_capture_support`."""
    if not config.hybrid_engine.enable_graph_capture:
        return GRAPHS_OFF
    reason = validate_graph_capture_support(config, accelerator)
    if reason is not None:
        return reason
    if disabled:
        return "Graphs were disabled for this engine after repeated capture failures; decode runs eagerly."
    if not pinned:
        return (
            "The generation length is not pinned (min_new_tokens != max_new_tokens), so the number of decode "
            "steps is unknown up front; pass min_new_tokens=max_new_tokens to use graphs."
        )
    return None


@dataclasses.dataclass
class _Plan:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    new_tokens: int
    min_new_tokens: int
    sampling: tuple  # (do_sample, temperature, top_k, top_p)
    eos: list[int]
    pad: int | None


class Generator:
    """Owns one engine's graph store and runs its ``generate`` calls (see module docstring)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig):
        self.model = model
        self.config = config
        self.graphs = PositionGraphs(get_accelerator())
        self._warned: set[str] = set()
        self._last_reason: str | None = GRAPHS_OFF if not config.hybrid_engine.enable_graph_capture else None

    # --------------------------------------------------------------- stats
    def gate_reason(self, pinned: bool = True) -> str | None:
        return graph_gate(self.config, get_accelerator(), pinned=pinned, disabled=self.graphs.disabled)

    def stats(self) -> GraphStats:
        s = dataclasses.replace(self.graphs.stats)
        s.last_refusal_reason = self._last_reason
        s.enabled = self.gate_reason() is None
        return s

    def _refuse(self, reason: str) -> None:
        self._last_reason = reason
        if self.config.hybrid_engine.enable_graph_capture and reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(reason, UserWarning, stacklevel=4)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, UserWarning, stacklevel=4)

    # ----------------------------------------------------------- validation
    def _validate(self, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(args) > 1:
            raise TypeError("generate() takes at most one positional argument (the input ids)")
        input_ids = kwargs.pop("input_ids", None)
        inputs = args[0] if args else kwargs.pop("inputs", None)
        if inputs is not None and input_ids is not None:
            raise ValueError("generate(): pass the prompt once, as input_ids= (not also as inputs)")
        input_ids = input_ids if input_ids is not None else inputs
        if input_ids is None:
            raise ValueError("generate(): input_ids is required (a [batch, prompt_len] integer tensor)")
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"generate(): input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(
                f"generate(): input_ids must hold integer token ids (torch.long), got {input_ids.dtype}; "
                "convert with input_ids.long()"
            )
        if input_ids.dim() != 2:
            raise ValueError(
                f"generate(): input_ids must be 2-D [batch, prompt_len], got shape {tuple(input_ids.shape)}; "
                "use input_ids.unsqueeze(0) for a single prompt"
            )
        if input_ids.shape[0] == 0:
            raise ValueError("generate(): input_ids is an empty batch (batch size 0); pass at least one prompt")
        if input_ids.shape[1] == 0:
            raise ValueError("generate(): input_ids has prompt length 0; pass at least one prompt token")
        vocab = getattr(self.model.config, "vocab_size", None)
        if vocab is not None and bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise ValueError(f"generate(): input_ids holds token ids outside the vocabulary [0, {vocab})")
        mask = kwargs.pop("attention_mask", None)
        if mask is not None:
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"generate(): attention_mask must be a torch.Tensor, got {type(mask).__name__}")
            if tuple(mask.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"generate(): attention_mask shape {tuple(mask.shape)} does not match input_ids shape "
                    f"{tuple(input_ids.shape)}; pass the mask returned with the input ids by the tokenizer"
                )
        return input_ids, mask

    def _lengths(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> tuple[int, int]:
        gen = self.model.generation_config
        width = input_ids.shape[1]
        max_new = kwargs.get("max_new_tokens")
        if max_new is None:
            if kwargs.get("max_length") is not None:
                max_new = kwargs["max_length"] - width
            elif gen.max_new_tokens is not None:
                max_new = gen.max_new_tokens
            else:
                max_new = (gen.max_length or 20) - width
        min_new = kwargs.get("min_new_tokens")
        if min_new is None:
            min_new = gen.min_new_tokens or 0
        for name, value in (("max_new_tokens", max_new), ("min_new_tokens", min_new)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"generate(): {name} must be an int, got {type(value).__name__}")
        if max_new <= 0:
            raise ValueError(
                f"generate(): max_new_tokens must be > 0, got {max_new} (with max_length, it must exceed the "
                f"prompt length {width})"
            )
        if not 0 <= min_new <= max_new:
            raise ValueError(f"generate(): min_new_tokens ({min_new}) must be in 0..max_new_tokens ({max_new})")
        total = width + max_new
        limit = max_positions(self.model.config)
        if limit is not None and total > limit:
            raise ValueError(
                f"generate(): prompt length {width} + max_new_tokens {max_new} = {total} exceeds the model's "
                f"{limit} positions; shorten the prompt or lower max_new_tokens"
            )
        cap = self.config.hybrid_engine.max_out_tokens
        if total > cap:
            raise ValueError(
                f"generate(): prompt length {width} + max_new_tokens {max_new} = {total} exceeds "
                f"hybrid_engine.max_out_tokens={cap}; raise max_out_tokens or generate fewer tokens"
            )
        return max_new, min_new

    def _unsupported(self, kwargs: dict[str, Any], mask: torch.Tensor | None) -> str | None:
        """Why our loop cannot run this call (delegate to transformers), or ``None``."""
        odd = []
        for name, value in kwargs.items():
            if name not in _FAST_KWARGS:
                odd.append(name)
            elif _FAST_KWARGS[name] is not None and value is not None and value != _FAST_KWARGS[name]:
                odd.append(f"{name}={value!r}")
        if odd:
            return (
                f"generate({', '.join(odd)}) is not covered by the fast decode path; delegated to transformers' "
                "generate, which runs eagerly."
            )
        gen = self.model.generation_config
        changed = [
            f for f in _GEN_CONFIG_FIELDS
            if hasattr(gen, f) and getattr(gen, f) != getattr(_DEFAULT_GEN_CONFIG, f, None)
        ]
        if changed:
            return (
                f"The model's generation_config sets {', '.join(changed)}, which the fast decode path does not "
                "implement; delegated to transformers' generate, which runs eagerly."
            )
        if mask is not None and not bool(mask[:, -1].bool().all()):
            return "The prompts are not left-padded; delegated to transformers' generate, which runs eagerly."
        try:
            check_model_supported(self.model)
        except (TypeError, ValueError) as exc:
            return f"The model cannot use the static KV cache ({exc}); delegated to transformers' generate."
        return None

    def _plan(self, input_ids, mask, kwargs, max_new, min_new) -> _Plan:
        gen = self.model.generation_config
        device = next(self.model.parameters()).device
        ids = input_ids.to(device=device, dtype=torch.long)
        eos = list(token_ids(kwargs.get("eos_token_id", gen.eos_token_id)))
        pad = kwargs.get("pad_token_id", gen.pad_token_id)
        if pad is None and eos:
            pad = eos[0]
        if mask is None:
            # transformers infers the mask from padding when it can tell padding from EOS.
            if pad is not None and pad not in eos and bool((ids == pad).any()):
                mask = (ids != pad).long()
            else:
                mask = torch.ones_like(ids)
        mask = mask.to(device=device, dtype=torch.long)
        do_sample = bool(kwargs.get("do_sample", gen.do_sample))
        if do_sample:
            temperature = kwargs.get("temperature", gen.temperature)
            top_k = kwargs.get("top_k", gen.top_k)
            top_p = kwargs.get("top_p", gen.top_p)
            temperature = 1.0 if temperature is None else float(temperature)
            top_k = 0 if top_k is None else int(top_k)
            top_p = 1.0 if top_p is None else float(top_p)
            validate_sampling(temperature, top_p, top_k)
            sampling: tuple = (True, temperature, top_k, top_p)
        else:
            sampling = (False, 0.0, 0, 1.0)
        return _Plan(ids, mask, max_new, min_new, sampling, eos, None if pad is None else int(pad))

    # ----------------------------------------------------------------- run
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        input_ids, mask = self._validate(args, kwargs)
        max_new, min_new = self._lengths(input_ids, kwargs)
        reason = self._unsupported(kwargs, mask)
        if reason is not None:
            self._refuse(reason)
            if mask is not None:
                kwargs["attention_mask"] = mask
            return self.model.generate(input_ids=input_ids, **kwargs)
        plan = self._plan(input_ids, mask, kwargs, max_new, min_new)
        # One seed per call, from torch's global generator (torch.manual_seed makes it reproducible).
        seed = int(torch.randint(0, 2**62, (1,)).item()) if plan.sampling[0] else 0
        pinned = min_new == max_new
        acc = get_accelerator()
        if self.graphs.accelerator is not acc:
            self.graphs.clear()
            self.graphs.accelerator = acc
        reason = graph_gate(self.config, acc, pinned=pinned, disabled=self.graphs.disabled)
        try:
            with torch.no_grad():
                if reason is not None:
                    self._refuse(reason)
                    return self._run_eager(plan, seed)
                return self._run_graphed(plan, seed)
        finally:
            if self.config.hybrid_engine.release_inference_cache:
                self.graphs.clear()

    def _pick(self, plan: _Plan, buf: GraphEntry, logits: torch.Tensor, index: int) -> torch.Tensor:
        """Next token of every row from ``logits [B, V]`` for new-token ``index`` (capture-safe)."""
        logits = logits.float()
        if buf.suppress is not None and index < plan.min_new_tokens:
            logits = logits.index_fill(-1, buf.suppress, float("-inf"))
        do_sample, temperature, top_k, top_p = plan.sampling
        if not do_sample:
            return torch.argmax(logits, dim=-1)
        tokens, _ = sample_tokens(
            logits, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=buf.seed, request_index=buf.rows, token_index=index,
        )
        return tokens

    def _buffers(self, plan: _Plan, key: GraphKey | None = None) -> GraphEntry:
        ids = plan.input_ids
        batch, width = ids.shape
        dtype = next(self.model.parameters()).dtype
        device = ids.device
        cache = StaticKVCache(self.model.config, batch, width + plan.new_tokens, device=device, dtype=dtype)
        cache.bounds_checks = False  # lengths were validated up front; skip the per-step host read
        return GraphEntry(
            key=key,  # type: ignore[arg-type]
            cache=cache,
            tokens=torch.zeros(batch, plan.new_tokens, dtype=torch.long, device=device),
            seed=torch.zeros((), dtype=torch.int64, device=device),
            rows=torch.arange(batch, dtype=torch.int64, device=device),
            suppress=torch.tensor(plan.eos, dtype=torch.int64, device=device) if plan.eos else None,
        )

    def _step_fn(self, plan: _Plan, buf: GraphEntry):
        width = plan.input_ids.shape[1]
        model = self.model

        def step(p: int) -> None:
            buf.cache.kv_len = width + p + 1
            logits = decode_one_token(model, buf.cache, buf.tokens[:, p])
            buf.tokens[:, p + 1].copy_(self._pick(plan, buf, logits, p + 1))

        return step

    def _prefill(self, plan: _Plan, buf: GraphEntry, seed: int) -> None:
        buf.seed.fill_(seed)
        buf.cache.kv_len = None
        logits = prefill(self.model, buf.cache, plan.input_ids, plan.attention_mask)
        buf.tokens[:, 0].copy_(self._pick(plan, buf, logits, 0))

    def _run_eager(self, plan: _Plan, seed: int) -> torch.Tensor:
        buf = self._buffers(plan)
        self._prefill(plan, buf, seed)
        step = self._step_fn(plan, buf)
        eos = buf.suppress
        tokens = buf.tokens
        unfinished = None
        if eos is not None and plan.pad is not None:
            unfinished = ~torch.isin(tokens[:, 0], eos)
        generated = 1
        for p in range(plan.new_tokens - 1):
            if unfinished is not None and not bool(unfinished.any()):
                break
            step(p)
            generated += 1
            if unfinished is not None:
                col = tokens[:, p + 1]
                col.copy_(torch.where(unfinished, col, torch.full_like(col, plan.pad)))
                unfinished &= ~torch.isin(col, eos)
        buf.cache.kv_len = None
        return torch.cat([plan.input_ids, tokens[:, :generated]], dim=1)

    def _run_graphed(self, plan: _Plan, seed: int) -> torch.Tensor:
        ids = plan.input_ids
        batch, width = ids.shape
        dtype = next(self.model.parameters()).dtype
        suppressed = tuple(plan.eos) if plan.min_new_tokens > 0 else ()
        key = GraphKey(batch, width, plan.new_tokens, dtype, str(ids.device), plan.sampling, suppressed)
        store = self.graphs
        store.check_weights(self.model)
        entry = store.entry(key, self.model, self.config.hybrid_engine.max_out_tokens)
        step = self._step_fn(plan, entry)
        try:
            self._prefill(plan, entry, seed)
            for p in range(plan.new_tokens - 1):
                store.run_position(entry, p, step, self.model)
        except CaptureFailed as exc:
            store.discard(key)
            disabled = store.record_failure()
            self._warn_once(
                f"Graph capture failed ({exc.__cause__!r} at decode position {exc.position}); this call and "
                "later failing calls rerun eagerly. Counted in graph_stats.fallbacks."
            )
            if disabled:
                self._warn_once(
                    f"Graph capture failed {store.failures} times; graphs are disabled for this engine."
                )
            self._last_reason = str(exc)
            return self._run_eager(plan, seed)
        finally:
            entry.cache.kv_len = None
        self._last_reason = None
        return torch.cat([ids, entry.tokens], dim=1)
