"""Triton kernels for the per-layer decode ops of :mod:`~hybrid_engine.decode.ops.layer_ops`, one launch per op.

Why our own kernels rather than a library's (liger-kernel has RMSNorm, rotary and SwiGLU in Triton): each kernel
here keeps the reference's rounding steps, so in bf16 it rounds where transformers' modules round, and the
package takes no training-oriented dependency for four small forward-only kernels.

What each kernel keeps of the reference (fp32 arithmetic, rounded to nearest even in the tensor dtype where the
reference rounds; the bf16 rounding is done on the bits (:func:`_rne`) because Triton's interpreter truncates a
bf16 cast, so CPU CI checks the rounding a device does). All launch without floating-point contraction
(:data:`LAUNCH_OPTIONS`): a product and a sum stay two IEEE operations, as in the reference.

* RMSNorm: ``residual + x`` rounded to the hidden dtype (stored as the new residual: bit for bit), variance and
  normalisation in fp32 (IEEE square root and divisions, as the reference on the CPU), the normalised row rounded
  to the hidden dtype, then the product with the weight rounded to the output dtype. Only the variance's summation
  order differs from the reference: agreement within rounding, not bit for bit.
* Rotary: ``q * cos`` and ``rotate_half(q) * sin`` each rounded to the output dtype, then their sum: the
  reference's arithmetic, bit for bit.
* SiLU·mul: ``silu(gate) = gate / (1 + exp(-gate))`` in fp32 (IEEE division) rounded to gate's dtype, then the
  product with ``up``; ``exp`` is Triton's, so within rounding.

Shapes: any leading dims (flattened to rows; a view where the strides allow, else a contiguous copy); rotary reads
q and k through their strides, so transformers' transposed ``[B, H, T, D]`` views need no copy. Outputs are
contiguous. This module imports Triton (which reads ``TRITON_INTERPRET`` then): :mod:`layer_ops` imports it on
first use, and only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["LAUNCH_OPTIONS", "triton_add_rms_norm", "triton_rms_norm", "triton_rotary_qk", "triton_silu_mul"]

_MAX_BLOCK = 8192  # elements a norm program holds per pass (longer rows loop)
_ELEMENTWISE_BLOCK = 1024
#: Compile options of every launch: no floating-point contraction (a product and a sum stay two roundings).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rne(x, ty: tl.constexpr):
    """``x`` (fp32) rounded to nearest even in ``ty``: bf16 by its bits (Triton's interpreter truncates a bf16
    cast; a device rounds, and this is the same rounding on both), other dtypes by the cast."""
    if ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    return x.to(ty)


@triton.jit
def _hidden(x_ptr, res_ptr, offs, mask, h_ty: tl.constexpr, HAS_RES: tl.constexpr):
    """A row chunk of the norm's input: ``x``, or ``residual + x`` rounded to the hidden dtype."""
    h = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        h = _rne(r.to(tl.float32) + h.to(tl.float32), h_ty)
    return h


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, hidden_ptr, n, x_stride, res_stride, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h_ty = hidden_ptr.dtype.element_ty  # without a residual: x itself (never written)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < n
        h = _hidden(x_ptr + row * x_stride, res_ptr + row * res_stride, cols, m, h_ty, HAS_RES).to(tl.float32)
        acc += h * h
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(acc, 0), n * 1.0) + eps))
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < n
        h = _hidden(x_ptr + row * x_stride, res_ptr + row * res_stride, cols, m, h_ty, HAS_RES)
        if HAS_RES:
            tl.store(hidden_ptr + row * n + cols, h, mask=m)
        normed = _rne(h.to(tl.float32) * inv, h_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, _rne(w * normed, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotate(src, dst, c, s, d, mask, HALF: tl.constexpr):
    """One head's ``x * cos + rotate_half(x) * sin``, each product rounded to the output dtype."""
    ty = dst.dtype.element_ty
    x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    first = d < HALF
    partner = tl.load(src + tl.where(first, d + HALF, d - HALF), mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(first, -partner, partner)
    out = _rne(x * c, ty).to(tl.float32) + _rne(rot * s, ty).to(tl.float32)
    tl.store(dst + d, _rne(out, ty), mask=mask)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, heads, seq,
                      qs_b, qs_h, qs_t, ks_b, ks_h, ks_t, cs_b, cs_t, qo_b, qo_h, qo_t, ko_b, ko_h, ko_t,
                      DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * seq + t
    head = tl.program_id(1)  # q heads first, then k heads
    b = row // seq
    t = row % seq
    d = tl.arange(0, DIM_PAD)
    m = d < DIM
    c = tl.load(cos_ptr + b * cs_b + t * cs_t + d, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * cs_b + t * cs_t + d, mask=m, other=0.0).to(tl.float32)
    if head < heads:
        _rotate(q_ptr + b * qs_b + head * qs_h + t * qs_t, qo_ptr + b * qo_b + head * qo_h + t * qo_t,
                c, s, d, m, DIM // 2)
    else:
        kh = head - heads
        _rotate(k_ptr + b * ks_b + kh * ks_h + t * ks_t, ko_ptr + b * ko_b + kh * ko_h + t * ko_t,
                c, s, d, m, DIM // 2)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, g_stride, u_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(g_ptr + row * g_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=m, other=0.0).to(tl.float32)
    act = _rne(tl.math.div_rn(g, 1.0 + tl.exp(-g)), g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, _rne(act * u, out_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------ launchers
def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, last dim]`` with unit stride along the row: a view where the strides allow, else a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _norm_warps(block: int) -> int:
    """Warps for a norm program holding ``block`` elements (about 64 fp32 values a thread at most)."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden_dtype = x.dtype if residual is None else torch.promote_types(residual.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, hidden_dtype), device=x.device)
    hidden = None if residual is None else torch.empty(x.shape, dtype=hidden_dtype, device=x.device)
    xr = _rows(x)
    rr = xr if residual is None else _rows(residual)
    n = xr.shape[-1]
    block = min(_pow2(n), _MAX_BLOCK)
    if out.numel():
        _rms_norm_kernel[(xr.shape[0],)](
            xr, rr, weight.contiguous(), out, xr if hidden is None else hidden, n, xr.stride(0), rr.stride(0),
            float(eps), HAS_RES=residual is not None, BLOCK=block, num_warps=_norm_warps(block),
            **LAUNCH_OPTIONS)
    return out, hidden


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused RMSNorm (see :func:`~hybrid_engine.decode.ops.layer_ops.reference_rms_norm`)."""
    return _norm(x, None, weight, eps)[0]


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused residual add and RMSNorm: ``(normed, residual + x)`` in one launch."""
    out, hidden = _norm(x, residual, weight, eps)
    return out, hidden


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def triton_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q and k in one launch: one program per (row, token, head), q heads then k heads."""
    b, heads, seq, dim = q.shape
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = (_unit_last(t.expand(b, seq, dim)) for t in (cos, sin))
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    ko = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype), device=k.device)
    if b * seq:
        _rotary_qk_kernel[(b * seq, heads + k.shape[1])](
            q, k, cos, sin, qo, ko, heads, seq, *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2],
            *qo.stride()[:3], *ko.stride()[:3], DIM=dim, DIM_PAD=_pow2(dim), num_warps=1, **LAUNCH_OPTIONS)
    return qo, ko


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one launch."""
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    g, u = _rows(gate), _rows(up)
    n = g.shape[-1]
    if out.numel():
        block = min(_pow2(n), _ELEMENTWISE_BLOCK)
        _silu_mul_kernel[(g.shape[0], -(-n // block))](
            g, u, out, n, g.stride(0), u.stride(0), BLOCK=block, **LAUNCH_OPTIONS)
    return out
