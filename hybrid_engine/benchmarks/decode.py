"""``hybrid-engine bench decode``: ms per decode step and tok/s over batch sizes, eager vs graph.

The reference's shape: a 256-token prompt, 128 new tokens, greedy, batch 1, 4,
8, 16 and 32. For every batch size, both paths (``engine.generate`` and the
rollout engine, both on the graph runner) run eager and graph side by side in
this process: two warm-up calls each (the first warms each key up, the second
captures the keys a call visits once), then ``--repeats`` measured calls,
interleaved eager/graph, and the median is reported.

``ms / step`` is the wall time of one whole generate call divided by the number
of new tokens (the prefill is amortised over the steps, as in the reference);
``tok/s`` is ``batch * new_tokens`` over the same wall time. ``agree`` counts
graph tokens identical to the eager tokens of the same call.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.options import UsageError
from hybrid_engine.benchmarks.paths import (
    engine_generate,
    graph_counts,
    make_engine,
    make_rollout,
    rollout_generate,
    rollout_tokens,
    unreachable_eos,
)

DEFAULT_MODEL = "tiny-gpt2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL)
    p.add_argument("--batch-sizes", type=C.parse_int_list, default=[1, 4, 8, 16, 32],
                   help="comma-separated batch sizes (default 1,4,8,16,32)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (default 128)")
    p.add_argument("--repeats", type=int, default=2, help="measured calls per batch size and mode (default 2)")
    p.add_argument("--paths", default="engine,rollout", help="engine, rollout or both (default engine,rollout)")


def _measure(run_eager, run_graph, repeats: int) -> dict[str, Any]:
    """Warm up both (graph: warm-up, then capture), then interleave measured calls, alternating which mode goes
    first; compare the tokens of the first and the last pair."""
    warm_e, first_e = C.timed(run_eager)
    warm_g, first_g = C.timed(run_graph)
    for _ in range(C.WARMUP_CALLS - 1):
        run_eager()
        run_graph()
    eager_ms: list[float] = []
    graph_ms: list[float] = []
    tok_e = tok_g = None
    for i in range(repeats):  # interleaved, alternating which mode goes first
        for mode in (("eager", "graph") if i % 2 == 0 else ("graph", "eager")):
            if mode == "eager":
                tok_e, t = C.timed(run_eager)
                eager_ms.append(t)
            else:
                tok_g, t = C.timed(run_graph)
                graph_ms.append(t)
    same, total = C.agreement(tok_e, tok_g)
    same0, total0 = C.agreement(warm_e, warm_g)
    return {"eager_ms": eager_ms, "graph_ms": graph_ms, "first_eager_ms": first_e, "first_graph_ms": first_g,
            "tokens_identical": same + same0, "tokens_total": total + total0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    acc, device, dtype, env = C.prepare(args)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = set(paths) - {"engine", "rollout"}
    if bad or not paths:
        raise UsageError(f"--paths takes engine and/or rollout, got {args.paths!r}")
    T, N = args.prompt_len, args.new_tokens
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for path in paths:
        m_eager = C.build_bench_model(args, dtype, device, seed=args.seed)
        m_graph = C.build_bench_model(args, dtype, device, seed=args.seed)
        pad, _ = C.special_ids(m_eager)
        vocab = int(m_eager.config.vocab_size)
        if path == "engine":
            big = max(args.batch_sizes)
            eager = make_engine(m_eager, graphs=False, max_out_tokens=T + N, batch_size=big, dtype=dtype)
            graph = make_engine(m_graph, graphs=True, max_out_tokens=T + N, batch_size=big, dtype=dtype)
        else:
            eos = unreachable_eos(m_eager)
            eager = make_rollout(m_eager, graphs=False, pad_token_id=pad, eos_token_id=eos)
            graph = make_rollout(m_graph, graphs=True, pad_token_id=pad, eos_token_id=eos)
        for b in args.batch_sizes:
            ids, mask = C.random_prompts(b, T, vocab, seed=args.seed + b, device=device, avoid=(pad,))
            if path == "engine":
                def run_e(e=eager, ids=ids, mask=mask):
                    return engine_generate(e, ids, mask, N)

                def run_g(g=graph, ids=ids, mask=mask):
                    return engine_generate(g, ids, mask, N)
            else:
                def run_e(e=eager, ids=ids, mask=mask):
                    return rollout_tokens(rollout_generate(e, ids, mask, N))

                def run_g(g=graph, ids=ids, mask=mask):
                    return rollout_tokens(rollout_generate(g, ids, mask, N))
            m = _measure(run_e, run_g, args.repeats)
            e_ms, g_ms = C.median(m["eager_ms"]), C.median(m["graph_ms"])
            row = {
                "path": path, "batch": b,
                "eager_ms_per_step": e_ms / N, "graph_ms_per_step": g_ms / N,
                "eager_tok_s": b * N / (e_ms / 1e3), "graph_tok_s": b * N / (g_ms / 1e3),
                "speedup": C.speedup(e_ms, g_ms),
                **m,
                "graph": graph_counts(graph),
            }
            rows.append(row)
            print(f"  {path:7s} batch {b:3d}: eager {row['eager_ms_per_step']:.2f} ms/step, "
                  f"graph {row['graph_ms_per_step']:.2f} ms/step, x{row['speedup']:.2f}, "
                  f"agree {m['tokens_identical']}/{m['tokens_total']}", flush=True)
        problem = C.graph_side_problem(f"{path} path", graph_counts(graph))
        if problem:
            problems.append(problem)
        del eager, graph, m_eager, m_graph
        gc.collect()
        acc.empty_cache()

    identical = sum(r["tokens_identical"] for r in rows)
    total = sum(r["tokens_total"] for r in rows)
    payload = {
        "benchmark": "decode", "environment": env,
        "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "prompt_len": T, "new_tokens": N,
                     "batch_sizes": args.batch_sizes, "repeats": args.repeats, "paths": paths, "greedy": True},
        "rows": rows,
        "token_agreement": {"identical": identical, "total": total},
        "graph_side_problems": problems,
    }
    headers = ["path", "batch", "eager ms/step", "graph ms/step", "eager tok/s", "graph tok/s", "speedup", "agree"]
    table = C.format_table(headers, [
        [r["path"], r["batch"], r["eager_ms_per_step"], r["graph_ms_per_step"], f"{r['eager_tok_s']:.0f}",
         f"{r['graph_tok_s']:.0f}", f"{r['speedup']:.2f}x", f"{r['tokens_identical']}/{r['tokens_total']}"]
        for r in rows
    ])
    text = (f"\nbench decode: {C.model_label(args)} {C.dtype_name(dtype)}, {T}-token prompt, {N} new tokens, greedy\n"
            f"{C.environment_lines(env)}\n\n{table}\n\ntoken agreement (graph vs eager): {identical}/{total}")

    def draw(plt: Any) -> None:
        for path in paths:
            rs = [r for r in rows if r["path"] == path]
            plt.plot([r["batch"] for r in rs], [r["eager_tok_s"] for r in rs], "o--", label=f"{path} eager")
            plt.plot([r["batch"] for r in rs], [r["graph_tok_s"] for r in rs], "o-", label=f"{path} graph")
        plt.xscale("log", base=2)
        plt.xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
        plt.xlabel("batch size")
        plt.ylabel("tokens / s")
        plt.legend()

    C.finish(args, payload, text, draw, f"decode throughput: {C.model_label(args)} {C.dtype_name(dtype)}")
    return payload
