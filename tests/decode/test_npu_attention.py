"""``"npu_graph"`` attention and the NPU attention switch, against a stub ``torch_npu`` (no NPU here).

What is stubbed, and only that (the hardware boundary):

* ``torch_npu`` itself. Its ``npu_fusion_attention_v3`` computes attention with
  ``scaled_dot_product_attention`` from BNSD (or BSH) inputs, reading ``atten_mask`` as
  torch_npu documents it (bool, True = masked out) and defaulting ``scale`` to
  1.0 as torch_npu does, so a caller that inverts the mask or forgets the scale
  gets different logits; a query row with every key masked comes out NaN
  (undefined in a fused kernel, so the stub takes the worst case). Its
  ``npu_fusion_attention`` (v1) raises the 107025 capture error when it is
  called while the current stream is capturing.
* On a stub NPU, torch's own SDPA: on an Ascend device it lowers to the fused
  v1 kernel, so the ``npu_sdpa`` fixture makes each SDPA call launch stub v1
  (then returns torch's result, so eager numerics are unchanged).
* The NPU itself, for the runner: a model cannot be placed on a fake ``npu``
  device (torch knows that device type only once real torch_npu registers it),
  so :class:`CPUEmulatedNPU` stands in. It is the CPU graph emulation (CUDA/NPU
  capture rules, tensors in host memory) under the backend name ``"npu"``,
  which is what the runner's policy probes. Its graphs are the CPU
  emulation's; its attention kernels are the stub's.

Nothing here is verified on a real NPU.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import left_padded_prompts as prompts
from sampled_close import assert_greedy_close, assert_rollouts_sampled_close

from hybrid_engine.accelerator import CPUAccelerator, is_capturing, set_accelerator
from hybrid_engine.decode.kv_cache import ForwardIndices, PagedKVCache
from hybrid_engine.decode.npu_attention import (
    NPU_GRAPH_ATTENTION,
    npu_graph_attention_forward,
    npu_masked_out,
)
from hybrid_engine.decode.step import build_decode_mask, decode_one_token, prefill
from hybrid_engine.engine import initialize
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

GQA_ARCHS = ("tiny-llama", "tiny-qwen2", "tiny-mistral")
ERR_107025 = "107025"
NO_EOS = 10_000
_SDPA = F.scaled_dot_product_attention  # torch's, before any test routes SDPA through the stub NPU


# ------------------------------------------------------------------------------------------------ stubs
def _stub_attention(query, key, value, head_num, layout, atten_mask, scale):
    """Attention as the fused kernels define it: BSH or BNSD inputs, bool mask with True = masked out."""
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"stub torch_npu: atten_mask must be bool/uint8, got {atten_mask.dtype}")
    if layout == "BSH":
        if query.dim() != 3 or query.shape[-1] % head_num:
            raise ValueError(f"stub torch_npu: BSH query of shape {tuple(query.shape)} with head_num={head_num}")
        b, sq, hidden = query.shape
        d = hidden // head_num
        kv_heads = key.shape[-1] // d
        q = query.view(b, sq, head_num, d).transpose(1, 2)
        k = key.view(b, key.shape[1], kv_heads, d).transpose(1, 2)
        v = value.view(b, value.shape[1], kv_heads, -1).transpose(1, 2)
    elif layout == "BNSD":
        q, k, v = query, key, value
    else:
        raise ValueError(f"stub torch_npu: unsupported layout {layout!r}")
    if atten_mask is not None and (atten_mask.dim() not in (2, 4) or atten_mask.shape[-2:] != (q.shape[2], k.shape[2])):
        raise ValueError(f"stub torch_npu: atten_mask shape {tuple(atten_mask.shape)} is not [B|1, N|1, Sq, Skv]/[Sq, Skv]")
    keep = None if atten_mask is None else ~atten_mask.bool()
    out = _SDPA(q, k, v, attn_mask=keep, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if keep is not None:  # a query with every key masked is 0/0 in a fused kernel: make that visible
        out = out.masked_fill(~keep.any(-1, keepdim=True), float("nan"))
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) if layout == "BSH" else out


def make_stub_torch_npu(*, v3: bool = True, tuple_output: bool = True, v3_error: str | None = None) -> types.ModuleType:
    """A stand-in for ``torch_npu`` with the two fused attention kernels; ``calls`` logs each launch.

    ``v3_error``: v3 raises it at every call, as the real one does on a chip it does not support (its
    implementation checks the SoC version: "Ascend950 not support")."""
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.calls = []  # (kernel, capturing, details)

    def npu_fusion_attention(query, key, value, head_num, input_layout, *, atten_mask=None, scale=1.0, **_):
        mod.calls.append(("v1", is_capturing(), {}))
        if is_capturing():
            raise RuntimeError(
                "stub torch_npu: npu_fusion_attention launched work on an internal secondary stream while the "
                f"current stream was capturing; capture_end would fail with error code {ERR_107025}")
        out = _stub_attention(query, key, value, head_num, input_layout, atten_mask, scale)
        return out, None, None, None, 0, 0, 0

    def npu_fusion_attention_v3(query, key, value, head_num, input_layout, *, atten_mask=None, scale=1.0,
                                keep_prob=1.0):
        mod.calls.append(("v3", is_capturing(), {"head_num": head_num, "layout": input_layout,
                                                  "shapes": (query.shape, key.shape, value.shape),
                                                  "mask": None if atten_mask is None else atten_mask.dtype,
                                                  "scale": scale}))
        if v3_error is not None:
            raise RuntimeError(v3_error)
        out = _stub_attention(query, key, value, head_num, input_layout, atten_mask, scale)
        return (out, None, None, None, 0, 0, 0) if tuple_output else out

    mod.npu_fusion_attention = npu_fusion_attention
    if v3:
        mod.npu_fusion_attention_v3 = npu_fusion_attention_v3
    return mod


def launches(stub, kernel, *, capturing=None):
    return [c for c in stub.calls if c[0] == kernel and (capturing is None or c[1] == capturing)]


@pytest.fixture
def stub_npu(monkeypatch):
    stub = make_stub_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    return stub


def route_sdpa_through_v1(monkeypatch, stub) -> None:
    """torch's SDPA as it runs on an Ascend device: every call launches torch_npu's fused v1 kernel."""

    def sdpa_on_npu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
        stub.npu_fusion_attention(query, key, value, query.shape[1], "BNSD", scale=scale)
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_on_npu)


@pytest.fixture
def npu_sdpa(monkeypatch, stub_npu):
    route_sdpa_through_v1(monkeypatch, stub_npu)
    return stub_npu


class CPUEmulatedNPU(CPUAccelerator):
    """The CPU graph emulation under the backend name "npu" (see the module docstring: a labelled stand-in)."""

    _name = "npu"

    def device(self) -> torch.device:
        return torch.device("cpu")  # its memory is host memory: models stay CPU models


@pytest.fixture
def npu_backend(npu_sdpa):
    acc = CPUEmulatedNPU()
    set_accelerator(acc)
    return acc


def engine_pair(model):
    graph, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    eager, *_ = initialize(model=model, config={})
    return graph, eager


def greedy(engine, ids, mask, n=6):
    return engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def rollout(model, graphs, **config):
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                           eos_token_id=NO_EOS, **config))


def rollout_request(seed=1):
    return RolloutRequest(*prompts(3, 5, seed=seed))


SAMPLED = SamplingConfig(max_new_tokens=7, temperature=0.9, top_p=0.9, n_samples_per_prompt=2, seed=3)


def assert_same_rollouts(a, b):
    """The same kernels (graph replay and eager of the same steps, or graphs turned off): the same tokens."""
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_lengths, b.response_lengths)
    torch.testing.assert_close(a.response_logprobs, b.response_logprobs, rtol=0, atol=1e-5)


# npu_graph attention (the stub's fused kernel) and SDPA compute the same attention in other ways: logprobs and
# logits that differ in the last float bits. Those paths are compared as sampled_close compares numerically
# different paths (issue 38): equal tokens (logprobs to 1e-5), or at a row's first difference a flip that float
# noise can make (teacher-forced on ``model``: inverse-CDF neighbours when sampled, a tie for the argmax when
# greedy), not by asking both kernels to round alike.
def assert_rollouts_close(model, a, b):
    assert_rollouts_sampled_close(model, a, b, temperature=SAMPLED.temperature, top_p=SAMPLED.top_p,
                                  top_k=SAMPLED.top_k)


def assert_greedy_outputs_close(model, ids, mask, got, want):
    """``greedy``'s outputs (the left-padded prompts, then the new tokens) of two numerically different paths."""
    width = ids.shape[1]
    assert torch.equal(got[:, :width], ids) and torch.equal(want[:, :width], ids)
    for row in range(ids.shape[0]):
        assert_greedy_close(model, ids[row][mask[row].bool()].tolist(), got[row, width:].tolist(),
                            want[row, width:].tolist(), name=f"row {row}")


