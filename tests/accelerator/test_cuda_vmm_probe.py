"""Issue 41: the CUDA VMM page storage is used only where its probe passes; everywhere else the pool keeps plain
storage and says why. (The VMM path itself has not run on a GPU: there is none here.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hybrid_engine.accelerator import cuda_vmm
from hybrid_engine.decode import kv_storage


def test_off_a_cuda_device_or_switched_off_there_is_no_vmm(monkeypatch):
    assert "not a CUDA device" in cuda_vmm.vmm_unavailable(torch.device("cpu"))
    monkeypatch.setenv("HYBRID_ENGINE_CUDA_VMM", "0")
    assert cuda_vmm.vmm_unavailable(torch.device("cuda", 0)) == "HYBRID_ENGINE_CUDA_VMM=0"
    assert not kv_storage.supports_release(torch.device("cuda", 0))
    assert kv_storage.make_arena(1024, torch.device("cuda", 0)) is None  # plain storage: drop and recapture


@pytest.mark.skipif(importlib.util.find_spec("cuda") is not None, reason="cuda-bindings is installed here")
def test_without_cuda_bindings_the_probe_names_the_extra(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # stand-in: a CUDA machine without the extra
    monkeypatch.setattr(cuda_vmm, "_PROBED", {})
    reason = cuda_vmm.vmm_unavailable(torch.device("cuda", 0))
    assert "cuda-bindings is not installed" in reason and "hybrid-engine[cuda-vmm]" in reason
    assert not kv_storage.supports_release(torch.device("cuda", 0))
