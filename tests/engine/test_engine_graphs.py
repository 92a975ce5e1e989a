"""engine.generate on the decode graph runner, through the strict CPU graph emulation.

Every case compares graph tokens with eager tokens (and greedy ones with
transformers' ``generate``): pinned and unpinned lengths, EOS, sampling, left
padding, bucket compaction, refusals, capture failures, hooks and weight changes.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import left_padded_prompts as prompts

import hybrid_engine.generation.scheduler as scheduler
import hybrid_engine.graphs.runner as runner_module
from hybrid_engine.accelerator import CPUAccelerator, get_accelerator, set_accelerator
from hybrid_engine.accelerator.cpu_graph import is_cpu_graph_capturing
from hybrid_engine.config.loading import load_config
from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode import kv_storage
from hybrid_engine.engine import initialize
from hybrid_engine.graphs.policy import GraphRefusedWarning, validate_graph_capture_support
from hybrid_engine.graphs.runner import MAX_CAPTURE_FAILURES
from hybrid_engine.graphs.stats import GraphStats
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

N = 5


def engines(model, **he):
    graph, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True, **he}})
    eager, *_ = initialize(model=model, config={})
    return graph, eager


def gen(engine, ids, mask, n=N, pinned=True, **kw):
    return engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n if pinned else kw.pop("min_new_tokens", 0), **kw)


def emitted_eos(model, ids, mask, at):
    """Tokens the model really emits (greedy) at new-token index ``at[row]``: EOS ids that stop rows early."""
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(at.values()) + 1, do_sample=False)
    return sorted({int(free[row, ids.shape[1] + k]) for row, k in at.items()})


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-opt", "tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("batch,dtype", [(1, torch.float32), (4, torch.float32), (4, torch.bfloat16)])
def test_graph_tokens_equal_eager_one_capture_for_every_position(arch, batch, dtype):
    model = build_model(arch, seed=3, dtype=dtype)
    graph, eager = engines(model)
    ids, mask = prompts(batch, 4)
    expected = gen(eager, ids, mask)
    first = gen(graph, ids, mask)  # warm-up step, then one capture
    again = gen(graph, ids, mask)  # replays only
    assert torch.equal(first, expected) and torch.equal(again, expected)
    s = graph.graph_stats
    assert s.captures == 1 and s.graph_keys == 1 and s.buckets == (batch,)
    # Warmed up and captured before the first step (on free slots): every decode step replays.
    assert s.warmups == 1 and s.eager_steps == 0 and s.replays == 2 * (N - 1)
    assert s.last_refusal_reason is None and s.enabled and s.fallbacks == 0
    assert expected.shape == (batch, 4 + N)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-opt", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_unpinned_length_with_eos_replays_and_matches_transformers(arch):
    model = build_model(arch, seed=12)
    graph, eager = engines(model)
    ids, mask = prompts(4, 5)
    eos = emitted_eos(model, ids, mask, {0: 2, 2: 5})
    for lo in (0, 3):
        kw = dict(max_new_tokens=12, min_new_tokens=lo, do_sample=False, eos_token_id=eos, pad_token_id=0)
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
        for _ in range(2):
            out = graph.generate(input_ids=ids, attention_mask=mask, **kw)
            assert torch.equal(out, ref) and torch.equal(out, eager.generate(input_ids=ids, attention_mask=mask, **kw))
    s = graph.graph_stats
    assert s.last_refusal_reason is None and s.fallbacks == 0 and s.replays > 0
    assert s.captures == len(s.buckets) <= 3  # at most one per bucket (4, 2, 1), never one per position


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-opt", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_sampled_unpinned_with_eos_equals_eager_and_is_seeded(arch):
    model = build_model(arch, seed=1)
    graph, eager = engines(model)
    ids, mask = prompts(3, 4)
    kw = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=10)
    torch.manual_seed(0)
    probe = eager.generate(input_ids=ids, attention_mask=mask, **kw)
    kw["eos_token_id"] = int(probe[1, 4 + 3])  # a token row 1 really samples: it stops early
    kw["pad_token_id"] = 0
    outs = []
    for engine in (eager, graph, graph):
        torch.manual_seed(123)
        outs.append(engine.generate(input_ids=ids, attention_mask=mask, **kw))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.manual_seed(124)
    assert not torch.equal(graph.generate(input_ids=ids, attention_mask=mask, **kw), outs[0])
    s = graph.graph_stats
    assert s.fallbacks == 0 and s.replays > 0 and s.last_refusal_reason is None


def test_sampled_capture_issues_no_host_to_device_copy():
    """The engine's sampled step used to build ``torch.tensor(<python int>)`` inside capture (a blocking
    host-to-device copy on CUDA); the strict emulation refuses that, so a capture failure would show here."""
    model = build_model("tiny-gpt2", seed=2)
    graph, eager = engines(model)
    ids, mask = prompts(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphRefusedWarning)
        torch.manual_seed(7)
        out = gen(graph, ids, mask, n=6, do_sample=True, temperature=0.8)
    torch.manual_seed(7)
    assert torch.equal(out, gen(eager, ids, mask, n=6, do_sample=True, temperature=0.8))
    s = graph.graph_stats
    assert s.captures == 1 and s.fallbacks == 0


def test_width_and_length_changes_reuse_the_captured_graph():
    model = build_model("tiny-opt", seed=5)
    graph, eager = engines(model, max_out_tokens=64)
    for width, n in ((4, 5), (7, 5), (4, 9), (6, 3), (3, 20)):
        ids, mask = prompts(3, width, seed=width + n)
        assert torch.equal(gen(graph, ids, mask, n=n), gen(eager, ids, mask, n=n))
    s = graph.graph_stats
    # One capture per span the rows reach (pages of 16: up to 7 + 20 tokens is 2 pages), never another.
    assert s.captures == s.graph_keys == 2 and s.invalidations == 0 and s.buckets == (4,)
    assert s.span_buckets == (1, 2)


def test_sampling_modes_are_separate_keys_each_captured_once():
    model = build_model("tiny-llama", seed=6)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    modes = [dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0),
             dict(do_sample=True, temperature=1.0, top_k=10, top_p=0.9)]
    for _ in range(2):
        for kw in modes:
            torch.manual_seed(3)
            got = gen(graph, ids, mask, n=6, **kw)
            torch.manual_seed(3)
            assert torch.equal(got, gen(eager, ids, mask, n=6, **kw))
    s = graph.graph_stats
    assert s.captures == len(modes) == s.graph_keys


def test_finished_rows_move_to_the_smallest_bucket():
    model = build_model("tiny-gpt2", seed=12)
    graph, eager = engines(model)
    ids, mask = prompts(8, 4, seed=3)
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    # Declare as EOS what rows 0..6 emit early, but never what row 7 emits: the last slot runs the full
    # length, so it must move down into a free slot of a smaller bucket.
    eos = sorted({int(free[r, 4 + k]) for r, k in zip(range(7), (1, 2, 1, 3, 2, 1, 2))} - set(free[7, 4:].tolist()))
    kw = dict(do_sample=False, eos_token_id=eos, pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **kw)
    finished_early = int((ref[:, -1] == 0).sum())
    assert finished_early >= 5, "the probe should stop most rows early"
    calls = []
    real = scheduler.DecodeSlots.move

    def spy(self, src, dst):
        calls.append((src.tolist(), dst.tolist()))
        return real(self, src, dst)

    scheduler.DecodeSlots.move = spy
    try:
        for _ in range(2):
            assert torch.equal(gen(graph, ids, mask, n=16, pinned=False, **kw), ref)
    finally:
        scheduler.DecodeSlots.move = real
    assert torch.equal(gen(eager, ids, mask, n=16, pinned=False, **kw), ref)
    s = graph.graph_stats
    assert calls and all(7 in src for src, _ in calls) and all(max(dst) < 4 for _, dst in calls)
    assert min(s.buckets) < 8 and s.captures == s.graph_keys


def test_bigger_batch_grows_the_buffers_once():
    model = build_model("tiny-gpt2", seed=3)
    graph, eager = engines(model, max_out_tokens=32)
    for batch in (2, 5, 2, 1, 5):
        ids, mask = prompts(batch, 3, seed=batch)
        assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    s = graph.graph_stats
    # 2 -> bucket 2; 5 -> bucket 8 (new buffers: bucket 2's graph is dropped once); then 2, 1 and 8 reuse them.
    assert s.invalidations == 1 and s.buckets == (1, 2, 8) and s.captures == 1 + 3
    from hybrid_engine.decode.kv_cache import PagedKVCache

    # The pool holds what the contiguous rows of 8 x 32 tokens took (in whole pages), plus the null page.
    assert s.cache_memory_bytes >= PagedKVCache(model.config, 8, 32).memory_bytes()


def test_stats_fields_and_to_dict():
    graph, _ = engines(build_model("tiny-gpt2"))
    s = graph.graph_stats
    assert isinstance(s, GraphStats)
    d = s.to_dict()
    for name in ("replays", "captures", "fallbacks", "last_refusal_reason", "enabled",
                 "capture_seconds", "graph_memory_bytes", "cache_memory_bytes", "graph_keys", "invalidations"):
        assert name in d
    assert s.enabled and s.captures == 0 and s.graph_memory_bytes == 0
    gen(graph, *prompts(2, 3), n=4)
    s = graph.graph_stats
    assert s.capture_seconds > 0 and s.cache_memory_bytes > 0 and s.graph_keys == 1
    runner = graph.generate_runner
    # The emulated pool's bytes are reported on CPU too. The step writes into preallocated buffers, so
    # they are workspace, which graphs sharing the pool share: a smaller bucket's graph adds nothing.
    assert s.graph_memory_bytes == runner.accelerator.graph_memory_bytes(runner.graph_memory) > 0
    gen(graph, *prompts(1, 3), n=4)
    assert graph.graph_stats.graph_keys == 2 and graph.graph_stats.graph_memory_bytes == s.graph_memory_bytes


# ------------------------------------------------------------------ the policy
def test_graphs_off_by_default_without_warning():
    engine, *_ = initialize(model=build_model("tiny-gpt2"), config={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(engine, *prompts(1, 3), n=3)
    s = engine.graph_stats
    assert not s.enabled and s.captures == 0 and "enable_graph_capture is off" in s.last_refusal_reason


def test_zero3_refused_by_validator_and_by_engine_gate():
    # Without the gathered inference copy (which graph capture implies at ZeRO-3 unless given, as here).
    cfg = EngineConfig(zero_optimization={"stage": 3},
                       hybrid_engine={"enable_graph_capture": True, "zero3_gathered_inference_copy": False})
    assert "ZeRO stage 3" in validate_graph_capture_support(cfg, CPUAccelerator())
    # The runner's policy goes through the same validator (ZeRO-3 training itself: tests/distributed).
    model = build_model("tiny-gpt2")
    graph, eager = engines(model)
    graph.generate_runner.config = load_config(cfg)
    ids, mask = prompts(2, 3)
    with pytest.warns(GraphRefusedWarning, match="ZeRO stage 3") as rec:
        out = gen(graph, ids, mask, n=3)
        gen(graph, ids, mask, n=3)
    assert sum("ZeRO stage 3" in str(w.message) for w in rec) == 1
    assert torch.equal(out, gen(eager, ids, mask, n=3))
    s = graph.graph_stats
    assert s.captures == 0 and not s.enabled and s.fallbacks == 2 and "ZeRO stage 3" in graph.graph_refusal_reason()


@pytest.mark.parametrize(
    "he,match",
    [({"release_inference_cache": True}, "release_inference_cache"), ({"inference_tp_size": 2}, "inference_tp_size")],
)
def test_config_refusals_warn_once_and_run_eager(he, match, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # inference_tp_size may not exceed the launched ranks
    monkeypatch.setattr(kv_storage, "supports_release", lambda device: False)  # stand-in: a device without releasable storage
    model = build_model("tiny-qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # initialize's own TP warning
        graph, eager = engines(model, **he)
    ids, mask = prompts(2, 3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = gen(graph, ids, mask, n=3)
        gen(graph, ids, mask, n=3)
    assert sum(match in str(w.message) for w in rec) == 1
    assert torch.equal(out, gen(eager, ids, mask, n=3))
    s = graph.graph_stats
    assert s.captures == 0 and s.graph_keys == 0 and not s.enabled and match in s.last_refusal_reason


def test_backend_without_graphs_runs_eager():
    set_accelerator(CPUAccelerator(emulate_graphs=False))
    model = build_model("tiny-gpt2")
    graph, eager = engines(model)
    ids, mask = prompts(2, 3)
    with pytest.warns(GraphRefusedWarning, match="cannot capture graphs"):
        out = gen(graph, ids, mask, n=3)
    assert torch.equal(out, gen(eager, ids, mask, n=3)) and graph.graph_stats.captures == 0


def test_attention_implementation_outside_the_capturable_set_is_refused():
    from hybrid_engine.graphs.runner import DecodeGraphRunner

    model = build_model("tiny-llama")
    runner = DecodeGraphRunner(model)
    assert runner.refusal() is None
    model.config._attn_implementation = "flex_attention"
    assert "flex_attention" in runner.refusal() and "not capturable" in runner.refusal()
    model.config._attn_implementation = "sdpa"


def test_prompt_forward_never_graphed(monkeypatch):
    calls = []
    real = runner_module.prefill

    def spy(*a, **k):
        calls.append(get_accelerator().is_current_stream_capturing())
        return real(*a, **k)

    monkeypatch.setattr(runner_module, "prefill", spy)
    graph, _ = engines(build_model("tiny-llama"))
    gen(graph, *prompts(2, 4), n=4)
    gen(graph, *prompts(2, 4, seed=1), n=4)
    assert calls == [False, False]
    assert graph.graph_stats.captures == 1


# --------------------------------------------------------- capture failure
def fail_capture(module, at):
    """Make ``module`` read a value on the host during its ``at``-th capture: a real GraphCaptureError."""
    real = module.forward
    seen = {"n": 0}

    def forward(*a, **k):
        if get_accelerator().is_current_stream_capturing():
            n = seen["n"]
            seen["n"] += 1
            if n == at:
                float(a[0].sum().item())
        return real(*a, **k)

    module.forward = forward
    return lambda: module.__dict__.pop("forward")


def test_capture_failure_falls_back_to_eager_for_the_rest_of_the_call():
    model = build_model("tiny-llama", seed=2)
    graph, eager = engines(model)
    ids, mask = prompts(4, 5)
    expected = gen(eager, ids, mask, n=8)
    undo = fail_capture(model.lm_head, 0)
    with pytest.warns(GraphRefusedWarning, match="Graph capture failed") as rec:
        out = gen(graph, ids, mask, n=8)
    undo()
    assert torch.equal(out, expected)
    assert sum("Graph capture failed" in str(w.message) for w in rec) == 1
    s = graph.graph_stats
    assert s.fallbacks == 1 and s.captures == 0 and s.replays == 0 and s.eager_steps == 7 and s.enabled
    assert "Graph capture failed" in s.last_refusal_reason
    # Graphs work again on the next call.
    assert torch.equal(gen(graph, ids, mask, n=8), expected)
    s = graph.graph_stats
    assert s.captures == 1 and s.replays == 7 and s.last_refusal_reason is None


def test_repeated_capture_failures_disable_graphs_once():
    model = build_model("tiny-gpt2")
    graph, eager = engines(model)
    ids, mask = prompts(2, 3)
    expected = gen(eager, ids, mask, n=3)
    real = model.lm_head.forward

    def always_sync(x):
        if get_accelerator().is_current_stream_capturing():
            x.sum().item()
        return real(x)

    model.lm_head.forward = always_sync
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(MAX_CAPTURE_FAILURES + 2):
            assert torch.equal(gen(graph, ids, mask, n=3), expected)
    msgs = [str(w.message) for w in rec]
    assert sum("disabled for this engine" in m for m in msgs if m.startswith("Graph capture failed")) == 1
    s = graph.graph_stats
    assert s.captures == 0 and not s.enabled and "disabled" in s.last_refusal_reason
    assert s.fallbacks == MAX_CAPTURE_FAILURES + 2  # three failed captures, then two calls refused up front


def test_capture_does_not_disturb_the_eager_state_it_falls_back_to(monkeypatch):
    """A capture that fails after running most of the step leaves every buffer as before the capture."""
    model = build_model("tiny-qwen2", seed=4)
    graph, eager = engines(model)
    ids, mask = prompts(3, 4)
    expected = gen(eager, ids, mask, n=6)
    real = scheduler.DecodeSlots.step

    def step_then_sync(self, m, key, span=None):
        real(self, m, key, span)  # the whole step's work is issued ...
        if get_accelerator().is_current_stream_capturing():
            self.token_index.sum().item()  # ... then a host read fails the capture

    monkeypatch.setattr(scheduler.DecodeSlots, "step", step_then_sync)
    with pytest.warns(GraphRefusedWarning, match="Graph capture failed"):
        assert torch.equal(gen(graph, ids, mask, n=6), expected)


# ------------------------------------------------------------------ hooks
def boost(token):
    def hook(module, args, output):
        return output + 100.0 * torch.nn.functional.one_hot(torch.tensor(token), output.shape[-1]).to(output.dtype)

    return hook


def device_boost(token, vocab):
    bias = torch.zeros(vocab)
    bias[token] = 100.0

    def hook(module, args, output):
        return output + bias.to(output.dtype)  # device work only: captured and replayed

    return hook


def test_output_changing_hook_is_captured_not_dropped():
    model = build_model("tiny-llama", seed=3)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    plain = gen(eager, ids, mask)
    gen(graph, ids, mask)  # captured without the hook
    handle = model.lm_head.register_forward_hook(device_boost(77, model.config.vocab_size))
    try:
        expected = gen(eager, ids, mask)
        assert (expected[:, 4:] == 77).all() and not torch.equal(expected, plain)
        for _ in range(2):
            assert torch.equal(gen(graph, ids, mask), expected)  # the new hook forces a recapture
        s = graph.graph_stats
        assert s.invalidations == 1 and s.captures == 2 and s.fallbacks == 0 and s.last_refusal_reason is None
    finally:
        handle.remove()
    assert torch.equal(gen(graph, ids, mask), plain)  # and removing it does too
    assert graph.graph_stats.invalidations == 2


def test_hook_that_reads_the_host_refuses_graphs_naming_the_module():
    model = build_model("tiny-qwen2")
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    seen = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(float(o.sum().item())))
    pre = model.lm_head.register_forward_pre_hook(lambda m, a: (a[0] * 1.0,))
    try:
        expected = gen(eager, ids, mask)
        with pytest.warns(GraphRefusedWarning, match=r"forward hook .* on module 'model.layers.0.mlp'") as rec:
            assert torch.equal(gen(graph, ids, mask), expected)
            assert torch.equal(gen(graph, ids, mask), expected)
        assert len(rec) == 1
        s = graph.graph_stats
        assert s.captures == 0 and s.replays == 0 and "model.layers.0.mlp" in s.last_refusal_reason
        assert "model.layers.0.mlp" in graph.graph_refusal_reason()
        assert len(seen) > 0  # the hook ran on every eager step
    finally:
        handle.remove()
    # Without the hook (the pre-hook is device work), graphs come back.
    assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    s = graph.graph_stats
    assert s.captures == 1 and s.last_refusal_reason is None
    pre.remove()


@pytest.mark.parametrize("log", [lambda o: f"{o[:, -1, :2]}", lambda o: o[:, -1, :2].detach().to("cpu")],
                         ids=["formatted", "copied-to-cpu"])
def test_a_logging_hook_refuses_graphs_instead_of_going_silent(log):
    """Printing a tensor, or copying it to the host, reads it on the host: on CUDA the capture fails. The
    emulation refuses it too, so the hook keeps running (eagerly) instead of running at capture only and
    never again."""
    model = build_model("tiny-gpt2")
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    lines: list = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: lines.append(log(o)))
    try:
        expected = gen(eager, ids, mask)
        eager_lines = len(lines)
        with pytest.warns(GraphRefusedWarning, match=r"forward hook .* on module 'lm_head'") as rec:
            assert torch.equal(gen(graph, ids, mask), expected)
        assert rec[0].filename == __file__  # the warning points at the user's call, not at library code
        # It ran at every step of the graph engine's call too (plus once in the capture it aborted).
        assert len(lines) - eager_lines in (eager_lines, eager_lines + 1)
        assert graph.graph_stats.captures == 0 and graph.graph_stats.replays == 0
    finally:
        handle.remove()


def test_a_refusal_by_a_hook_the_fingerprint_ignores_lifts_when_the_hook_goes():
    """Gradient checkpointing's input-require-grads hooks are left out of the graph fingerprint; one that
    could not be captured all the same refuses graphs only while it is registered."""
    model = build_model("tiny-gpt2", seed=2)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)

    def make_inputs_require_grads(module, args, output):  # named as transformers' own, but reads the host
        output.sum().item()

    make_inputs_require_grads.__module__ = "transformers.modeling_utils"
    handle = model.transformer.wte.register_forward_hook(make_inputs_require_grads)
    with pytest.warns(GraphRefusedWarning, match="transformer.wte"):
        assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    assert graph.graph_stats.captures == 0
    handle.remove()
    assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    assert graph.graph_stats.captures == 1 and graph.graph_stats.last_refusal_reason is None


def test_a_hook_refusal_holds_while_trl_re_registers_its_inert_hook_every_step():
    """TRL adds one more input-require-grads hook at every step: the refusal of a hook that cannot be
    captured must hold through that, not be retried (one failed capture) at every call."""
    model = build_model("tiny-llama", seed=2)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    attempts = []

    def logging_hook(module, args, output):
        attempts.append(is_cpu_graph_capturing())
        output.sum().item()

    handle = model.lm_head.register_forward_hook(logging_hook)
    per_call = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)
        for _ in range(4):
            model.enable_input_require_grads()  # what TRL's trainer does at every step
            before = sum(attempts)
            assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
            per_call.append(sum(attempts) - before)
    handle.remove()
    assert per_call == [1, 0, 0, 0] and graph.graph_stats.captures == 0


def test_hooks_are_restored_after_capture():
    model = build_model("tiny-gpt2")
    graph, _ = engines(model)
    hook = device_boost(5, model.config.vocab_size)
    handle = model.lm_head.register_forward_hook(hook)
    gen(graph, *prompts(2, 3))
    assert list(model.lm_head._forward_hooks.values()) == [hook]
    handle.remove()


# ------------------------------------------------------------------ weights
def test_in_place_optimizer_update_is_seen_by_replay():
    model = build_model("tiny-gpt2", seed=4)
    graph, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True},
                                               "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}})
    eager, *_ = initialize(model=model, config={})
    ids, mask = prompts(2, 4)
    before = gen(graph, ids, mask)
    graph.train()
    target = torch.full_like(before, 7)  # train towards other tokens, so the output changes
    for _ in range(3):
        loss = graph(input_ids=target, labels=target).loss
        graph.backward(loss)
        graph.step()
    graph.eval()
    after = gen(graph, ids, mask)
    assert torch.equal(after, gen(eager, ids, mask))
    assert not torch.equal(after, before)  # the update changed the tokens
    s = graph.graph_stats
    assert s.captures == 1 and s.replays == 2 * (N - 1) and s.invalidations == 0


@pytest.mark.parametrize("how", ["load_state_dict_assign", "param_data_swap", "to_dtype"])
def test_reallocated_weights_are_detected_and_recaptured(how):
    model = build_model("tiny-llama", seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    before = gen(graph, ids, mask)
    if how == "load_state_dict_assign":
        model.load_state_dict(build_model("tiny-llama", seed=6).state_dict(), assign=True)
    elif how == "param_data_swap":
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.data = p.data + 0.5 * torch.randn(p.shape, generator=g)
    else:
        model.to(torch.bfloat16)
    after = gen(graph, ids, mask)
    assert torch.equal(after, gen(eager, ids, mask))
    if how != "to_dtype":  # bf16 may well pick the same tokens
        assert not torch.equal(after, before)
    s = graph.graph_stats
    assert s.invalidations == 1 and s.captures == 2 and s.graph_keys == 1


@pytest.mark.parametrize("path", ["engine", "rollout"])
def test_without_the_fingerprint_check_the_emulation_refuses_the_stale_replay(monkeypatch, path):
    """What the weight fingerprint guards against fails loudly in CPU CI: with the check disabled, replaying
    graphs whose weights were reallocated (the old memory freed) raises instead of reading stale weights,
    though every graph of the runner (decode buckets, prefill, admission) reads those weights."""
    import hybrid_engine.graphs.runner as graph_runner
    from hybrid_engine.accelerator import GraphReplayError

    model = build_model("tiny-llama", seed=5)
    ids, mask = prompts(4, 4)
    if path == "engine":
        engine, _ = engines(model)
        eos = emitted_eos(model, ids, mask, {0: 1, 1: 3})  # rows end unevenly: several buckets are captured

        def call():
            gen(engine, ids, mask, pinned=False, eos_token_id=eos)
            return engine.graph_stats
    else:
        rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, max_batch_size=2,
                                                                  pad_token_id=0, eos_token_id=10_000))
        request = RolloutRequest(ids, mask, max_new_tokens=[2, 5, 3, 5])

        def call():
            rollout.generate(request, SamplingConfig(max_new_tokens=5))
            return rollout.graph_stats
    call()
    monkeypatch.setattr(graph_runner, "graph_fingerprint", lambda model: "unchanged")
    stats = call()  # the same weights: the replays run
    assert stats.graph_keys + stats.admission_captures > 1 and stats.replays > 0
    for p in model.parameters():
        p.data = p.data * 1.5  # new storage; nothing holds the old one any more
    with pytest.raises(GraphReplayError, match="stale address"):
        call()


def _patch_head_forward(model):
    head, orig = model.lm_head, model.lm_head.forward
    head.forward = lambda x: orig(x) * -1.0  # an instance-level kernel patch, as Liger/Unsloth apply


class _LoudActivation(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 100.0 * x


def _swap_activation(model):
    for m in model.modules():
        if hasattr(m, "act_fn"):
            m.act_fn = _LoudActivation()


def _change_norm_eps(model):
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = 10.0


def _drop_a_layer(model):
    model.config.num_hidden_layers -= 1  # Llama's layer loop reads it at every forward (early-exit assistants)


def _transpose_a_square_weight(model):
    proj = model.model.layers[0].self_attn.o_proj
    assert proj.weight.shape[0] == proj.weight.shape[1]
    proj.weight.data = proj.weight.data.t()  # same address, dtype and shape: only the strides change


@pytest.mark.parametrize("change", [_patch_head_forward, _swap_activation, _change_norm_eps, _drop_a_layer,
                                    _transpose_a_square_weight],
                         ids=["submodule-forward-patched", "activation-swapped", "norm-eps-changed",
                              "config-num-layers-lowered", "weight-re-laid-out"])
def test_a_module_patched_swapped_or_reconfigured_after_capture_is_recaptured(change):
    """The captured step froze the module tree, its host attributes, the config and the weights' layout, not
    only the weights' addresses: a change to any must drop the graphs, or they replay the old model."""
    model = build_model("tiny-llama", seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    before = gen(graph, ids, mask)
    change(model)
    after = gen(graph, ids, mask)
    assert torch.equal(after, gen(eager, ids, mask))
    assert torch.equal(after, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N,
                                             min_new_tokens=N, do_sample=False))
    assert not torch.equal(after, before)
    s = graph.graph_stats
    assert s.invalidations == 1 and s.captures == 2
    gen(graph, ids, mask)  # nothing changed since: replayed, not captured again
    assert graph.graph_stats.captures == 2


