"""One rank of tests/distributed/test_trl_zero3.py: TRL's GRPOTrainer on DeepSpeed ZeRO-3, hybrid-engine rollouts.

``python trl_zero3_worker.py MODE OUT_DIR``: MODE ``gathered`` (rollouts gather
the parameters per call and decode eagerly), ``lora`` (the same, training LoRA
adapters on a tiny Llama through TRL's ``peft_config``), ``copy``
(``zero3_gathered_inference_copy=True``: graphs on an unpartitioned copy) or
``lora_copy`` (LoRA adapters, graphs on a copy with the same adapters). At
every rollout call it also generates the same request eagerly on the trainer's
partitioned model (a collective gather, on every rank alike) and records both,
with the rollout's stats and a checksum of the gathered weights, to
``OUT_DIR/rank<R>.pt`` for the test to compare.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from hybrid_engine.distributed.deepspeed_import import import_deepspeed
from hybrid_engine.distributed.launch import exit_launched_rank  # noqa: E402
from hybrid_engine.distributed.world import destroy_process_group
from hybrid_engine.distributed.zero3 import gathered_for_inference

import_deepspeed()  # before TRL and accelerate import it: no C++ op is built on this CPU

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hybrid_engine import HybridEngineRollout  # noqa: E402
from hybrid_engine.graphs.policy import GraphRefusedWarning  # noqa: E402
from hybrid_engine.integrations.trl import destroy_trainer_deepspeed, make_rollout_func  # noqa: E402
from hybrid_engine.model_access import decode_model  # noqa: E402
from hybrid_engine.tiny_models import build_model, build_tokenizer  # noqa: E402

STEPS = 3
PROMPTS = ["the cat is in the water", "you can find the day", "he was", "make some time for it now so",
           "we can see the oil", "what is it"]
DEEPSPEED = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _cut(rows: torch.Tensor, lengths: torch.Tensor) -> list[list]:
    return [r[:k] for r, k in zip(rows.tolist(), lengths.tolist())]


def main(mode: str, out_dir: Path) -> None:
    lora = mode.startswith("lora")
    fn = make_rollout_func(zero3_gathered_inference_copy=mode.endswith("copy"))
    calls: list[dict] = []
    eager: list[HybridEngineRollout] = []

    def rollout_func(prompts, trainer):
        out = fn(prompts, trainer)
        source = trainer.accelerator.unwrap_model(trainer.model)
        if not eager:
            eager.append(HybridEngineRollout(source, config=dataclasses.replace(fn.rollout.config,
                                                                                use_graph_capture=False)))
        ref = eager[0].generate(fn.last_request, fn.last_sampling)  # gathers: every rank calls it here
        record = {"step": trainer.state.global_step, "completion_ids": out["completion_ids"],
                  "logprobs": out["logprobs"], "eager_completion_ids": _cut(ref.responses, ref.response_lengths),
                  "eager_logprobs": _cut(ref.response_logprobs, ref.response_lengths),
                  "stats": {k: fn.rollout.last_stats.get(k) for k in ("use_graph_capture", "graph_captures",
                                                                      "graph_replays", "last_refusal_reason")},
                  "generates_on_trainer_model": fn.rollout.model is decode_model(source),
                  "generation_model_partitioned": any(hasattr(p, "ds_id") for p in fn.rollout.model.parameters())}
        with torch.no_grad(), gathered_for_inference(source):
            record["weight_sum"] = float(sum(p.double().sum() for p in source.parameters()))
            if fn.inference_copy is not None:
                mine = dict(fn.inference_copy.module.named_parameters())
                record["copy_equals_gathered"] = all(torch.equal(mine[n], p)
                                                     for n, p in decode_model(source).named_parameters())
        calls.append(record)
        return out

    # Built before the config, so that deepspeed.initialize partitions it.
    model = build_model("tiny-llama" if lora else "tiny-gpt2", seed=0)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = GRPOConfig(
        output_dir=str(out_dir / "trainer"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", seed=0, deepspeed=DEEPSPEED, dataloader_num_workers=0,
        disable_dropout=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer(),
                          rollout_func=rollout_func, peft_config=peft_config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphRefusedWarning)
        trainer.train()
    rank = trainer.accelerator.process_index
    torch.save({"rank": rank, "world": trainer.accelerator.num_processes,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
                "global_step": trainer.state.global_step, "calls": calls,
                "graph_refused_warnings": sum(issubclass(w.category, GraphRefusedWarning) for w in caught)},
               out_dir / f"rank{rank}.pt")
    # DeepSpeed's teardown while both ranks are alive (left to interpreter shutdown, a ZeRO-3 engine can abort
    # the process on gloo), then the process group.
    destroy_trainer_deepspeed(trainer)
    dist.barrier()
    destroy_process_group()
    exit_launched_rank()


def _reward(completions, **kwargs):
    return [len(c) / 40.0 for c in completions]


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
