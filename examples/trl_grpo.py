"""TRL's GRPOTrainer with hybrid-engine rollouts: decode graphs captured once, replayed at every training step.

Runs offline in seconds on a CPU: a tiny GPT-2-shaped model with seeded random
weights, a tokenizer built in memory (``hybrid_engine.tiny_models``), and a toy
reward (the fraction of completion words that are real English words). The
rollout function wraps the trainer's own model, so the optimizer's in-place
updates are what the next replay reads: no weight copy, no sync, no recapture.

    python examples/trl_grpo.py                  # 5 steps, graphs on
    python examples/trl_grpo.py --no-graphs      # the same run, eager decoding
    python examples/trl_grpo.py --compare        # both, side by side, and whether every completion matched
    torchrun --nproc-per-node 2 examples/trl_grpo.py --zero3 --compare
                                                 # on DeepSpeed ZeRO-3: an inference copy with graphs vs
                                                 # the gathered parameters, eagerly
    python examples/trl_grpo.py --lora 8         # train LoRA adapters of rank 8 (TRL's peft_config)

Per step it prints the loss, the mean reward, the rollout time, the step time and
the captures so far; at the end steps, captures (decode graphs / admission
graphs) and the time per step. Needs ``pip install 'hybrid-engine[trl]'``.

``--zero3`` trains on DeepSpeed ZeRO-3 (``pip install 'hybrid-engine[deepspeed]'``;
one process under plain ``python``, or as many as ``torchrun`` starts, printing on
rank 0). There "graphs on" generates on an unpartitioned copy of the model
refreshed at each step (``zero3_gathered_inference_copy=True``) and "graphs off"
on the parameters gathered for each call. ``--lora R`` trains LoRA adapters of
rank ``R`` on every linear layer instead of the whole model (``pip install
'hybrid-engine[trl]'`` brings PEFT); under ZeRO-3 the copy carries them too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16

import torch  # noqa: E402

#: DeepSpeed config for ``--zero3`` ("auto" values come from the GRPOConfig).
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

PROMPTS = [
    "the water is", "you can find the", "he was not what we", "make some time for",
    "we can see the oil and", "what is it that", "how long is one day in", "all of them were out by",
    "she said there would be", "if you look at the", "people call it the", "the first word of this",
]


def english_word_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Fraction of each completion's words that are alphabetic words of two letters or more."""
    rewards = []
    for text in completions:
        words = text.split()
        rewards.append(sum(w.isalpha() and len(w) >= 2 for w in words) / max(1, len(words)))
    return rewards


