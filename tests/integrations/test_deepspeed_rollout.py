"""DeepSpeedRolloutEngine: DeepSpeed's rollout ABC served by our graphed rollout.

Checked against DeepSpeed itself: its own ``HybridEngineRollout`` (greedy, the
reference layout), its ``ResponseTokenBatch.from_rollout`` and its
``generalized_jsd_loss`` (an on-policy distillation step on our batches).
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

pytest.importorskip("deepspeed.runtime.rollout.base", reason="needs the deepspeed extra")

from deepspeed.runtime.rollout import (  # noqa: E402
    HybridEngineRollout as DSHybridEngineRollout,
)
from deepspeed.runtime.rollout import (  # noqa: E402
    ResponseTokenBatch,
    RolloutBatch,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
    generalized_jsd_loss,
)
from deepspeed.runtime.rollout import RolloutConfig as DSRolloutConfig  # noqa: E402
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig  # noqa: E402

import hybrid_engine  # noqa: E402
from hybrid_engine import rollout as ours  # noqa: E402
from hybrid_engine.integrations.deepspeed import (
    DeepSpeedRolloutEngine,
    to_deepspeed_batch,
    to_hybrid_request,
    to_hybrid_sampling,
)
from hybrid_engine.tiny_models import build_model  # noqa: E402

NO_EOS = 10_000  # outside the tiny vocab: never generated
PAD = 0


def _request(batch: int = 3, width: int = 7, seed: int = 0) -> RolloutRequest:
    """Left-padded prompts: row ``b`` has ``b % 3`` pads (id 0, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 384, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        ids[b, : b % 3] = PAD
        mask[b, : b % 3] = 0
    return RolloutRequest(ids, mask)


def _adapter(model, *, graphs: bool, eos: int = NO_EOS, **config) -> DeepSpeedRolloutEngine:
    cfg = ours.RolloutConfig(use_graph_capture=graphs, pad_token_id=PAD, eos_token_id=eos, **config)
    return DeepSpeedRolloutEngine(model, config=cfg)


def _eos_cutting_row0(model, request: RolloutRequest, sampling: SamplingConfig, seed: int) -> int:
    """A token the first response emits third: as EOS it ends that row early, others later or never."""
    batch = _adapter(model, graphs=False).generate(request, sampling, seed=seed)
    return int(batch.input_ids[0, request.prompt_ids.shape[1] + 2])


def _assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.response_start_idx, b.response_start_idx)


# ---------------------------------------------------------------------- interface
def test_is_deepspeeds_rollout_engine_and_builds_from_what_ds_users_hold():
    model = build_model("tiny-gpt2", seed=0)
    assert issubclass(DeepSpeedRolloutEngine, RolloutEngine)
    adapter = _adapter(model, graphs=True)
    assert isinstance(adapter, RolloutEngine) and adapter.model is model

    wrapped = ours.HybridEngineRollout(model, config=ours.RolloutConfig(pad_token_id=PAD))
    assert DeepSpeedRolloutEngine(wrapped).rollout is wrapped  # shares its runner and graphs

    engine = hybrid_engine.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1})[0]
    assert DeepSpeedRolloutEngine(engine).model is model
    ds_like_engine = types.SimpleNamespace(module=model)  # a DeepSpeedEngine exposes the model as .module
    assert DeepSpeedRolloutEngine(ds_like_engine).model is model

    # DeepSpeed's own configs carry over.
    assert DeepSpeedRolloutEngine(model, config=DSRolloutConfig(use_graph_capture=True)).rollout.config.use_graph_capture
    he_cfg = HybridEngineRolloutConfig(use_graph_capture=True, use_shared_prefill=False, enable_profiling=True)
    cfg = DeepSpeedRolloutEngine(model, config=he_cfg).rollout.config
    assert cfg.use_graph_capture and not cfg.use_shared_prefill and cfg.enable_profiling


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-opt"])
def test_greedy_equals_deepspeeds_own_rollout(arch):
    """Same tokens, masks and response_start_idx as DeepSpeed's HybridEngineRollout (its HF generate path).

    DeepSpeed always returns T_p + max_new_tokens columns; ours stops at the longest response, so
    DeepSpeed's extra columns must be masked padding.
    """
    model = build_model(arch, seed=0)
    request = _request()
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0, n_samples_per_prompt=2)
    for eos in (NO_EOS, _eos_cutting_row0(model, request, sampling, seed=0)):
        tokenizer = types.SimpleNamespace(pad_token_id=PAD, eos_token_id=eos)
        reference = DSHybridEngineRollout(types.SimpleNamespace(module=model), tokenizer).generate(request, sampling)
        got = _adapter(model, graphs=True, eos=eos).generate(request, sampling)
        width = got.input_ids.shape[1]
        assert torch.equal(got.input_ids, reference.input_ids[:, :width])
        assert torch.equal(got.attention_mask, reference.attention_mask[:, :width])
        assert not reference.attention_mask[:, width:].any()
        assert torch.equal(got.response_start_idx, reference.response_start_idx)
    assert got.attention_mask[0, 7 + 3:].sum() == 0  # row 0 ended at its EOS (kept, mask 1), padded after


