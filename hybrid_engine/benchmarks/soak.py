"""``hybrid-engine bench soak``: a long RL run with graphs on, watching memory and captures over time.

Each iteration is the demo's GRPO step: sample ``--samples`` responses for
``--batch-size`` fresh prompts of random lengths (a real EOS id, so lengths
vary and rows finish early), score them, and take one clipped-objective
optimizer step on the engine that generated them. Over a long run this is
where a leak would show: captured graphs that keep accumulating (new keys,
recaptures), buffers that are never freed, host memory that creeps up.

At ``--checkpoints`` points it records resident host memory (and accelerator
memory where the backend has counters), the graphs held and captured so far
(decode steps and admission rounds), and the time per iteration. After the
warm-up (``--warmup-fraction`` of the run) captures and memory must stay flat:
the report says whether they did, with the growth measured. At the end a
rollout without graphs samples the same prompts from the same weights, and
the tokens must agree with the graph rollout's, greedy and sampled.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.options import UsageError

DEFAULT_MODEL = "tiny-gpt2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL)
    p.add_argument("--iterations", type=int, default=200, help="RL iterations (default 200)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per iteration (default 8)")
    p.add_argument("--samples", type=int, default=4, help="responses per prompt (default 4)")
    p.add_argument("--new-tokens", type=int, default=16, help="response budget (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--checkpoints", type=int, default=20, help="measurement points over the run (default 20)")
    p.add_argument("--warmup-fraction", type=float, default=0.1,
                   help="share of the run before which captures and memory may still grow (default 0.1)")
    p.add_argument("--max-rss-growth-mb", type=float, default=16.0,
                   help="host memory growth after the warm-up still called flat (default 16 MiB)")


def resident_mb() -> float:
    """Resident host memory of this process now (MiB): /proc where there is one, else the peak."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sample(it: int, rollout: Any, engine: Any, acc: Any, started: float, last: tuple[int, float]) -> dict[str, Any]:
    acc.synchronize()  # the clock below counts finished work only
    s = rollout.graph_stats
    done, t_last = last
    return {
        "iteration": it, "rss_mb": resident_mb(), "device_mb": acc.memory_allocated() / 2**20,
        "decode_graphs": s.graph_keys, "captures": s.captures, "admission_captures": s.admission_captures,
        "replays": s.replays + s.admission_replays, "fallbacks": s.fallbacks,
        "ms_per_iteration": (time.perf_counter() - t_last) * 1e3 / max(1, it - done),
        "elapsed_s": time.perf_counter() - started, "global_steps": engine.global_steps,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig, initialize
    from hybrid_engine.benchmarks.toy_grpo import (
        group_advantages,
        make_prompts,
        policy_loss,
        rewards_of,
        without_dropout,
    )

    if not 0 <= args.warmup_fraction < 1:
        raise UsageError(f"--warmup-fraction must be in [0, 1), got {args.warmup_fraction}")
    acc, device, dtype, env = C.prepare(args)  # --iterations, --checkpoints, --lr, --max-rss-growth-mb too
    model = C.build_bench_model(args, dtype, device, seed=args.seed)
    without_dropout(model)  # RL fine-tuning runs without dropout (the training forward scores the sampler)
    vocab = int(model.config.vocab_size)
    pad, eos = C.special_ids(model)
    engine, *_ = initialize(model=model, config={
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
        **C.precision_config(dtype)})
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=pad,
                                                               eos_token_id=eos))
    target = torch.rand(vocab, generator=torch.Generator().manual_seed(args.seed)) < 0.25  # "good" tokens
    special = {pad, eos}
    every = max(1, args.iterations // args.checkpoints)
    samples: list[dict[str, Any]] = []
    started = time.perf_counter()
    last = (0, started)
    print(f"bench soak: {args.iterations} iterations of {args.batch_size} prompts x {args.samples} samples x "
          f"{args.new_tokens} tokens ...", flush=True)
    for it in range(1, args.iterations + 1):
        ids, mask = make_prompts(args.batch_size, vocab, pad_id=pad, special=special, seed=args.seed * 100_003 + it,
                                 device=device)
        engine.eval()
        batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(
            max_new_tokens=args.new_tokens, temperature=1.0, n_samples_per_prompt=args.samples, seed=it))
        engine.train()
        loss, _ = policy_loss(engine, batch, group_advantages(rewards_of(batch, target), args.samples))
        engine.backward(loss)
        engine.step()
        if it % every == 0 or it == args.iterations:
            samples.append(_sample(it, rollout, engine, acc, started, last))
            last = (it, time.perf_counter())
            p = samples[-1]
            print(f"  iteration {it:6d}: rss {p['rss_mb']:8.1f} MiB, decode graphs {p['decode_graphs']}, "
                  f"captures {p['captures']} + {p['admission_captures']} admission, "
                  f"{p['ms_per_iteration']:.1f} ms/iteration", flush=True)

    # Agreement at the end: same weights, same prompts, with and without graphs.
    engine.eval()
    eager = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=False, pad_token_id=pad,
                                                             eos_token_id=eos))
    ids, mask = make_prompts(args.batch_size, vocab, pad_id=pad, special=special, seed=args.seed + 7, device=device)
    same = total = 0
    for temperature in (0.0, 1.0):
        sc = SamplingConfig(max_new_tokens=args.new_tokens, temperature=temperature,
                            n_samples_per_prompt=args.samples, seed=11)
        a, b = rollout.generate(RolloutRequest(ids, mask), sc), eager.generate(RolloutRequest(ids, mask), sc)
        s_, t_ = C.agreement(a.input_ids, b.input_ids)
        same, total = same + s_, total + t_

    # The first call captures the decode graphs, the second the admission ones (a key is warmed up, then captured).
    warm_at = max(C.WARMUP_CALLS, int(args.iterations * args.warmup_fraction))
    base = next((p for p in samples if p["iteration"] >= warm_at), samples[-1])
    end = samples[-1]
    captures_after = (end["captures"] + end["admission_captures"]) - (base["captures"] + base["admission_captures"])
    rss_growth = end["rss_mb"] - base["rss_mb"]
    device_growth = end["device_mb"] - base["device_mb"]
    flat = captures_after == 0 and rss_growth <= args.max_rss_growth_mb and device_growth <= 1.0
    payload = {
        "benchmark": "soak", "environment": env,
        "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "iterations": args.iterations,
                     "batch_size": args.batch_size, "samples": args.samples, "new_tokens": args.new_tokens,
                     "lr": args.lr, "warmup_iterations": base["iteration"]},
        "samples": samples,
        "after_warmup": {"from_iteration": base["iteration"], "captures": captures_after,
                         "rss_growth_mb": rss_growth, "device_growth_mb": device_growth, "flat": flat},
        "token_agreement": {"identical": same, "total": total},
    }
    table = C.format_table(
        ["iteration", "rss MiB", "device MiB", "decode graphs", "captures", "admission captures", "ms / iteration"],
        [[p["iteration"], f"{p['rss_mb']:.1f}", f"{p['device_mb']:.1f}", p["decode_graphs"], p["captures"],
          p["admission_captures"], f"{p['ms_per_iteration']:.1f}"] for p in samples])
    text = (
        f"\nbench soak: {C.model_label(args)} {C.dtype_name(dtype)}, {args.iterations} iterations of rollout "
        f"({args.batch_size} prompts x {args.samples} samples, up to {args.new_tokens} tokens, sampled, EOS {eos}) "
        f"+ train step, graphs on\n{C.environment_lines(env)}\n\n{table}\n\n"
        f"after the warm-up (from iteration {base['iteration']}): {captures_after} new captures, host memory "
        f"{rss_growth:+.1f} MiB, device memory {device_growth:+.1f} MiB -> {'flat' if flat else 'NOT flat'}\n"
        f"graph vs eager rollout at the end (same weights and prompts, greedy and sampled): {same}/{total} "
        f"tokens identical; {end['elapsed_s']:.1f} s in all"
    )

    def draw(plt: Any) -> None:
        its = [p["iteration"] for p in samples]
        ax = plt.gca()
        ax.plot(its, [p["rss_mb"] for p in samples], "o-", label="host memory (MiB)")
        ax.set_xlabel("iteration")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)  # from zero: flatness is the point, not a few MiB of noise
        ax2 = ax.twinx()
        ax2.step(its, [p["captures"] + p["admission_captures"] for p in samples], "r-", where="post",
                 label="graphs captured")
        ax2.set_ylabel("graphs captured")
        ax2.set_ylim(bottom=0)
        ax.legend(loc="upper left")
        ax2.legend(loc="lower right")

    C.finish(args, payload, text, draw, f"soak: {C.model_label(args)}, {args.iterations} iterations")
    if not flat or same != total:  # the report is out; the run failed what it checks
        raise SystemExit("error: " + ("; ".join(
            ([] if flat else ["captures or memory grew after the warm-up"])
            + ([] if same == total else [f"graph and eager rollouts differ ({same}/{total} tokens identical)"]))))
    return payload
