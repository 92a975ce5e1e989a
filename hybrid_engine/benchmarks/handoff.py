"""``hybrid-engine bench handoff``: the memory hand-off between rollouts and training, measured (issue 41).

The same RL loop (the demo's GRPO step: rollout with graphs, score, one optimizer step) runs twice on the same
seeded model, without and with ``hybrid_engine.sleep_between_phases``. Per phase it reports the process
memory: RssAnon from ``/proc/self/status`` on the CPU (resident anonymous memory, what ``MADV_DONTNEED``
returns), ``mem_get_info``'s used bytes on an accelerator (what the device really holds, not the caching
allocator's ``memory_allocated``). It also reports the time of each sleep and wake, captures (the same in both
runs: wake keeps every graph), and whether the tokens and losses of the two runs are identical. The K/V pool
is sized by ``--kv-cache-mb`` so the hand-off has something to return.

Exit status 1 when tokens or losses differ, or the hand-off captured more where the pool keeps its addresses
(the CPU; on accelerators without a VMM allocator yet the pool is dropped on sleep and the graphs recaptured).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.decode import kv_storage

DEFAULT_MODEL = "tiny-llama"


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL, plot=False)
    p.add_argument("--iterations", type=int, default=4, help="RL iterations per run (default 4)")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per iteration (default 4)")
    p.add_argument("--samples", type=int, default=2, help="responses per prompt (default 2)")
    p.add_argument("--new-tokens", type=int, default=8, help="response budget (default 8)")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="the K/V pool's budget in MiB (default 256)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")


def memory_bytes(acc: Any, device: torch.device) -> int:
    """Memory the process holds now: RssAnon on the CPU, the device's used bytes elsewhere."""
    if device.type == "cpu":
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0
    info = getattr(getattr(torch, device.type, None), "mem_get_info", None)
    if info is None:
        return acc.memory_reserved()
    free, total = info(device)
    return int(total - free)


