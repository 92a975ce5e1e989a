"""One rank: gradient accumulation, clipping and the LR scheduler on DeepSpeed ZeRO 1-3 vs stage 0.

``python delegation_worker.py OUT``: for each stage, trains a tiny GPT-2 through
``hybrid_engine.initialize`` with ``gradient_accumulation_steps=2``,
``gradient_clipping=0.5`` and an LR scheduler given as a callable, beside a
stage-0 engine with the same config and data, and saves what the test compares.
"""

from __future__ import annotations

import copy
import sys

import torch

from hybrid_engine import initialize
from hybrid_engine.distributed.launch import exit_launched_rank
from hybrid_engine.distributed.world import destroy_process_group
from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.tiny_models import build_model


def batch(i: int) -> torch.Tensor:
    return torch.randint(4, 384, (2, 6), generator=torch.Generator().manual_seed(i))


def train(stage: int, model: torch.nn.Module) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, optimizer, loader, scheduler = initialize(
        model=model, config=config, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    boundaries, lrs, returned, applied, samples, norms = [], [], [], [], [], []
    for i in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        ids = batch(i)
        returned.append(float(engine.backward(engine(input_ids=ids, labels=ids).loss)))
        engine.step()
        lrs.append(scheduler.get_last_lr()[0])
        applied.append(engine.was_step_applied())
        samples.append(engine.global_samples)
        norms.append(engine.get_global_grad_norm())
    # DeepSpeed's smaller engine queries: stage 0 answers them itself, ZeRO 1-3 through DeepSpeed's engine.
    queries = {"gradient_clipping": engine.gradient_clipping(), "zero_stage": engine.zero_optimization_stage(),
               "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(), "loss_scale": engine.loss_scale(),
               "steps_per_print": engine.steps_per_print(), "optimizer_name": engine.optimizer_name(),
               "mom": engine.get_mom(), "world_size": engine.world_size, "dp_world_size": engine.dp_world_size,
               "global_rank": engine.global_rank, "local_rank": engine.local_rank, "device": str(engine.device)}
    with gathered_for_inference(model):
        weights = [p.detach().clone() for p in model.parameters()]
    result = {"boundaries": boundaries, "lrs": lrs, "global_steps": engine.global_steps,
              "micro_steps": engine.micro_steps, "scheduler_is_engines": scheduler is engine.lr_scheduler,
              "optimizer": type(optimizer).__name__, "loader": loader, "weights": weights, "returned": returned,
              "applied": applied, "samples": samples, "norms": norms, "queries": queries}
    engine.destroy()
    return result


def main() -> None:
    torch.set_num_threads(1)
    base = build_model("tiny-gpt2", seed=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    results = {stage: train(stage, copy.deepcopy(base)) for stage in (0, 1, 2, 3)}
    torch.save(results, sys.argv[1])
    destroy_process_group()
    exit_launched_rank()


if __name__ == "__main__":
    main()
