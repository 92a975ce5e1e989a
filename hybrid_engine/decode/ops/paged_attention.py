"""``hybrid_engine::paged_decode_attention``: one decode query per row attending over the row's pages in place.

Why one custom op: today's step gathers every row's whole span out of the page pool into new contiguous K/V
tensors and masks it (3x the K/V bytes of reading each live token once). Behind one op the step is one node in a
captured graph and one kernel in ``hybrid-engine bench kernels``, and an accelerator runs a kernel that reads
each row's pages where they lie, up to the row's own length.

Implementations, chosen per device by a capability probe (:func:`implementation`), the first candidate whose kernel
runs on that device and agrees with the reference on a probe input, never by device name: torch_npu's paged
incremental attention (``"npu"``, :mod:`~hybrid_engine.decode.ops.paged_npu`: views of the pool, lengths as a
device mask, so capture-safe) where torch_npu provides it; the Triton kernel (``"triton"``,
:func:`_triton_attention`, over :class:`~hybrid_engine.decode.kv_pool.KVPool`'s token-major layout ``[pages *
page_size, kv_heads, head_dim]``) where Triton is installed (under ``TRITON_INTERPRET=1`` that includes the CPU:
how CPU CI tests the kernel); else the reference (:func:`reference_attention`: gather + SDPA with a length mask,
what the step does today). The probe runs outside capture, once per device; a graph captured with one
implementation replays it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from hybrid_engine.decode.ops.define import define_op
from hybrid_engine.decode.ops.probe import failure, first_serving, probe_device, refuse_while_capturing

__all__ = ["PAGED_ATTENTION", "PagedRead", "implementation", "paged_attention_forward", "paged_decode_attention",
           "reference_attention"]


def _check(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: torch.Tensor,
           lengths: torch.Tensor, page_size: int) -> None:
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"paged_decode_attention: query must be [B, heads, 1, head_dim], got {tuple(query.shape)}")
    if key_pool.dim() != 3 or key_pool.shape != value_pool.shape or key_pool.shape[-1] != query.shape[-1]:
        raise ValueError("paged_decode_attention: key_pool and value_pool must be [slots, kv_heads, head_dim] "
                         f"with the query's head_dim, got {tuple(key_pool.shape)} and {tuple(value_pool.shape)}")
    if query.shape[1] % key_pool.shape[1]:
        raise ValueError(f"paged_decode_attention: {query.shape[1]} query heads are not a multiple of "
                         f"{key_pool.shape[1]} kv heads")
    if block_table.dim() != 2 or block_table.shape[0] != query.shape[0] or lengths.shape != (query.shape[0],):
        raise ValueError("paged_decode_attention: block_table must be [B, pages] and lengths [B]")
    if page_size < 1 or key_pool.shape[0] % page_size:
        raise ValueError(f"paged_decode_attention: page_size {page_size} does not divide the pool's slots")


def reference_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                        block_table: torch.Tensor, lengths: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
    """``[B, Hq, 1, D]``: row ``b`` attends over the first ``lengths[b]`` tokens of its pages ``block_table[b]``
    (gathered, then SDPA with an additive mask in the query's dtype; GQA by head groups)."""
    b, _, _, d = query.shape
    span = block_table.shape[1] * page_size
    offsets = torch.arange(page_size, device=query.device)
    slots = (block_table[:, :, None] * page_size + offsets).flatten()
    k = key_pool.index_select(0, slots).view(b, span, -1, d).transpose(1, 2)
    v = value_pool.index_select(0, slots).view(b, span, -1, d).transpose(1, 2)
    seen = torch.arange(span, device=query.device)[None, :] < lengths[:, None]
    mask = torch.where(seen, 0.0, torch.finfo(query.dtype).min).to(query.dtype)[:, None, None, :]
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=query.shape[1] != k.shape[1])


def _paged_decode_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                            block_table: torch.Tensor, lengths: torch.Tensor, scale: float,
                            page_size: int) -> torch.Tensor:
    """One decode query per row over its pages in place (see the module docstring); ``lengths [B]`` int64: the
    tokens each row sees (0 gives zeros on the kernel path, the mean of the span's values on the reference)."""
    _check(query, key_pool, value_pool, block_table, lengths, page_size)  # shapes only: no host read
    name = implementation(query.device)
    run = reference_attention if name == "reference" else _CANDIDATES[name]()
    return run(query, key_pool, value_pool, block_table, lengths, scale, page_size)


def _paged_decode_attention_fake(query, key_pool, value_pool, block_table, lengths, scale, page_size):
    return torch.empty_like(query)


paged_decode_attention = define_op(_paged_decode_attention, _paged_decode_attention_fake)


# ------------------------------------------------------------------ choice
@functools.lru_cache(maxsize=1)
def _npu_attention():
    """torch_npu's paged kernel (:mod:`.paged_npu`); ``None`` without torch_npu or the kernel."""
    from hybrid_engine.decode.ops.paged_npu import npu_attention

    return npu_attention(reference_attention)


def _triton_candidate():
    return _triton_attention if _kernel() is not None else None


#: Candidates in order of preference (a vendor's kept kernel first), each with its probe's dtype, page size and
#: tolerance: torch_npu's kernel takes fp16/bf16 and pages aligned to 16 only.
_CANDIDATES = {"npu": _npu_attention, "triton": _triton_candidate}
_PROBES = {"npu": (torch.float16, 16, 1e-2), "triton": (torch.float32, 4, 1e-4)}


