"""The training side of HybridEngine at stage 0: initialize, optimizer, fp32 masters, loss scaling, accumulation, clipping."""

import copy
import json
import os
import sys
import warnings

import pytest
import torch

from hybrid_engine import HybridEngine, initialize
from hybrid_engine.tiny_models import build_model


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 384, (2, 6), generator=g)
    return dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize("kind,cls", [("AdamW", torch.optim.AdamW), ("adam", torch.optim.AdamW), ("SGD", torch.optim.SGD)])
def test_optimizer_built_from_config(kind, cls):
    engine, opt, _, _ = initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": kind, "params": {"lr": 0.01}}})
    assert isinstance(engine, HybridEngine) and isinstance(opt, cls) and engine.optimizer is opt
    assert opt.param_groups[0]["lr"] == 0.01


def test_passed_optimizer_is_used_and_config_path_accepted(tmp_path):
    model = build_model("tiny-gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    engine, out, _, _ = initialize(model=model, optimizer=opt, config=str(path))
    assert out is opt and engine.config.gradient_accumulation_steps == 2 and engine.module is model


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_without_deepspeed_say_how_to_install_it(stage, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    model = build_model("tiny-gpt2")
    with pytest.raises(ImportError, match=r"pip install 'hybrid-engine\[deepspeed\]'"):
        initialize(model=model, config={"zero_optimization": {"stage": stage}})
    engine, *_ = initialize(model=model, config={"zero_optimization": {"stage": 0}})  # stage 0 needs none
    assert engine.zero_stage == 0 and next(model.parameters()).dtype == torch.float32


def test_initialize_returns_what_deepspeed_initialize_returns():
    model = build_model("tiny-gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, optimizer, loader, sched = initialize(
        model=model, optimizer=opt, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1), config={})
    assert optimizer is opt and loader is None
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and sched is engine.lr_scheduler
    assert sched.optimizer is opt


def test_stage0_and_no_section_are_plain_pytorch():
    ref = build_model("tiny-llama", seed=1)
    model = copy.deepcopy(ref)
    engine, *_ = initialize(
        model=model, config={"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    )
    # DeepSpeed's defaults: its fused Adam's weight decay (0) and gradient_clipping 1.0.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    engine.train()
    ref.train()
    for step in range(2):
        loss = engine(**batch(step)).loss
        engine.backward(loss)
        engine.step()
        ref(**batch(step)).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b)
    assert engine.global_steps == 2


def test_gradient_accumulation_and_clipping():
    model = build_model("tiny-gpt2", seed=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref = copy.deepcopy(model)
    engine, *_ = initialize(
        model=model,
        config={"gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(**batch(0)).loss)
    assert not engine.is_gradient_accumulation_boundary() or engine.micro_steps == 1
    engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no update mid-accumulation
    assert engine.is_gradient_accumulation_boundary()
    engine.backward(engine(**batch(1)).loss)
    engine.step()
    assert engine.global_steps == 1 and all(p.grad is None for p in model.parameters())
    # Same as averaging the two losses, clipping to 0.5 and one SGD step by hand.
    loss = (ref(**batch(0)).loss + ref(**batch(1)).loss) / 2
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_parameters_train_through_fp32_masters(precision, dtype):
    model = build_model("tiny-llama")
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    engine, *_ = initialize(model=model, optimizer=opt, config={precision: {"enabled": True}})
    params = [p for p in model.parameters()]
    addresses = [p.data_ptr() for p in params]
    assert all(p.dtype == dtype for p in params)
    masters = [p for group in opt.param_groups for p in group["params"]]
    assert all(m.dtype == torch.float32 for m in masters) and not {id(m) for m in masters} & {id(p) for p in params}
    assert all(torch.equal(m, r) for m, r in zip(masters, reference.parameters()))  # the fp32 values, not rounded
    out = engine(**batch())
    assert out.logits.dtype == dtype and torch.isfinite(out.loss)
    for step in range(3):
        engine.backward(engine(**batch(step)).loss)
        engine.step()
    assert engine.global_steps == 3
    assert [p.data_ptr() for p in params] == addresses  # updated in place: captured graphs see the new weights
    assert all(torch.equal(p, m.to(dtype)) for p, m in zip(params, masters))
    # The masters keep updates below the low-precision resolution, which bf16/fp16 weights alone would lose.
    moved = sum(int(not torch.equal(m, r)) for m, r in zip(masters, reference.parameters()))
    lost = sum(int(not torch.equal(m, r) and torch.equal(m.to(dtype), r.to(dtype)))
               for m, r in zip(masters, reference.parameters()))
    assert moved == len(masters) and lost > 0


def test_fp16_uses_grad_scaler():
    engine, *_ = initialize(
        model=build_model("tiny-gpt2"),
        config={"fp16": {"enabled": True, "initial_scale_power": 8}, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}},
    )
    assert engine.cur_scale == 256.0
    before = [p.detach().clone() for p in engine.module.parameters()]
    out = engine(**batch())
    assert out.logits.dtype == torch.float16
    engine.backward(out.loss)
    engine.step()
    changed = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert changed or engine.cur_scale < 256.0  # stepped, or skipped an overflow and backed off


def test_fp16_overflow_skips_the_step_and_halves_the_scale_after_the_hysteresis():
    # DeepSpeed's default hysteresis is 2: the first overflow only uses it up, the second halves the scale.
    model = build_model("tiny-gpt2")
    engine, *_ = initialize(model=model, config={"fp16": {"enabled": True, "initial_scale_power": 8},
                                                 "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    before = [p.detach().clone() for p in model.parameters()]
    scales = []
    for _ in range(2):
        engine.backward(engine(**batch()).loss * float("inf"))
        engine.step()
        scales.append(engine.cur_scale)
    assert scales == [256.0, 128.0] and engine.global_steps == 2 and engine.skipped_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def _fp16_scales(fp16: dict, steps: str) -> list[float]:
    """Loss scales after each step of ``steps`` ("o": an overflowing step, ".": a clean one)."""
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "fp16": {"enabled": True, **fp16}, "optimizer": {"type": "SGD", "params": {"lr": 1e-4}}})
    out = []
    for i, kind in enumerate(steps):
        loss = engine(**batch(i)).loss
        engine.backward(loss * float("inf") if kind == "o" else loss)
        engine.step()
        out.append(engine.cur_scale)
    return out


def test_fp16_loss_scale_follows_deepspeeds_policy():
    # Values from DeepSpeed's LossScaler / DynamicLossScaler with the same settings.
    assert _fp16_scales({"loss_scale": 128}, "o..o.") == [128.0] * 5  # static: only skips
    window = {"initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}
    assert _fp16_scales(window, "o...") == [8.0, 8.0, 8.0, 16.0]
    assert _fp16_scales({**window, "min_loss_scale": 4}, "oo.") == [8.0, 4.0, 4.0]
    # An overflow at min_loss_scale cannot lower it: DeepSpeed's DynamicLossScaler stops the run (it raises).
    with pytest.raises(RuntimeError, match=r"already at fp16.min_loss_scale \(4\)"):
        _fp16_scales({**window, "min_loss_scale": 4}, "ooo")
    assert _fp16_scales({"initial_scale_power": 4, "loss_scale_window": 2}, "o.o") == [16.0, 16.0, 8.0]
    assert _fp16_scales({"initial_scale_power": 4, "loss_scale_window": 2, "consecutive_hysteresis": True},
                        "o.o") == [16.0, 16.0, 16.0]


def test_the_loss_scale_policy_travels_with_the_scaler_state():
    from hybrid_engine.training.local import LossScalePolicy, PolicyGradScaler

    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 1e-4}}})
    engine.backward(engine(**batch()).loss * float("inf"))
    engine.step()
    state = engine.training_backend.scaler.state_dict()
    other = PolicyGradScaler("cpu", LossScalePolicy(engine.config.fp16))
    other.load_state_dict(state)
    assert vars(other.policy) == vars(engine.training_backend.scaler.policy) and other.policy.hysteresis_left == 1


def test_adam_means_decoupled_weight_decay_unless_adam_w_mode_is_false_as_in_deepspeed():
    # DeepSpeed: "Optimizer name of Adam forces AdamW logic unless adam_w_mode is explicitly set".
    params = {"lr": 0.01, "weight_decay": 0.5}
    _, opt, *_ = initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "Adam", "params": params}})
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.5
    _, opt, *_ = initialize(model=build_model("tiny-gpt2"),
                            config={"optimizer": {"type": "Adam", "params": {**params, "adam_w_mode": False}}})
    assert type(opt) is torch.optim.Adam


