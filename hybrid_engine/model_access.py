"""What the engine reads off a model: the module that decodes, its device, ZeRO-3 partitioning, input devices.

Both front ends (``engine.generate`` and rollouts) check their inputs' devices
here before any work. A tensor on another device than the model would otherwise fail deep inside a
forward (or, for a ``meta`` tensor, with an internal ``NotImplementedError``),
after graphs or slots may already have been touched. Refusing it up front, with
both devices named, keeps the engine usable and the error actionable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ADAPTER_STATE", "attention_implementation", "check_device", "decode_model", "is_zero3_partitioned", "model_device"]


# Host-side attributes of a PEFT tuner layer (found by duck typing: no peft import) that its forward branches on
# or freezes into a captured graph.
ADAPTER_STATE = ("merged_adapters", "_active_adapter", "_disable_adapters", "scaling")


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


def is_zero3_partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitioned (DeepSpeed tags each with ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _attn_implementations(config: Any) -> list[tuple[Any, Any]]:
    """``(config, _attn_implementation)`` for ``config`` and its sub-configs (setting it recurses into them)."""
    out = [(config, config._attn_implementation)]
    for name in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out.extend(_attn_implementations(sub))
    return out


@contextlib.contextmanager
def attention_implementation(config: Any, impl: str | None) -> Iterator[None]:
    """Run the block with ``config._attn_implementation = impl`` (``None``: unchanged); the config's own value,
    and its sub-configs', are put back after."""
    if impl is None or config is None or config._attn_implementation == impl:
        yield
        return
    saved = _attn_implementations(config)
    config._attn_implementation = impl
    try:
        yield
    finally:
        for cfg, value in saved:
            cfg._attn_implementation = value