def test_batch_round_trips_through_response_token_batch():
    model = build_model("tiny-qwen3", seed=1)
    request = _request(batch=3, width=6, seed=2)
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.9, top_p=0.95, n_samples_per_prompt=2)
    eos = _eos_cutting_row0(model, request, sampling, seed=11)
    adapter = _adapter(model, graphs=True, eos=eos)
    batch = adapter.generate(request, sampling, seed=11)
    native = adapter.last_rollout

    assert type(batch) is RolloutBatch and batch.batch_size == 6
    assert batch.response_start_idx.dtype == torch.int64 and batch.response_start_idx.shape == (6,)
    assert batch.response_start_idx.device == batch.input_ids.device
    assert (batch.response_start_idx == 6).all()
    # Prompt i's samples are rows 2i, 2i+1 (DeepSpeed's repeat_interleave order), prompt left padding kept.
    assert torch.equal(batch.input_ids[:, :6], request.prompt_ids.repeat_interleave(2, dim=0))
    assert torch.equal(batch.attention_mask[:, :6], request.prompt_attention_mask.repeat_interleave(2, dim=0))
    lengths = native.response_lengths
    assert lengths[0] == 3 and lengths.max() == batch.seq_len - 6  # right-padded to the longest response
    responses = batch.input_ids[:, 6:]
    real = torch.arange(responses.shape[1])[None, :] < lengths[:, None]
    assert torch.equal(batch.attention_mask[:, 6:].bool(), real)
    assert (responses[~real] == PAD).all()

    targets = ResponseTokenBatch.from_rollout(batch)
    assert torch.equal(targets.response_mask.sum(dim=1), lengths)
    assert torch.equal(targets.target_ids[targets.response_mask], responses[real])
    # And back: the conversion is exactly ours plus a response_start_idx tensor.
    _assert_same(to_deepspeed_batch(native), batch)


def test_distillation_step_on_our_batches_reuses_the_capture():
    """An OPSD loop: our rollout -> DeepSpeed's targets and JSD loss -> in-place optimizer step -> sync_weights."""
    student = build_model("tiny-llama", seed=3)
    teacher = build_model("tiny-qwen2", seed=4)
    engine = hybrid_engine.initialize(  # [0]: the engine, whether initialize returns 2 or 4 items
        model=student,
        config={"train_micro_batch_size_per_gpu": 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}},
    )[0]
    adapter = DeepSpeedRolloutEngine(
        engine, config=ours.RolloutConfig(use_graph_capture=True, pad_token_id=PAD, eos_token_id=NO_EOS), seed=7
    )
    request = _request(batch=3, width=6, seed=5)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=0, n_samples_per_prompt=2)
    captures, previous = [], None
    for step in range(2):
        adapter.sync_weights(step)
        assert not adapter.last_sync_reallocated  # AdamW updates in place: nothing to do
        batch = adapter.generate(request, sampling)
        captures.append(adapter.last_stats["graph_captures"])
        assert adapter.last_stats["graph_replays"] > 0
        eager = _adapter(student, graphs=False).generate(request, sampling, seed=adapter.last_seed)
        _assert_same(batch, eager)  # the replay saw the updated weights
        if previous is not None:
            assert not torch.equal(adapter.last_rollout.response_logprobs, previous)
        previous = adapter.last_rollout.response_logprobs

        targets = ResponseTokenBatch.from_rollout(batch)
        engine.train()
        student_logits = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        with torch.no_grad():
            teacher_logits = teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        out = generalized_jsd_loss(
            targets.select_causal_logits(student_logits), targets.select_causal_logits(teacher_logits),
            targets.response_mask, beta=0.5,
        )
        assert torch.isfinite(out.loss) and out.loss > 0
        assert out.valid_token_count == adapter.last_rollout.response_lengths.sum() == 36
        same = generalized_jsd_loss(
            targets.select_causal_logits(student_logits), targets.select_causal_logits(student_logits),
            targets.response_mask,
        )
        assert same.loss.abs() < 1e-6
        engine.backward(out.loss)
        engine.step()
    assert engine.global_steps == 2
    assert captures[0] >= 1 and captures[1:] == [0]
    assert adapter.weight_reallocations == 0 and adapter.last_seed == 8  # seed 7 + one earlier call


