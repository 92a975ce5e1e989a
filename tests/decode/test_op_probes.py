"""Every decode op's capability probe refuses to run for the first time inside a capture: it compares results on
the host, which fails while capturing, and that failure would be cached as "no kernel on this device"
(decode/ops/probe.py). The layer ops' own case, through the op, is in tests/decode/test_layer_ops.py."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.decode.ops import bookkeeping, layer_ops, paged_attention, sampler


@pytest.mark.leaves_pool_recording  # a raw capture that fails, with no runner to clean up (conftest releases it)
@pytest.mark.parametrize("module", [paged_attention, bookkeeping, sampler, layer_ops],
                         ids=["paged_attention", "bookkeeping", "sampler", "layer_ops"])
def test_a_probe_asked_for_first_inside_a_capture_is_refused_and_nothing_is_cached(module):
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    module._probe.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="before capturing"):
            with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(CPUGraph()):
                module.implementation(torch.device("cpu"))
        assert module._probe.cache_info().currsize == 0
        assert module.implementation(torch.device("cpu")) in ("reference", "triton")  # outside: probed as usual
    finally:
        module._probe.cache_clear()
