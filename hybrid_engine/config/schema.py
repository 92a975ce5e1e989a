"""DeepSpeed-style engine configuration, validated once, up front.

Every config (dict, JSON file or ``EngineConfig``) goes through ``load_config``
before the engine starts, which checks types and ranges, derives the batch-size
triple, migrates the deprecated ``enable_cuda_graph`` alias (and DeepSpeed's legacy
``bfloat16`` name of ``bf16``), rejects typos and unresolved ``"auto"`` values.
Graph-capture gates and the rest of the engine can then read plain, trusted
fields instead of re-checking raw dictionaries on the hot path, and every
mistake surfaces as one ``ValueError`` naming the dotted field and the fix.
"""

from __future__ import annotations

import difflib
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hybrid_engine.decode.kv_pool import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from hybrid_engine.distributed.world import world_size
from hybrid_engine.user_warnings import user_stacklevel

__all__ = ["BF16Config", "EngineConfig", "FP16Config", "HybridEngineConfig", "MAX_CACHE_TOKENS", "MAX_LR",
           "OptimizerConfig", "ZeroConfig"]


#: The most tokens a decode cache row may be configured to hold (``hybrid_engine.max_out_tokens``,
#: ``RolloutConfig.cache_capacity``): 2**24, 16M, above any model's positions today. Where they are used, both are
#: checked against the model's own position limit as well, before anything is allocated.
MAX_CACHE_TOKENS = 2**24


#: The largest learning rate a config may give (``optimizer.params.lr`` and a scheduler's ``*_lr`` params):
#: an Adam-family step moves every weight by about ``lr``, and typical values are 1e-6 to 1e-2, so a larger one
#: is a typo (``1e308`` made every weight NaN), refused before any step.
MAX_LR = 10.0


#: fp16 loss scales (``loss_scale``, ``min_loss_scale``, ``2**initial_scale_power``) are within
#: ``[2**MIN_LOSS_SCALE_POWER, 2**MAX_LOSS_SCALE_POWER]``: fp16 holds magnitudes 2**-24 to 65504 (about 2**16),
#: a scale above 2**32 overflows nearly every gradient (every step skipped, and a static scale never comes down)
#: and one below 2**-24 flushes them to zero (its inverse overflows fp32 for 1e-45).
MIN_LOSS_SCALE_POWER, MAX_LOSS_SCALE_POWER = -24, 32


_DEPRECATED_ALIAS = "enable_cuda_graph"


_ALIAS_TARGET = "enable_graph_capture"


#: DeepSpeed's legacy name of the ``bf16`` section (``BFLOAT16_OLD`` in deepspeed/runtime/precision_config.py).
_BF16_LEGACY = "bfloat16"


_OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


#: DeepSpeed's other optimizer names (``deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS`` and its 1-bit ones).
_DEEPSPEED_OPTIMIZERS = ("adagrad", "lamb", "lion", "muadam", "muadamw", "musgd", "muon", "onebitadam",
                         "zerooneadam", "onebitlamb")


# Sections that change training which DeepSpeed 0.19 has removed (its config refuses them): refused at stage 0,
# where nothing would apply them; at stages 1-3 DeepSpeed's own config check answers.
_REMOVED_FROM_DEEPSPEED = ("amp", "sparse_attention", "progressive_layer_drop")


# Real DeepSpeed top-level keys we do not use: passed through untouched, never
# reported as misspellings of our own keys.
_DEEPSPEED_PASSTHROUGH = frozenset(
    (
        "wall_clock_breakdown",
        "zero_allow_untested_optimizer",
        "activation_checkpointing",
        "gradient_predivide_factor",
        "prescale_gradients",
        "sparse_gradients",
        "communication_data_type",
        "amp",
        "scheduler",
        "zero_force_ds_cpu_optimizer",
        "checkpoint",
        "data_types",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comms_logger",
        "elasticity",
        "pipeline",
        "compression_training",
        "aio",
        "autotuning",
        "data_efficiency",
        "curriculum_learning",
        "sparse_attention",
        "dump_state",
        "memory_breakdown",
        "disable_allgather",
        "graph_harvesting",
        "seq_parallel_communication_data_type",
        "use_node_local_storage",
        "load_universal_checkpoint",
        "eigenvalue",
        "progressive_layer_drop",
        "quantize_training",
        "weight_quantization",
        "nebula",
        "timers",
    )
)


