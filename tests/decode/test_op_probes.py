"""Every decode op's capability probe refuses to run for the first time inside a capture: it compares results on
the host, which fails while capturing, and that failure would be cached as "no kernel on this device"
(decode/ops/probe.py). The layer ops' own case, through the op, is in tests/decode/test_layer_ops.py. And a probe
that refuses a kernel on a device the kernel is built for warns once, with the kernel's own error."""

from __future__ import annotations

import warnings

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


def test_a_refused_kernel_warns_once_per_module_and_device_only_where_it_is_built_for():
    from hybrid_engine.decode.ops import probe

    probe._WARNED.clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"ops\.sampler: the triton kernel failed its probe on cuda:0 \(boom\)"
                                                r".*bench kernels --check --device cuda"):
            probe.warn_fallback("sampler", torch.device("cuda", 0), "triton", "boom")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            probe.warn_fallback("sampler", torch.device("cuda", 0), "triton", "again")  # once per module and device
            probe.warn_fallback("sampler", torch.device("cpu"), "triton", "expected")  # a CPU without the interpreter
            probe.warn_fallback("sampler", torch.device("mps", 0), "triton", "expected")  # Triton is not built for MPS
    finally:
        probe._WARNED.clear()


@pytest.mark.parametrize("module", [paged_attention, bookkeeping, sampler, layer_ops],
                         ids=["paged_attention", "bookkeeping", "sampler", "layer_ops"])
def test_each_probe_warns_with_the_kernels_error_when_it_falls_back(module, monkeypatch):
    """Every probe reports why it refused its Triton kernel. The CPU stands in for a GPU here (the table of the
    devices Triton is built for is widened to it): without the interpreter the kernel cannot launch on it."""
    pytest.importorskip("triton")
    from hybrid_engine.decode.ops import probe

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(probe.KERNEL_DEVICES, "triton", frozenset({"cpu"}))
    probe._WARNED.clear()
    module._probe.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=rf"ops\.{module.__name__.rsplit('.', 1)[-1]}: the triton kernel "
                                                r"failed its probe on cpu \(RuntimeError: .*active drivers"):
            assert module.implementation(torch.device("cpu")) == "reference"
    finally:
        module._probe.cache_clear()
        probe._WARNED.clear()