# ------------------------------------------------------------------ graph == eager
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_equals_eager_through_the_adapter(temperature):
    model = build_model("tiny-mistral", seed=6)
    request = _request(batch=4, width=5, seed=8)
    sampling = SamplingConfig(max_new_tokens=6, temperature=temperature, top_p=0.9, top_k=20,
                              n_samples_per_prompt=2)
    graphed, eager = _adapter(model, graphs=True), _adapter(model, graphs=False)
    a = graphed.generate(request, sampling, seed=3)
    assert graphed.last_stats["graph_replays"] == graphed.last_stats["decode_steps"] > 0
    _assert_same(a, eager.generate(request, sampling, seed=3))
    # No explicit seed: drawn from torch's generator, so torch.manual_seed fixes the samples.
    torch.manual_seed(0)
    b = graphed.generate(request, sampling)
    torch.manual_seed(0)
    _assert_same(b, eager.generate(request, sampling))
    assert graphed.last_stats["graph_captures"] == 0  # the first call's graphs are replayed
    if temperature > 0:
        assert not torch.equal(a.input_ids, b.input_ids)


def test_sampling_semantics_match_deepspeeds():
    greedy, _ = to_hybrid_sampling(SamplingConfig(max_new_tokens=3, temperature=-1.0, top_p=0.5, top_k=7))
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 1.0, -1)  # DeepSpeed ignores top_p/top_k when greedy
    for top_k in (0, -1, -5):  # DeepSpeed: top_k <= 0 disables top-k
        assert to_hybrid_sampling(SamplingConfig(max_new_tokens=3, top_k=top_k))[0].top_k == -1
    mapped, slots = to_hybrid_sampling(
        SamplingConfig(max_new_tokens=3, temperature=0.7, top_p=0.8, top_k=5, n_samples_per_prompt=4,
                       continuous_batch_size=2), seed=9,
    )
    assert mapped == ours.SamplingConfig(max_new_tokens=3, temperature=0.7, top_p=0.8, top_k=5,
                                         n_samples_per_prompt=4, seed=9)
    assert slots == 2

    # The adapter samples exactly what our own API samples with the mapped config.
    model = build_model("tiny-gpt2", seed=2)
    request = _request(seed=4)
    adapter = _adapter(model, graphs=True)
    got = adapter.generate(request, SamplingConfig(max_new_tokens=5, top_k=0, n_samples_per_prompt=3), seed=5)
    direct = ours.HybridEngineRollout(model, config=adapter.rollout.config).generate(
        to_hybrid_request(request), ours.SamplingConfig(max_new_tokens=5, temperature=1.0, top_k=-1,
                                                        n_samples_per_prompt=3, seed=5)
    )
    _assert_same(got, to_deepspeed_batch(direct))


