"""The stage-0 overflow surface (:mod:`hybrid_engine.training.overflow`) on DeepSpeed's ZeRO 1-3 optimizers.

At ZeRO 1-3 the optimizer the engine hands out is DeepSpeed's own (``DeepSpeedZeroOptimizer``,
``DeepSpeedZeroOptimizer_Stage3``): it has ``overflow``, ``loss_scale`` and ``cur_scale``, but (DeepSpeed 0.19)
its ``check_overflow(partition_gradients=True)`` takes no ``external`` and returns nothing, and it has no
``skip_step``, so DeepSpeed-Chat's ``--align_overflow`` raised ``TypeError``. :func:`attach_zero_overflow_surface`
adds both to that same instance (its class, its state and its checkpoints are untouched):

* ``check_overflow(partition_gradients=True, external=False)`` runs DeepSpeed's own check (``has_overflow``: inf/NaN
  in this rank's reduced gradient partition, all-reduced over the data-parallel and model-parallel groups, so
  every rank gets the same answer), sets ``overflow`` and returns it. Every rank must call it (a collective).
  It checks the gradients DeepSpeed has reduced: call it after the last ``backward`` before ``step``. With no
  gradients held (before the first ``backward``, or after a ``step``) it answers ``False`` where DeepSpeed's own
  would raise (ZeRO 1/2). This check runs under bf16 and fp32 too, where DeepSpeed's step itself also skips a
  step with inf/NaN gradients (ZeRO 1/2: under bf16 while ``bf16.check_grad_overflow`` is on, the default, under
  fp32 through the invalid gradient norm; ZeRO 3: the invalid gradient norm): unlike stage 0's bf16 optimizer, it
  reports them.
* ``skip_step = True``: the next optimizer step (at the accumulation boundary) is skipped on every rank: the
  request is agreed over the ranks (one 1-byte all-reduce per optimizer step; a rank that asks skips them all,
  as a partitioned update cannot be taken on some ranks only), then DeepSpeed's step takes its own overflow path
  with the loss scale kept (:func:`requested_skip`): no update, optimizer state and LR scheduler untouched,
  gradients dropped, counted in the engine's ``skipped_steps``; the flag then resets. ``overflow`` then says
  what DeepSpeed's step found in the gradients, as a step that was not skipped would.

The skip rides on DeepSpeed's step calling ``_update_scale(overflow)`` before its update and taking the overflow
path when ``overflow`` is then set (both ZeRO optimizers in DeepSpeed 0.19); if a DeepSpeed step never calls it,
the engine raises instead of reporting a skip it did not make. Not covered: DeepSpeed's Muon optimizer at ZeRO-3
applies its momentum before that call, so a requested skip there would still advance the momentum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hybrid_engine.training.overflow import CheckOverflow, take_skip_request

__all__ = ["attach_zero_overflow_surface", "requested_skip", "skip_agreed"]


def _is_zero_optimizer(optimizer: Any) -> bool:
    """DeepSpeed's ZeRO 1-3 optimizers: they check overflow with ``has_overflow`` and scale with ``_update_scale``."""
    kind = type(optimizer)
    return all(callable(getattr(kind, name, None)) for name in ("has_overflow", "check_overflow", "_update_scale"))


class ZeroGradients:
    """What :class:`~hybrid_engine.training.overflow.CheckOverflow` reads from a ZeRO optimizer: DeepSpeed's own check."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.loss_scale)

    def holds_gradients(self) -> bool:
        """Whether DeepSpeed holds reduced gradients to check (it keeps them in ``averaged_gradients``, emptied or
        set to ``None`` by a step; with optimizer offload it keeps its own flag, which it always answers)."""
        opt = self.optimizer
        grads = getattr(opt, "averaged_gradients", None)
        if getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False) or not isinstance(grads, dict):
            return True
        return any(g is not None for g in grads.values())

    def gradients_overflow(self, partition_gradients: bool = True) -> bool:
        """DeepSpeed's ``check_overflow`` (the class's: the instance's is ours), which sets ``overflow``. The same
        answer on every rank: whether gradients are held is the same on every rank, and the check all-reduces."""
        opt = self.optimizer
        if not self.holds_gradients():
            return False
        type(opt).check_overflow(opt, partition_gradients=partition_gradients)
        return bool(opt.overflow)


def attach_zero_overflow_surface(optimizer: Any) -> None:
    """Give a DeepSpeed ZeRO optimizer ``check_overflow(partition_gradients=True, external=False)`` returning the
    answer, and ``skip_step``; any other optimizer (``None``, DeepSpeed's stage-0 ones) is left as it is."""
    if optimizer is None or not _is_zero_optimizer(optimizer) or isinstance(optimizer.__dict__.get("check_overflow"),
                                                                            CheckOverflow):
        return
    optimizer.skip_step = False
    optimizer.check_overflow = CheckOverflow(optimizer, ZeroGradients(optimizer))


def skip_agreed(optimizer: Any) -> bool:
    """Whether any rank asked to skip the coming step (``optimizer.skip_step``, consumed here on every rank).

    A collective over DeepSpeed's data-parallel and model-parallel groups, as its ``has_overflow``: call it on every
    rank at each accumulation boundary. ``False`` without the ZeRO surface (no collective)."""
    if not isinstance(optimizer.__dict__.get("check_overflow") if optimizer is not None else None, CheckOverflow):
        return False
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    flag = torch.tensor([take_skip_request(optimizer)], dtype=torch.uint8,
                        device=get_accelerator().current_device_name())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=optimizer.dp_process_group)
    optimizer._model_parallel_all_reduce(tensor=flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@contextlib.contextmanager
def requested_skip(optimizer: Any) -> Iterator[None]:
    """While active, the ZeRO optimizer's ``step`` takes DeepSpeed's own overflow path (gradients dropped, nothing
    updated; the engine then counts the step as skipped and leaves the LR scheduler alone) with the loss scale
    kept. Afterwards ``optimizer.overflow`` is what DeepSpeed's step found in the gradients."""
    found: list[bool] = []

    def keep_scale(has_overflow: bool = False) -> None:
        found.append(bool(has_overflow))
        optimizer.overflow = True  # DeepSpeed's step then takes its overflow path, and its engine counts a skip

    optimizer._update_scale = keep_scale  # an instance attribute over the class's method, for this step only
    try:
        yield
    finally:
        del optimizer._update_scale
    if not found:
        raise RuntimeError(
            f"optimizer.skip_step: {type(optimizer).__name__}.step did not reach _update_scale, so this DeepSpeed "
            "version's ZeRO step could not be skipped (it may have updated the weights); skip_step needs "
            "DeepSpeed's ZeRO 1-3 step as in 0.19")
    optimizer.overflow = found[0]
