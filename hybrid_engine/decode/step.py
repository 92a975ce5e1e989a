"""Prefill and one-token decode as plain functions over a :class:`~hybrid_engine.decode.kv_cache.PagedKVCache`.

``decode_one_token`` is the function that gets captured into an accelerator
graph once and replayed for every later step, so it obeys the capture rules:

* every per-step input is read from a device tensor whose address never
  changes: the token ids (one static ``tokens`` tensor), the rows' block
  tables, ``write_pos`` and ``position``; the step advances the last two in
  place;
* no host reads and no data-dependent shapes: the pool slots the step writes
  and reads, the 4D additive attention mask and the position ids are computed
  here from device state and passed explicitly, so transformers' mask-building
  code returns early, and ``get_seq_length`` (OPT asks at every forward) is
  answered with a device tensor in every step, eager or captured;
* the only host values frozen into a capture are shapes and the ``span`` (how
  many pages of each row attention reads: one graph per span bucket).

Each step function computes the forward's indices and hands them to the cache
in one :class:`~hybrid_engine.decode.kv_cache.ForwardIndices`
(:meth:`~hybrid_engine.decode.kv_cache.PagedKVCache.set_forward`); nothing
else is set on the cache for a forward.

``prefill`` writes a left-padded (or right-aligned) prompt batch into any rows
of the cache; the prompt attends to its own new states, so its numerics do not
depend on the pool. It is captured only through the prompt stage
(:mod:`hybrid_engine.decode.staging`). Works with transformers 4.57
(``past_key_values=``, ``cache_position=``) and 5.x (``cache=``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.accelerator import is_capturing
from hybrid_engine.decode.fused_forward import fused_decode_forward
from hybrid_engine.decode.kv_cache import ForwardIndices, PagedKVCache
from hybrid_engine.decode.layout import FULL, AttentionKind, attention_kinds
from hybrid_engine.decode.ops.paged_attention import (
    PAGED_ATTENTION,
    PAGED_MODEL_TYPES,
    PagedRead,
    implementation,
)
from hybrid_engine.exact.mode import exact_ops, uses_exact_attention
from hybrid_engine.exact.rows import pack_order, pack_rows
from hybrid_engine.model_access import attention_implementation

__all__ = ["build_decode_mask", "build_prefill_mask", "build_ring_mask", "decode_one_token", "extend", "layer_masks", "prefill",
           "prompt_position_ids"]


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


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def build_decode_mask(write_pos: torch.Tensor, span: int, dtype: torch.dtype,
                      kind: AttentionKind = FULL) -> torch.Tensor:
    """``[B, 1, T, span]`` additive mask of queries at logical indices ``write_pos`` (``[B]``: one per row, a
    decode step; ``[B, T]``: :func:`extend`): query ``q`` of a row sees its logical keys ``j <= q`` (what the row
    holds and the tokens being written; a key's logical index is its position), within the last ``kind.window``
    positions or the query's ``kind.chunk``; 0 there, ``finfo(dtype).min`` elsewhere."""
    keys = _arange(span, write_pos.device)[None, None, :]
    query = (write_pos[:, None] if write_pos.dim() == 1 else write_pos)[:, :, None]
    return _additive(keys <= query, keys, query, kind, dtype)[:, None, :, :]


def _additive(allowed: torch.Tensor, keys: torch.Tensor, query: torch.Tensor, kind: AttentionKind,
              dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed`` and key position ``keys`` is within query ``query``'s window or chunk, else
    ``finfo(dtype).min``."""
    if kind.window is not None:
        allowed = allowed & (keys > query - kind.window)
    if kind.chunk is not None:
        allowed = allowed & (keys >= query - query % kind.chunk)
    zero, neg = _mask_values(dtype, query.device)
    return torch.where(allowed, zero, neg)


def _mask_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0 and ``finfo(dtype).min`` as 0-dim ``dtype`` tensors on ``device``: made once, read by every step's mask
    (never written, so a captured step may read them)."""
    return _constant(("mask", dtype, device), lambda: (torch.zeros((), dtype=dtype, device=device),
                                                       torch.full((), torch.finfo(dtype).min, dtype=dtype,
                                                                  device=device)))


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` on ``device``, made once (never written)."""
    return _constant(("arange", n, device), lambda: torch.arange(n, device=device))


_CONSTANTS: dict[tuple, Any] = {}


def _constant(key: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, kept under ``key`` when made outside a capture. One made while capturing is not kept: a
    capture runs none of its work, so its tensors hold their values only after a replay (on CUDA, in the graph's
    private memory), and an eager step reading them would read garbage."""
    value = _CONSTANTS.get(key)
    if value is None:
        value = make()
        if not is_capturing():
            if len(_CONSTANTS) > 256:  # spans and dtypes are few; bound it anyway
                _CONSTANTS.clear()
            _CONSTANTS[key] = value
    return value


def build_ring_mask(write_pos: torch.Tensor, ring: int, dtype: torch.dtype, kind: AttentionKind) -> torch.Tensor:
    """``[B, 1, 1, ring]`` additive mask of a decode step over a windowed layer's ring: slot ``r`` of a row whose
    query is at position ``q = write_pos`` holds position ``q - (q - r) mod ring`` (the latest written there),
    seen when that is not negative and within the query's window or chunk."""
    query = write_pos[:, None]
    slots = torch.arange(ring, device=write_pos.device)[None, :]
    held = query - (query - slots).remainder(ring)
    return _additive(held >= 0, held, query, kind, dtype)[:, None, None, :]


def build_prefill_mask(attention_mask: torch.Tensor, kv_len: int, dtype: torch.dtype,
                       kind: AttentionKind = FULL) -> torch.Tensor:
    """``[N, 1, T, kv_len]`` additive mask for a prompt written at slots ``0..T-1``: causal AND key is a real token
    (AND within ``kind.window`` positions, or in the query's ``kind.chunk``).

    A padding query also sees its own slot: a row with every key masked is all ``finfo.min``, which fp16 eager
    attention can round to ``-inf`` and softmax to NaN, and a NaN in a padding slot's K/V poisons every real
    row that masks it (NaN + mask is NaN). Real rows are unchanged: a masked key weighs exactly 0."""
    n, t = attention_mask.shape
    device = attention_mask.device
    key_real = torch.zeros(n, kv_len, dtype=torch.bool, device=device)
    key_real[:, :t] = attention_mask.bool()
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    causal = (k <= q)[None, :, :] & key_real[:, None, :]
    if kind.window is not None:  # real tokens are consecutive: a column apart is a position apart
        causal &= (q - k < kind.window)[None, :, :]
    if kind.chunk is not None:
        pos = prompt_position_ids(attention_mask)
        key_chunk = torch.zeros(n, kv_len, dtype=torch.int64, device=device)
        key_chunk[:, :t] = pos // kind.chunk
        causal &= key_chunk[:, None, :] == (pos // kind.chunk)[:, :, None]
    allowed = causal | (k == q)[None, :, :]
    zero = torch.zeros((), dtype=dtype, device=device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(allowed, zero, neg)[:, None, :, :]


def prompt_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: ``cumsum(mask) - 1`` for real tokens, 0 for pads."""
    mask = attention_mask.to(torch.int64)
    return ((mask.cumsum(-1) - 1) * mask).clamp_(min=0)


def layer_masks(model: PreTrainedModel, build: Callable[[AttentionKind], torch.Tensor],
                padding: torch.Tensor | None = None, kinds: dict[str | None, AttentionKind | None] | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """The ``attention_mask`` a forward takes: one 4D mask, or one per layer type (models with sliding or
    chunked layers among full ones take a dict), each built once by ``build``. Linear-attention layers take
    ``padding``, the 2-D mask of a prefill's real tokens (``None``: a decode step's single real token).
    ``kinds``: :func:`~hybrid_engine.decode.layout.attention_kinds` of the model's config, when the caller read
    it already (``None``: read here)."""
    if kinds is None:
        kinds = attention_kinds(model.config)
    if None in kinds:
        return build(kinds[None])
    if all(kind is None for kind in kinds.values()):  # only linear layers (Mamba): the padding mask alone
        return padding
    built: dict[AttentionKind, torch.Tensor] = {}
    for kind in kinds.values():
        if kind is not None and kind not in built:
            built[kind] = build(kind)
    return {name: padding if kind is None else built[kind] for name, kind in kinds.items()}


def _forward(
    model: PreTrainedModel,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    mask4d: torch.Tensor | dict[str, torch.Tensor],
    position_ids: torch.Tensor,
    cache_position: torch.Tensor,
    last: torch.Tensor | None = None,
    paged: PagedRead | None = None,
) -> torch.Tensor:
    """The logits of each row's last column, or of column ``last[row]`` (all columns are then computed);
    ``paged``: a decode step whose attention reads pages in place (:func:`reads_pages_in_place`)."""
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
    if takes_logits_to_keep and last is None:
        kwargs["logits_to_keep"] = 1
    if paged is not None:
        kwargs["paged_kv"] = paged  # through the model's keyword arguments to its attention function
    with exact_ops() if uses_exact_attention(model) else contextlib.nullcontext(), \
            attention_implementation(model.config, PAGED_ATTENTION if paged is not None else None):
        out = model(**kwargs)
    logits = out[0] if isinstance(out, tuple) else out.logits  # a tuple under config.return_dict=False
    if last is None:
        return logits[:, -1]
    return logits.gather(1, last.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1)


def reads_pages_in_place(model: PreTrainedModel, cache: PagedKVCache,
                         kinds: dict[str | None, AttentionKind | None] | None = None) -> bool:
    """Whether a decode step's attention reads each row's pages in place (the ``paged_decode_attention`` op)
    rather than gathering them: where the op has a kernel on the cache's device (its capability probe), for
    ``sdpa`` models of the families that hand it the pages, with full attention only and no exact mode. The
    reference implementation is the gather the step does anyway, so it never switches."""
    if getattr(model.config, "model_type", None) not in PAGED_MODEL_TYPES \
            or getattr(model.config, "_attn_implementation", None) != "sdpa" \
            or cache.states is not None or any(cache.rings) or uses_exact_attention(model):
        return False
    kinds = attention_kinds(model.config) if kinds is None else kinds
    return kinds.get(None) == FULL and len(kinds) == 1 and implementation(cache.device) != "reference"


def _check_tokens(cache: PagedKVCache, tokens: torch.Tensor) -> None:
    if tokens.dim() != 1 or tokens.shape[0] != cache.batch_size:
        raise ValueError(f"decode_one_token: tokens must have shape [{cache.batch_size}], got {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"decode_one_token: tokens must be an integer tensor, got {tokens.dtype}")


@torch.no_grad()
def prefill(
    model: PreTrainedModel,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: torch.LongTensor | None = None,
    *,
    checked: bool = False,
) -> torch.Tensor:
    """Run a LEFT-padded prompt batch ``[N, T]`` into cache ``rows`` (default ``0..N-1``); return ``[N, V]`` logits.

    Each row's real tokens are written at its logical indices ``0..len-1``, into
    the pages its block table names (padding writes the null page); afterwards
    ``write_pos`` = ``position`` = its real-token count. The prompt attends over
    its own ``T`` new states, so prefill numerics depend neither on the pool nor
    on the cache capacity. ``checked=True`` skips the input checks (and their
    host read) for callers that validated already (capture-safe then).
    """
    if not checked:
        _check_prompts(cache, input_ids, attention_mask)
    n, t = input_ids.shape
    device = cache.device
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device)
    if rows is None:
        if n > cache.batch_size:
            raise ValueError(f"prefill: {n} prompts but the cache has {cache.batch_size} rows")
        table = cache.block_table[:n]
    else:
        rows = torch.as_tensor(rows, dtype=torch.int64, device=device)
        if rows.numel() != n:
            raise ValueError(f"prefill: {n} prompts but {rows.numel()} rows")
        table = cache.block_table.index_select(0, rows)
    lengths = attention_mask.to(torch.int64).sum(-1)
    last = None
    if uses_exact_attention(model):
        # Exact attention counts key blocks from column 0: each row's tokens go first, as in a decode step.
        input_ids, attention_mask = pack_rows(pack_order(attention_mask), input_ids, attention_mask)
        last = lengths - 1
    # The forward runs on a view of the target rows whose lengths read 0: the prompt is all there is.
    states = None if cache.states is None else cache.states.sub(slice(0, n) if rows is None else rows)
    target = cache.forward_view(table, torch.zeros_like(lengths), torch.zeros_like(lengths), states)
    real = attention_mask.bool()
    target.set_forward(ForwardIndices(
        write_slots=target.token_slots(prompt_position_ids(attention_mask), keep=real).flatten(), kv_len=t,
        fresh=True, token_pos=prompt_position_ids(attention_mask), token_keep=real, token_len=lengths))
    dtype = model_dtype(model)
    mask4d = layer_masks(model, lambda kind: build_prefill_mask(attention_mask, t, dtype, kind), attention_mask)
    logits = _forward(model, target, input_ids, mask4d, prompt_position_ids(attention_mask),
                      torch.arange(t, device=device), last)
    if rows is None:
        cache.write_pos[:n].copy_(lengths)
        cache.position[:n].copy_(lengths)
    else:
        cache.write_pos.index_copy_(0, rows, lengths)
        cache.position.index_copy_(0, rows, lengths)
    return logits


@torch.no_grad()
def extend(model: PreTrainedModel, cache: PagedKVCache, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           rows: torch.Tensor, span: int) -> torch.Tensor:
    """Run new tokens ``[N, T]`` (left-padded) onto cache ``rows`` that already hold ``write_pos`` tokens (an
    episode's next turn on the pages its earlier turns filled); return each row's last logits ``[N, V]``.

    Row ``i``'s tokens are written at logical indices ``write_pos .. write_pos + n_i - 1`` (positions from
    ``position``), and attend over the row's first ``span`` pages, which must hold them all: the cached
    tokens and the new ones, causally, as one decode step per token would. Padding writes the null page and
    sees key 0 only. ``write_pos`` and ``position`` then advance by ``n_i``. Eager (a host int sets the span);
    the caller has checked the inputs and written the rows' block tables."""
    n, t = input_ids.shape
    device = cache.device
    table = cache.block_table.index_select(0, rows)
    cached = cache.write_pos.index_select(0, rows)
    start = cache.position.index_select(0, rows)
    if cache.states is not None:
        raise ValueError("extend: rows with state layers or windowed rings cannot continue on kept pages (their "
                         "states are not kept); prefill the whole history")
    target = cache.forward_view(table, cached, start)
    real = attention_mask.bool()
    new = attention_mask.to(torch.int64).sum(-1)
    offset = torch.arange(t, device=device)[None, :] - (t - new)[:, None]  # 0 at each row's first new token
    logical = torch.where(real, cached[:, None] + offset, 0)
    kv_len = target.span_tokens(span)
    target.set_forward(ForwardIndices(write_slots=target.token_slots(logical, keep=real).flatten(), kv_len=kv_len,
                                      read_slots=target.span_slots(span)))
    dtype = model_dtype(model)
    mask4d = layer_masks(model, lambda kind: build_decode_mask(logical, kv_len, dtype, kind))
    logits = _forward(model, target, input_ids, mask4d, torch.where(real, start[:, None] + offset, 0),
                      logical.max(0).values)
    cache.write_pos.index_copy_(0, rows, cached + new)
    cache.position.index_copy_(0, rows, start + new)
    return logits


def _check_prompts(cache: PagedKVCache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
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
def decode_one_token(model: PreTrainedModel, cache: PagedKVCache, tokens: torch.Tensor,
                     live: torch.Tensor | None = None, span: int | None = None, *,
                     kinds: dict[str | None, AttentionKind | None] | None = None,
                     dtype: torch.dtype | None = None, advance: torch.Tensor | None = None,
                     paged: bool | None = None, fused: bool = False) -> torch.Tensor:
    """One decode step for every row: feed ``tokens [B]``, return ``[B, V]`` logits (model dtype).

    Row ``b`` writes its token at logical index ``write_pos[b]`` and attends
    over its first ``span`` pages (all of them when ``None``), masked
    by its length; ``write_pos`` and ``position`` then advance by one in place.
    ``live`` (bool ``[B]``): rows that are not live write the null page and do
    not advance (finished or free slots of a captured bucket). Capture-safe:
    the checks that need host reads run only outside capture. ``kinds`` and ``dtype``: the model's mask kinds
    and dtype, when the caller read them once for its call (``None``: read here); ``advance``: ``live`` as int64,
    when the caller has it already; ``paged``: :func:`reads_pages_in_place`, when the caller asked it once for
    its call (``None``: asked here); ``fused``: run the fused decode forward
    (:func:`~hybrid_engine.decode.fused_forward.fused_decode_forward`, whose support the caller checked:
    :func:`~hybrid_engine.decode.fused_forward.resolve_fused_decode`) instead of transformers' model forward.
    """
    if not is_capturing():
        _check_tokens(cache, tokens)
        cache.check_room(1, span)
    write_pos = cache.write_pos
    keep = None if live is None else live[:, None]
    read_slots = cache.span_slots(span)
    rings = any(cache.rings)  # windowed layers read their rings (all of them, or none: layer_specs)
    if fused and rings:
        raise ValueError("decode_one_token: fused=True needs full attention over pages (this cache has windowed "
                         "rings); resolve the flag with fused_forward.resolve_fused_decode")
    if rings:  # a ring's position may lie past the pages it reads
        write_slots = cache.token_slots(write_pos[:, None], keep=keep).flatten()
    else:  # the written token lies in the span: its slot is one of the span's
        write_slots = cache.span_write_slots(read_slots, write_pos, keep)
    kv_len = cache.span_tokens(span)
    if fused:
        indices = ForwardIndices(write_slots=write_slots, kv_len=kv_len, read_slots=read_slots, paged=True)
        pages = _paged_read(cache, kv_len)

        def run() -> torch.Tensor:
            return fused_decode_forward(model, cache, tokens[:, None], cache.position[:, None], pages)
    else:
        indices, run = _transformers_step(model, cache, tokens, keep, rings, write_slots, read_slots, kv_len,
                                          kinds, dtype, paged)
    cache.set_forward(indices)
    try:
        logits = run()
    finally:  # the indices are this forward's temporaries: nothing outlives a captured step but its outputs
        cache.set_forward(None)
    step = 1 if live is None else live.to(torch.int64) if advance is None else advance
    write_pos.add_(step)
    cache.position.add_(step)
    return logits


def _paged_read(cache: PagedKVCache, kv_len: int) -> PagedRead:
    """Each row's pages within ``kv_len`` tokens and its length, the token being written included (a row that
    is not live may lie past the span: clamped, so no kernel reads past its table)."""
    return PagedRead(cache.block_table[:, :kv_len // cache.page_size], (cache.write_pos + 1).clamp_(max=kv_len),
                     cache.page_size)


def _transformers_step(model: PreTrainedModel, cache: PagedKVCache, tokens: torch.Tensor,
                       keep: torch.Tensor | None, rings: bool, write_slots: torch.Tensor, read_slots: torch.Tensor,
                       kv_len: int, kinds: dict[str | None, AttentionKind | None] | None, dtype: torch.dtype | None,
                       paged: bool | None) -> tuple[ForwardIndices, Callable[[], torch.Tensor]]:
    """A decode step's indices and forward through transformers' model (masks built here, attention reading
    pages in place where ``paged``)."""
    write_pos = cache.write_pos
    token_pos = token_keep = None
    if rings:  # only ring layers read them: no extra work in other models' steps
        token_pos = write_pos[:, None]
        token_keep = torch.ones_like(token_pos, dtype=torch.bool) if keep is None else keep
    dtype = dtype or model_dtype(model)

    def build(kind: AttentionKind) -> torch.Tensor:
        if rings and (kind.window or kind.chunk):
            return build_ring_mask(write_pos, kind.window or kind.chunk, dtype, kind)
        return build_decode_mask(write_pos, kv_len, dtype, kind)

    mask4d = layer_masks(model, build, kinds=kinds)
    if paged is None:
        paged = reads_pages_in_place(model, cache, kinds)
    pages = _paged_read(cache, kv_len) if paged else None
    read_pages = None if paged else cache.block_table[:, :kv_len // cache.page_size].reshape(-1)
    indices = ForwardIndices(write_slots=write_slots, kv_len=kv_len, read_slots=read_slots, read_pages=read_pages,
                             token_pos=token_pos, token_keep=token_keep, paged=paged)
    return indices, lambda: _forward(model, cache, tokens[:, None], mask4d, cache.position[:, None], write_pos[:1],
                                     paged=pages)
