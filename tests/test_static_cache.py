"""StaticKVCache: layout, per-row writes, row ops, bounds checks, Cache API of transformers 4.57 and 5.x."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache

from hybrid_engine.decode.kv_cache import StaticKVCache, cache_geometry
from hybrid_engine.tiny_models import ARCHITECTURES, build_config


def make(arch: str = "llama", batch: int = 3, capacity: int = 8) -> StaticKVCache:
    return StaticKVCache(build_config(f"tiny-{arch}"), batch, capacity, dtype=torch.float32)


def states(cache: StaticKVCache, q_len: int, fill: float | None = None) -> torch.Tensor:
    shape = (cache.batch_size, cache.num_kv_heads, q_len, cache.head_dim)
    if fill is not None:
        return torch.full(shape, fill)
    return torch.randn(shape)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layout(arch):
    cache = make(arch)
    layers, kv_heads, head_dim = cache_geometry(build_config(f"tiny-{arch}"))
    expected_heads = 4 if arch in ("gpt2", "opt") else 2
    expected_dim = 32 if arch == "qwen3" else 16
    assert (layers, kv_heads, head_dim) == (2, expected_heads, expected_dim)
    assert isinstance(cache, Cache)
    assert len(cache) == 2 and len(cache.layers) == 2
    for layer in cache.layers:
        assert layer.keys.shape == (3, expected_heads, 8, expected_dim)
    assert cache.write_pos.dtype == torch.int64 and cache.write_pos.shape == (3,)
    assert cache.position.shape == (3,)
    assert cache.valid.dtype == torch.bool and cache.valid.shape == (3, 8)
    kv_bytes = 2 * 2 * 3 * expected_heads * 8 * expected_dim * 4
    assert cache.memory_bytes() == kv_bytes + 3 * 8 * 2 + 3 * 8
    assert (cache.batch_size, cache.capacity, cache.dtype, cache.device.type) == (3, 8, torch.float32, "cpu")


def test_constructor_validation():
    cfg = build_config("tiny-gpt2")
    with pytest.raises(ValueError, match="batch_size"):
        StaticKVCache(cfg, 0, 8)
    with pytest.raises(ValueError, match="capacity"):
        StaticKVCache(cfg, 1, 0)
    assert StaticKVCache(cfg, 1, 4, dtype=torch.bfloat16).layers[0].keys.dtype == torch.bfloat16


def test_transformers_cache_api():
    cache = make(capacity=8)
    assert cache.is_compileable is True
    assert cache.is_sliding == [False, False]
    assert cache.get_max_cache_shape() == 8 and cache.max_cache_len == 8 and cache.max_batch_size == 3
    assert cache.get_max_length() == 8
    assert cache.get_mask_sizes(1, 0) == (8, 0)  # 5.x form (query_length, layer_idx)
    assert cache.get_mask_sizes(torch.arange(1), 0) == (8, 0)  # 4.57 form (cache_position, layer_idx)
    cache.kv_len = 5
    assert cache.get_mask_sizes(1, 1) == (5, 0)
    cache.kv_len = None
    assert cache.get_seq_length() == 0 and cache.get_query_offset(0) == 0
    cache.write_pos.copy_(torch.tensor([2, 5, 1]))
    assert cache.get_seq_length() == 5 and isinstance(cache.get_seq_length(), int)
    assert cache.get_query_offset(0) == 5
    assert cache.layers[0].get_seq_length() == 5


def test_update_writes_each_row_at_its_own_position():
    cache = make(batch=3, capacity=8)
    cache.write_pos.copy_(torch.tensor([0, 3, 6]))
    k, v = states(cache, 2), states(cache, 2)
    keys, values = cache.update(k, v, 1)
    assert keys.data_ptr() == cache.layers[1].keys.data_ptr()  # full buffer, same address
    for b, start in enumerate([0, 3, 6]):
        assert torch.equal(keys[b, :, start : start + 2], k[b])
        assert torch.equal(values[b, :, start : start + 2], v[b])
    assert cache.write_pos.tolist() == [0, 3, 6]  # update does not advance
    assert cache.layers[0].keys.abs().sum() == 0  # other layer untouched
    cache.kv_len = 8
    keys, _ = cache.update(k, v, 0)
    assert keys.shape[2] == 8 and keys.data_ptr() == cache.layers[0].keys.data_ptr()


def test_update_kv_len_returns_prefix_views():
    cache = make(batch=2, capacity=8)
    cache.kv_len = 3
    keys, values = cache.update(states(cache, 1), states(cache, 1), 0)
    assert keys.shape[2] == 3 and values.shape[2] == 3
    assert keys.data_ptr() == cache.layers[0].keys.data_ptr()


def test_bounds_check_outside_capture():
    cache = make(batch=2, capacity=8)
    cache.write_pos.copy_(torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="capacity=8"):
        cache.update(states(cache, 2), states(cache, 2), 0)
    cache.write_pos.zero_()
    cache.kv_len = 2
    with pytest.raises(ValueError, match="kv_len=2"):
        cache.update(states(cache, 3), states(cache, 3), 0)
    cache.kv_len = None
    with pytest.raises(ValueError, match="dtype"):
        cache.update(states(cache, 1).double(), states(cache, 1).double(), 0)
    with pytest.raises(ValueError, match="layout"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)


def test_no_checks_and_no_host_reads_during_capture(cpu_graphs):
    """The host-side check path must not run while capturing (it would raise GraphCaptureError)."""
    cache = make(batch=2, capacity=8)
    cache.write_pos.copy_(torch.tensor([1, 4]))
    k = states(cache, 1, fill=2.0)
    row0, row1 = torch.tensor([0]), torch.tensor([1])  # index tensors live on the device before capture
    graph = cpu_graphs.create_graph()
    with cpu_graphs.capture_to_graph(graph):
        cache.update(k, k, 0)
        seq = cache.get_seq_length()
        offset = cache.get_query_offset(0)
        assert isinstance(seq, torch.Tensor) and isinstance(offset, torch.Tensor)
        cache.reset_rows(row1)
        cache.copy_rows(row0, row1)
    assert cache.layers[0].keys.abs().sum() == 0  # capture did not apply its work
    cpu_graphs.replay_graph(graph)
    assert torch.equal(cache.layers[0].keys[0, :, 1], k[0, :, 0])
    assert torch.equal(cache.layers[0].keys[1], cache.layers[0].keys[0])  # row 1 became a copy of row 0
    assert cache.write_pos.tolist() == [1, 1]


def test_reset_rows_and_copy_rows():
    cache = make(batch=3, capacity=4)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    cache.valid.fill_(True)
    cache.write_pos.copy_(torch.tensor([1, 2, 3]))
    cache.position.copy_(torch.tensor([4, 5, 6]))
    ptrs = [layer.keys.data_ptr() for layer in cache.layers]
    row2 = cache.layers[0].keys[2].clone()

    cache.copy_rows(torch.tensor([2, 0]), torch.tensor([0, 2]))  # swap rows 0 and 2 (overlapping sets)
    assert torch.equal(cache.layers[0].keys[0], row2)
    assert cache.write_pos.tolist() == [3, 2, 1] and cache.position.tolist() == [6, 5, 4]

    cache.reset_rows(torch.tensor([1]))
    assert cache.layers[1].keys[1].abs().sum() == 0 and cache.layers[1].values[1].abs().sum() == 0
    assert not cache.valid[1].any() and cache.valid[0].all()
    assert cache.write_pos.tolist() == [3, 0, 1] and cache.position.tolist() == [6, 0, 4]
    with pytest.raises(ValueError, match="rows"):
        cache.reset_rows(torch.tensor([3]))
    with pytest.raises(ValueError, match="src_rows"):
        cache.copy_rows(torch.tensor([0, 1]), torch.tensor([2]))

    cache.reset()
    assert [layer.keys.data_ptr() for layer in cache.layers] == ptrs
    assert cache.write_pos.sum() == 0 and not cache.valid.any()


def test_load_rows_from_smaller_cache():
    big = make(batch=4, capacity=8)
    for layer in big.layers:
        layer.keys.fill_(9.0)
    big.valid.fill_(True)
    small = make(batch=2, capacity=3)
    for layer in small.layers:
        layer.keys.fill_(1.0)
        layer.values.fill_(2.0)
    small.valid[:, :3] = torch.tensor([[False, True, True], [True, True, True]])
    small.write_pos.fill_(3)
    small.position.copy_(torch.tensor([2, 3]))
    big.load_rows(torch.tensor([3, 1]), small)
    keys = big.layers[0].keys
    # Slots past the loaded prompt keep stale K/V but are invalid, so nothing attends to them.
    assert (keys[3, :, :3] == 1).all() and (keys[3, :, 3:] == 9).all() and (keys[0] == 9).all()
    assert big.valid[3].tolist() == [False, True, True] + [False] * 5
    assert big.write_pos.tolist() == [0, 3, 0, 3] and big.position.tolist() == [0, 3, 0, 2]
    with pytest.raises(ValueError, match="capacity"):
        small.load_rows(torch.tensor([0, 1]), big.__class__(build_config("tiny-llama"), 2, 9))


def test_reorder_cache_keeps_addresses():
    cache = make(batch=2, capacity=4)
    cache.layers[0].keys[0].fill_(1.0)
    ptr = cache.layers[0].keys.data_ptr()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.layers[0].keys.data_ptr() == ptr
    assert (cache.layers[0].keys[1] == 1).all() and (cache.layers[0].keys[0] == 0).all()


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_every_layer_lives_in_one_buffer_so_row_ops_cost_the_same_at_any_depth():
    """Moving and emptying rows is one op over every layer. Loading rows from another cache (admission) copies
    one layer at a time, so that its gathered temporary is one layer's (see the next test): the same few ops
    per layer."""

    def row_ops(layers: int) -> tuple[list[str], list[str]]:
        cfg = build_config("tiny-llama")
        cfg.num_hidden_layers = layers
        cache = StaticKVCache(cfg, 4, 8, dtype=torch.float32)
        assert cache.kv.shape == (layers, 2, 4, cfg.num_key_value_heads, 8, 16)
        for i, layer in enumerate(cache.layers):  # contiguous views of the one buffer, as attention wants them
            assert layer.keys.is_contiguous() and layer.keys.data_ptr() == cache.kv[i, 0].data_ptr()
            assert layer.values.data_ptr() == cache.kv[i, 1].data_ptr()
        stage = StaticKVCache(cfg, 2, 4, dtype=torch.float32)
        stage.kv.normal_()
        src, dst = torch.tensor([0, 3]), torch.tensor([1, 2])
        with _CountOps() as count:
            cache.copy_rows(src, dst, checked=True)
            cache.reset_rows(src)
        with _CountOps() as load:
            cache.load_rows(dst, stage, sources=torch.tensor([1, 1]), checked=True)
        assert torch.equal(cache.layers[-1].values[2, :, :4], stage.layers[-1].values[1])  # fanned out, last layer
        return count.ops, load.ops

    (moves2, load2), (moves6, load6) = row_ops(2), row_ops(6)
    assert moves2 == moves6
    per_layer = (len(load6) - len(load2)) // 4
    assert 0 < per_layer <= 5 and len(load6) - len(load2) == 4 * per_layer


def _graph_workspace(run) -> int:
    """Peak bytes of the intermediates ``run`` leaves in a graph pool when captured (the CPU emulation's count)."""
    from hybrid_engine.accelerator import CPUAccelerator

    acc = CPUAccelerator(emulate_graphs=True)
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        run()
    acc.replay_graph(graph)
    return graph.workspace_bytes


@pytest.mark.parametrize("fan_out", [True, False])
def test_load_rows_gathers_one_layer_at_a_time_so_a_captured_admission_keeps_one_layers_rows(fan_out):
    """A captured admission round keeps load_rows' gathered K/V in its graph pool for good: with all layers at
    once that was rows x width x every layer's K/V (64 MB at 256 slots of 256 tokens on an 8-layer tiny model,
    ~15 GB for a 7B model); now it is one layer's, and the rows loaded are the same."""
    cfg = build_config("tiny-llama")
    cfg.num_hidden_layers = 8
    rows, width = 16, 32
    cache = StaticKVCache(cfg, rows, 48, dtype=torch.float32)
    cache.valid.fill_(True)
    stage = StaticKVCache(cfg, 4, width, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    stage.kv.copy_(torch.randn(stage.kv.shape, generator=gen))
    stage.valid.copy_(torch.rand(stage.valid.shape, generator=gen) < 0.7)
    stage.write_pos.fill_(width)
    stage.position.copy_(stage.valid.sum(-1))
    dst = torch.randperm(rows, generator=gen)
    src = torch.randint(0, 4, (rows,), generator=gen) if fan_out else None
    if not fan_out:
        dst = dst[:4]
    expected = cache.kv.clone()
    picked = stage.kv if src is None else stage.kv[:, :, src]
    expected[:, :, dst, :, :width] = picked
    workspace = _graph_workspace(lambda: cache.load_rows(dst, stage, sources=src, checked=True))
    assert torch.equal(cache.kv, expected)
    loaded = len(dst) if fan_out else 0  # narrowed sources are views: nothing gathered
    one_layer = 2 * loaded * cache.num_kv_heads * width * cache.head_dim * 4
    assert workspace <= one_layer + 4096, (workspace, one_layer)
    assert cache.valid[dst, :width].tolist() == (stage.valid if src is None else stage.valid[src]).tolist()
    assert not cache.valid[dst, width:].any()