def _disagreement(run, device: torch.device, dtype: torch.dtype, page: int, tol: float) -> str | None:
    """Why ``run`` does not serve ``device`` (``None``: it runs there and agrees with the reference on a small
    input: two rows over scattered pages, one ending mid-page, GQA)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=g).to(device, dtype)
    kp, vp = (torch.randn(5 * page, 2, 16, generator=g).to(device, dtype) for _ in range(2))
    table = torch.tensor([[1, 3], [4, 2]], device=device)
    lengths = torch.tensor([page + 3, page + 1], device=device)
    try:
        got = run(q, kp, vp, table, lengths, 0.25, page)
        want = reference_attention(q, kp, vp, table, lengths, 0.25, page)
        if got.shape == want.shape and got.dtype == want.dtype and torch.allclose(got.float(), want.float(),
                                                                                   atol=tol, rtol=tol):
            return None
        return "its output differs from the reference's"
    except Exception as exc:  # noqa: BLE001 -- any failure to compile or run means: not on this device
        return failure(exc)


@functools.lru_cache(maxsize=16)
def _probe(device: torch.device) -> str:
    """The first candidate whose kernel runs on ``device`` and agrees with the reference, else ``"reference"``."""
    refuse_while_capturing("paged_attention", device)
    return first_serving("paged_attention", device, _CANDIDATES,
                         lambda name, run: _disagreement(run, device, *_PROBES[name]))


def implementation(device: torch.device | str) -> str:
    """The implementation :func:`paged_decode_attention` runs on ``device``: ``"npu"``, ``"triton"`` or
    ``"reference"``."""
    return _probe(probe_device(device))


# ------------------------------------------------------------------ kernel
@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted Triton kernel (built on first use, so ``TRITON_INTERPRET`` is read then); ``None`` without
    Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, scale, pages_per_row, kv_heads,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
               PAGE: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        t = tl.arange(0, PAGE)
        qmask = (g[:, None] < GROUP) & (d[None, :] < DIM)
        heads = kvh * GROUP + g  # query heads of this kv head
        q_off = (row * kv_heads * GROUP + heads)[:, None] * DIM + d[None, :]
        q = tl.load(q_ptr + q_off, mask=qmask, other=0.0).to(tl.float32)
        length = tl.load(len_ptr + row)
        best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
        for i in range(0, tl.cdiv(length, PAGE)):
            page = tl.load(table_ptr + row * pages_per_row + i)
            token = i * PAGE + t
            seen = token < length
            kv_off = ((page * PAGE + t) * kv_heads + kvh)[:, None] * DIM + d[None, :]
            kvmask = seen[:, None] & (d[None, :] < DIM)
            k = tl.load(k_ptr + kv_off, mask=kvmask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=kvmask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, PAGE]
            s = tl.where(seen[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)
            p = tl.exp(s - safe[:, None])
            shrink = tl.exp(best - safe)
            total = total * shrink + tl.sum(p, axis=1)
            acc = acc * shrink[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            best = new_best
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=qmask)

    return kernel


def _triton_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                      block_table: torch.Tensor, lengths: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
    """The Triton kernel: one program per (row, kv head), its query heads together, an online softmax over the
    row's pages up to its length (fp32 accumulation)."""
    kernel = _kernel()
    b, hq, _, d = query.shape
    kv_heads = key_pool.shape[1]
    group = hq // kv_heads
    if page_size & (page_size - 1):
        raise ValueError(f"paged_decode_attention: the Triton kernel needs a power-of-two page size, got {page_size}")
    q = query.contiguous()
    out = torch.empty_like(q)
    table = block_table.contiguous()
    kernel[(b, kv_heads)](q, key_pool.contiguous(), value_pool.contiguous(), table, lengths.contiguous(), out,
                          float(scale), table.shape[1], kv_heads, GROUP=group,
                          GROUP_PAD=max(1, 1 << math.ceil(math.log2(group))), DIM=d,
                          DIM_PAD=1 << math.ceil(math.log2(d)), PAGE=page_size)
    return out


# ------------------------------------------------- transformers attention
#: The attention implementation a decode step switches a model to where it reads pages in place.
PAGED_ATTENTION = "hybrid_paged"
#: Model families whose attention modules pass the forward's keyword arguments on to the attention function
#: (how a step hands it :class:`PagedRead`).
PAGED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class PagedRead(NamedTuple):
    """What a decode step's attention reads instead of gathered K/V: each row's pages and length."""

    block_table: torch.Tensor  # [B, span pages]
    lengths: torch.Tensor  # [B] int64: tokens each row sees, the one being written included
    page_size: int


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            paged_kv: PagedRead | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``"hybrid_paged"``: with ``paged_kv`` (a decode step; ``key``/``value`` are then the pool's
    ``[slots, kv_heads, head_dim]`` tensors, which the cache's ``update`` returned without gathering) the
    :func:`paged_decode_attention` op; any other forward (a thread that runs one while a step has the config
    switched) is transformers' ``sdpa``."""
    if paged_kv is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_decode_attention(query, key, value, paged_kv.block_table, paged_kv.lengths, float(scale),
                                 paged_kv.page_size)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"hybrid_paged"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)


register()
