"""Per-position decode graphs of HybridEngine, through the CPU graph emulation.

Parity cases (graph tokens == eager tokens, 5 new tokens, pinned length, left padding):
tiny-gpt2/opt/llama/qwen2 x batch 1 and 4 in fp32, and x batch 4 in bf16.
"""

import warnings

import pytest
import torch
from conftest import left_padded_prompts as prompts

import hybrid_engine.generation as generation
from hybrid_engine.accelerator import CPUAccelerator, get_accelerator, set_accelerator
from hybrid_engine.config import EngineConfig, load_config, validate_graph_capture_support
from hybrid_engine.decode_graphs import MAX_CAPTURE_FAILURES, DecodeLengthError, GraphStats
from hybrid_engine.engine import initialize
from hybrid_engine.generation import graph_gate
from hybrid_engine.tiny_models import build_model

GRAPH = {"hybrid_engine": {"enable_graph_capture": True}}
N = 5




def engines(model, **he):
    graph, _ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True, **he}})
    eager, _ = initialize(model=model, config={})
    return graph, eager


def gen(engine, ids, mask, n=N, **kw):
    return engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-opt", "tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("batch,dtype", [(1, torch.float32), (4, torch.float32), (4, torch.bfloat16)])
def test_graph_tokens_equal_eager(arch, batch, dtype):
    model = build_model(arch, seed=3, dtype=dtype)
    graph, eager = engines(model)
    ids, mask = prompts(batch, 4)
    expected = gen(eager, ids, mask)
    first = gen(graph, ids, mask)  # captures every position
    again = gen(graph, ids, mask)  # replays only
    assert torch.equal(first, expected) and torch.equal(again, expected)
    s = graph.graph_stats
    assert s.captures == N - 1 and s.captured_positions == N - 1
    assert s.replays == 2 * (N - 1)
    assert s.last_refusal_reason is None and s.enabled
    assert expected.shape == (batch, 4 + N)


def test_sampled_graph_tokens_equal_eager_and_are_seeded():
    model = build_model("tiny-llama", seed=1)
    graph, eager = engines(model)
    ids, mask = prompts(3, 4)
    kw = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95)
    outs = []
    for engine in (eager, graph, graph):
        torch.manual_seed(123)
        outs.append(gen(engine, ids, mask, **kw))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.manual_seed(124)
    assert not torch.equal(gen(graph, ids, mask, **kw), outs[0])  # a new seed, new tokens


def test_stats_fields_and_to_dict():
    graph, _ = engines(build_model("tiny-gpt2"))
    s = graph.graph_stats
    assert isinstance(s, GraphStats)
    d = s.to_dict()
    for name in ("captured_positions", "replays", "captures", "fallbacks", "last_refusal_reason", "enabled",
                 "capture_seconds", "graph_memory_bytes"):
        assert name in d
    assert s.enabled and s.captures == 0 and s.graph_memory_bytes == 0
    gen(graph, *prompts(2, 3), n=3)
    s = graph.graph_stats
    assert s.capture_seconds > 0 and s.cache_memory_bytes > 0 and s.graph_keys == 1


# ------------------------------------------------------------------ the gate
def test_unpinned_length_runs_eager_and_warns_once():
    model = build_model("tiny-opt")
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            out = graph.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=2)
    assert [str(w.message) for w in rec].count(graph.graph_stats.last_refusal_reason) == 1
    assert "not pinned" in graph.graph_stats.last_refusal_reason
    assert graph.graph_stats.captures == 0
    assert torch.equal(out, eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=2))
    gen(graph, ids, mask, n=4)  # pinned: graphs
    assert graph.graph_stats.captures == 3 and graph.graph_stats.last_refusal_reason is None


