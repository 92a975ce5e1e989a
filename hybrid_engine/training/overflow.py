"""DeepSpeed's fp16 loss-scaler surface on the optimizer the engine hands out.

DeepSpeed hands its trainer an optimizer wrapper (``FP16_Optimizer``, the ZeRO optimizers) that scripts
query between ``backward`` and ``step``: ``optimizer.overflow`` (did the last step overflow),
``check_overflow(external=...)`` (do the gradients held now overflow), ``skip_step`` (set it to skip the next
step, e.g. to keep an actor and a critic in lockstep: DeepSpeed-Chat's ``--align_overflow``),
``loss_scale``/``cur_scale``. At stage 0 the engine returns the torch optimizer itself (so
``isinstance(opt, torch.optim.Optimizer)`` and its ``state_dict`` stay as they are);
:func:`attach_overflow_surface` sets these names on that instance, answered by the stage-0 backend:

* fp16: ``overflow`` is whether the last optimizer step found non-finite gradients (that step was skipped
  and the loss scale backed off, as DeepSpeed's dynamic scaler does); ``check_overflow`` checks the
  gradients accumulated so far and sets ``overflow``; ``loss_scale``/``cur_scale`` are the scale now.
* bf16 and fp32: no loss scaling, so ``overflow`` is ``False`` and ``check_overflow`` returns ``False``
  (DeepSpeed's bf16 optimizer keeps no overflow flag); the scale is 1.
* ``skip_step = True``: the next optimizer step (accumulation boundary) is skipped whatever the gradients:
  no update, no LR-scheduler step, the scale unchanged, counted in ``skipped_steps``; the flag then resets.

At ZeRO 1-3 the optimizer is DeepSpeed's own; :mod:`hybrid_engine.training.zero_overflow` gives it the same
``check_overflow`` (:class:`CheckOverflow`, answered by DeepSpeed's own check) and ``skip_step``
(:func:`take_skip_request`, agreed over the ranks).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["CheckOverflow", "OverflowSource", "attach_overflow_surface", "publish_scale", "take_skip_request"]


class OverflowSource(Protocol):
    """What the surface reads from the training backend (stage 0) or DeepSpeed's ZeRO optimizer."""

    @property
    def loss_scale(self) -> float: ...

    def gradients_overflow(self, partition_gradients: bool = True) -> bool: ...


class CheckOverflow:
    """``optimizer.check_overflow(partition_gradients=True, external=False)``: a callable attribute (picklable with
    its source), in DeepSpeed's argument order, returning the answer as well as setting ``optimizer.overflow``."""

    def __init__(self, optimizer: Any, source: OverflowSource) -> None:
        self.optimizer, self.source = optimizer, source

    def __call__(self, partition_gradients: bool = True, external: bool = False) -> bool:
        """Whether the gradients held now hold inf/NaN; sets ``optimizer.overflow``. ``partition_gradients`` is
        DeepSpeed's switch (one process has nothing partitioned); ``external`` is accepted as DeepSpeed-Chat
        passes it and changes nothing (the check is the same whoever asks)."""
        for name, value in (("external", external), ("partition_gradients", partition_gradients)):
            if not isinstance(value, bool):
                raise TypeError(f"optimizer.check_overflow({name}=...): expected True or False, got {value!r}")
        overflow = bool(self.source.gradients_overflow(partition_gradients))
        self.optimizer.overflow = overflow
        return overflow


def attach_overflow_surface(optimizer: torch.optim.Optimizer | None, source: OverflowSource) -> None:
    """Set ``overflow``, ``skip_step``, ``check_overflow``, ``loss_scale`` and ``cur_scale`` on ``optimizer``."""
    if optimizer is None:
        return
    optimizer.overflow = False
    optimizer.skip_step = False
    optimizer.check_overflow = CheckOverflow(optimizer, source)
    publish_scale(optimizer, source)


def publish_scale(optimizer: torch.optim.Optimizer | None, source: OverflowSource) -> None:
    """Refresh ``loss_scale``/``cur_scale`` after the scale may have changed (a step, a checkpoint load)."""
    if optimizer is not None:
        scale = float(source.loss_scale)
        optimizer.loss_scale = optimizer.cur_scale = scale


def take_skip_request(optimizer: Any) -> bool:
    """Whether a ``skip_step = True`` is pending; it is consumed (reset to ``False``)."""
    pending = bool(getattr(optimizer, "skip_step", False))
    if pending:
        optimizer.skip_step = False
    return pending