def test_a_torch_scheduler_in_the_config_needs_no_deepspeed_and_deepspeeds_are_named_when_it_is_missing(monkeypatch):
    """A torch.optim.lr_scheduler type was refused with "install deepspeed" where DeepSpeed was not installed
    (the transformers-4.57 CI pass); only DeepSpeed's own schedule types need it."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError, as uninstalled
    _, opt, _, step_lr = initialize(model=build_model("tiny-gpt2"), config={
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}})
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ImportError, match="scheduler 'WarmupLR' is one of DeepSpeed's, which is not installed"):
        initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "SGD"},
                                                            "scheduler": {"type": "WarmupLR"}})
    with pytest.raises(ValueError, match="'WarmupLRR' is neither a DeepSpeed LR schedule .*WarmupLR.* nor a torch"):
        initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "SGD"},
                                                            "scheduler": {"type": "WarmupLRR"}})


def test_the_deepspeed_schedule_names_we_know_are_deepspeeds():
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from hybrid_engine.training.local import DEEPSPEED_LR_SCHEDULES

    assert set(DEEPSPEED_LR_SCHEDULES) == set(lr_schedules.VALID_LR_SCHEDULES)


def test_the_config_scheduler_section_is_built_with_deepspeeds_schedule_at_stage_0():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.lr_schedules import WarmupLR

    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10}}
    model = build_model("tiny-gpt2")
    engine, opt, _, scheduler = initialize(model=model, config={
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": sched})
    assert isinstance(scheduler, WarmupLR) and engine.lr_scheduler is scheduler
    reference = torch.optim.SGD(build_model("tiny-gpt2").parameters(), lr=0.1)
    expected = WarmupLR(reference, **sched["params"])
    for step in range(3):
        engine.backward(engine(**batch(step)).loss)
        engine.step()
        reference.step()
        expected.step()
        assert opt.param_groups[0]["lr"] == reference.param_groups[0]["lr"]
    assert 0 < opt.param_groups[0]["lr"] < 0.1
    with pytest.raises(ValueError, match="'WarmupLRR' is neither a DeepSpeed LR schedule .*WarmupLR.* nor a torch"):
        initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "SGD"},
                                                            "scheduler": {"type": "WarmupLRR"}})
    # A type DeepSpeed has no class of is torch's, as deepspeed.initialize falls back to torch.optim.lr_scheduler.
    _, opt, _, step_lr = initialize(model=build_model("tiny-gpt2"), config={
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}})
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)
    opt.step()
    step_lr.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("check", [True, False])
def test_bf16_steps_with_non_finite_gradients_are_skipped_as_in_deepspeed(check):
    model = build_model("tiny-gpt2")
    engine, *_ = initialize(model=model, config={"bf16": {"enabled": True, "check_grad_overflow": check},
                                                 "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(**batch()).loss * float("inf"))
    engine.step()
    assert engine.global_steps == 1 and engine.skipped_steps == int(check)
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    assert finite == check and all(torch.equal(a, b) for a, b in zip(before, model.parameters())) == check
    if check:  # the next finite step trains
        engine.backward(engine(**batch(1)).loss)
        engine.step()
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_initialize_reads_args_deepspeed_config_as_deepspeed_does(tmp_path):
    import argparse

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "gradient_accumulation_steps": 2}))
    engine, opt, *_ = initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=build_model("tiny-gpt2"))
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.05
    assert engine.config.gradient_accumulation_steps == 2
    # Both places at once: refused, as deepspeed.initialize asserts (before, config= won silently).
    for given in ({"config": {}}, {"config_params": {}}):
        with pytest.raises(ValueError, match="both as args.deepspeed_config and as config="):
            initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=build_model("tiny-gpt2"), **given)


def test_train_eval_switch():
    model = build_model("tiny-gpt2")
    engine, *_ = initialize(model=model, config={})
    engine.train()
    assert model.training
    engine.eval()
    assert not model.training and not engine.training
    with pytest.raises(RuntimeError, match="no optimizer"):
        engine.step()


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_an_optimizer_callable_builds_the_optimizer_from_the_parameters_as_deepspeed_does(precision):
    """deepspeed.initialize takes "Optimizer or Callable that returns an Optimizer"; before, stage 0 took the
    callable as the optimizer and failed later, in get_lr() or step()."""
    import functools

    config = {precision: {"enabled": True}} if precision else {}
    model = build_model("tiny-gpt2")
    engine, opt, _, _ = initialize(model=model, optimizer=functools.partial(torch.optim.SGD, lr=0.5), config=config)
    assert isinstance(opt, torch.optim.SGD) and engine.optimizer is opt and engine.get_lr() == [0.5]
    params = [p for g in opt.param_groups for p in g["params"]]
    want = torch.float32 if precision else next(model.parameters()).dtype
    assert len(params) == len(list(model.parameters())) and all(p.dtype == want for p in params)
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(**batch()).loss)
    engine.step()
    assert engine.global_steps == 1 and any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, a callable"):
        initialize(model=build_model("tiny-gpt2"), optimizer="adam", config={})
    with pytest.raises(TypeError, match="the optimizer callable must return a torch.optim.Optimizer, got list"):
        initialize(model=build_model("tiny-gpt2"), optimizer=lambda params: list(params), config={})


def test_initialize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        initialize(model=None, config={})
    with pytest.raises(ValueError, match="optimizer.type"):
        initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "Lion"}})
    with pytest.raises(TypeError, match="mpu must be a model-parallel unit with get_data_parallel_world_size"):
        initialize(model=build_model("tiny-gpt2"), config={}, mpu=object())


def test_a_half_model_gets_fp32_masters_from_its_own_values():
    model = build_model("tiny-gpt2").half()
    engine, opt, _, _ = initialize(model=model, config={"fp16": {"enabled": True}, "optimizer": {"type": "AdamW"}})
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 and torch.equal(m.half(), p) for m, p in zip(masters, model.parameters()))
    engine.backward(engine(**batch()).loss)
    engine.step()
    assert engine.global_steps == 1


def test_an_optimizer_with_state_or_foreign_parameters_is_refused_under_bf16():
    model = build_model("tiny-gpt2")
    used = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(**batch()).loss.backward()
    used.step()
    with pytest.raises(ValueError, match="already has state"):
        initialize(model=build_model("tiny-gpt2"), optimizer=used, config={"bf16": {"enabled": True}})
    foreign = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="parameter outside the model"):
        initialize(model=build_model("tiny-gpt2"), model_parameters=[foreign],
                   config={"bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_from_deepspeed_refuses_anything_but_a_deepspeed_engine():
    with pytest.raises(TypeError, match="DeepSpeedEngine returned by deepspeed.initialize"):
        HybridEngine.from_deepspeed(build_model("tiny-gpt2"))
    with pytest.raises(TypeError, match="got object"):
        HybridEngine.from_deepspeed(object())


def test_the_zero3_inference_copy_key_below_stage_3_warns_and_changes_nothing():
    model = build_model("tiny-gpt2")
    with pytest.warns(UserWarning, match="no effect below ZeRO stage 3"):
        engine, *_ = initialize(model=model, config={"hybrid_engine": {"zero3_gathered_inference_copy": True}})
    assert engine.inference_module is model


@pytest.mark.parametrize("given", [None, True])
def test_an_implied_zero3_copy_is_built_only_where_it_fits_half_the_free_memory(monkeypatch, given):
    """The copy decision itself, on an unpartitioned model (a copy of one is the same mechanism: ZeRO-3 proper in
    tests/distributed/test_one_process_zero.py). Free memory is hardware state: the probe is replaced."""
    import hybrid_engine.engine as engine_module
    from hybrid_engine.config.loading import load_config
    from hybrid_engine.distributed.inference_copy import InferenceCopy
    from hybrid_engine.graphs.policy import validate_graph_capture_support

    model = build_model("tiny-gpt2")
    need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    copy_key = {} if given is None else {"zero3_gathered_inference_copy": given}

    def decide(free):
        monkeypatch.setattr(engine_module, "free_memory", lambda device: free)  # test double: free device memory
        config = load_config({"zero_optimization": {"stage": 3},
                              "hybrid_engine": {"enable_graph_capture": True, **copy_key}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = engine_module._inference_copy(model, config)
        return built, config, [str(w.message) for w in caught]

    for free in (2 * need, None):  # fits in half of it; unknown free memory: built
        built, config, caught = decide(free)
        assert isinstance(built, InferenceCopy) and config.hybrid_engine.zero3_gathered_inference_copy and not caught
    built, config, caught = decide(2 * need - 1)  # just over half of it
    if given:  # asked for: built whatever it takes
        assert isinstance(built, InferenceCopy) and not caught
        return
    assert built is None and len(caught) == 1
    assert "more than 50% of the" in caught[0] and "GiB free on cpu" in caught[0] and "to true" in caught[0]
    # Taken back as if given: a reload keeps graphs refused, so generation decodes eagerly on gathered weights.
    assert not config.hybrid_engine.zero3_gathered_inference_copy
    assert "ZeRO stage 3" in validate_graph_capture_support(config)


def test_destroy_releases_the_graphs_and_a_stage_0_engine_still_works():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={"hybrid_engine": {"enable_graph_capture": True}})
    ids = batch()["input_ids"]
    first = engine.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert engine.graph_stats.graph_keys > 0
    engine.destroy()
    assert engine.graph_stats.graph_keys == 0
    assert torch.equal(engine.generate(input_ids=ids, max_new_tokens=4, do_sample=False), first)


def test_backward_and_step_take_deepspeeds_keyword_arguments_at_stage_0():
    # DeepSpeedEngine.backward(loss, retain_graph=False, scale_wrt_gas=True) and step(lr_kwargs=None).
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.lr_schedules import WarmupLR

    def grads(accumulation, **backward):
        model = build_model("tiny-gpt2", seed=3)
        engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                     "gradient_accumulation_steps": accumulation})
        loss = engine(**batch(1)).loss
        engine.backward(loss, **backward)
        return engine, loss, [p.grad.clone() for p in model.parameters()]

    _, _, plain = grads(1)
    _, _, halved = grads(2)
    _, _, unscaled = grads(2, scale_wrt_gas=False)
    assert all(torch.allclose(h * 2, p) for h, p in zip(halved, plain))
    assert all(torch.equal(u, p) for u, p in zip(unscaled, plain))  # not divided by the accumulation steps
    engine, loss, _ = grads(1, retain_graph=True)
    engine.backward(loss)  # the graph was kept: a second backward accumulates
    assert all(torch.allclose(p.grad, 2 * g) for p, g in zip(engine.module.parameters(), plain))
    with pytest.raises(TypeError, match="retain_graph must be True or False"):
        engine.backward(loss, retain_graph="yes")

    sched = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10}
    engine, opt, _, _ = initialize(model=build_model("tiny-gpt2"), config={
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR", "params": sched}})
    engine.backward(engine(**batch()).loss)
    engine.step(lr_kwargs={"last_batch_iteration": 5})  # to the scheduler's step, as DeepSpeed passes it
    reference = torch.optim.SGD(build_model("tiny-gpt2").parameters(), lr=0.1)
    WarmupLR(reference, **sched).step(last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] == reference.param_groups[0]["lr"] > 0
    with pytest.raises(TypeError, match="lr_kwargs must be a dict"):
        engine.step(lr_kwargs=[5])


def test_fp16_stage_0_over_two_ranks_is_refused_by_name_and_one_process_trains_in_pytorch(monkeypatch):
    fp16 = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "optimizer": {"type": "AdamW"}}
    # Stage 0 on two launched ranks trains on DeepSpeed, whose stage-0 fp16 optimizer never scales the loss.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"fp16.enabled with zero_optimization.stage 0: data-parallel training "
                                         r"over 2 ranks .* set zero_optimization.stage to 1 .* or use bf16"):
        initialize(model=build_model("tiny-gpt2"), config=fp16)
    monkeypatch.setenv("WORLD_SIZE", "1")
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config=fp16)  # one process: plain PyTorch fp16
    assert engine.cur_scale > 1


@pytest.mark.stub
def test_fp16_at_zero_is_refused_by_name_where_deepspeeds_accelerator_lacks_it(monkeypatch):
    """Stub at the hardware boundary: DeepSpeed's CPU accelerator reports fp16 from the CPU's own kernels
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported``: true on Intel CPUs with AVX-512 fp16, false on others), so
    the answer is stubbed to the one that CPUs without those kernels give. Where the CPU has them, ZeRO trains in
    fp16 (tests/distributed/test_one_process_zero.py)."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # Recorded as they are (set, then put back), so the one-rank launcher variables initialize fills in go at
        # teardown: a later test's subprocess must not inherit them.
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if name not in os.environ or not os.environ[name]:
            monkeypatch.delenv(name)
    fp16 = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 1}}
    with pytest.raises(ValueError, match="fp16.enabled: DeepSpeed's cpu accelerator does not support fp16.*bf16"):
        initialize(model=build_model("tiny-gpt2"), config=fp16)