def _run_loop(args: argparse.Namespace, acc: Any, device: torch.device, dtype: torch.dtype,
              phases: bool) -> dict[str, Any]:
    from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig, initialize
    from hybrid_engine.benchmarks.toy_grpo import (
        group_advantages,
        make_prompts,
        policy_loss,
        rewards_of,
        without_dropout,
    )

    model = C.build_bench_model(args, dtype, device, seed=args.seed)
    without_dropout(model)
    vocab = int(model.config.vocab_size)
    pad, eos = C.special_ids(model)
    engine, *_ = initialize(model=model, config={
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}}, **C.precision_config(dtype),
        "hybrid_engine": {"enable_graph_capture": True, "sleep_between_phases": phases}})
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=pad,
                                                               eos_token_id=eos,
                                                               kv_cache_bytes=args.kv_cache_mb << 20))
    target = torch.rand(vocab, generator=torch.Generator().manual_seed(args.seed)) < 0.25
    tokens, losses, rows = [], [], []
    for it in range(1, args.iterations + 1):
        ids, mask = make_prompts(args.batch_size, vocab, pad_id=pad, special={pad, eos}, seed=args.seed * 7 + it,
                                 device=device)
        engine.eval()
        acc.synchronize()
        before = memory_bytes(acc, device)
        t0 = time.perf_counter()
        batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(
            max_new_tokens=args.new_tokens, temperature=1.0, n_samples_per_prompt=args.samples, seed=it))
        rollout_s = time.perf_counter() - t0
        stats = dict(rollout.last_stats)
        acc.synchronize()
        training_mem = memory_bytes(acc, device)  # after the call: in phase mode the pool sleeps now
        engine.train()
        loss, _ = policy_loss(engine, batch, group_advantages(rewards_of(batch, target), args.samples))
        engine.backward(loss)
        engine.step()
        acc.synchronize()
        tokens.append(batch.input_ids.cpu())
        losses.append(loss.detach().float().cpu())
        rows.append({"iteration": it, "before_rollout": before, "during_training": training_mem,
                     "after_step": memory_bytes(acc, device), "rollout_s": rollout_s,
                     "captures": stats["graph_captures"]
                     + stats["admission_graph_captures"], "wakes": stats["wakes"]})
    handoff = engine.handoff_stats
    # One explicit sleep and wake of everything, timed.
    t0 = time.perf_counter()
    engine.sleep(["kv_cache", "graphs", "optimizer"])
    sleep_s = time.perf_counter() - t0
    asleep_mem = memory_bytes(acc, device)
    t0 = time.perf_counter()
    engine.wake()
    wake_s = time.perf_counter() - t0
    return {"phases": phases, "iterations": rows, "tokens": tokens, "losses": losses,
            "captures": rollout.graph_stats.captures + rollout.graph_stats.admission_captures,
            "kv_pool_bytes": rollout.graph_stats.cache_memory_bytes, "handoff": handoff.to_dict(),
            "explicit_sleep_s": sleep_s, "explicit_wake_s": wake_s, "asleep_bytes": asleep_mem,
            "awake_bytes": memory_bytes(acc, device)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    acc, device, dtype, env = C.prepare(args)
    if args.iterations < 1 or args.kv_cache_mb < 1:
        raise SystemExit("error: --iterations and --kv-cache-mb must be >= 1")
    plain = _run_loop(args, acc, device, dtype, False)
    slept = _run_loop(args, acc, device, dtype, True)
    same_tokens = all(torch.equal(a, b) for a, b in zip(plain["tokens"], slept["tokens"]))
    same_losses = all(torch.equal(a, b) for a, b in zip(plain["losses"], slept["losses"]))
    mib = 2**20
    table = C.format_table(
        ["run", "iteration", "before rollout MiB", "during training MiB", "after step MiB", "rollout s", "wakes",
         "captures"],
        [[("phase mode" if r["phases"] else "plain"), row["iteration"], f"{row['before_rollout'] / mib:.1f}",
          f"{row['during_training'] / mib:.1f}", f"{row['after_step'] / mib:.1f}", f"{row['rollout_s']:.3f}",
          row["wakes"], row["captures"]] for r in (plain, slept) for row in r["iterations"]])
    for r in (plain, slept):
        del r["tokens"], r["losses"]  # compared above; not JSON material
    saved = (plain["iterations"][-1]["during_training"] - slept["iterations"][-1]["during_training"]) / mib
    text = (
        f"\nbench handoff: {C.model_label(args)} {C.dtype_name(dtype)} on {device.type}, {args.iterations} RL "
        f"iterations, K/V pool {args.kv_cache_mb} MiB, without and with sleep_between_phases\n"
        f"{C.environment_lines(env)}\n\n{table}\n\n"
        f"memory during training, phase mode vs plain: {saved:.1f} MiB less\n"
        f"explicit sleep(all) / wake(): {slept['explicit_sleep_s'] * 1e3:.1f} ms / "
        f"{slept['explicit_wake_s'] * 1e3:.1f} ms, memory asleep {slept['asleep_bytes'] / mib:.1f} MiB vs awake "
        f"{slept['awake_bytes'] / mib:.1f} MiB\n"
        f"captures: plain {plain['captures']}, phase mode {slept['captures']}; tokens identical: {same_tokens}; "
        f"losses identical: {same_losses}"
    )
    payload = {"benchmark": "handoff", "environment": env,
               "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "iterations": args.iterations,
                            "batch_size": args.batch_size, "samples": args.samples, "new_tokens": args.new_tokens,
                            "kv_cache_mb": args.kv_cache_mb, "memory": "RssAnon" if device.type == "cpu"
                            else "mem_get_info used"},
               "plain": plain, "phase_mode": slept, "tokens_identical": same_tokens, "losses_identical": same_losses,
               "training_memory_saved_mib": saved}
    keeps = kv_storage.supports_release(device)
    if not keeps:
        text += (f"\n{device.type}: no page storage released at fixed addresses yet (no VMM allocator), so the pool "
                 "is dropped and the graphs recaptured after a sleep: captures may differ (phase mode: "
                 f"{slept['handoff']['kv_cache_drops']} drops, {slept['handoff']['recaptures']} recaptures)")
    payload["pool_keeps_addresses"] = keeps
    C.finish(args, payload, text, None, "handoff")
    if not (same_tokens and same_losses and (plain["captures"] == slept["captures"] or not keeps)):
        raise SystemExit("error: the hand-off changed tokens, losses or captures")
    return payload
