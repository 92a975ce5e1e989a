"""The ``generate()`` front end: validate, choose a path, run it.

Paths, decided once per call before any decode step:

* **delegated** -- arguments the fast path does not cover (beams, scores,
  ``return_dict_in_generate``, logits processors, repetition penalty, a
  ``generation_config`` other than the model's own, ``inputs_embeds``,
  right-padded prompts by the passed or the inferred mask, a model that cannot
  use the paged KV cache), and any field of the model's ``generation_config``
  outside :data:`_FAST_PATH_FIELDS` set away from transformers' default (so a
  newer transformers' field is delegated, not ignored), go to transformers'
  ``model.generate``, eagerly; the reason is recorded in
  ``graph_stats.last_refusal_reason``. Arguments at transformers' defaults
  (``repetition_penalty=1.0``, ``num_beams=1``, ``logits_processor=None``...)
  change nothing and are not delegated; unset sampling knobs take
  transformers' defaults (``top_k`` 50).
* **ours** -- the whole batch is prefilled at once (never captured) and decoded
  on the engine's :class:`~hybrid_engine.graphs.runner.DecodeGraphRunner` by the
  slot scheduler (:mod:`hybrid_engine.generation.scheduler`), with transformers'
  semantics: EOS is suppressed below ``min_new_tokens`` (a device comparison in
  the step), rows that emitted EOS are padded with ``pad_token_id``, and the
  output ends once every row has finished. ``synced_gpus=True`` (DeepSpeed-Chat
  passes it under ZeRO-3) stays on this path: no step makes a collective call
  (under ZeRO-3 each rank's call gathers the parameters once, on entry), so a
  rank whose rows finish early has no peer to keep stepping for. Steps replay the graph captured
  for the batch bucket and sampling mode when the graph policy allows it, and
  run the same step eagerly otherwise, so any length, EOS, greedy or sampled
  decoding replays graphs, and changing the prompt width or the length reuses
  them while the cache (``hybrid_engine.max_out_tokens``) holds. As rows
  finish, the survivors move to the smallest bucket that holds them.

Greedy decoding is argmax (also ``do_sample=True`` with ``top_p=0``, which keeps the most likely token, as
transformers' filter does); sampling knobs transformers refuses, or that leave no distribution, are refused
naming ``engine.generate(<knob>=...)`` (or the generation config's field they came from); sampling is
:func:`~hybrid_engine.decode.sampling.sample_tokens` keyed by a seed drawn from
torch's global generator at the start of the call (``torch.manual_seed`` makes
it reproducible), the row index and the token index, so eager and graph steps
pick identical tokens.
"""

from __future__ import annotations

import math
import numbers
import operator
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode.layout import exact_length
from hybrid_engine.decode.model_support import check_model_supported, max_positions
from hybrid_engine.decode.sampling import MIN_TEMPERATURE
from hybrid_engine.distributed.ranks import rank_seed
from hybrid_engine.exact.mode import exact_kernels
from hybrid_engine.generation.call import run_call
from hybrid_engine.generation.plan import (
    GENERATE,
    CallPlan,
    check_batch_size,
    check_generate_length,
    check_positions,
    plan_generate,
)
from hybrid_engine.generation.token_ids import token_id, token_ids
from hybrid_engine.graphs.runner import DecodeGraphRunner
from hybrid_engine.graphs.stats import GraphStats
from hybrid_engine.model_access import check_device, model_device

__all__ = ["GRAPHS_OFF", "GenerateFrontEnd"]

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
    # Any value: a fast-path call makes no collective per step (under ZeRO-3 every rank's call gathers the
    # parameters once, on entry, and decodes locally), so a rank that finishes early has nothing to step on for.
    "synced_gpus": None,
}
# generate()'s own parameters besides the prompt: None is what transformers takes when they are not passed.
_GENERATE_PARAMS = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                    "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids",
                    "negative_prompt_attention_mask", "use_model_defaults", "custom_generate", "tokenizer")
