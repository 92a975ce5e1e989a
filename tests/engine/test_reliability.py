"""Reliability: concurrent callers are serialised, interrupted calls leave nothing behind, inputs on the
wrong device are refused clearly."""

import threading
import time

import pytest
import torch
from conftest import left_padded_prompts as prompts

from hybrid_engine.engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

SAMPLED = SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)


def rollout_for(model, graphs=True):
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, max_batch_size=4,
                                                           pad_token_id=0, eos_token_id=10_000))


def pause_first_decode_of(thread_name: str, model, entered: threading.Event, release: threading.Event):
    """A forward hook that, in the named thread only, stops in the first decode forward until ``release``."""
    state = {"paused": False}

    def hook(module, args, output):
        if threading.current_thread().name == thread_name and not state["paused"] and args[0].shape[1] == 1:
            state["paused"] = True
            entered.set()
            release.wait(timeout=1.0)  # the other call gets this long to run in the middle, if it is let in

    return model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("graphs", [True, False])
def test_concurrent_rollouts_on_one_model_each_get_their_own_answer(graphs):
    model = build_model("tiny-llama", seed=4)
    a_req, b_req = RolloutRequest(*prompts(3, 5, seed=1)), RolloutRequest(*prompts(4, 7, seed=2))
    expected = {"a": rollout_for(model, graphs).generate(a_req, SAMPLED),
                "b": rollout_for(model, graphs).generate(b_req, SAMPLED)}
    shared = rollout_for(model, graphs)
    shared.generate(b_req, SAMPLED)  # warm the shared object up: captures happen before the race
    entered, b_done = threading.Event(), threading.Event()
    handle = pause_first_decode_of("caller-a", model, entered, b_done)
    got, errors = {}, []

    def call(name, request, after=None):
        try:
            if after is not None:
                after.wait(timeout=5)
            got[name] = shared.generate(request, SAMPLED)
            if name == "b":
                b_done.set()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    a = threading.Thread(target=call, args=("a", a_req), name="caller-a")
    b = threading.Thread(target=call, args=("b", b_req, entered), name="caller-b")
    a.start()
    b.start()
    a.join(timeout=30)
    b.join(timeout=30)
    handle.remove()
    assert not a.is_alive() and not b.is_alive() and not errors
    for name in ("a", "b"):
        assert torch.equal(got[name].input_ids, expected[name].input_ids), name
        assert torch.equal(got[name].response_logprobs, expected[name].response_logprobs), name


