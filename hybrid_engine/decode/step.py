"""Prefill and one-token decode as plain functions over a :class:`StaticKVCache`.

``decode_one_token`` is the function that gets captured into an accelerator
graph once and replayed for every later step, so it obeys the capture rules:

* every per-step input is read from a device tensor whose address never
  changes: the token ids (the caller copies the next tokens into one static
  ``tokens`` tensor before each replay), ``cache.write_pos``, ``cache.position``
  and ``cache.valid``; the step advances ``write_pos``/``position`` in place;
* no host reads and no data-dependent shapes: the 4D additive attention mask and
  the position ids are built here from device state and passed explicitly, so
  transformers' mask-building code (which may read the mask on the host to decide
  whether it can be skipped) returns early, and ``get_seq_length`` (OPT asks at
  every forward) is answered with a device tensor in every step, eager or
  captured, so neither reads the host;
* the only host values frozen into a capture are shapes and ``cache.kv_len``
  (``None``: attention spans the whole capacity; an int: one graph per length).

``prefill`` is never captured; it writes a left-padded prompt batch into any
subset of cache rows. Works with transformers 4.57 (``past_key_values=``,
``cache_position=``) and 5.x (``cache=``; no ``cache_position``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.accelerator import is_capturing
from hybrid_engine.decode.kv_cache import StaticKVCache

__all__ = ["build_decode_mask", "build_prefill_mask", "decode_one_token", "prefill", "prompt_position_ids"]


_SIGNATURES: dict[type, tuple[str, bool, bool]] = {}


def _forward_signature(model: torch.nn.Module) -> tuple[str, bool, bool]:
    """(cache keyword, takes cache_position, takes logits_to_keep) for ``model.forward``."""
    cls = type(model)
    sig = _SIGNATURES.get(cls)
    if sig is None:
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            cache_kw = "cache"
        elif "past_key_values" in params:
            cache_kw = "past_key_values"
        else:
            raise TypeError(f"{cls.__name__}.forward takes neither `cache` nor `past_key_values`")
        sig = (cache_kw, "cache_position" in params, "logits_to_keep" in params)
        _SIGNATURES[cls] = sig
    return sig


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def build_decode_mask(valid: torch.Tensor, dtype: torch.dtype, kv_len: int | None = None) -> torch.Tensor:
    """``[B, 1, 1, kv_len]`` additive mask: 0 where ``valid``, ``finfo(dtype).min`` elsewhere."""
    if kv_len is not None:
        valid = valid[:, :kv_len]
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=valid.device)
    return torch.where(valid, zero, neg)[:, None, None, :]


def build_prefill_mask(attention_mask: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, 1, T, kv_len]`` additive mask for a prompt written at slots ``0..T-1``: causal AND key is a real token.

    A padding query also sees its own slot: a row with every key masked is all ``finfo.min``, which fp16 eager
    attention can round to ``-inf`` and softmax to NaN, and a NaN in a padding slot's K/V poisons every real
    row that masks it (NaN + mask is NaN). Real rows are unchanged: a masked key weighs exactly 0."""
    n, t = attention_mask.shape
    device = attention_mask.device
    key_real = torch.zeros(n, kv_len, dtype=torch.bool, device=device)
    key_real[:, :t] = attention_mask.bool()
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    allowed = ((k <= q)[None, :, :] & key_real[:, None, :]) | (k == q)[None, :, :]
    zero = torch.zeros((), dtype=dtype, device=device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(allowed, zero, neg)[:, None, :, :]


def prompt_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: ``cumsum(mask) - 1`` for real tokens, 0 for pads."""
    mask = attention_mask.to(torch.int64)
    return ((mask.cumsum(-1) - 1) * mask).clamp_(min=0)


def _forward(
    model: PreTrainedModel,
    cache: StaticKVCache,
    input_ids: torch.Tensor,
    mask4d: torch.Tensor,
    position_ids: torch.Tensor,
    cache_position: torch.Tensor,
) -> torch.Tensor:
    cache_kw, takes_cache_position, takes_logits_to_keep = _forward_signature(model)
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": mask4d,
        "position_ids": position_ids,
        cache_kw: cache,
        "use_cache": True,
    }
    if takes_cache_position:
        kwargs["cache_position"] = cache_position
    if takes_logits_to_keep:
        kwargs["logits_to_keep"] = 1
    cache.answer_on_device = True  # eager steps answer length queries as captured ones do: no host read
    try:
        out = model(**kwargs)
    finally:
        cache.answer_on_device = False
    logits = out[0] if isinstance(out, tuple) else out.logits  # a tuple under config.return_dict=False
    return logits[:, -1]


def _check_tokens(cache: StaticKVCache, tokens: torch.Tensor) -> None:
    if tokens.dim() != 1 or tokens.shape[0] != cache.batch_size:
        raise ValueError(f"decode_one_token: tokens must have shape [{cache.batch_size}], got {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"decode_one_token: tokens must be an integer tensor, got {tokens.dtype}")


@torch.no_grad()
def prefill(
    model: PreTrainedModel,
    cache: StaticKVCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: torch.LongTensor | None = None,
    *,
    checked: bool = False,
) -> torch.Tensor:
    """Run a LEFT-padded prompt batch ``[N, T]`` into cache ``rows`` (default ``0..N-1``); return ``[N, V]`` logits.

    Afterwards ``valid`` marks the real prompt tokens (nothing past them), ``write_pos
    = T`` and ``position`` = number of real tokens; K/V past ``T`` are left as they were
    (never attended). When ``rows`` is not the whole cache, the forward runs on a
    temporary cache of batch ``N`` and capacity ``T`` whose rows are then loaded with
    :meth:`StaticKVCache.load_rows`. ``checked=True`` skips the input checks (and their
    host read) for callers that validated already. Not capture-safe (never captured).
    """
    if not checked:
        _check_prompts(cache, input_ids, attention_mask)
    n, t = input_ids.shape
    device = cache.device
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device)
    whole = rows is None and n == cache.batch_size
    if whole:
        target = cache
        target.write_pos.zero_()  # the prompt is written at slots 0..T-1
    else:
        rows = torch.arange(n, device=device) if rows is None else torch.as_tensor(rows, device=device)
        if rows.numel() != n:
            raise ValueError(f"prefill: {n} prompts but {rows.numel()} rows")
        target = StaticKVCache(model.config, n, t, device=device, dtype=cache.dtype)
    # Attend over the prompt's own T slots only: prefill numerics do not depend on the cache capacity.
    saved_kv_len, target.kv_len = target.kv_len, t
    target.writes_at_start = True  # write_pos is 0 in every row (zeroed above, or a fresh cache)
    try:
        mask4d = build_prefill_mask(attention_mask, t, _model_dtype(model))
        logits = _forward(
            model,
            target,
            input_ids,
            mask4d,
            prompt_position_ids(attention_mask),
            torch.arange(t, device=device),
        )
    finally:
        target.kv_len = saved_kv_len
        target.writes_at_start = False
    if whole:
        target.valid[:, t:] = False
    target.valid[:, :t] = attention_mask.bool()
    target.write_pos.fill_(t)
    target.position.copy_(attention_mask.to(torch.int64).sum(-1))
    if not whole:
        cache.load_rows(rows, target, checked=checked)
    return logits


def _check_prompts(cache: StaticKVCache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"prefill: input_ids [N, T] and attention_mask of the same shape expected, got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    n, t = input_ids.shape
    if t < 1 or n < 1:
        raise ValueError("prefill: empty prompt batch")
    if t > cache.capacity:
        raise ValueError(f"prefill: prompt length {t} exceeds the cache capacity {cache.capacity}")
    if not bool(attention_mask[:, -1].bool().all()):
        raise ValueError("prefill: prompts must be LEFT-padded with at least one real token (last column all 1)")


@torch.no_grad()
def decode_one_token(model: PreTrainedModel, cache: StaticKVCache, tokens: torch.Tensor) -> torch.Tensor:
    """One decode step for every row: feed ``tokens [B]``, return ``[B, V]`` logits (model dtype).

    Marks ``valid[b, write_pos[b]]``, attends over ``cache.kv_len`` (or all) slots,
    then advances ``write_pos`` and ``position`` by one in place. Capture-safe: the
    checks that need host reads run only outside capture.
    """
    kv_len = cache.kv_len if cache.kv_len is not None else cache.capacity
    if not is_capturing():
        _check_tokens(cache, tokens)
        end = int(cache.write_pos.max()) if cache.bounds_checks else -1
        if end >= kv_len:
            raise ValueError(
                f"decode_one_token: a row's write position {end} is at or past "
                f"{'kv_len' if cache.kv_len is not None else 'capacity'}={kv_len}; the cache is full"
            )
    write_pos = cache.write_pos
    cache.valid.scatter_(1, write_pos[:, None], True)
    mask4d = build_decode_mask(cache.valid, _model_dtype(model), kv_len)
    logits = _forward(
        model,
        cache,
        tokens[:, None],
        mask4d,
        cache.position[:, None],
        write_pos[:1],
    )
    write_pos.add_(1)
    cache.position.add_(1)
    return logits