# generation_config fields the fast path implements, or that cannot change what it returns: bookkeeping, and
# settings of modes it never runs (beam search, assisted decoding, encoder-decoder models, compilation). Any
# other field set away from transformers' default (a new transformers version's included) is delegated.
_FAST_PATH_FIELDS = frozenset({
    "max_new_tokens", "min_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
    "pad_token_id", "eos_token_id", "bos_token_id", "use_cache", "transformers_version", "decoder_start_token_id",
    "is_assistant", "compile_config", "disable_compile", "cache_config", "max_cache_len", "prefill_chunk_size",
    "low_memory", "early_stopping", "length_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size",
    "assistant_ensemble_weight", "output_attentions", "output_hidden_states", "remove_invalid_values",
    "return_legacy_cache", "continuous_batching_config", "encoder_no_repeat_ngram_size",
})

def _transformers_defaults() -> dict[str, Any]:
    """The values transformers generates with for fields nobody set: 5.x keeps them apart
    (``_get_default_generation_params``; a fresh ``GenerationConfig`` holds ``None``), 4.x in ``GenerationConfig()``."""
    fresh = GenerationConfig().to_dict()
    extra = getattr(GenerationConfig, "_get_default_generation_params", None)
    return {**fresh, **(extra() if callable(extra) else {})}


_GEN_DEFAULTS = _transformers_defaults()


def unimplemented_generation_fields(gen: Any, fields: Sequence[str] | None = None) -> list[str]:
    """The fields of a ``GenerationConfig`` set away from transformers' defaults that the fast path does not
    implement: among ``fields``, or (``None``) among all its fields, unknown ones included."""
    if fields is None:
        fields = [f for f in vars(gen) if not f.startswith("_") and f not in _FAST_PATH_FIELDS]
    return [f for f in fields if hasattr(gen, f) and _effective(gen, f) != _GEN_DEFAULTS.get(f)]


def _effective(gen: Any, name: str) -> Any:
    """``gen.<name>``, or transformers' default when it is unset (``None``), as transformers resolves it."""
    value = getattr(gen, name, None)
    return _GEN_DEFAULTS.get(name) if value is None else value


def _count(name: str, value: Any) -> int:
    """A token count as an int: Python, NumPy or 0-dim integer tensor values, as transformers takes them."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"generate(): {name} must be an int, got {type(value).__name__}")


GRAPHS_OFF = "hybrid_engine.enable_graph_capture is off (or hybrid_engine.enabled is false), so decode runs eagerly."


#: generate()'s counts of sequences, each an int >= 1 (what each counts, for the error).
_SEARCH_COUNTS = {"num_beams": "the beams kept per prompt", "num_return_sequences": "the sequences returned per prompt",
                  "num_beam_groups": "the groups the beams are split into"}


def _default_max_new_tokens(config: Any, gen: Any, width: int) -> int:
    """What transformers generates when the call names no length: ``max_length - width`` when the model's
    generation config sets a ``max_length`` of its own, else 20 new tokens, within the model's positions."""
    default = GenerationConfig().max_length  # None on transformers 5, 20 on 4.x
    if gen.max_length is not None and gen.max_length != default:
        return gen.max_length - width
    total = (default or 20) + width
    limit = getattr(config, "max_position_embeddings", None)
    return (min(total, limit) if isinstance(limit, int) else total) - width