# ----------------------------------------------------------------------------------- registration, mask
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu is installed")
def test_registered_on_import_and_torch_npu_imported_only_when_called():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[NPU_GRAPH_ATTENTION] is npu_graph_attention_forward
    assert NPU_GRAPH_ATTENTION in AttentionMaskInterface._global_mapping
    assert "torch_npu" not in sys.modules  # importing hybrid_engine did not import it
    model = build_model("tiny-llama", attn_implementation=NPU_GRAPH_ATTENTION)
    ids, mask = prompts(2, 4)
    with pytest.raises(ModuleNotFoundError, match="torch_npu"):
        model(input_ids=ids, attention_mask=mask)


def test_masked_out_follows_torch_npu_convention():
    dev = torch.device("cpu")
    keep = torch.tensor([[True, True, False], [False, False, False]])[:, None, None, :]  # transformers: True = attend
    assert npu_masked_out(keep, 1, 3, is_causal=True, device=dev)[0, 0, 0].tolist() == [False, False, True]
    # A row with nothing to attend (padding) attends everything rather than dividing 0 by 0.
    assert not npu_masked_out(keep, 1, 3, is_causal=True, device=dev)[1].any()
    additive = build_decode_mask(torch.tensor([1]), 4, torch.float32)  # 0 / finfo.min: keys 0 and 1 seen
    assert npu_masked_out(additive, 1, 4, is_causal=True, device=dev).flatten().tolist() == [False, False, True, True]
    assert npu_masked_out(additive, 1, 2, is_causal=True, device=dev).shape[-1] == 2  # cut to the keys given
    causal = npu_masked_out(None, 3, 3, is_causal=True, device=dev)[0, 0]
    assert causal.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert npu_masked_out(None, 1, 5, is_causal=True, device=dev) is None  # one query: nothing to mask
    assert npu_masked_out(None, 3, 3, is_causal=False, device=dev) is None


