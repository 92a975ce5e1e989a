"""Device check of ``hybrid_engine::sample_rows``' Triton kernel against its reference (for bench/gpu_check.sh).

On the device: the probe's choice; the in-kernel uniform's bits against ``counter_uniform``; on Qwen2.5-wide rows
(vocab 151936, bf16) for temperature, top-p, top-k and top-k + top-p, every token is the inverse CDF of the exact
filtered distribution at its uniform (float64 CDF in vocabulary order) with the reference's logprob for it; a
chi-square over many draws of one small row; non-finite rows stay in range; then the time of one op (kernel) and
of the reference's aten ops at ``--batch`` rows. Exits 1 on a failed check.

    python -m bench.sampler_check [--device cuda] [--dtype bf16] [--batch 64] [--vocab 151936] [--json PATH]
    TRITON_INTERPRET=1 python -m bench.sampler_check --cpu-mini   (checks the script on CPU, tiny sizes)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from hybrid_engine.decode.ops import sampler as so
from hybrid_engine.decode.sampling import SamplingKnobs, counter_uniform

SETTINGS = {"temperature 1": (1.0, 1.0, -1), "top-p 0.9": (1.0, 0.9, -1), "top-k 50": (0.8, 1.0, 50),
            "top-k 50 + top-p 0.9": (0.7, 0.9, 50)}


def launch(kernel: bool, logits, setting, index, eos=None, suppress=None):
    knobs = SamplingKnobs(logits.device)
    knobs.set(*setting)
    rows = logits.shape[0]
    args = (logits, eos, suppress, torch.zeros(rows, dtype=torch.long, device=logits.device), knobs.inv_temperature,
            knobs.top_p, knobs.top_k, knobs.full, torch.tensor(7, device=logits.device),
            torch.tensor(1, device=logits.device), index, setting[2] > 0, setting[1] < 1)
    return (so._triton_sample_rows if kernel else so.reference_sample_rows)(*args)


def check_inverse_cdf(logits, setting, index, tokens, lp) -> float:
    """The largest distance of a token's uniform outside its CDF interval (0: every draw is exact), and the
    largest logprob difference to the reference's, as a pair."""
    t, p, k = setting
    knobs = SamplingKnobs(logits.device)
    knobs.set(*setting)
    ref_lp, _, _ = so.filtered_logprobs(logits, knobs.inv_temperature[:1, None], knobs.top_p[:1, None],
                                        knobs.top_k[:1, None], k > 0, p < 1, per_row=True)
    q = ref_lp.double().exp()
    q = q / q.sum(-1, keepdim=True)
    cdf = torch.cumsum(q, -1)
    u = counter_uniform(torch.tensor(7, device=logits.device), 1, index).double()
    hi = cdf.gather(-1, tokens[:, None])[:, 0]
    lo = hi - q.gather(-1, tokens[:, None])[:, 0]
    kept = q.gather(-1, tokens[:, None])[:, 0] > 0
    outside = torch.clamp(torch.maximum(lo - u, u - hi), min=0).max().item()
    if not kept.all():
        outside = math.inf
    lp_err = (lp - ref_lp.gather(-1, tokens[:, None])[:, 0]).abs().max().item()
    return outside, lp_err


def timed(fn, reps: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-mini", action="store_true")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --cpu-mini)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the logits' dtype")
    a = ap.parse_args()
    device = torch.device(a.device or ("cpu" if a.cpu_mini else "cuda"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if a.cpu_mini:
        a.batch, a.vocab, a.draws = 4, 300, 80  # the script end to end; test_sampler_op.py checks the draws
    out, ok = {"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu")}, True
    out["implementation"] = so.implementation(device)
    ok &= out["implementation"] == "triton"
    n = 4096 if not a.cpu_mini else 300
    g = torch.Generator().manual_seed(0)
    counters = [torch.randint(-2**62, 2**62, (n,), generator=g).to(device) for _ in range(3)]
    u = torch.empty(n, device=device)
    so._kernel()._uniform_kernel[(triton_cdiv(n, 256),)](*counters, u, n, K0=so.seed_lane(0), BLOCK=256)
    out["uniform_bits_equal"] = bool(torch.equal(u, counter_uniform(*counters)))
    ok &= out["uniform_bits_equal"]
    logits = (torch.randn(a.batch, a.vocab, generator=g) * 3).to(dtype).to(device)
    index = torch.arange(a.batch, device=device)
    for name, setting in SETTINGS.items():
        tokens, lp = launch(True, logits, setting, index)
        outside, lp_err = check_inverse_cdf(logits, setting, index, tokens, lp)
        kernel_ms = timed(lambda s=setting: launch(True, logits, s, index), 1 if a.cpu_mini else 50)
        ref_ms = timed(lambda s=setting: launch(False, logits, s, index), 1 if a.cpu_mini else 20)
        out[name] = {"uniform_outside_cdf_interval": outside, "logprob_max_abs_diff": lp_err,
                     "kernel_ms": kernel_ms, "reference_ms": ref_ms}
        ok &= outside <= 1e-5 and lp_err <= 1e-4
    row = torch.full((64,), -4.0)
    row[[3, 11, 17, 29, 40, 47]] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, 3.0])
    draws = row.expand(a.draws, -1).contiguous().to(device)
    for name, setting in SETTINGS.items():
        tokens, _ = launch(True, draws, setting, torch.arange(a.draws, device=device))
        knobs = SamplingKnobs(torch.device("cpu"))
        knobs.set(*setting)
        ref_lp, _, _ = so.filtered_logprobs(row[None], knobs.inv_temperature[:1, None], knobs.top_p[:1, None],
                                            knobs.top_k[:1, None], setting[2] > 0, setting[1] < 1, per_row=True)
        expected = ref_lp[0].double().exp() * a.draws
        counts = torch.bincount(tokens.cpu(), minlength=64).double()
        big = expected >= 5
        chi2 = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
        df = int(big.sum()) - 1
        crit = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3 if df > 0 else math.inf
        out[name]["chi2"], out[name]["chi2_critical"] = chi2, crit
        ok &= chi2 < crit and bool((counts[expected == 0] == 0).all())
    bad = torch.full((3, a.vocab), float("nan"), device=device)
    bad[1] = float("-inf")
    tokens, lp = launch(True, bad, SETTINGS["top-k 50 + top-p 0.9"], torch.arange(3, device=device))
    out["non_finite_in_range"] = bool(((tokens >= 0) & (tokens < a.vocab)).all() and torch.isnan(lp).all())
    ok &= out["non_finite_in_range"]
    out["ok"] = bool(ok)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


if __name__ == "__main__":
    sys.exit(main())