def _sampling_knobs(gen: Any, kwargs: dict[str, Any]) -> tuple[float, float, int]:
    """``(temperature, top_p, top_k)`` of a ``do_sample=True`` call, checked where they enter: the call's, else the
    model's ``generation_config``'s, else transformers' defaults (top_k 50 on every version), as its generate
    resolves them. Refused as transformers refuses them (temperature 0, negative or NaN; top_k negative or not
    whole; top_p negative), and where they are no distribution (top_p NaN or above 1, temperature infinite) or
    below :data:`~hybrid_engine.decode.sampling.MIN_TEMPERATURE`, where logits / temperature overflow float32.
    ``top_p=0`` keeps only the most likely token, as in transformers: greedy."""
    values, names = {}, {}
    for name in ("temperature", "top_p", "top_k"):
        given = kwargs.get(name) is not None
        values[name] = kwargs[name] if given else _effective(gen, name)
        names[name] = (f"engine.generate({name}={values[name]!r})" if given else
                       f"model.generation_config.{name}={values[name]!r} (engine.generate(do_sample=True) samples "
                       f"with it when the call passes no {name})")
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{names[name]}: {name} must be a number, got {type(value).__name__}")
    temperature, top_p, top_k = values["temperature"], values["top_p"], values["top_k"]
    if math.isnan(temperature) or temperature <= 0:
        raise ValueError(f"{names['temperature']}: do_sample=True needs temperature > 0 (transformers refuses 0, "
                         "negative and NaN temperatures too); pass a temperature such as 1.0, or do_sample=False for "
                         "greedy decoding")
    if math.isinf(temperature):
        raise ValueError(f"{names['temperature']}: the temperature must be finite (logits / inf leave no "
                         "distribution to sample); pass a temperature such as 1.0")
    if temperature < MIN_TEMPERATURE:
        raise ValueError(f"{names['temperature']}: a sampling temperature must be 0 (greedy) or at least "
                         f"{MIN_TEMPERATURE:g} (below it logits / temperature overflow float32); pass do_sample=False "
                         f"for greedy decoding, which is what so small a temperature samples, or temperature >= "
                         f"{MIN_TEMPERATURE:g}")
    if not 0 <= top_p <= 1:  # NaN too
        raise ValueError(f"{names['top_p']}: top_p must be a probability in [0, 1] (1 disables the filter, 0 keeps "
                         "only the most likely token); pass top_p=1.0 for no top-p filter")
    if not isinstance(top_k, numbers.Integral) or not 0 <= top_k < 2**63:
        raise ValueError(f"{names['top_k']}: top_k must be a whole number >= 0 (0 disables the filter; transformers "
                         "refuses negative top_k too); pass top_k=0 for no top-k filter")
    if top_p == 0:
        return (0.0, 1.0, -1)
    return (float(temperature), float(top_p), int(top_k))