# ----------------------------------------------------------------------------------- numerics vs sdpa
@pytest.mark.stub
@pytest.mark.parametrize("tuple_output", [True, False], ids=["tuple-out", "tensor-out"])
@pytest.mark.parametrize("arch", GQA_ARCHS)
def test_npu_graph_logits_equal_sdpa_with_left_padding_and_gqa(arch, tuple_output, monkeypatch):
    stub = make_stub_torch_npu(tuple_output=tuple_output)
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    ref = build_model(arch, seed=5, attn_implementation="sdpa")
    npu = build_model(arch, seed=5, attn_implementation=NPU_GRAPH_ATTENTION)
    cfg = npu.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    ids, mask = prompts(4, 6, seed=2)  # rows with 0..3 left pads
    real = mask.bool()
    with torch.no_grad():  # transformers' own mask path (2D mask -> npu_graph mask function)
        want, got = ref(input_ids=ids, attention_mask=mask).logits, npu(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    assert torch.isfinite(got).all()  # pad queries too: no NaN to leak through 0 * NaN
    # The paged cache's path: explicit 4D additive float masks, in prefill and in every decode step.
    caches = [PagedKVCache(m.config, 4, 12, dtype=torch.float32) for m in (ref, npu)]
    logits = [prefill(m, c, ids, mask) for m, c in zip((ref, npu), caches)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
    for _ in range(4):
        tokens = logits[0].argmax(-1)
        logits = [decode_one_token(m, c, tokens) for m, c in zip((ref, npu), caches)]
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
    v3 = launches(stub, "v3")
    assert v3 and not launches(stub, "v1")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for _, _, d in v3:
        q_shape, k_shape, v_shape = d["shapes"]
        assert d["layout"] == "BNSD" and d["head_num"] == cfg.num_attention_heads and d["mask"] == torch.bool
        assert q_shape[1] == cfg.num_attention_heads and q_shape[-1] == head_dim
        assert k_shape[1] == v_shape[1] == cfg.num_key_value_heads  # GQA native: K/V neither repeated nor copied
        assert d["scale"] == pytest.approx(head_dim ** -0.5)


# ------------------------------------------------------------------------- captured decode, CPU graphs
@pytest.mark.stub
@pytest.mark.parametrize("arch", GQA_ARCHS)
def test_graph_captured_npu_graph_decoding_equals_sdpa_eager(arch, stub_npu):
    ref = build_model(arch, seed=8, attn_implementation="sdpa")
    npu = build_model(arch, seed=8, attn_implementation=NPU_GRAPH_ATTENTION)
    ids, mask = prompts(4, 5, seed=3)
    _, eager = engine_pair(ref)
    graph, _ = engine_pair(npu)
    expected = greedy(eager, ids, mask)
    first = greedy(graph, ids, mask)
    assert_greedy_outputs_close(ref, ids, mask, first, expected)  # npu_graph against SDPA: other kernels
    assert torch.equal(greedy(graph, ids, mask), first)  # a replay of the same graph: the same tokens
    s = graph.graph_stats
    assert s.captures == 1 and s.replays > 0 and s.fallbacks == 0 and s.last_refusal_reason is None
    assert launches(stub_npu, "v3", capturing=True)  # the captured step runs the graph-mode kernel
    # Rollouts: staged admission rounds and decode steps, captured with npu_graph.
    want = rollout(ref, graphs=False, max_batch_size=4).generate(rollout_request(), SAMPLED)
    roll = rollout(npu, graphs=True, max_batch_size=4)
    got = roll.generate(rollout_request(), SAMPLED)
    assert_rollouts_close(ref, got, want)
    assert_same_rollouts(roll.generate(rollout_request(), SAMPLED), got)  # replayed: the same kernels
    rs = roll.graph_stats
    assert rs.captures >= 1 and rs.admission_captures >= 1 and rs.fallbacks == 0
    assert not launches(stub_npu, "v1")


# ------------------------------------------------------------------------------- the NPU switch
@pytest.mark.stub
def test_uncaptured_v1_is_what_the_switch_avoids(npu_backend, npu_sdpa):
    """Control: on the stub NPU, capturing an sdpa step without the switch fails with 107025."""
    model = build_model("tiny-llama", seed=2, attn_implementation="sdpa")
    cache = PagedKVCache(model.config, 2, 8, dtype=torch.float32)
    ids, mask = prompts(2, 3)
    prefill(model, cache, ids, mask)  # eager: v1 is fine outside capture
    assert launches(npu_sdpa, "v1", capturing=False)
    tokens = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=ERR_107025), npu_backend.capture_to_graph(npu_backend.create_graph()):
        decode_one_token(model, cache, tokens)


@pytest.mark.stub
def test_npu_capture_runs_npu_graph_never_v1_and_eager_keeps_sdpa(npu_backend, npu_sdpa, caplog):
    model = build_model("tiny-qwen2", seed=4, attn_implementation="sdpa")
    graph, eager = engine_pair(model)
    ids, mask = prompts(3, 5, seed=6)
    expected = greedy(eager, ids, mask)
    assert launches(npu_sdpa, "v1") and not launches(npu_sdpa, "v3")  # eager NPU runs keep the model's sdpa
    npu_sdpa.calls.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine.graphs.runner"):
        first = greedy(graph, ids, mask)
        for _ in range(2):
            assert torch.equal(greedy(graph, ids, mask), first)  # replays of the same graph: the same tokens
    # Captured steps run npu_graph, eager ones SDPA: other kernels (see assert_rollouts_close).
    assert_greedy_outputs_close(model, ids, mask, first, expected)
    assert not launches(npu_sdpa, "v1", capturing=True)  # the v1 kernel never ran inside a capture
    assert launches(npu_sdpa, "v3", capturing=True) and launches(npu_sdpa, "v3", capturing=False)  # capture, warm-up
    s = graph.graph_stats
    assert s.captures == 1 and s.fallbacks == 0 and s.last_refusal_reason is None
    assert s.invalidations == 0  # the fingerprint does not see the switch: no recapture per call
    assert model.config._attn_implementation == "sdpa"  # switched only around warm-up and capture
    switched = [r for r in caplog.records if NPU_GRAPH_ATTENTION in r.getMessage()]
    assert len(switched) == 1 and switched[0].levelno == logging.INFO
    # Rollouts capture their admission rounds (a prefill) as well: those switch too.
    want = rollout(model, graphs=False, max_batch_size=4).generate(rollout_request(), SAMPLED)
    npu_sdpa.calls.clear()
    roll = rollout(model, graphs=True, max_batch_size=4)
    got = roll.generate(rollout_request(), SAMPLED)
    assert_same_rollouts(roll.generate(rollout_request(), SAMPLED), got)  # replayed: the same kernels
    rs = roll.graph_stats
    assert rs.captures >= 1 and rs.admission_captures >= 1 and rs.fallbacks == 0
    assert not launches(npu_sdpa, "v1", capturing=True)
    assert_rollouts_close(model, got, want)  # npu_graph against SDPA (after the launch checks: it runs SDPA)


@pytest.mark.stub
def test_eager_attention_is_captured_as_it_is_on_an_npu(npu_backend, npu_sdpa):
    """transformers' eager attention is matmul and softmax, which NPU capture records: no switch, so graph and
    eager steps run the same kernels."""
    model = build_model("tiny-llama", seed=4, attn_implementation="eager")
    graph, eager = engine_pair(model)
    ids, mask = prompts(3, 5, seed=6)
    expected = greedy(eager, ids, mask)
    for _ in range(2):
        assert torch.equal(greedy(graph, ids, mask), expected)
    s = graph.graph_stats
    assert s.captures == 1 and s.replays > 0 and s.last_refusal_reason is None
    assert not launches(npu_sdpa, "v3") and not launches(npu_sdpa, "v1")


@pytest.fixture
def npu_without_v3(monkeypatch):
    """A torch_npu older than 2.6: fused v1 behind SDPA, no graph-mode v3."""
    stub = make_stub_torch_npu(v3=False)
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    route_sdpa_through_v1(monkeypatch, stub)
    set_accelerator(CPUEmulatedNPU())
    return stub


@pytest.mark.stub
def test_sdpa_without_the_graph_mode_kernel_is_refused_up_front(npu_without_v3):
    """Each capture would fail with 107025 (three failures, then graphs off): refused before any, by name."""
    model = build_model("tiny-qwen2", seed=4, attn_implementation="sdpa")
    graph, eager = engine_pair(model)
    ids, mask = prompts(3, 5, seed=6)
    with pytest.warns(GraphRefusedWarning, match="npu_fusion_attention_v3"):
        out = greedy(graph, ids, mask)
    assert torch.equal(out, greedy(eager, ids, mask))
    s = graph.graph_stats
    assert s.captures == 0 and s.warmups == 0 and "attn_implementation='eager'" in s.last_refusal_reason
    assert not launches(npu_without_v3, "v1", capturing=True)


@pytest.mark.stub
def test_graph_mode_attention_that_fails_its_first_run_turns_graphs_off_without_failing_the_call(monkeypatch):
    """v3 rejects this chip: its first run is a warm-up, whose failure must not reach the caller."""
    stub = make_stub_torch_npu(v3_error="stub torch_npu: Ascend950 not support")
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    set_accelerator(CPUEmulatedNPU())
    model = build_model("tiny-llama", seed=4, attn_implementation="sdpa")
    graph, eager = engine_pair(model)
    ids, mask = prompts(3, 5, seed=6)
    expected = greedy(eager, ids, mask)
    with pytest.warns(GraphRefusedWarning, match="'npu_graph' failed in its first run.*Ascend950"):
        assert torch.equal(greedy(graph, ids, mask), expected)
    tried = len(launches(stub, "v3"))
    assert torch.equal(greedy(graph, ids, mask), expected)  # refused now: no new attempt
    assert len(launches(stub, "v3")) == tried == 1 and model.config._attn_implementation == "sdpa"
    s = graph.graph_stats
    assert s.captures == 0 and s.fallbacks >= 1 and "npu_graph" in s.last_refusal_reason
    # A rollout warms its buckets up front: the same failure, the same eager rollout.
    want = rollout(model, graphs=False, max_batch_size=4).generate(rollout_request(), SAMPLED)
    roll = rollout(model, graphs=True, max_batch_size=4)
    with pytest.warns(GraphRefusedWarning, match="npu_graph"):
        assert_same_rollouts(roll.generate(rollout_request(), SAMPLED), want)
    assert roll.graph_stats.captures == 0


# --------------------------------------------------------------- failed capture: host state put back
def _fail_in_capture_after_layer(model, layer):
    """A forward hook on decoder layer ``layer`` that reads a value on the host: fails only inside capture."""
    def host_read(module, args, out):
        bool(args[0].sum() > 0)  # a host read: legal eagerly, refused inside capture

    return model.model.layers[layer].register_forward_hook(host_read)


@pytest.mark.stub
@pytest.mark.parametrize("backend,failure", [("cpu", "kernel-107025"), ("cpu", "hook"), ("npu", "hook")])
def test_failed_capture_leaves_host_counters_as_before(backend, failure, request):
    """The capture fails after the step advanced host state (layer 0 wrote the cache); the fallback is exact."""
    if backend == "npu":
        request.getfixturevalue("npu_backend")
    elif failure == "kernel-107025":  # the CPU graph emulation, with torch's SDPA launching stub v1
        request.getfixturevalue("npu_sdpa")
    model = build_model("tiny-llama", seed=9, attn_implementation="sdpa", num_hidden_layers=3)
    if failure == "hook":
        _fail_in_capture_after_layer(model, 1)
    ref = rollout(model, graphs=False, max_batch_size=4)
    roll = rollout(model, graphs=True, max_batch_size=4)
    want = ref.generate(rollout_request(), SAMPLED)
    with pytest.warns(GraphRefusedWarning):
        got = roll.generate(rollout_request(), SAMPLED)
    assert_same_rollouts(got, want)
    s = roll.graph_stats
    assert s.fallbacks == 1 and s.captures == 0
    assert (ERR_107025 if failure == "kernel-107025" else "cannot be captured") in s.last_refusal_reason
    # Every host counter is where the eager run left it, plus the graph run's one up-front warm-up step (a
    # real step on free slots, one update per layer): the failed capture's cache writes were not counted.
    assert s.warmups == 1
    warm_up = model.config.num_hidden_layers
    assert roll.runner.slots.cache.host_state() == (ref.runner.slots.cache.host_state()[0] + warm_up,)
    assert roll.runner.stage.cache.host_state() == ref.runner.stage.cache.host_state()
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.stub
def test_failed_capture_restores_counters_at_the_runner():
    """The counter a failed capture advanced (through a row view of the cache) is put back by the runner."""
    from hybrid_engine.decode.kv_pool import KVBudget
    from hybrid_engine.graphs.keys import GraphKey
    from hybrid_engine.graphs.runner import DecodeGraphRunner

    model = build_model("tiny-llama", seed=1)
    runner = DecodeGraphRunner(model)
    slots = runner.prepare(rows=2, capacity=8, num_eos=1, graphs=True,
                           budget=KVBudget(16, None, None, "RolloutConfig.kv_cache", 4, 4))
    view = slots.cache.rows_view(0, 2)
    view.set_forward(ForwardIndices(write_slots=torch.zeros(2, dtype=torch.int64), kv_len=1, fresh=True))  # the null page

    def step():
        view.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
        if is_capturing():
            raise RuntimeError("fails after advancing host state")

    key = GraphKey(2, 1, (False, False, False))
    runner._run(key, step)  # warm-up (eager): counted
    assert slots.cache.num_updates == 1
    with pytest.warns(GraphRefusedWarning, match="fails after advancing host state"):
        runner._run(key, step)  # capture fails -> restored -> the step runs eagerly once
    assert slots.cache.num_updates == 2 and runner.stats.fallbacks == 1


# ------------------------------------------------------------------- two engines, one process
@pytest.mark.stub
@pytest.mark.parametrize("backend", ["cpu", "npu"])
def test_two_engines_with_different_layer_counts_side_by_side(backend, request):
    if backend == "npu":
        request.getfixturevalue("npu_backend")
    models = [build_model("tiny-llama", seed=11, num_hidden_layers=3),
              build_model("tiny-qwen2", seed=12, num_hidden_layers=1, num_key_value_heads=4)]
    ids, mask = prompts(3, 5, seed=4)
    pairs = [engine_pair(m) for m in models]
    expected = [greedy(eager, ids, mask) for _, eager in pairs]
    wants = [rollout(m, graphs=False, max_batch_size=4).generate(rollout_request(2), SAMPLED) for m in models]
    rolls = [rollout(m, graphs=True, max_batch_size=4) for m in models]
    for _ in range(3):  # interleaved: each call captures or replays its own graphs
        for model, (graph, _), want in zip(models, pairs, expected):
            got = greedy(graph, ids, mask)
            if backend == "npu":  # captured with npu_graph, eager with SDPA: other kernels
                assert_greedy_outputs_close(model, ids, mask, got, want)
            else:  # the CPU graphs replay the eager steps' own kernels: the same tokens
                assert torch.equal(got, want)
        for model, roll, want in zip(models, rolls, wants):
            got = roll.generate(rollout_request(2), SAMPLED)
            if backend == "npu":
                assert_rollouts_close(model, got, want)
            else:
                assert_same_rollouts(got, want)
    for model, (graph, _), roll in zip(models, pairs, rolls):
        layers = model.config.num_hidden_layers
        assert len(roll.runner.slots.cache.layers) == len(roll.runner.stage.cache.layers) == layers
        for s in (graph.graph_stats, roll.graph_stats):
            assert s.captures >= 1 and s.replays > 0 and s.fallbacks == 0 and s.invalidations == 0