@pytest.mark.parametrize("teardown", ["rollout.release", "engine.destroy"])
def test_release_and_destroy_wait_for_a_generate_running_in_another_thread(teardown):
    """Before, they freed the slots under the running call: AttributeError ('NoneType' has no 'device')."""
    model = build_model("tiny-llama", seed=4)
    request = RolloutRequest(*prompts(3, 5, seed=1))
    expected = rollout_for(model, graphs=False).generate(request, SAMPLED)
    rollout = rollout_for(model, graphs=False)
    engine, *_ = initialize(model=model, config={})
    entered, never = threading.Event(), threading.Event()
    handle = pause_first_decode_of("caller", model, entered, never)  # pauses one second inside the call
    got, errors = {}, []

    def call():
        try:
            got["batch"] = rollout.generate(request, SAMPLED)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def tear_down():
        entered.wait(timeout=5)
        (rollout.release if teardown == "rollout.release" else engine.destroy)()

    threads = [threading.Thread(target=call, name="caller"), threading.Thread(target=tear_down)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    handle.remove()
    assert entered.is_set() and not any(t.is_alive() for t in threads) and not errors
    assert torch.equal(got["batch"].input_ids, expected.input_ids)


def test_released_decode_buffers_are_freed_at_once_not_when_the_cyclic_collector_runs():
    """A release (or buffers regrown by a larger call) must give the KV cache back when the last reference
    goes: before, the slots sat in a reference cycle with their own views, held until a cyclic collection
    (the oldest generation's had never run in 200 calls of release_inference_cache)."""
    import gc
    import weakref

    rollout = rollout_for(build_model("tiny-llama", seed=4))
    small, large = RolloutRequest(*prompts(2, 5, seed=1)), RolloutRequest(*prompts(4, 9, seed=2))
    gc.collect()
    gc.disable()
    try:
        rollout.generate(small, SAMPLED)
        slots = weakref.ref(rollout.runner.slots)
        kv = weakref.ref(rollout.runner.slots.cache.pool.keys[0])
        rollout.release()
        assert slots() is None and kv() is None
        rollout.generate(small, SamplingConfig(max_new_tokens=4))
        slots = weakref.ref(rollout.runner.slots)
        rollout.generate(large, SamplingConfig(max_new_tokens=30))  # more rows and positions: new buffers
        assert slots() is None
    finally:
        gc.enable()


def test_engine_and_rollout_on_one_model_are_serialised_too():
    """They share the model's train/eval mode: interleaved, the first to return would put the model back in
    train mode (dropout on) under the other's feet."""
    model = build_model("tiny-gpt2", seed=2)  # GPT-2 has dropout 0.1
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    ids, mask = prompts(2, 4, seed=3)
    req = RolloutRequest(*prompts(3, 6, seed=4))
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    engine.train()
    want_engine = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    want_rollout = rollout_for(model).generate(req, greedy)
    rollout = rollout_for(engine)
    rollout.generate(req, greedy)
    assert model.training
    x_in, y_in, x_done = threading.Event(), threading.Event(), threading.Event()

    def hook(module, args, output):
        name = threading.current_thread().name
        if args[0].shape[1] != 1 or name not in ("x", "y") or getattr(hook, name, False):
            return
        setattr(hook, name, True)
        if name == "x":  # the engine call waits (up to 1 s) until the rollout call is inside too
            x_in.set()
            y_in.wait(timeout=1.0)
        else:  # the rollout call waits until the engine call has returned
            y_in.set()
            x_done.wait(timeout=5.0)

    handle = model.lm_head.register_forward_hook(hook)
    got = {}

    def call_engine():
        got["engine"] = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        x_done.set()

    def call_rollout():
        x_in.wait(timeout=5)
        got["rollout"] = rollout.generate(req, greedy)

    threads = [threading.Thread(target=call_engine, name="x"), threading.Thread(target=call_rollout, name="y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    handle.remove()
    assert torch.equal(got["engine"], want_engine)
    assert torch.equal(got["rollout"].input_ids, want_rollout.input_ids)
    assert model.training  # train mode restored once both are done


def test_a_second_model_warms_up_and_captures_only_after_the_first_models_capture_ends():
    """One capture at a time per process: CUDA capture belongs to the stream, and another thread's work or
    waits on a capturing stream are recorded into its graph or break it. Model Y, started while model X is
    stopped in the middle of its capture in another thread, runs no warm-up or capture (work on a graph
    stream) until X's capture ends; then both finish with graphs and exact tokens. Before, Y warmed up and
    captured on the very stream X was capturing on."""
    from hybrid_engine.accelerator import get_accelerator
    from hybrid_engine.accelerator.cpu_graph import is_cpu_graph_capturing

    acc = get_accelerator()
    x_model, y_model = build_model("tiny-llama", seed=4), build_model("tiny-gpt2", seed=5)
    x_req, y_req = RolloutRequest(*prompts(3, 5, seed=1)), RolloutRequest(*prompts(2, 6, seed=2))
    want = {"x": rollout_for(x_model, graphs=False).generate(x_req, SAMPLED),
            "y": rollout_for(y_model, graphs=False).generate(y_req, SAMPLED)}
    x_capturing, y_started = threading.Event(), threading.Event()
    y_during_x_capture = []  # the stream of every forward Y runs while X is held inside its capture

    def hold_x_capture(module, args, output):
        if is_cpu_graph_capturing() and not x_capturing.is_set():
            x_capturing.set()
            y_started.wait(timeout=10)
            time.sleep(0.5)  # Y gets this long to run inside X's capture, if it is let in
            x_capturing.clear()

    def watch_y(module, args, output):
        if x_capturing.is_set():
            y_during_x_capture.append(acc.current_stream())

    handles = [x_model.lm_head.register_forward_hook(hold_x_capture),
               y_model.lm_head.register_forward_hook(watch_y)]
    rollouts = {"x": rollout_for(x_model), "y": rollout_for(y_model)}
    got, errors = {}, []

    def call(name, request, after=None):
        try:
            if after is not None:
                assert after.wait(timeout=20)
                y_started.set()
            got[name] = rollouts[name].generate(request, SAMPLED)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=("x", x_req)),
               threading.Thread(target=call, args=("y", y_req, x_capturing))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for h in handles:
        h.remove()
    assert not errors and y_started.is_set()
    assert all(s is acc.default_stream() for s in y_during_x_capture), y_during_x_capture  # eager work only
    for name in ("x", "y"):
        stats = rollouts[name].graph_stats
        assert stats.captures > 0 and stats.fallbacks == 0, (name, stats)
        assert torch.equal(got[name].input_ids, want[name].input_ids), name
        assert torch.equal(got[name].response_logprobs, want[name].response_logprobs), name


def test_generate_from_inside_generate_is_refused_not_deadlocked():
    model = build_model("tiny-gpt2", seed=1)
    rollout = rollout_for(model)
    req = RolloutRequest(*prompts(2, 4))
    seen = []

    def reenter(module, args, output):
        if not seen:
            try:
                rollout.generate(req, SAMPLED)
            except RuntimeError as exc:
                seen.append(str(exc))

    handle = model.lm_head.register_forward_hook(reenter)
    rollout.generate(req, SAMPLED)
    handle.remove()
    assert seen and "in use" in seen[0] and "inside generate" in seen[0]
    assert torch.equal(rollout.generate(req, SAMPLED).input_ids, rollout_for(model).generate(req, SAMPLED).input_ids)


# ------------------------------------------------------------ devices
@pytest.mark.parametrize("device", ["meta", "cpu-but-model-elsewhere"])
def test_inputs_on_another_device_are_refused_naming_both(device, monkeypatch):
    model = build_model("tiny-gpt2", seed=1)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    rollout = rollout_for(engine)
    ids, mask = prompts(2, 4)
    if device == "meta":
        bad_ids, where = ids.to("meta"), "meta"
        with pytest.raises(ValueError, match="meta tensor"):
            RolloutRequest(bad_ids)
    else:  # the model claims another device (a real second device is not available here)
        import hybrid_engine.model_access as inputs

        monkeypatch.setattr(inputs, "model_device", lambda m: torch.device("cuda", 0))
        bad_ids, where = ids, "cuda:0"
        with pytest.raises(ValueError, match="is on cpu but the model is on cuda:0"):
            rollout.generate(RolloutRequest(ids, mask), SAMPLED)
    with pytest.raises(ValueError, match=where):
        engine.generate(input_ids=bad_ids, max_new_tokens=3)
    monkeypatch.undo()
    # Nothing was touched: both still work and agree with a fresh eager engine.
    eager, *_ = initialize(model=model, config={})
    assert torch.equal(engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5),
                       eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5))
    req = RolloutRequest(ids, mask)
    assert torch.equal(rollout.generate(req, SAMPLED).input_ids, rollout_for(model).generate(req, SAMPLED).input_ids)


