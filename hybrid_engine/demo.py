"""``hybrid-engine demo``: a small, real RL loop on one engine, with graph-captured rollouts.

What it does, on a laptop CPU in a few seconds:

* model: a tiny GPT-2-shaped causal LM built from a config with seeded random
  weights (``--model`` picks another tiny architecture; ``--model-path`` loads a
  local Hugging Face checkpoint directory); the tokenizer is built locally.
* task: the reward of a response is the fraction of its tokens that are English
  words (alphabetic tokens of two letters or more); at the start the policy
  emits them at chance, about a quarter of the time.
* each iteration: ``eval -> rollout (graphs on) -> reward -> train step``. The
  rollout samples ``--samples`` responses per prompt; advantages are the rewards
  normalised within each prompt's group (GRPO); the loss is the clipped
  PPO/GRPO objective with the rollout's log-probabilities as the old ones and
  the new ones from a training forward (``sampling.logprobs_of``).
* at the end: the reward curve, graph-vs-eager token agreement on a fixed
  prompt set, the capture count and cost, and an eager-vs-graph speedup table
  measured side by side in this run.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from hybrid_engine.benchmarks.options import DEMO_PROMPT_LEN
from hybrid_engine.benchmarks.toy_grpo import (
    build_model_and_tokenizer,
    group_advantages,
    make_prompts,
    policy_loss,
    rewards_of,
    word_token_ids,
)

__all__ = ["DEMO_MODELS", "add_arguments", "check_arguments", "run"]


DEMO_MODELS = ("gpt2", "opt", "llama", "qwen2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=DEMO_MODELS, default="gpt2", help="tiny architecture to build (default gpt2)")
    p.add_argument("--model-path", default=None, help="load a local Hugging Face checkpoint directory instead")
    p.add_argument("--iterations", type=int, default=40, help="RL iterations (default 40)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per iteration (default 8)")
    p.add_argument("--samples", type=int, default=4, help="responses sampled per prompt, the GRPO group (default 4)")
    p.add_argument("--new-tokens", type=int, default=16, help="response budget in tokens (default 16)")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default 5e-3)")
    p.add_argument("--no-graphs", action="store_true", help="run every rollout eagerly (no graph capture)")
    p.add_argument("--sleep-between-phases", action="store_true",
                   help="the memory hand-off: K/V pools asleep during training, the optimizer during rollouts, "
                        "graphs kept (hybrid_engine.sleep_between_phases; docs/memory-handoff.md)")
    p.add_argument("--device", default=None, help="accelerator: cuda, npu, xpu, mps or cpu (default: auto-detect)")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed (default 0)")
    p.add_argument("--check-prompts", type=int, default=8, help="prompts in the final agreement check (default 8)")
    p.add_argument("--check-tokens", type=int, default=128, help="tokens per prompt in that check (default 128)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 on CPU for models under 20M parameters, where more "
                        "threads only add overhead; torch's default otherwise)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON to PATH")


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _ms(t0: float) -> float:
    from hybrid_engine.accelerator import get_accelerator

    get_accelerator().synchronize()
    return (time.perf_counter() - t0) * 1e3


def check_arguments(args: argparse.Namespace) -> None:
    """Every option checked before any work: a bad one is a one-line ``error:`` (exit status 2), no traceback.

    ``--device`` is checked by :func:`~hybrid_engine.benchmarks.common.select_device`.
    """
    from hybrid_engine.benchmarks.common import check_output_path
    from hybrid_engine.benchmarks.options import (
        UsageError,
        check_finite_nonnegative,
        check_generation_length,
        check_rows,
        check_seed,
        model_label_and_config,
    )

    for option, value in (("--iterations", args.iterations), ("--batch-size", args.batch_size),
                          ("--samples", args.samples), ("--new-tokens", args.new_tokens),
                          ("--check-prompts", args.check_prompts), ("--check-tokens", args.check_tokens)):
        if value < 1:
            raise UsageError(f"{option} must be >= 1, got {value}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}; leave it out for the default")
    check_seed(args.seed)
    check_rows(args.batch_size, "--batch-size", args.samples)  # the rollout's rows and the training batch
    check_rows(args.check_prompts, "--check-prompts")
    check_finite_nonnegative("--lr", args.lr)
    check_output_path("--json", args.json)
    label, config = model_label_and_config(args.model_path, f"tiny-{args.model}")
    check_generation_length(config, label, prompt_tokens=DEMO_PROMPT_LEN, new_tokens=args.new_tokens)
    if not args.no_graphs:  # the graph-vs-eager check after training generates --check-tokens
        check_generation_length(config, label, prompt_tokens=DEMO_PROMPT_LEN, new_tokens=args.check_tokens,
                                new_option="--check-tokens")


def run(args: argparse.Namespace) -> int:
    import hybrid_engine
    from hybrid_engine.benchmarks.common import environment, format_table, median, select_device, write_json

    check_arguments(args)
    acc = select_device(args.device)
    if args.samples < 2:
        print("note: --samples 1 gives every group a zero advantage (GRPO needs >= 2 samples per prompt)")
    device = acc.device()
    graphs = not args.no_graphs
    t_start = time.perf_counter()
    model, tokenizer = build_model_and_tokenizer(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu" and n_params < 20_000_000:
        torch.set_num_threads(1)
    vocab = int(model.config.vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad_id
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | {pad_id, eos_id}
    target = word_token_ids(tokenizer, vocab)
    prompt_len = DEMO_PROMPT_LEN
    engine, *_ = hybrid_engine.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": args.batch_size * args.samples,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
        "gradient_clipping": 1.0,
        "hybrid_engine": {"max_out_tokens": prompt_len + max(args.new_tokens, args.check_tokens),
                          "enable_graph_capture": graphs, "sleep_between_phases": args.sleep_between_phases},
    })
    rollout = hybrid_engine.HybridEngineRollout(engine, tokenizer=tokenizer, config=hybrid_engine.RolloutConfig(
        use_graph_capture=graphs, pad_token_id=pad_id, eos_token_id=eos_id))
    label = args.model_path or f"tiny-{args.model}"
    print(f"hybrid-engine demo: {label} ({n_params / 1e6:.2f}M params) on {acc.device_name()}, "
          f"graphs {'on via ' + str(acc.graph_api) if graphs and acc.supports_graph_capture else 'off'}")
    print(f"task: reward = fraction of response tokens that are English words ({int(target.sum())} of {vocab} "
          f"ids); {args.batch_size} prompts x {args.samples} samples x {args.new_tokens} tokens per iteration, "
          f"GRPO advantages, clipped-ratio loss, AdamW lr {args.lr}")

    history: list[dict[str, Any]] = []
    captures = admission_captures = 0
    capture_ms = 0.0  # the rollout's own capture timer, where it reports one
    for it in range(args.iterations):
        ids, mask = make_prompts(args.batch_size, vocab, pad_id=pad_id, special=special, seed=args.seed * 1000 + it,
                                 device=device, max_len=prompt_len)
        t_iter = time.perf_counter()
        engine.eval()
        t0 = time.perf_counter()
        batch = rollout.generate(hybrid_engine.RolloutRequest(ids, mask), hybrid_engine.SamplingConfig(
            max_new_tokens=args.new_tokens, temperature=1.0, n_samples_per_prompt=args.samples,
            seed=args.seed * 1000 + it))
        gen_ms = _ms(t0)
        stats = rollout.last_stats or {}
        captures += int(stats.get("graph_captures") or 0)
        admission_captures += int(stats.get("admission_graph_captures") or 0)
        capture_ms += float(stats.get("capture_ms") or 0.0)
        rewards = rewards_of(batch, target)
        t0 = time.perf_counter()
        engine.train()
        loss, gap = policy_loss(engine, batch, group_advantages(rewards, args.samples))
        engine.backward(loss)
        engine.step()
        train_ms = _ms(t0)
        iter_ms = _ms(t_iter)
        row = {"iteration": it + 1, "reward": float(rewards.mean()), "loss": float(loss.detach()),
               "logprob_gap": gap, "generate_ms": gen_ms, "train_ms": train_ms, "iteration_ms": iter_ms,
               "graph_replays": (rollout.last_stats or {}).get("graph_replays")}
        history.append(row)
        print(f"{_bar(it + 1, args.iterations)} {it + 1:3d}/{args.iterations}  reward {row['reward']:.3f}  "
              f"generate {gen_ms:7.1f} ms  train {train_ms:6.1f} ms  iteration {iter_ms:7.1f} ms", flush=True)

    # ---- reward curve
    k = max(1, min(5, len(history) // 3))
    first = sum(h["reward"] for h in history[:k]) / k
    last = sum(h["reward"] for h in history[-k:]) / k
    print(f"\nmean reward: first {k} iterations {first:.3f} -> last {k} iterations {last:.3f} "
          f"({'rising' if last > first else 'NOT rising'})")
    print(f"max |train-forward - rollout| log-prob: {max(h['logprob_gap'] for h in history):.2e} "
          f"(the rollout's log-probs are the training forward's)")
    gen_steady = median([h["generate_ms"] for h in history[1:]]) if len(history) > 1 else float("nan")

    # ---- graph vs eager on a fixed prompt set, same weights, measured side by side
    refused = rollout.runner.refusal() if graphs else None
    if refused is not None:  # asked for, but this accelerator or model cannot: eager against eager says nothing
        graphs = False
    summary: dict[str, Any] = {
        "model": label, "device": acc.device_name(), "graphs": graphs, "iterations": args.iterations,
        "reward_first": first, "reward_last": last, "history": history,
    }
    if graphs:
        eager_rollout = hybrid_engine.HybridEngineRollout(engine, tokenizer=tokenizer, config=hybrid_engine.RolloutConfig(
            use_graph_capture=False, pad_token_id=pad_id, eos_token_id=vocab + 7))
        check_rollout = hybrid_engine.HybridEngineRollout(engine, tokenizer=tokenizer, config=hybrid_engine.RolloutConfig(
            use_graph_capture=True, pad_token_id=pad_id, eos_token_id=vocab + 7))
        ids, mask = make_prompts(args.check_prompts, vocab, pad_id=pad_id, special=special, seed=999_999,
                                 device=device, max_len=prompt_len)
        req = hybrid_engine.RolloutRequest(ids, mask)
        sc = hybrid_engine.SamplingConfig(max_new_tokens=args.check_tokens, temperature=0.0)
        engine.eval()
        t0 = time.perf_counter()
        check_rollout.generate(req, sc)  # first call: warms up, then captures the decode step
        first_graph_ms = _ms(t0)
        check_rollout.generate(req, sc)  # second call: captures admission (its prefill batch and round)
        check_stats = check_rollout.graph_stats
        check_captures, check_admissions = check_stats.captures, check_stats.admission_captures
        check_capture_ms = check_stats.capture_seconds * 1e3
        eager_ms, graph_ms = [], []
        out_e = out_g = None
        for _ in range(3):
            t0 = time.perf_counter()
            out_e = eager_rollout.generate(req, sc)
            eager_ms.append(_ms(t0))
            t0 = time.perf_counter()
            out_g = check_rollout.generate(req, sc)
            graph_ms.append(_ms(t0))
        resp_e = out_e.input_ids[:, out_e.response_start_idx:].cpu()
        resp_g = out_g.input_ids[:, out_g.response_start_idx:].cpu()
        same, total = int((resp_e == resp_g).sum()), resp_e.numel()
        # sampled as well: the counter-based sampler draws the same numbers in eager and replay
        sc_s = hybrid_engine.SamplingConfig(max_new_tokens=args.check_tokens, temperature=1.0, seed=7)
        s_e = eager_rollout.generate(req, sc_s)
        s_g = check_rollout.generate(req, sc_s)
        same_s = int((s_e.input_ids[:, s_e.response_start_idx:] == s_g.input_ids[:, s_g.response_start_idx:]).sum())
        total_s = s_e.input_ids[:, s_e.response_start_idx:].numel()
        e_med, g_med = median(eager_ms), median(graph_ms)
        print(f"\ngraph vs eager, fixed prompt set ({args.check_prompts} prompts x {args.check_tokens} tokens, "
              f"trained weights): greedy {same}/{total} tokens identical, sampled {same_s}/{total_s} tokens identical")
        print(f"graph captures: {captures} decode step(s) + {admission_captures} admission graph(s) during training, "
              f"{check_captures} + {check_admissions} for the check's batch/sampling shape (one per bucket and "
              f"sampling mode, replayed at every position); "
              f"capture time {capture_ms:.0f} ms + {check_capture_ms:.0f} ms (first training rollout "
              f"{history[0]['generate_ms']:.0f} ms vs {gen_steady:.0f} ms median afterwards; first check call "
              f"{first_graph_ms:.0f} ms vs {g_med:.0f} ms replayed)")
        print("\n" + format_table(["generate (same weights, same prompts)", "eager", "graph", "speedup"], [
            [f"{args.check_prompts} x {args.check_tokens} tokens, greedy (median of 3)", f"{e_med:.1f} ms",
             f"{g_med:.1f} ms", f"{e_med / g_med:.2f}x"],
        ]))
        summary.update({
            "token_agreement": {"identical": same, "total": total},
            "sampled_token_agreement": {"identical": same_s, "total": total_s},
            "captures_training": captures, "captures_check": check_captures,
            "admission_captures_training": admission_captures, "admission_captures_check": check_admissions,
            "capture_ms": capture_ms + check_capture_ms,
            "first_rollout_extra_ms": history[0]["generate_ms"] - gen_steady,
            "first_check_call_ms": first_graph_ms,
            "speedup": {"eager_ms": e_med, "graph_ms": g_med, "speedup": e_med / g_med},
        })
    elif refused is not None:
        print(f"\ngraphs refused ({refused}): every rollout ran eagerly, so there is no graph-vs-eager comparison")
        summary["graph_refusal"] = refused
    else:
        print("\ngraphs off (--no-graphs): no graph-vs-eager comparison")
    sample = batch.input_ids[0, batch.response_start_idx:]
    sample = sample[batch.attention_mask[0, batch.response_start_idx:].bool()]
    print(f"\nlast sampled response: {tokenizer.decode(sample.tolist())!r}")
    if args.sleep_between_phases:
        summary["handoff"] = engine.handoff_stats.to_dict()
        print(f"memory hand-off: {summary['handoff']['kv_cache_wakes']} pool wakes by rollouts, "
              f"{summary['handoff']['optimizer_wakes']} optimizer wakes by training steps")
    total_s = time.perf_counter() - t_start
    summary["total_seconds"] = total_s
    print(f"done in {total_s:.1f} s")
    if args.json:
        summary["environment"] = environment(getattr(args, "argv", None))
        write_json(args.json, summary)
    sys.stdout.flush()
    return 0
