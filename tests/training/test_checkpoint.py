"""Checkpoint and resume (ZeRO stage 0): DeepSpeed's names and return values, bit-identical resume."""

import copy
import dataclasses
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import left_padded_prompts as prompts

from hybrid_engine import initialize
from hybrid_engine.tiny_models import build_model
from hybrid_engine.training.checkpoint import STATE_FILE
from hybrid_engine.training.checkpoint_files import MANIFEST_FILE

pytestmark = pytest.mark.slow  # launches processes (tests/tiers.py)

HERE = Path(__file__).resolve().parent


def run_isolated(*args: str, timeout: float = 120) -> None:
    """Run the checkpoint script in a fresh process; a hard timeout kills its whole process group."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "checkpoint_run.py"), *args], env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"checkpoint_run.py {args[0]} timed out after {timeout} s")
    assert proc.returncode == 0, output


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_isolated("full", str(ckpt), str(tmp_path / "full.pt"))
    assert (ckpt / "latest").read_text() == "global_step3" and (ckpt / "global_step3" / STATE_FILE).is_file()
    run_isolated("resume", str(ckpt), str(tmp_path / "resume.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resume.pt", weights_only=True)
    assert len(full["tokens"]) == len(resumed["tokens"]) == 3
    for a, b in zip(full["tokens"], resumed["tokens"]):
        assert torch.equal(a, b)  # sampled rollouts continue the same stream
    for name, w in full["weights"].items():
        assert torch.equal(w, resumed["weights"][name]), name
    assert full["lr"] == resumed["lr"] and full["steps"] == resumed["steps"] == 6
    assert resumed["captures"] >= 1  # the resumed engine captured its own graphs


def engine_with_state(**config):
    model = build_model("tiny-llama", seed=3)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                                "hybrid_engine": {"enable_graph_capture": True}, **config},
                           lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s))
    return model, engine


def train_once(engine, ids):
    engine.train()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.eval()


def test_save_load_round_trip_restores_everything_and_recaptures(tmp_path):
    model, engine = engine_with_state()
    ids, mask = prompts(2, 5)
    train_once(engine, ids)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True)
    engine.generate(**gen)
    assert engine.save_checkpoint(tmp_path, tag="mine", client_state={"epoch": 7}) is True
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    lr, steps, rng = engine.lr_scheduler.get_last_lr(), engine.global_steps, torch.get_rng_state()
    expected = engine.generate(**gen)  # what comes next, from the saved RNG state
    for _ in range(2):
        train_once(engine, ids)
    captures = engine.graph_stats.captures
    path, client = engine.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "mine") and client == {"epoch": 7}
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert engine.lr_scheduler.get_last_lr() == lr and engine.global_steps == steps
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(engine.generate(**gen), expected)
    s = engine.graph_stats
    assert s.invalidations >= 1 and s.captures > captures  # the graphs were dropped and recaptured


def test_optimizer_state_and_fp16_scaler_round_trip(tmp_path):
    model, engine = engine_with_state(fp16={"enabled": True, "initial_scale_power": 8})
    ids, _ = prompts(2, 5)
    train_once(engine, ids)
    engine.save_checkpoint(tmp_path)
    opt_state = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.optimizer.state_dict()["state"].items()}
    masters = [m.detach().clone() for m in engine.training_backend.masters.masters]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    scale = engine.cur_scale
    train_once(engine, ids)
    engine.training_backend.scaler.update(new_scale=3.0)
    engine.load_checkpoint(tmp_path)
    assert engine.cur_scale == scale
    # The fp32 masters come back exactly (not re-derived from the fp16 module), and the module with them.
    assert all(torch.equal(a, b) for a, b in zip(engine.training_backend.masters.masters, masters))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    for k, v in engine.optimizer.state_dict()["state"].items():
        for n, t in v.items():
            assert torch.equal(t, opt_state[k][n]), (k, n)


def test_missing_checkpoints_and_bad_arguments_are_clear(tmp_path):
    model, engine = engine_with_state()
    with pytest.warns(UserWarning, match="latest"):
        assert engine.load_checkpoint(tmp_path / "nothing") == (None, None)
    with pytest.warns(UserWarning, match="no checkpoint"):
        assert engine.load_checkpoint(tmp_path, tag="absent") == (None, None)
    with pytest.raises(TypeError, match="save_dir"):
        engine.save_checkpoint(42)
    with pytest.raises(ValueError, match="tag"):
        engine.save_checkpoint(tmp_path, tag="../escape")
    with pytest.raises(TypeError, match="client_state"):
        engine.save_checkpoint(tmp_path, client_state=[1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.save_checkpoint(tmp_path) is True  # still usable
    assert engine.load_checkpoint(tmp_path)[0] == str(tmp_path / "global_step0")


@pytest.mark.parametrize("content", [["not", "a", "dict"], {"format": 3}, b"\x00garbage", None],
                         ids=["a-list", "a-dict-missing-keys", "garbage-bytes", "truncated"])
def test_a_file_that_is_no_checkpoint_is_refused_by_name_and_changes_nothing(tmp_path, content):
    """Before: AttributeError ('list' has no 'get'), KeyError ('master_weights') or torch's unpickling errors."""
    model, engine = engine_with_state()
    assert engine.save_checkpoint(tmp_path, tag="good") is True
    path = tmp_path / "bad" / STATE_FILE
    path.parent.mkdir()
    if content is None:
        path.write_bytes((tmp_path / "good" / STATE_FILE).read_bytes()[:200])
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=f"{path} is not a hybrid-engine checkpoint of format 2 or 3"):
        engine.load_checkpoint(tmp_path, tag="bad")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert engine.load_checkpoint(tmp_path, tag="good")[0] == str(tmp_path / "good")