# ------------------------------------------------------------ interrupted calls
class Injected(RuntimeError):
    pass


def arm(where, model, monkeypatch, exc):
    """Raise ``exc`` once at ``where``; return a flag list that records the firing."""
    import hybrid_engine.decode.staging as admission
    import hybrid_engine.graphs.runner as runner_module
    from hybrid_engine.accelerator import CPUGraph, get_accelerator
    from hybrid_engine.decode.slots import DecodeSlots

    class Fired(list):
        handle = None

    fired = Fired()

    def once():
        if not fired:
            fired.append(where)
            raise exc

    if where == "prefill":
        for mod in (runner_module, admission):
            real = mod.prefill
            monkeypatch.setattr(mod, "prefill", lambda *a, _real=real, **k: (once(), _real(*a, **k))[1])
    elif where == "capture":
        real_step = DecodeSlots.step

        def step(self, m, key, span=None):
            if get_accelerator().is_current_stream_capturing():
                once()
            return real_step(self, m, key, span)

        monkeypatch.setattr(DecodeSlots, "step", step)
    elif where == "replay":
        real_replay = CPUGraph.replay
        count = []

        def replay(self):
            real_replay(self)  # the step's work is done, then the call is interrupted
            count.append(1)
            if len(count) == 3:
                once()

        monkeypatch.setattr(CPUGraph, "replay", replay)
    else:  # a user's forward hook, in an eager prompt forward
        handle = model.get_input_embeddings().register_forward_hook(
            lambda m, a, out: once() if a[0].shape[1] > 1 else None)  # in a prompt forward
        fired.handle = handle
    return fired


