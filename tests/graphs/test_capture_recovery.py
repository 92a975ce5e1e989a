"""A failed capture leaves the allocator usable, and captures in several threads are serialised.

On CUDA a capture that fails (a hook or the model's own code reading the host,
any refusal) leaves the caching allocator "recording" into its pool unless the
pool is ended and released, and a capture shares its stream with whatever
another thread issues there. The CPU emulation models both (a failed capture's
pool stays recording, ``empty_cache`` then raises; touching another thread's
capturing stream is refused), so these tests fail the way a GPU would.
"""

import threading
import warnings

import pytest
import torch
from conftest import left_padded_prompts as prompts

from hybrid_engine.accelerator import get_accelerator
from hybrid_engine.accelerator.cpu_graph import is_cpu_graph_capturing, recording_pools
from hybrid_engine.engine import initialize
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

SAMPLED = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5)


def rollout_for(model, graphs=True):
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, max_batch_size=4,
                                                           pad_token_id=0, eos_token_id=10_000))


def record_pool_handles(acc, monkeypatch) -> list:
    """Every pool handle the runner takes from ``acc``."""
    made = []
    real = acc.graph_pool_handle

    def handle():
        made.append(real())
        return made[-1]

    monkeypatch.setattr(acc, "graph_pool_handle", handle)
    return made


def syncing_lm_head(model):
    """The model's own code reads the host while capturing (as gpt_neo, falcon, mpt ... do): every capture fails."""
    real = model.lm_head.forward

    def forward(x):
        if is_cpu_graph_capturing():
            x.sum().item()
        return real(x)

    model.lm_head.forward = forward
    return lambda: model.lm_head.__dict__.pop("forward")


def assert_allocator_clean(acc, pools):
    assert recording_pools() == []
    acc.empty_cache()  # raises while a failed capture's pool still records
    assert pools and all(not p.recording and acc.graph_memory_bytes(p) == 0 for p in pools)


@pytest.mark.parametrize("failure", ["hook", "model code"])
def test_after_a_failed_capture_empty_cache_works_and_the_pools_bytes_fall_to_zero(failure, monkeypatch):
    acc = get_accelerator()
    model = build_model("tiny-gpt2", seed=3)
    request = RolloutRequest(*prompts(3, 5, seed=1))
    want = rollout_for(model, graphs=False).generate(request, SAMPLED)
    if failure == "hook":
        seen = []
        handle = model.transformer.h[0].register_forward_hook(lambda m, a, out: seen.append(float(out[0].sum())))
        undo = handle.remove
    else:
        undo = syncing_lm_head(model)
    pools = record_pool_handles(acc, monkeypatch)
    rollout = rollout_for(model)
    with pytest.warns(GraphRefusedWarning, match="transformer.h.0" if failure == "hook" else "capture failed"):
        got = rollout.generate(request, SAMPLED)
    undo()
    assert torch.equal(got.input_ids, want.input_ids)
    assert rollout.graph_stats.captures == 0 and rollout.graph_stats.fallbacks >= 1
    assert_allocator_clean(acc, pools)


def test_ten_failed_captures_in_a_row_leave_the_allocator_usable(monkeypatch):
    acc = get_accelerator()
    model = build_model("tiny-llama", seed=2)
    request = RolloutRequest(*prompts(2, 4, seed=3))
    want = rollout_for(model, graphs=False).generate(request, SAMPLED)
    pools = record_pool_handles(acc, monkeypatch)
    undo = syncing_lm_head(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)
        for _ in range(10):  # a runner stops trying after MAX_CAPTURE_FAILURES: ten runners, one failure each
            rollout = rollout_for(model)
            assert torch.equal(rollout.generate(request, SAMPLED).input_ids, want.input_ids)
            assert rollout.graph_stats.fallbacks == 1 and rollout.graph_stats.captures == 0
    undo()
    assert len(pools) == 10
    assert_allocator_clean(acc, pools)
    rollout = rollout_for(model)
    got = rollout.generate(request, SAMPLED)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.response_logprobs, want.response_logprobs)
    assert rollout.graph_stats.captures > 0 and rollout.graph_stats.fallbacks == 0


def test_a_hook_set_one_runner_could_not_capture_is_never_captured_again_by_another():
    """The engine and a rollout on the same model each have a runner: once one of them learnt that a hook cannot
    be captured, the other must not go through a failed capture (on CUDA an invalidated stream capture) to learn
    it again."""
    model = build_model("tiny-gpt2", seed=1)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    attempts = []

    def logging_hook(module, args, output):
        attempts.append(is_cpu_graph_capturing())
        float(output.sum())

    handle = model.lm_head.register_forward_hook(logging_hook)
    ids, mask = prompts(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)
        engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4)
        assert sum(attempts) == 1
        rollout = rollout_for(engine)
        rollout.generate(RolloutRequest(ids, mask), SAMPLED)
    assert sum(attempts) == 1, "the rollout's runner captured a hook set already refused"
    assert "lm_head" in rollout.graph_stats.last_refusal_reason
    handle.remove()
    rollout.generate(RolloutRequest(ids, mask), SAMPLED)  # without the hook, graphs come back
    assert rollout.graph_stats.captures > 0


def test_two_models_in_two_threads_capture_repeatedly_with_exact_tokens():
    """Each call drops its graphs, so both threads warm up and capture again and again at the same time. Each
    runner warms up and captures on a stream of its own, one capture at a time in the process; sharing one
    stream (the old pattern) is refused by the emulation (test_cpu_graph_strict)."""
    models = {"x": build_model("tiny-llama", seed=4), "y": build_model("tiny-gpt2", seed=5)}
    requests = {"x": RolloutRequest(*prompts(3, 5, seed=1)), "y": RolloutRequest(*prompts(2, 6, seed=2))}
    want = {k: rollout_for(models[k], graphs=False).generate(requests[k], SAMPLED) for k in models}
    rollouts = {k: rollout_for(models[k]) for k in models}
    rounds, errors, start = 4, [], threading.Barrier(2)
    got = {k: [] for k in models}

    def calls(name):
        try:
            start.wait(10)
            for _ in range(rounds):
                rollouts[name].runner.invalidate()
                got[name].append(rollouts[name].generate(requests[name], SAMPLED))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(k,), name=k) for k in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for name in models:
        stats = rollouts[name].graph_stats
        assert stats.captures >= rounds and stats.fallbacks == 0 and stats.replays > 0, (name, stats)
        assert stats.invalidations == rounds - 1
        for batch in got[name]:
            assert torch.equal(batch.input_ids, want[name].input_ids), name
            assert torch.equal(batch.response_logprobs, want[name].response_logprobs), name
    assert recording_pools() == []
