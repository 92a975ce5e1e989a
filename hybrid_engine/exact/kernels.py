"""Batch-invariant kernels: a row's result never depends on how many rows, keys or padding share the call.

Why: a BLAS matmul picks its blocking (and so its summation order) from the
shapes of the call, so the same row multiplied alone, beside 7 others, or as
row 300 of a training batch comes out different in the last bits; attention
that reduces over "all keys of this call" does the same with the key count.
Here every contraction is a ``bmm`` of one fixed shape per operand shape:

* :func:`~hybrid_engine.exact.chunks.fixed_bmm` cuts the rows of ``a`` into
  chunks of a fixed size (probed: :func:`~hybrid_engine.exact.chunks.chunk_rows`)
  and multiplies each chunk by the same kernel at the same shape, whatever
  else is in the call;
* :func:`exact_linear` is ``F.linear`` (and GPT-2's ``addmm``) through it;
* :func:`block_attention` is softmax attention over fixed blocks of
  :data:`KEY_BLOCK` keys, counted from key 0: the max over the keys a query
  sees (exact in any order), one weighted sum per block, and the blocks
  added in order. A block in which every key is masked adds exact zeros, so
  a decode step that sees keys past its query, masked, and a training
  forward that sees the rest of the sequence, masked, sum the same blocks in
  the same order. Keys must be laid out by position from column 0 (the
  decode cache is; :mod:`hybrid_engine.exact.rows` packs training rows so).

Only the forwards are invariant: the backwards use the usual formulas
(gradients need no invariance). Nothing here reads the device on the host or
depends on data for a shape, so each forward captures into a graph; the chunk
counts are host ints of the shapes, frozen like every shape.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from hybrid_engine.exact.chunks import KEY_BLOCK, chunk_rows, fixed_bmm, head_dims

__all__ = ["KEY_BLOCK", "attention_calls", "block_attention", "exact_addmm", "exact_linear", "recorded_heads"]


_calls = 0
#: The (key, value) head sizes :func:`block_attention` saw, while :func:`recorded_heads` records them.
_heads: contextvars.ContextVar[set[tuple[int, int]] | None] = contextvars.ContextVar("exact_heads", default=None)


def attention_calls() -> int:
    """How many times :func:`block_attention` has run (host counter: a model whose attention bypasses
    transformers' attention interface never reaches it, and the exact mode refuses it)."""
    return _calls


class _Linear(torch.autograd.Function):
    """``x @ w`` with the row-invariant forward; the backward is the usual matmuls (gradients need no
    invariance, and a batch of per-chunk weight gradients would cost a copy of the weight per chunk)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x [M, K], w [K, N]
        ctx.save_for_backward(x, w)
        rows = chunk_rows(x.dtype).linear
        m, k = x.shape
        if m % rows:
            return fixed_bmm(x.unsqueeze(0), w, rows)[0]
        return torch.bmm(x.view(m // rows, rows, k), w.expand(m // rows, k, w.shape[1])).view(m, w.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = ctx.saved_tensors
        return (grad @ w.t() if ctx.needs_input_grad[0] else None,
                x.t() @ grad if ctx.needs_input_grad[1] else None)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row depends only on its input row (see :func:`fixed_bmm`)."""
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def exact_addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, beta: Any = 1,
                alpha: Any = 1) -> torch.Tensor:
    """``torch.addmm(bias, x [M, K], weight [K, N])`` (GPT-2's ``Conv1D``), row-invariant."""
    out = _Linear.apply(x, weight)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta)


@contextlib.contextmanager
def recorded_heads() -> Iterator[set[tuple[int, int]]]:
    """The (key, value) head sizes :func:`block_attention` runs at inside the block (a model's probe forward),
    for :func:`~hybrid_engine.exact.chunks.heads_invariant`."""
    seen: set[tuple[int, int]] = set()
    token = _heads.set(seen)
    try:
        yield seen
    finally:
        _heads.reset(token)


def _allowed(attention_mask: torch.Tensor | None, lq: int, lk: int, device: torch.device) -> torch.Tensor:
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
    seen = _heads.get()
    if seen is not None:
        seen.add((query.shape[-1], value.shape[-1]))
    if dropout:
        raise ValueError(f"exact_logprobs: attention dropout ({dropout}) makes logprobs random; set the model's "
                         "attention dropout to 0 or turn exact_logprobs off")
    for unsupported in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"exact_logprobs: attention with `{unsupported}` is not supported; turn "
                             "exact_logprobs off for this model")
    allowed = _allowed(attention_mask, query.shape[2], key.shape[2], query.device)  # [B|1, H|1, lq, lk]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = _Attention.apply(query, key, value, allowed, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


