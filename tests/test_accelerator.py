"""Accelerator selection and graph-API discovery.

Tests marked ``stub`` check wiring only: small stub modules stand in for
``torch.cuda`` / ``torch_npu`` / ``torch.xpu`` / ``torch.accelerator.Graph``,
because this machine has no such hardware. They check which class is
constructed, which capture context is entered and which pool is passed.
"""

import contextlib
import sys
import types

import pytest
import torch

import hybrid_engine.accelerator as accel
from hybrid_engine.accelerator import (
    Accelerator,
    CPUAccelerator,
    TorchBackendAccelerator,
    build_accelerator,
    get_accelerator,
    set_accelerator,
)


@pytest.fixture(autouse=True)
def _restore_accelerator():
    yield
    set_accelerator(None)


def make_stub_backend(graph_cls_name: str, log: list, capturing_fn: bool = True):
    """A stand-in for a torch device module with a native graph API."""

    class StubGraph:
        def __init__(self):
            log.append(("construct", graph_cls_name))
            self.replays = 0

        def replay(self):
            self.replays += 1
            log.append(("replay",))

        def pool(self):
            return ("pool-of", id(self))

    state = {"capturing": False}

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append(("enter", type(g).__name__, pool, stream))
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False
            log.append(("exit",))

    class StubEvent:
        def __init__(self, enable_timing=False):
            log.append(("event", enable_timing))

    mod = types.SimpleNamespace(
        Event=StubEvent,
        graph=graph,
        synchronize=lambda: log.append(("sync",)),
        is_available=lambda: True,
        memory_allocated=lambda: 1234,
        max_memory_allocated=lambda: 5678,
        current_device=lambda: 0,
    )
    setattr(mod, graph_cls_name, StubGraph)
    if capturing_fn:
        mod.is_current_stream_capturing = lambda: state["capturing"]
    return mod


@pytest.mark.stub
@pytest.mark.parametrize("name,cls_name", [("cuda", "CUDAGraph"), ("npu", "NPUGraph"), ("xpu", "XPUGraph")])
def test_stub_native_graph_wiring(name, cls_name, monkeypatch):
    log: list = []
    stub = make_stub_backend(cls_name, log)
    # the stub backend is not the current torch.accelerator, so the native class is used
    acc = TorchBackendAccelerator(name, stub)
    assert acc.graph_api == f"torch.{name}.{cls_name}"
    assert acc.supports_graph_capture
    g = acc.create_graph()
    assert type(g).__name__ == "StubGraph"
    pool = acc.graph_pool(g)
    assert pool == ("pool-of", id(g))
    g2 = acc.create_graph()
    assert acc.is_current_stream_capturing() is False
    with acc.capture_to_graph(g2, pool=pool, stream="s1"):
        assert acc.is_current_stream_capturing() is True
    assert acc.is_current_stream_capturing() is False
    acc.replay_graph(g2)
    assert ("enter", "StubGraph", pool, "s1") in log
    assert g2.replays == 1
    assert acc.memory_allocated() == 1234 and acc.max_memory_allocated() == 5678
    assert type(acc.Event(enable_timing=True)).__name__ == "StubEvent" and ("event", True) in log
    if name != "npu":  # "npu" becomes a torch device type only once real torch_npu registers it
        assert acc.device() == torch.device(name, 0)


@pytest.mark.stub
def test_stub_torch_npu_import_path(monkeypatch):
    """`build_accelerator('npu')` imports torch_npu and uses its graph class."""
    log: list = []
    npu = make_stub_backend("NPUGraph", log)
    fake = types.ModuleType("torch_npu")
    fake.npu = npu
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.delattr(torch, "npu", raising=False)
    acc = build_accelerator("npu")
    assert acc.graph_api == "torch.npu.NPUGraph"
    with acc.capture_to_graph(acc.create_graph()):
        assert acc.is_current_stream_capturing()
    assert log[0] == ("construct", "NPUGraph")


