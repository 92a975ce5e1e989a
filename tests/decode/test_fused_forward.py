"""The fused decode forward (decode/fused_forward.py) against transformers' forward, on the CPU.

The fused ops run their reference implementations here, so the fused forward must agree with transformers'
model forward within rounding: teacher-forced logprobs within 1e-5 (fp32) over several decode steps, and the
same greedy token wherever the top two logits are not a near-tie, for llama, mistral, qwen2 (q/k/v bias),
qwen3 (per-head q/k norms), static rope scalings (llama3, yarn) and a LoRA model. Graph tokens equal eager
tokens with it on. Models it cannot run fall back to transformers' forward, with one warning when asked for
explicitly. A decode step with it on launches at most 16 device ops a layer (the ``bench kernels`` count).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import left_padded_prompts as prompts

import hybrid_engine.decode.fused_forward as fused_forward
from hybrid_engine.config.loading import load_config
from hybrid_engine.decode.fused_forward import (
    fused_decode_refusal,
    fused_decode_supported,
    fused_kernels_available,
    resolve_fused_decode,
)
from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.step import decode_one_token, prefill
from hybrid_engine.engine import initialize
from hybrid_engine.tiny_models import build_model

STEPS = 5
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "llama": ("tiny-llama", {}),
    "mistral": ("tiny-mistral", {}),
    "qwen2": ("tiny-qwen2", {}),
    "qwen3": ("tiny-qwen3", {}),
    "llama3-rope": ("tiny-llama", {"rope_parameters": LLAMA3}),
    "yarn-rope": ("tiny-qwen2", {"rope_parameters": YARN}),
}


def _caches(model, n: int = 2, batch: int = 3, capacity: int = 40):
    ids, mask = prompts(batch, 6)
    caches = [PagedKVCache(model.config, batch, capacity, page_size=4) for _ in range(n)]
    for cache in caches:
        prefill(model, cache, ids, mask)
    return caches


def _compare_teacher_forced(model, steps: int = STEPS) -> None:
    """Fused and transformers' steps fed the same tokens: logprobs within 1e-5, greedy tokens equal off ties."""
    plain, fused = _caches(model)
    tokens = torch.tensor([5, 9, 200])
    for _ in range(steps):
        want = decode_one_token(model, plain, tokens).float().log_softmax(-1)
        got = decode_one_token(model, fused, tokens, fused=True).float().log_softmax(-1)
        assert (got - want).abs().max() <= 1e-5
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
        tokens = want.argmax(-1)  # teacher forcing: both paths are fed transformers' tokens
    assert torch.equal(plain.write_pos, fused.write_pos) and torch.equal(plain.position, fused.position)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_forward_matches_transformers_teacher_forced(family):
    name, overrides = FAMILIES[family]
    model = build_model(name, seed=1, **overrides)
    assert fused_decode_refusal(model, PagedKVCache(model.config, 1, 8)) is None
    _compare_teacher_forced(model)


def test_rope_scaling_reaches_the_fused_path():
    """The rotary table is the model's own module's: a llama3-scaled model's steps differ from the unscaled
    one's (so the comparison above could fail if the table ignored the scaling)."""
    scaled, plain = (build_model("tiny-llama", seed=1, **kw) for kw in ({"rope_parameters": LLAMA3}, {}))
    tokens = torch.tensor([5, 9, 200])
    a = decode_one_token(scaled, _caches(scaled, 1)[0], tokens, fused=True)
    b = decode_one_token(plain, _caches(plain, 1)[0], tokens, fused=True)
    assert (a - b).abs().max() > 1e-3


def test_lora_model_matches_its_unfused_forward():
    peft = pytest.importorskip("peft")
    base = build_model("tiny-llama", seed=2)
    before = decode_one_token(base, _caches(base, 1)[0], torch.tensor([5, 9, 200]), fused=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj",
                                                                "down_proj"], lora_dropout=0.0, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wrapped = peft.get_peft_model(base, config)
    assert fused_decode_supported(wrapped, PagedKVCache(base.config, 1, 8))
    model = wrapped.get_base_model()
    after = decode_one_token(model, _caches(model, 1)[0], torch.tensor([5, 9, 200]), fused=True)
    assert (after - before).abs().max() > 1e-3  # the adapters run in the fused path
    _compare_teacher_forced(model, steps=3)


