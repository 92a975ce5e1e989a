"""HybridEngine: one module that trains a causal LM and generates its rollouts.

The engine holds the Hugging Face model once. Training is plain PyTorch (ZeRO
stage 0): a forward under autocast when fp16/bf16 is configured, a backward
scaled by ``1 / gradient_accumulation_steps`` (and by the fp16 loss scale), and
an optimizer step only at accumulation boundaries. Generation goes through
:mod:`hybrid_engine.generation`, which decodes on the engine's graph runner
(:mod:`hybrid_engine.graph_runner`): one captured step per batch bucket and
sampling mode, replayed at every position.

Why the two sides can share one model safely: optimizer updates are in place,
so captured graphs, which read weights by address, see them on the next
replay; anything that re-allocates a parameter or buffer changes the weight
fingerprint, and the runner drops its graphs before the next replay.

Train/eval: ``eval()`` selects the inference path, ``train()`` the training
forward. ``generate`` called in train mode runs that one call in eval mode (no
dropout) under ``torch.no_grad`` and restores train mode afterwards.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
from torch import nn

from . import checkpoint
from .config import ConfigSource, EngineConfig, load_config
from .exclusive import exclusive_generation
from .generation import Generator
from .graph_runner import GraphStats
from .inputs import model_device

__all__ = ["HybridEngine", "initialize"]


def _build_optimizer(config: EngineConfig, params: Any) -> torch.optim.Optimizer | None:
    spec = config.optimizer
    if spec is None:
        return None
    kwargs = dict(spec.params)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}[spec.type]
    if spec.type == "SGD" and "lr" not in kwargs:
        kwargs["lr"] = 1e-3  # torch's SGD needs an explicit learning rate
    try:
        return cls(params, **kwargs)
    except TypeError as exc:
        raise ValueError(f"optimizer.params are not valid for {spec.type}: {exc}") from exc


class HybridEngine(nn.Module):
    """Wraps ``module`` (a causal LM) for training and fast rollout generation."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, config: EngineConfig,
                 lr_scheduler: Any = None):
        super().__init__()
        self.module = model
        self.config = config
        self.optimizer = optimizer
        #: Stepped once per optimizer step (not on fp16 overflow-skipped steps), as DeepSpeed does.
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.micro_steps = 0
        self._device_type = model_device(model).type
        self._amp_dtype = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None
        self._scaler = None
        if config.fp16.enabled:
            static = config.fp16.loss_scale > 0
            init = config.fp16.loss_scale if static else float(2**config.fp16.initial_scale_power)
            # A static loss scale never grows; overflowing steps are skipped (the scale halves then).
            self._scaler = torch.amp.GradScaler(
                self._device_type, init_scale=init, growth_interval=2**31 - 1 if static else 2000
            )
        self._generator = Generator(model, config)

    # ---------------------------------------------------------------- helpers
    def _autocast(self):
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self._amp_dtype)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` call will update the weights."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    # --------------------------------------------------------------- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The training forward of ``module`` (under autocast when fp16/bf16 is on)."""
        with self._autocast():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (loss-scaled under fp16)."""
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("engine.backward(loss): loss must be a scalar tensor")
        loss = loss / self.gradient_accumulation_steps
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        loss.backward()

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary clip, step the optimizer and zero grads."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.optimizer is None:
            raise RuntimeError(
                "engine.step(): no optimizer; pass optimizer= to initialize() or set config.optimizer"
            )
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self._scaler is not None:
            self._scaler.unscale_(self.optimizer)
        if self.config.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(params, self.config.gradient_clipping)
        stepped = True
        if self._scaler is not None:
            scale = self._scaler.get_scale()
            self._scaler.step(self.optimizer)
            self._scaler.update()
            stepped = self._scaler.get_scale() >= scale  # the scale drops only when the step was skipped
        else:
            self.optimizer.step()
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self.module.zero_grad(set_to_none=set_to_none)

    @property
    def loss_scale(self) -> float:
        return float(self._scaler.get_scale()) if self._scaler is not None else 1.0

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True) -> bool:
        """Save the training state under ``save_dir/tag`` (DeepSpeed's names; returns ``True``).

        Saved: the model, the optimizer, the fp16 loss scaler, the LR scheduler, the
        step counters, torch's RNG state (CPU and the accelerator's, which seeds
        sampled ``generate`` calls and dropout) and ``client_state``. ``tag``
        defaults to ``global_step<N>``; ``save_latest`` records it in
        ``save_dir/latest`` for :meth:`load_checkpoint`.
        """
        return checkpoint.save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """Restore what :meth:`save_checkpoint` saved; returns ``(load_path, client_state)``.

        ``tag`` defaults to the one in ``load_dir/latest``. When there is no such
        checkpoint it warns and returns ``(None, None)``, as DeepSpeed does. The
        engine's graphs are dropped and recaptured by the next ``generate``
        (loading may re-allocate; rollouts compare weight addresses before replaying).
        """
        with exclusive_generation(self.module, "HybridEngine.load_checkpoint"):
            result = checkpoint.load(self, load_dir, tag, load_module_strict=load_module_strict,
                                     load_optimizer_states=load_optimizer_states,
                                     load_lr_scheduler_states=load_lr_scheduler_states,
                                     load_module_only=load_module_only)
            if result[0] is not None:
                self._generator.runner.invalidate()
        return result

    # ------------------------------------------------------------- generation
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Drop-in for transformers' ``generate`` (same arguments, same return value).

        In train mode the call runs in eval mode (no dropout) and train mode is
        restored afterwards. Concurrent calls on one model are serialised
        (:mod:`hybrid_engine.exclusive`). See :mod:`hybrid_engine.generation` for the paths
        and :mod:`hybrid_engine.graph_policy` for when graphs are refused.
        """
        with exclusive_generation(self.module, "HybridEngine.generate"):
            was_training = self.module.training
            if was_training:
                self.module.eval()
            try:
                with torch.no_grad():
                    return self._generator.generate(*args, **kwargs)
            finally:
                if was_training:
                    self.module.train()

    @property
    def graph_stats(self) -> GraphStats:
        return self._generator.stats()

    def graph_refusal_reason(self) -> str | None:
        """Why graphs would be refused for a ``generate`` call now, or ``None``."""
        return self._generator.gate_reason()


def initialize(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    config: ConfigSource | None = None,
    model_parameters: Any = None,
    **kwargs: Any,
) -> tuple[HybridEngine, torch.optim.Optimizer | None]:
    """Build a :class:`HybridEngine`; returns ``(engine, optimizer)`` (cf. ``deepspeed.initialize``).

    ``config`` is a dict, a JSON path or an ``EngineConfig``. The optimizer is
    ``optimizer`` if given, else one built from ``config.optimizer`` (AdamW, Adam
    or SGD) over ``model_parameters`` (default: the model's trainable parameters),
    else ``None`` (generation only). ``lr_scheduler`` (a scheduler, or a callable
    building one from the optimizer) is stepped with the optimizer and kept as
    ``engine.lr_scheduler``. ZeRO stages 1-3 are not implemented yet.
    """
    if kwargs.get("config_params") is not None and config is None:
        config = kwargs.pop("config_params")
    unknown = set(kwargs) - {"config_params", "args", "training_data", "lr_scheduler", "mpu", "dist_init_required"}
    if unknown:
        raise TypeError(f"initialize() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    if kwargs.get("training_data") is not None:
        raise ValueError("initialize(): training_data is not supported; iterate over your data yourself")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(): model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = load_config(config if config is not None else {})
    stage = cfg.zero_optimization.stage
    if stage != 0:
        raise ValueError(
            f"zero_optimization.stage={stage} is not supported yet: the ZeRO integration is not there; "
            "use stage 0 (or omit zero_optimization) for plain PyTorch training"
        )
    if cfg.fp16.enabled and any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad):
        raise ValueError(
            "fp16.enabled trains fp32 weights under fp16 autocast with a gradient scaler, but the model has "
            "float16 parameters (the scaler cannot unscale fp16 gradients); keep the model in float32, or "
            "set fp16.enabled=false to train the float16 weights directly"
        )
    if cfg.hybrid_engine.inference_tp_size > 1:
        warnings.warn(
            f"hybrid_engine.inference_tp_size={cfg.hybrid_engine.inference_tp_size}: tensor-parallel inference "
            "is not implemented (single process); generation runs unsharded and eagerly",
            UserWarning,
            stacklevel=2,
        )
    if optimizer is None:
        params = model_parameters if model_parameters is not None else [
            p for p in model.parameters() if p.requires_grad
        ]
        optimizer = _build_optimizer(cfg, params)
    elif cfg.optimizer is not None:
        warnings.warn(
            "initialize(): both an optimizer and config.optimizer were given; using the optimizer passed in",
            UserWarning,
            stacklevel=2,
        )
    lr_scheduler = kwargs.get("lr_scheduler")
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        if not callable(lr_scheduler):
            raise TypeError("initialize(): lr_scheduler must be a scheduler (with .step()) or a callable that "
                            f"builds one from the optimizer, got {type(lr_scheduler).__name__}")
        if optimizer is None:
            raise ValueError("initialize(): lr_scheduler was given as a callable but there is no optimizer to "
                             "build it for; pass optimizer= or config.optimizer")
        lr_scheduler = lr_scheduler(optimizer)
    engine = HybridEngine(model, optimizer, cfg, lr_scheduler=lr_scheduler)
    return engine, optimizer
