"""One rank of tests/distributed/test_dschat_step3_zero.py: DeepSpeed-Chat's step 3 at ZeRO 2 or 3.

``python dschat_step3_worker.py STAGE COPY OUT_DIR [ALIGN] [PRECISION]``: the literal drop-in, ``deepspeed.initialize =
hybrid_engine.initialize``, then the actor (ZeRO ``STAGE``, ``PRECISION`` bf16 (the default) or fp16, hybrid engine
and graphs on; ``COPY`` ``default``: DeepSpeed-Chat's config as it is, no copy key (graphs imply the gathered
inference copy at ZeRO-3), ``off``: ``zero3_gathered_inference_copy`` false) and the reference are built through ``deepspeed.initialize``; critic and reward
are plain models. Two PPO iterations with DeepSpeed-Chat's calls (``synced_gpus`` true at ZeRO-3), with prompts
of different widths per rank, so the ranks' generations finish at different steps. ``ALIGN`` 1: three, with
``--align_overflow``: in the first the critic reports an overflow (so the actor's step is skipped through
``skip_step``), in the second the actor's loss is NaN on rank 1 only (both ranks' ``check_overflow`` see it, so
the critic's step is skipped on both), the third trains both. Records the graph counters,
the steps, greedy tokens of ``actor.module.generate`` and the trained weights (gathered, in ``PRECISION``), on which
the test runs transformers' own generate in one process, to ``OUT_DIR/rank<R>.pt``.

fp16 runs DeepSpeed's own fp16 ZeRO optimizer under the CPU accelerator's fp16 test double (``cpu_fp16.py``), with
the dynamic loss scale from 2**8 (DeepSpeed's default 2**16 could make the tiny model's fp16 gradients overflow on
their own; here only the steps the test makes overflow do).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hybrid_engine.distributed.deepspeed_import import import_deepspeed
from hybrid_engine.distributed.launch import exit_launched_rank
from hybrid_engine.distributed.world import destroy_process_group, rank
from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.tiny_models import PAD_ID

deepspeed = import_deepspeed()
from cpu_fp16 import report_fp16_on_cpu  # noqa: E402  (this folder: the test double for fp16 on CPU)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the trainer is in tests/

import hybrid_engine  # noqa: E402
from tests.integrations.dschat_step3 import (  # noqa: E402
    PlainTrainer,
    Step3Trainer,
    ValueModel,
    actor_config,
    actor_model,
    prompts,
)

MAX_ANSWER = 8


def align_overflow_iterations(trainer: Step3Trainer) -> list[dict]:
    """Three ``--align_overflow`` iterations (see the module docstring); the actor's and critic's counters after each."""
    actor, critic, log = trainer.actor, trainer.critic, []
    for it in range(3):
        # Test double: a plain fp32 critic never overflows; this stands for an fp16 critic's overflow.
        critic.optimizer.check_overflow = lambda external=False, overflow=it == 0: overflow
        if it == 1 and rank() == 1:  # a NaN in this rank's actor gradients only
            actor.backward = lambda loss: type(actor).backward(actor, loss * float("nan"))
        trainer.iteration(*prompts(2, 4 + rank(), seed=10 * it + rank()))
        actor.__dict__.pop("backward", None)
        log.append({"actor_skipped": actor.skipped_steps, "actor_applied": actor.was_step_applied(),
                    "actor_skip_flag": actor.optimizer.skip_step, "critic_skipped": critic.skipped,
                    "critic_steps": critic.steps, "actor_scale": float(actor.optimizer.cur_scale)})
    return log


def main() -> None:
    stage, copy, out_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    align = len(sys.argv) > 4 and sys.argv[4] == "1"
    precision = sys.argv[5] if len(sys.argv) > 5 else "bf16"
    config = actor_config(precision, stage, **({"zero3_gathered_inference_copy": False} if copy == "off" else {}))
    if precision == "fp16":
        report_fp16_on_cpu()
        config["fp16"]["initial_scale_power"] = 8
    deepspeed.initialize = hybrid_engine.initialize  # the literal drop-in (issue 42)
    torch.manual_seed(0)
    actor, *_ = deepspeed.initialize(model=actor_model(), config=config)
    ref, *_ = deepspeed.initialize(model=actor_model(), config={precision: {"enabled": True},
                                                               "train_micro_batch_size_per_gpu": 2})
    trainer = Step3Trainer(actor, ref, PlainTrainer(ValueModel(seed=2)), ValueModel(seed=3), max_answer=MAX_ANSWER,
                           zero3=stage == 3, precision=precision, align_overflow=align)
    if align:
        align_log = align_overflow_iterations(trainer)
    else:
        for it in range(2):
            trainer.iteration(*prompts(2, 4 + rank(), seed=10 * it + rank()))
    stats = actor.graph_stats
    result = {"captures": stats.captures, "replays": stats.replays, "invalidations": stats.invalidations,
              "refusal": stats.last_refusal_reason, "eager_steps": stats.eager_steps,
              "fast_path_calls": bool(actor.last_stats), "global_steps": actor.global_steps,
              "zero_stage": actor.zero_stage, "num_params_set": hasattr(actor.module, "_num_params")}
    if align:
        result["align_log"], result["overflow_log"] = align_log, trainer.overflow_log
    ids, mask = prompts(2, 5, seed=99)
    kw = dict(attention_mask=mask, max_length=5 + MAX_ANSWER, pad_token_id=PAD_ID, do_sample=False)
    result["kw"] = {k: v for k, v in kw.items() if k != "attention_mask"}
    result["graph_tokens"] = actor.module.generate(ids, synced_gpus=stage == 3, **kw)
    model = actor.inference_module
    with gathered_for_inference(model), torch.no_grad():  # collective under ZeRO-3: every rank enters it
        result["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["ids"], result["mask"] = ids, mask
    actor.destroy()
    result["generate_restored"] = "generate" not in actor.module.__dict__
    torch.save(result, out_dir / f"rank{rank()}.pt")
    destroy_process_group()
    exit_launched_rank()


if __name__ == "__main__":
    main()
