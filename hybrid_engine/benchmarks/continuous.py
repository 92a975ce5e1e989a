"""``hybrid-engine bench continuous``: continuous rollouts, eager vs graph reuse, and continuous vs static batching.

Part 1 (the reference's methodology): batch 1, a 32-token prompt, 32 new tokens,
greedy, continuous batching. Eager and graph rollouts each make two warm-up
calls, on prompts drawn with seeds 1234 and 1235, then five measured calls
(interleaved eager/graph). The graph rollout's first call, which captures, is
reported separately; its second call, on the other prompt, must reuse that
capture (0 new captures) and both must be token-identical to eager.

Part 2 (a mixed-length workload): many requests of different prompt lengths
whose responses end at different lengths (per-request budgets), served with
``max_batch_size`` slots. Continuous batching refills a slot as soon as its
request ends; static batching runs each group of ``max_batch_size`` requests
until its longest one ends. Both run with graphs on, after one warm-up call
each, then ``--mixed-repeats`` interleaved calls (median); throughput is real
response tokens over wall time. Tokens must agree.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from . import common as C
from .paths import make_rollout, rollout_generate, rollout_tokens, unreachable_eos

DEFAULT_MODEL = "gpt2"
PROMPT_SEEDS = (1234, 1235)


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL)
    p.add_argument("--batch-size", type=int, default=1, help="part 1 batch size (default 1)")
    p.add_argument("--prompt-len", type=int, default=32, help="part 1 prompt tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=32, help="part 1 new tokens (default 32)")
    p.add_argument("--warmup", type=int, default=2, help="part 1 warm-up calls, >= 2 (default 2)")
    p.add_argument("--measured", type=int, default=5, help="part 1 measured calls (default 5)")
    p.add_argument("--mixed-requests", type=int, default=16, help="part 2 number of requests (default 16; 0 skips)")
    p.add_argument("--mixed-max-batch", type=int, default=4, help="part 2 concurrent slots (default 4)")
    p.add_argument("--mixed-max-new", type=int, default=32, help="part 2 largest response budget (default 32)")
    p.add_argument("--mixed-prompt-len", type=int, default=32, help="part 2 longest prompt (default 32)")
    p.add_argument("--mixed-repeats", type=int, default=2, help="part 2 measured calls per mode (default 2)")


def _captures(rollout: Any) -> int:
    return int((rollout.last_stats or {}).get("graph_captures") or 0)


def _part1(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    m_e = C.build_bench_model(args, dtype, device, seed=args.seed)
    m_g = C.build_bench_model(args, dtype, device, seed=args.seed)
    pad, _ = C.special_ids(m_e)
    eos = unreachable_eos(m_e)
    vocab = int(m_e.config.vocab_size)
    eager = make_rollout(m_e, graphs=False, pad_token_id=pad, eos_token_id=eos)
    graph = make_rollout(m_g, graphs=True, pad_token_id=pad, eos_token_id=eos)
    B, T, N = args.batch_size, args.prompt_len, args.new_tokens
    prompts = {s: C.random_prompts(B, T, vocab, seed=s, device=device, avoid=(pad,)) for s in PROMPT_SEEDS}

    def call(rollout, seed):
        return rollout_tokens(rollout_generate(rollout, *prompts[seed], N))

    def pair(seed):
        tok_e, te = C.timed(lambda: call(eager, seed))
        tok_g, tg = C.timed(lambda: call(graph, seed))
        return tok_e, te, tok_g, tg

    seed_checks = []
    warm_ms = {"eager": [], "graph": []}
    for i in range(max(2, args.warmup)):
        s = PROMPT_SEEDS[i % 2]
        tok_e, te, tok_g, tg = pair(s)
        warm_ms["eager"].append(te)
        warm_ms["graph"].append(tg)
        if i < 2:
            same, total = C.agreement(tok_e, tok_g)
            seed_checks.append({"prompt_seed": s, "identical": same, "total": total,
                                "graph_captures_this_call": _captures(graph)})
    eager_ms, graph_ms = [], []
    same_m = total_m = 0
    for _ in range(args.measured):
        tok_e, te, tok_g, tg = pair(PROMPT_SEEDS[0])
        eager_ms.append(te)
        graph_ms.append(tg)
        s_, t_ = C.agreement(tok_e, tok_g)
        same_m += s_
        total_m += t_
    stats_g = dict(graph.last_stats or {})
    stats_e = dict(eager.last_stats or {})
    eager = graph = m_e = m_g = None  # free both models before part 2
    gc.collect()
    e_med, g_med = C.median(eager_ms), C.median(graph_ms)
    return {
        "eager_median_ms": e_med, "graph_median_ms": g_med, "speedup": C.speedup(e_med, g_med),
        "eager_tok_s": B * N / (e_med / 1e3), "graph_tok_s": B * N / (g_med / 1e3),
        "first_graph_call_ms": warm_ms["graph"][0], "first_eager_call_ms": warm_ms["eager"][0],
        "eager_ms": eager_ms, "graph_ms": graph_ms, "warmup_ms": warm_ms,
        "seed_checks": seed_checks,
        "captures_in_second_prompt_call": seed_checks[1]["graph_captures_this_call"],
        "measured_agreement": {"identical": same_m, "total": total_m},
        "last_stats": {"eager": stats_e, "graph": stats_g},
    }


def _part2(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    R = args.mixed_requests
    model = C.build_bench_model(args, dtype, device, seed=args.seed)
    pad, _ = C.special_ids(model)
    vocab = int(model.config.vocab_size)
    ids, mask = C.random_prompts(R, args.mixed_prompt_len, vocab, seed=args.seed + 7, device=device, avoid=(pad,),
                                 min_length=max(1, args.mixed_prompt_len // 4))
    gen = torch.Generator().manual_seed(args.seed + 11)
    budgets = torch.randint(1, args.mixed_max_new + 1, (R,), generator=gen).tolist()
    eos = unreachable_eos(model)
    rollouts = {mode: make_rollout(model, graphs=True, pad_token_id=pad, eos_token_id=eos, continuous=continuous,
                                   max_batch_size=args.mixed_max_batch)
                for mode, continuous in (("continuous", True), ("static", False))}

    def call(mode: str):
        return rollout_generate(rollouts[mode], ids, mask, args.mixed_max_new, budgets=budgets)

    for mode in rollouts:  # warm-up: captures every bucket the workload visits
        call(mode)
    times: dict[str, list[float]] = {mode: [] for mode in rollouts}
    tokens = {}
    stats: dict[str, dict[str, Any]] = {}
    for i in range(args.mixed_repeats):  # interleaved, alternating which goes first
        for mode in (("continuous", "static") if i % 2 == 0 else ("static", "continuous")):
            batch, ms = C.timed(lambda mode=mode: call(mode))
            times[mode].append(ms)
            tokens[mode] = (rollout_tokens(batch).cpu(), batch.response_lengths.cpu())
            stats[mode] = dict(rollouts[mode].last_stats or {})
    results: dict[str, Any] = {}
    for mode in rollouts:
        useful = int(tokens[mode][1].sum())
        ms = C.median(times[mode])
        st = stats[mode]
        results[mode] = {"ms": ms, "all_ms": times[mode], "tokens": useful, "tok_s": useful / (ms / 1e3),
                         "decode_steps": st.get("decode_steps"), "graph_replays": st.get("graph_replays"),
                         "graph_captures": st.get("graph_captures"), "peak_active_batch": st.get("peak_active_batch"),
                         "last_stats": st}
    rollouts.clear()
    gc.collect()
    (tc, lc), (ts, ls) = tokens["continuous"], tokens["static"]
    same = total = 0
    for r in range(R):
        n = int(lc[r])
        total += n
        if int(ls[r]) == n:
            same += int((tc[r, :n] == ts[r, :n]).sum())
    del model
    return {
        "requests": R, "max_batch_size": args.mixed_max_batch, "max_new_tokens": args.mixed_max_new,
        "budgets": budgets, **results,
        "speedup": C.speedup(results["static"]["ms"], results["continuous"]["ms"]),
        "agreement": {"identical": same, "total": total},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    acc, device, dtype, env = C.prepare(args)
    print("bench continuous: part 1, eager vs graph reuse ...", flush=True)
    p1 = _part1(args, device, dtype)
    p2 = None
    if args.mixed_requests > 0:
        print("bench continuous: part 2, mixed-length workload, continuous vs static batching ...", flush=True)
        p2 = _part2(args, device, dtype)
    seed_same = sum(c["identical"] for c in p1["seed_checks"])
    seed_total = sum(c["total"] for c in p1["seed_checks"])
    identical = seed_same + p1["measured_agreement"]["identical"] + (p2["agreement"]["identical"] if p2 else 0)
    total = seed_total + p1["measured_agreement"]["total"] + (p2["agreement"]["total"] if p2 else 0)
    payload = {
        "benchmark": "continuous", "environment": env,
        "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "batch_size": args.batch_size,
                     "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "warmup": max(2, args.warmup),
                     "measured": args.measured, "greedy": True, "prompt_seeds": list(PROMPT_SEEDS)},
        "latency": p1, "mixed": p2,
        "token_agreement": {"identical": identical, "total": total},
    }
    t1 = C.format_table(["mode", "median latency", "throughput"], [
        ["eager", f"{p1['eager_median_ms']:.2f} ms", f"{p1['eager_tok_s']:.0f} tokens/s"],
        ["graph reuse", f"{p1['graph_median_ms']:.2f} ms", f"{p1['graph_tok_s']:.0f} tokens/s"],
    ])
    checks = "; ".join(f"seed {c['prompt_seed']}: {c['identical']}/{c['total']} identical, "
                       f"{c['graph_captures_this_call']} captures" for c in p1["seed_checks"])
    text = (
        f"\nbench continuous: {C.model_label(args)} {C.dtype_name(dtype)}, batch {args.batch_size}, "
        f"{args.prompt_len}-token prompt, {args.new_tokens} new tokens, greedy, continuous batching, "
        f"{max(2, args.warmup)} warm-up + {args.measured} measured calls\n{C.environment_lines(env)}\n\n{t1}\n\n"
        f"steady-state speedup: {p1['speedup']:.2f}x; first graph call (with capture): "
        f"{p1['first_graph_call_ms']:.1f} ms (first eager call {p1['first_eager_call_ms']:.1f} ms)\n"
        f"prompts: {checks}\n"
        f"measured calls: {p1['measured_agreement']['identical']}/{p1['measured_agreement']['total']} identical"
    )
    if p2:
        t2 = C.format_table(["batching", "wall", "response tokens", "throughput", "decode steps"], [
            [m, f"{p2[m]['ms']:.1f} ms (median of {len(p2[m]['all_ms'])})", p2[m]["tokens"], f"{p2[m]['tok_s']:.0f} tokens/s", p2[m]["decode_steps"]]
            for m in ("continuous", "static")
        ])
        text += (
            f"\n\nmixed-length workload: {p2['requests']} requests, prompts up to {args.mixed_prompt_len} tokens, "
            f"response budgets 1..{p2['max_new_tokens']}, {p2['max_batch_size']} slots, graphs on\n\n{t2}\n\n"
            f"continuous vs static: {p2['speedup']:.2f}x; tokens identical {p2['agreement']['identical']}/"
            f"{p2['agreement']['total']}"
        )
    text += f"\n\ntoken agreement overall: {identical}/{total}"

    def draw(plt: Any) -> None:
        labels = ["batch-1 latency"]
        e, g = [p1["eager_tok_s"]], [p1["graph_tok_s"]]
        plt.subplot(1, 2, 1)
        C.bar_pairs(plt, labels, e, g, "tokens / s")
        if p2:
            plt.subplot(1, 2, 2)
            plt.bar(["static", "continuous"], [p2["static"]["tok_s"], p2["continuous"]["tok_s"]])
            plt.ylabel("tokens / s (mixed workload)")

    C.finish(args, payload, text, draw, f"continuous rollouts: {C.model_label(args)}")
    return payload