def _suggest(key: str, valid: list[str]) -> str | None:
    matches = difflib.get_close_matches(key.lower(), valid, n=1, cutoff=0.8)
    return matches[0] if matches else None


#: Where an ``"auto"`` value is refused: the top-level fields we read, and the sections whose values we read or
#: hand to a constructor (the optimizer's and scheduler's params). DeepSpeed's own sections we only pass
#: through (``zero_optimization``'s buckets, ``data_types``...) are left to DeepSpeed, whose section models
#: read ``"auto"`` there as "the default".
_AUTO_CHECKED_FIELDS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                        "gradient_clipping", "steps_per_print")


_AUTO_CHECKED_SECTIONS = ("fp16", "bf16", _BF16_LEGACY, "optimizer", "scheduler", "hybrid_engine")


#: Keys whose own value ``"auto"`` is (a setting of ours, not a template placeholder).
_AUTO_VALUED = ("hybrid_engine.fused_decode",)


def _auto_paths(value: Any, path: str) -> list[str]:
    if isinstance(value, str):
        return [path] if value.strip().lower() == "auto" else []
    if isinstance(value, Mapping):
        return [p for key, item in value.items() for p in _auto_paths(item, f"{path}.{key}")]
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in _auto_paths(item, f"{path}[{i}]")]
    return []


def _refuse_auto(data: Mapping[str, Any]) -> None:
    """Refuse the ``"auto"`` placeholders of Hugging Face's DeepSpeed config templates, naming each key path
    (except the keys whose own value "auto" is: :data:`_AUTO_VALUED`)."""
    paths = [p for key in _AUTO_CHECKED_FIELDS if key in data for p in _auto_paths(data[key], key)]
    paths += [p for key in _AUTO_CHECKED_SECTIONS if key in data for p in _auto_paths(data[key], key)
              if p not in _AUTO_VALUED]
    zero = data.get("zero_optimization")
    if isinstance(zero, Mapping) and "stage" in zero:
        paths += _auto_paths(zero["stage"], "zero_optimization.stage")
    if paths:
        raise ValueError(
            f'"auto" must be resolved to a value before hybrid-engine reads the config ({", ".join(paths)}): '
            "hybrid-engine does not resolve \"auto\" (Hugging Face's Trainer fills it in from its own arguments "
            "only when it builds the DeepSpeed config itself); set each to the value to use"
        )


class ZeroConfig(BaseModel):
    """``zero_optimization``: the stage is checked, other DeepSpeed keys pass through (DeepSpeed checks them
    at stages 1-3); a key that looks like a misspelt ``stage`` is refused, since it would mean stage 0."""

    model_config = ConfigDict(extra="allow")

    stage: StrictInt = Field(default=0)

    @model_validator(mode="before")
    @classmethod
    def _misspelt_stage(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "stage" not in data:
            for key in data:
                if isinstance(key, str) and _suggest(key, ["stage"]) is not None:
                    raise ValueError(f"unknown zero_optimization key {key!r}; did you mean 'stage'?")
        return data

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, value: int) -> int:
        if not 0 <= value <= 3:
            raise ValueError(
                f"zero_optimization.stage must be 0, 1, 2 or 3 (got {value}); DeepSpeed ZeRO has no other stage"
            )
        return value


#: DeepSpeed's own keys of the fp16 and bf16 sections (``DeepSpeedFP16Config``/``DeepSpeedBF16Config``, which
#: refuse any other) beyond those we read, with DeepSpeed's defaults. They configure DeepSpeed's optimizers, so
#: only take effect at ZeRO stages 1-3; stage 0 (plain PyTorch) refuses a value other than the default.
_FP16_DEEPSPEED_KEYS = {"auto_cast": False, "fp16_master_weights_and_grads": False}


_BF16_DEEPSPEED_KEYS = {"immediate_grad_update": False, "bf16_master_weights_and_grads": False,
                        "bf16_optimizer_states": False}


