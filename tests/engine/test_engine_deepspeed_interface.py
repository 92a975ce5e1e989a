"""DeepSpeed's engine interface at stage 0: the queries, defaults and controls a DeepSpeed training script uses.

ZeRO 1-3 answer through DeepSpeed's own engine; tests/distributed/test_zero_delegation.py checks that stage 0's
answers equal DeepSpeed's there, side by side. These cases cover what that one config does not reach.
"""

import copy
import logging

import pytest
import torch

from hybrid_engine import initialize
from hybrid_engine.tiny_models import build_model


def batch(seed=0):
    ids = torch.randint(4, 384, (2, 6), generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, labels=ids)


def train_step(engine, seed=0):
    loss = engine.backward(engine(**batch(seed)).loss)
    engine.step()
    return loss


def test_deepspeed_defaults_clip_at_one_and_adam_without_weight_decay():
    """DeepSpeed 0.19.8 clips at 1.0 unless told otherwise, and its fused Adam (which torch's AdamW stands in
    for) decays at 0: the same config must train the same way here."""
    model = build_model("tiny-llama", seed=1)
    ref = copy.deepcopy(model)
    engine, opt, *_ = initialize(model=model, config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert engine.gradient_clipping() == 1.0 and opt.param_groups[0]["weight_decay"] == 0.0
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(2):
        train_step(engine, step)
        ref(**batch(step)).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert norm > 1.0 and engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-5)  # clipped
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    # torch's own optimizer when the config asks for it, with torch's defaults; no clipping when it is 0.
    engine, opt, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    assert opt.param_groups[0]["weight_decay"] == 0.01 and engine.gradient_clipping() == 0.0
    train_step(engine)
    assert engine.get_global_grad_norm() is None and engine.was_step_applied()


def test_step_outcome_counters_and_backward_value_follow_deepspeed():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    assert engine.global_samples == 0 and not engine.was_step_applied() and engine.get_global_grad_norm() is None
    seen = []
    for step in range(4):
        loss = engine(**batch(step)).loss
        returned = engine.backward(loss)
        assert torch.equal(returned, loss / 2)  # DeepSpeed returns the loss divided by the accumulation steps
        engine.step()
        seen.append((engine.was_step_applied(), engine.global_samples))
    assert seen == [(False, 0), (True, 4), (False, 4), (True, 8)]
    assert engine.optimizer_name() == "sgd" and engine.get_mom() == [0.9]
    assert (engine.zero_optimization_stage(), engine.fp16_enabled(), engine.bfloat16_enabled()) == (0, False, False)
    assert (engine.world_size, engine.dp_world_size, engine.global_rank, engine.local_rank) == (1, 1, 0, 0)
    assert engine.device == torch.device("cpu") and engine.steps_per_print() is None
    passed, *_ = initialize(model=build_model("tiny-gpt2"), optimizer=torch.optim.Adam)  # the caller's optimizer
    assert passed.optimizer_name() == "Adam" and passed.get_mom() == [(0.9, 0.999)]
    assert passed.global_samples is None  # no batch size configured: DeepSpeed would refuse such a config


def test_fp16_loss_scale_is_deepspeeds_configured_value_and_cur_scale_the_live_one():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "fp16": {"enabled": True, "initial_scale_power": 8}, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    assert engine.loss_scale() == 0.0 and engine.cur_scale == 256.0  # dynamic: DeepSpeed's loss_scale() is 0
    static, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "fp16": {"enabled": True, "loss_scale": 128.0}, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    assert static.loss_scale() == 128.0 and static.cur_scale == 128.0


