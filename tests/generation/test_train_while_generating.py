"""A thread that trains while another generates on the same model waits its turn (and vice versa).

Found by an adversarial run: 55 of 456 training forwards ran in the eval mode a generate had set, dropout
switched on in the middle of an eager prefill (the trainer's ``engine.train()``), and 141 of 142
generations came from half-updated weights. The choice is to wait, as generate calls already wait for
each other (:mod:`hybrid_engine.generation.call_context`). Every thread here is joined under a timeout,
and daemonic, so a deadlock fails the test instead of hanging it.
"""

import threading
import time

import pytest
import torch
from conftest import left_padded_prompts as prompts

from hybrid_engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

JOIN_S = 120


class SlowSGD(torch.optim.SGD):
    """SGD that updates one parameter at a time, yielding the GIL in between: a generation let in during
    ``step`` would read half-updated weights. ``progress`` says whether an update is under way."""

    def __init__(self, params, progress: dict, lr: float = 1e-3) -> None:
        super().__init__(params, lr=lr)
        self.progress = progress

    @torch.no_grad()
    def step(self, closure=None):
        self.progress["in_step"] = True
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
                    time.sleep(0.0005)
        self.progress["version"] += 1
        self.progress["in_step"] = False


def run_threads(*targets, names):
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # surfaced below
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(fn), name=name, daemon=True) for fn, name in zip(targets, names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread is still running: deadlock or starvation"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("generator,graphs", [("engine.generate", False), ("rollout", False),
                                              ("engine.generate", True)])
def test_training_and_generation_in_two_threads_take_turns(generator, graphs):
    """Eager, every decode forward is seen by the hook; with graphs (replays run no module code) the
    prefills are."""
    model = build_model("tiny-gpt2", seed=2)  # GPT-2 has dropout: eval and train mode differ
    progress = {"in_step": False, "version": 0}
    engine, *_ = initialize(model=model, optimizer=SlowSGD(model.parameters(), progress),
                            config={"hybrid_engine": {"enable_graph_capture": graphs}})
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=graphs, max_batch_size=4,
                                                               pad_token_id=0, eos_token_id=10_000))
    ids, mask = prompts(2, 5, seed=1)
    request = RolloutRequest(*prompts(2, 5, seed=2))
    seen = {"train": [], "generate": []}  # per forward: (all modules in train mode, any in train mode, ...)
    current_call = {"id": None}

    def hook(module, args):
        name = threading.current_thread().name
        if name in seen:
            modes = [m.training for m in model.modules()]
            seen[name].append((all(modes), any(modes), progress["in_step"], progress["version"], current_call["id"]))

    handle = model.register_forward_pre_hook(hook)
    stop = threading.Event()
    spans = {}

    def train():
        spans["train"] = [time.perf_counter(), None]
        for _ in range(25):
            engine.train()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        spans["train"][1] = time.perf_counter()
        stop.set()

    def generate():
        spans["generate"] = [time.perf_counter(), None]
        calls = 0
        while not stop.is_set() or calls < 3:
            current_call["id"] = calls
            if generator == "rollout":
                rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=1.0, seed=calls))
            else:
                engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True)
            calls += 1
        spans["generate"][1] = time.perf_counter()

    try:
        run_threads(train, generate, names=["train", "generate"])
    finally:
        handle.remove()
    assert engine.global_steps == 25 and len(seen["train"]) == 25
    # The two ran at the same time (not one after the other), and generations fell between steps.
    assert spans["generate"][0] < spans["train"][1] and spans["train"][0] < spans["generate"][1]
    versions = {version for *_, version, _ in seen["generate"]}
    assert len(versions) > 1, "every generation ran before or after all of training: nothing was tested"
    # No training forward in eval mode; no generation forward in train mode (dropout) or during a step.
    assert all(all_train for all_train, *_ in seen["train"])
    assert not any(any_train for _, any_train, *_ in seen["generate"])
    assert not any(in_step for _, _, in_step, *_ in seen["generate"])
    # Each generation saw one set of weights from its first forward to its last.
    per_call = {}
    for *_, version, call in seen["generate"]:
        per_call.setdefault(call, set()).add(version)
    assert all(len(v) == 1 for v in per_call.values()), per_call
    assert model.training  # the trainer's mode, given back by the last generate


def test_a_step_waits_for_a_generation_that_holds_the_model():
    """Deterministic: a generation paused mid-decode; the step issued meanwhile runs only after it returns."""
    model = build_model("tiny-gpt2", seed=2)
    progress = {"in_step": False, "version": 0}
    engine, *_ = initialize(model=model, optimizer=SlowSGD(model.parameters(), progress), config={})
    ids, mask = prompts(2, 5, seed=1)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    entered, order = threading.Event(), []

    def pause(module, args, output):
        if threading.current_thread().name == "generate" and not entered.is_set() and args[0].shape[1] == 1:
            entered.set()
            time.sleep(0.5)  # the step's thread is waiting meanwhile
            order.append(("decode sees version", progress["version"]))

    handle = model.lm_head.register_forward_hook(pause)

    def generate():
        engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        order.append("generate returned")

    def step():
        assert entered.wait(timeout=30)
        engine.step()
        order.append("step returned")

    try:
        run_threads(generate, step, names=["generate", "step"])
    finally:
        handle.remove()
    assert order == [("decode sees version", 0), "generate returned", "step returned"]
    assert progress["version"] == 1


@pytest.mark.parametrize("inner", ["forward", "backward", "step", "train"])
def test_a_training_call_from_inside_generate_is_refused_naming_both(inner):
    model = build_model("tiny-gpt2", seed=2)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 1e-3}}})
    ids, mask = prompts(2, 5, seed=1)
    loss = engine(input_ids=ids, labels=ids).loss
    calls = {"forward": lambda: engine(input_ids=ids, labels=ids), "backward": lambda: engine.backward(loss),
             "step": engine.step, "train": engine.train}
    errors = []

    def hook(module, args):
        if not errors:
            try:
                calls[inner]()
            except RuntimeError as exc:
                errors.append(exc)

    handle = model.register_forward_pre_hook(hook)
    try:
        engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    finally:
        handle.remove()
    assert errors and f"HybridEngine.{inner}" in str(errors[0]) and "HybridEngine.generate" in str(errors[0])
    assert "cannot be nested" in str(errors[0])
    engine.backward(loss)  # the engine is still usable
    engine.step()
    assert engine.global_steps == 1


def test_generate_from_inside_a_training_forward_is_refused_naming_both():
    model = build_model("tiny-gpt2", seed=2)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 1e-3}}})
    ids, mask = prompts(2, 5, seed=1)
    errors = []

    def hook(module, args):
        if not errors and torch.is_grad_enabled():
            try:
                engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)
            except RuntimeError as exc:
                errors.append(exc)

    handle = model.register_forward_pre_hook(hook)
    try:
        engine(input_ids=ids, labels=ids)
    finally:
        handle.remove()
    assert errors and "HybridEngine.generate" in str(errors[0]) and "HybridEngine.forward" in str(errors[0])
    assert engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2).shape == (2, 7)
