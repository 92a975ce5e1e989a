"""``hybrid-engine bench exact``: the exact mode's cost and what it buys, default vs exact side by side in one run.

For each dtype in ``--dtypes`` and each mode (default kernels, then
``hybrid_engine.exact_logprobs``), one engine with the same seeded weights:

* rollout time: ``HybridEngineRollout.generate`` with graphs (median of
  ``--repeats`` calls after one that captures, the two modes' calls
  interleaved), prompts of mixed lengths and ``--samples`` samples each;
* train-step time: forward over the rollout's training inputs, a GRPO-style
  policy loss, backward and step (median; learning rate 0, so every step sees
  the same weights and the same rollout stays on-policy);
* ``max |rollout - train|``: the largest difference between a response token's
  rollout logprob and the training forward's, before any update (exact: 0);
* across batch compositions (verl#6280's measure): each sequence's training
  forward alone vs inside the whole batch, the largest logprob difference and
  the fraction of tokens whose ratio ``exp(a - b)`` lies outside [0.9, 1.1]
  (the same for rollout vs training forward).

The command exits with status 1 if the exact rows are not exactly 0.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.paths import engine_config, unreachable_eos

MODES = ("default", "exact")


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model="tiny-llama", plot=False)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated dtypes to measure (default fp32,bf16)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default 8)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--prompt-len", type=int, default=24, help="longest prompt, shorter ones left-padded (default 24)")
    p.add_argument("--new-tokens", type=int, default=48, help="new tokens per sample (default 48)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per phase and mode (default 5)")


def _setup(args, dtype: torch.dtype, mode: str, device: torch.device) -> dict[str, Any]:
    """One mode's engine, rollout and request, warmed up: the rollout has captured its graphs."""
    from hybrid_engine import initialize
    from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig

    model = C.build_bench_model(args, dtype, device, seed=args.seed)
    pad, _ = C.special_ids(model)
    config = engine_config(graphs=True, max_out_tokens=args.prompt_len + args.new_tokens,
                           batch_size=args.prompts * args.samples, dtype=dtype, lr=0.0)
    config["hybrid_engine"]["exact_logprobs"] = mode == "exact"
    engine, *_ = initialize(model=model, config=config)
    ids, mask = C.random_prompts(args.prompts, args.prompt_len, int(model.config.vocab_size), seed=args.seed + 5,
                                 device=device, avoid=(pad,), min_length=max(1, args.prompt_len // 3))
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=pad,
                                                               eos_token_id=unreachable_eos(model)))
    run = {"mode": mode, "engine": engine, "rollout": rollout, "request": RolloutRequest(ids, mask),
           "sampling": SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed,
                                      n_samples_per_prompt=args.samples),
           "rollout_ms": [], "train_ms": []}
    engine.eval()
    run["batch"] = rollout.generate(run["request"], run["sampling"])  # captures
    return run