@pytest.mark.parametrize("bad", [{"scheduler": {"type": "NoSuchLR"}}, {"optimizer": {"type": "AdamW",
                                                                                    "params": {"lr": "fast"}}}],
                         ids=["bad-scheduler", "bad-optimizer-params"])
def test_a_refused_bf16_setup_leaves_the_callers_model_in_its_own_precision(bad):
    model = build_model("tiny-gpt2", seed=1)
    config = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **bad}
    with pytest.raises((ValueError, ImportError)):  # ImportError: DeepSpeed's schedulers without DeepSpeed
        initialize(model=model, config=config)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    engine, *_ = initialize(model=model, config={"bf16": {"enabled": True},
                                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_frozen_parameters_passed_to_a_bf16_engine_are_left_out_as_deepspeed_does():
    """The PEFT pattern: model_parameters=model.parameters() with most of them frozen. The optimizer steps the
    fp32 masters of the trainable ones only (it was a ValueError about 'a parameter outside the model')."""
    model = build_model("tiny-gpt2", seed=1)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head") or ".h.1." in name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, *_ = initialize(model=model, model_parameters=model.parameters(), config={
        "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(stepped) == len(trainable) and all(p.dtype == torch.float32 for p in stepped)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine.backward(engine(**batch()).loss)
    engine.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_a_misspelt_scheduler_section_is_refused():
    for key in ("schedular", "Scheduler", "lr_scheduler"):
        with pytest.raises(ValueError, match=f"unknown top-level key '{key}'; did you mean 'scheduler'"):
            initialize(model=build_model("tiny-gpt2"), config={key: {"type": "WarmupLR"}})


def test_a_refused_step_changes_no_counter_and_a_failing_scheduler_step_still_spends_the_gradients():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={})
    with pytest.raises(RuntimeError, match="no optimizer"):
        engine.step()
    assert engine.training_backend.micro_steps == 0 and engine.global_steps == 0
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "SGD", "params": {"lr": 1e-2}}},
                            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    engine.backward(engine(**batch()).loss)
    with pytest.raises(TypeError):
        engine.step(lr_kwargs={"no_such_argument": 1})
    assert engine.global_steps == 1 and all(p.grad is None for p in engine.module.parameters())


