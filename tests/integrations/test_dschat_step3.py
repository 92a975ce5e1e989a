"""DeepSpeed-Chat's step 3 on hybrid_engine at ZeRO 0 in one process (issue 42).

The trainer (:mod:`tests.integrations.dschat_step3`) makes DeepSpeed-Chat's calls: the actor's generations go
through ``actor.module.generate`` and must be captured and replayed, fp16 must expose DeepSpeed's overflow
surface (with and without ``--align_overflow``), and after training the graph tokens must equal eager ones and
transformers' (greedy, teacher-forced arbiter where the paths' rounding could tie). ZeRO 2 and 3 on two ranks:
tests/distributed/test_dschat_step3_zero.py.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_engine
from hybrid_engine.tiny_models import PAD_ID, build_model
from tests.integrations.dschat_step3 import (
    PlainTrainer,
    Step3Trainer,
    ValueModel,
    actor_config,
    actor_model,
    prompts,
)
from tests.sampled_close import assert_greedy_close

ITERATIONS = 3
MAX_ANSWER = 8
#: How far below the fp32 argmax a greedy token of a 16-bit path may be (logits spread over about +-10 here):
#: a tie its rounding can break (the
#: paged cache and transformers' cache round differently from the first layer on).
LOGIT_ATOL = {"fp16": 0.5, "bf16": 1.0}


def build_trainer(precision: str, align_overflow: bool = False) -> Step3Trainer:
    torch.manual_seed(0)
    actor, *_ = hybrid_engine.initialize(model=actor_model(), config=actor_config(precision))
    ref, *_ = hybrid_engine.initialize(model=actor_model(), config={precision: {"enabled": True}})
    critic = PlainTrainer(ValueModel(seed=2))
    return Step3Trainer(actor, ref, critic, ValueModel(seed=3), max_answer=MAX_ANSWER,
                        align_overflow=align_overflow, precision=precision)


def eager_copy(actor, precision: str):
    """The trained weights in a second engine without graphs (the eager reference for the graph tokens)."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    model = actor_model(dtype=dtype)
    model.load_state_dict(actor.module.state_dict())
    engine, *_ = hybrid_engine.initialize(model=model, config={"hybrid_engine": {"max_out_tokens": 32}})
    return engine