def test_lora_model_graph_tokens_equal_eager_with_fused_on():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wrapped = peft.get_peft_model(build_model("tiny-llama", seed=2), config)
    graph, *_ = initialize(model=wrapped, config={"hybrid_engine": {"enable_graph_capture": True,
                                                                     "fused_decode": True}})
    eager, *_ = initialize(model=wrapped, config={"hybrid_engine": {"fused_decode": True}})
    ids, mask = prompts(3, 5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(graph.generate(**kw), eager.generate(**kw))
    assert graph.generate_runner.slots.fused_decode and graph.graph_stats.replays > 0


def test_graph_tokens_equal_eager_with_fused_on():
    model = build_model("tiny-qwen3", seed=3)
    graph, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True,
                                                                   "fused_decode": True}})
    eager, *_ = initialize(model=model, config={"hybrid_engine": {"fused_decode": True}})
    ids, mask = prompts(3, 5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
    expected = eager.generate(**kw)
    first, again = graph.generate(**kw), graph.generate(**kw)
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert graph.generate_runner.slots.fused_decode and eager.generate_runner.slots.fused_decode
    decode_keys = [k for k in graph.generate_runner.graph_keys if hasattr(k, "fused")]
    assert decode_keys and all(k.fused for k in decode_keys)
    assert graph.graph_stats.replays > 0
    sampled = dict(kw, do_sample=True, temperature=0.9, top_p=0.8)
    torch.manual_seed(4)
    want = eager.generate(**sampled)
    torch.manual_seed(4)
    assert torch.equal(graph.generate(**sampled), want)


def test_a_rope_table_made_while_capturing_is_not_kept(cpu_graphs):
    """The rotary table is kept on the cache when made eagerly; one made inside a capture is not (its values
    exist only after a replay), so a later eager step makes its own, and both give the same logits."""
    model = build_model("tiny-llama", seed=1)
    graph_cache, eager_cache = _caches(model)
    tokens = torch.tensor([5, 9, 200])
    graph = cpu_graphs.create_graph()
    with cpu_graphs.capture_to_graph(graph):
        captured = decode_one_token(model, graph_cache, tokens, fused=True)
    assert graph_cache.memory_bytes() == PagedKVCache(model.config, 3, 40, page_size=4).memory_bytes()
    eager = decode_one_token(model, eager_cache, tokens, fused=True)
    cpu_graphs.replay_graph(graph)
    assert torch.equal(eager, captured)
    kept = eager_cache.memory_bytes() - PagedKVCache(model.config, 3, 40, page_size=4).memory_bytes()
    assert kept == (40 + 1) * 2 * 16 * 4  # (capacity + 1) positions x (cos, sin) x head_dim, fp32


def test_fused_setting_is_part_of_the_graph_key():
    model = build_model("tiny-llama", seed=3)
    ids, mask = prompts(2, 4)
    keys = []
    for setting in (True, False):
        engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True,
                                                                        "fused_decode": setting}})
        engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
        keys.append({k for k in engine.generate_runner.graph_keys if hasattr(k, "fused")})
    assert {k.fused for k in keys[0]} == {True} and {k.fused for k in keys[1]} == {False}
    assert {k._replace(fused=False) for k in keys[0]} == keys[1]


def _generate(engine, n: int = 4):
    ids, mask = prompts(2, 4)
    return engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n)