def _refuse_unknown(section: str, data: Any, known: list[str], deepspeed_keys: Mapping[str, bool]) -> Any:
    if isinstance(data, Mapping):
        known = [*known, *deepspeed_keys]
        for key in data:
            if key not in known:
                hint = _suggest(str(key), known)
                raise ValueError(f"unknown {section} key {key!r}" + (f"; did you mean {hint!r}?" if hint else
                                                                     f"; valid keys are {', '.join(known)}"))
        for key in deepspeed_keys:
            if key in data and not isinstance(data[key], bool):
                raise ValueError(f"{section}.{key} must be true or false (got {data[key]!r})")
    return data


def _refuse_deepspeed_only_at_stage_0(section: str, extras: Mapping[str, Any],
                                      deepspeed_keys: Mapping[str, bool]) -> None:
    for key, default in deepspeed_keys.items():
        if extras.get(key, default) != default:
            raise ValueError(
                f"{section}.{key}={extras[key]!r} needs zero_optimization.stage >= 1: it configures DeepSpeed's "
                f"optimizer, and stage 0 trains in plain PyTorch in one process, which would ignore it; set "
                f"zero_optimization.stage to 1, 2 or 3, or remove {section}.{key}"
            )


class FP16Config(BaseModel):
    """``fp16``: mixed precision with loss scaling (``loss_scale=0`` means dynamic). As in DeepSpeed, a key
    that is not one of the section's is refused (a typo of ``enabled`` would silently train in fp32)."""

    model_config = ConfigDict(extra="allow")

    enabled: StrictBool = False
    loss_scale: StrictFloat = Field(default=0.0, ge=0)
    initial_scale_power: StrictInt = Field(default=16, ge=0)
    # The dynamic scale's policy, with DeepSpeed's defaults (hybrid_engine.training.local.LossScalePolicy).
    loss_scale_window: StrictInt = Field(default=1000, gt=0)
    hysteresis: StrictInt = Field(default=2, ge=1)
    consecutive_hysteresis: StrictBool = False
    min_loss_scale: StrictFloat = Field(default=1.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        return _refuse_unknown("fp16", data, list(cls.model_fields), _FP16_DEEPSPEED_KEYS)

    @field_validator("loss_scale", "min_loss_scale")
    @classmethod
    def _scale_in_fp16_range(cls, value: float, info: ValidationInfo) -> float:
        low, high = 2.0**MIN_LOSS_SCALE_POWER, 2.0**MAX_LOSS_SCALE_POWER
        dynamic = " (0 means dynamic)" if info.field_name == "loss_scale" else ""
        if not (value == 0 and info.field_name == "loss_scale") and not low <= value <= high:  # NaN fails too
            raise ValueError(
                f"fp16.{info.field_name} must be between 2**{MIN_LOSS_SCALE_POWER} and 2**{MAX_LOSS_SCALE_POWER}"
                f"{dynamic}, got {value!r}: fp16 holds magnitudes 2**-24 to 65504, so a larger scale overflows "
                "every gradient and a smaller one flushes them to zero, and either way every step is skipped; "
                "DeepSpeed's defaults are loss_scale 0 (dynamic, from 2**16) and min_loss_scale 1")
        return value

    @field_validator("initial_scale_power")
    @classmethod
    def _power_in_fp16_range(cls, value: int) -> int:
        if value > MAX_LOSS_SCALE_POWER:
            raise ValueError(
                f"fp16.initial_scale_power must be at most {MAX_LOSS_SCALE_POWER}, got {value}: the dynamic loss "
                f"scale starts at 2**initial_scale_power, fp16 holds magnitudes up to 65504 (about 2**16), and each "
                "power too many costs skipped steps while the scale comes down (past 2**127 it is no fp32 number "
                "at all); DeepSpeed's default is 16")
        return value

    @model_validator(mode="after")
    def _min_scale_below_the_start(self) -> FP16Config:
        if self.loss_scale == 0 and self.min_loss_scale > 2.0**self.initial_scale_power:
            raise ValueError(
                f"fp16.min_loss_scale ({self.min_loss_scale:g}) is above the dynamic scale's start, "
                f"2**fp16.initial_scale_power = {2.0**self.initial_scale_power:g}: the first overflow would raise "
                "the scale instead of lowering it; lower min_loss_scale or raise initial_scale_power")
        return self


class BF16Config(BaseModel):
    """``bf16`` (or DeepSpeed's legacy name ``bfloat16``): bfloat16 mixed precision. ``check_grad_overflow``
    (default on, as in DeepSpeed) skips an optimizer step whose gradients are not finite. Unknown keys are
    refused, as in DeepSpeed; its ZeRO-only keys (``bf16_master_weights_and_grads``, ...) pass through."""

    model_config = ConfigDict(extra="allow")

    enabled: StrictBool = False
    check_grad_overflow: StrictBool = True

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        return _refuse_unknown("bf16", data, list(cls.model_fields), _BF16_DEEPSPEED_KEYS)

    @model_validator(mode="after")
    def _optimizer_states_need_master_weights(self) -> BF16Config:
        extras = self.model_extra or {}
        if extras.get("bf16_optimizer_states") and not extras.get("bf16_master_weights_and_grads"):
            raise ValueError("bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads: true (as in "
                             "DeepSpeed, optimizer states are kept in bf16 only with bf16 master weights)")
        return self


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _non_finite_paths(value: Any, path: str) -> list[str]:
    """The dotted paths under ``value`` that hold NaN or an infinity."""
    if _is_number(value):
        return [] if math.isfinite(value) else [f"{path}={value!r}"]
    if isinstance(value, Mapping):
        return [p for key, item in value.items() for p in _non_finite_paths(item, f"{path}.{key}")]
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in _non_finite_paths(item, f"{path}[{i}]")]
    return []