class GenerateFrontEnd:
    """Runs one engine's ``generate`` calls on its graph runner (see module docstring)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig):
        self.model = model
        self.runner = DecodeGraphRunner(model, config=config)
        #: The last fast-path call's :class:`~hybrid_engine.graphs.stats.CallStats` dict (``{}`` before one).
        self.last_stats: dict[str, Any] = {}
        #: Transformers' ``generate`` for delegated calls, when the model's own ``generate`` attribute has been
        #: routed to the engine (``None``: ``model.generate``). Without it a delegated call would come back here.
        self.delegate: Any = None
        if not config.hybrid_engine.enable_graph_capture:
            self.runner.note_refusal(GRAPHS_OFF, warn=False)

    @property
    def config(self) -> EngineConfig:
        """The engine's config: the one its runner's graph policy holds (one reference, not two)."""
        return self.runner.config

    # --------------------------------------------------------------- stats
    def gate_reason(self) -> str | None:
        """Why graphs would be refused for a call now, or ``None``."""
        if not self.config.hybrid_engine.enable_graph_capture:
            return GRAPHS_OFF
        return self.runner.refusal()

    def stats(self) -> GraphStats:
        s = self.runner.stats
        s.enabled = self.gate_reason() is None
        return s

    # ----------------------------------------------------------- validation
    def _validate(self, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(args) > 2:
            raise TypeError("generate() takes at most two positional arguments (the input ids and a "
                            "generation_config), as transformers' generate")
        if len(args) == 2:
            if "generation_config" in kwargs:
                raise TypeError("generate() got generation_config both as a positional and a keyword argument")
            kwargs["generation_config"] = args[1]
            args = args[:1]
        gen_config = kwargs.get("generation_config")
        if gen_config is not None and not isinstance(gen_config, GenerationConfig):
            raise TypeError("generate(): generation_config (the keyword, or the second positional argument) must be "
                            f"a transformers GenerationConfig, got {type(gen_config).__name__}; pass settings such "
                            "as max_new_tokens as keyword arguments instead")
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
            raise ValueError("generate(): input_ids is an empty batch (batch size 0); pass at least one prompt (under "
                             "ZeRO-3 every rank must still make each generate call: give every rank a prompt, or "
                             "use HybridEngineRollout, which takes an empty RolloutRequest)")
        if input_ids.shape[1] == 0:
            raise ValueError("generate(): input_ids has prompt length 0; pass at least one prompt token")
        check_device("generate(): input_ids", input_ids, self.model)
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
            check_device("generate(): attention_mask", mask, self.model)
            if bool(((mask != 0) & (mask != 1)).any()):  # other values would become out-of-range positions
                raise ValueError("generate(): attention_mask must hold only 0 (padding) and 1 (a real token); pass "
                                 "the mask returned with the input ids by the tokenizer")
        return input_ids, mask

    def _check_search_counts(self, input_ids: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """The counts transformers divides by or allocates with, checked on every path (a delegated call too)
        before any work: ``num_beams=0`` was a ZeroDivisionError inside transformers, ``num_beams=10**9`` an
        allocator error, ``num_return_sequences=0`` silently one sequence per prompt. The longest prompt's positions
        are checked here too, once for every path (one host read of the mask)."""
        gen = kwargs.get("generation_config")
        gen = gen if isinstance(gen, GenerationConfig) else self.model.generation_config
        counts = {}
        for name in _SEARCH_COUNTS:
            value = kwargs.get(name)
            value = getattr(gen, name, None) if value is None else value
            if value is None:
                continue
            if isinstance(value, bool):
                raise TypeError(f"generate(): {name} must be an int >= 1, got {value!r}")
            counts[name] = _count(name, value)
            if counts[name] < 1:
                raise ValueError(f"generate(): {name} must be >= 1, got {counts[name]} (1 is transformers' default: "
                                 f"{_SEARCH_COUNTS[name]})")
        beams = counts.get("num_beams", 1)
        if counts.get("num_beam_groups", 1) > beams:
            raise ValueError(f"generate(): num_beam_groups ({counts['num_beam_groups']}) must not exceed num_beams "
                             f"({beams}): each group holds at least one beam")
        min_new = kwargs.get("min_new_tokens")
        if min_new is not None and _count("min_new_tokens", min_new) < 0:
            raise ValueError(f"generate(): min_new_tokens must be >= 0, got {min_new}")
        batch, width = input_ids.shape
        max_new = _count("max_new_tokens", self._max_new_tokens(width, kwargs))
        if max_new <= 0:
            return  # refused with the fast path's message, or transformers'
        longest = width if mask is None else int(mask.to(torch.int64).sum(-1).max())
        check_positions(GENERATE, longest, max_new, max_positions(self.model.config), fed=False)
        rows = batch * max(beams, counts.get("num_return_sequences", 1))
        check_batch_size(f"generate(): {batch} prompts x num_beams {beams} x num_return_sequences "
                         f"{counts.get('num_return_sequences', 1)} = {{rows}} rows of {{width}} prompt + {{max_new}} new "
                         "tokens would be more than {limit} tokens in one call; lower num_beams or "
                         "num_return_sequences, or split the batch", rows, width, max_new)

    def _max_new_tokens(self, width: int, kwargs: dict[str, Any]) -> Any:
        """The call's new-token count as transformers resolves it, unchecked: max_new_tokens (the call's, then
        the generation config's) over max_length."""
        gen = self.model.generation_config
        if kwargs.get("max_new_tokens") is not None:
            return kwargs["max_new_tokens"]
        if gen.max_new_tokens is not None:
            return gen.max_new_tokens
        if kwargs.get("max_length") is not None:
            return kwargs["max_length"] - width
        return _default_max_new_tokens(self.model.config, gen, width)

    def _lengths(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> tuple[int, int]:
        gen = self.model.generation_config
        width = input_ids.shape[1]
        max_new = self._max_new_tokens(width, kwargs)
        min_new = kwargs.get("min_new_tokens")
        if min_new is None:
            min_new = gen.min_new_tokens or 0
        max_new, min_new = _count("max_new_tokens", max_new), _count("min_new_tokens", min_new)
        if max_new <= 0:
            raise ValueError(
                f"generate(): max_new_tokens must be > 0, got {max_new} (with max_length, it must exceed the "
                f"prompt length {width})"
            )
        if min_new < 0:
            raise ValueError(f"generate(): min_new_tokens must be >= 0, got {min_new}")
        if min_new > max_new:  # transformers warns and generates max_new_tokens tokens, EOS suppressed throughout
            warnings.warn(f"generate(): min_new_tokens ({min_new}) is larger than max_new_tokens ({max_new}): "
                          f"{max_new} tokens are generated, none of them EOS", UserWarning, stacklevel=4)
            min_new = max_new
        check_generate_length(self.config, width, max_new, max_positions(self.model.config))
        return max_new, min_new

    def _unsupported(self, kwargs: dict[str, Any], mask: torch.Tensor | None) -> str | None:
        """Why our loop cannot run this call (delegate to transformers), or ``None``."""
        odd = []
        for name, value in kwargs.items():
            if name not in _FAST_KWARGS:
                if (name in _GENERATE_PARAMS and value is None) or name == "disable_compile":
                    continue  # not passed, as transformers sees it; nothing here compiles
                if name in _GEN_DEFAULTS and value == _GEN_DEFAULTS[name]:
                    continue  # a field at transformers' default (repetition_penalty=1.0...): nothing to implement
                if name == "generation_config" and value == self.model.generation_config:
                    continue  # the model's own, as the call would use anyway
                odd.append(name)
            elif _FAST_KWARGS[name] is not None and value is not None and value != _FAST_KWARGS[name]:
                odd.append(f"{name}={value!r}")
        if odd:
            return (
                f"generate({', '.join(odd)}) is not covered by the fast decode path; delegated to transformers' "
                "generate, which runs eagerly."
            )
        changed = unimplemented_generation_fields(self.model.generation_config)
        if changed:
            return (
                f"The model's generation_config sets {', '.join(changed)}, which the fast decode path does not "
                "implement; delegated to transformers' generate, which runs eagerly."
            )
        if mask is not None and not bool(mask[:, -1].bool().all()):
            return ("The prompts are not left-padded (as the attention mask, passed or inferred from pad_token_id, "
                    "says); delegated to transformers' generate, which runs eagerly.")
        try:
            check_model_supported(self.model)
        except (TypeError, ValueError) as exc:
            return f"The model cannot use the paged KV cache ({exc}); delegated to transformers' generate."
        limit, capacity = exact_length(self.model.config), self.config.hybrid_engine.max_out_tokens
        if limit is not None and limit.tokens < capacity:
            return (f"The model's {limit.why} makes the paged cache exact only up to {limit.tokens} tokens, less "
                    f"than hybrid_engine.max_out_tokens={capacity}; delegated to transformers' generate. Set "
                    f"max_out_tokens to at most {limit.tokens} for the fast path.")
        return None

    def _special_ids(self, kwargs: dict[str, Any]) -> tuple[list[int], int | None]:
        """(EOS ids, pad id) of the call, as transformers resolves them (pad falls back to the first EOS)."""
        gen = self.model.generation_config
        eos = list(token_ids(kwargs.get("eos_token_id", gen.eos_token_id), "generate(): eos_token_id"))
        pad = kwargs.get("pad_token_id", gen.pad_token_id)
        if pad is None and eos:
            pad = eos[0]
        return eos, None if pad is None else token_id(pad, "generate(): pad_token_id")

    def _inferred_mask(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The mask transformers infers when none is passed: from padding, when it can tell padding from EOS."""
        eos, pad = self._special_ids(kwargs)
        if pad is not None and pad not in eos and bool((input_ids == pad).any()):
            return (input_ids != pad).long()
        return None

    def _plan(self, input_ids: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any], max_new: int,
              min_new: int, seed_of: Any) -> CallPlan:
        """The fast path's :class:`CallPlan`: ids and mask on the model's device, the call's sampling knobs, special
        ids, and a seed (``seed_of()``, drawn only when the call samples)."""
        gen = self.model.generation_config
        device = model_device(self.model)
        ids = input_ids.to(device=device, dtype=torch.long)
        eos, pad = self._special_ids(kwargs)
        mask = (torch.ones_like(ids) if mask is None else mask).to(device=device, dtype=torch.long)
        do_sample = bool(kwargs.get("do_sample", _effective(gen, "do_sample")))
        sampling = _sampling_knobs(gen, kwargs) if do_sample else (0.0, 1.0, -1)
        seed = seed_of() if sampling[0] > 0 else 0
        return plan_generate(self.config, ids, mask, max_new=max_new, min_new=min_new, sampling=sampling, eos=eos,
                             pad=pad, seed=seed)

    # ----------------------------------------------------------------- run
    def _transformers_generate(self, *args: Any, **kwargs: Any) -> Any:
        return (self.delegate or self.model.generate)(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        t_start = time.perf_counter()
        if kwargs.get("inputs_embeds") is not None:  # the fast path starts from token ids
            self.runner.note_refusal("generate(inputs_embeds=...) is not covered by the fast decode path; delegated "
                                     "to transformers' generate, which runs eagerly.",
                                     warn=self.config.hybrid_engine.enable_graph_capture)
            return self._transformers_generate(*args, **kwargs)
        synced = kwargs.get("synced_gpus")
        if synced is not None and not isinstance(synced, bool):
            raise TypeError(f"generate(): synced_gpus must be True or False, got {synced!r}")
        input_ids, mask = self._validate(args, kwargs)
        effective = mask if mask is not None else self._inferred_mask(input_ids, kwargs)
        self._check_search_counts(input_ids, effective, kwargs)
        reason = self._unsupported(kwargs, effective)
        if reason is not None:  # transformers checks the lengths of what it runs; the paged cache is not used
            self.runner.note_refusal(reason, warn=self.config.hybrid_engine.enable_graph_capture)
            if mask is not None:
                kwargs["attention_mask"] = mask
            return self._transformers_generate(input_ids=input_ids, **kwargs)
        max_new, min_new = self._lengths(input_ids, kwargs)
        # One seed per call, from torch's global generator (torch.manual_seed makes it reproducible), made
        # distinct per data-parallel rank (ranks usually seed alike).
        plan = self._plan(input_ids, effective, kwargs, max_new, min_new,
                          lambda: rank_seed(int(torch.randint(0, 2**62, (1,)).item())))
        he = self.config.hybrid_engine
        if not plan.graphs:
            self.runner.note_refusal(GRAPHS_OFF, warn=False)
        with exact_kernels(self.model, he.exact_logprobs):  # before prepare: graphs are keyed by the mode
            out = run_call(self.runner, plan, t_start=t_start, release=he.release_inference_cache or he.sleep_between_phases)
        self.last_stats = out.stats
        return torch.cat([plan.prompt_ids, out.responses], dim=1)
