"""PEFT LoRA models on the engine and the rollout, with graphs on (tiny GPT-2 and tiny Llama, on CPU).

``peft.get_peft_model`` injects LoRA layers into the transformers model it
wraps; ``peft_model.get_base_model()`` is that model, LoRA included, and it is
what the engine and the rollout are given (``initialize`` builds the optimizer
from its trainable parameters: the LoRA weights). What must hold:

* LoRA weights trained in place are read by the next replay: no recapture, and
  graph output equals eager output after every step;
* ``merge_adapter()`` in place (same storage, but the layers' forward takes
  another branch) and ``unmerge_adapter()`` recapture, and the graphs then equal
  eager; ``merge_adapter(safe_merge=True)`` re-allocates and is caught as a
  weight change; ``disable_adapter()`` likewise;
* TRL's GRPOTrainer on a PEFT model generates through ``make_rollout_func``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiers import fast_first

peft = pytest.importorskip("peft", reason="needs the peft extra")

import hybrid_engine  # noqa: E402
from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig  # noqa: E402
from hybrid_engine.graphs.fingerprint import adapter_fingerprint, graph_fingerprint  # noqa: E402
from hybrid_engine.tiny_models import build_model, build_tokenizer  # noqa: E402

NO_EOS = 10_000  # outside the tiny vocab: every response runs to its budget
TARGETS = {"tiny-gpt2": ["c_attn", "c_fc"], "tiny-llama": ["q_proj", "v_proj", "gate_proj"]}
FAMILIES = tuple(TARGETS)


def _lora(name: str, seed: int = 0):
    """A LoRA model with random (non-zero) adapters, so the adapter changes every output."""
    model = build_model(name, seed=seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[name], lora_dropout=0.0,
                             init_lora_weights=False, fan_in_fan_out=name == "tiny-gpt2")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def _request(seed: int = 0) -> RolloutRequest:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 384, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # one left-padded row
    return RolloutRequest(ids, mask)


def _rollouts(model_or_engine, base):
    """A graphed rollout (on ``model_or_engine``) and an eager one on the same module."""
    config = RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=NO_EOS)
    graphed = HybridEngineRollout(model_or_engine, config=config)
    eager = HybridEngineRollout(base, config=dataclasses.replace(config, use_graph_capture=False))
    return graphed, eager


def _assert_same(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.response_logprobs, b.response_logprobs)


def _engine(base, *, graphs: bool, lr: float | None = None):
    config = {"hybrid_engine": {"enabled": True, "max_out_tokens": 64, "enable_graph_capture": graphs}}
    if lr is not None:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr}}
    engine, *_ = hybrid_engine.initialize(model=base, config=config)
    return engine


def _generate(engine, req: RolloutRequest, *, sample: bool, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return engine.generate(input_ids=req.prompt_ids, attention_mask=req.prompt_attention_mask, max_new_tokens=8,
                           do_sample=sample, top_k=0, pad_token_id=0, eos_token_id=NO_EOS)


def _lora_params(base):
    return {n: p for n, p in base.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trained_in_place_is_replayed_without_recapture(family):
    pm = _lora(family)
    base = pm.get_base_model()
    engine = _engine(base, graphs=True, lr=5e-2)
    eager_engine = _engine(base, graphs=False)
    rollout, eager = _rollouts(engine, base)
    lora = _lora_params(base)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if "lora_" not in n}
    assert lora and all(p.requires_grad for p in lora.values())
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == {id(p) for p in lora.values()}
    ptrs = {n: p.data_ptr() for n, p in lora.items()}
    req = _request()
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, n_samples_per_prompt=2, seed=11)
    previous = None
    for step in range(3):
        batch = rollout.generate(req, sampling)
        _assert_same(batch, eager.generate(req, sampling))
        for sample in (False, True):
            assert torch.equal(_generate(engine, req, sample=sample, seed=step),
                               _generate(eager_engine, req, sample=sample, seed=step))
        if previous is not None:  # same seed, new LoRA weights: the replay read them
            assert not torch.equal(batch.response_logprobs, previous.response_logprobs)
        previous = batch
        if step == 0:
            captured = (rollout.graph_stats.captures, engine.graph_stats.captures)
            assert captured[0] > 0 and captured[1] > 0
        # One LoRA training step on the rollout's own tokens.
        engine.train()
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        engine.backward(engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss)
        engine.step()
        engine.eval()
    assert (rollout.graph_stats.captures, engine.graph_stats.captures) == captured
    assert rollout.graph_stats.invalidations == 0 and engine.graph_stats.invalidations == 0
    assert rollout.last_stats["graph_replays"] > 0 and rollout.last_stats["fallbacks"] == 0
    assert {n: p.data_ptr() for n, p in lora.items()} == ptrs  # updated in place
    assert all(torch.equal(p, frozen[n]) for n, p in base.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("family", fast_first(FAMILIES))
def test_merge_and_unmerge_recapture_and_match_eager(family):
    pm = _lora(family)
    base = pm.get_base_model()
    engine = _engine(base, graphs=True)
    eager_engine = _engine(base, graphs=False)
    rollout, eager = _rollouts(base, base)
    req = _request(1)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, n_samples_per_prompt=2, seed=3)
    layer = next(m for m in base.modules() if hasattr(m, "merged_adapters"))
    weight = layer.get_base_layer().weight

    def check(expect_invalidations: int):
        _assert_same(rollout.generate(req, sampling), eager.generate(req, sampling))
        assert rollout.graph_stats.invalidations == expect_invalidations
        assert rollout.last_stats["graph_replays"] > 0
        for sample in (False, True):
            assert torch.equal(_generate(engine, req, sample=sample), _generate(eager_engine, req, sample=sample))
        assert engine.graph_stats.invalidations == expect_invalidations

    check(0)
    ptr, before = weight.data_ptr(), weight.detach().clone()
    pm.merge_adapter()  # in place: same storage, and the LoRA layers now skip their adapter branch
    assert layer.merged and weight.data_ptr() == ptr and not torch.equal(weight, before)
    check(1)
    pm.unmerge_adapter()  # in place again
    assert not layer.merged and weight.data_ptr() == ptr
    check(2)
    pm.merge_adapter(safe_merge=True)  # re-allocates the merged weight before peft 0.22, in place since
    assert layer.merged and not torch.equal(layer.get_base_layer().weight, before)
    check(3)  # either way a change the graphs must see (new storage, or the adapter's merged state)
    pm.unmerge_adapter()
    check(4)
    with pm.disable_adapter():  # the base model alone
        check(5)
    check(6)


def test_adapter_state_is_part_of_the_graph_fingerprint():
    pm = _lora("tiny-llama")
    base = pm.get_base_model()
    fp, adapters = graph_fingerprint(base), adapter_fingerprint(base)
    assert len(adapters) == 2 * 3  # two layers, three targets each
    with torch.no_grad():
        for p in _lora_params(base).values():
            p.add_(0.1)  # an optimizer step: in place, the same graphs stay valid
    assert graph_fingerprint(base) == fp
    for change, undo in ((pm.merge_adapter, pm.unmerge_adapter),
                         (lambda: pm.base_model.disable_adapter_layers(), lambda: pm.base_model.enable_adapter_layers())):
        change()
        assert adapter_fingerprint(base) != adapters and graph_fingerprint(base) != fp
        undo()
        assert adapter_fingerprint(base) == adapters
    layer = next(m for m in base.modules() if hasattr(m, "merged_adapters"))
    layer.scaling["default"] *= 2  # a constant a captured step bakes in
    assert adapter_fingerprint(base) != adapters
    assert adapter_fingerprint(build_model("tiny-llama")) == ()


def test_trl_grpo_trains_a_lora_model_through_the_rollout_func(tmp_path, monkeypatch):
    pytest.importorskip("trl", reason="needs the trl extra")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_engine.integrations.trl import make_rollout_func

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    pm = _lora("tiny-llama")
    base = pm.get_base_model()
    lora_before = {n: p.detach().clone() for n, p in _lora_params(base).items()}
    fn = make_rollout_func()
    checks = []
    eager = []

    def rollout_func(prompts, trainer):
        out = fn(prompts, trainer)
        if not eager:
            eager.append(HybridEngineRollout(base, config=dataclasses.replace(fn.rollout.config,
                                                                              use_graph_capture=False)))
        ref = eager[0].generate(fn.last_request, fn.last_sampling)
        checks.append((out["completion_ids"], ref, fn.rollout.last_stats["graph_captures"]))
        return out

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        max_steps=2, learning_rate=5e-2, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", disable_dropout=True, seed=0,  # TRL's default gradient checkpointing
    )
    trainer = GRPOTrainer(model=pm, reward_funcs=lambda completions, **kw: [len(c) / 30.0 for c in completions],
                          args=args, processing_class=build_tokenizer(), rollout_func=rollout_func,
                          train_dataset=Dataset.from_dict({"prompt": ["the cat is in the water", "you can find it",
                                                                      "what is the day", "he was not"]}))
    trainer.train()
    assert trainer.state.global_step == 2 and fn.rollout.model is base
    assert [c[2] for c in checks][1:] == [0]  # captured in the first call only
    for completions, ref, _ in checks:
        assert completions == [r[:n] for r, n in zip(ref.responses.tolist(), ref.response_lengths.tolist())]
    assert all(not torch.equal(p, lora_before[n]) for n, p in _lora_params(base).items())


def test_the_peft_wrapper_itself_is_accepted():
    pm = _lora("tiny-gpt2")
    engine = _engine(pm, graphs=True, lr=1e-2)
    base_engine = _engine(pm.get_base_model(), graphs=False)
    req = _request()
    for _ in range(2):
        for sample in (False, True):
            assert torch.equal(_generate(engine, req, sample=sample), _generate(base_engine, req, sample=sample))
        engine.train()
        ids = req.prompt_ids
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.eval()
    assert engine.graph_stats.captures > 0 and engine.graph_stats.fallbacks == 0
    graphed, eager = _rollouts(engine, pm.get_base_model())
    assert graphed.model is pm.get_base_model()
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3)
    _assert_same(graphed.generate(req, sampling), eager.generate(req, sampling))
    _assert_same(HybridEngineRollout(pm, config=graphed.config).generate(req, sampling), eager.generate(req, sampling))