def test_continuous_batch_size_bounds_the_rows_not_the_tokens():
    model = build_model("tiny-qwen2", seed=3)
    request = _request(batch=3, width=6, seed=6)
    adapter = _adapter(model, graphs=True)
    config = adapter.rollout.config
    kwargs = dict(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=2)
    reference = adapter.generate(request, SamplingConfig(**kwargs), seed=2)
    assert adapter.last_stats["peak_active_batch"] == 6
    for slots in (1, 4):
        batch = adapter.generate(request, SamplingConfig(**kwargs, continuous_batch_size=slots), seed=2)
        assert adapter.last_stats["peak_active_batch"] == slots
        _assert_same(batch, reference)
        assert adapter.rollout.config is config  # the call's slot bound is not kept


# ------------------------------------------------------------------- sync_weights
def test_sync_weights_drops_graphs_only_when_weights_were_reallocated():
    model = build_model("tiny-gpt2", seed=5)
    request = _request(seed=9)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0)
    adapter = _adapter(model, graphs=True)
    adapter.sync_weights(0)  # before any call: nothing captured, nothing to do
    first = adapter.generate(request, sampling)
    assert adapter.last_stats["graph_captures"] >= 1

    # In-place update (what an optimizer step does): graphs stay and see the new values.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.3)
    adapter.sync_weights(1)
    assert not adapter.last_sync_reallocated and adapter.rollout.graph_stats.graph_keys >= 1
    second = adapter.generate(request, sampling)
    assert adapter.last_stats["graph_captures"] == 0 and adapter.last_stats["graph_replays"] > 0
    assert not torch.equal(second.input_ids, first.input_ids)
    _assert_same(second, _adapter(model, graphs=False).generate(request, sampling))

    # Re-allocation: the graphs would read the old storage; sync drops them now, the next call recaptures.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 0.8
    invalidations = adapter.rollout.graph_stats.invalidations
    adapter.sync_weights(2)
    assert adapter.last_sync_reallocated and adapter.weight_reallocations == 1 and adapter.last_synced_step == 2
    assert adapter.rollout.graph_stats.graph_keys == 0
    assert adapter.rollout.graph_stats.invalidations == invalidations + 1
    third = adapter.generate(request, sampling)
    assert adapter.last_stats["graph_captures"] >= 1
    _assert_same(third, _adapter(model, graphs=False).generate(request, sampling))
    adapter.sync_weights(3)
    assert not adapter.last_sync_reallocated and adapter.weight_reallocations == 1
    # Freezing a layer re-allocates nothing: not reported as a re-allocation (the next call recaptures,
    # since eager kernels may differ).
    model.transformer.h[0].requires_grad_(False)
    adapter.sync_weights(4)
    assert not adapter.last_sync_reallocated and adapter.weight_reallocations == 1

    adapter.shutdown()
    assert adapter.rollout.runner.slots is None and adapter.rollout.graph_stats.graph_keys == 0


