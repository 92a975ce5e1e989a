"""``hybrid-engine bench overhead``: our eager path vs transformers' own ``model.generate``.

Our eager path is ``HybridEngine.generate`` with graph capture off, a pinned
length and greedy decoding. The baseline is ``model.generate(do_sample=False,
max_new_tokens=N, min_new_tokens=N)`` of transformers on an identical copy of
the model (same seed), on the same inputs. Repetitions are interleaved (ours,
theirs, ours, theirs, ...) after one warm-up each, so drift in machine load hits
both alike; the medians and their ratio are reported. The ratio should stay at
or below 1.05. Tokens are compared as well.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.paths import engine_generate, make_engine

DEFAULT_MODEL = "tiny-gpt2"
TARGET_RATIO = 1.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL)
    p.add_argument("--batch-size", type=int, default=4, help="rows (default 4)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens (default 256)")
    p.add_argument("--repeats", type=int, default=7, help="measured calls per side, interleaved (default 7)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    acc, device, dtype, env = C.prepare(args)
    ours_model = C.build_bench_model(args, dtype, device, seed=args.seed)
    hf_model = C.build_bench_model(args, dtype, device, seed=args.seed)
    pad, _ = C.special_ids(hf_model)
    B, T, N = args.batch_size, args.prompt_len, args.new_tokens
    ids, mask = C.random_prompts(B, T, int(hf_model.config.vocab_size), seed=args.seed + 3, device=device,
                                 avoid=(pad,))
    engine = make_engine(ours_model, graphs=False, max_out_tokens=T + N, batch_size=B, dtype=dtype)

    def ours() -> torch.Tensor:
        return engine_generate(engine, ids, mask, N)

    def theirs() -> torch.Tensor:
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N,
                                    min_new_tokens=N, pad_token_id=pad)
        return out[:, T:]

    ours(), theirs()  # warm-up
    ours_ms: list[float] = []
    hf_ms: list[float] = []
    tok_o = tok_h = None
    for i in range(args.repeats):
        order = (("ours", ours), ("hf", theirs)) if i % 2 == 0 else (("hf", theirs), ("ours", ours))
        for name, fn in order:
            tok, ms = C.timed(fn)
            if name == "ours":
                ours_ms.append(ms)
                tok_o = tok
            else:
                hf_ms.append(ms)
                tok_h = tok
    same, total = C.agreement(tok_o, tok_h)
    o_med, h_med = C.median(ours_ms), C.median(hf_ms)
    ratio = o_med / h_med
    engine = ours_model = hf_model = None
    gc.collect()
    payload = {
        "benchmark": "overhead", "environment": env,
        "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "batch_size": B, "prompt_len": T,
                     "new_tokens": N, "repeats": args.repeats, "greedy": True},
        "ours_ms": ours_ms, "hf_ms": hf_ms, "ours_median_ms": o_med, "hf_median_ms": h_med,
        "ratio": ratio, "target_ratio": TARGET_RATIO, "within_target": ratio <= TARGET_RATIO,
        "token_agreement": {"identical": same, "total": total},
    }
    table = C.format_table(["generate", "median", "ms / token step", "tok/s"], [
        ["hybrid-engine eager", f"{o_med:.1f} ms", o_med / N, f"{B * N / (o_med / 1e3):.0f}"],
        ["transformers model.generate", f"{h_med:.1f} ms", h_med / N, f"{B * N / (h_med / 1e3):.0f}"],
    ])
    verdict = "within" if ratio <= TARGET_RATIO else "ABOVE"
    text = (
        f"\nbench overhead: {C.model_label(args)} {C.dtype_name(dtype)}, batch {B}, {T}-token prompt, {N} new "
        f"tokens, greedy, {args.repeats} interleaved repetitions\n{C.environment_lines(env)}\n\n{table}\n\n"
        f"ratio ours / transformers: {ratio:.3f} ({verdict} the {TARGET_RATIO} target)\n"
        f"token agreement with transformers: {same}/{total}"
    )

    def draw(plt: Any) -> None:
        plt.boxplot([ours_ms, hf_ms])
        plt.xticks([1, 2], ["hybrid-engine eager", "transformers generate"])
        plt.ylabel("ms per generate call")

    C.finish(args, payload, text, draw, f"eager overhead vs transformers: ratio {ratio:.3f}")
    return payload
