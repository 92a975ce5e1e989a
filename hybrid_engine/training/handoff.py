"""The optimizer's side of the memory hand-off: its memory goes to host memory during rollouts, and back.

Stage 0 (:class:`OptimizerHandoff`): every optimizer state tensor, every fp32 master weight the optimizer steps
(parameters of the optimizer that are not the model's) and their gradients, and the update guard's snapshot,
are copied to host memory (pinned where the device is an accelerator) and their device storage freed, by
swapping ``tensor.data``: the tensor objects stay, so the optimizer's state dict, the masters' identity and
anything keyed on them are untouched, and wake copies the values back bit for bit. The model's own parameters
never move (the decode graphs read them by address), nor their gradients.

ZeRO 1/2 (:class:`ZeroHandoff`): DeepSpeed's ``offload_states``/``reload_states`` for ``optim_states``,
``hp_params``, ``lp_grads`` and ``contiguous_grad_buffer``, never ``lp_params`` (moving those would move the
weights every graph reads).

Every training call that needs the optimizer wakes it first (counted in :attr:`wakes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerHandoff", "ZeroHandoff", "handoff_for"]


class OptimizerHandoff:
    """Stage-0 hand-off of ``optimizer``'s memory (see the module docstring); ``extra`` yields more tensors kept
    between steps (the update guard's snapshot)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                 extra: Any = None) -> None:
        self.optimizer = optimizer
        self.module = module
        self._extra = extra
        self._moved: list[tuple[torch.Tensor, torch.device]] = []
        #: Whether the optimizer's memory is on the host (:meth:`sleep`).
        self.asleep = False
        #: Wakes made by a training call (not by ``wake()``).
        self.wakes = 0
        #: Bytes the last :meth:`sleep` moved.
        self.bytes_moved = 0

    def _tensors(self) -> Iterator[torch.Tensor]:
        model = {id(p) for p in self.module.parameters()}
        seen: set[int] = set()

        def once(tensors: Iterable[Any]) -> Iterator[torch.Tensor]:
            for t in tensors:
                if isinstance(t, torch.Tensor) and id(t) not in seen and id(t) not in model:
                    seen.add(id(t))
                    yield t

        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in model:  # an fp32 master: the optimizer's own copy, not the model's weight
                    yield from once([p, p.grad])
        for state in self.optimizer.state.values():
            yield from once(state.values())
        if self._extra is not None:
            yield from once(self._extra())

    @torch.no_grad()
    def sleep(self) -> None:
        """Copy the optimizer's memory to the host and free it on the device (no-op when asleep)."""
        if self.asleep:
            return
        moved, nbytes = [], 0
        for t in self._tensors():
            if t.numel() == 0:
                continue
            device = t.device
            pin = device.type != "cpu" and torch.cuda.is_available()
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=False)
            t.data = host
            moved.append((t, device))
            nbytes += host.numel() * host.element_size()
        self._moved, self.bytes_moved, self.asleep = moved, nbytes, True

    @torch.no_grad()
    def wake(self, *, auto: bool = False) -> bool:
        """Bring the optimizer's memory back where it was; ``auto``: a training call woke it (counted)."""
        if not self.asleep:
            return False
        for t, device in self._moved:
            if device.type != "cpu":
                t.data = t.data.to(device, non_blocking=False)
        self._moved, self.asleep = [], False
        if auto:
            self.wakes += 1
        return True


#: What ZeRO 1/2 hands over: everything but the weights the graphs read (``lp_params``).
ZERO_STATES = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")


class ZeroHandoff:
    """ZeRO 1/2 hand-off through DeepSpeed's ``offload_states``/``reload_states`` on ``ds_engine``."""

    def __init__(self, ds_engine: Any) -> None:
        self.ds_engine = ds_engine
        self.asleep = False
        self.wakes = 0
        self.bytes_moved = 0

    def _states(self) -> list[Any]:
        from deepspeed.runtime.zero.offload_config import (
            OffloadStateTypeEnum,  # lazily: DeepSpeed is optional
        )

        return [OffloadStateTypeEnum(name) for name in ZERO_STATES]

    def sleep(self) -> None:
        if self.asleep:
            return
        engine = self.ds_engine
        if not hasattr(engine, "offload_states"):
            raise RuntimeError("engine.sleep('optimizer'): this DeepSpeed has no offload_states (added in 0.16); "
                               "upgrade DeepSpeed, or leave 'optimizer' out of the tags")
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

        try:
            engine.offload_states(include=self._states(), device=OffloadDeviceEnum.cpu, pin_memory=True,
                                  non_blocking=False)
        except Exception as exc:  # DeepSpeed names its own limit (device, optimizer, stage): pass it on
            stage = int(engine.zero_optimization_stage())
            raise RuntimeError(
                f"engine.sleep('optimizer') at ZeRO stage {stage}: DeepSpeed's offload_states refused: {exc}; "
                "nothing was moved: leave 'optimizer' out of the tags (the rollout memory still sleeps)") from exc
        self.asleep = True

    def wake(self, *, auto: bool = False) -> bool:
        if not self.asleep:
            return False
        self.ds_engine.reload_states(non_blocking=False)
        self.asleep = False
        if auto:
            self.wakes += 1
        return True


def handoff_for(training: Any) -> OptimizerHandoff | ZeroHandoff | None:
    """The hand-off of a training backend (``None``: no optimizer)."""
    if training.optimizer is None:
        return None
    ds_engine = getattr(training, "ds_engine", None)
    if ds_engine is not None:
        return ZeroHandoff(ds_engine)
    guard = getattr(training, "_guard", None)
    return OptimizerHandoff(training.optimizer, training.module,
                            extra=guard.tensors if guard is not None else None)
