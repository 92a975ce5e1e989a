"""Trains at ZeRO 1-3 in one plain process (no launcher variables), beside a stage-0 reference.

Run by ``test_one_process_zero.py`` under a hard timeout; prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings

import torch
from hand_lora import inject_hand_lora  # tests/distributed, this script's folder

from hybrid_engine import initialize
from hybrid_engine.graphs.policy import validate_graph_capture_support
from hybrid_engine.model_access import decode_model
from hybrid_engine.tiny_models import build_model

STEPS = 3


def train(stage: int, precision: str, layers: str = "") -> dict:
    """``layers``: ``"lora"``, a tiny Llama with LoRA layers injected by hand (as DeepSpeed-Chat's own LoRA does),
    which the gathered inference copy copies structurally; ``"uncopyable"``, a layer added by hand that holds a
    lock, so no copy can mirror it."""
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "hybrid_engine": {"enable_graph_capture": True}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    model = inject_hand_lora(build_model("tiny-llama", seed=3)) if layers == "lora" else build_model("tiny-gpt2", seed=3)
    if layers == "uncopyable":
        model.transformer.h[0].extra = torch.nn.Linear(4, 4)  # never called: the forward is unchanged
        model.transformer.h[0].extra.lock = threading.Lock()  # nothing deep-copies a lock
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 12), generator=gen)
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    tokens = engine.generate(ids[:, :4], max_new_tokens=6, do_sample=False).tolist()
    out = {"losses": losses, "tokens": tokens, "global_steps": int(engine.global_steps),
           "zero_stage": int(engine.zero_optimization_stage()), "captures": engine.graph_stats.captures,
           "replays": engine.graph_stats.replays, "refusal": engine.graph_stats.last_refusal_reason,
           "inference_copy": engine.inference_module is not decode_model(engine.module),
           "config_refusal": validate_graph_capture_support(engine.config),
           "init_warnings": [str(w.message) for w in caught if "inference copy" in str(w.message)]}
    engine.destroy()
    return out


def exact(stage: int, precision: str) -> dict:
    """Exact mode under ZeRO ``stage``: a rollout's logprobs against the engine's training forward."""
    from hybrid_engine import logprobs_of
    from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "hybrid_engine": {"exact_logprobs": True}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = initialize(model=build_model("tiny-llama", seed=3), config=config)
    ids = torch.randint(4, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    rollout = HybridEngineRollout(engine, config=RolloutConfig(pad_token_id=0, eos_token_id=10_000))
    batch = rollout.generate(RolloutRequest(ids), SamplingConfig(max_new_tokens=8, temperature=1.0, seed=2,
                                                                 n_samples_per_prompt=2))
    inputs = batch.training_inputs()
    logits = engine(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    start = batch.response_start_idx
    new = logprobs_of(logits[:, start - 1:-1], batch.responses, temperature=1.0)
    out = {"max_diff": float((new - batch.response_logprobs).abs().max()), "tokens": int(batch.response_lengths.sum()),
           "zero_stage": int(engine.zero_optimization_stage())}
    engine.destroy()
    return out


def episode(stage: int, precision: str) -> dict:
    """An episode's K/V kept between turns under ZeRO ``stage``, and dropped after an optimizer step between
    turns (the next turn prefills its histories whole)."""
    from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = initialize(model=build_model("tiny-llama", seed=3), config=config)
    ids = torch.randint(4, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    rollout = HybridEngineRollout(engine, config=RolloutConfig(pad_token_id=0, eos_token_id=10_000))
    episodes = rollout.open_episodes(RolloutRequest(ids), n_samples_per_prompt=2)
    reused = []
    for turn in range(3):
        episodes.turn(SamplingConfig(max_new_tokens=4, temperature=1.0, seed=turn))
        reused.append(rollout.last_stats["kv_reused_tokens"])
        for row in range(episodes.num_rows):
            episodes.append(row, [7, 8])
        if turn == 1:  # a training step between turns 2 and 3
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    history = episodes.history(0)
    episodes.turn(SamplingConfig(max_new_tokens=4, temperature=1.0, seed=9), rows=[0])
    reused.append(rollout.last_stats["kv_reused_tokens"])
    single = rollout.generate(RolloutRequest(torch.tensor([history]), request_ids=[3 * episodes.num_rows]),
                              SamplingConfig(max_new_tokens=4, temperature=1.0, seed=9))
    out = {"reused": reused, "same_tokens": episodes.last_turn(0) == single.responses[0].tolist(),
           "zero_stage": int(engine.zero_optimization_stage())}
    engine.destroy()
    return out


def main() -> None:
    leaked = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if name in os.environ]
    assert not leaked, f"launcher variables set: {leaked}"
    torch.set_num_threads(1)
    results = {}
    for case in sys.argv[1:]:  # stage:precision, or stage:precision:exact / :episode / :lora / :uncopyable
        stage, precision, *mode = case.split(":")
        if precision == "fp16":  # the same on every CPU, with or without oneDNN's fp16 kernels
            from cpu_fp16 import report_fp16_on_cpu  # noqa: PLC0415 -- tests/distributed, this script's folder

            report_fp16_on_cpu()
        if mode and mode[0] in ("lora", "uncopyable"):
            results[case] = train(int(stage), precision, layers=mode[0])
            continue
        run = {"exact": exact, "episode": episode}.get(mode[0] if mode else "", train)
        results[case] = run(int(stage), precision)
    import torch.distributed as dist

    results["world"] = dist.get_world_size() if dist.is_initialized() else None
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
