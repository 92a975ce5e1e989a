"""Per-layer decode ops as ``torch.library`` custom ops: add+RMSNorm, RMSNorm, rotary on q and k, SiLU·mul.

Why custom ops: transformers writes an RMSNorm as 8 kernels, rotary on q and k as 10 and the gated MLP's
activation as 2; a fused kernel does each in one. Behind one op each is one node in a captured graph and one
kernel in ``hybrid-engine bench kernels``, and the implementation is chosen per device by a capability probe,
never by device name (:func:`implementation`).

Every op has a reference implementation that computes exactly what transformers' modules compute for the
llama / mistral / qwen2 / qwen3 families (same ops, same dtypes, same order), so the fused decode forward on the
reference path gives transformers' bits. A fused kernel agrees with the reference within rounding. Decode steps
only: training forwards keep transformers' modules (these ops have no backward).

Implementations, one per device for all four ops (:func:`implementation`), the first that runs every op on that
device and agrees with the reference on a probe input: torch_npu's fused kernels
(:mod:`~hybrid_engine.decode.ops.layer_npu`) where torch_npu provides them; the Triton kernels
(:mod:`~hybrid_engine.decode.ops.layer_kernels`) where Triton is installed (under ``TRITON_INTERPRET=1`` that
includes the CPU: how CPU CI tests them); else the reference. The probe runs once per device, outside capture
(call :func:`implementation` before capturing: it reads the device); a graph captured with one implementation
replays it. Each op checks its arguments' shapes (never their values: no host read) and names the argument it
refuses; its outputs are contiguous on every implementation (what its fake kernel says).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from hybrid_engine.decode.ops.define import define_op
from hybrid_engine.decode.ops.probe import failure, first_serving, probe_device, refuse_while_capturing

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


# ------------------------------------------------------------------ checks
def _floating(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _floating(op, "x", x)
    _floating(op, "weight", weight)
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"{op}: weight must be [hidden] with x's last dim (x {tuple(x.shape)}), "
                         f"got {tuple(weight.shape)}")
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps}")


def _check_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _floating("rotary_qk", "q", q)
    if q.dim() != 4:
        raise ValueError(f"rotary_qk: q must be [B, heads, T, head_dim], got {tuple(q.shape)}")
    b, _, t, d = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"rotary_qk: k must be [B, kv_heads, T, head_dim] with q's B, T and head_dim (q "
                         f"{tuple(q.shape)}), got {tuple(k.shape)}")
    if d % 2:
        raise ValueError(f"rotary_qk: head_dim must be even (rotate_half splits it in two halves), got {d}")
    if cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1:] != (t, d):
        raise ValueError(f"rotary_qk: cos must be [B, T, head_dim] (or [1, T, head_dim]) for q {tuple(q.shape)}, "
                         f"got {tuple(cos.shape)}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(f"rotary_qk: sin must have cos's shape and dtype {tuple(cos.shape)} {cos.dtype}, got "
                         f"{tuple(sin.shape)} {sin.dtype}")


def _check_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> None:
    _floating("silu_mul", "gate", gate)
    if up.shape != gate.shape:
        raise ValueError(f"silu_mul: up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")


# ------------------------------------------------------------------ choice
class _Impl(NamedTuple):
    """One implementation of the four ops, each with its op's signature and results."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]


_REFERENCE = _Impl(reference_rms_norm, reference_add_rms_norm, reference_rotary_qk, reference_silu_mul)


@functools.lru_cache(maxsize=1)
def _triton_impl() -> _Impl | None:
    """The Triton kernels (:mod:`.layer_kernels`, imported on first use so ``TRITON_INTERPRET`` is read then);
    ``None`` without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from hybrid_engine.decode.ops import layer_kernels as k

    return _Impl(k.triton_rms_norm, k.triton_add_rms_norm, k.triton_rotary_qk, k.triton_silu_mul)


@functools.lru_cache(maxsize=1)
def _npu_impl() -> _Impl | None:
    """torch_npu's fused kernels (:mod:`.layer_npu`); ``None`` without torch_npu or one of its kernels."""
    from hybrid_engine.decode.ops.layer_npu import npu_functions

    functions = npu_functions(_REFERENCE._asdict())
    return None if functions is None else _Impl(**functions)