def test_lr_scheduler_is_stepped_with_the_optimizer_not_per_micro_step():
    model = build_model("tiny-gpt2", seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, *_ = initialize(model=model, optimizer=opt, lr_scheduler=sched, config={"gradient_accumulation_steps": 2})
    assert engine.lr_scheduler is sched
    ids, _ = prompts(2, 4)
    for _ in range(4):
        train_once(engine, ids)
    assert engine.global_steps == 2 and sched.get_last_lr() == [0.25]
    with pytest.raises(TypeError, match="lr_scheduler"):
        initialize(model=model, optimizer=opt, lr_scheduler=3)


@dataclasses.dataclass
class RunInfo:  # a client_state value that torch.load(weights_only=True) refuses
    name: str
    seen: set


def recorded_torch_loads(monkeypatch):
    """Every torch.load call's weights_only, from now on."""
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k.get("weights_only")) or real_load(*a, **k))
    return calls


def test_plain_client_state_loads_with_the_safe_unpickler_only(tmp_path, monkeypatch):
    _, engine = engine_with_state()
    train_once(engine, prompts(2, 5)[0])
    client = {"epoch": 3, "best": 1.25, "name": "run", "seen": [1, 2, (3, "x")], "ids": torch.arange(4),
              "nested": {"ok": True, "none": None}}
    assert engine.save_checkpoint(tmp_path, tag="plain", client_state=client) is True
    engine.save_checkpoint(tmp_path, tag="none")
    fresh = engine_with_state()[1]
    calls = recorded_torch_loads(monkeypatch)
    path, loaded = fresh.load_checkpoint(tmp_path, tag="plain")
    assert path == str(tmp_path / "plain") and sorted(loaded) == sorted(client)
    assert torch.equal(loaded.pop("ids"), client["ids"])
    assert loaded == {k: v for k, v in client.items() if k != "ids"}
    # Saved with plain or no client_state: never unpickled in full, even with the opt-in.
    assert fresh.load_checkpoint(tmp_path, tag="plain", trust_client_state=True)[1]["epoch"] == 3
    assert fresh.load_checkpoint(tmp_path, tag="none", trust_client_state=True) == (str(tmp_path / "none"), {})
    assert calls and all(c is True for c in calls), calls


