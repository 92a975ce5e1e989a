"""torch_npu's paged incremental attention behind :func:`~hybrid_engine.decode.ops.paged_attention.paged_decode_attention`
(Ascend NPU).

Why ``npu_incre_flash_attention`` (IFA) and not ``npu_fused_infer_attention_score`` (FIA): both take a block table,
but FIA's page attention wants pages of 128 to 512 tokens in multiples of 128, while IFA takes any page size
aligned to 16 for fp16/bf16, which is our default (16) and every power of two from there.

The mapping, views only (no K/V copy): the pool ``[pages * page_size, kv_heads, D]`` is token-major, so
``view(pages, page_size, kv_heads * D)`` is IFA's ``(blocknum, blocksize, H)`` cache layout; the query ``[B, Hq, 1,
D]`` is ``"BSH"`` as ``reshape(B, 1, Hq * D)`` (a view at one token per row); the output ``[B, 1, Hq * D]`` is viewed
back. The block table is cast to int32 (IFA's documented dtype): ``B * pages`` integers, not K/V.

What capture freezes, and why lengths go in as a mask: IFA's ``actual_seq_lengths`` is a host ``List[int]``, and in
page attention it is required. Passing each row's length there would read the device every layer of every step and
freeze the lengths into a captured graph. Instead every row gets the table's whole span (``pages * page_size``: a
shape, known on the host) and its own length as a device ``atten_mask [B, 1, 1, span]`` (True = masked out), built
from ``lengths`` on the device. So nothing here reads a device value on the host, eager and graph run the same
kernel with the same arguments, and one captured graph serves every step. The cost: the kernel reads each row's
whole span of pages (unused table entries name a scratch page, a valid block) rather than only its live tokens;
still in place, with no gather. A row of length 0 (an idle slot) attends its whole span: finite, never 0/0
(its output is discarded; the reference's value there depends on the dtype).

Where a call falls outside IFA's documented limits it takes the reference (same results, the gather): a dtype
other than fp16/bf16 (or mixed), a page size not a multiple of 16, a pool that is not contiguous, ``Hq / kv_heads >
64``, ``B > 65535``, ``Hq > 256``, ``D > 512``, a span over 262144 tokens, ``kv_heads * D > 65535``. These depend on
shapes and dtypes only, so eager and graph take the same path. Tested against a stub torch_npu
(tests/decode/test_npu_paged_attention.py); not verified on a real NPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_engine.decode.ops.layer_npu import _torch_npu

__all__ = ["KERNEL", "npu_attention", "within_limits"]

#: The torch_npu kernel the "npu" implementation calls.
KERNEL = "npu_incre_flash_attention"
_DTYPES = (torch.float16, torch.bfloat16)
_PAGE_ALIGN = 16  # IFA: block_size aligned to 16 for fp16/bf16 K/V
_MAX_GROUP, _MAX_B, _MAX_HEADS, _MAX_D, _MAX_S, _MAX_H = 64, 65535, 256, 512, 262144, 65535


def within_limits(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: torch.Tensor,
                  page_size: int) -> bool:
    """Whether IFA's documented limits admit this call (shapes and dtypes only: no device read)."""
    b, hq, _, d = query.shape
    kv_heads = key_pool.shape[1]
    return (query.dtype in _DTYPES and key_pool.dtype == value_pool.dtype == query.dtype
            and page_size % _PAGE_ALIGN == 0 and key_pool.is_contiguous() and value_pool.is_contiguous()
            and hq // kv_heads <= _MAX_GROUP and b <= _MAX_B and hq <= _MAX_HEADS and d <= _MAX_D
            and block_table.shape[1] * page_size <= _MAX_S and kv_heads * d <= _MAX_H)


def npu_attention(reference: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | None:
    """The op on torch_npu's IFA (falling back to ``reference`` outside its limits: :func:`within_limits`), or
    ``None`` where torch_npu is missing or lacks the kernel."""
    npu = _torch_npu()
    kernel = None if npu is None else getattr(npu, KERNEL, None)
    if not callable(kernel):
        return None

    def attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: torch.Tensor,
                  lengths: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
        if not within_limits(query, key_pool, value_pool, block_table, page_size):
            return reference(query, key_pool, value_pool, block_table, lengths, scale, page_size)
        b, hq, _, d = query.shape
        kv_heads = key_pool.shape[1]
        pages, span = key_pool.shape[0] // page_size, block_table.shape[1] * page_size
        unseen = torch.arange(span, device=query.device)[None, :] >= lengths[:, None]  # True = masked out
        unseen = unseen & ~unseen.all(dim=-1, keepdim=True)  # a row of length 0 attends its span: never 0/0
        out = kernel(query.reshape(b, 1, hq * d), key_pool.view(pages, page_size, kv_heads * d),
                     value_pool.view(pages, page_size, kv_heads * d), atten_mask=unseen[:, None, None, :],
                     actual_seq_lengths=[span] * b, block_table=block_table.to(torch.int32), num_heads=hq,
                     scale_value=float(scale), input_layout="BSH", num_key_value_heads=kv_heads,
                     block_size=page_size)
        return out.view(b, hq, 1, d)

    return attention