def _refuse_non_finite(value: Any, path: str) -> None:
    bad = _non_finite_paths(value, path)
    if bad:
        raise ValueError(f"{', '.join(bad)}: every number in {path} must be finite (NaN or an infinity there "
                         "makes every weight NaN, or skips every step); give a finite value")


def _check_lr(value: Any, path: str) -> None:
    if not _is_number(value):
        raise ValueError(f"{path} must be a number, got {value!r}")  # noqa: TRY004 - pydantic wants ValueError
    if not 0 <= value <= MAX_LR:
        raise ValueError(f"{path} must be between 0 and {MAX_LR:g}, got {value!r}: an Adam-family step moves each "
                         "weight by about lr (typical values are 1e-6 to 1e-2), so a larger one makes the weights "
                         "diverge or NaN; give the learning rate you mean")


#: Decoupled weight decay multiplies each weight by ``1 - lr * weight_decay`` every step (AdamW, and SGD's L2
#: term alike): at ``lr * weight_decay >= 1`` every weight is zeroed or flips sign at each step.
_DECAYING_TYPES = ("AdamW", "Adam", "SGD")


def _check_optimizer_params(kind: str, params: Mapping[str, Any]) -> None:
    """Finite numbers everywhere; ``lr`` within ``[0, MAX_LR]``; ``weight_decay``, ``eps`` >= 0 and ``betas`` in
    ``[0, 1)``; decay that would zero the weights refused: each would make every weight NaN (or zero) silently."""
    _refuse_non_finite(params, "optimizer.params")
    if "lr" in params:
        _check_lr(params["lr"], "optimizer.params.lr")
    for key in ("weight_decay", "eps", "momentum"):
        value = params.get(key)
        if value is not None and (not _is_number(value) or value < 0):
            raise ValueError(f"optimizer.params.{key} must be a number >= 0, got {value!r}")
    betas = params.get("betas")
    if isinstance(betas, (list, tuple)):
        for i, beta in enumerate(betas):
            if not _is_number(beta) or not 0 <= beta < 1:
                raise ValueError(f"optimizer.params.betas[{i}] must be a number in [0, 1), got {beta!r}: the "
                                 "moments are running averages with that decay")
    decay, lr = params.get("weight_decay"), params.get("lr", 1e-3)  # 1e-3: torch's and this engine's SGD default
    if kind in _DECAYING_TYPES and _is_number(decay) and _is_number(lr) and lr * decay >= 1:
        raise ValueError(f"optimizer.params: lr ({lr:g}) * weight_decay ({decay:g}) = {lr * decay:g} is >= 1, so "
                         "each step would multiply every weight by 1 - lr * weight_decay <= 0 (zeroing or "
                         "flipping it); typical weight_decay values are 0 to 0.1")