def test_deepspeeds_engine_methods_answer_as_on_deepspeed():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert engine.gradient_accumulation_steps() == 3 and engine.train_micro_batch_size_per_gpu() == 2
    assert engine.train_batch_size() == 6 and engine.get_lr() == [1e-3]
    assert initialize(model=build_model("tiny-gpt2"), config={})[0].get_lr() == []


@pytest.mark.parametrize("betas", [0.9, [0.9], [0.9, 0.99, 0.1]])
def test_betas_that_are_not_a_pair_are_refused_by_name(betas):
    with pytest.raises(ValueError, match=r"optimizer.params.betas must be a pair"):
        initialize(model=build_model("tiny-gpt2"), config={
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": betas}}})


def test_torch_autocast_at_stage_0_is_refused_instead_of_ignored():
    config = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    with pytest.raises(ValueError, match=r"torch_autocast.enabled is applied by DeepSpeed's engine"):
        initialize(model=build_model("tiny-gpt2"), config=config)
    initialize(model=build_model("tiny-gpt2"), config={"torch_autocast": {"enabled": False}})  # off: nothing lost



@pytest.mark.parametrize("section", [{"amp": {"enabled": True}}, {"sparse_attention": {"mode": "fixed"}},
                                     {"progressive_layer_drop": {"enabled": True}}])
def test_sections_deepspeed_removed_are_refused_at_stage_0_instead_of_ignored(section):
    (key,) = section
    with pytest.raises(ValueError, match=f"{key} would change training"):
        initialize(model=build_model("tiny-gpt2"), config=section)
    if key != "sparse_attention":  # switched off: nothing is lost
        initialize(model=build_model("tiny-gpt2"), config={key: {"enabled": False}})


# ------------------------------------------------ steps that would write non-finite weights


def _trained(precision, bad_step):
    """An engine after three steps on batches 0, 1, 2, the second of them with lr 1e308 when ``bad_step``."""
    model = build_model("tiny-gpt2", seed=3)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **({precision: {"enabled": True}} if precision
                                                                         else {})}
    engine, opt, *_ = initialize(model=model, config=config)
    engine.eval()  # no dropout: both runs draw the same numbers whatever their step count
    caught = []
    for step in range(3):
        if step == 1 and not bad_step:
            continue
        opt.param_groups[0]["lr"] = 1e308 if step == 1 else 1e-3  # as a schedule or a user could set it
        engine.backward(engine(**batch(step)).loss)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            engine.step()
        caught += [w for w in seen if issubclass(w.category, RuntimeWarning)]
        if step == 1:
            assert not engine.training_backend.step_applied
    return engine, opt, caught


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_a_step_that_would_write_non_finite_weights_is_undone_and_counted(precision):
    """The gradients were finite; lr 1e308 made the update infinite, and every weight was NaN after the step.
    Now the step is undone (weights and optimizer state) and counted, as a step with non-finite gradients is,
    so the run continues exactly as if it had not been taken."""
    engine, opt, caught = _trained(precision, bad_step=True)
    reference, ref_opt, none = _trained(precision, bad_step=False)
    assert engine.skipped_steps == 1 and engine.training_backend.non_finite_updates == 1 and not none
    assert engine.global_steps == 3 and reference.global_steps == 2
    assert len(caught) == 1 and "would have written non-finite weights" in str(caught[0].message)
    assert "1e+308" in str(caught[0].message)
    for a, b in zip(engine.module.parameters(), reference.module.parameters()):
        assert torch.equal(a, b)
    stepped = [p for g in opt.param_groups for p in g["params"]]
    ref_stepped = [p for g in ref_opt.param_groups for p in g["params"]]
    for p, q in zip(stepped, ref_stepped):  # fp32 masters under bf16/fp16, and their Adam moments and counts
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[q][key]), key
    assert engine.cur_scale == reference.cur_scale