# --------------------------------------------------------------------- bad inputs
def test_bad_inputs_give_clear_errors_before_any_work():
    model = build_model("tiny-gpt2", seed=0)
    adapter = _adapter(model, graphs=True)
    request = _request()
    ok = SamplingConfig(max_new_tokens=4)
    ids, mask = request.prompt_ids, request.prompt_attention_mask

    with pytest.raises(TypeError, match="deepspeed.runtime.rollout.RolloutRequest.*own RolloutRequest"):
        adapter.generate(ours.RolloutRequest(ids, mask), ok)
    with pytest.raises(TypeError, match="deepspeed.runtime.rollout.SamplingConfig.*own SamplingConfig"):
        adapter.generate(request, ours.SamplingConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="left-padded"):
        adapter.generate(RolloutRequest(ids, mask.flip(1)), ok)
    with pytest.raises(ValueError, match="all zero"):
        adapter.generate(RolloutRequest(ids, torch.zeros_like(mask)), ok)
    with pytest.raises(ValueError, match="top_p must be in"):
        adapter.generate(request, SamplingConfig(max_new_tokens=4, top_p=0.0))
    with pytest.raises(ValueError, match="top_k must be an integer"):
        adapter.generate(request, SamplingConfig(max_new_tokens=4, top_k=2.5))
    with pytest.raises(TypeError, match="SamplingConfig.temperature must be a number"):
        adapter.generate(request, SamplingConfig(max_new_tokens=4, temperature="hot"))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        adapter.generate(request, SamplingConfig(max_new_tokens=0))
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 1"):
        adapter.generate(request, SamplingConfig(max_new_tokens=4, n_samples_per_prompt=0))
    with pytest.raises(ValueError, match="continuous_batch_size must be None or a positive int"):
        adapter.generate(request, SamplingConfig(max_new_tokens=4, continuous_batch_size=0))
    with pytest.raises(ValueError, match="position limit"):
        adapter.generate(request, SamplingConfig(max_new_tokens=600))
    with pytest.raises(TypeError, match="seed must be an int"):
        adapter.generate(request, ok, seed=1.5)
    with pytest.raises(ValueError, match="DeepSpeedRolloutEngine.generate: seed must fit in int64, got 18446744073709551616"):
        adapter.generate(request, ok, seed=2**64)
    bucketed = _adapter(model, graphs=True, graph_batch_sizes=(1, 2))
    with pytest.raises(ValueError, match="continuous_batch_size=4.*graph_batch_sizes"):
        bucketed.generate(request, SamplingConfig(max_new_tokens=4, continuous_batch_size=4))
    assert adapter.calls == 0 and adapter.rollout.graph_stats.captures == 0  # nothing ran

    with pytest.raises(TypeError, match="step must be an int"):
        adapter.sync_weights("3")
    with pytest.raises(ValueError, match="already a HybridEngineRollout"):
        DeepSpeedRolloutEngine(adapter.rollout, config=ours.RolloutConfig())
    with pytest.raises(TypeError, match="HybridEngine .* or a transformers PreTrainedModel"):
        DeepSpeedRolloutEngine(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="config must be"):
        DeepSpeedRolloutEngine(model, config={"use_graph_capture": True})
    with pytest.raises(ValueError, match="DeepSpeedRolloutEngine: seed must fit in int64"):
        DeepSpeedRolloutEngine(model, seed=2**63)
    with pytest.raises(ValueError, match="serves 'hybrid_engine' only"):
        DeepSpeedRolloutEngine(model, config=DSRolloutConfig(engine="vllm"))

    # The adapter is still usable after every refusal.
    batch = adapter.generate(request, ok)
    assert batch.batch_size == 3 and adapter.calls == 1

    # A base seed at the top of int64: each later call's seed wraps around instead of leaving int64.
    counted = DeepSpeedRolloutEngine(model, config=ours.RolloutConfig(pad_token_id=PAD, eos_token_id=NO_EOS),
                                     seed=2**63 - 1)
    sampled = SamplingConfig(max_new_tokens=3, temperature=1.0)
    counted.generate(request, sampled)
    counted.generate(request, sampled)
    assert counted.last_seed == -(2**63) and counted.calls == 2


def test_a_refused_call_leaves_torchs_generator_for_the_next_one():
    # Without a seed, each sampled call draws one from torch's generator (torch.manual_seed reproduces a run);
    # a refused call, the rollout's own position-limit refusal included, must not have drawn it.
    model = build_model("tiny-gpt2", seed=0)
    adapter, reference = _adapter(model, graphs=True), _adapter(model, graphs=False)
    request, ok = _request(), SamplingConfig(max_new_tokens=4)
    assert ok.temperature > 0
    torch.manual_seed(0)
    first = reference.generate(request, ok).input_ids
    torch.manual_seed(0)
    for bad in (SamplingConfig(max_new_tokens=4, top_p=0.0), SamplingConfig(max_new_tokens=4, continuous_batch_size=0),
                SamplingConfig(max_new_tokens=600)):
        with pytest.raises(ValueError):
            adapter.generate(request, bad)
    assert torch.equal(adapter.generate(request, ok).input_ids, first)


def test_import_error_names_the_extra_without_deepspeed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.rollout.base", None)
    monkeypatch.delitem(sys.modules, "hybrid_engine.integrations.deepspeed")
    with pytest.raises(ImportError, match=r"pip install hybrid-engine\[deepspeed\]"):
        importlib.import_module("hybrid_engine.integrations.deepspeed")