def test_graphs_off_by_default_without_warning():
    engine, _ = initialize(model=build_model("tiny-gpt2"), config={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(engine, *prompts(1, 3), n=3)
    s = engine.graph_stats
    assert not s.enabled and s.captures == 0 and "enable_graph_capture is off" in s.last_refusal_reason


def test_zero3_refused_by_validator_and_by_engine_gate():
    cfg = EngineConfig(zero_optimization={"stage": 3}, hybrid_engine={"enable_graph_capture": True})
    assert "ZeRO stage 3" in validate_graph_capture_support(cfg, CPUAccelerator())
    assert "ZeRO stage 3" in graph_gate(cfg, CPUAccelerator(), pinned=True)
    with pytest.raises(ValueError, match="zero_optimization.stage=3"):
        initialize(model=build_model("tiny-gpt2"), config=cfg)
    # The engine's per-call gate goes through the same validator.
    model = build_model("tiny-gpt2")
    graph, eager = engines(model)
    graph._generator.config = load_config(cfg)
    ids, mask = prompts(2, 3)
    with pytest.warns(UserWarning, match="ZeRO stage 3") as rec:
        out = gen(graph, ids, mask, n=3)
        gen(graph, ids, mask, n=3)
    assert sum("ZeRO stage 3" in str(w.message) for w in rec) == 1
    assert torch.equal(out, gen(eager, ids, mask, n=3))
    assert graph.graph_stats.captures == 0 and not graph.graph_stats.enabled


@pytest.mark.parametrize(
    "he,match",
    [({"release_inference_cache": True}, "release_inference_cache"), ({"inference_tp_size": 2}, "inference_tp_size")],
)
def test_config_refusals_warn_once_and_run_eager(he, match):
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


def test_tp_size_warns_at_initialize():
    with pytest.warns(UserWarning, match="tensor-parallel inference is not implemented"):
        initialize(model=build_model("tiny-gpt2"), config={"hybrid_engine": {"inference_tp_size": 2}})


def test_backend_without_graphs_runs_eager():
    set_accelerator(CPUAccelerator(emulate_graphs=False))
    model = build_model("tiny-gpt2")
    graph, eager = engines(model)
    ids, mask = prompts(2, 3)
    with pytest.warns(UserWarning, match="cannot capture graphs"):
        out = gen(graph, ids, mask, n=3)
    assert torch.equal(out, gen(eager, ids, mask, n=3)) and graph.graph_stats.captures == 0


def test_prompt_forward_never_graphed(monkeypatch):
    calls = []
    real = generation.prefill

    def spy(*a, **k):
        calls.append(get_accelerator().is_current_stream_capturing())
        return real(*a, **k)

    monkeypatch.setattr(generation, "prefill", spy)
    graph, _ = engines(build_model("tiny-llama"))
    gen(graph, *prompts(2, 4), n=4)
    gen(graph, *prompts(2, 4, seed=1), n=4)
    assert calls == [False, False]
    assert graph.graph_stats.captures == 3  # decode positions only: 1 token comes from the prefill


# ----------------------------------------------------------- state machine
def test_length_change_invalidates_and_recaptures():
    model = build_model("tiny-gpt2")
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    gen(graph, ids, mask, n=5)
    out = gen(graph, ids, mask, n=3)
    s = graph.graph_stats
    assert s.invalidations == 1 and s.graph_keys == 1 and s.captured_positions == 2 and s.captures == 4 + 2
    assert torch.equal(out, gen(eager, ids, mask, n=3))
    assert torch.equal(gen(graph, ids, mask, n=5), gen(eager, ids, mask, n=5))
    assert graph.graph_stats.captures == 6 + 4  # the old length was dropped, so it is captured again


def test_batch_and_width_change_recapture_and_keep_lru():
    model = build_model("tiny-opt")
    graph, eager = engines(model)
    shapes = [(2, 4), (3, 4), (2, 5)]
    for b, t in shapes:
        assert torch.equal(gen(graph, *prompts(b, t), n=3), gen(eager, *prompts(b, t), n=3))
    s = graph.graph_stats
    assert s.graph_keys == 3 and s.captures == 3 * 2 and s.invalidations == 0
    for b, t in shapes:  # all still cached: replay only
        assert torch.equal(gen(graph, *prompts(b, t, seed=9), n=3), gen(eager, *prompts(b, t, seed=9), n=3))
    assert graph.graph_stats.captures == 6 and graph.graph_stats.replays == 12


def test_lru_bound_on_keys():
    graph, _ = engines(build_model("tiny-gpt2"))
    store = graph._generator.graphs
    for t in range(1, store.max_keys + 3):
        gen(graph, *prompts(1, t), n=2)
    assert graph.graph_stats.graph_keys == store.max_keys


def test_running_past_declared_length_raises():
    model = build_model("tiny-gpt2")
    graph, _ = engines(model)
    gen(graph, *prompts(2, 3), n=4)
    store = graph._generator.graphs
    (key,) = store.keys()
    entry = store.entry(key, model, key.prompt_width + key.new_tokens)
    with pytest.raises(DecodeLengthError, match="past the declared generation length"):
        store.run_position(entry, key.new_tokens - 1, lambda p: None, model)
    gen(graph, *prompts(2, 3), n=4)  # still works


# --------------------------------------------------------- capture failure
def fail_capture(module, at):
    """Make ``module`` synchronise (``.item()``) during the ``at``-th capture: a real GraphCaptureError."""
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


@pytest.mark.parametrize("position", [0, 2, N - 2])
def test_capture_failure_falls_back_to_eager_for_the_whole_call(position):
    model = build_model("tiny-llama", seed=2)
    graph, eager = engines(model)
    ids, mask = prompts(4, 5)
    expected = gen(eager, ids, mask)
    undo = fail_capture(model.lm_head, position)
    with pytest.warns(UserWarning, match="Graph capture failed") as rec:
        out = gen(graph, ids, mask)
    undo()
    assert torch.equal(out, expected)
    assert sum("Graph capture failed" in str(w.message) for w in rec) == 1
    s = graph.graph_stats
    assert s.fallbacks == 1 and s.captured_positions == 0 and s.enabled
    assert s.captures == position and s.replays == position
    # Graphs work again on the next call.
    assert torch.equal(gen(graph, ids, mask), expected) and graph.graph_stats.captured_positions == N - 1


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
    assert s.fallbacks == MAX_CAPTURE_FAILURES and not s.enabled and s.captures == 0
    assert "disabled" in s.last_refusal_reason


def test_synchronising_forward_hook_is_suspended_during_capture():
    model = build_model("tiny-qwen2")
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    expected = gen(eager, ids, mask)
    calls = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: calls.append(float(o.sum().item())))
    pre = model.lm_head.register_forward_pre_hook(lambda m, a: calls.append(int(a[0].abs().sum().item() > 0)))
    assert torch.equal(gen(graph, ids, mask), expected)
    assert torch.equal(gen(graph, ids, mask), expected)
    s = graph.graph_stats
    assert s.fallbacks == 0 and s.captures == N - 1
    n = len(calls)
    assert n > 0  # hooks ran in the eager prefill/warm-up
    model(input_ids=ids[:, :2])
    assert len(calls) == n + 2  # and are still registered afterwards
    handle.remove()
    pre.remove()


# ------------------------------------------------------------------ weights
def test_in_place_optimizer_update_is_seen_by_replay():
    model = build_model("tiny-gpt2", seed=4)
    graph, _ = initialize(model=model, config={**GRAPH, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}})
    eager, _ = initialize(model=model, config={})
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
    assert s.captures == N - 1 and s.replays == 2 * (N - 1) and s.invalidations == 0


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
    assert s.invalidations == 1 and s.captures == 2 * (N - 1) and s.graph_keys == 1


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
        s = g.graph_stats
        assert s.captures == N - 1 and s.replays == 2 * (N - 1)


def test_generate_in_train_mode_uses_inference_path_and_restores():
    model = build_model("tiny-gpt2", seed=1)  # GPT-2 has dropout 0.1
    graph, eager = engines(model)
    ids, mask = prompts(2, 4)
    expected = gen(eager, ids, mask)
    graph.train()
    assert model.training
    assert torch.equal(gen(graph, ids, mask), expected)
    assert model.training and graph.training


def test_keys_of_one_batch_share_one_cache_sized_from_max_out_tokens():
    from hybrid_engine.static_cache import StaticKVCache

    model = build_model("tiny-llama", seed=2)
    graph, eager = engines(model, max_out_tokens=64)
    widths = (4, 7, 5)
    for width in widths:
        ids, mask = prompts(3, width, seed=width)
        assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    s = graph.graph_stats
    assert s.graph_keys == len(widths)
    one_cache = StaticKVCache(model.config, 3, 64).memory_bytes()
    assert s.cache_memory_bytes == one_cache
    ids, mask = prompts(2, 4)  # another batch size: its own cache
    assert torch.equal(gen(graph, ids, mask), gen(eager, ids, mask))
    assert graph.graph_stats.cache_memory_bytes == one_cache + StaticKVCache(model.config, 2, 64).memory_bytes()