class _Attention(torch.autograd.Function):
    """The fixed-block forward; the backward recomputes plain softmax attention and differentiates it
    (gradients need no invariance)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                scale: float, softcap: float | None) -> torch.Tensor:
        ctx.save_for_backward(query, key, value, allowed)
        ctx.scale, ctx.softcap = scale, softcap
        return _block_attention(query, key, value, allowed, scale, softcap)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, allowed = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((query, key, value), ctx.needs_input_grad)]
        with torch.enable_grad():
            out = _plain_attention(*inputs, allowed, ctx.scale, ctx.softcap)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None)


def _plain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                     scale: float, softcap: float | None) -> torch.Tensor:
    """Softmax attention as eager kernels compute it (the backward's reference): ``[B, H, lq, Dv]``."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (weights @ value.float()).to(query.dtype)


def _block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                     scale: float, softcap: float | None) -> torch.Tensor:
    """See :func:`block_attention`; ``[B, H, lq, Dv]``."""
    b, h, lq, d = query.shape
    hk, lk, dv = key.shape[1], key.shape[2], value.shape[-1]
    kd, vd = head_dims(d, dv)  # small heads padded with zero columns: the products run at probed shapes
    if allowed.shape[1] != 1 and h != hk:  # a mask per head: each head its own row group
        key, value = key.repeat_interleave(h // hk, dim=1), value.repeat_interleave(h // hk, dim=1)
        hk = h
    group = h // hk  # query heads per K/V head: their queries share that head's keys, as rows of one product
    rows = chunk_rows().attention
    blocks = -(-lk // KEY_BLOCK)
    pad = blocks * KEY_BLOCK - lk
    g = b * hk
    k, v = key.float(), value.float()
    if pad or kd > d:
        k = F.pad(k, (0, kd - d, 0, pad))
    if pad:
        allowed = F.pad(allowed, (0, pad), value=False)
    # Values get columns of ones up to vd + 1: the product of the first with the weights is the weights' sum, in
    # the same kernel.
    v = F.pad(v, (0, vd + 1 - dv, 0, pad), value=1.0)
    q = query.float() * scale
    if kd > d:
        q = F.pad(q, (0, kd - d))  # zero columns: every score is the same sum of the same products plus zeros
    q = q.reshape(g, 1, group * lq, kd).expand(g, blocks, group * lq, kd)
    scores = fixed_bmm(q.reshape(g * blocks, group * lq, kd), k.reshape(g * blocks, KEY_BLOCK, kd).transpose(1, 2),
                       rows).view(b, hk, blocks, group, lq, KEY_BLOCK)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # [B|1, hk|1, blocks, 1, lq, KEY_BLOCK], against the scores' [B, hk, blocks, group, lq, KEY_BLOCK]
    allowed = allowed.unflatten(-1, (blocks, KEY_BLOCK)).movedim(3, 2).unsqueeze(3)
    # masked_fill keeps the scores' contiguous layout, so exp below runs its vectorised kernel in decode and
    # training alike (a strided tensor would take the scalar one, whose last bits may differ).
    scores = scores.masked_fill(~allowed, float("-inf"))
    # The max over the keys a query sees is the same set of numbers in decode and in training (max is exact).
    top = scores.amax(dim=(2, 5), keepdim=True)
    weights = torch.exp(scores - torch.where(top == float("-inf"), torch.zeros_like(top), top))
    partial = fixed_bmm(weights.reshape(g * blocks, group * lq, KEY_BLOCK), v.reshape(g * blocks, KEY_BLOCK, vd + 1),
                        rows).view(g, blocks, group * lq, vd + 1)
    acc = partial[:, 0]
    for j in range(1, blocks):  # blocks in order, one add each: a block past the query adds exact zeros
        acc = acc + partial[:, j]
    out = acc[..., :dv] / acc[..., dv:dv + 1]
    out = torch.nan_to_num(out, nan=0.0)  # a query with no key at all (padding) gives 0/0
    return out.view(b, h, lq, dv).to(query.dtype)
