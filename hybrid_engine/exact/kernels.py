"""Batch-invariant kernels: a row's result never depends on how many rows, keys or padding share the call.

Why: a BLAS matmul picks its blocking (and so its summation order) from the
shapes of the call, so the same row multiplied alone, beside 7 others, or as
row 300 of a training batch comes out different in the last bits; attention
that reduces over "all keys of this call" does the same with the key count.
Here every contraction is a ``bmm`` of one fixed shape per operand shape:

* :func:`fixed_bmm` cuts the rows of ``a`` into chunks of :data:`CHUNK_ROWS`
  (padding the last with zeros) and multiplies all chunks in one ``bmm``; a
  row's dot products are then computed by the same kernel at the same shape
  whatever else is in the call;
* :func:`exact_linear` is ``F.linear`` (and GPT-2's ``addmm``) through it;
* :func:`block_attention` is softmax attention over fixed blocks of
  :data:`KEY_BLOCK` keys, counted from key 0: the max over the keys a query
  sees (exact in any order), one weighted sum per block, and the blocks
  added in order. A block in which every key is masked adds exact zeros, so
  a decode step that sees keys past its query, masked, and a training
  forward that sees the rest of the sequence, masked, sum the same blocks in
  the same order. Keys must be laid out by position from column 0 (the
  decode cache is; :mod:`hybrid_engine.exact.rows` packs training rows so).

Nothing here reads the device on the host or depends on data for a shape, so
each function captures into a graph; the chunk counts are host ints of the
shapes, frozen like every shape.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_ROWS", "KEY_BLOCK", "attention_calls", "block_attention", "exact_addmm", "exact_linear",
           "fixed_bmm"]

#: Rows per matmul chunk: every contraction runs at ``[CHUNK_ROWS, K] x [K, N]``.
CHUNK_ROWS = 16
#: Keys per attention block (the online softmax combines blocks from key 0 on).
KEY_BLOCK = 64


_calls = 0


def attention_calls() -> int:
    """How many times :func:`block_attention` has run (host counter: a model whose attention bypasses
    transformers' attention interface never reaches it, and the exact mode refuses it)."""
    return _calls


def fixed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [G, M, K] @ b [G, K, N]`` (``b`` may be ``[K, N]``, shared), as chunks of :data:`CHUNK_ROWS` rows.

    Each chunk of ``a`` is multiplied in one ``bmm`` of fixed shape, so row ``i``
    of the result depends only on row ``i`` of ``a`` and on ``b``."""
    shared = b.dim() == 2
    g, m, k = a.shape
    n = b.shape[-1]
    pad = (-m) % CHUNK_ROWS
    if pad:
        a = torch.cat([a, a.new_zeros(g, pad, k)], dim=1)
    chunks = a.shape[1] // CHUNK_ROWS
    a = a.reshape(g * chunks, CHUNK_ROWS, k)
    if shared:
        b = b.unsqueeze(0).expand(g * chunks, k, n)
    else:
        b = b.unsqueeze(1).expand(g, chunks, k, n).reshape(g * chunks, k, n)
    return torch.bmm(a, b).view(g, chunks * CHUNK_ROWS, n)[:, :m]


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row depends only on its input row (see :func:`fixed_bmm`)."""
    lead = x.shape[:-1]
    flat = x.reshape(1, -1, x.shape[-1])
    out = fixed_bmm(flat, weight.t()).reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias


def exact_addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, beta: Any = 1,
                alpha: Any = 1) -> torch.Tensor:
    """``torch.addmm(bias, x [M, K], weight [K, N])`` (GPT-2's ``Conv1D``), row-invariant."""
    out = fixed_bmm(x.unsqueeze(0), weight)[0]
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta)


def _allowed(attention_mask: torch.Tensor | None, b: int, lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[B or 1, H or 1, Lq, Lk]``: which keys each query may see (causal when no mask is given)."""
    if attention_mask is None:
        q = torch.arange(lq, device=device)[:, None] + (lk - lq)
        return (torch.arange(lk, device=device)[None, :] <= q)[None, None]
    mask = attention_mask[..., :lk]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2  # additive masks: 0 attends, finfo.min masks


def block_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, H, Lq, D]``, ``key``/``value [B, Hkv, Lk, D]``.

    Returns ``(out [B, Lq, H, Dv], None)``. Computed in float32 and cast back to the query's dtype.
    """
    global _calls
    _calls += 1
    if dropout:
        raise ValueError(f"exact_logprobs: attention dropout ({dropout}) makes logprobs random; set the model's "
                         "attention dropout to 0 or turn exact_logprobs off")
    for unsupported in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"exact_logprobs: attention with `{unsupported}` is not supported; turn "
                             "exact_logprobs off for this model")
    b, h, lq, d = query.shape
    hk, lk, dv = key.shape[1], key.shape[2], value.shape[-1]
    if h != hk:
        key = key.repeat_interleave(h // hk, dim=1)
        value = value.repeat_interleave(h // hk, dim=1)
    scale = float(scaling) if scaling is not None else d ** -0.5
    blocks = -(-lk // KEY_BLOCK)
    pad = blocks * KEY_BLOCK - lk
    g = b * h
    allowed = _allowed(attention_mask, b, lq, lk, query.device).expand(b, h, lq, lk).reshape(g, lq, lk)
    # Keys (and values with a column of ones, whose product sums the weights) as [G * blocks, KEY_BLOCK, D]:
    # one bmm per kind over every (row, head, block), each of the same shape whatever lk is.
    k = F.pad(key.float().reshape(g, lk, d), (0, 0, 0, pad)).view(g * blocks, KEY_BLOCK, d)
    v = F.pad(value.float().reshape(g, lk, dv), (0, 1, 0, pad), value=1.0)
    v = v.view(g * blocks, KEY_BLOCK, dv + 1)
    q = (query.float() * scale).reshape(g, 1, lq, d).expand(g, blocks, lq, d).reshape(g * blocks, lq, d)
    scores = fixed_bmm(q, k.transpose(1, 2))  # [G * blocks, lq, KEY_BLOCK]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(g, blocks, lq, KEY_BLOCK).transpose(1, 2).reshape(g, lq, blocks * KEY_BLOCK)
    allowed = F.pad(allowed, (0, pad), value=False)
    scores = torch.where(allowed, scores, torch.full((), float("-inf"), device=query.device))
    # The max over the keys a query sees is the same set of numbers in decode and in training (max is exact).
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - torch.where(top == float("-inf"), torch.zeros_like(top), top))
    weights = weights.view(g, lq, blocks, KEY_BLOCK).transpose(1, 2).reshape(g * blocks, lq, KEY_BLOCK)
    partial = fixed_bmm(weights, v).view(g, blocks, lq, dv + 1)
    acc = partial[:, 0]
    for j in range(1, blocks):  # blocks in order, one add each: a block past the query adds exact zeros
        acc = acc + partial[:, j]
    out = acc[..., :dv] / acc[..., dv:]
    out = torch.nan_to_num(out, nan=0.0)  # a query with no key at all (padding) gives 0/0
    return out.view(b, h, lq, dv).transpose(1, 2).to(query.dtype).contiguous(), None
