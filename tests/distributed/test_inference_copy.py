"""The inference copy's mechanics on an unpartitioned source, PEFT adapters included (ZeRO-3 itself:
tests/distributed/test_zero.py and tests/distributed/test_trl_zero3.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.distributed.inference_copy import InferenceCopy
from hybrid_engine.graphs.fingerprint import graph_fingerprint
from hybrid_engine.tiny_models import build_model
from tests.distributed.hand_lora import HandLoRA, inject_hand_lora


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen3"])
def test_the_copy_computes_what_its_source_does_and_follows_in_place_updates(name):
    source = build_model(name, seed=2)
    copy = InferenceCopy(source)
    model = copy.module
    assert type(model) is type(source) and model is not source and not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert {n for n, _ in model.named_buffers()} == {n for n, _ in source.named_buffers()}
    if source.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    assert not {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in source.parameters()}
    ids = torch.randint(4, 384, (2, 7), generator=torch.Generator().manual_seed(0))
    source.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, source(input_ids=ids).logits)
        addresses = [p.data_ptr() for p in model.parameters()]
        for p in source.parameters():
            p.mul_(0.5)
        assert not torch.equal(model(input_ids=ids).logits, source(input_ids=ids).logits)
        copy.refresh()
        assert [p.data_ptr() for p in model.parameters()] == addresses  # in place: graphs stay valid
        assert torch.equal(model(input_ids=ids).logits, source(input_ids=ids).logits)


def _lora(name: str, dtype: torch.dtype = torch.float32, **extra):
    peft = pytest.importorskip("peft")
    targets = {"tiny-gpt2": ["c_attn", "c_fc"], "tiny-llama": ["q_proj", "v_proj"]}[name]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
                             fan_in_fan_out=name == "tiny-gpt2", **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return peft.get_peft_model(build_model(name, seed=0).to(dtype), config)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_a_peft_model_gets_its_adapters_injected_and_their_state_mirrored_at_each_refresh(name):
    peft_model = _lora(name)
    source = peft_model.get_base_model()
    source.eval()
    copy = InferenceCopy(source)
    model = copy.module
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in source.named_parameters()]
    assert any("lora_A" in n for n, _ in model.named_parameters())
    ids = torch.randint(4, 384, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, ids), _logits(source, ids))
    addresses = [p.data_ptr() for p in model.parameters()]
    with torch.no_grad():  # a training step on the adapters only
        for n, p in source.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    assert not torch.equal(_logits(model, ids), _logits(source, ids))
    copy.refresh()
    assert torch.equal(_logits(model, ids), _logits(source, ids))
    print_before = graph_fingerprint(model)
    peft_model.merge_adapter()  # the delta moves into the base weights; the layers take another branch
    copy.refresh()
    assert graph_fingerprint(model) != print_before  # so graphs captured before are dropped
    assert torch.allclose(_logits(model, ids), _logits(source, ids), atol=1e-5)
    peft_model.unmerge_adapter()
    with peft_model.disable_adapter():
        copy.refresh()
        assert torch.equal(_logits(model, ids), _logits(source, ids))
    copy.refresh()
    assert torch.equal(_logits(model, ids), _logits(source, ids))
    assert [p.data_ptr() for p in model.parameters()] == addresses  # in place: graphs stay valid


def test_graph_rollouts_on_a_peft_copy_equal_eager_rollouts_on_its_source():
    peft_model = _lora("tiny-llama")
    source = peft_model.get_base_model()
    copy = InferenceCopy(source)
    config = RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=10_000)
    graphed = HybridEngineRollout(copy.module, config=config)
    eager = HybridEngineRollout(source, config=dataclasses.replace(config, use_graph_capture=False))
    ids = torch.randint(4, 384, (3, 6), generator=torch.Generator().manual_seed(1))
    request, sampling = RolloutRequest(ids, torch.ones_like(ids)), SamplingConfig(max_new_tokens=6, temperature=0.0)
    captures, responses = [], []
    for step in range(2):
        with torch.no_grad():
            for n, p in source.named_parameters():
                if "lora_B" in n:
                    p.add_(0.05 * (step + 1))
        copy.refresh()
        out, ref = graphed.generate(request, sampling), eager.generate(request, sampling)
        assert torch.equal(out.responses, ref.responses)
        assert graphed.last_stats["graph_replays"] > 0
        captures.append(graphed.last_stats["graph_captures"])
        responses.append(out.responses)
    assert captures[0] > 0 and captures[1] == 0  # the second call replays the first call's graphs
    assert not torch.equal(responses[0], responses[1])  # ... on the refreshed adapters


def test_peft_adapters_kept_in_fp32_beside_a_bf16_base_stay_fp32_in_the_copy():
    source = _lora("tiny-llama", torch.bfloat16).get_base_model()
    dtypes = {n: p.dtype for n, p in source.named_parameters()}
    assert {dtypes[n] for n in dtypes if "lora_" in n} == {torch.float32}  # PEFT's autocast_adapter_dtype
    copy = InferenceCopy(source)
    assert {n: p.dtype for n, p in copy.module.named_parameters()} == dtypes
    ids = torch.randint(4, 384, (2, 5), generator=torch.Generator().manual_seed(0))
    source.eval()
    assert torch.equal(_logits(copy.module, ids), _logits(source, ids))


def test_peft_modules_to_save_are_mirrored_too():
    peft_model = _lora("tiny-llama", modules_to_save=["lm_head"])
    source = peft_model.get_base_model()
    source.eval()
    copy = InferenceCopy(source)
    assert "lm_head.modules_to_save.default.weight" in dict(copy.module.named_parameters())
    ids = torch.randint(4, 384, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        source.lm_head.modules_to_save["default"].weight.add_(0.1)
    copy.refresh()
    assert torch.equal(_logits(copy.module, ids), _logits(source, ids))
    with peft_model.disable_adapter():  # the wrapper then runs the original lm_head
        copy.refresh()
        assert torch.equal(_logits(copy.module, ids), _logits(source, ids))


def test_layers_no_config_builds_get_a_structural_copy_with_their_flags_mirrored():
    source = inject_hand_lora(build_model("tiny-llama", seed=0)).eval()
    source.model.layers[0].register_forward_pre_hook(lambda m, args: None)  # as ZeRO-3's fetch hooks are
    copy = InferenceCopy(source)
    model = copy.module
    assert copy.structural and type(model.model.layers[0].self_attn.q_proj) is HandLoRA and not model.training
    assert not {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in source.parameters()}
    assert not model.model.layers[0]._forward_pre_hooks and source.model.layers[0]._forward_pre_hooks
    ids = torch.randint(4, 384, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, ids), _logits(source, ids))
    addresses = [p.data_ptr() for p in model.parameters()]
    before = graph_fingerprint(model)
    with torch.no_grad():
        for layer in source.model.layers:
            layer.self_attn.q_proj.lora_left_weight.mul_(2.0)
            layer.self_attn.v_proj.fuse_lora_weight()  # the weight changed in place, the branch off
    assert not torch.equal(_logits(model, ids), _logits(source, ids))
    copy.refresh()
    assert [p.data_ptr() for p in model.parameters()] == addresses  # in place: graphs stay valid
    assert model.model.layers[1].self_attn.v_proj.fuse_lora  # the flag mirrored, so the branch is not added twice
    assert graph_fingerprint(model) != before  # and a captured graph of the unfused branch is dropped
    assert torch.equal(_logits(model, ids), _logits(source, ids))


def test_a_module_tree_no_copy_can_mirror_is_refused_by_name_with_the_way_out():
    import threading

    source = build_model("tiny-llama", seed=0)
    source.model.layers[0].extra = torch.nn.Linear(4, 4)  # injected by hand: no config describes it
    source.model.layers[0].extra.lock = threading.Lock()  # and nothing deep-copies it
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra\.weight.*injected.*cannot be copied.*lock"
                                         r".*turn the copy off"):
        InferenceCopy(source)
