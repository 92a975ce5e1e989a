"""Token-id settings (pad, EOS) as both front ends read them: integers that fit the int64 token tensors.

A bad id is refused on the host, naming the setting, before any device work.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = ["MAX_TOKEN_ID", "token_id", "token_ids"]


#: Token ids are int64 on the device: a larger one could not be written into a token tensor.
MAX_TOKEN_ID = 2**63 - 1


def token_id(value: Any, name: str) -> int:
    """One token id, checked: an integer (not a bool) that fits in int64, else a ``TypeError``/``ValueError``
    naming the setting."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        value = value.item()
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must hold integer token ids, got {type(value).__name__} ({value!r})")
    if not -MAX_TOKEN_ID - 1 <= value <= MAX_TOKEN_ID:
        raise ValueError(f"{name}: token id {value} does not fit in int64; pass an id of the model's vocabulary")
    return int(value)


def token_ids(value: Any, name: str = "eos_token_id") -> tuple[int, ...]:
    """A token-id setting (``None``, an int, a list/tuple or a tensor, as in generation configs) as a tuple of
    checked ids (:func:`token_id`); ``None`` entries are skipped."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise TypeError(f"{name} must hold integer token ids, got a {value.dtype} tensor")
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        return tuple(token_id(v, name) for v in value if v is not None)
    return (token_id(value, name),)
