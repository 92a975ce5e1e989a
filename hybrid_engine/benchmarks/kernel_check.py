"""``hybrid-engine bench kernels --check``: every decode custom op against its reference, on the device.

Why: an op picks its implementation by a probe on a tiny input; this runs each op through the dispatcher (the
implementation the probe chose on ``--device``) at a decode step's real widths (Qwen2.5-0.5B: 14 query and 2 KV
heads of 64, hidden 896, intermediate 4,864, 64 rows, rows up to 2k tokens on 16-token pages) and compares it with
the op's reference implementation on the same inputs. A mismatch beyond the op's tolerance fails the command
(exit 1), so ``bench/gpu_check.sh`` reports it. On a machine where every op runs its reference, the comparison is
trivially exact, and the table says so (``implementation: reference``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Tolerances (max |got - want|) per dtype: fp32 kernels agree to rounding; half types to their precision.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
ROWS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE, SPAN = 64, 896, 4864, 14, 2, 64, 16, 2048


def _paged_attention(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[str, list]:
    from hybrid_engine.decode.ops import paged_attention as P

    pages = SPAN // PAGE
    q = torch.randn(ROWS, HEADS, 1, HEAD_DIM, generator=g).to(device, dtype)
    pools = [torch.randn((1 + ROWS * pages) * PAGE, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
             for _ in range(2)]
    table = (1 + torch.randperm(ROWS * pages, generator=g)).view(ROWS, pages).to(device)
    lengths = torch.randint(1, SPAN + 1, (ROWS,), generator=g).to(device)
    got = torch.ops.hybrid_engine.paged_decode_attention(q, *pools, table, lengths, HEAD_DIM ** -0.5, PAGE)
    want = P.reference_attention(q, *pools, table, lengths, HEAD_DIM ** -0.5, PAGE)
    return P.implementation(device), [("paged_decode_attention", got, want)]


def _layer_ops(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[str, list]:
    from hybrid_engine.decode.ops import layer_ops as L

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    x, res, w = rand(ROWS, 1, HIDDEN), rand(ROWS, 1, HIDDEN), rand(HIDDEN)
    q, k = rand(ROWS, HEADS, 1, HEAD_DIM), rand(ROWS, KV_HEADS, 1, HEAD_DIM)
    angle = torch.rand(ROWS, 1, HEAD_DIM // 2, generator=g).to(device) * 100
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(dtype) for f in (torch.cos, torch.sin))
    gate, up = rand(ROWS, 1, INTER), rand(ROWS, 1, INTER)
    ops = torch.ops.hybrid_engine
    pairs = [("rms_norm", ops.rms_norm(x, w, 1e-6), L.reference_rms_norm(x, w, 1e-6))]
    for name, got, want in zip(("add_rms_norm (normed)", "add_rms_norm (sum)"), ops.add_rms_norm(x, res, w, 1e-6),
                               L.reference_add_rms_norm(x, res, w, 1e-6)):
        pairs.append((name, got, want))
    for name, got, want in zip(("rotary_qk (q)", "rotary_qk (k)"), ops.rotary_qk(q, k, cos, sin),
                               L.reference_rotary_qk(q, k, cos, sin)):
        pairs.append((name, got, want))
    pairs.append(("silu_mul", ops.silu_mul(gate, up), L.reference_silu_mul(gate, up)))
    return L.implementation(device), pairs


#: One entry per ops module: (name, check(device, dtype, generator) -> (implementation, [(op, got, want)])).
CHECKS: list[tuple[str, Callable[..., tuple[str, list]]]] = [
    ("paged attention", _paged_attention),
    ("layer ops", _layer_ops),
]


def check_kernels(device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """One row per op output: the implementation chosen on ``device``, the max abs error against the reference,
    the tolerance, and whether it holds. A check that raises is a failed row, not a crash."""
    rows: list[dict[str, Any]] = []
    tol = TOLERANCE[dtype]
    for group, check in CHECKS:
        try:
            impl, pairs = check(device, dtype, torch.Generator().manual_seed(0))
        except Exception as exc:  # noqa: BLE001 -- reported as a failed row
            rows.append({"group": group, "op": group, "implementation": "?", "max_abs_err": None, "tolerance": tol,
                         "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for op, got, want in pairs:
            if got.dtype.is_floating_point:
                err = float((got.float() - want.float()).abs().max())
                ok = err <= tol and bool(torch.isfinite(got).all())
            else:
                err = float((got != want).sum())
                ok = err == 0
            rows.append({"group": group, "op": op, "implementation": impl, "max_abs_err": err, "tolerance": tol,
                         "ok": ok, "error": None})
    return rows