#: Candidate implementations in order of preference (a vendor's kept kernels first); the first whose probe passes
#: on a device runs there.
_CANDIDATES: dict[str, Callable[[], _Impl | None]] = {"npu": _npu_impl, "triton": _triton_impl}


def _probe_cases(device: torch.device) -> list[tuple[str, tuple]]:
    """Small fp32 inputs for each op (a seeded generator on the host, then moved); rotary at a real head_dim with
    cos/sin in [-1, 1] (what torch_npu's kernel documents)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    x, res, w = rand(3, 40), rand(3, 40), rand(40)
    q, k = rand(2, 3, 4, 128).transpose(1, 2), rand(2, 2, 3, 128)  # q as transformers has it: a transposed view
    angles = rand(2, 3, 128)
    cos, sin = angles.cos(), angles.sin()
    return [("rms_norm", (x, w, 1e-6)), ("add_rms_norm", (x, res, w, 1e-6)), ("rotary_qk", (q, k, cos, sin)),
            ("silu_mul", (x, res))]


def _disagreement(impl: _Impl, device: torch.device) -> str | None:
    """Why ``impl`` does not serve ``device`` (``None``: every op runs there and agrees with the reference on the
    probe inputs)."""
    try:
        for name, args in _probe_cases(device):
            got, want = getattr(impl, name)(*args), getattr(_REFERENCE, name)(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            if not all(a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
                       for a, b in zip(got, want, strict=True)):
                return f"{name} differs from the reference"
        return None
    except Exception as exc:  # noqa: BLE001 -- any failure to compile or run means: not on this device
        return failure(exc)


@functools.lru_cache(maxsize=16)
def _probe(device: torch.device) -> str:
    refuse_while_capturing("layer_ops", device)
    return first_serving("layer_ops", device, _CANDIDATES, lambda name, impl: _disagreement(impl, device))


def implementation(device: torch.device | str) -> str:
    """The implementation the layer ops run on ``device``: the first candidate (``"npu"``: torch_npu's kernels,
    then ``"triton"``) whose kernels all run there and agree with the reference on a small input (probed once per
    device, outside capture), else ``"reference"``."""
    return _probe(probe_device(device))


def _impl(device: torch.device) -> _Impl:
    name = implementation(device)
    return _REFERENCE if name == "reference" else _CANDIDATES[name]()


def _dense(out):
    """Outputs contiguous whatever the implementation (the reference's follow its inputs' strides), as the fake
    kernels say; a no-op at decode, where transformers' ``[B, H, 1, D]`` views are contiguous already."""
    return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()


# ------------------------------------------------------------------ ops
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (see :func:`reference_rms_norm`)."""
    _check_norm("rms_norm", x, weight, eps)
    return _dense(_impl(x.device).rms_norm(x, weight, eps))


def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


rms_norm = define_op(_rms_norm, _rms_norm_fake)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, hidden)`` with ``hidden = residual + x`` (see :func:`reference_add_rms_norm`)."""
    _check_norm("add_rms_norm", x, weight, eps)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    return _dense(_impl(x.device).add_rms_norm(x, residual, weight, eps))


def _add_rms_norm_fake(x, residual, weight, eps):
    hidden = torch.promote_types(residual.dtype, x.dtype)
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, hidden)), x.new_empty(x.shape, dtype=hidden)


add_rms_norm = define_op(_add_rms_norm, _add_rms_norm_fake)


def _rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q and k in one op (see :func:`reference_rotary_qk`)."""
    _check_rotary(q, k, cos, sin)
    return _dense(_impl(q.device).rotary_qk(q, k, cos, sin))


def _rotary_qk_fake(q, k, cos, sin):
    return (q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype)),
            k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype)))


rotary_qk = define_op(_rotary_qk, _rotary_qk_fake)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (see :func:`reference_silu_mul`)."""
    _check_silu_mul(gate, up)
    return _dense(_impl(gate.device).silu_mul(gate, up))


def _silu_mul_fake(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


silu_mul = define_op(_silu_mul, _silu_mul_fake)