def test_an_fp32_step_with_non_finite_gradients_is_skipped_too():
    """In fp32 nothing checked the gradients, so a NaN loss wrote NaN into every weight."""
    model = build_model("tiny-gpt2")
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(**batch()).loss * float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite weights"):
        engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # the gradients are spent, as on any skipped step
    engine.backward(engine(**batch(1)).loss)
    engine.step()
    assert engine.skipped_steps == 1 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_weight_that_was_not_finite_before_the_step_does_not_make_every_step_skipped():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)
            self.unused = torch.nn.Parameter(torch.tensor([float("nan"), 1.0]))

        def forward(self, x):
            return self.linear(x).sum()

    model = Model()
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    before = model.linear.weight.detach().clone()
    engine.backward(engine(torch.ones(2, 3)))
    engine.step()
    assert engine.skipped_steps == 0 and not torch.equal(model.linear.weight, before)


# ------------------------------------------------------------------ LR schedules


def test_reduce_lr_on_plateau_steps_on_the_metric_given_and_without_one_nothing_steps():
    """It was a TypeError (missing 'metrics') from the scheduler after the optimizer had stepped."""
    model = build_model("tiny-gpt2")
    engine, opt, _, scheduler = initialize(model=model, config={
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "ReduceLROnPlateau", "params": {"factor": 0.5, "patience": 0}}})
    assert isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(**batch()).loss)
    for lr_kwargs in (None, {"last_batch_iteration": 1}):
        with pytest.raises(ValueError, match=r"ReduceLROnPlateau, which steps on a metric; pass it as "
                                             r"engine.step\(lr_kwargs=\{'metrics': value\}\)"):
            engine.step(lr_kwargs=lr_kwargs)
    assert engine.global_steps == 0 and engine.training_backend.micro_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())  # the gradients wait for the step
    engine.step(lr_kwargs={"metrics": 1.0})
    assert engine.global_steps == 1 and opt.param_groups[0]["lr"] == 0.1
    engine.backward(engine(**batch(1)).loss)
    engine.step(lr_kwargs={"metrics": 2.0})  # no better: with patience 0 the rate halves
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    # Inside an accumulation window nothing steps, so no metric is needed there.
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={
        "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        lr_scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o))
    engine.backward(engine(**batch()).loss)
    engine.step()
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        engine.step()


@pytest.mark.parametrize("scheduler,match", [
    ({"type": "StepLR", "params": {"step_size": 0}}, r"scheduler\.params\.step_size must be an int >= 1"),
    ({"type": "LRScheduler"}, r"scheduler\.type 'LRScheduler' is torch's abstract base class"),
    ({"type": "ExponentialLR", "params": {"gamma": 1e10}}, r"scheduler 'ExponentialLR' .* sets the learning rate to "
                                                           r"1000000000\.0 at step 1; a learning rate must be a "
                                                           r"finite number in \[0, 10\]"),
    ({"type": "ExponentialLR", "params": {"gamma": -1.0}}, r"sets the learning rate to -0\.1 at step 1"),
    ({"type": "StepLR", "params": {"step_size": 1, "last_epoch": 3}}, r"scheduler\.params are not valid for StepLR"),
])
def test_a_schedule_that_fails_or_leaves_the_sane_range_is_refused_at_initialize(scheduler, match):
    """StepLR with step_size 0 was a ZeroDivisionError and LRScheduler a NotImplementedError, both at the first
    step; a schedule is now stepped on a stand-in optimizer first, and the caller's optimizer is left alone."""
    model = build_model("tiny-gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        initialize(model=model, optimizer=opt, config={"scheduler": scheduler})
    assert opt.param_groups[0]["lr"] == 0.1 and "initial_lr" not in opt.param_groups[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_optimizer_whose_zero_grad_takes_no_argument_steps_as_deepspeed_calls_it(precision):
    """DeepSpeed's FusedAdam and FusedLion (DeepSpeed-Chat's default optimizer) define ``zero_grad(self)``, and
    DeepSpeed's engine calls it bare; found running DeepSpeed-Chat's own step 3, where every stage-0 step raised
    TypeError after the update. This optimizer has that signature (no DeepSpeed op built)."""

    class BareZeroGrad(torch.optim.AdamW):
        def zero_grad(self):  # the signature of deepspeed.ops.adam.FusedAdam.zero_grad
            self.bare_calls = getattr(self, "bare_calls", 0) + 1
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

    model = build_model("tiny-opt", seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = BareZeroGrad(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, optimizer, *_ = initialize(model=model, optimizer=opt if precision == "fp32" else
                                       (lambda params: BareZeroGrad(params, lr=1e-3)), config=config)
    ids = torch.randint(4, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
    assert engine.global_steps == 2 and optimizer.bare_calls >= 2
    assert all(p.grad is None for p in engine.module.parameters())
    assert any(not torch.equal(a, b.detach().to(a.dtype)) for a, b in zip(before, engine.module.parameters()))
