"""Host-built index tensors reach the device without a hidden host sync (issue 29, part 3).

No accelerator here: pinned host memory is stubbed at the hardware boundary (``Tensor.pin_memory``), and the
"device" is ``meta``, which takes a copy of any tensor without holding its values.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybrid_engine.accelerator.host_copy import device_tensor


def test_on_the_cpu_nothing_is_copied_or_counted():
    counters = SimpleNamespace(host_syncs=0)
    t = device_tensor([[1, 2], [3, 4]], torch.device("cpu"), counters=counters)
    assert t.dtype == torch.int64 and t.device.type == "cpu" and t.tolist() == [[1, 2], [3, 4]]
    assert counters.host_syncs == 0


def test_without_pinned_memory_the_copy_is_pageable_and_counted_as_a_host_sync(monkeypatch):
    def no_pinning(self, *args, **kwargs):  # as torch without an accelerator answers
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    counters = SimpleNamespace(host_syncs=0)
    t = device_tensor([1, 2, 3], torch.device("meta"), counters=counters)
    assert t.device.type == "meta" and t.shape == (3,) and t.dtype == torch.int64
    assert counters.host_syncs == 1
    device_tensor([4], torch.device("meta"))  # without counters: still a tensor, nothing to count in


def test_with_pinned_memory_the_copy_is_queued_non_blocking_from_the_pinned_tensor(monkeypatch):
    """STUB at the hardware boundary: a pinned allocator that records what it pinned, and a copy that records
    how it was asked for; on a GPU the real ones run (bench/gpu_check.sh)."""
    pinned: list[torch.Tensor] = []
    copies: list[tuple[bool, bool]] = []
    real_to = torch.Tensor.to

    def pin(self):
        pinned.append(self)
        return self

    def to(self, *args, **kwargs):
        copies.append((any(self is p for p in pinned), kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    counters = SimpleNamespace(host_syncs=0)
    t = device_tensor([7, 8], torch.device("meta"), counters=counters)
    assert t.device.type == "meta" and len(pinned) == 1 and pinned[0].tolist() == [7, 8]
    assert copies == [(True, True)]  # the pinned tensor itself, non-blocking
    assert counters.host_syncs == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_dtype_asked_for_is_kept(dtype):
    assert device_tensor([1], torch.device("cpu"), dtype=dtype).dtype == dtype