#: torch.optim.lr_scheduler's base classes: no schedule of their own (``get_lr`` raises NotImplementedError).
_ABSTRACT_SCHEDULERS = ("LRScheduler", "_LRScheduler")


#: torch schedules' int params that divide the step count (0 is a ZeroDivisionError at the first step).
_SCHEDULE_PERIODS = {"StepLR": ("step_size",), "CosineAnnealingLR": ("T_max",), "CosineAnnealingWarmRestarts": ("T_0",),
                     "CyclicLR": ("step_size_up",)}


def _check_scheduler(section: Any) -> None:
    """The ``scheduler`` section's values, checked at every stage (at ZeRO 1-3 DeepSpeed builds and steps it,
    and would not say a word): finite numbers, learning rates within ``[0, MAX_LR]``, no abstract base class,
    no zero period. Stage 0 also steps a stand-in copy of the schedule once it is built
    (:func:`hybrid_engine.training.local.build_scheduler`)."""
    if not isinstance(section, Mapping):
        return  # the builder says what shape it must have
    kind, params = section.get("type"), section.get("params")
    if isinstance(kind, str) and kind.strip() in _ABSTRACT_SCHEDULERS:
        raise ValueError(f"scheduler.type {kind!r} is torch's abstract base class of LR schedules (it has no "
                         "schedule: its first step raises NotImplementedError); name a schedule such as WarmupLR, "
                         "WarmupDecayLR, StepLR or CosineAnnealingLR")
    _refuse_non_finite(params, "scheduler.params")
    if not isinstance(params, Mapping):
        return
    for key, value in params.items():
        if isinstance(key, str) and (key == "lr" or key.endswith("_lr") or key == "eta_min"):
            for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
                if item is not None:
                    _check_lr(item, f"scheduler.params.{key}" + (f"[{i}]" if isinstance(value, (list, tuple)) else ""))
    for key in _SCHEDULE_PERIODS.get(kind, ()) if isinstance(kind, str) else ():
        value = params.get(key)
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
            raise ValueError(f"scheduler.params.{key} must be an int >= 1 for {kind}, got {value!r}: the schedule "
                             f"divides the step count by it (0 is a ZeroDivisionError at the first step)")


class OptimizerConfig(BaseModel):
    """``optimizer``: ``type`` is normalised to its canonical spelling."""

    model_config = ConfigDict(extra="allow")

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> str:
        valid = ", ".join(_OPTIMIZER_TYPES.values())
        if not isinstance(value, str):
            raise ValueError(  # noqa: TRY004 - pydantic only converts ValueError into a field error
                f"optimizer.type must be a string, one of {valid} (got {value!r})"
            )
        key = value.strip().lower()
        canonical = _OPTIMIZER_TYPES.get(key)
        if canonical is not None:
            return canonical
        if key in _DEEPSPEED_OPTIMIZERS:  # DeepSpeed builds it (ZeRO 1-3); stage 0 says so when it builds
            return value.strip()
        raise ValueError(f"optimizer.type {value!r} is not supported; valid types are {valid} (any stage) and "
                         f"{', '.join(_DEEPSPEED_OPTIMIZERS)} (built by DeepSpeed, ZeRO stages 1-3)")

    @model_validator(mode="after")
    def _sane_params(self) -> OptimizerConfig:
        _check_optimizer_params(self.type, self.params)
        return self


