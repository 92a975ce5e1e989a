"""One rank of the ZeRO tests (run under torchrun by tests/distributed/test_zero.py).

``python zero_worker.py STAGE PRECISION OUT_DIR [copy] [lora]``: trains a tiny
Llama (``lora``: LoRA adapters on it, through ``peft.get_peft_model``) on
DeepSpeed (ZeRO ``STAGE``, or stage 0's data parallelism) through
``hybrid_engine.initialize``, beside a stage-0 reference trained on the whole
global batch on every rank, generates
rollouts with graphs and eagerly, and saves what the test asserts to
``OUT_DIR/rank<R>.pt``. Every check that compares ranks is made by the test.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid_engine import (
    HybridEngine,
    HybridEngineRollout,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
    initialize,
)
from hybrid_engine.config.loading import load_config
from hybrid_engine.distributed.deepspeed_import import import_deepspeed
from hybrid_engine.distributed.launch import exit_launched_rank
from hybrid_engine.distributed.ranks import shard
from hybrid_engine.distributed.world import destroy_process_group, rank
from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.model_access import decode_model
from hybrid_engine.tiny_models import build_model
from hybrid_engine.training.deepspeed import deepspeed_config

STEPS = 3
MICRO = 2


def global_batch(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(4, 384, (MICRO * world, 8), generator=g)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 384, (6, 5), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2] = 0
    mask[0, :2] = 0
    return ids, mask


def config(stage: int, precision: str, inference_copy: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "hybrid_engine": {"enable_graph_capture": True, "zero3_gathered_inference_copy": inference_copy},
    }


def full_params(engine: HybridEngine) -> list[torch.Tensor]:
    with gathered_for_inference(engine.module):
        return [p.detach().float().clone() for p in engine.module.parameters()]


def rollout(obj, graphs: bool) -> HybridEngineRollout:
    return HybridEngineRollout(obj, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0, eos_token_id=2))


def main() -> None:
    stage, precision, out_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    flags = set(sys.argv[4:])
    inference_copy = "copy" in flags
    torch.set_num_threads(1)
    model = build_model("tiny-llama", seed=1)
    if "lora" in flags:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                     init_lora_weights=False))
    reference = copy.deepcopy(model)
    engine, optimizer, _, _ = initialize(model=model, config=config(stage, precision, inference_copy))
    # The reference: stage 0, same precision, trained on the whole global batch on every rank (in this 2-rank job
    # that is DeepSpeed's data parallelism averaging identical gradients, the single-process result exactly).
    ref_engine, *_ = initialize(model=reference, config=config(0, precision))
    r, world = rank(), dist.get_world_size()
    result: dict = {"rank": r, "world": world, "zero_stage": engine.zero_stage,
                    "param_dtype": str(next(model.parameters()).dtype),
                    "optimizer": type(optimizer).__name__,
                    "generates_on_copy": engine.inference_module is not decode_model(model),
                    "trainable": sum(p.requires_grad for p in model.parameters())}
    addresses = [p.data_ptr() for p in model.parameters()]

    ids, mask = prompts()
    mine, offset = shard(list(range(ids.shape[0])))
    request = RolloutRequest(ids[list(mine)], mask[list(mine)], request_ids=[offset + i for i in range(len(mine))])
    graph_rollout, eager_rollout = rollout(engine, True), rollout(engine, False)
    greedy = SamplingConfig(max_new_tokens=6)
    sampled = SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=50, seed=11)

    def generate_both(label: str) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, sampling in (("greedy", greedy), ("sampled", sampled)):
                g = graph_rollout.generate(request, sampling)
                e = eager_rollout.generate(request, sampling)
                result[f"{label}_{name}_graph"] = g.input_ids
                result[f"{label}_{name}_eager"] = e.input_ids
                result[f"{label}_{name}_logprobs_graph"] = g.response_logprobs
                result[f"{label}_{name}_logprobs_eager"] = e.response_logprobs
            out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            result[f"{label}_engine_generate"] = out
        result[f"{label}_captures"] = graph_rollout.graph_stats.captures
        result[f"{label}_refusal"] = graph_rollout.graph_stats.last_refusal_reason
        result[f"{label}_warnings"] = [str(w.message) for w in caught if issubclass(w.category, GraphRefusedWarning)]

    def train_step(step: int) -> None:
        batch = global_batch(step, world)
        rows = batch[r * MICRO:(r + 1) * MICRO]
        engine.train()
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
        ref_loss = sum(ref_engine(input_ids=batch[k * MICRO:(k + 1) * MICRO],
                                  labels=batch[k * MICRO:(k + 1) * MICRO]).loss for k in range(world)) / world
        ref_engine.backward(ref_loss)
        ref_engine.step()
        engine.eval()

    def hook_tables() -> list:
        return [(name, list(m._forward_pre_hooks), list(m._forward_hooks)) for name, m in model.named_modules()]

    tables_before = hook_tables()
    offload_ids: set = set()
    if stage == 3:  # DeepSpeed's own handles of its per-module fetch/release hooks
        offload = engine.training_backend.ds_engine.optimizer.parameter_offload
        offload_ids = {h.id for h in [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]}
    seen_during_decode: list[int] = []

    def count_offload_hooks(module, args):  # a user hook: it must keep running, and see DeepSpeed's hooks off
        seen_during_decode.append(sum(k in offload_ids for m in model.modules()
                                      for k in (*m._forward_pre_hooks, *m._forward_hooks)))

    # Stage 3 only: there every call decodes eagerly, while at stages 1-2 a hook would be captured into the
    # graphs and its removal would (rightly) recapture them.
    user_hook = decode_model(model).lm_head.register_forward_pre_hook(count_offload_hooks) if stage == 3 else None
    generate_both("before")
    if user_hook is not None:
        user_hook.remove()
    result["offload_hooks_registered"] = len(offload_ids)
    result["offload_hooks_during_decode"] = seen_during_decode
    result["hook_tables_restored"] = hook_tables() == tables_before
    for step in range(STEPS):
        train_step(step)
    result["global_steps"] = engine.global_steps
    result["skipped_steps"] = engine.skipped_steps  # DeepSpeed's own count
    result["addresses_kept"] = [p.data_ptr() for p in model.parameters()] == addresses
    generate_both("after")
    result["weights_max_diff"] = max(float((a - b.detach().float()).abs().max())
                                     for a, b in zip(full_params(engine), reference.parameters()))
    # The stage-0 reference generates from its own weights: with equal weights, equal tokens.
    result["reference_greedy"] = rollout(reference, False).generate(request, greedy).input_ids

    # Ranks finishing at different lengths: rank 0 stops after 2 tokens, the others run 24.
    uneven = SamplingConfig(max_new_tokens=2 if r == 0 else 24)
    result["uneven_width"] = eager_rollout.generate(request, uneven).input_ids.shape[1] - request.prompt_ids.shape[1]
    train_step(STEPS)  # a collective right after: it would deadlock if a rank were left in a gather
    result["after_uneven_steps"] = engine.global_steps

    # Fewer prompts than ranks: rank 1's shard is empty, and it still makes the call (under ZeRO-3 the call
    # gathers the parameters collectively); a collective right after checks the ranks are still in step.
    one, at = shard(range(1))
    lonely = RolloutRequest(ids[list(one)], mask[list(one)], request_ids=[at + i for i in range(len(one))])
    result["one_prompt_rows"] = graph_rollout.generate(lonely, greedy).input_ids.shape[0]
    in_step = torch.tensor([r + 1])
    dist.all_reduce(in_step)
    result["in_step_after_empty_shard"] = int(in_step)

    # Same prompt, same seed, same request id on every rank: per-rank seeds must still differ.
    same = RolloutRequest(ids[:1], mask[:1], request_ids=[0])
    result["same_request_tokens"] = graph_rollout.generate(same, sampled).input_ids
    result["same_request_again"] = graph_rollout.generate(same, sampled).input_ids

    # DeepSpeed's rollout interface on the same engine: the same tokens as our rollout (ZeRO-3: gathered).
    from deepspeed.runtime.rollout.base import RolloutRequest as DSRequest
    from deepspeed.runtime.rollout.base import SamplingConfig as DSSampling

    from hybrid_engine.integrations.deepspeed import DeepSpeedRolloutEngine

    adapter = DeepSpeedRolloutEngine(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                                  eos_token_id=2))
    adapter.sync_weights(engine.global_steps)
    ds_batch = adapter.generate(DSRequest(request.prompt_ids, request.prompt_attention_mask), DSSampling(6, 0.0))
    ours = eager_rollout.generate(request, greedy)
    result["adapter_matches"] = torch.equal(ds_batch.input_ids[:, :ours.input_ids.shape[1]], ours.input_ids)

    if stage in (0, 1, 2):
        # Checkpoints go through DeepSpeed's save/load; weights and steps come back.
        ckpt = out_dir / "ckpt"
        saved = full_params(engine)
        torch.rand(1 + 7 * rank())  # the ranks have used their RNG streams unevenly
        engine.save_checkpoint(ckpt, tag="t")
        next_draws = torch.rand(4)  # what this rank draws next in an uninterrupted run
        train_step(STEPS + 1)
        path, client = engine.load_checkpoint(ckpt, tag="t")
        # Its own stream back (DeepSpeed keeps client_state from rank 0 only at ZeRO 1/2).
        result["checkpoint_rng_is_this_ranks"] = torch.equal(torch.rand(4), next_draws)
        result["checkpoint_restored"] = all(torch.equal(a, b) for a, b in zip(full_params(engine), saved))
        # A damaged file that only rank 1 hashes (the ranks split the reading): every rank refuses, naming it,
        # before DeepSpeed's collective load (a rank going on alone would hang), and nothing changes.
        from hybrid_engine.training.checkpoint_files import MANIFEST_FILE

        damaged = out_dir / "damaged"
        names = sorted(json.loads((ckpt / "t" / MANIFEST_FILE).read_text())["files"])
        if rank() == 0:
            shutil.copytree(ckpt, damaged)
            data = bytearray((damaged / "t" / names[1]).read_bytes())
            data[len(data) // 2] ^= 0x01
            (damaged / "t" / names[1]).write_bytes(bytes(data))
        dist.barrier()
        steps_before = engine.global_steps
        try:
            engine.load_checkpoint(damaged, tag="t")
            result["damaged_refused"] = None
        except ValueError as exc:
            result["damaged_refused"] = str(exc)
        result["damaged_file"] = names[1]
        result["damaged_unchanged"] = engine.global_steps == steps_before
        # DeepSpeed's own save_16bit_model, through the engine: the weights alone, written by rank 0.
        result["saved_16bit"] = engine.save_16bit_model(out_dir / "weights16")
        # A stage-0 checkpoint is refused by name (DeepSpeed would fail on an assert), the same on every rank.
        local, *_ = initialize(model=build_model("tiny-llama", seed=1), config={})
        local.save_checkpoint(out_dir / f"stage0_rank{rank()}", tag="t")
        try:
            engine.load_checkpoint(out_dir / f"stage0_rank{rank()}", tag="t")
            result["stage0_checkpoint_refused"] = None
        except ValueError as exc:
            result["stage0_checkpoint_refused"] = str(exc)
        result["checkpoint_steps"] = engine.global_steps
        if stage == 2 and precision == "fp32":
            # The stage-2 checkpoint into a stage-3 engine: DeepSpeed asserts on the files it expects;
            # the engine says which stage the files are from and how to convert them.
            other3, *_ = initialize(model=build_model("tiny-llama", seed=1), config=config(3, precision))
            try:
                other3.load_checkpoint(ckpt, tag="t")
                result["cross_stage_refused"] = None
            except ValueError as exc:
                result["cross_stage_refused"] = str(exc)
            other3.destroy()
        # An engine the user built with deepspeed.initialize, wrapped.
        deepspeed = import_deepspeed()
        other = build_model("tiny-llama", seed=1)
        ds_engine, *_ = deepspeed.initialize(model=other, config=deepspeed_config(load_config(config(stage, precision))),
                                             model_parameters=other.parameters())
        wrapped = HybridEngine.from_deepspeed(ds_engine, config={"hybrid_engine": {"enable_graph_capture": True}})
        result["wrapped_stage"] = wrapped.zero_stage
        # Training settings are the DeepSpeed engine's own, not the defaults of the hybrid_engine-only config.
        result["wrapped_matches_deepspeed"] = (
            wrapped.gradient_accumulation_steps() == ds_engine.gradient_accumulation_steps()
            and wrapped.config.bf16.enabled == ds_engine.bfloat16_enabled()
            and wrapped.config.train_micro_batch_size_per_gpu == ds_engine.train_micro_batch_size_per_gpu())
        out = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        result["wrapped_generate"] = out
        result["wrapped_captures"] = wrapped.graph_stats.captures
    if stage in (1, 2):
        wrapped.destroy()
    engine.destroy()  # DeepSpeed's teardown while every rank is still here
    try:
        engine.step()
    except RuntimeError as exc:
        result["after_destroy"] = str(exc)
    torch.save(result, out_dir / f"rank{r}.pt")
    dist.barrier()
    destroy_process_group()
    # DeepSpeed's own reference to its clone of the world group is gone with it (kept, it would be torn down at
    # interpreter shutdown, where gloo can abort the rank after its last line); a failed assert fails the test.
    from deepspeed.utils import groups

    assert groups._WORLD_GROUP is None, "deepspeed.utils.groups still holds a process group after teardown"
    exit_launched_rank()


if __name__ == "__main__":
    main()
