"""What a DeepSpeed training script asks its engine, beyond forward, backward and step.

``deepspeed.DeepSpeedEngine`` answers many small questions: ranks and device,
config switches, the optimizer's name and momenta, whether the last ``step()``
changed the weights, the gradient norm, and it offers ``no_sync`` and a manual
accumulation boundary. :class:`DeepSpeedEngineInterface` gives
:class:`~hybrid_engine.engine.HybridEngine` the same answers with DeepSpeed's
names and meanings, so a script written for DeepSpeed keeps working. Under
ZeRO (and stage 0 across ranks) the wrapped DeepSpeed engine answers itself;
at stage 0 in one process :class:`~hybrid_engine.training.local.LocalTraining` keeps
the state. Attributes the engine does not have are looked up on the wrapped
model, as DeepSpeed's engine does (``engine.gradient_checkpointing_enable()``,
``engine.generation_config``). Nothing here touches decode graphs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from hybrid_engine.distributed.world import rank, world_size
from hybrid_engine.model_access import model_device
from hybrid_engine.training.local import LocalTraining, optimizer_momenta

__all__ = ["DeepSpeedEngineInterface"]


class DeepSpeedEngineInterface:
    """DeepSpeed's engine queries, mixed into :class:`~hybrid_engine.engine.HybridEngine`."""

    training_backend: Any
    config: Any
    module: torch.nn.Module
    optimizer: Any

    def _deepspeed(self) -> Any | None:
        """The wrapped ``DeepSpeedEngine``, or ``None`` at stage 0 in one process."""
        backend = self.training_backend
        return None if isinstance(backend, LocalTraining) else backend.ds_engine

    # ----------------------------------------------------------- ranks, device
    @property
    def device(self) -> torch.device:
        """The device the model's parameters are on (DeepSpeed's: the rank's accelerator)."""
        ds = self._deepspeed()
        return ds.device if ds is not None else model_device(self.module)

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``, 0 when not launched)."""
        ds = self._deepspeed()
        return int(ds.local_rank) if ds is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)

    @property
    def global_rank(self) -> int:
        """This process's rank in the launched world."""
        ds = self._deepspeed()
        return int(ds.global_rank) if ds is not None else rank()

    @property
    def world_size(self) -> int:
        """Processes in the launched world."""
        ds = self._deepspeed()
        return int(ds.world_size) if ds is not None else world_size()

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (the world, without model parallelism)."""
        ds = self._deepspeed()
        return int(ds.dp_world_size) if ds is not None else world_size()

    # ------------------------------------------------------------ config flags
    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def gradient_clipping(self) -> float:
        """The gradient norm clipped to at each optimizer step (0: off; DeepSpeed's default is 1.0)."""
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def loss_scale(self) -> float:
        """The configured static fp16 loss scale, 0 for dynamic (DeepSpeed's ``loss_scale()``); the scale in use
        now is :attr:`cur_scale`."""
        return float(self.config.fp16.loss_scale)

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale in use now (1.0 without fp16), as DeepSpeed's optimizers call it."""
        return float(self.training_backend.loss_scale)

    # --------------------------------------------------------------- optimizer
    def optimizer_name(self) -> str | None:
        """The optimizer's class name when one was passed in, else the config's type (DeepSpeed's spelling)."""
        ds = self._deepspeed()
        if ds is not None:
            return ds.optimizer_name()
        backend = self.training_backend
        if backend.optimizer is None:
            return None
        spec = self.config.optimizer
        return spec.type.lower() if backend.built_from_config and spec is not None else type(backend.optimizer).__name__

    def get_mom(self) -> list[Any]:
        """Each param group's ``betas`` (Adam family) or ``momentum`` (SGD)."""
        return optimizer_momenta(self.optimizer)

    # ------------------------------------------------------------ step outcome
    @property
    def global_samples(self) -> int | None:
        """Samples trained on: ``train_batch_size`` per optimizer step (``None`` when no batch size is configured)."""
        ds = self._deepspeed()
        if ds is not None:
            return int(ds.global_samples)
        size = self.config.train_batch_size
        return None if size is None else size * self.training_backend.global_steps

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (False between accumulation boundaries and on skipped
        overflow steps)."""
        ds = self._deepspeed()
        return bool(ds.was_step_applied()) if ds is not None else self.training_backend.step_applied

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm measured at the last optimizer step, or ``None``. At stage 0 it is measured when
        gradients are clipped (``gradient_clipping`` > 0, the default); DeepSpeed's ZeRO optimizers measure it."""
        ds = self._deepspeed()
        if ds is not None:
            norm = ds.get_global_grad_norm()
        else:
            norm = self.training_backend.grad_norm
        return None if norm is None else float(norm)

    # -------------------------------------------------- accumulation control
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override whether the next ``step()`` is an accumulation boundary (DeepSpeed's manual mode)."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary: is_boundary must be True or False, got {is_boundary!r}")
        ds = self._deepspeed()
        if ds is not None:
            ds.set_gradient_accumulation_boundary(is_boundary)
        else:
            self.training_backend.boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not reduce gradients across ranks (DeepSpeed's ``no_sync``; refused at ZeRO
        2/3 by DeepSpeed). ``step()`` inside is an error."""
        ds = self._deepspeed()
        with (ds.no_sync() if ds is not None else self.training_backend.no_sync()):
            yield

    # ----------------------------------------------------- the wrapped model
    def __getattr__(self, name: str) -> Any:
        """An attribute the engine lacks, looked up on the wrapped model as DeepSpeed's engine does."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's parameters, buffers, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            # The engine's own names are not forwarded: a property of the engine that failed inside (Python
            # then falls back here) must raise its own error, not answer with the model's namesake.
            if module is None or name.startswith("__") or any(name in vars(c) for c in type(self).__mro__):
                raise
        try:
            return getattr(module, name)
        except AttributeError:  # named as the engine's, as DeepSpeed's engine does
            raise AttributeError(f"'{type(self).__name__}' object (nor its model, "
                                 f"{type(module).__name__}) has no attribute '{name}'") from None