def test_a_manual_accumulation_boundary_and_no_sync_behave_as_in_deepspeed():
    model = build_model("tiny-gpt2")
    engine, *_ = initialize(model=model, config={"gradient_accumulation_steps": 4,
                                                 "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    before = [p.detach().clone() for p in model.parameters()]
    with engine.no_sync():
        engine.backward(engine(**batch(0)).loss)
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.step()  # illegal inside, as in DeepSpeed, and nothing was counted
        with pytest.raises(RuntimeError, match="again inside itself"):
            with engine.no_sync():
                pass
    assert engine.micro_steps == 0 and engine.global_steps == 0
    engine.set_gradient_accumulation_boundary(True)  # the caller decides: step now, after one micro-batch
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    engine.set_gradient_accumulation_boundary(False)
    train_step(engine, 1)
    assert engine.global_steps == 1 and not engine.was_step_applied()
    with pytest.raises(TypeError, match="is_boundary must be True or False"):
        engine.set_gradient_accumulation_boundary(1)


def test_attributes_the_engine_lacks_are_the_models_as_on_deepspeeds_engine():
    model = build_model("tiny-gpt2")
    engine, *_ = initialize(model=model, config={})
    assert engine.generation_config is model.generation_config
    engine.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    assert engine.config is not model.config  # the engine's own attributes come first
    with pytest.raises(AttributeError, match="'HybridEngine' object .*has no attribute 'no_such_thing'"):
        _ = engine.no_such_thing


def test_an_engine_property_that_fails_inside_is_not_answered_by_the_model(monkeypatch):
    """``device`` exists on the model too: if the engine's own property fails, Python falls back to
    ``__getattr__``, which must not forward the name and hide the failure behind the model's answer."""
    from hybrid_engine.training.local import LocalTraining

    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={})

    def broken(self):
        raise AttributeError("the backend lost its scaler")

    monkeypatch.setattr(LocalTraining, "loss_scale", property(broken))
    with pytest.raises(AttributeError, match="HybridEngine.* has no attribute .cur_scale"):  # not the model's
        _ = engine.cur_scale
    monkeypatch.setattr("hybrid_engine.training.deepspeed_interface.model_device", lambda m: (_ for _ in ()).throw(
        AttributeError("no parameters")))
    with pytest.raises(AttributeError):
        _ = engine.device  # the model's .device would have answered "cpu"


def test_steps_per_print_logs_deepspeeds_progress_line(caplog):
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "steps_per_print": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with caplog.at_level(logging.INFO, logger="hybrid_engine.training.local"):
        for step in range(4):
            train_step(engine, step)
    lines = [r.getMessage() for r in caplog.records if r.name == "hybrid_engine.training.local"]
    assert lines == ["step=2, skipped=0, lr=[0.1], mom=[0]", "step=4, skipped=0, lr=[0.1], mom=[0]"]


def test_lr_kwargs_the_scheduler_does_not_take_are_named():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1))
    engine.backward(engine(**batch()).loss)
    with pytest.raises(TypeError, match=r"lr_kwargs=\{'increment': 1\}.*StepLR.step does not take them"):
        engine.step(lr_kwargs={"increment": 1})
    assert engine.global_steps == 1  # the optimizer step was taken, as the message says
    train_step(engine, 1)
    assert engine.global_steps == 2


def test_a_checkpoint_without_frozen_parameters_loads_and_keeps_them(tmp_path):
    """``exclude_frozen_parameters`` (a LoRA run saving its adapters only) and ``custom_load_fn``, as in DeepSpeed."""
    model = build_model("tiny-gpt2", seed=3)
    frozen = [name for name, p in model.named_parameters() if ".h.0." in name]  # (wte is tied to lm_head)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    train_step(engine)
    assert engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    saved = torch.load(tmp_path / "global_step1" / "hybrid_engine_states.pt", weights_only=True)
    assert frozen and not set(frozen) & set(saved["module"]) and saved["frozen_excluded"] == sorted(frozen)

    other = copy.deepcopy(model)
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    target, *_ = initialize(model=other, config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    path, _ = target.load_checkpoint(tmp_path)  # strict: the frozen ones are not missing, they stay as they are
    assert path is not None and target.global_steps == 1
    for name, p in other.named_parameters():
        expected = trained[name] + 1.0 if name in frozen else trained[name]
        torch.testing.assert_close(p.detach(), expected)

    calls = []
    target.load_checkpoint(tmp_path, load_module_only=True,
                           custom_load_fn=lambda src, dst: calls.append((sorted(src), dst)))
    assert calls == [(sorted(saved["module"]), other)]
    with pytest.raises(TypeError, match="custom_load_fn must be a callable"):
        target.load_checkpoint(tmp_path, custom_load_fn="mine")
    with pytest.raises(TypeError, match="exclude_frozen_parameters must be True or False"):
        target.save_checkpoint(tmp_path, exclude_frozen_parameters="yes")