@pytest.mark.parametrize("where", ["prefill", "capture", "replay", "hook"])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, Injected])
@pytest.mark.parametrize("path", ["engine", "rollout"])
def test_an_interrupted_call_propagates_and_the_next_calls_are_exact(path, kind, where, monkeypatch):
    if where == "capture" and kind is Injected:
        pytest.skip("an ordinary exception inside capture is a capture failure: the call falls back to eager "
                    "(test_engine_graphs / test_rollout_errors); only BaseExceptions propagate from capture")
    model = build_model("tiny-qwen2", seed=7)
    device_hook = lambda m, a, out: out * 1.0  # noqa: E731 - a user's hook that captures: it must stay put
    model.lm_head.register_forward_hook(device_hook)
    ids_a, mask_a = prompts(3, 5, seed=1)
    ids_b, mask_b = prompts(2, 6, seed=2)
    if path == "engine":
        graph, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
        eager, *_ = initialize(model=model, config={})

        def call(obj, ids, mask):
            return obj.generate(input_ids=ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    else:
        graph, eager = rollout_for(model), rollout_for(model, graphs=False)

        def call(obj, ids, mask):
            return obj.generate(RolloutRequest(ids, mask), SAMPLED).input_ids
    want_a, want_b = call(eager, ids_a, mask_a), call(eager, ids_b, mask_b)
    model.train()  # generate runs in eval mode and must give train mode back, interrupted or not
    exc = kind("injected")
    fired = arm(where, model, monkeypatch, exc)
    with pytest.raises(kind) as info:
        call(graph, ids_a, mask_a)
    assert info.value is exc and fired  # propagated unchanged
    captured_before = graph.graph_stats.captures
    assert model.training and all(m.training for m in model.modules())
    assert list(model.lm_head._forward_hooks.values()) == [device_hook]  # hooks restored
    monkeypatch.undo()
    if fired.handle is not None:
        fired.handle.remove()
    for _ in range(2):  # the next calls are exactly what they would be without the interruption
        assert torch.equal(call(graph, ids_b, mask_b), want_b)
        assert torch.equal(call(graph, ids_a, mask_a), want_a)
    s = graph.graph_stats
    assert s.fallbacks == 0  # nothing left broken
    if where == "hook":  # removing the injected hook changed what graphs bake in: one recapture, per key
        assert s.invalidations == 1 and s.captures - captured_before == s.graph_keys
    else:  # no key (bucket, span, sampling mode) captured twice
        assert s.invalidations == 0 and s.captures == s.graph_keys
