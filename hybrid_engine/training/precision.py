"""Low-precision parameters with fp32 master weights, for ZeRO stage 0 (as DeepSpeed does at 1-3).

With ``bf16``/``fp16`` enabled the module's parameters are cast to that dtype
once, before anything is captured, and stay there: the forward, the rollouts
and the captured decode graphs all run at low precision. The optimizer never
sees them. It steps fp32 *master* copies, and after each step the masters are
copied back into the low-precision parameters **in place**, so the parameters
keep their addresses and a captured graph reads the new weights on its next
replay without a recapture or a copy of its own.

Gradients are folded into the masters' fp32 ``.grad`` after every backward, so
accumulation over micro-steps happens in fp32. Under fp16 a
``torch.amp.GradScaler`` over the master optimizer scales the loss, unscales
the fp32 gradients, skips steps whose gradients overflowed and adapts the scale.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["MasterWeights"]


class MasterWeights:
    """fp32 masters for a module's trainable parameters, which :meth:`cast_module` then casts to ``dtype``."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        self._by_param = {id(p): m for p, m in zip(self.params, self.masters)}
        self._frozen = {id(p) for p in module.parameters() if not p.requires_grad}

    def cast_module(self) -> None:
        """Cast the module to ``dtype``, once everything that could refuse the setup is built: an error before
        it leaves the caller's model as it was. Parameters keep their identity (``param.data`` is swapped), so
        optimizers built on them can be remapped."""
        self.module.to(self.dtype)

    def master_params(self, params: Any) -> Any:
        """``params`` (parameters or param-group dicts, as an optimizer takes them) with masters substituted;
        the model's frozen parameters are left out, as DeepSpeed's mixed-precision optimizers leave them."""
        items = list(params)
        if items and isinstance(items[0], dict):
            return [{**group, "params": self._masters_of(group["params"])} for group in items]
        return self._masters_of(items)

    def _masters_of(self, params: Any) -> list[nn.Parameter]:
        return [self._master(p) for p in params if id(p) not in self._frozen]

    def _master(self, param: nn.Parameter) -> nn.Parameter:
        master = self._by_param.get(id(param))
        if master is None:
            raise ValueError(
                "initialize(): with bf16/fp16 enabled the optimizer must train the model's own trainable "
                "parameters (their fp32 master copies are stepped); a parameter outside the model was given"
            )
        return master

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` (built on the module's parameters) step the masters instead."""
        if any(optimizer.state.values()):
            raise ValueError(
                "initialize(): the optimizer already has state; with bf16/fp16 enabled pass a fresh optimizer, "
                "whose parameters are swapped for their fp32 master copies"
            )
        for group in optimizer.param_groups:
            group["params"] = [self._master(p) for p in group["params"]]

    def fold_gradients(self) -> None:
        """Add the low-precision gradients into the masters' fp32 gradients and drop them."""
        for param, master in zip(self.params, self.masters):
            if param.grad is None:
                continue
            grad = param.grad.to(torch.float32)
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the masters into the low-precision parameters, in place (addresses unchanged)."""
        for param, master in zip(self.params, self.masters):
            param.copy_(master)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, state: Iterable[torch.Tensor]) -> None:
        saved = list(state)
        if len(saved) != len(self.masters):
            raise ValueError(f"load_checkpoint: the checkpoint holds {len(saved)} master weights, the engine "
                             f"{len(self.masters)}; it was saved from another model or precision setting")
        for master, value in zip(self.masters, saved):
            master.copy_(value)
        self.publish()