def test_switches_a_decode_step_never_reads_do_not_recapture():
    """A training loop that turns ``use_cache`` off (or gradient checkpointing on) for its training forward and
    back for generation: neither changes a decode step (it passes use_cache=True itself, and checkpointing acts
    only in training mode), so neither may drop the graphs (each toggle recaptured everything)."""
    model = build_model("tiny-llama", seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    first = gen(graph, ids, mask)
    captures = graph.graph_stats.captures
    for toggle in range(2):
        model.config.use_cache = bool(toggle)
        (model.gradient_checkpointing_disable if toggle else model.gradient_checkpointing_enable)()
        assert torch.equal(gen(graph, ids, mask), first) and torch.equal(first, gen(eager, ids, mask))
    s = graph.graph_stats
    assert s.invalidations == 0 and s.captures == captures and s.replays > 0


def _patch_norm_class(monkeypatch, model):
    norm = type(model.model.norm)
    plain = norm.forward
    monkeypatch.setattr(norm, "forward", lambda self, x: plain(self, x) * -1.0)  # a class-level kernel patch


def _patch_attention_function(monkeypatch, model):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    plain = ALL_ATTENTION_FUNCTIONS[impl]

    def loud(module, query, *args, **kwargs):
        out, weights = plain(module, query, *args, **kwargs)
        return out * 3.0, weights

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, impl, loud)


