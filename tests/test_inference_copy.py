"""The inference copy's mechanics on an unpartitioned source (ZeRO-3 itself: tests/distributed/test_zero.py)."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.inference_copy import InferenceCopy
from hybrid_engine.tiny_models import build_model


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


def test_a_model_with_injected_layers_is_refused_by_name_with_the_way_out():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model("tiny-llama", seed=0),
                                peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    with pytest.raises(ValueError, match=r"lora_A.*injected LoRA layers.*turn the copy off"):
        InferenceCopy(model.get_base_model())
