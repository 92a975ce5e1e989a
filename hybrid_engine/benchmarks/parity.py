"""``hybrid-engine bench parity``: graph vs eager tokens, engine and rollout paths, greedy and sampled.

For every model in ``--models``, two copies with the same seeded weights run
the same left-padded prompts, one eagerly and one with graph capture, on the
process accelerator (CUDA on a GPU machine; the CPU graph emulation otherwise):

* engine path: ``engine.generate`` with a pinned length, greedy, then sampled
  (``torch.manual_seed`` before each call fixes the engine's per-call seed);
* rollout path: ``HybridEngineRollout.generate``, greedy, then sampled
  (``SamplingConfig.seed``), two calls each so the second one replays.

Every graph token must equal its eager twin and the graph side must have
replayed; the command exits with status 1 otherwise. No timing is reported.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.paths import (
    engine_generate,
    graph_counts,
    make_engine,
    make_rollout,
    rollout_generate,
    rollout_tokens,
)

DEFAULT_MODELS = "tiny-gpt2,tiny-opt,tiny-llama,tiny-qwen2,tiny-qwen3,tiny-mistral"


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model="tiny-gpt2", plot=False)  # its result is pass or fail: nothing to draw
    p.set_defaults(model=None)  # --model checks that one model, as --models with one name
    p.add_argument("--models", default=None,
                   help=f"comma-separated model names (default {DEFAULT_MODELS}, or --model's one); "
                        "--model-path overrides")
    p.add_argument("--batch-size", type=int, default=4, help="prompts (default 4)")
    p.add_argument("--prompt-len", type=int, default=16, help="longest prompt; shorter ones are left-padded (default 16)")
    p.add_argument("--new-tokens", type=int, default=24, help="new tokens (default 24)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampled-check temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=0.9, help="sampled-check top-p (default 0.9)")


def _engine_pair(args, model_args, dtype, device, ids, mask, sampled: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    outs = []
    graph_engine = None
    for graphs in (False, True):
        model = C.build_bench_model(model_args, dtype, device, seed=args.seed)
        engine = make_engine(model, graphs=graphs, max_out_tokens=ids.shape[1] + args.new_tokens,
                             batch_size=ids.shape[0], dtype=dtype)
        calls = []
        for call in range(2):  # the second graph call replays
            if sampled:
                torch.manual_seed(args.seed + call)
                engine.eval()
                out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                      min_new_tokens=args.new_tokens, do_sample=True,
                                      temperature=args.temperature, top_p=args.top_p)[:, ids.shape[1]:]
            else:
                out = engine_generate(engine, ids, mask, args.new_tokens)
            calls.append(out.cpu())
        outs.append(torch.cat(calls))
        if graphs:
            graph_engine = graph_counts(engine)
        del engine, model
    return outs[0], outs[1], graph_engine


def _rollout_pair(args, model_args, dtype, device, ids, mask, sampled: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    outs = []
    replays = 0
    captures = 0
    for graphs in (False, True):
        model = C.build_bench_model(model_args, dtype, device, seed=args.seed)
        pad, eos = C.special_ids(model)
        rollout = make_rollout(model, graphs=graphs, pad_token_id=pad, eos_token_id=eos)
        calls = []
        for call in range(2):
            batch = rollout_generate(rollout, ids, mask, args.new_tokens,
                                     temperature=args.temperature if sampled else 0.0,
                                     top_p=args.top_p if sampled else 1.0, seed=args.seed + call)
            calls.append(rollout_tokens(batch).cpu())
            if graphs:
                replays += int(rollout.last_stats.get("graph_replays") or 0)
                captures += int(rollout.last_stats.get("graph_captures") or 0)
        width = max(c.shape[1] for c in calls)
        outs.append(torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad) for c in calls]))
        del rollout, model
    return outs[0], outs[1], {"captures": captures, "replays": replays}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.models is None:
        args.models = args.model or DEFAULT_MODELS
    args.model = args.model or args.models.split(",")[0].strip() or None  # what the thread choice reads
    acc, device, dtype, env = C.prepare(args)
    names = [args.model_path] if args.model_path else [m.strip() for m in args.models.split(",") if m.strip()]
    rows = []
    for name in names:
        model_args = argparse.Namespace(model=name, model_path=args.model_path)
        probe = C.build_bench_model(model_args, dtype, torch.device("cpu"), seed=args.seed)
        pad, _ = C.special_ids(probe)
        vocab = int(probe.config.vocab_size)
        del probe
        ids, mask = C.random_prompts(args.batch_size, args.prompt_len, vocab, seed=args.seed + 5, device=device,
                                     avoid=(pad,), min_length=max(1, args.prompt_len // 2))
        for path, pair in (("engine", _engine_pair), ("rollout", _rollout_pair)):
            for sampled in (False, True):
                eager, graph, counts = pair(args, model_args, dtype, device, ids, mask, sampled)
                same, total = C.agreement(eager, graph)
                replayed = bool(counts and (counts.get("replays") or 0) > 0)
                rows.append({"model": name, "path": path, "mode": "sampled" if sampled else "greedy",
                             "identical": same, "total": total, "graph": counts, "replayed": replayed,
                             "ok": same == total and total > 0 and replayed})
                print(f"  {name:12s} {path:7s} {rows[-1]['mode']:7s} {same}/{total} identical, "
                      f"replays {counts.get('replays') if counts else None}", flush=True)
                gc.collect()
                acc.empty_cache()
    identical = sum(r["identical"] for r in rows)
    total = sum(r["total"] for r in rows)
    ok = bool(rows) and all(r["ok"] for r in rows)
    why = [f"{r['model']}/{r['path']}/{r['mode']}: {r['total'] - r['identical']} of {r['total']} tokens differ"
           for r in rows if r["identical"] != r["total"]]
    why += [problem for r in rows if not r["replayed"]
            and (problem := C.graph_side_problem(f"{r['model']}/{r['path']}/{r['mode']}", r["graph"] or {}))]
    payload = {"benchmark": "parity", "environment": env,
               "settings": {"models": names, "dtype": C.dtype_name(dtype), "batch_size": args.batch_size,
                            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                            "temperature": args.temperature, "top_p": args.top_p},
               "rows": rows, "token_agreement": {"identical": identical, "total": total}, "ok": ok,
               "failures": why}
    table = C.format_table(["model", "path", "mode", "identical", "graph replays", "ok"], [
        [r["model"], r["path"], r["mode"], f"{r['identical']}/{r['total']}",
         (r["graph"] or {}).get("replays"), "yes" if r["ok"] else "NO"] for r in rows
    ])
    text = (f"\nbench parity: graph vs eager tokens, {C.dtype_name(dtype)}, batch {args.batch_size}, prompts up to "
            f"{args.prompt_len} tokens (left-padded), {args.new_tokens} new tokens\n{C.environment_lines(env)}\n\n"
            f"{table}\n\ntoken agreement: {identical}/{total} -> {'PASS' if ok else 'FAIL'}"
            + "".join(f"\n  {line}" for line in why))
    C.finish(args, payload, text, None, "parity")
    if not ok:
        raise SystemExit(1)
    return payload