def test_unsupported_model_falls_back_with_one_warning():
    model = build_model("tiny-llama", seed=3)
    model.model.norm.register_forward_hook(lambda module, args, out: None)  # the fused path would skip it
    asked, *_ = initialize(model=model, config={"hybrid_engine": {"fused_decode": True}})
    off, *_ = initialize(model=model, config={"hybrid_engine": {"fused_decode": False}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = _generate(asked), _generate(asked)
    mine = [w for w in caught if "fused_decode" in str(w.message)]
    assert len(mine) == 1 and "model.norm has a forward hook" in str(mine[0].message)
    assert not asked.generate_runner.slots.fused_decode
    assert torch.equal(first, _generate(off)) and torch.equal(second, first)


def test_auto_is_on_only_where_every_op_has_a_kernel(monkeypatch):
    model, gpt2 = build_model("tiny-llama"), build_model("tiny-gpt2")
    cache, gpt2_cache = PagedKVCache(model.config, 2, 16), PagedKVCache(gpt2.config, 2, 16)
    assert resolve_fused_decode("auto", model, cache) is fused_kernels_available(cache.device)
    assert resolve_fused_decode(False, model, cache) is False
    # Hardware boundary: a device whose probes found kernels for every fused op.
    monkeypatch.setattr(fused_forward, "fused_kernels_available", lambda device: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" never warns
        assert resolve_fused_decode("auto", model, cache) is True
        assert resolve_fused_decode("auto", gpt2, gpt2_cache) is False
    with pytest.warns(UserWarning, match="model type 'gpt2'"):
        assert resolve_fused_decode(True, gpt2, gpt2_cache) is False


@pytest.mark.parametrize("change,why", [
    (lambda m: setattr(next(m.parameters()), "ds_id", 0), "ZeRO-3"),
    (lambda m: setattr(m.config, "hidden_act", "gelu"), "activation"),
    (lambda m: setattr(m.config, "pretraining_tp", 2), "pretraining_tp"),
    (lambda m: m.model.layers[1].mlp.register_forward_pre_hook(lambda *a: None), "model.layers.1.mlp"),
    (lambda m: setattr(m.model.layers[0].self_attn, "forward", lambda *a, **k: None), "forward was replaced"),
    (lambda m: setattr(m.model.rotary_emb, "rope_type", "dynamic"), "rope type"),
])
def test_refusals_name_the_reason_and_fall_back(change, why):
    model = build_model("tiny-qwen2")
    change(model)
    cache = PagedKVCache(model.config, 2, 16)
    assert why in fused_decode_refusal(model, cache)
    with pytest.warns(UserWarning, match="fused_decode is true"):
        assert resolve_fused_decode(True, model, cache) is False


def test_windowed_layers_are_refused():
    model = build_model("tiny-mistral", sliding_window=8)
    assert "windowed" in fused_decode_refusal(model, PagedKVCache(model.config, 2, 16))


def test_config_key_is_validated():
    he = lambda v: load_config({"hybrid_engine": {"fused_decode": v}}).hybrid_engine.fused_decode  # noqa: E731
    assert load_config({}).hybrid_engine.fused_decode == "auto"
    assert he("auto") == "auto" and he(True) is True and he(False) is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"hybrid_engine\.fused_decode"):
            he(bad)
    with pytest.raises(ValueError, match=r"hybrid_engine\.max_out_tokens"):  # other "auto"s are still refused
        load_config({"hybrid_engine": {"fused_decode": "auto", "max_out_tokens": "auto"}})


def test_a_fused_step_launches_at_most_16_ops_a_layer(monkeypatch):
    """``bench kernels``' count of one ``DecodeSlots.step`` (aten ops that launch a kernel, custom ops once) on a
    2-layer and a 1-layer qwen2: the difference is one layer's ops, the same number ``bench kernels`` attributes
    to each layer (its summary also checks that every layer launches the same ops)."""
    from hybrid_engine.benchmarks.kernels import ours, summarise

    def per_layer() -> tuple[int, int]:
        ops = {n: ours(build_model("tiny-qwen2", dtype=torch.bfloat16, vocab_size=1024, num_hidden_layers=n),
                       4, 64, (0.0, 1.0, -1), "auto") for n in (1, 2)}
        return len(ops[2]) - len(ops[1]), summarise(ops[2], 2, 2, 4, 64, 1, "fused")["per_layer"]

    # Hardware boundary: a device whose probes found kernels for every fused op ("auto" turns it on).
    monkeypatch.setattr(fused_forward, "fused_kernels_available", lambda device: True)
    fused, attributed = per_layer()
    assert fused <= 16 and attributed == fused
    monkeypatch.setattr(fused_forward, "fused_kernels_available", lambda device: False)
    unfused, _ = per_layer()
    assert unfused > 16  # transformers' modules: the count sees them


_INTERPRETED = """
import json, torch
from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.ops import paged_attention as pa
from hybrid_engine.decode.step import decode_one_token, prefill
from hybrid_engine.tiny_models import build_model

impl = pa.implementation("cpu")  # the probe runs the kernel once: before counting
calls = {"n": 0}
kernel = pa._triton_attention
def counted(*a, **k):
    calls["n"] += 1
    return kernel(*a, **k)
pa._triton_attention = counted
model = build_model("tiny-qwen3", seed=1)
ids = torch.randint(10, 300, (3, 6), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[0, :2] = 0
plain, fused = (PagedKVCache(model.config, 3, 32, page_size=4) for _ in range(2))
for cache in (plain, fused):
    prefill(model, cache, ids, mask)
tokens, worst = torch.tensor([5, 9, 200]), 0.0
for _ in range(4):
    want = decode_one_token(model, plain, tokens, paged=False).log_softmax(-1)
    got = decode_one_token(model, fused, tokens, fused=True).log_softmax(-1)
    worst = max(worst, float((got - want).abs().max()))
    tokens = want.argmax(-1)
print(json.dumps({"worst": worst, "kernel_calls": calls["n"], "impl": impl}))
"""


@pytest.mark.slow  # a process of its own (tests/tiers.py)
def test_fused_forward_on_the_paged_kernel_under_the_interpreter():
    """Under ``TRITON_INTERPRET=1`` the paged attention op runs its Triton kernel over the pool the fused
    forward wrote through ``cache.update``: within 1e-5 of transformers' gathering step."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["impl"] == "triton" and got["kernel_calls"] == 4 * 2  # every step, every layer
    assert got["worst"] <= 1e-5
