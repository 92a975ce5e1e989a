"""One rank of tests/distributed/test_dschat_step3_zero.py: DeepSpeed-Chat's step 3 at ZeRO 2 or 3.

``python dschat_step3_worker.py STAGE COPY OUT_DIR``: the literal drop-in, ``deepspeed.initialize =
hybrid_engine.initialize``, then the actor (ZeRO ``STAGE``, bf16, hybrid engine and graphs on; ``COPY`` 1:
``zero3_gathered_inference_copy``) and the reference are built through ``deepspeed.initialize``; critic and reward
are plain models. Two PPO iterations with DeepSpeed-Chat's calls (``synced_gpus`` true at ZeRO-3), with prompts
of different widths per rank, so the ranks' generations finish at different steps. Records the graph counters,
the steps, greedy tokens of ``actor.module.generate`` and the trained weights (gathered, bf16), on which the test
runs transformers' own generate in one process, to ``OUT_DIR/rank<R>.pt``.
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


def main() -> None:
    stage, copy, out_dir = int(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3])
    deepspeed.initialize = hybrid_engine.initialize  # the literal drop-in (issue 42)
    torch.manual_seed(0)
    extra = {"zero3_gathered_inference_copy": True} if copy else {}
    actor, *_ = deepspeed.initialize(model=actor_model(), config=actor_config("bf16", stage, **extra))
    ref, *_ = deepspeed.initialize(model=actor_model(), config={"bf16": {"enabled": True},
                                                               "train_micro_batch_size_per_gpu": 2})
    trainer = Step3Trainer(actor, ref, PlainTrainer(ValueModel(seed=2)), ValueModel(seed=3), max_answer=MAX_ANSWER,
                           zero3=stage == 3, precision="bf16")
    for it in range(2):
        trainer.iteration(*prompts(2, 4 + rank(), seed=10 * it + rank()))
    stats = actor.graph_stats
    result = {"captures": stats.captures, "replays": stats.replays, "invalidations": stats.invalidations,
              "refusal": stats.last_refusal_reason, "eager_steps": stats.eager_steps,
              "fast_path_calls": bool(actor.last_stats), "global_steps": actor.global_steps,
              "zero_stage": actor.zero_stage, "num_params_set": hasattr(actor.module, "_num_params")}
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
