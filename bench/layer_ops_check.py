"""The layer ops on a device against their references (issue 40: "the GPU check runs every kernel against its
reference on the device"): ``hybrid_engine::rms_norm``, ``::add_rms_norm``, ``::rotary_qk``, ``::silu_mul`` at
decode shapes of Qwen2.5-0.5B and -7B (64 rows, one token each), fp32 and bf16.

Per op and dtype: the implementation the device's probe chose, the largest difference from the reference, the
share of elements equal bit for bit, and the time per call of the op and of the reference (CUDA events; a
median). Rotary and the residual sum must equal the reference bit for bit, the rest agree within 1e-5 (fp32) or
one bf16 rounding (1e-2 relative); exit status 1 otherwise.

    python -m bench.layer_ops_check --device cuda --json layer_ops.json
    TRITON_INTERPRET=1 python -m bench.layer_ops_check --device cpu --mini   # the CPU rehearsal (tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hybrid_engine.decode.ops import layer_ops as lo

SHAPES = {"qwen2.5-0.5b": {"hidden": 896, "heads": 14, "kv_heads": 2, "head_dim": 64, "intermediate": 4864},
          "qwen2.5-7b": {"hidden": 3584, "heads": 28, "kv_heads": 4, "head_dim": 128, "intermediate": 18944}}
MINI = {"mini": {"hidden": 40, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 56}}
EXACT = {"rotary_qk q", "rotary_qk k", "add_rms_norm residual"}  # bit for bit


def _inputs(shape: dict[str, int], rows: int, dtype: torch.dtype, device: torch.device) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*size, generator=g)).to(dtype).to(device)

    hidden, d = shape["hidden"], shape["head_dim"]
    x, res, w = rand(rows, 1, hidden), rand(rows, 1, hidden), (1 + rand(hidden, scale=0.1)).to(dtype)
    q = rand(rows, 1, shape["heads"], d).transpose(1, 2)  # [B, H, 1, D] views, as transformers has them
    k = rand(rows, 1, shape["kv_heads"], d).transpose(1, 2)
    angles = torch.rand(rows, 1, d, generator=g) * 1000
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    gate, up = rand(rows, 1, shape["intermediate"], scale=3.0), rand(rows, 1, shape["intermediate"])
    return {"rms_norm": (x, w, 1e-6), "add_rms_norm": (x, res, w, 1e-6), "rotary_qk": (q, k, cos, sin),
            "silu_mul": (gate, up)}


def _time_us(fn, args: tuple, device: torch.device, reps: int) -> float:
    """Median microseconds per call (CUDA events on CUDA, the host clock elsewhere)."""
    fn(*args)
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000)
        else:
            t0 = time.perf_counter()
            fn(*args)
            samples.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(samples), 2)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    tol = 0.0 if name in EXACT else 1e-5 if want.dtype == torch.float32 else 1e-2
    ok = got.dtype == want.dtype and got.shape == want.shape and torch.allclose(
        got.float(), want.float(), atol=tol, rtol=tol)
    return {"op": name, "ok": bool(ok), "max_abs_err": float((got.float() - want.float()).abs().max()),
            "equal_fraction": round(float((got == want).float().mean()), 4)}


def check(device: torch.device, shapes: dict[str, dict[str, int]], rows: int, reps: int) -> list[dict]:
    results = []
    for model, shape in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            for name, args in _inputs(shape, rows, dtype, device).items():
                op, reference = getattr(torch.ops.hybrid_engine, name), getattr(lo, f"reference_{name}")
                got, want = op(*args), reference(*args)
                got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
                labels = {"add_rms_norm": (name, f"{name} residual"), "rotary_qk": (f"{name} q", f"{name} k")}
                fused_us, reference_us = _time_us(op, args, device, reps), _time_us(reference, args, device, reps)
                for label, a, b in zip(labels.get(name, (name,)), got, want, strict=True):
                    results.append({"model": model, "dtype": str(dtype).removeprefix("torch."), **_compare(label, a, b),
                                    "fused_us": fused_us, "reference_us": reference_us})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--mini", action="store_true", help="tiny shapes, 2 rows, 2 reps (the CPU rehearsal)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes, rows, reps = (MINI, 2, 2) if args.mini else (SHAPES, args.rows, args.reps)
    chosen = lo.implementation(device)
    results = check(device, shapes, rows, reps)
    for r in results:
        print(f"{r['model']:>13} {r['dtype']:>8} {r['op']:>22}  {'ok ' if r['ok'] else 'BAD'}  "
              f"max err {r['max_abs_err']:.3g}  equal {r['equal_fraction']:.4f}  "
              f"{r['fused_us']:.1f} us vs reference {r['reference_us']:.1f} us")
    ok = all(r["ok"] for r in results)
    summary = {"device": str(device), "implementation": chosen, "ok": ok, "results": results}
    print(f"implementation on {device}: {chosen}; {'all ok' if ok else 'MISMATCH'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