def test_client_state_beyond_plain_data_needs_trust_client_state_at_load(tmp_path, monkeypatch):
    """Before, it was unpickled in full whenever present (a tampered one ran code on load)."""
    _, engine = engine_with_state()
    train_once(engine, prompts(2, 5)[0])
    client = {"epoch": 3, "best_loss": np.float64(1.25), "np_rng": np.random.get_state(),
              "info": RunInfo("run", {1, 2}), "ids": torch.arange(4)}
    assert engine.save_checkpoint(tmp_path, tag="np", client_state=client) is True
    # The engine's own state still loads with the safe unpickler; client_state is a pickle of its own inside.
    assert torch.load(tmp_path / "np" / STATE_FILE, weights_only=True)["global_steps"] == 1
    fresh = engine_with_state()[1]
    for _ in range(2):
        train_once(fresh, prompts(2, 5)[0])
    before = snapshot(fresh)
    calls = recorded_torch_loads(monkeypatch)
    with pytest.raises(ValueError, match=r"beyond plain data.*numpy.*can run code.*trust_client_state=True"):
        fresh.load_checkpoint(tmp_path)
    assert calls and False not in calls  # nothing was unpickled in full
    assert_unchanged(fresh, before)
    path, loaded = fresh.load_checkpoint(tmp_path, trust_client_state=True)
    assert False in calls
    assert path == str(tmp_path / "np") and sorted(loaded) == sorted(client) and fresh.global_steps == 1
    assert loaded["best_loss"] == 1.25 and isinstance(loaded["best_loss"], np.float64)
    assert loaded["np_rng"][0] == client["np_rng"][0] and np.array_equal(loaded["np_rng"][1], client["np_rng"][1])
    assert loaded["info"] == client["info"] and torch.equal(loaded["ids"], client["ids"])
    with pytest.raises(TypeError, match="trust_client_state"):
        fresh.load_checkpoint(tmp_path, trust_client_state="yes")
    monkeypatch.undo()
    # A client_state that cannot be pickled fails at save time, and writes nothing.
    with pytest.raises(TypeError, match="client_state cannot be pickled"):
        engine.save_checkpoint(tmp_path / "bad", client_state={"fn": lambda: 0})
    assert not (tmp_path / "bad").exists()


def snapshot(engine):
    return ({k: v.clone() for k, v in engine.module.state_dict().items()}, copy.deepcopy(engine.optimizer.state_dict()),
            engine.global_steps, torch.get_rng_state())


def assert_unchanged(engine, before):
    weights, opt, steps, rng = before
    assert all(torch.equal(v, weights[k]) for k, v in engine.module.state_dict().items())
    now = engine.optimizer.state_dict()
    assert now["param_groups"] == opt["param_groups"] and now["state"].keys() == opt["state"].keys()
    assert engine.global_steps == steps and torch.equal(torch.get_rng_state(), rng)


