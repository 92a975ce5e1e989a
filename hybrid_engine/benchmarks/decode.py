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

``--paths transformers`` adds transformers' own ``generate`` on the same model (greedy, its default cache; no
graph column): the peer every figure is read against. ``--per-step`` leaves the prefill out: every call runs
twice, with ``new_tokens`` and with one new token, and ``ms / step`` is the difference over ``new_tokens - 1``
(the decode steps alone; what ``bench/gpu_check.sh`` reports for a Qwen2.5-0.5B shape at 64 rows x 2k span).
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
    p.add_argument("--paths", default="engine,rollout",
                   help="comma-separated: engine, rollout, transformers (default engine,rollout)")
    p.add_argument("--per-step", action="store_true",
                   help="ms per decode step without the prefill: (call(new_tokens) - call(1)) / (new_tokens - 1)")


def _measure(run_eager, run_graph, repeats: int) -> dict[str, Any]:
    """Warm up both (graph: warm-up, then capture), then interleave measured calls, alternating which mode goes
    first; compare the tokens of the first and the last pair. ``run_graph`` ``None``: eager alone."""
    if run_graph is None:
        run_eager()
        ms = [C.timed(run_eager)[1] for _ in range(max(1, repeats))]
        return {"eager_ms": ms, "graph_ms": [], "first_eager_ms": ms[0], "first_graph_ms": None,
                "tokens_identical": 0, "tokens_total": 0}
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


def _runners(path: str, m_eager: Any, m_graph: Any, args: argparse.Namespace, dtype: Any, pad: int) -> tuple:
    """(eager, graph) engines or rollouts of ``path``; transformers' path: (its model, None)."""
    T, N = args.prompt_len, args.new_tokens
    if path == "engine":
        big = max(args.batch_sizes)
        return (make_engine(m_eager, graphs=False, max_out_tokens=T + N, batch_size=big, dtype=dtype),
                make_engine(m_graph, graphs=True, max_out_tokens=T + N, batch_size=big, dtype=dtype))
    if path == "rollout":
        eos = unreachable_eos(m_eager)
        return (make_rollout(m_eager, graphs=False, pad_token_id=pad, eos_token_id=eos),
                make_rollout(m_graph, graphs=True, pad_token_id=pad, eos_token_id=eos))
    return m_eager, None


def _call(path: str, runner: Any, ids: Any, mask: Any, n: int) -> Any:
    if path == "engine":
        return engine_generate(runner, ids, mask, n)
    if path == "rollout":
        return rollout_tokens(rollout_generate(runner, ids, mask, n))
    out = runner.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=int(runner.config.pad_token_id or 0))
    return out[:, ids.shape[1]:]


def _measure_calls(path: str, eager: Any, graph: Any, ids: Any, mask: Any, args: argparse.Namespace
                   ) -> dict[str, Any]:
    """:func:`_measure` of ``path``'s calls; ``--per-step``: the same at one new token, subtracted."""
    def runs(n: int) -> tuple:
        return (lambda: _call(path, eager, ids, mask, n),
                None if graph is None else lambda: _call(path, graph, ids, mask, n))

    m = _measure(*runs(args.new_tokens), args.repeats)
    if args.per_step:
        one = _measure(*runs(1), args.repeats)
        for k in ("eager_ms", "graph_ms"):
            m[k] = [max(a - b, 1e-9) for a, b in zip(m[k], one[k])]
    return m


def run(args: argparse.Namespace) -> dict[str, Any]:
    acc, device, dtype, env = C.prepare(args)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = set(paths) - {"engine", "rollout", "transformers"}
    if bad or not paths:
        raise UsageError(f"--paths takes engine, rollout and/or transformers, got {args.paths!r}")
    T, N = args.prompt_len, args.new_tokens
    if args.per_step and N < 2:
        raise UsageError(f"--per-step needs --new-tokens of at least 2, got {N}")
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for path in paths:
        m_eager = C.build_bench_model(args, dtype, device, seed=args.seed)
        m_graph = None if path == "transformers" else C.build_bench_model(args, dtype, device, seed=args.seed)
        pad, _ = C.special_ids(m_eager)
        vocab = int(m_eager.config.vocab_size)
        eager, graph = _runners(path, m_eager, m_graph, args, dtype, pad)
        for b in args.batch_sizes:
            ids, mask = C.random_prompts(b, T, vocab, seed=args.seed + b, device=device, avoid=(pad,))
            m = _measure_calls(path, eager, graph, ids, mask, args)
            e_ms, g_ms = C.median(m["eager_ms"]), C.median(m["graph_ms"]) if m["graph_ms"] else None
            steps = N - 1 if args.per_step else N
            row = {
                "path": path, "batch": b,
                "eager_ms_per_step": e_ms / steps, "graph_ms_per_step": None if g_ms is None else g_ms / steps,
                "eager_tok_s": b * steps / (e_ms / 1e3), "graph_tok_s": None if g_ms is None else b * steps / (g_ms / 1e3),
                "speedup": None if g_ms is None else C.speedup(e_ms, g_ms),
                **m,
                "graph": None if graph is None else graph_counts(graph),
            }
            rows.append(row)
            graph_text = "" if g_ms is None else (f", graph {row['graph_ms_per_step']:.2f} ms/step, "
                                                  f"x{row['speedup']:.2f}, agree {m['tokens_identical']}/"
                                                  f"{m['tokens_total']}")
            print(f"  {path:12s} batch {b:3d}: eager {row['eager_ms_per_step']:.2f} ms/step{graph_text}", flush=True)
        problem = None if graph is None else C.graph_side_problem(f"{path} path", graph_counts(graph))
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
                     "batch_sizes": args.batch_sizes, "repeats": args.repeats, "paths": paths, "greedy": True,
                     "per_step": bool(args.per_step)},
        "rows": rows,
        "token_agreement": {"identical": identical, "total": total},
        "graph_side_problems": problems,
    }
    headers = ["path", "batch", "eager ms/step", "graph ms/step", "eager tok/s", "graph tok/s", "speedup", "agree"]
    table = C.format_table(headers, [
        [r["path"], r["batch"], r["eager_ms_per_step"], r["graph_ms_per_step"] or "-", f"{r['eager_tok_s']:.0f}",
         "-" if r["graph_tok_s"] is None else f"{r['graph_tok_s']:.0f}",
         "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
         f"{r['tokens_identical']}/{r['tokens_total']}" if r["tokens_total"] else "-"]
        for r in rows
    ])
    basis = "decode steps alone (prefill left out)" if args.per_step else "prefill amortised over the steps"
    text = (f"\nbench decode: {C.model_label(args)} {C.dtype_name(dtype)}, {T}-token prompt, {N} new tokens, greedy; "
            f"ms/step: {basis}\n"
            f"{C.environment_lines(env)}\n\n{table}\n\ntoken agreement (graph vs eager): {identical}/{total}")

    def draw(plt: Any) -> None:
        for path in paths:
            rs = [r for r in rows if r["path"] == path]
            plt.plot([r["batch"] for r in rs], [r["eager_tok_s"] for r in rs], "o--", label=f"{path} eager")
            if path == "transformers":
                continue
            plt.plot([r["batch"] for r in rs], [r["graph_tok_s"] for r in rs], "o-", label=f"{path} graph")
        plt.xscale("log", base=2)
        plt.xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
        plt.xlabel("batch size")
        plt.ylabel("tokens / s")
        plt.legend()

    C.finish(args, payload, text, draw, f"decode throughput: {C.model_label(args)} {C.dtype_name(dtype)}")
    return payload