@pytest.mark.stub
def test_stub_backend_without_capturing_query_tracks_capture_itself():
    log: list = []
    stub = make_stub_backend("CUDAGraph", log, capturing_fn=False)
    acc = TorchBackendAccelerator("cuda", stub)
    assert acc.is_current_stream_capturing() is False
    with acc.capture_to_graph(acc.create_graph()):
        assert acc.is_current_stream_capturing() is True
    assert acc.is_current_stream_capturing() is False


@pytest.mark.stub
def test_stub_torch_accelerator_graph_preferred_when_registered(monkeypatch):
    """When torch.accelerator.Graph has an implementation for the current backend, it wins."""
    log: list = []

    class StubAccelGraph:
        def __init__(self, keep_graph=False, *, pool=None):
            log.append("construct")
            self.graph_pool = pool

        def capture_begin(self):
            log.append(("begin", self.graph_pool))

        def capture_end(self):
            log.append("end")

        def replay(self):
            log.append("replay")

        def pool(self):
            return (7, 7)

    monkeypatch.setattr(torch.accelerator, "Graph", StubAccelGraph)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    native = make_stub_backend("CUDAGraph", [])
    acc = TorchBackendAccelerator("cuda", native)
    assert acc.graph_api == "torch.accelerator.Graph"
    g = acc.create_graph()
    with acc.capture_to_graph(g, pool=(1, 2)):
        assert acc.is_current_stream_capturing()
    acc.replay_graph(g)
    assert log == ["construct", "construct", ("begin", (1, 2)), "end", "replay"]
    assert acc.graph_pool(g) == (7, 7)


@pytest.mark.stub
def test_torch_accelerator_graph_without_backend_impl_falls_back_to_module(monkeypatch):
    class Unregistered:
        def __init__(self, *a, **k):
            raise RuntimeError("no graph implementation registered")

    monkeypatch.setattr(torch.accelerator, "Graph", Unregistered)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    acc = TorchBackendAccelerator("xpu", make_stub_backend("XPUGraph", []))
    assert acc.graph_api == "torch.xpu.XPUGraph"


def test_backend_without_graph_class_cannot_capture():
    acc = TorchBackendAccelerator("mps", types.SimpleNamespace(is_available=lambda: False))
    assert acc.create_graph() is None
    assert acc.supports_graph_capture is False
    assert "mps" in acc.graph_unavailable_reason
    assert acc.is_current_stream_capturing() is False
    assert acc.memory_allocated() == 0
    with pytest.raises(RuntimeError, match="unavailable"), acc.capture_to_graph(object()):
        pass


def test_env_var_forces_cpu_and_detection_defaults_to_cpu(monkeypatch):
    monkeypatch.setenv(accel.ENV_VAR, "cpu")
    set_accelerator(None)
    acc = get_accelerator()
    assert isinstance(acc, CPUAccelerator)
    assert acc is get_accelerator()  # process-wide
    monkeypatch.delenv(accel.ENV_VAR)
    set_accelerator(None)
    assert get_accelerator().device_name() == "cpu"


def test_env_var_can_disable_cpu_graph_emulation(monkeypatch):
    monkeypatch.setenv("HYBRID_ENGINE_CPU_GRAPHS", "0")
    assert build_accelerator("cpu").supports_graph_capture is False


def test_unknown_accelerator_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'"):
        build_accelerator("tpu")


def test_set_accelerator_replaces_and_validates():
    mine = CPUAccelerator(emulate_graphs=False)
    set_accelerator(mine)
    assert get_accelerator() is mine
    with pytest.raises(TypeError, match="Accelerator"):
        set_accelerator("cpu")


def test_cpu_accelerator_interface():
    acc = CPUAccelerator()
    assert isinstance(acc, Accelerator)
    assert acc.device() == torch.device("cpu")
    assert acc.is_available()
    acc.synchronize()
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0
    with acc.stream(acc.Stream()):
        pass
    assert acc.supports_graph_capture
    assert acc.graph_pool(acc.create_graph()) is not None
