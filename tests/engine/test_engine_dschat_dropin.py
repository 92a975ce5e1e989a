"""Issue 42's smaller contracts: the model-change check ignores new plain attributes (but not what a graph
reads), ``deepspeed.initialize`` replaced by ``hybrid_engine.initialize`` still reaches DeepSpeed's own, and
``synced_gpus`` keeps the fast path."""

from __future__ import annotations

import pytest
import torch

import hybrid_engine
from hybrid_engine.distributed import deepspeed_import
from hybrid_engine.tiny_models import build_model

CONFIG = {"hybrid_engine": {"enable_graph_capture": True, "max_out_tokens": 32}}


def _ids():
    ids = torch.randint(4, 300, (2, 4), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)


def test_a_new_plain_attribute_keeps_the_graphs_a_read_one_does_not():
    model = build_model("tiny-llama", seed=1)
    engine, *_ = hybrid_engine.initialize(model=model, config=CONFIG)
    first = engine.generate(**_ids())
    captures = engine.graph_stats.captures
    model._num_params = 123  # DeepSpeed-Chat's throughput printer
    model.model.layers[0]._trace = {"note": "x"}
    assert torch.equal(engine.generate(**_ids()), first)
    assert engine.graph_stats.invalidations == 0 and engine.graph_stats.captures == captures > 0
    model._num_params = 456  # changed again: still nothing a graph read
    engine.generate(**_ids())
    assert engine.graph_stats.invalidations == 0
    norm = model.model.layers[0].input_layernorm
    norm.variance_epsilon = 10.0  # an attribute the forward reads: recaptured, and equal to eager
    graph = engine.generate(**_ids())
    assert engine.graph_stats.invalidations == 1
    eager, *_ = hybrid_engine.initialize(model=model, config={})
    assert torch.equal(graph, eager.generate(**_ids()))


def test_a_new_attribute_shadowing_a_class_attribute_recaptures():
    model = build_model("tiny-llama", seed=1)
    engine, *_ = hybrid_engine.initialize(model=model, config=CONFIG)
    engine.generate(**_ids())
    attn = model.model.layers[0].self_attn
    type(attn).probe_flag = False  # a class attribute a patched forward might read ...
    try:
        attn.probe_flag = True  # ... shadowed on the instance after capture
        engine.generate(**_ids())
        assert engine.graph_stats.invalidations == 1
    finally:
        del type(attn).probe_flag


def test_deepspeed_initialize_replaced_by_ours_is_still_found(monkeypatch):
    deepspeed = pytest.importorskip("deepspeed")
    own = deepspeed.initialize
    assert deepspeed_import.deepspeed_initialize(deepspeed) is own or not getattr(
        own, deepspeed_import.REPLACES_DEEPSPEED_INITIALIZE, False)
    monkeypatch.setattr(deepspeed, "initialize", hybrid_engine.initialize)
    assert deepspeed_import.deepspeed_initialize(deepspeed).__code__ is own.__code__
    # Patched before hybrid_engine ever saw DeepSpeed's: rebuilt from deepspeed/__init__.py.
    monkeypatch.setattr(deepspeed_import, "_original_initialize", None)
    rebuilt = deepspeed_import.deepspeed_initialize(deepspeed)
    assert rebuilt is not hybrid_engine.initialize and rebuilt.__name__ == "initialize"
    assert rebuilt.__code__.co_varnames[:rebuilt.__code__.co_argcount] == \
        own.__code__.co_varnames[:own.__code__.co_argcount]


@pytest.mark.parametrize("synced", [True, False])
def test_synced_gpus_keeps_the_fast_path(synced):
    model = build_model("tiny-opt", seed=1)
    engine, *_ = hybrid_engine.initialize(model=model, config=CONFIG)
    out = engine.generate(**_ids(), synced_gpus=synced)
    assert engine.graph_stats.captures > 0 and engine.graph_stats.last_refusal_reason is None
    assert torch.equal(out, model.generate(**_ids()))
    with pytest.raises(TypeError, match="synced_gpus"):
        engine.generate(**_ids(), synced_gpus="yes")
