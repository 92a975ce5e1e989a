"""``hybrid-engine bench overhead``: our eager path vs transformers' own ``model.generate``.

Our eager path is ``HybridEngine.generate`` with graph capture off, a pinned
length and greedy decoding. The baseline is ``model.generate(do_sample=False,
max_new_tokens=N, min_new_tokens=N)`` of transformers on an identical copy of
the model (same seed), on the same inputs. Repetitions are interleaved (ours,
theirs, ours, theirs, ...) after one warm-up each, so drift in machine load hits
both alike; the medians and their ratio are reported. The ratio should stay at
or below 1.05. Tokens are compared as well.

The second comparison (where DeepSpeed is installed) is the rollout path: our
``HybridEngineRollout`` with graphs off against DeepSpeed's own
``deepspeed.runtime.rollout.HybridEngineRollout`` (its ``model.generate`` path)
on the same work: the same prompts, ``--samples`` samples each, a pinned length
(an EOS no model emits), greedy and sampled at temperature 1 (``--rollout-modes``).
Ours must be no slower (ratio <= 1.0); greedy tokens are compared. Ours runs twice: with graphs off (the
eager path, the ratio the target is read on) and with graphs on (the path a user runs; on a CPU, the graph
emulation), both in the same interleaved rounds.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.paths import (
    engine_generate,
    make_engine,
    make_rollout,
    rollout_generate,
    rollout_tokens,
    unreachable_eos,
)

DEFAULT_MODEL = "tiny-gpt2"
TARGET_RATIO = 1.05
#: Ours against DeepSpeed's HybridEngineRollout on the same work: no slower.
ROLLOUT_TARGET_RATIO = 1.0
ROLLOUT_MODES = {"greedy": 0.0, "sampled": 1.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL)
    p.add_argument("--batch-size", type=int, default=4, help="rows (default 4)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens (default 256)")
    p.add_argument("--repeats", type=int, default=7, help="measured calls per side, interleaved (default 7)")
    p.add_argument("--samples", type=int, default=2, help="rollout samples per prompt (default 2)")
    p.add_argument("--rollout-modes", default="greedy,sampled",
                   help="rollout comparison modes: greedy, sampled (temperature 1), none (default greedy,sampled)")


def _interleaved(*fns: Any, repeats: int) -> list[Any]:
    """One warm-up each, then ``repeats`` timed calls each, rotating which goes first; ``[ms of the first,
    ..., last output of the first, ...]``."""
    for fn in fns:
        fn()
    ms: list[list[float]] = [[] for _ in fns]
    outs: list[Any] = [None] * len(fns)
    for i in range(repeats):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            outs[k], t = C.timed(fns[k])
            ms[k].append(t)
    return [*ms, *outs]


def rollout_vs_deepspeed(args: argparse.Namespace, dtype: torch.dtype, device: torch.device, ids: torch.Tensor,
                         mask: torch.Tensor) -> list[dict[str, Any]]:
    """Our rollout (graphs off) vs DeepSpeed's ``HybridEngineRollout`` on the same work, per mode; ``[]`` without
    DeepSpeed's rollout module or with ``--rollout-modes none``."""
    modes = [m.strip() for m in args.rollout_modes.split(",") if m.strip() and m.strip() != "none"]
    bad = set(modes) - set(ROLLOUT_MODES)
    if bad:
        from hybrid_engine.benchmarks.options import UsageError

        raise UsageError(f"--rollout-modes takes greedy, sampled or none, got {args.rollout_modes!r}")
    try:
        from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedRollout
        from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig
    except ImportError:
        return []
    import types

    ours_model = C.build_bench_model(args, dtype, device, seed=args.seed)
    ds_model = C.build_bench_model(args, dtype, device, seed=args.seed)
    pad, _ = C.special_ids(ours_model)
    eos = unreachable_eos(ours_model)
    ours = make_rollout(ours_model, graphs=False, pad_token_id=pad, eos_token_id=eos)
    graphed = make_rollout(C.build_bench_model(args, dtype, device, seed=args.seed), graphs=True, pad_token_id=pad,
                           eos_token_id=eos)
    theirs = DeepSpeedRollout(types.SimpleNamespace(module=ds_model),
                              types.SimpleNamespace(pad_token_id=pad, eos_token_id=eos))
    rows = []
    for mode in modes:
        temperature = ROLLOUT_MODES[mode]

        def run_ours(t: float = temperature, rollout: Any = ours) -> torch.Tensor:
            return rollout_tokens(rollout_generate(rollout, ids, mask, args.new_tokens, temperature=t,
                                                   n_samples=args.samples))

        def run_theirs(t: float = temperature) -> torch.Tensor:
            sc = SamplingConfig(max_new_tokens=args.new_tokens, temperature=t, n_samples_per_prompt=args.samples)
            batch = theirs.generate(RolloutRequest(ids, mask), sc)
            return batch.input_ids[:, int(batch.response_start_idx[0]):]  # [B] of equal starts (left-padded)

        def run_graphed(t: float = temperature) -> torch.Tensor:
            return run_ours(t, graphed)

        run_graphed()  # the graph side's warm-up call; it captures on the next
        o_ms, d_ms, g_ms, tok_o, tok_d, tok_g = _interleaved(run_ours, run_theirs, run_graphed, repeats=args.repeats)
        same, total = C.agreement(tok_o, tok_d) if temperature == 0 else (None, None)
        ratio = C.median(o_ms) / C.median(d_ms)
        rows.append({"mode": mode, "ours_ms": o_ms, "deepspeed_ms": d_ms, "ours_median_ms": C.median(o_ms),
                     "deepspeed_median_ms": C.median(d_ms), "ratio": ratio,
                     "within_target": ratio <= ROLLOUT_TARGET_RATIO,
                     "graphs_ms": g_ms, "graphs_median_ms": C.median(g_ms),
                     "graphs_ratio": C.median(g_ms) / C.median(d_ms),
                     "graph_tokens_equal_eager": bool(tok_g.shape == tok_o.shape and (tok_g == tok_o).all()),
                     "graph_replays": int(graphed.last_stats["graph_replays"]),
                     "token_agreement": None if same is None else {"identical": same, "total": total}})
    return rows


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

    ours_ms, hf_ms, tok_o, tok_h = _interleaved(ours, theirs, repeats=args.repeats)
    same, total = C.agreement(tok_o, tok_h)
    o_med, h_med = C.median(ours_ms), C.median(hf_ms)
    ratio = o_med / h_med
    engine = ours_model = hf_model = None
    gc.collect()
    rollout_rows = rollout_vs_deepspeed(args, dtype, device, ids, mask)
    payload = {
        "benchmark": "overhead", "environment": env,
        "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "batch_size": B, "prompt_len": T,
                     "new_tokens": N, "repeats": args.repeats, "greedy": True},
        "ours_ms": ours_ms, "hf_ms": hf_ms, "ours_median_ms": o_med, "hf_median_ms": h_med,
        "ratio": ratio, "target_ratio": TARGET_RATIO, "within_target": ratio <= TARGET_RATIO,
        "token_agreement": {"identical": same, "total": total},
        "rollout_vs_deepspeed": rollout_rows, "rollout_target_ratio": ROLLOUT_TARGET_RATIO,
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
    if rollout_rows:
        n = B * args.samples * N
        text += "\n\n" + C.format_table(
            ["rollout", "ours (graphs off)", "DeepSpeed HybridEngineRollout", "ratio ours / DeepSpeed",
             "ours, graphs on", "ratio graphs / DeepSpeed", "agree"],
            [[r["mode"], f"{r['ours_median_ms']:.1f} ms", f"{r['deepspeed_median_ms']:.1f} ms",
              f"{r['ratio']:.3f} ({'within' if r['within_target'] else 'ABOVE'} {ROLLOUT_TARGET_RATIO})",
              f"{r['graphs_median_ms']:.1f} ms", f"{r['graphs_ratio']:.3f}",
              "-" if r["token_agreement"] is None else
              f"{r['token_agreement']['identical']}/{r['token_agreement']['total']}"] for r in rollout_rows],
            title=f"rollouts on the same work: {B} prompts x {args.samples} samples, {n} tokens per call")
        text += "\n" + "; ".join(f"{r['mode']}: graph tokens {'equal' if r['graph_tokens_equal_eager'] else 'DIFFER FROM'} "
                                 f"eager ({r['graph_replays']} replays in the last call)" for r in rollout_rows)

    def draw(plt: Any) -> None:
        plt.boxplot([ours_ms, hf_ms])
        plt.xticks([1, 2], ["hybrid-engine eager", "transformers generate"])
        plt.ylabel("ms per generate call")

    C.finish(args, payload, text, draw, f"eager overhead vs transformers: ratio {ratio:.3f}")
    return payload