@pytest.mark.parametrize("patch", [_patch_norm_class, _patch_attention_function],
                         ids=["module-class-forward", "registered-attention-function"])
def test_a_kernel_patched_on_the_class_or_registry_recaptures_and_again_when_undone(monkeypatch, patch):
    """Liger-style patchers replace a module class's forward or the attention function transformers looks up
    at every forward; graphs captured before must not replay after, nor graphs captured under the patch once
    it is undone."""
    model = build_model("tiny-llama", seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    before = gen(graph, ids, mask)
    with monkeypatch.context() as m:
        patch(m, model)
        patched = gen(graph, ids, mask)
        assert torch.equal(patched, gen(eager, ids, mask)) and not torch.equal(patched, before)
        assert graph.graph_stats.invalidations == 1
    assert torch.equal(gen(graph, ids, mask), before)
    s = graph.graph_stats
    assert s.invalidations == 2 and s.captures == 3 and s.replays > 0


def test_kernel_switches_changed_after_capture_recapture():
    """``sdpa_kernel`` (on every device) and the matmul precision pick the kernels a capture records: a graph
    captured under one choice replayed under another would not match eager steps to the bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build_model("tiny-llama", seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    gen(graph, ids, mask)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    assert graph.graph_stats.invalidations == 1
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if precision != "medium" else "high")
    try:
        assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert graph.graph_stats.invalidations == 2  # the graphs captured under MATH only are dropped
    gen(graph, ids, mask)
    assert graph.graph_stats.invalidations == 3 and graph.graph_stats.replays > 0


_NEW_PRECISION_API = """
import torch
from hybrid_engine.engine import initialize
from hybrid_engine.tiny_models import build_model

model = build_model("tiny-llama", seed=5)
cfg = {"hybrid_engine": {"enabled": True, "enable_graph_capture": True, "max_out_tokens": 64}}
graph, eager = initialize(model=model, config=cfg)[0], initialize(model=model, config={})[0]
ids = torch.randint(4, 300, (2, 4), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
run = lambda e: e.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
first = run(graph)
before = graph.graph_stats.captures
torch.backends.cuda.matmul.fp32_precision = "tf32"  # the per-backend API (torch >= 2.9): numerics on CPU unchanged
assert torch.equal(run(graph), run(eager)) and torch.equal(run(graph), first)
stats = graph.graph_stats
assert stats.invalidations == 1 and stats.captures == 2 * before and stats.fallbacks == 0, stats
print("ok")
"""


@pytest.mark.slow
def test_the_per_backend_matmul_precision_api_is_a_kernel_switch_too():
    """torch >= 2.9's ``torch.backends.<backend>.fp32_precision``: once set, torch's legacy
    ``get_float32_matmul_precision()`` raises, which made every ``generate`` call fail. It is read per
    backend now, and a change recaptures like the legacy switch. (In a subprocess: the mixed-API state is
    process-wide and cannot be undone.)"""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend fp32_precision")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", _NEW_PRECISION_API], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_invalidate_graphs_drops_them_for_a_patch_no_fingerprint_sees(monkeypatch):
    """A module-level function patched after capture (here Llama's rotary embedding) is invisible to the graph
    fingerprint: ``invalidate_graphs()`` is the documented way to recapture."""
    import transformers.models.llama.modeling_llama as llama

    model = build_model("tiny-llama", seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    gen(graph, ids, mask)
    plain = llama.apply_rotary_pos_emb
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", lambda q, k, *a, **kw: plain(-q, k, *a, **kw))
    graph.invalidate_graphs()
    assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    s = graph.graph_stats
    assert s.invalidations == 1 and s.captures == 2 and s.replays > 0


@pytest.mark.parametrize("keep_old", [True, False], ids=["old-tensor-still-held", "old-tensor-dropped"])
def test_a_plain_tensor_attribute_re_assigned_after_capture_is_recaptured(keep_old):
    """A tensor held as a plain module attribute (neither a parameter nor a buffer), read by a captured hook:
    the graph reads it by address, so assigning a new tensor must recapture. Before, the graph replayed the
    old value silently (old tensor still held) or every later call raised a stale-address error."""
    model = build_model("tiny-llama", seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    head = model.lm_head
    head.scale = torch.ones(())
    handle = head.register_forward_hook(lambda m, i, o: o * m.scale)
    try:
        before = gen(graph, ids, mask)
        old = head.scale
        head.scale = torch.full((), -1.0)
        if not keep_old:
            del old
        after = gen(graph, ids, mask)
        assert torch.equal(after, gen(eager, ids, mask)) and not torch.equal(after, before)
        s = graph.graph_stats
        assert s.invalidations == 1 and s.captures == 2
        head.scale.fill_(2.0)  # an in-place update is read by the next replay, with no recapture
        assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
        assert graph.graph_stats.captures == 2
    finally:
        handle.remove()


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("delta", [64, -16])
def test_resized_token_embeddings_between_calls(arch, delta):
    """resize_token_embeddings changes the logits width the slots' EOS mask is sized by: the slots are
    reallocated (before, every later call failed on a shape mismatch deep in sampling)."""
    model = build_model(arch, seed=5)
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    gen(graph, ids, mask)
    model.resize_token_embeddings(model.config.vocab_size + delta)
    after = gen(graph, ids, mask)
    assert torch.equal(after, gen(eager, ids, mask))
    assert torch.equal(after, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N,
                                             min_new_tokens=N, do_sample=False))
    assert graph.graph_stats.replays > 0


def test_two_engines_side_by_side():
    m1, m2 = build_model("tiny-gpt2", seed=7), build_model("tiny-llama", seed=8)
    g1, e1 = engines(m1)
    g2, e2 = engines(m2)
    ids, mask = prompts(3, 4)
    x1, x2 = gen(e1, ids, mask), gen(e2, ids, mask)
    assert not torch.equal(x1, x2)
    for _ in range(2):
        assert torch.equal(gen(g1, ids, mask), x1)
        assert torch.equal(gen(g2, ids, mask), x2)
    for g in (g1, g2):
        assert g.graph_stats.captures == 1


def test_generate_in_train_mode_uses_inference_path_and_restores():
    model = build_model("tiny-gpt2", seed=1)  # GPT-2 has dropout 0.1
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    expected = gen(eager, ids, mask)
    graph.train()
    assert model.training
    assert torch.equal(gen(graph, ids, mask), expected)
    assert model.training and graph.training


def test_release_inference_cache_frees_the_buffers_after_each_call(monkeypatch):
    monkeypatch.setattr(kv_storage, "supports_release", lambda device: False)  # stand-in: a device without releasable storage
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)
        graph, eager = engines(build_model("tiny-gpt2"), release_inference_cache=True)
        ids, mask = prompts(2, 3)
        assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    assert graph.generate_runner.slots is None and graph.graph_stats.cache_memory_bytes == 0


def test_generate_under_autocast_equals_transformers_and_a_change_recaptures():
    model = build_model("tiny-qwen2", seed=9)
    graph, eager = engines(model)
    ids, mask = prompts(3, 4)
    outs = {}
    for on in (True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            ours = gen(graph, ids, mask, n=8, pinned=False)
            assert torch.equal(ours, gen(eager, ids, mask, n=8, pinned=False))
            assert torch.equal(ours, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                                    do_sample=False))
        outs.setdefault(on, ours)
        assert torch.equal(ours, outs[on])
    assert graph.graph_stats.replays > 0 and graph.graph_stats.invalidations == 2


@pytest.mark.parametrize("rope_type,graphed", [("dynamic", False), ("linear", True)])
def test_rope_rescaled_at_run_time_is_refused_up_front(rope_type, graphed):
    # transformers' dynamic (and longrope) RoPE reads the largest position on the host at every forward: each
    # capture would fail. A static rescaling (linear) captures like any other.
    import transformers

    rope = {"rope_type": rope_type, "factor": 2.0}
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw = {"rope_parameters": {**rope, "rope_theta": 10000.0}}
    else:
        kw = {"rope_scaling": rope}
    model = build_model("tiny-llama", seed=2, **kw)
    graph, eager = engines(model)
    ids, mask = prompts(2, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [gen(graph, ids, mask, n=6, pinned=False) for _ in range(3)]
    assert all(torch.equal(o, gen(eager, ids, mask, n=6, pinned=False)) for o in outs)
    assert torch.equal(outs[0], model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    s = graph.graph_stats
    refusals = [w for w in caught if issubclass(w.category, GraphRefusedWarning)]
    if graphed:
        assert s.replays > 0 and not refusals
    else:
        assert s.captures == 0 and len(refusals) == 1 and f"rope_type={rope_type!r}" in s.last_refusal_reason
