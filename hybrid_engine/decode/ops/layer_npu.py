"""torch_npu's fused kernels behind the layer ops of :mod:`~hybrid_engine.decode.ops.layer_ops` (Ascend NPU).

Why torch_npu's and not ours: Ascend ships kept, graph-capturable fused kernels for exactly these ops
(``npu_rms_norm``, ``npu_add_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``), and Triton on Ascend is a separate
toolchain. :func:`npu_functions` hands them to the layer ops' capability probe, which runs them on the tensor's
device and keeps them only where they agree with the reference: no device-name check anywhere.

Where a call falls outside what a kernel documents, that call takes the reference (same results, more kernels):
mixed dtypes (the kernels take one dtype; the reference promotes), and rotary beyond ``npu_rotary_mul``'s limits
(``B, N < 1000``, ``D < 896``). Launches per op: one each, except rotary (q and k: two) and SiLU·mul (``npu_swiglu``
takes gate and up as one tensor: a concatenation, then the kernel). Numerics: a fused kernel rounds once at its
output, so bf16 results agree with transformers' (which rounds the normalised row and each product) within
rounding, not bit for bit. Tested against a stub torch_npu (tests/decode/test_npu_layer_ops.py); not verified on a
real NPU.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType

import torch

__all__ = ["REQUIRED", "npu_functions"]

#: What torch_npu must provide for the "npu" implementation (``npu_add_rms_norm`` is used where present).
REQUIRED = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu")
_ROTARY_LIMITS = (1000, 1000, 896)  # B, N, D: npu_rotary_mul's documented bounds (exclusive)


def _torch_npu() -> ModuleType | None:
    """The installed torch_npu (imported on first use), or ``None``."""
    module = sys.modules.get("torch_npu")
    if module is None:
        try:
            module = importlib.import_module("torch_npu")
        except Exception:  # noqa: BLE001 -- not installed, or its import fails without an NPU
            return None
    return module


def npu_functions(reference: dict[str, Callable]) -> dict[str, Callable] | None:
    """The four ops on torch_npu's kernels (each falling back to ``reference[name]`` outside a kernel's limits),
    or ``None`` where torch_npu is missing or lacks one of :data:`REQUIRED`."""
    npu = _torch_npu()
    if npu is None or not all(callable(getattr(npu, name, None)) for name in REQUIRED):
        return None
    add_norm = getattr(npu, "npu_add_rms_norm", None)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype != x.dtype or x.dim() < 2:
            return reference["rms_norm"](x, weight, eps)
        return npu.npu_rms_norm(x.contiguous(), weight.contiguous(), epsilon=eps)[0]

    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not (weight.dtype == residual.dtype == x.dtype) or x.dim() < 2:
            return reference["add_rms_norm"](x, residual, weight, eps)
        if add_norm is None:
            hidden = residual + x
            return npu.npu_rms_norm(hidden, weight.contiguous(), epsilon=eps)[0], hidden
        normed, _, hidden = add_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)
        return normed, hidden

    def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, heads, _, d = q.shape
        within = all(n < limit for n, limit in zip((b, max(heads, k.shape[1]), d), _ROTARY_LIMITS, strict=True))
        if not within or not (q.dtype == k.dtype == cos.dtype):
            return reference["rotary_qk"](q, k, cos, sin)
        r1, r2 = cos.unsqueeze(1).contiguous(), sin.unsqueeze(1).contiguous()  # [B or 1, 1, T, D]: BNSD's B1SD
        return npu.npu_rotary_mul(q.contiguous(), r1, r2), npu.npu_rotary_mul(k.contiguous(), r1, r2)

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.dtype != up.dtype or gate.dim() < 1:
            return reference["silu_mul"](gate, up)
        return npu.npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)

    return {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotary_qk": rotary_qk, "silu_mul": silu_mul}