@pytest.mark.parametrize("precision,align", [("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True)])
def test_step3_trains_with_the_actors_generations_captured_and_replayed(precision, align):
    trainer = build_trainer(precision, align)
    actor = trainer.actor
    before = [p.detach().clone() for p in actor.module.parameters()]
    for it in range(ITERATIONS):
        trainer.iteration(*prompts(4, 5, seed=it))
    stats = actor.graph_stats
    # module.generate went to engine.generate: captured and replayed, never delegated, never recaptured
    # (optimizer steps write in place; the throughput printer's _num_params is no part of any graph).
    assert stats.captures > 0 and stats.replays > 0 and stats.last_refusal_reason is None
    assert stats.invalidations == 0 and hasattr(actor.module, "_num_params")
    assert actor.global_steps == ITERATIONS and trainer.critic.steps == ITERATIONS
    assert len(trainer.overflow_log) == ITERATIONS
    assert all(isinstance(a, bool) and isinstance(c, bool) for a, c in trainer.overflow_log)
    if precision == "bf16":
        assert not actor.optimizer.overflow and actor.optimizer.loss_scale == 1.0
    # Every step that did not overflow changed the weights.
    applied = actor.global_steps - actor.skipped_steps
    changed = any(not torch.equal(a, b) for a, b in zip(before, actor.module.parameters()))
    assert changed == (applied > 0)
    # On the trained weights: graph tokens equal eager ones, and transformers' own generate's.
    ids, mask = prompts(4, 5, seed=99)
    kw = dict(attention_mask=mask, max_length=5 + MAX_ANSWER, pad_token_id=PAD_ID, do_sample=False)
    replays = actor.graph_stats.replays
    graph = actor.module.generate(ids, **kw)
    assert actor.graph_stats.replays > replays
    eager_engine = eager_copy(actor, precision)
    assert torch.equal(graph, eager_engine.generate(ids, **kw))
    transformers_out = type(actor.module).generate(actor.module, ids, **kw)  # the class's: transformers' own
    arbiter = actor_model()  # the trained weights in fp32: rounds neither path's way
    arbiter.load_state_dict({k: v.float() for k, v in actor.module.state_dict().items()})
    for r in range(ids.shape[0]):
        context = [int(t) for t, m in zip(ids[r], mask[r]) if m]
        assert_greedy_close(arbiter, context, graph[r, 5:], transformers_out[r, 5:], logit_atol=LOGIT_ATOL[precision],
                            name=f"row {r}")
    actor.destroy()
    assert "generate" not in actor.module.__dict__  # restored: transformers' generate again


def test_generate_is_routed_only_while_the_engine_lives_and_delegation_reaches_transformers():
    model = build_model("tiny-opt", seed=1)
    engine, *_ = hybrid_engine.initialize(model=model, config=actor_config("bf16"))
    ids, mask = prompts(2, 5, seed=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert engine.graph_stats.captures > 0 and engine.last_stats  # the unwrapped model's generate is routed too
    with pytest.warns(UserWarning, match="num_beams=2"):  # delegated: transformers' beam search, no recursion
        beams = engine.module.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    assert beams.shape == out.shape
    assert torch.equal(beams, type(model).generate(model, ids, attention_mask=mask, max_new_tokens=4, num_beams=2))
    engine.destroy()
    assert model.generate.__func__ is type(model).generate


@pytest.mark.parametrize("as_object", [False, True])
def test_graphs_without_the_hybrid_engine_switch_leave_the_models_generate_alone(as_object):
    """Only ``hybrid_engine.enabled: true`` given explicitly (DeepSpeed's switch) routes the model's generate, also
    when the config comes as an ``EngineConfig`` object (re-validated: ``enabled`` stays implied, not given)."""
    from hybrid_engine.config.loading import load_config

    model = build_model("tiny-opt", seed=1)
    config = {"hybrid_engine": {"enable_graph_capture": True}}
    engine, *_ = hybrid_engine.initialize(model=model, config=load_config(config) if as_object else config)
    assert "generate" not in model.__dict__ and engine.config.hybrid_engine.enabled


def _inf_loss(engine):
    ids, _ = prompts(2, 5, seed=1)
    return engine(input_ids=ids, labels=ids).loss * float("inf")


def _loss(engine):
    ids, _ = prompts(2, 5, seed=1)
    return engine(input_ids=ids, labels=ids).loss


def test_fp16_overflow_surface_has_deepspeeds_semantics():
    config = actor_config("fp16")
    config["fp16"]["hysteresis"] = 1  # DeepSpeed's default 2 absorbs the first overflow before backing off
    engine, opt, _, _ = hybrid_engine.initialize(model=build_model("tiny-opt", seed=1), config=config)
    assert isinstance(opt, torch.optim.Optimizer) and opt is engine.optimizer
    scale = opt.loss_scale
    assert opt.cur_scale == scale == 2.0 ** 16 and opt.overflow is False and opt.skip_step is False
    engine.backward(_inf_loss(engine))
    assert opt.check_overflow(external=True) is True and opt.overflow is True
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.step()  # skipped; the scale backs off
    assert opt.overflow is True and engine.skipped_steps == 1 and engine.global_steps == 1
    assert opt.loss_scale == opt.cur_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.backward(_loss(engine))
    assert opt.check_overflow() is False
    engine.step()
    assert opt.overflow is False and engine.skipped_steps == 1 and opt.loss_scale == scale / 2
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    # skip_step (DeepSpeed-Chat's --align_overflow, when the critic overflowed): skipped, scale kept, flag reset.
    after = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(_loss(engine))
    opt.skip_step = True
    engine.step()
    assert opt.skip_step is False and engine.skipped_steps == 2 and opt.loss_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(after, engine.module.parameters()))
    assert all(p.grad is None for p in engine.module.parameters())
    with pytest.raises(TypeError, match="external"):
        opt.check_overflow(external="yes")


@pytest.mark.parametrize("precision", ["bf16", None])
def test_bf16_and_fp32_report_no_overflow(precision):
    config = actor_config(precision or "bf16")
    if precision is None:
        del config["bf16"]
    engine, opt, _, _ = hybrid_engine.initialize(model=build_model("tiny-opt", seed=1), config=config)
    engine.backward(_inf_loss(engine))
    assert opt.check_overflow(external=True) is False
    engine.step()
    assert opt.overflow is False and opt.loss_scale == opt.cur_scale == 1.0


def test_latency_fields_and_the_per_generation_line(capsys):
    trainer = build_trainer("bf16")
    actor = trainer.actor
    trainer.iteration(*prompts(4, 5, seed=0))
    assert capsys.readouterr().out == ""  # the first eval() starts the clock, as DeepSpeed's
    trainer.iteration(*prompts(4, 5, seed=1))
    line = capsys.readouterr().out.strip()
    assert line.startswith("|E2E latency=") and "|Gather latency=" in line and "|Generate time=" in line
    assert "|Training time=" in line and "|Others=" in line and "|CurSamplesPerSec=" in line
    assert "|AvgSamplesPerSec=" in line and actor._iters == 1 and actor._total_batch_size == 4
    assert actor._generate_latency > 0 and actor._training_latency > 0  # since the last eval(), as DeepSpeed's
    assert actor._gather_latency == 0  # nothing is gathered below ZeRO-3
    # Without DeepSpeed's switch (hybrid_engine.enabled) the line is not printed; the fields are kept.
    quiet, *_ = hybrid_engine.initialize(model=build_model("tiny-opt", seed=1), config={})
    quiet.eval(), quiet.train(), quiet.eval()
    assert capsys.readouterr().out == "" and quiet._iters == 1


def test_lora_fuse_and_the_cache_calls():
    """fuse/unfuse on DeepSpeed-Chat-style LoRA layers (a ``fuse_lora_weight`` method per layer), in place;
    the next generate recaptures (the layers' flag is in the fingerprint) and equals eager decoding."""

    class LoRALinear(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear) -> None:
            super().__init__()
            self.weight, self.bias = base.weight, base.bias
            self.lora_right = torch.nn.Parameter(torch.randn(base.in_features, 2) * 0.1)
            self.lora_left = torch.nn.Parameter(torch.randn(2, base.out_features) * 0.1)
            self.fuse_lora = False

        def fuse_lora_weight(self) -> None:
            if not self.fuse_lora:
                self.weight.data += (self.lora_right @ self.lora_left).t()
            self.fuse_lora = True

        def unfuse_lora_weight(self) -> None:
            if self.fuse_lora:
                self.weight.data -= (self.lora_right @ self.lora_left).t()
            self.fuse_lora = False

        def forward(self, x):
            out = torch.nn.functional.linear(x, self.weight, self.bias)
            return out if self.fuse_lora else out + x @ self.lora_right @ self.lora_left

    torch.manual_seed(0)
    model = build_model("tiny-opt", seed=1)
    layer = model.model.decoder.layers[0].self_attn
    layer.q_proj = LoRALinear(layer.q_proj)
    engine, *_ = hybrid_engine.initialize(model=model, config={"hybrid_engine": {"enabled": True,
                                                                                 "enable_graph_capture": True}})
    ids, mask = prompts(2, 5, seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    unfused = engine.generate(ids, **kw)
    weight = layer.q_proj.weight.detach().clone()
    engine.fuse_lora_weight()
    assert layer.q_proj.fuse_lora and not torch.equal(weight, layer.q_proj.weight)
    fused = engine.generate(ids, **kw)
    assert engine.graph_stats.invalidations == 1
    eager, *_ = hybrid_engine.initialize(model=model, config={})
    assert torch.equal(fused, eager.generate(ids, **kw))
    engine.unfuse_lora_weight()
    assert not layer.q_proj.fuse_lora and torch.allclose(weight, layer.q_proj.weight, atol=1e-6)
    assert unfused.shape == fused.shape
    engine.retake_inference_cache()  # DeepSpeed's workspace: here generate allocates what it needs itself
    engine.empty_partition_cache()
    assert torch.equal(engine.generate(ids, **kw), eager.generate(ids, **kw))
