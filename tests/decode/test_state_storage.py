"""The state stores of rings and linear states over releasable storage (issue 41), unit by unit: the same
mechanism as the page pool's (``kv_storage.ReleasableTensors``), so a store sleeps at fixed addresses, wakes
NaN-filled from the backend and zeroed by its owner, and reports the bytes it holds."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.decode import kv_storage
from hybrid_engine.decode.kv_pool import KVPool, LayerSpec
from hybrid_engine.decode.linear_states import StateStore

SHAPES = {("recurrent", 0, 0): ((4, 64, 64), torch.float32), ("conv", 0, 0): ((96, 4), torch.float32),
          ("ring", 1, 0): ((8, 2, 16), torch.bfloat16)}


def test_a_store_sleeps_at_fixed_addresses_and_wakes_zeroed():
    store = StateStore(3, torch.device("cpu"), SHAPES)
    assert store.releasable and not store.asleep
    held = store.nbytes()
    assert held == 4 * (4 * 64 * 64 * 4 + 96 * 4 * 4 + 8 * 2 * 16 * 2)  # 3 rows and the spare one
    for t in store.tensors.values():
        t.fill_(3)
    pointers = {k: t.data_ptr() for k, t in store.tensors.items()}
    store.sleep()
    assert store.asleep and store.nbytes() == 0
    assert store.wake() is False  # nothing moved
    assert {k: t.data_ptr() for k, t in store.tensors.items()} == pointers
    assert all(not t.any() for t in store.tensors.values()) and store.nbytes() == held


def test_the_backend_hands_the_memory_back_nan_filled_for_the_owner_to_zero(monkeypatch):
    store = StateStore(2, torch.device("cpu"), SHAPES)
    monkeypatch.setattr(StateStore, "zero_states", lambda self: None)
    store.sleep()
    store.wake()
    assert all(t.isnan().all() for t in store.tensors.values())


def test_stores_without_releasable_storage_refuse_to_sleep(monkeypatch):
    lazy = StateStore(2, torch.device("cpu"), {}, lazy=True)  # a probe's: made as written, plain tensors
    with pytest.raises(RuntimeError, match="StateStore.sleep: no releasable storage"):
        lazy.sleep()
    # Stand-in for a device without releasable storage (NPU, XPU, CUDA without cuda-bindings).
    monkeypatch.setattr(kv_storage, "make_arena", lambda nbytes, device: None)
    plain = StateStore(2, torch.device("cpu"), SHAPES)
    pool = KVPool([LayerSpec(2, 8, 8)], 4, 4, device=torch.device("cpu"), dtype=torch.float32)
    assert not plain.releasable and not pool.releasable
    with pytest.raises(RuntimeError, match="StateStore.sleep: no releasable storage on cpu"):
        plain.sleep()
    with pytest.raises(RuntimeError, match="KVPool.sleep: no releasable storage on cpu"):
        pool.sleep()
    assert plain.nbytes() > 0 and not plain.asleep


def test_the_pool_reports_the_bytes_it_holds():
    pool = KVPool([LayerSpec(2, 8, 8)], 4, 4, device=torch.device("cpu"), dtype=torch.float32)
    assert pool.memory_bytes() == 4 * pool.page_bytes > 0
    pool.sleep()
    assert pool.memory_bytes() == 0
    pool.wake()
    assert pool.memory_bytes() == 4 * pool.page_bytes
