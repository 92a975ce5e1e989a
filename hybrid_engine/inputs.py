"""Checks on user inputs that both front ends (``engine.generate`` and rollouts) make before any work.

A tensor on another device than the model would otherwise fail deep inside a
forward (or, for a ``meta`` tensor, with an internal ``NotImplementedError``),
after graphs or slots may already have been touched. Refusing it up front, with
both devices named, keeps the engine usable and the error actionable.
"""

from __future__ import annotations

import torch

__all__ = ["check_device", "decode_model", "model_device"]


def decode_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model that decodes for ``model``: a PEFT wrapper's base model, else ``model`` itself.

    A ``PeftModel`` forwards to its base model, whose LoRA layers were injected in
    place, so decoding the base model runs the adapters (found by duck typing: no
    peft import).
    """
    from transformers import PreTrainedModel

    get_base = getattr(model, "get_base_model", None)
    if not isinstance(model, PreTrainedModel) and callable(get_base):
        base = get_base()
        if isinstance(base, PreTrainedModel):
            return base
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s parameters (the CPU for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def check_device(what: str, tensor: torch.Tensor, model: torch.nn.Module) -> None:
    """``ValueError`` naming both devices unless ``tensor`` is on ``model``'s device (and holds data)."""
    device = model_device(model)
    if tensor.is_meta:
        raise ValueError(f"{what} is a meta tensor (a shape without data); pass real token ids on {device}")
    if tensor.device != device:
        raise ValueError(
            f"{what} is on {tensor.device} but the model is on {device}; move it first, e.g. .to({str(device)!r})"
        )
