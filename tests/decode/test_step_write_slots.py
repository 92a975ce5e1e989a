"""The decode step's write slot, read off the span's slots, is the slot ``token_slots`` computes from page and
offset (the null page's first slot where a row is not kept)."""

from __future__ import annotations

import torch

from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.kv_pool import KVPool
from hybrid_engine.decode.layout import layer_specs
from hybrid_engine.tiny_models import build_model


def test_span_write_slots_equal_token_slots():
    model = build_model("tiny-llama", seed=0)
    pool = KVPool(layer_specs(model.config), 64, 4, device=torch.device("cpu"), dtype=torch.float32)
    cache = PagedKVCache(model.config, 6, 32, pool=pool)
    g = torch.Generator().manual_seed(0)
    cache.block_table.copy_(torch.randperm(63, generator=g)[:48].view(6, 8) + 1)
    for span in (2, 5, 8):
        write_pos = torch.randint(0, span * 4, (6,), generator=g)
        keep = torch.rand(6, 1, generator=g) < 0.6
        read = cache.span_slots(span)
        for k in (None, keep):
            want = cache.token_slots(write_pos[:, None], keep=k).flatten()
            assert torch.equal(cache.span_write_slots(read, write_pos, k), want)
