"""``hybrid-engine bench multiturn``: tool-use episodes with K/V kept between turns vs re-prefilled, side by side.

The task, a calculator tool that triggers on a token: ``--prompts`` prompts x
``--samples`` samples are episodes of ``--turns`` model turns of up to
``--new-tokens`` tokens. A turn ends at the call token (a stop sequence; the
token the model samples most often, found once) or at its budget. Then the
environment appends the tool's answer (the sum of the two tokens before the
call, as digit tokens) or, where the model did not call, a fixed user turn.
Three paths on the same seeded weights, their runs interleaved:

* ``reuse``: :meth:`HybridEngineRollout.open_episodes`, graphs on: each turn
  prefills only the tokens after the K/V its row kept;
* ``re-prefill``: the same with ``reuse_kv=False``: every turn prefills its
  rows' whole histories (same tokens: the command exits 1 if they differ);
* ``transformers``: transformers' ``generate`` per turn on the left-padded
  histories, what TRL's own multi-turn path runs without vLLM (its tool loop
  generates each later turn on the whole history).

Reported per path: the median wall time of ``--repeats`` runs of every episode,
the prompt tokens prefilled (real tokens, over all turns), the tokens
generated and the tool calls.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.paths import unreachable_eos

PATHS = ("reuse", "re-prefill", "transformers")
DIGIT0 = 10  # digit d of the tool's answer is token DIGIT0 + d
USER_TURN = [20, 21, 22, 23]  # what the environment says when the model did not call the tool


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model="tiny-llama", plot=False)
    p.add_argument("--prompts", type=int, default=16, help="prompts (default 16)")
    p.add_argument("--samples", type=int, default=4, help="episodes per prompt (default 4: 64 episodes)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt, shorter ones left-padded (default 32)")
    p.add_argument("--turns", type=int, default=3, help="model turns per episode (default 3)")
    p.add_argument("--new-tokens", type=int, default=24, help="most tokens per model turn (default 24)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (default 3)")


def _environment(turn_tokens: list[int], call: int) -> tuple[list[int], bool]:
    """The environment's tokens after a model turn, and whether the tool was called."""
    if turn_tokens and turn_tokens[-1] == call:
        a, b = ([0, 0] + turn_tokens[:-1])[-2:]
        return [DIGIT0 + int(d) for d in str(a + b)], True
    return list(USER_TURN), False


def _ours(rollout, request, args, call: int, reuse: bool) -> dict[str, Any]:
    from hybrid_engine.rollout import SamplingConfig

    episodes = rollout.open_episodes(request, n_samples_per_prompt=args.samples, reuse_kv=reuse)
    prefill = calls = generated = 0
    for t in range(args.turns):
        sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed + t,
                                  stop_token_ids=[[call]])
        episodes.turn(sampling)
        prefill += rollout.last_stats["prefill_tokens"]
        generated += rollout.last_stats["tokens_generated"]
        for r in range(episodes.num_rows):
            env, called = _environment(episodes.last_turn(r), call)
            calls += called
            episodes.append(r, env)
    batch = episodes.close()
    return {"batch": batch, "prefill_tokens": prefill, "generated": generated, "tool_calls": calls}


def _transformers(model, ids: torch.Tensor, mask: torch.Tensor, args, call: int, pad: int) -> dict[str, Any]:
    """Each turn: transformers' ``generate`` on the left-padded histories (as TRL's tool loop does)."""
    histories = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0]) for _ in range(args.samples)]
    prefill = calls = generated = 0
    for t in range(args.turns):
        width = max(len(h) for h in histories)
        x = torch.full((len(histories), width), pad, dtype=torch.int64)
        m = torch.zeros_like(x)
        for i, h in enumerate(histories):
            x[i, width - len(h):] = torch.tensor(h)
            m[i, width - len(h):] = 1
        prefill += sum(len(h) for h in histories)
        torch.manual_seed(args.seed + t)
        with torch.no_grad():
            out = model.generate(input_ids=x.to(model.device), attention_mask=m.to(model.device), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                                 eos_token_id=call, pad_token_id=pad)
        for i, row in enumerate(out[:, width:].tolist()):
            turn_tokens = row[: row.index(call) + 1] if call in row else row
            generated += len(turn_tokens)
            env, called = _environment(turn_tokens, call)
            calls += called
            histories[i] = histories[i] + turn_tokens + env
    return {"prefill_tokens": prefill, "generated": generated, "tool_calls": calls}