class HybridEngineConfig(BaseModel):
    """``hybrid_engine``: generation settings shared by training and rollouts.

    As in DeepSpeed, ``enabled: false`` turns the hybrid engine's graph-captured decode off: given
    explicitly, it leaves ``enable_graph_capture`` false whatever else the section says. Left unset,
    it follows ``enable_graph_capture`` (so a dump of the config loads back to the same settings).
    """

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool = False
    max_out_tokens: StrictInt = Field(default=512, gt=0)
    inference_tp_size: StrictInt = Field(default=1, ge=1)
    release_inference_cache: StrictBool = False
    #: The memory hand-off between phases (issue 41): the page pools sleep after each generation call (graphs
    #: kept) and the optimizer's memory sleeps during it; the next call of either side wakes what it needs.
    sleep_between_phases: StrictBool = False
    pin_parameters: StrictBool = True
    tp_gather_partition_size: StrictInt = Field(default=8, gt=0)
    enable_graph_capture: StrictBool = False
    #: Under ZeRO-3, keep an unpartitioned copy for generation, refreshed in place after each step (graphs allowed).
    #: Left unset, it follows ``enable_graph_capture`` at ZeRO-3 (see ``EngineConfig._zero3_graphs_imply_the_copy``).
    zero3_gathered_inference_copy: StrictBool = False
    #: Tokens per page of generate's K/V pool, and the pool's budget in tokens or bytes (unset: what the call's
    #: rows could hold at once, never more than max_out_tokens rows would take).
    kv_page_size: StrictInt = Field(default=DEFAULT_PAGE_SIZE, ge=1, le=MAX_PAGE_SIZE)
    kv_cache_tokens: StrictInt | None = Field(default=None, gt=0)
    kv_cache_bytes: StrictInt | None = Field(default=None, gt=0)
    #: Batch-invariant kernels in ``engine(...)``, ``engine.generate`` and the rollouts on this engine: a rollout's
    #: logprob is then bit-for-bit the training forward's, in any batch (:mod:`hybrid_engine.exact`).
    exact_logprobs: StrictBool = False
    #: Decode steps of llama / mistral / qwen2 / qwen3 models run the fused decode forward
    #: (:mod:`hybrid_engine.decode.fused_forward`): "auto" where every fused op has a kernel on the device, true
    #: wherever the model is supported, false never.
    fused_decode: StrictBool | Literal["auto"] = "auto"

    @field_validator("fused_decode", mode="before")
    @classmethod
    def _fused_decode_value(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if not isinstance(value, bool):
            raise ValueError(f'hybrid_engine.fused_decode must be "auto", true or false (got {value!r}): "auto" runs '
                             "the fused decode forward where its kernels exist on the device, true wherever the "
                             "model is supported, false never")
        return value

    @model_validator(mode="before")
    @classmethod
    def _migrate_and_check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data  # pydantic reports the wrong type
        data = dict(data)
        valid = list(cls.model_fields)
        for key in data:
            if key in valid or key == _DEPRECATED_ALIAS:
                continue
            hint = _suggest(str(key), valid)
            fix = f"did you mean {hint!r}?" if hint else f"valid keys are {', '.join(valid)}"
            raise ValueError(f"unknown key {key!r} in hybrid_engine; {fix}")
        if _DEPRECATED_ALIAS in data:
            old = data.pop(_DEPRECATED_ALIAS)
            # A FutureWarning, pointing at the user's call: the key is in their config, and Python's default
            # filters hide a DeprecationWarning raised from library code.
            warnings.warn(
                f"hybrid_engine.{_DEPRECATED_ALIAS} is deprecated; use hybrid_engine.{_ALIAS_TARGET} instead",
                FutureWarning,
                stacklevel=user_stacklevel(),
            )
            if _ALIAS_TARGET in data and data[_ALIAS_TARGET] != old:
                raise ValueError(
                    f"hybrid_engine.{_DEPRECATED_ALIAS}={old!r} conflicts with "
                    f"hybrid_engine.{_ALIAS_TARGET}={data[_ALIAS_TARGET]!r}; "
                    f"remove the deprecated hybrid_engine.{_DEPRECATED_ALIAS}"
                )
            data.setdefault(_ALIAS_TARGET, old)
        if data.get("kv_cache_tokens") is not None and data.get("kv_cache_bytes") is not None:
            raise ValueError("hybrid_engine: set kv_cache_tokens or kv_cache_bytes, not both (they size the same pool)")
        return data

    @field_validator("max_out_tokens")
    @classmethod
    def _sane_cache_length(cls, value: int) -> int:
        if value > MAX_CACHE_TOKENS:
            raise ValueError(
                f"hybrid_engine.max_out_tokens must be at most {MAX_CACHE_TOKENS} (2**24), got {value}: it is the "
                "length of every decode cache row, allocated at the first generate; set it to the longest prompt "
                "plus new tokens you generate, within the model's position limit")
        return value

    @model_validator(mode="after")
    def _enabled_gates_graph_capture(self) -> HybridEngineConfig:
        if "enabled" not in self.model_fields_set:
            if self.enable_graph_capture:  # asking for graphs implies the engine is on: a dump loads back the same
                # Not marked as set: only an explicit ``enabled: true`` (DeepSpeed's switch) routes the model's
                # own ``generate`` to the engine (HybridEngine._route_module_generate).
                self.__dict__["enabled"] = True
        elif not self.enabled and self.enable_graph_capture:
            if _ALIAS_TARGET in self.model_fields_set:
                warnings.warn(
                    f"hybrid_engine.enabled is false, which turns the hybrid engine's graph capture off (as in "
                    f"DeepSpeed), so hybrid_engine.{_ALIAS_TARGET}=true is ignored; set hybrid_engine.enabled to "
                    "true to capture graphs",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            self.enable_graph_capture = False
        return self

    @property
    def enable_cuda_graph(self) -> bool:
        """Deprecated read-only alias of ``enable_graph_capture``."""
        warnings.warn(
            f"hybrid_engine.{_DEPRECATED_ALIAS} is deprecated; use hybrid_engine.{_ALIAS_TARGET} instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.enable_graph_capture


#: ``hybrid_engine`` keys a validator may imply from others when they are not given.
_IMPLIED_HYBRID_ENGINE_KEYS = ("enabled", "zero3_gathered_inference_copy")


class EngineConfig(BaseModel):
    """The whole engine config. Unused DeepSpeed keys are kept as extras."""

    model_config = ConfigDict(extra="allow")

    train_batch_size: StrictInt | None = Field(default=None, gt=0)
    train_micro_batch_size_per_gpu: StrictInt | None = Field(default=None, gt=0)
    gradient_accumulation_steps: StrictInt = Field(default=1, gt=0)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    gradient_clipping: StrictFloat = Field(default=1.0, ge=0, allow_inf_nan=False)  # DeepSpeed's default (0: off)
    steps_per_print: StrictInt | None = Field(default=None, gt=0)  # DeepSpeed's default: no progress lines
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)

    @model_validator(mode="before")
    @classmethod
    def _check_top_level_typos(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        known = list(cls.model_fields)
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"config keys must be strings (got {key!r})")  # noqa: TRY004 - see above
        _refuse_auto(data)
        if _BF16_LEGACY in data:
            data = dict(data)
            if "bf16" in data:
                raise ValueError(f"both bf16 and {_BF16_LEGACY} (DeepSpeed's legacy name of bf16) are given; "
                                 f"keep bf16 and remove {_BF16_LEGACY}")
            data["bf16"] = data.pop(_BF16_LEGACY)
        for key in data:
            if key in known or key in _DEEPSPEED_PASSTHROUGH:
                continue
            hint = _suggest(key, [*known, "scheduler"])  # DeepSpeed's section stage 0 reads too
            if hint is not None:
                raise ValueError(f"unknown top-level key {key!r}; did you mean {hint!r}?")
        return data

    @model_validator(mode="after")
    def _check_consistency(self, info: ValidationInfo) -> EngineConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        _check_scheduler((self.model_extra or {}).get("scheduler"))
        if self.zero_optimization.stage == 0:
            extra = self.model_extra or {}
            autocast = extra.get("torch_autocast")
            if isinstance(autocast, dict) and autocast.get("enabled"):
                raise ValueError(
                    "torch_autocast.enabled is applied by DeepSpeed's engine (zero_optimization.stage 1-3); at stage "
                    "0 training is plain PyTorch and would run without it: set zero_optimization.stage to 1, use "
                    "bf16.enabled, or wrap your forward in torch.autocast yourself")
            for key in _REMOVED_FROM_DEEPSPEED:
                section = extra.get(key)
                if section is not None and (not isinstance(section, dict) or section.get("enabled", True)):
                    raise ValueError(
                        f"{key} would change training, but at zero_optimization.stage 0 (plain PyTorch) nothing "
                        f"applies it, and DeepSpeed 0.19 has removed it (its config refuses {key!r}); remove the "
                        "section (for mixed precision use bf16 or fp16)")
            _refuse_deepspeed_only_at_stage_0("fp16", self.fp16.model_extra or {}, _FP16_DEEPSPEED_KEYS)
            _refuse_deepspeed_only_at_stage_0("bf16", self.bf16.model_extra or {}, _BF16_DEEPSPEED_KEYS)
        world = (info.context or {}).get("world_size") or world_size()
        tp = self.hybrid_engine.inference_tp_size
        if tp > world:
            raise ValueError(
                f"hybrid_engine.inference_tp_size ({tp}) is larger than the world size ({world}); it must divide "
                "the ranks that share one inference copy, so use at most the number of ranks launched"
            )
        self._derive_batch_sizes(world)
        self._zero3_graphs_imply_the_copy()
        return self

    def _zero3_graphs_imply_the_copy(self) -> None:
        """At ZeRO-3, asking for graphs implies ``zero3_gathered_inference_copy`` unless it is given: partitioned
        weights can never be replayed, and DeepSpeed's own hybrid engine generates on gathered weights, so the graph
        flag alone gives graphs there (DeepSpeed-Chat's config has no copy key). Not marked as set, so the engine
        can fall back to eager decode where no copy can be built (``HybridEngine.__init__``)."""
        he = self.hybrid_engine
        if (self.zero_optimization.stage == 3 and he.enable_graph_capture
                and "zero3_gathered_inference_copy" not in he.model_fields_set):
            he.__dict__["zero3_gathered_inference_copy"] = True

    def _derive_batch_sizes(self, world: int) -> None:
        """DeepSpeed's rules (``_set_batch_related_parameters`` then ``_batch_assertion``), on every branch:
        the sizes given, with those derived, must satisfy total == micro * accumulation * world, all > 0."""
        given = self.model_fields_set
        total = self.train_batch_size
        micro = self.train_micro_batch_size_per_gpu
        accum = self.gradient_accumulation_steps if "gradient_accumulation_steps" in given else None
        if total is not None and micro is not None and accum is not None:
            if total != micro * accum * world:
                raise ValueError(
                    f"train_batch_size ({total}) must equal train_micro_batch_size_per_gpu ({micro}) * "
                    f"gradient_accumulation_steps ({accum}) * world_size ({world}) = "
                    f"{micro * accum * world}; fix one of them or omit one to have it derived"
                )
        elif total is not None and micro is not None:
            if total % (micro * world):
                raise ValueError(
                    f"train_batch_size ({total}) is not divisible by train_micro_batch_size_per_gpu "
                    f"({micro}) * world_size ({world}); gradient_accumulation_steps cannot be derived"
                )
            self.gradient_accumulation_steps = total // (micro * world)
        elif total is not None and accum is not None:
            if total % (accum * world):
                raise ValueError(
                    f"train_batch_size ({total}) is not divisible by gradient_accumulation_steps "
                    f"({accum}) * world_size ({world}); train_micro_batch_size_per_gpu cannot be derived"
                )
            self.train_micro_batch_size_per_gpu = total // (accum * world)
        elif micro is not None:
            self.train_batch_size = micro * (accum or 1) * world
        elif total is not None:
            if total % world:
                raise ValueError(
                    f"train_batch_size ({total}) is not divisible by world_size ({world}): as in DeepSpeed, "
                    f"train_micro_batch_size_per_gpu would be {total} // {world} = {total // world}, so a step "
                    f"would train on {total // world * world} samples, not {total}; use a multiple of {world}, "
                    "or give train_micro_batch_size_per_gpu and gradient_accumulation_steps instead"
                )
            self.train_micro_batch_size_per_gpu = total // world
        # Neither size given: both stay None and the trainer chooses.

    def dump_for_reload(self) -> dict[str, Any]:
        """Every field, as ``model_dump`` gives them, less the values a validator implied rather than the user
        gave (``hybrid_engine.enabled``, ``hybrid_engine.zero3_gathered_inference_copy``), so that validating the
        dump again (after a mutation, say) implies them again from what it says, and still tells them apart."""
        data = self.model_dump()
        for key in _IMPLIED_HYBRID_ENGINE_KEYS:
            if key not in self.hybrid_engine.model_fields_set:
                data["hybrid_engine"].pop(key, None)
        return data

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict of the config (unset optional fields omitted)."""
        return self.model_dump(mode="json", exclude_none=True)
