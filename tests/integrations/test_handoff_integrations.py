"""Issue 41's phase mode through the integrations: TRL's ``make_rollout_func(sleep_between_phases=True)`` and
DeepSpeed's rollout interface on an engine with ``hybrid_engine.sleep_between_phases``. The page pool sleeps
after each call, graphs kept; the next call wakes it, captures nothing new and samples what it would without."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybrid_engine import RolloutConfig, initialize
from hybrid_engine.tiny_models import EOS_ID, build_model, build_tokenizer

PROMPTS = ["the cat is in the water", "he was"]


def _trainer(model, step: int):
    args = SimpleNamespace(max_completion_length=5, temperature=1.0, top_p=1.0, top_k=0, seed=0, min_p=None,
                           repetition_penalty=1.0, generation_kwargs=None)
    return SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0),
                           processing_class=build_tokenizer(), args=args,
                           state=SimpleNamespace(global_step=step), eos_token_ids=[EOS_ID], chat_template_kwargs={})


def test_trl_rollout_func_sleeps_its_pool_between_calls_and_samples_the_same():
    pytest.importorskip("trl", reason="needs the trl extra")
    from hybrid_engine.integrations.trl import make_rollout_func

    model = build_model("tiny-gpt2", seed=0)
    config = RolloutConfig(use_graph_capture=True, eos_token_id=10_000)
    plain, slept = make_rollout_func(config=config), make_rollout_func(config=config, sleep_between_phases=True)
    prompts = [p for p in PROMPTS for _ in range(2)]
    for step in range(3):
        assert slept(prompts, _trainer(model, step)) == plain(prompts, _trainer(model, step))
        assert slept.rollout.sleeping_tags == {"kv_cache"} and not plain.rollout.sleeping_tags
        if step:
            assert slept.rollout.last_stats["wakes"] == 1
            assert slept.rollout.last_stats["graph_captures"] == plain.rollout.last_stats["graph_captures"]
    assert slept.rollout.graph_stats.captures == plain.rollout.graph_stats.captures > 0
    with pytest.raises(TypeError, match="sleep_between_phases must be True or False"):
        make_rollout_func(sleep_between_phases="yes")


def test_deepspeed_rollout_interface_on_an_engine_with_the_phase_mode():
    pytest.importorskip("deepspeed.runtime.rollout.base", reason="needs the deepspeed extra")
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

    from hybrid_engine import rollout as ours
    from hybrid_engine.integrations.deepspeed import DeepSpeedRolloutEngine

    def adapter(phases: bool):
        engine, *_ = initialize(model=build_model("tiny-gpt2", seed=0), config={
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "hybrid_engine": {"enable_graph_capture": True, "sleep_between_phases": phases}})
        cfg = ours.RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=10_000)
        return engine, DeepSpeedRolloutEngine(engine, config=cfg)

    ids = torch.randint(4, 384, (2, 6), generator=torch.Generator().manual_seed(0))
    request = RolloutRequest(ids, torch.ones_like(ids))
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, top_k=0, n_samples_per_prompt=2)
    (plain_engine, plain), (engine, slept) = adapter(False), adapter(True)
    for call in range(3):
        a, b = slept.generate(request, sampling, seed=call), plain.generate(request, sampling, seed=call)
        assert torch.equal(a.input_ids, b.input_ids)
        assert engine.sleeping_tags == {"kv_cache", "optimizer"} and plain_engine.sleeping_tags == frozenset()
    assert slept.last_stats["wakes"] == 1 and slept.last_stats["graph_captures"] == 0