def _call_token(rollout, request, args) -> int:
    """The token the model samples most often on these prompts: the tool's trigger, so that it gets called."""
    from hybrid_engine.rollout import SamplingConfig

    batch = rollout.generate(request, SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0,
                                                     seed=args.seed, n_samples_per_prompt=args.samples))
    counts = Counter(t for row, n in zip(batch.responses.tolist(), batch.response_lengths.tolist())
                     for t in row[:n] if t >= DIGIT0 + 10 and t not in USER_TURN)
    return counts.most_common(1)[0][0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest

    acc, device, dtype, env = C.prepare(args)
    model = C.build_bench_model(args, dtype, device, seed=args.seed)
    model.eval()
    pad, _ = C.special_ids(model)
    ids, mask = C.random_prompts(args.prompts, args.prompt_len, int(model.config.vocab_size), seed=args.seed + 5,
                                 device=device, avoid=(pad,), min_length=max(1, args.prompt_len // 2))
    request = RolloutRequest(ids, mask)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=pad,
                                                              eos_token_id=unreachable_eos(model)))
    call = _call_token(rollout, request, args)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    def once(path: str) -> dict[str, Any]:
        if path == "transformers":
            return _transformers(model, ids, mask, args, call, pad)
        return _ours(rollout, request, args, call, path == "reuse")

    for path in PATHS:  # warm-up: every graph the timed runs replay is captured here
        once(path)
    for _ in range(args.repeats):
        for path in PATHS:
            with C.timer(times[path]):
                runs[path].append(once(path))
    reuse, again = runs["reuse"][-1]["batch"], runs["re-prefill"][-1]["batch"]
    same = bool(torch.equal(reuse.completion_ids, again.completion_ids))
    rows = [{"path": p, "wall_s": C.median(times[p]) / 1e3, "prefill_tokens": runs[p][-1]["prefill_tokens"],
             "tokens_generated": runs[p][-1]["generated"], "tool_calls": runs[p][-1]["tool_calls"]} for p in PATHS]
    by = {r["path"]: r for r in rows}
    ratios = {"prefill_tokens_reprefill_over_reuse": by["re-prefill"]["prefill_tokens"] / by["reuse"]["prefill_tokens"],
              "wall_reprefill_over_reuse": by["re-prefill"]["wall_s"] / by["reuse"]["wall_s"],
              "wall_transformers_over_reuse": by["transformers"]["wall_s"] / by["reuse"]["wall_s"]}
    problem = C.graph_side_problem("reuse", {"replays": rollout.last_stats.get("graph_replays"),
                                             "fallbacks": rollout.graph_stats.fallbacks,
                                             "refusal": rollout.graph_stats.last_refusal_reason})
    table = C.format_table(["path", "wall s", "prefill tokens", "tokens generated", "tool calls"],
                           [[r["path"], C.fmt(r["wall_s"], 3), r["prefill_tokens"], r["tokens_generated"],
                             r["tool_calls"]] for r in rows])
    text = (f"\nbench multiturn: {args.prompts * args.samples} episodes x {args.turns} turns of up to "
            f"{args.new_tokens} tokens, {C.model_label(args)}, prompts up to {args.prompt_len} tokens, tool "
            f"trigger token {call}\n{C.environment_lines(env)}\n\n{table}\n\n"
            f"re-prefill / reuse: prefill tokens {ratios['prefill_tokens_reprefill_over_reuse']:.2f}x, wall "
            f"{ratios['wall_reprefill_over_reuse']:.2f}x; transformers / reuse: wall "
            f"{ratios['wall_transformers_over_reuse']:.2f}x\nreuse and re-prefill tokens identical: {same}")
    payload = {"benchmark": "multiturn", "environment": env,
               "settings": {"model": C.model_label(args), "prompts": args.prompts, "samples": args.samples,
                            "prompt_len": args.prompt_len, "turns": args.turns, "new_tokens": args.new_tokens,
                            "repeats": args.repeats, "call_token": call},
               "rows": rows, "ratios": ratios, "same_tokens": same, "ok": same,
               "graph_side_problems": [problem] if problem else []}
    C.finish(args, payload, text, None, "multiturn")
    acc.empty_cache()
    if not same:
        raise SystemExit(1)
    return payload
