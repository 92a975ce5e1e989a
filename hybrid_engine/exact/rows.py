"""Rows packed so that a token's column is its position: what the exact attention's key blocks count from.

Why: :func:`~hybrid_engine.exact.kernels.block_attention` reduces keys in
fixed blocks from column 0, and a decode step holds a row's keys by position
from 0. A left-padded training batch puts a row's first token at column
``pads``, so its blocks would start elsewhere and sum in another order.
:func:`pack_rows` moves every row's real tokens to the front (in order, pads
after), and :func:`unpack` puts per-token outputs back where the caller's
columns are. Both are gathers: exact, differentiable and capture-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["pack_order", "pack_rows", "packed_forward", "unpack"]


def pack_order(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` column order that puts each row's real tokens first, in order (a stable sort)."""
    return torch.sort((attention_mask == 0).to(torch.int8), dim=-1, stable=True).indices


def pack_rows(order: torch.Tensor, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each ``[N, T, ...]`` tensor (``None`` passes through) with its columns taken in ``order``."""
    return [None if t is None else t.gather(1, _expand(order, t)) for t in tensors]


def unpack(order: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_rows` for one ``[N, T, ...]`` tensor: column ``c`` back at ``order[:, c]``."""
    return packed.gather(1, _expand(torch.argsort(order, dim=-1), packed))


def _expand(order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    index = order.view(*order.shape, *([1] * (like.dim() - 2)))
    return index.expand(*order.shape, *like.shape[2:])


def packed_forward(forward: Callable[..., Any], input_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   **kwargs: Any) -> Any:
    """``forward(...)`` on rows packed by :func:`pack_rows`, with ``logits`` (and ``hidden_states``) put back in
    the caller's columns. ``labels``, ``inputs_embeds`` and ``token_type_ids`` are packed along; without
    ``position_ids``, packed rows get ``0..T-1``, each real token its position."""
    if attention_mask is None or attention_mask.dim() != 2:
        return forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    order = pack_order(attention_mask)
    names = [n for n in _PER_TOKEN if kwargs.get(n) is not None]
    input_ids, attention_mask, position_ids, *rest = pack_rows(order, input_ids, attention_mask, position_ids,
                                                               *(kwargs[n] for n in names))
    kwargs.update(zip(names, rest))
    if position_ids is None:
        position_ids = torch.arange(order.shape[1], device=order.device).expand(order.shape)
    out = forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.shape[:2] == order.shape:
        out.logits = unpack(order, logits)
    hidden = getattr(out, "hidden_states", None)
    if isinstance(hidden, tuple):
        out.hidden_states = tuple(unpack(order, h) if h.shape[:2] == order.shape else h for h in hidden)
    return out


_PER_TOKEN = ("labels", "inputs_embeds", "token_type_ids")
