"""The paged K/V pool, its host ledger, and PagedKVCache: layout, writes and gathers by block table, row ops,
bounds checks, the Cache API of transformers 4.57 and 5.x, and what capture keeps."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from transformers.cache_utils import Cache

from hybrid_engine.decode.kv_cache import ForwardIndices, PagedKVCache
from hybrid_engine.decode.kv_pool import (
    NULL_PAGE,
    KVBudget,
    KVPool,
    LayerSpec,
    PageLedger,
    pages_for,
    pool_pages,
)
from hybrid_engine.decode.layout import cache_geometry
from hybrid_engine.tiny_models import ARCHITECTURES, build_config


def make(arch: str = "llama", batch: int = 3, capacity: int = 8, page_size: int = 4) -> PagedKVCache:
    return PagedKVCache(build_config(f"tiny-{arch}"), batch, capacity, page_size=page_size, dtype=torch.float32)


def states(cache: PagedKVCache, q_len: int) -> torch.Tensor:
    return torch.randn(cache.batch_size, cache.num_kv_heads, q_len, cache.head_dim)


def decode_indices(cache: PagedKVCache, live: torch.Tensor | None = None, span: int | None = None) -> None:
    """What decode_one_token sets before a forward: each row writes at its length, reads its span."""
    keep = None if live is None else live[:, None]
    cache.set_forward(ForwardIndices(write_slots=cache.token_slots(cache.write_pos[:, None], keep=keep).flatten(),
                                     kv_len=cache.span_tokens(span), read_slots=cache.span_slots(span)))


# ---------------------------------------------------------------------- pool and ledger


def test_ledger_hands_out_pages_once_shares_by_reference_and_never_the_null_page():
    ledger = PageLedger(6)
    assert ledger.capacity == ledger.free == 5 and ledger.in_use == 0
    a = ledger.allocate(3)
    assert a == [1, 2, 3] and NULL_PAGE not in a and ledger.peak == 3
    assert ledger.allocate(3) is None and ledger.free == 2  # all or nothing
    ledger.retain(a[:2])  # a second holder of the first two pages (samples sharing a prompt)
    ledger.release(a)
    assert ledger.free == 3 and ledger.refs(1) == 1 and ledger.refs(3) == 0
    ledger.release(a[:2])
    assert ledger.free == 5 and ledger.in_use == 0 and ledger.peak == 3
    with pytest.raises(RuntimeError, match="released more often"):
        ledger.release([1])
    with pytest.raises(RuntimeError, match="not held"):
        ledger.retain([2])
    ledger.reset_peak()
    assert ledger.peak == 0 and sorted(ledger.allocate(5)) == [1, 2, 3, 4, 5]


def test_pool_layers_may_differ_in_heads_and_kv_widths_and_copy_pages_is_per_layer():
    """MLA caches keys and values of different widths; a layer kind of its own may have other heads."""
    pool = KVPool([LayerSpec(2, 8, 4), LayerSpec(1, 16, 16)], 5, 4, device=torch.device("cpu"),
                  dtype=torch.float32)
    assert [k.shape for k in pool.keys] == [(20, 2, 8), (20, 1, 16)]
    assert [v.shape for v in pool.values] == [(20, 2, 4), (20, 1, 16)]
    assert pool.page_bytes == (2 * (8 + 4) + 16 + 16) * 4 * 4 and pool.memory_bytes() == 5 * pool.page_bytes
    for t in (*pool.keys, *pool.values):
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in (*pool.keys, *pool.values)]
    pool.copy_pages(torch.tensor([1, 3]), torch.tensor([2, 3]))  # 1 -> 2, and 3 onto itself (a no-op)
    for old, new in zip(before, (*pool.keys, *pool.values)):
        assert torch.equal(new[8:12], old[4:8]) and torch.equal(new[12:16], old[12:16])
        assert torch.equal(new[:8], old[:8]) and torch.equal(new[16:], old[16:])


def test_a_budget_too_small_for_one_request_is_refused_naming_the_knob_and_the_size_needed():
    budget = KVBudget(16, 40, None, "RolloutConfig.kv_cache", longest_prompt=30, max_new=20)
    with pytest.raises(ValueError, match=r"RolloutConfig\.kv_cache_tokens=40 holds 2 pages of 16 tokens .* needs up "
                                         r"to 6 pages: raise RolloutConfig\.kv_cache_tokens to at least 96"):
        pool_pages(budget, page_bytes=1024, slots=4, stage_rows=2, capacity=64, stage_width=32)
    assert pool_pages(budget._replace(tokens=96), page_bytes=1024, slots=4, stage_rows=2, capacity=64,
                      stage_width=32) == (6, True)
    by_bytes = budget._replace(tokens=None, nbytes=10 * 1024)
    assert pool_pages(by_bytes, page_bytes=1024, slots=4, stage_rows=2, capacity=64, stage_width=32) == (10, True)
    # Unset: the contiguous rows' footprint in whole pages (4 slots of 64 tokens, a stage of 2 x 32).
    default = budget._replace(tokens=None)
    assert pool_pages(default, page_bytes=1024, slots=4, stage_rows=2, capacity=64, stage_width=32) == (20, False)
    assert pages_for(17, 16) == 2 and pages_for(16, 16) == 1


# ------------------------------------------------------------------------------- cache


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layout(arch):
    cache = make(arch, batch=3, capacity=8, page_size=4)
    layers, kv_heads, head_dim = cache_geometry(build_config(f"tiny-{arch}"))
    expected_heads = 4 if arch in ("gpt2", "opt") else 2
    expected_dim = 32 if arch == "qwen3" else 16
    assert (layers, kv_heads, head_dim) == (2, expected_heads, expected_dim)
    assert isinstance(cache, Cache) and len(cache.layers) == 2
    # A self-contained cache: row b holds pages 1 + 2b and 2 + 2b of its own pool for good; page 0 is null.
    assert cache.block_table.tolist() == [[1, 2], [3, 4], [5, 6]]
    for layer in cache.layers:
        assert layer.keys.shape == (7 * 4, expected_heads, expected_dim)  # token-major pool storage
    assert cache.write_pos.shape == cache.position.shape == (3,) and cache.write_pos.dtype == torch.int64
    kv_bytes = 2 * 2 * 7 * 4 * expected_heads * expected_dim * 4
    assert cache.memory_bytes() == kv_bytes + 3 * 2 * 8 + 3 * 8 * 2
    assert (cache.batch_size, cache.capacity, cache.max_pages, cache.page_size) == (3, 8, 2, 4)


def test_constructor_validation():
    cfg = build_config("tiny-gpt2")
    with pytest.raises(ValueError, match="batch_size"):
        PagedKVCache(cfg, 0, 8)
    with pytest.raises(ValueError, match="capacity"):
        PagedKVCache(cfg, 1, 0)
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(cfg, 1, 8, page_size=0)
    assert PagedKVCache(cfg, 1, 4, dtype=torch.bfloat16).layers[0].keys.dtype == torch.bfloat16
    pool = KVPool([LayerSpec(4, 16, 16)], 4, 4, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="the pool has 1 layers, the config 2"):
        PagedKVCache(cfg, 1, 8, pool=pool)


def test_transformers_cache_api():
    cache = make(capacity=8)
    assert cache.is_compileable is True and cache.is_sliding == [False, False]
    assert cache.get_max_cache_shape() == 8 and cache.max_cache_len == 8 and cache.max_batch_size == 3
    assert cache.get_mask_sizes(1, 0) == (8, 0)  # 5.x form (query_length, layer_idx): the whole table
    assert cache.get_mask_sizes(torch.arange(1), 0) == (8, 0)  # 4.57 form (cache_position, layer_idx)
    decode_indices(cache, span=1)
    assert cache.get_mask_sizes(1, 1) == (4, 0)  # what the current forward returns: its span
    cache.set_forward(None)
    assert cache.get_seq_length() == 0 and cache.get_query_offset(0) == 0
    cache.write_pos.copy_(torch.tensor([2, 5, 1]))
    assert cache.get_seq_length() == 5 and isinstance(cache.get_seq_length(), int)
    assert cache.layers[0].get_seq_length() == 5


def test_update_writes_each_row_through_its_table_and_gathers_its_span_in_logical_order():
    cache = make(batch=3, capacity=8, page_size=4)
    cache.block_table.copy_(torch.tensor([[6, 1], [2, 5], [3, 4]]))  # pages in any order
    cache.write_pos.copy_(torch.tensor([0, 3, 6]))
    k, v = states(cache, 1), states(cache, 1)
    decode_indices(cache)
    keys, values = cache.update(k, v, 1)
    assert keys.shape == (3, cache.num_kv_heads, 8, cache.head_dim)
    for b, pos in enumerate([0, 3, 6]):
        assert torch.equal(keys[b, :, pos], k[b, :, 0]) and torch.equal(values[b, :, pos], v[b, :, 0])
    pool = cache.pool
    assert torch.equal(pool.keys[1][6 * 4 + 0], k[0, :, 0])  # row 0, logical 0: page 6, offset 0
    assert torch.equal(pool.keys[1][4 * 4 + 2], k[2, :, 0])  # row 2, logical 6: page 4, offset 2
    assert pool.keys[0].abs().sum() == 0  # other layer untouched
    assert cache.write_pos.tolist() == [0, 3, 6]  # update does not advance
    decode_indices(cache, span=1)
    keys, _ = cache.update(k, v, 0)
    assert keys.shape[2] == 4  # the span: one page a row


def test_rows_that_are_not_live_write_the_null_page():
    cache = make(batch=2, capacity=8, page_size=4)
    cache.write_pos.copy_(torch.tensor([1, 2]))
    decode_indices(cache, live=torch.tensor([True, False]))
    k = states(cache, 1)
    cache.update(k, k, 0)
    keys = cache.pool.keys[0]
    assert torch.equal(keys[NULL_PAGE * 4], k[1, :, 0])  # row 1 wrote the null page's first slot
    assert keys[cache.block_table[1].tolist()[0] * 4 + 2].abs().sum() == 0  # not its own page


def test_fresh_prefill_returns_its_own_states_and_writes_real_tokens_only():
    cache = make(batch=2, capacity=8, page_size=4)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    logical = ((mask.cumsum(-1) - 1) * mask).clamp(min=0)
    cache.set_forward(ForwardIndices(write_slots=cache.token_slots(logical, keep=mask.bool()).flatten(), kv_len=5,
                                     fresh=True))
    k = torch.randn(2, cache.num_kv_heads, 5, cache.head_dim)
    keys, _ = cache.update(k, k, 0)
    assert keys is k
    pool = cache.pool.keys[0]
    assert torch.equal(pool[1 * 4 + 0], k[0, :, 2]) and torch.equal(pool[1 * 4 + 2], k[0, :, 4])  # row 0: 3 reals
    assert torch.equal(pool[4 * 4 + 0], k[1, :, 4])  # row 1, logical 4: its second page


def test_bounds_and_layout_checks_outside_capture():
    cache = make(batch=2, capacity=8)
    cache.write_pos.copy_(torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="capacity=8; the cache is full"):
        cache.check_room(1)
    cache.write_pos.copy_(torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="span=4"):
        cache.check_room(1, span=1)
    decode_indices(cache)
    with pytest.raises(ValueError, match="dtype"):
        cache.update(states(cache, 1).double(), states(cache, 1).double(), 0)
    with pytest.raises(ValueError, match="layout"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
    cache.set_forward(None)
    with pytest.raises(ValueError, match="no write slots"):
        cache.update(states(cache, 1), states(cache, 1), 0)


def test_no_checks_and_no_host_reads_during_capture(cpu_graphs):
    """The host-side check path must not run while capturing (it would raise GraphCaptureError)."""
    cache = make(batch=2, capacity=8)
    cache.write_pos.copy_(torch.tensor([1, 4]))
    k = torch.full((2, cache.num_kv_heads, 1, cache.head_dim), 2.0)
    row0, row1 = torch.tensor([0]), torch.tensor([1])  # index tensors live on the device before capture
    graph = cpu_graphs.create_graph()
    with cpu_graphs.capture_to_graph(graph):
        cache.check_room(1)
        decode_indices(cache)
        cache.update(k, k, 0)
        seq = cache.get_seq_length()
        offset = cache.get_query_offset(0)
        assert isinstance(seq, torch.Tensor) and isinstance(offset, torch.Tensor)
        cache.copy_rows(row0, row1)
    assert cache.pool.keys[0].abs().sum() == 0  # capture did not apply its work
    cpu_graphs.replay_graph(graph)
    assert torch.equal(cache.pool.keys[0][1 * 4 + 1], k[0, :, 0])
    assert cache.block_table[1].tolist() == cache.block_table[0].tolist()  # row 1 now reads row 0's pages
    assert cache.write_pos.tolist() == [1, 1]


def test_row_ops_move_table_entries_not_kv_and_keep_addresses():
    cache = make(batch=3, capacity=8, page_size=4)
    pool = KVPool(cache.pool.layers, 8, 4, device=torch.device("cpu"), dtype=torch.float32)
    shared = PagedKVCache(build_config("tiny-llama"), 3, 8, pool=pool)
    assert shared.block_table.tolist() == [[NULL_PAGE] * 2] * 3  # a shared pool's rows start with no pages
    shared.block_table.copy_(torch.tensor([[1, 2], [3, 0], [4, 5]]))
    shared.write_pos.copy_(torch.tensor([5, 2, 7]))
    shared.position.copy_(torch.tensor([6, 3, 8]))
    ptrs = [t.data_ptr() for t in (*pool.keys, *pool.values)]
    before = [t.clone() for t in (*pool.keys, *pool.values)]
    shared.copy_rows(torch.tensor([2, 0]), torch.tensor([0, 2]))  # swap rows 0 and 2 (overlapping sets)
    assert shared.block_table.tolist() == [[4, 5], [3, 0], [1, 2]]
    assert shared.write_pos.tolist() == [7, 2, 5] and shared.position.tolist() == [8, 3, 6]
    shared.reset_rows(torch.tensor([1]))
    assert shared.block_table[1].tolist() == [NULL_PAGE, NULL_PAGE] and shared.write_pos.tolist() == [7, 0, 5]
    assert all(torch.equal(a, b) for a, b in zip(before, (*pool.keys, *pool.values)))  # no K/V moved
    assert [t.data_ptr() for t in (*pool.keys, *pool.values)] == ptrs
    with pytest.raises(ValueError, match="rows"):
        shared.reset_rows(torch.tensor([3]))
    with pytest.raises(ValueError, match="src_rows"):
        shared.copy_rows(torch.tensor([0, 1]), torch.tensor([2]))
    shared.reset()
    assert shared.write_pos.sum() == 0 and (shared.block_table == NULL_PAGE).all()
    view = shared.rows_view(1, 3)
    assert view.block_table.data_ptr() == shared.block_table[1].data_ptr() and view.pool is pool
    with pytest.raises(ValueError, match="rows_view"):
        shared.rows_view(2, 5)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_moving_and_emptying_rows_cost_the_same_at_any_depth_and_a_page_copy_a_few_ops_per_layer():
    """Compaction moves table rows, whatever the depth; a sample's own last page is copied layer by layer (a
    gather and a copy of its keys, the same of its values)."""

    def row_ops(layers: int) -> tuple[list[str], list[str]]:
        cfg = build_config("tiny-llama")
        cfg.num_hidden_layers = layers
        cache = PagedKVCache(cfg, 4, 8, page_size=4, dtype=torch.float32)
        src, dst = torch.tensor([0, 3]), torch.tensor([1, 2])
        with _CountOps() as moves:
            cache.copy_rows(src, dst, checked=True)
            cache.reset_rows(src, checked=True)
        with _CountOps() as copies:
            cache.pool.copy_pages(torch.tensor([1, 2]), torch.tensor([5, 6]))
        return moves.ops, copies.ops

    (moves2, copy2), (moves6, copy6) = row_ops(2), row_ops(6)
    assert moves2 == moves6
    per_layer = (len(copy6) - len(copy2)) // 4
    assert 0 < per_layer <= 4 and len(copy6) - len(copy2) == 4 * per_layer


def test_a_captured_page_copy_keeps_one_layers_pages_in_the_graph_pool():
    """A captured admission round copies each sample's partly filled last page; the gathered page is a
    temporary that stays in the graph pool for good, so it must be one layer's, not every layer's."""
    from hybrid_engine.accelerator import CPUAccelerator

    pool = KVPool([LayerSpec(2, 16, 16)] * 8, 40, 16, device=torch.device("cpu"), dtype=torch.float32)
    for t in (*pool.keys, *pool.values):
        t.copy_(torch.randn(t.shape))
    src, dst = torch.arange(1, 17), torch.arange(17, 33)
    expected = [t.clone() for t in pool.keys]
    for t in expected:
        t[17 * 16: 33 * 16] = t[16: 17 * 16]
    acc = CPUAccelerator(emulate_graphs=True)
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        pool.copy_pages(src, dst)
    acc.replay_graph(graph)
    assert all(torch.equal(a, b) for a, b in zip(pool.keys, expected))
    one_layer_pages = 16 * 16 * 2 * 16 * 4  # 16 pages of 16 tokens, 2 heads x 16, float32
    assert graph.workspace_bytes <= one_layer_pages + 4096, graph.workspace_bytes
