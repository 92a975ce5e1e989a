"""Property: graph tokens == eager tokens over architecture x batch x prompt width x padding x length.

Bounded to stay fast (``MAX_EXAMPLES`` derandomized examples, tiny models cached per architecture).
"""


import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_engine.accelerator import CPUAccelerator, get_accelerator, set_accelerator
from hybrid_engine.engine import initialize
from hybrid_engine.tiny_models import build_model

MAX_EXAMPLES = 60
ARCHS = ["tiny-gpt2", "tiny-opt", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
_models: dict = {}


def model_for(arch):
    if arch not in _models:
        _models[arch] = build_model(arch, seed=21)
    return _models[arch]


@st.composite
def cases(draw):
    arch = draw(st.sampled_from(ARCHS))
    batch = draw(st.integers(1, 4))
    width = draw(st.integers(1, 6))
    pads = [draw(st.integers(0, width - 1)) for _ in range(batch)]
    new = draw(st.integers(1, 4))
    sample = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return arch, batch, width, pads, new, sample, seed


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_graph_tokens_equal_eager(case):
    arch, batch, width, pads, new, sample, seed = case
    prev = get_accelerator()
    set_accelerator(CPUAccelerator())
    try:
        model = model_for(arch)
        graph, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
        eager, *_ = initialize(model=model, config={})
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(4, 384, (batch, width), generator=g)
        mask = torch.ones_like(ids)
        for b, p in enumerate(pads):
            ids[b, :p] = 0
            mask[b, :p] = 0
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=sample)
        torch.manual_seed(seed)
        expected = eager.generate(**kw)
        torch.manual_seed(seed)
        got = graph.generate(**kw)
        assert torch.equal(got, expected)
        s = graph.graph_stats
        # One warm-up and one capture for the bucket, up front, whatever the length: never one per position.
        assert s.captures == (1 if new > 1 else 0) and s.fallbacks == 0 and s.eager_steps == 0
    finally:
        set_accelerator(prev)