def test_loading_another_optimizers_state_is_a_clear_error_that_changes_nothing(tmp_path):
    _, adamw = engine_with_state()
    ids = prompts(2, 5)[0]
    train_once(adamw, ids)
    adamw.save_checkpoint(tmp_path)
    _, sgd = engine_with_state(optimizer={"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}})
    train_once(sgd, ids)
    before = snapshot(sgd)
    with pytest.raises(ValueError, match=r"AdamW optimizer state.*optimizer is SGD.*load_optimizer_states=False"):
        sgd.load_checkpoint(tmp_path)
    assert_unchanged(sgd, before)
    train_once(sgd, ids)  # still usable: its own SGD state, no KeyError: 'momentum'
    assert sgd.global_steps == 2
    assert sgd.load_checkpoint(tmp_path, load_optimizer_states=False)[0] == str(tmp_path / "global_step1")
    train_once(sgd, ids)
    # Same class, other param groups: also refused before anything is loaded.
    model = build_model("tiny-llama", seed=3)
    params = list(model.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], lr=1e-2)
    split, *_ = initialize(model=model, optimizer=two_groups)
    before = snapshot(split)
    with pytest.raises(ValueError, match=r"param groups of \[\d+\] parameters.*AdamW has \[2, \d+\]"):
        split.load_checkpoint(tmp_path)
    assert_unchanged(split, before)


def test_a_checkpoint_of_another_model_scheduler_or_trainable_set_is_refused_before_anything_loads(tmp_path):
    """load_state_dict copies what fits before it raises, and a scheduler of another type failed with a bare
    KeyError after the module, the masters and the optimizer were loaded: all of it is checked first now."""
    _, source = engine_with_state(bf16={"enabled": True})
    ids = prompts(2, 5)[0]
    train_once(source, ids)
    source.save_checkpoint(tmp_path)
    cases = []
    wide = build_model("tiny-llama", seed=3, intermediate_size=96)  # other shapes
    cases.append((initialize(model=wide, config={"bf16": {"enabled": True},
                                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})[0],
                  "does not fit this model .shapes differ"))
    _, step_lr = engine_with_state(bf16={"enabled": True})
    step_lr.training_backend.lr_scheduler = torch.optim.lr_scheduler.StepLR(step_lr.optimizer, 2)
    cases.append((step_lr, "another learning-rate scheduler than this engine's StepLR"))
    frozen_model = build_model("tiny-llama", seed=3)
    frozen_model.lm_head.weight.requires_grad_(False)  # another set of trainable parameters: other masters
    frozen, *_ = initialize(model=frozen_model, config={"bf16": {"enabled": True},
                                                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}},
                            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s))
    cases.append((frozen, "master weights"))
    for engine, match in cases:
        train_once(engine, ids)
        before = snapshot(engine)
        masters = [m.detach().clone() for m in engine.training_backend.masters.masters]
        with pytest.raises(ValueError, match=match):
            engine.load_checkpoint(tmp_path, load_optimizer_states=False)
        assert_unchanged(engine, before)
        assert all(torch.equal(a, b) for a, b in zip(engine.training_backend.masters.masters, masters))
        train_once(engine, ids)  # still usable
    assert step_lr.load_checkpoint(tmp_path, load_optimizer_states=False, load_lr_scheduler_states=False)[0]


def test_skipped_steps_round_trip(tmp_path):
    model, engine = engine_with_state(fp16={"enabled": True, "initial_scale_power": 8})
    ids = prompts(2, 5)[0]
    engine.backward(engine(input_ids=ids, labels=ids).loss * float("inf"))
    engine.step()
    train_once(engine, ids)
    assert engine.skipped_steps == 1
    engine.save_checkpoint(tmp_path)
    _, fresh = engine_with_state(fp16={"enabled": True, "initial_scale_power": 8})
    fresh.load_checkpoint(tmp_path)
    assert fresh.skipped_steps == 1 and fresh.global_steps == engine.global_steps


def test_format_2_checkpoints_still_load(tmp_path):
    """Checkpoints written before format 3: client_state inline, no optimizer class."""
    _, engine = engine_with_state()
    train_once(engine, prompts(2, 5)[0])
    engine.save_checkpoint(tmp_path)
    file = tmp_path / "global_step1" / STATE_FILE
    state = torch.load(file, weights_only=True)
    state.pop("optimizer_class", None)
    torch.save({**state, "format": 2, "client_state": {"epoch": 7}}, file)
    (file.parent / MANIFEST_FILE).unlink()  # written since format 4
    train_once(engine, prompts(2, 5)[0])
    assert engine.load_checkpoint(tmp_path) == (str(tmp_path / "global_step1"), {"epoch": 7})
    assert engine.global_steps == 1


def test_save_16bit_model_writes_the_weights_alone_as_deepspeed_does(tmp_path):
    from hybrid_engine import initialize
    from hybrid_engine.tiny_models import build_model

    model = build_model("tiny-gpt2", seed=5)
    engine, *_ = initialize(model=model, config={"bf16": {"enabled": True},
                                                 "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.save_16bit_model(tmp_path / "out") is True
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert state["transformer.wte.weight"].dtype == torch.bfloat16  # the module's dtype
    fresh = build_model("tiny-gpt2", seed=6, dtype=torch.bfloat16)
    fresh.load_state_dict(state)
    model.transformer.wte.weight.requires_grad_(False)
    engine.save_16bit_model(tmp_path / "out", "trainable.bin", exclude_frozen_parameters=True)
    assert "transformer.wte.weight" not in torch.load(tmp_path / "out" / "trainable.bin", weights_only=True)
