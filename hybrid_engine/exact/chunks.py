"""Fixed-shape chunked products, and how many rows a chunk takes: the smallest size at which this machine's
``bmm`` is row-invariant.

Why a probe: BLAS libraries pick kernels by shape and CPU (MKL on this
project's AMD machines gives other bits for a 1- or 2-row product with an odd
column count once the batch grows, and is invariant from 4 rows on). A chunk
that looked invariant here could differ on another CPU, so the first use
measures it: for every candidate size, the same row alone and inside batches
of other sizes and offsets must come out bit-identical, for the shapes the
exact kernels multiply. The answer is cached per process and dtype; the
probe runs outside any capture (:func:`~hybrid_engine.exact.mode.exact_kernels`
asks before its block starts).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["KEY_BLOCK", "MIN_HEAD_DIM", "ChunkRows", "NoInvariantChunk", "chunk_rows", "fixed_bmm", "head_dims",
           "heads_invariant"]

#: Candidate rows per product chunk, smallest first (smaller wastes less on a decode step's few rows).
LINEAR_CHOICES = (16, 32, 64)
ATTENTION_CHOICES = (4, 8, 16)
#: Keys per attention block (blocks are counted from key 0 and summed in order).
KEY_BLOCK = 64
#: The smallest head size attention multiplies at: smaller heads are padded with zero columns to it. MKL gives
#: a [rows, 64] x [64, N] product other bits in batches of other sizes for N of 6, 7 and 9 to 11 (heads of 5 to
#: 10 with the weights' sum column), where a head of 8 made the rollout's logprobs 4.8e-7 off the training's.
MIN_HEAD_DIM = 16
#: (K, N) of the probed products: linears, then attention's scores ([D] x [KEY_BLOCK]) and weighted sums
#: ([KEY_BLOCK] x [D + 1]) for head sizes 16 to 128 (a model's other head sizes: :func:`heads_invariant`).
_LINEAR_SHAPES = ((64, 192), (64, 384), (256, 1024), (96, 250))
_ATTENTION_HEADS = (MIN_HEAD_DIM, 32, 64, 128)


class ChunkRows(NamedTuple):
    linear: int
    attention: int


class NoInvariantChunk(ValueError):
    """No candidate chunk size gives row-invariant products on this machine: the exact mode cannot run."""


def fixed_bmm(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    """``a [G, M, K] @ b [G, K, N]`` (``b`` may be ``[K, N]``, shared), as chunks of ``rows`` rows.

    Each chunk of ``a`` is multiplied in one ``bmm`` of fixed shape, so row ``i``
    of the result depends only on row ``i`` of ``a`` and on ``b``."""
    g, m, k = a.shape
    n = b.shape[-1]
    pad = (-m) % rows
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
    chunks = (m + pad) // rows
    if b.dim() == 2:  # one weight for every chunk: a stride-0 batch of it, no copy
        out = torch.bmm(a.reshape(g * chunks, rows, k), b.expand(g * chunks, k, n)).view(g, chunks * rows, n)
    elif chunks == 1:
        out = torch.bmm(a, b)
    else:  # each chunk against the same b (a batch of b per chunk would copy it that many times)
        out = torch.cat([torch.bmm(part, b) for part in a.split(rows, dim=1)], dim=1)
    return out[:, :m] if pad else out


def head_dims(key_dim: int, value_dim: int) -> tuple[int, int]:
    """The (key, value) head sizes attention multiplies at for heads of ``key_dim``/``value_dim``: at least
    :data:`MIN_HEAD_DIM` (zero columns added; they change no score, and the values' extra columns are dropped)."""
    return max(key_dim, MIN_HEAD_DIM), max(value_dim, MIN_HEAD_DIM)


def _attention_shapes(key_dim: int, value_dim: int) -> tuple[tuple[int, int], ...]:
    """(K, N) of the scores and the weighted sums (values and their sum column) for heads of these sizes."""
    k, v = head_dims(key_dim, value_dim)
    return ((k, KEY_BLOCK), (KEY_BLOCK, v + 1))


_ATTENTION_SHAPES = tuple(shape for d in _ATTENTION_HEADS for shape in _attention_shapes(d, d))


def _invariant(rows: int, shapes: tuple[tuple[int, int], ...], dtype: torch.dtype, shared: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    for k, n in shapes:
        a = torch.randn(1, 1, k, generator=gen).to(dtype)
        b = torch.randn(1, k, n, generator=gen).to(dtype)
        want = fixed_bmm(a, b[0] if shared else b, rows)[0, 0]
        for batch in ((1,) if shared else (1, 3, 8, 64, 200)):
            for m in (1, rows - 1, rows, 3 * rows + 1):
                if m < 1:
                    continue
                at = (batch // 2, m // 2)
                x = torch.randn(batch, m, k, generator=gen).to(dtype)
                x[at] = a[0, 0]
                y = torch.randn(batch, k, n, generator=gen).to(dtype)
                y[at[0]] = b[0]
                got = fixed_bmm(x, b[0] if shared else y, rows)[at]
                if not torch.equal(got, want):
                    return False
    return True


@functools.cache
def chunk_rows(dtype: torch.dtype = torch.float32) -> ChunkRows:
    """The chunk sizes for linears in ``dtype`` and for attention (float32): the smallest invariant ones."""
    with torch.no_grad():
        linear = next((r for r in LINEAR_CHOICES if _invariant(r, _LINEAR_SHAPES, dtype, shared=True)), None)
        attention = next((r for r in ATTENTION_CHOICES
                          if _invariant(r, _ATTENTION_SHAPES, torch.float32, shared=False)), None)
    if linear is None or attention is None:
        what = "linear" if linear is None else "attention"
        raise NoInvariantChunk(
            f"exact_logprobs: this machine's matmul kernels give other bits for the same row in batches of other "
            f"sizes at every {what} chunk size tried ({LINEAR_CHOICES if linear is None else ATTENTION_CHOICES} "
            f"rows, {dtype}), so rollout logprobs cannot be made exact here; turn exact_logprobs off")
    return ChunkRows(linear, attention)


@functools.cache
def heads_invariant(key_dim: int, value_dim: int) -> bool:
    """Whether attention's products for heads of ``key_dim``/``value_dim`` are row-invariant at the probed
    attention chunk (the probe covers heads of 16 to 128; a model's own sizes are asked before it runs)."""
    with torch.no_grad():
        return _invariant(chunk_rows().attention, _attention_shapes(key_dim, value_dim), torch.float32, shared=False)
