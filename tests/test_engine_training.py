"""The training side of HybridEngine: initialize, optimizer, autocast, loss scaling, accumulation, clipping."""

import copy
import json

import pytest
import torch

from hybrid_engine import HybridEngine, initialize
from hybrid_engine.tiny_models import build_model


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 384, (2, 6), generator=g)
    return dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize("kind,cls", [("AdamW", torch.optim.AdamW), ("adam", torch.optim.Adam), ("SGD", torch.optim.SGD)])
def test_optimizer_built_from_config(kind, cls):
    engine, opt = initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": kind, "params": {"lr": 0.01}}})
    assert isinstance(engine, HybridEngine) and isinstance(opt, cls) and engine.optimizer is opt
    assert opt.param_groups[0]["lr"] == 0.01


def test_passed_optimizer_is_used_and_config_path_accepted(tmp_path):
    model = build_model("tiny-gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    engine, out = initialize(model=model, optimizer=opt, config=str(path))
    assert out is opt and engine.config.gradient_accumulation_steps == 2 and engine.module is model


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_are_a_clear_error(stage):
    with pytest.raises(ValueError, match="ZeRO integration is not there"):
        initialize(model=build_model("tiny-gpt2"), config={"zero_optimization": {"stage": stage}})


def test_stage0_and_no_section_are_plain_pytorch():
    ref = build_model("tiny-llama", seed=1)
    model = copy.deepcopy(ref)
    engine, _ = initialize(
        model=model, config={"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    engine.train()
    ref.train()
    for step in range(2):
        loss = engine(**batch(step)).loss
        engine.backward(loss)
        engine.step()
        ref(**batch(step)).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b)
    assert engine.global_steps == 2


def test_gradient_accumulation_and_clipping():
    model = build_model("tiny-gpt2", seed=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref = copy.deepcopy(model)
    engine, _ = initialize(
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


def test_bf16_autocast():
    engine, _ = initialize(
        model=build_model("tiny-llama"), config={"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}}
    )
    out = engine(**batch())
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    engine.backward(out.loss)
    engine.step()
    assert engine.global_steps == 1 and next(engine.module.parameters()).dtype == torch.float32


def test_fp16_uses_grad_scaler():
    engine, _ = initialize(
        model=build_model("tiny-gpt2"),
        config={"fp16": {"enabled": True, "initial_scale_power": 8}, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}},
    )
    assert engine.loss_scale == 256.0
    before = [p.detach().clone() for p in engine.module.parameters()]
    out = engine(**batch())
    assert out.logits.dtype == torch.float16
    engine.backward(out.loss)
    engine.step()
    changed = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert changed or engine.loss_scale < 256.0  # stepped, or skipped an overflow and backed off


def test_train_eval_switch():
    model = build_model("tiny-gpt2")
    engine, _ = initialize(model=model, config={})
    engine.train()
    assert model.training
    engine.eval()
    assert not model.training and not engine.training
    with pytest.raises(RuntimeError, match="no optimizer"):
        engine.step()


def test_initialize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        initialize(model=None, config={})
    with pytest.raises(ValueError, match="optimizer.type"):
        initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "Lion"}})


def test_fp16_mode_with_half_weights_is_a_clear_error():
    model = build_model("tiny-gpt2").half()
    with pytest.raises(ValueError, match="float16 parameters"):
        initialize(model=model, config={"fp16": {"enabled": True}, "optimizer": {"type": "AdamW"}})