def _logprobs(engine, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    from hybrid_engine import logprobs_of

    logits = engine(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    position_ids=inputs["position_ids"]).logits
    return logprobs_of(logits[:, :-1], inputs["input_ids"][:, 1:], temperature=1.0)


def _train_step(engine, batch, samples: int) -> None:
    from hybrid_engine.benchmarks.toy_grpo import group_advantages, policy_loss

    rewards = (batch.responses % 7 == 0).float().mean(-1)  # any reward that varies within a group
    loss, _ = policy_loss(engine, batch, group_advantages(rewards, samples))
    engine.backward(loss)
    engine.step()


def _outside(a: torch.Tensor, b: torch.Tensor) -> float:
    ratio = torch.exp(a.double() - b.double())
    return float(((ratio < 0.9) | (ratio > 1.1)).double().mean()) if ratio.numel() else 0.0


def _drift(run: dict[str, Any]) -> dict[str, Any]:
    """Rollout vs training forward, and each row's forward alone vs in the batch, before any update."""
    engine, batch = run["engine"], run["batch"]
    inputs = batch.training_inputs()
    start = batch.response_start_idx
    real = batch.response_mask[:, start:]
    engine.eval()
    with torch.no_grad():
        together = _logprobs(engine, inputs)[:, start - 1:]
        alone = torch.cat([_logprobs(engine, {k: v[i:i + 1] for k, v in inputs.items()})[:, start - 1:]
                           for i in range(inputs["input_ids"].shape[0])])
    rollout_lp = batch.response_logprobs
    return {"tokens": int(real.sum()),
            "max_rollout_vs_train": float((rollout_lp - together)[real].abs().max()),
            "rollout_vs_train_outside": _outside(rollout_lp[real], together[real]),
            "max_batch1_vs_batch": float((alone - together)[real].abs().max()),
            "batch1_vs_batch_outside": _outside(alone[real], together[real])}


def _timed(args, runs: list[dict[str, Any]]) -> None:
    """The modes' calls interleaved (default, exact, default, ...), so drift in the machine hits both alike."""
    for _ in range(args.repeats):
        for run in runs:
            run["engine"].eval()
            with C.timer(run["rollout_ms"]):
                run["batch"] = run["rollout"].generate(run["request"], run["sampling"])
    for run in runs:
        run["engine"].train()
        _train_step(run["engine"], run["batch"], args.samples)  # warm-up
    for _ in range(args.repeats):
        for run in runs:
            with C.timer(run["train_ms"]):
                _train_step(run["engine"], run["batch"], args.samples)


def _measure(args, dtype: torch.dtype, device: torch.device) -> list[dict[str, Any]]:
    runs = [_setup(args, dtype, mode, device) for mode in MODES]
    rows = [{"dtype": C.dtype_name(dtype), "mode": run["mode"], **_drift(run)} for run in runs]
    _timed(args, runs)
    for row, run in zip(rows, runs):
        rollout = run["rollout"]
        row.update(rollout_s=C.median(run["rollout_ms"]) / 1e3, train_step_s=C.median(run["train_ms"]) / 1e3,
                   graph_problem=C.graph_side_problem(f"{row['dtype']} {row['mode']} rollout", {
                       "replays": rollout.last_stats.get("graph_replays"), "fallbacks": rollout.graph_stats.fallbacks,
                       "refusal": rollout.graph_stats.last_refusal_reason}))
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    acc, device, _, env = C.prepare(args)
    dtypes = [C.parse_dtype(d.strip(), device.type) for d in args.dtypes.split(",") if d.strip()]
    rows = []
    for dtype in dtypes:
        for r in _measure(args, dtype, device):
            rows.append(r)
            print(f"  {r['dtype']:5s} {r['mode']:7s} rollout {r['rollout_s'] * 1e3:8.1f} ms  train step "
                  f"{r['train_step_s'] * 1e3:7.1f} ms  max|rollout-train| {r['max_rollout_vs_train']:.2e}",
                  flush=True)
    cost = {}
    for dtype in {r["dtype"] for r in rows}:
        d, e = (next(r for r in rows if r["dtype"] == dtype and r["mode"] == m) for m in MODES)
        cost[dtype] = {"rollout": e["rollout_s"] / d["rollout_s"], "train_step": e["train_step_s"] / d["train_step_s"]}
    failures = [f"{r['dtype']} exact: max |rollout - train| {r['max_rollout_vs_train']:.3g}, batch 1 vs batch "
                f"{r['max_batch1_vs_batch']:.3g}" for r in rows
                if r["mode"] == "exact" and (r["max_rollout_vs_train"] or r["max_batch1_vs_batch"])]
    problems = [r["graph_problem"] for r in rows if r["graph_problem"]]
    table = C.format_table(
        ["dtype", "mode", "rollout ms", "train step ms", "max |rollout-train|", "outside [0.9,1.1]",
         "max |batch1-batch|", "outside [0.9,1.1]"],
        [[r["dtype"], r["mode"], C.fmt(r["rollout_s"] * 1e3, 1), C.fmt(r["train_step_s"] * 1e3, 1),
          f"{r['max_rollout_vs_train']:.2e}", f"{r['rollout_vs_train_outside']:.2%}",
          f"{r['max_batch1_vs_batch']:.2e}", f"{r['batch1_vs_batch_outside']:.2%}"] for r in rows])
    cost_lines = "\n".join(f"  {dtype}: rollout {c['rollout']:.2f}x, train step {c['train_step']:.2f}x"
                           for dtype, c in cost.items())
    text = (f"\nbench exact: default vs exact_logprobs, {C.model_label(args)}, {args.prompts} prompts x "
            f"{args.samples} samples, prompts up to {args.prompt_len} tokens, {args.new_tokens} new tokens, "
            f"graphs on\n{C.environment_lines(env)}\n\n{table}\n\nexact mode's cost (exact / default):\n{cost_lines}"
            + ("\n\nFAIL: " + "; ".join(failures) if failures else "\n\nexact rows: 0 difference -> PASS"))
    payload = {"benchmark": "exact", "environment": env,
               "settings": {"model": C.model_label(args), "dtypes": [C.dtype_name(d) for d in dtypes],
                            "prompts": args.prompts, "samples": args.samples, "prompt_len": args.prompt_len,
                            "new_tokens": args.new_tokens, "repeats": args.repeats},
               "rows": rows, "cost": cost, "ok": not failures, "failures": failures,
               "graph_side_problems": problems}
    C.finish(args, payload, text, None, "exact")
    acc.empty_cache()
    if failures:
        raise SystemExit(1)
    return payload