def train(args: argparse.Namespace, *, graphs: bool) -> dict[str, Any]:
    """One GRPO run of ``args.steps`` steps; returns per-step times, captures and every call's completions."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_engine import RolloutConfig
    from hybrid_engine.integrations.trl import destroy_trainer_deepspeed, make_rollout_func
    from hybrid_engine.tiny_models import build_model, build_tokenizer

    if args.zero3:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        # A GRPOConfig with ZeRO-3 makes later models initialise under deepspeed.zero.Init, which draws other
        # random weights; clear it so that every run starts from the same weights (DeepSpeed partitions them).
        unset_hf_deepspeed_config()
    model = build_model(f"tiny-{args.model}", seed=args.seed)
    tokenizer = build_tokenizer(int(model.config.vocab_size))
    fn = make_rollout_func(RolloutConfig(use_graph_capture=graphs), zero3_gathered_inference_copy=graphs and args.zero3)
    calls: list[dict[str, Any]] = []

    def rollout_func(prompts: list, trainer: Any) -> dict[str, list]:
        out = fn(prompts, trainer)
        calls.append({"completions": out["completion_ids"], "stats": fn.rollout.last_stats})
        return out

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.seconds: list[float] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.seconds.append(time.perf_counter() - self.t0)

    timer = StepTimer()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=1.0, learning_rate=args.lr, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=args.device == "cpu", bf16=False, disable_dropout=True,
        disable_tqdm=True, seed=args.seed, deepspeed=ZERO3 if args.zero3 else None,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear", lora_dropout=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=english_word_reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rollout_func,
                          callbacks=[timer], peft_config=peft_config)
    trainer.remove_callback(PrinterCallback)
    print(f"\n== graphs {'on' if graphs else 'off'}: tiny-{args.model}{f' LoRA r={args.lora}' if args.lora else ''}, "
          f"{args.steps} steps, "
          f"{args.prompts_per_step} prompts x {args.num_generations} completions x {args.max_completion_length} "
          f"tokens per step")
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    stats = fn.rollout.graph_stats
    for i, (sec, call) in enumerate(zip(timer.seconds, calls)):
        log = logs[i] if i < len(logs) else {}
        s = call["stats"]
        print(f"step {i + 1:3d}  loss {float(log.get('loss', float('nan'))):+.4f}  "
              f"reward {float(log.get('reward', float('nan'))):.3f}  rollout {s['total_ms']:7.1f} ms  "
              f"step {sec * 1e3:7.1f} ms  captures +{s['graph_captures']}/+{s['admission_graph_captures']}  "
              f"replays {s['graph_replays']}")
    later = timer.seconds[1:] or timer.seconds
    result = {
        "graphs": graphs, "steps": trainer.state.global_step, "wall_s": wall,
        "captures": stats.captures, "admission_captures": stats.admission_captures,
        "buckets": stats.buckets, "replays": stats.replays, "eager_steps": stats.eager_steps,
        "first_step_ms": timer.seconds[0] * 1e3, "step_ms": statistics.median(later) * 1e3,
        "rollout_ms": statistics.median(c["stats"]["total_ms"] for c in calls[1:] or calls),
        "completions": [c["completions"] for c in calls],
    }
    if args.zero3:
        destroy_trainer_deepspeed(trainer)  # now, while every rank is alive (gloo can abort at exit otherwise)
    print(f"steps {result['steps']}, captures {stats.captures} decode (buckets {stats.buckets}) + "
          f"{stats.admission_captures} admission, replays {stats.replays}, eager decode steps {stats.eager_steps}; "
          f"first step {result['first_step_ms']:.0f} ms (captures included), then {result['step_ms']:.1f} ms/step "
          f"(median), rollout {result['rollout_ms']:.1f} ms/call")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt2", "opt", "llama", "qwen2"), default="gpt2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 suits the tiny models)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-graphs", action="store_true", help="decode eagerly")
    mode.add_argument("--compare", action="store_true", help="run with graphs on, then off, and compare")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="train LoRA adapters of rank R on every linear layer (0: the whole model)")
    p.add_argument("--zero3", action="store_true",
                   help="train on DeepSpeed ZeRO-3; graphs run on an inference copy refreshed at each step")
    args = p.parse_args(argv)
    if args.lora < 0:
        p.error(f"--lora must be a LoRA rank >= 1 (or 0 for none), got {args.lora}")
    for flag, least in (("steps", 1), ("prompts_per_step", 1), ("num_generations", 2),
                        ("max_completion_length", 1), ("threads", 1)):
        if getattr(args, flag) < least:  # GRPO normalises rewards within a group: it needs two generations
            p.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    torch.set_num_threads(args.threads)
    quiet = contextlib.nullcontext()
    if args.zero3:
        from hybrid_engine.distributed.deepspeed_import import import_deepspeed
        from hybrid_engine.distributed.launch import free_port

        import_deepspeed()  # before TRL imports it: no C++ op is built on a CPU
        if "RANK" not in os.environ:  # plain `python`: one process
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if os.environ["RANK"] != "0":
            quiet = contextlib.redirect_stdout(io.StringIO())  # rank 0 prints
    with quiet:
        if not args.compare:
            train(args, graphs=not args.no_graphs)
            code = 0
        else:
            code = _compare(train(args, graphs=True), train(args, graphs=False))
    if args.zero3:
        import torch.distributed as dist

        from hybrid_engine.distributed.world import destroy_process_group

        if dist.is_initialized():
            dist.barrier()
            destroy_process_group()  # DeepSpeed's teardown: it also drops the groups DeepSpeed holds
    return code


def _compare(on: dict[str, Any], off: dict[str, Any]) -> int:
    same = on["completions"] == off["completions"]
    print("\n| graphs | steps | decode captures | admission captures | first step ms | ms/step (median) | "
          "rollout ms/call |")
    print("|---|---|---|---|---|---|---|")
    for r in (on, off):
        print(f"| {'on' if r['graphs'] else 'off'} | {r['steps']} | {r['captures']} | {r['admission_captures']} | "
              f"{r['first_step_ms']:.0f} | {r['step_ms']:.1f} | {r['rollout_ms']:.1f} |")
    print(f"completions identical at every step: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
