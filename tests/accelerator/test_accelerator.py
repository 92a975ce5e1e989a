"""Accelerator selection and graph-API discovery.

Tests marked ``stub`` check wiring only: small stub modules stand in for
``torch.cuda`` / ``torch_npu`` / ``torch.xpu`` / ``torch.accelerator.Graph``,
because this machine has no such hardware. They check which class is
constructed, which capture context is entered, which pool and stream are
passed. The stubs model one CUDA rule on purpose: capture on the default
stream raises, so a capture path that forgets the side stream fails here.
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


class StubStream:
    """A stub device stream: identity plus a logged ``wait_stream``."""

    def __init__(self, name: str, log: list):
        self.name = name
        self._log = log

    def wait_stream(self, other: "StubStream") -> None:
        self._log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return f"<StubStream {self.name}>"


NON_DEFAULT = "graphs must be captured on a non-default stream"


def make_stub_backend(graph_cls_name: str, log: list, capturing_fn: bool = True, stream_api: str = "context"):
    """A stand-in for a torch device module with a native graph API and streams.

    ``stream_api``: ``"context"`` exposes ``stream(s)``, ``"set_stream"`` only
    ``set_stream(s)``, ``"none"`` no streams at all.
    """

    class StubGraph:
        def __init__(self):
            log.append(("construct", graph_cls_name))
            self.replays = 0

        def replay(self):
            self.replays += 1
            log.append(("replay",))

        def pool(self):
            if not getattr(self, "captured", False):  # as the real classes: "without a preceding successful capture"
                raise RuntimeError("stub: Called pool() without a preceding successful capture.")
            return ("pool-of", id(self))

    default = StubStream("default", log)
    state = {"capturing": False, "current": default, "made": 0}

    def new_stream():
        state["made"] += 1
        return StubStream(f"side{state['made']}", log)

    @contextlib.contextmanager
    def stream(s):
        prev = state["current"]
        if s is not None:
            state["current"] = s
        try:
            yield s
        finally:
            state["current"] = prev

    @contextlib.contextmanager
    def graph_with_mode(g, pool=None, stream=None, capture_error_mode="global"):
        # Like torch.cuda.graph: its own side stream when none is given; CUDA refuses the default one.
        s = stream if stream is not None else StubStream("graph-internal", log)
        if s is default:
            raise RuntimeError(f"stub: CUDA {NON_DEFAULT}")
        state["mode"] = capture_error_mode
        log.append(("enter", type(g).__name__, pool, s))
        prev, state["current"] = state["current"], s
        state["capturing"] = True
        try:
            yield
            g.captured = True
        finally:
            state["capturing"] = False
            state["current"] = prev
            log.append(("exit",))

    def graph(g, pool=None, stream=None):  # torch.xpu.graph (2.11, 2.13): no capture_error_mode
        return graph_with_mode(g, pool, stream, capture_error_mode=None)

    class StubEvent:
        def __init__(self, enable_timing=False):
            log.append(("event", enable_timing))

    mod = types.SimpleNamespace(
        Event=StubEvent,
        graph=graph if graph_cls_name == "XPUGraph" else graph_with_mode,
        synchronize=lambda: log.append(("sync",)),
        is_available=lambda: True,
        memory_allocated=lambda: 1234,
        max_memory_allocated=lambda: 5678,
        current_device=lambda: 0,
    )
    if stream_api != "none":
        mod.Stream = new_stream
        mod.default_stream = lambda: default
        mod.current_stream = lambda: state["current"]
    if stream_api == "context":
        mod.stream = stream
    elif stream_api == "set_stream":
        mod.set_stream = lambda s: state.update(current=s)
    setattr(mod, graph_cls_name, StubGraph)
    if capturing_fn:
        mod.is_current_stream_capturing = lambda: state["capturing"]
    mod.stub_state = state  # for assertions, not part of any backend's API
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
    with acc.capture_to_graph(g):  # a pool handle exists only after a capture, as on the real classes
        pass
    pool = acc.graph_pool(g)
    assert pool == ("pool-of", id(g))
    g2 = acc.create_graph()
    assert acc.is_current_stream_capturing() is False
    s1 = acc.Stream()
    with acc.capture_to_graph(g2, pool=pool, stream=s1):
        assert acc.is_current_stream_capturing() is True
    assert acc.is_current_stream_capturing() is False
    acc.replay_graph(g2)
    assert ("enter", "StubGraph", pool, s1) in log
    # Another thread's host read must not break the capture: thread-local mode where the API takes a mode;
    # torch.xpu.graph takes none, and gets none.
    assert stub.stub_state["mode"] == (None if name == "xpu" else "thread_local")
    assert g2.replays == 1
    assert acc.memory_allocated() == 1234 and acc.max_memory_allocated() == 5678
    assert type(acc.Event(enable_timing=True)).__name__ == "StubEvent" and ("event", True) in log
    if name != "npu":  # "npu" becomes a torch device type only once real torch_npu registers it
        assert acc.device() == torch.device(name, 0)


@pytest.mark.stub
@pytest.mark.parametrize("name,cls_name", [("cuda", "CUDAGraph"), ("npu", "NPUGraph"), ("xpu", "XPUGraph")])
def test_stub_native_capture_gets_the_owned_side_stream(name, cls_name):
    """stream=None resolves to graph_stream(), passed explicitly to the native graph context."""
    log: list = []
    acc = TorchBackendAccelerator(name, make_stub_backend(cls_name, log))
    default = acc.default_stream()
    side = acc.graph_stream()
    assert side is not None and side is not default
    assert acc.graph_stream() is side  # owned: the same stream every time
    for _ in range(2):
        with acc.capture_to_graph(acc.create_graph()):
            assert acc.current_stream() is side
        assert acc.current_stream() is default
    enters = [e for e in log if e[0] == "enter"]
    assert [e[3] for e in enters] == [side, side]
    first = log.index(enters[0])
    assert log.index(("wait", side.name, "default")) < first < log.index(("wait", "default", side.name))
    with pytest.raises(RuntimeError, match=NON_DEFAULT), acc.capture_to_graph(acc.create_graph(), stream=default):
        pass
    assert acc.current_stream() is default


@pytest.mark.stub
def test_stub_on_graph_stream_orders_warm_up_against_the_caller():
    log: list = []
    acc = TorchBackendAccelerator("cuda", make_stub_backend("CUDAGraph", log))
    side = acc.graph_stream()
    with acc.on_graph_stream() as s:
        assert s is side and acc.current_stream() is side
        log.append("warm-up")
    assert acc.current_stream() is acc.default_stream()
    assert log == [("wait", side.name, "default"), "warm-up", ("wait", "default", side.name)]


@pytest.mark.stub
def test_stub_module_with_set_stream_only():
    log: list = []
    acc = TorchBackendAccelerator("xpu", make_stub_backend("XPUGraph", log, stream_api="set_stream"))
    with acc.on_graph_stream():
        assert acc.current_stream() is acc.graph_stream()
    assert acc.current_stream() is acc.default_stream()


@pytest.mark.stub
def test_stub_module_without_streams_captures_without_one():
    log: list = []
    acc = TorchBackendAccelerator("cuda", make_stub_backend("CUDAGraph", log, stream_api="none"))
    assert acc.default_stream() is None and acc.graph_stream() is None
    with acc.on_graph_stream() as s:
        assert s is None
    g = acc.create_graph()
    with acc.capture_to_graph(g):
        pass
    assert [e[3] for e in log if e[0] == "enter"][0].name == "graph-internal"  # the native default applies
    assert acc.graph_memory_bytes(acc.graph_pool(g)) is None


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


def make_stub_accelerator_graph(native, log: list):
    """A stand-in for ``torch.accelerator.Graph``: ``capture_begin`` captures on the current stream,
    and, as on CUDA, refuses when that is the default stream."""

    class StubAccelGraph:
        def __init__(self, keep_graph=False, *, pool=None, capture_error_mode="default"):
            log.append("construct")
            self.graph_pool = pool
            self.capture_error_mode = capture_error_mode

        def capture_begin(self):
            current = native.current_stream()
            if current is native.default_stream():
                raise RuntimeError(f"stub: CUDA {NON_DEFAULT}")
            log.append(("begin", self.graph_pool, current.name))
            log.append(("mode", self.capture_error_mode))

        def capture_end(self):
            log.append("end")

        def replay(self):
            log.append("replay")

        def pool(self):
            return (7, 7)

    return StubAccelGraph


@pytest.mark.stub
def test_stub_torch_accelerator_graph_preferred_when_registered(monkeypatch):
    """When torch.accelerator.Graph has an implementation for the current backend, it wins."""
    log: list = []
    native = make_stub_backend("CUDAGraph", [])
    monkeypatch.setattr(torch.accelerator, "Graph", make_stub_accelerator_graph(native, log), raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    acc = TorchBackendAccelerator("cuda", native)
    assert acc.graph_api == "torch.accelerator.Graph"
    g = acc.create_graph()
    with acc.capture_to_graph(g, pool=(1, 2)):
        assert acc.is_current_stream_capturing()
    acc.replay_graph(g)
    # Captured in thread-local error mode: another thread's host read neither fails nor breaks it.
    assert log == ["construct", "construct", ("begin", (1, 2), acc.graph_stream().name), ("mode", "thread_local"),
                   "end", "replay"]
    assert acc.graph_pool(g) == (7, 7)


@pytest.mark.stub
def test_a_backend_that_warns_about_the_capture_mode_at_every_capture_is_said_once_in_the_log(monkeypatch, caplog):
    """XPU's torch.accelerator.Graph warns at each capture_begin that it falls back to its default error mode:
    under -W error every capture would fail, and otherwise each would warn."""
    import logging
    import warnings

    log: list = []
    native = make_stub_backend("XPUGraph", [])
    graph_cls = make_stub_accelerator_graph(native, log)
    begin = graph_cls.capture_begin

    def warning_begin(self):
        if self.capture_error_mode != "default":
            warnings.warn("XPUGraph currently only support default GraphCaptureMode. Falling back to default "
                          "capture behavior.", UserWarning, stacklevel=2)
        begin(self)

    monkeypatch.setattr(graph_cls, "capture_begin", warning_begin)
    monkeypatch.setattr(torch.accelerator, "Graph", graph_cls, raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    acc = TorchBackendAccelerator("xpu", native)
    assert acc.graph_api == "torch.accelerator.Graph"
    with caplog.at_level(logging.INFO, logger="hybrid_engine.accelerator.backends"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with acc.capture_to_graph(acc.create_graph()):
                pass
    assert log.count("end") == 2
    said = [r.getMessage() for r in caplog.records if "GraphCaptureMode" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("Graph capture on xpu: XPUGraph currently")


@pytest.mark.stub
def test_stub_torch_accelerator_graph_captures_on_owned_side_stream(monkeypatch):
    """capture_begin captures on the *current* stream, so stream=None must switch to graph_stream()
    first: on real CUDA the current stream is the default one, where capture is refused."""
    log: list = []
    native = make_stub_backend("CUDAGraph", log)
    monkeypatch.setattr(torch.accelerator, "Graph", make_stub_accelerator_graph(native, log), raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    acc = TorchBackendAccelerator("cuda", native)
    default = acc.default_stream()
    assert acc.current_stream() is default
    side = acc.graph_stream()
    log.clear()
    with acc.capture_to_graph(acc.create_graph()):
        assert acc.current_stream() is side
    assert acc.current_stream() is default
    begin = log.index(("begin", None, side.name))
    # the side stream waits on the caller's stream before capture; the caller waits on it after
    assert log.index(("wait", side.name, "default")) < begin < log.index(("wait", "default", side.name))
    assert log.index(("sync",)) < begin  # pending work is drained before capture, as torch.cuda.graph does
    with pytest.raises(RuntimeError, match=NON_DEFAULT), acc.capture_to_graph(acc.create_graph(), stream=default):
        pass
    assert acc.current_stream() is default and not acc.is_current_stream_capturing()


@pytest.mark.stub
def test_torch_accelerator_graph_without_backend_impl_falls_back_to_module(monkeypatch):
    class Unregistered:
        def __init__(self, *a, **k):
            raise RuntimeError("no graph implementation registered")

    monkeypatch.setattr(torch.accelerator, "Graph", Unregistered, raising=False)
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


@pytest.mark.stub
def test_a_cuda_build_of_torch_on_a_host_without_a_gpu_detects_cpu(monkeypatch):
    """Stub of a CUDA wheel on a CPU-only host: torch.accelerator still names CUDA (its build), but reports it
    unavailable. Detection must pick the CPU: an engine on a CPU model once called torch.cuda.current_device()
    there and failed with "Found no NVIDIA driver"."""
    monkeypatch.delenv(accel.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: (
        None if check_available else torch.device("cuda")))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    set_accelerator(None)
    try:
        assert isinstance(get_accelerator(), CPUAccelerator)
    finally:
        set_accelerator(None)


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
    assert acc.graph_pool_handle() is not None


def test_base_accelerator_has_no_streams_or_pool_accounting():
    acc = Accelerator()
    assert acc.default_stream() is None and acc.current_stream() is None and acc.graph_stream() is None
    with acc.on_graph_stream() as s:
        assert s is None
    assert acc.graph_memory_bytes(object()) is None


@pytest.mark.stub
def test_stub_npu_backend_graphs_sdpa_models_with_npu_graph(monkeypatch):
    """The runner's attention switch asks the backend's name and torch_npu's kernels, never a torch device.
    Only sdpa reaches the fused kernels that NPU capture rejects; eager attention captures as it is."""
    from hybrid_engine.graphs.policy import graph_attention, refusal_reason
    from hybrid_engine.tiny_models import build_model

    npu = TorchBackendAccelerator("npu", make_stub_backend("NPUGraph", []))
    cuda = TorchBackendAccelerator("cuda", make_stub_backend("CUDAGraph", []))
    fake = types.ModuleType("torch_npu")
    fake.npu_fusion_attention_v3 = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    model = build_model("tiny-llama", attn_implementation="sdpa")
    for impl, expected in (("sdpa", "npu_graph"), ("eager", None), ("npu_graph", None),
                           ("flash_attention_2", None)):
        model.config._attn_implementation = impl
        assert graph_attention(model, npu) == expected, impl
        assert graph_attention(model, cuda) is None and graph_attention(model, CPUAccelerator()) is None
    model.config._attn_implementation = "sdpa"
    del fake.npu_fusion_attention_v3  # a torch_npu without the graph-mode kernel: nothing to switch to
    assert graph_attention(model, npu) is None
    assert "npu_fusion_attention_v3" in refusal_reason(model, npu, None)  # and sdpa is refused up front


INVALIDATED = "operation failed due to a previous error during capture"


@pytest.mark.stub
@pytest.mark.parametrize("api", ["module graph", "torch.accelerator.Graph"])
def test_a_failed_capture_raises_the_bodys_error_not_the_failed_end(api, monkeypatch):
    """On CUDA, a capture the body invalidated (a host read in a hook) fails again when it ends; the
    stubs do the same. The body's exception is the cause the runner must see."""
    log: list = []
    native = make_stub_backend("CUDAGraph", log)
    if api == "module graph":
        plain = native.graph

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):  # torch.cuda.graph's __exit__ ends the capture whatever happened
            with plain(g, pool=pool, stream=stream):
                try:
                    yield
                except BaseException:
                    raise RuntimeError(f"stub: CUDA {INVALIDATED}") from None

        native.graph = graph
    else:
        class Invalidating(make_stub_accelerator_graph(native, log)):
            def capture_end(self):
                raise RuntimeError(f"stub: CUDA {INVALIDATED}")

        monkeypatch.setattr(torch.accelerator, "Graph", Invalidating, raising=False)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    acc = TorchBackendAccelerator("cuda", native)
    assert (acc.graph_api == "torch.accelerator.Graph") == (api != "module graph")
    with pytest.raises(ValueError, match="the body's own error"), acc.capture_to_graph(acc.create_graph()):
        raise ValueError("the body's own error")
    assert acc.current_stream() is acc.default_stream() and not acc.is_current_stream_capturing()


def _emulating_cuda_module(reserved: dict | None = None, failing_captures: tuple[int, ...] = ()):
    """A stub ``torch.cuda`` whose ``graph`` records with the CPU emulation and, like CUDA, fails to end a
    capture its body broke; ``reserved["bytes"]``, when given, is what ``memory_reserved`` reports, and each
    capture reserves 4096 more for its pool. Like CUDA's allocator, the emulation keeps a pool whose capture
    failed "recording" and refuses any later capture into it; the captures numbered in ``failing_captures``
    (from 1) fail at their end, as one running out of memory would. Returns the module and its allocator
    bindings (``_cpu_endAllocateToPool``, ``_cpu_releasePool``: what ``torch._C`` offers for CUDA)."""
    from hybrid_engine.accelerator import cpu_graph as emu

    count = [0]

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        count[0] += 1
        with emu.cpu_stream(stream):
            try:
                with emu.capture_cpu_graph(g, pool=pool):
                    yield
                    if count[0] in failing_captures:
                        raise RuntimeError("stub: CUDA out of memory while capturing")
            except BaseException:
                raise RuntimeError(f"stub: CUDA {INVALIDATED}") from None
        if reserved is not None:
            reserved["bytes"] += 4096

    module = types.SimpleNamespace(
        CUDAGraph=emu.CPUGraph, graph=graph, Stream=emu.CPUStream, stream=emu.cpu_stream,
        current_stream=emu.current_cpu_stream, default_stream=emu.default_cpu_stream,
        is_current_stream_capturing=emu.is_cpu_graph_capturing, is_available=lambda: True,
        graph_pool_handle=emu.CPUGraphPool,
        memory_reserved=(lambda: reserved["bytes"]) if reserved is not None else None)
    bindings = types.SimpleNamespace(_cpu_endAllocateToPool=lambda device, pool: emu.end_allocating_to_pool(pool),
                                     _cpu_releasePool=lambda device, pool: emu.release_graph_pool(pool))
    return module, bindings


def _emulating_cuda(reserved: dict | None = None, failing_captures: tuple[int, ...] = ()) -> TorchBackendAccelerator:
    module, bindings = _emulating_cuda_module(reserved, failing_captures)
    return TorchBackendAccelerator("cpu", module, bindings=bindings)


def _decode_steps(model, calls: int = 4, steps: int = 3):
    import warnings

    from hybrid_engine.generation.call_context import decode_grad_mode
    from hybrid_engine.graphs.runner import DecodeGraphRunner

    runner, key = DecodeGraphRunner(model), (0.0, 1.0, -1)
    with warnings.catch_warnings(), decode_grad_mode():
        warnings.simplefilter("ignore")
        for _ in range(calls):
            slots = runner.prepare(rows=2, capacity=32, num_eos=1, graphs=True)
            slots.set_special_ids(0, (2,))
            slots.knobs.set(*key)
            for _ in range(steps):
                runner.step(2, 1, key)
    return runner.stats


@pytest.mark.stub
def test_an_uncapturable_hook_is_refused_by_name_when_ending_the_capture_fails_too():
    """The runner still names the hook's module, and counts no generic capture failure."""
    from hybrid_engine.tiny_models import build_model

    set_accelerator(_emulating_cuda())
    model = build_model("tiny-gpt2")
    model.transformer.h[0].register_forward_hook(lambda mod, args, out: print(float(out[0].abs().max())))
    stats = _decode_steps(model)
    assert "'transformer.h.0'" in stats.last_refusal_reason and INVALIDATED not in stats.last_refusal_reason
    assert stats.captures == 0 and "disabled" not in stats.last_refusal_reason


@pytest.mark.stub
def test_a_capture_that_fails_into_the_shared_pool_does_not_doom_the_later_ones():
    """On CUDA a capture that cannot end leaves its pool "recording", and every later capture into that pool
    fails ("already recording to mempool_id"): before, three such failures disabled graphs for good."""
    import warnings

    from hybrid_engine.generation.call_context import decode_grad_mode
    from hybrid_engine.graphs.runner import DecodeGraphRunner
    from hybrid_engine.tiny_models import build_model

    set_accelerator(_emulating_cuda(failing_captures=(2,)))
    runner, key = DecodeGraphRunner(build_model("tiny-gpt2")), (0.0, 1.0, -1)
    with warnings.catch_warnings(), decode_grad_mode():
        warnings.simplefilter("ignore")
        for _ in range(4):
            slots = runner.prepare(rows=4, capacity=32, num_eos=1, graphs=True)
            slots.set_special_ids(0, (2,))
            slots.knobs.set(*key)
            for bucket in (4, 4, 2, 2, 1, 1):  # captures 4 (into its own pool), then 2 (fails), then 1
                runner.step(bucket, 1, key)
    stats = runner.stats
    assert stats.buckets == (1, 2, 4) and stats.fallbacks == 1 and stats.replays > 0
    assert "disabled" not in (stats.last_refusal_reason or "")


@pytest.mark.stub
def test_graph_memory_of_a_cuda_pool_is_the_size_of_its_segments_in_the_allocator_snapshot():
    """torch.cuda.graph empties the cache before capturing, so a difference of reserved memory can be 0."""
    calls = []

    def memory_snapshot(mempool_id=None, include_traces=True):
        calls.append((mempool_id, include_traces))
        return [{"total_size": 2 << 20}, {"total_size": 1 << 20}] if mempool_id == (0, 7) else []

    module = make_stub_backend("CUDAGraph", [])
    module.memory_snapshot = memory_snapshot
    acc = TorchBackendAccelerator("cuda", module)
    assert acc.graph_memory_bytes((0, 7)) == 3 << 20 and calls == [((0, 7), False)]
    assert acc.graph_memory_bytes(None) is None


@pytest.mark.stub
def test_graph_memory_is_what_the_allocator_reserves_for_the_pool_where_the_backend_cannot_size_it():
    """CUDA frees a capture's allocations by its end (memory_allocated is back where it was); its pool keeps
    the memory reserved."""
    from hybrid_engine.tiny_models import build_model

    reserved = {"bytes": 10_000}
    acc = _emulating_cuda(reserved)
    set_accelerator(acc)
    assert acc.graph_memory_bytes(None) is None and acc.memory_reserved() == 10_000
    stats = _decode_steps(build_model("tiny-gpt2"))
    assert stats.captures == 1 and stats.graph_memory_bytes == 4096


@pytest.mark.stub
def test_on_device_makes_the_models_device_current_and_streams_are_per_device():
    """A model on cuda:1 while cuda:0 is current: its streams, captures and replays must be on cuda:1 (a
    stream made on cuda:0 would capture nothing of cuda:1's work: an empty graph)."""
    log: list = []
    native = make_stub_backend("CUDAGraph", log)
    current = {"index": 0}

    @contextlib.contextmanager
    def device(index):
        prev, current["index"] = current["index"], index
        try:
            yield
        finally:
            current["index"] = prev

    native.device = device
    native.current_device = lambda: current["index"]
    made = native.Stream

    def stream_on_current_device():
        s = made()
        s.device_index = current["index"]
        return s

    native.Stream = stream_on_current_device
    acc = TorchBackendAccelerator("cuda", native)
    on_0 = acc.graph_stream()
    with acc.on_device(torch.device("cuda", 1)):
        assert acc.current_device_index() == 1
        on_1 = acc.graph_stream()
        assert on_1 is acc.graph_stream() and on_1 is not on_0 and on_1.device_index == 1
    assert acc.current_device_index() == 0 and acc.graph_stream() is on_0 and on_0.device_index == 0
    with acc.on_device(torch.device("cuda")):  # no index: the current device
        assert acc.current_device_index() == 0


# ------------------------------------------------------------------ a failed CUDA capture and the allocator
class FakeCudaAllocator:
    """CUDA's caching allocator as far as graph pools go (c10/cuda/CUDACachingAllocator.cpp): the captures under
    way (``captures_underway``) and a use count per private pool, with the checks and asserts it makes."""

    def __init__(self, log: list):
        self.underway: list = []
        self.use: dict = {}
        self.log = log

    def begin(self, pool):  # beginAllocateToPool: create_or_incref_pool, then the already-recording check
        if pool in self.use and self.use[pool] <= 0:
            raise RuntimeError("stub: INTERNAL ASSERT FAILED: it->second->use_count > 0")
        self.use[pool] = self.use.get(pool, 0) + 1
        if pool in self.underway:
            raise RuntimeError("stub: beginAllocateToPool: already recording to mempool_id")
        self.underway.append(pool)

    def end(self, device, pool):  # torch._C._cuda_endAllocateToPool
        if pool not in self.underway:
            raise RuntimeError("stub: endAllocatePool: not currently recording to mempool_id")
        self.underway.remove(pool)

    def release(self, device, pool):  # torch._C._cuda_releasePool
        self.use[pool] -= 1
        if self.use[pool] < 0:
            raise RuntimeError("stub: INTERNAL ASSERT FAILED: uc >= 0")

    def empty_cache(self):
        self.log.append(("empty_cache",))
        if self.underway:
            raise RuntimeError("stub: INTERNAL ASSERT FAILED: captures_underway.empty()")


def make_stub_cuda(version: str, log: list):
    """A stub ``torch.cuda`` whose ``CUDAGraph`` manages its pool as CUDAGraph.cpp does: ``"2.11"`` throws from
    ``capture_end`` before ending allocation when cudaStreamEndCapture fails and releases only an ended capture's
    pool; ``"fixed"`` (pytorch#180395) ends allocation in ``capture_end`` whatever happened and releases a begun
    capture's pool in ``reset()``. ``host_read()`` is a host synchronisation: refused while capturing, and it
    breaks the capture. ``graph`` is ``torch.cuda.graph``: a synchronize and an empty_cache before every capture."""
    alloc = FakeCudaAllocator(log)
    module = make_stub_backend("CUDAGraph", log)
    state = module.stub_state
    handles = iter(range(1, 1000))

    class FakeCUDAGraph:
        def __init__(self):
            self.pool_id, self.ended, self.begun, self.routing, self.broken = None, False, False, False, False
            self.fail_instantiate = state.get("fail_instantiate", False)

        def capture_begin(self, pool=None, capture_error_mode="global"):
            if state["current"] is module.default_stream():
                raise RuntimeError(f"stub: CUDA {NON_DEFAULT}")
            log.append(("begin", pool, capture_error_mode, state["current"].name))
            self.pool_id = pool if pool is not None else ("internal", id(self))
            alloc.begin(self.pool_id)
            self.begun = self.routing = True
            state["capturing"], state["graph"] = True, self

        def capture_end(self):
            state["capturing"], state["graph"] = False, None
            log.append(("end",))
            if version == "fixed":
                alloc.end(0, self.pool_id)
                self.routing = False
            if self.broken:
                raise RuntimeError(f"stub: CUDA {INVALIDATED}")  # cudaStreamEndCapture failed
            if version != "fixed":
                alloc.end(0, self.pool_id)
            self.ended = True  # capture_ended_
            if self.fail_instantiate:
                raise RuntimeError("stub: cudaGraphInstantiate failed")

        def reset(self):
            if version == "fixed":
                if self.begun:
                    if self.routing:
                        alloc.end(0, self.pool_id)
                    alloc.release(0, self.pool_id)
            elif self.ended:
                alloc.release(0, self.pool_id)
            self.begun = self.ended = self.routing = False

        def pool(self):
            if not self.ended:
                raise RuntimeError("stub: Called CUDAGraph::pool() without a preceding successful capture.")
            return self.pool_id

        def replay(self):
            log.append(("replay",))

    @contextlib.contextmanager
    def cuda_graph(g, pool=None, stream=None, capture_error_mode="global"):  # torch.cuda.graph
        module.synchronize()
        alloc.empty_cache()
        with module.stream(stream):
            g.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                yield
            finally:
                g.capture_end()

    def host_read():
        log.append(("host_read",))
        if state["capturing"]:
            state["graph"].broken = True
            raise RuntimeError("stub: CUDA operation not permitted when stream is capturing")

    module.CUDAGraph, module.graph, module.host_read = FakeCUDAGraph, cuda_graph, host_read
    module.graph_pool_handle = lambda: (0, next(handles))
    module.empty_cache = alloc.empty_cache
    bindings = types.SimpleNamespace(_cuda_endAllocateToPool=alloc.end, _cuda_releasePool=alloc.release)
    return module, bindings, alloc


@pytest.mark.stub
@pytest.mark.parametrize("version", ["2.11", "fixed"])
@pytest.mark.parametrize("failure", ["invalidated", "instantiate", "body only"])
def test_stub_a_failed_cuda_capture_ends_and_releases_its_pool_exactly_once(version, failure):
    """Before, a failed capture left the allocator recording (empty_cache asserted at the next torch.cuda.graph,
    record_stream frees were never reclaimed) and its pool's use count leaked. A release too many would free
    blocks the live graphs of a shared pool use."""
    log: list = []
    module, bindings, alloc = make_stub_cuda(version, log)
    acc = TorchBackendAccelerator("cuda", module, bindings=bindings)
    shared = acc.graph_pool_handle()
    live = acc.create_graph()
    with acc.capture_to_graph(live, pool=shared):
        pass
    assert alloc.use == {shared: 1} and alloc.underway == []
    for pool in (shared, None):  # into the pool a live graph holds, and into a handle of the call's own
        bad = acc.create_graph()
        bad.fail_instantiate = failure == "instantiate"
        raised = {"invalidated": INVALIDATED, "instantiate": "Instantiate failed", "body only": "not permitted"}
        with pytest.raises(RuntimeError, match=raised[failure]):  # the body's error where it raised one
            with acc.capture_to_graph(bad, pool=pool):
                if failure == "invalidated":
                    with contextlib.suppress(RuntimeError):
                        module.host_read()  # a hook that catches the refusal: the capture stays broken
                elif failure == "body only":
                    module.host_read()
        assert alloc.underway == [], "the allocator is left recording"
        acc.empty_cache()
    assert alloc.use[shared] == 1  # the live graph's reference, no more and no less
    assert [n for p, n in alloc.use.items() if p != shared] == [0]  # the call's own handle: released
    live.reset()
    assert alloc.use[shared] == 0
    assert ("sync",) not in log  # no synchronize per capture (torch.cuda.graph's __enter__ has one) ...
    assert log.count(("empty_cache",)) == 2  # ... nor an empty_cache: these two are the test's own
    begins = [e for e in log if e[0] == "begin"]
    assert [e[1] for e in begins] == [shared, shared, begins[2][1]] and begins[2][1] not in (None, shared)
    assert {e[2] for e in begins} == {"thread_local"} and {e[3] for e in begins} == {acc.graph_stream().name}


@pytest.mark.stub
def test_stub_without_the_allocator_bindings_a_failed_capture_is_left_as_torch_leaves_it():
    """A torch that offers neither binding: nothing is called that is not there (the runner still starts a fresh
    pool after the failure)."""
    log: list = []
    module, _, alloc = make_stub_cuda("2.11", log)
    acc = TorchBackendAccelerator("cuda", module, bindings=types.SimpleNamespace())
    with pytest.raises(RuntimeError, match="not permitted"), acc.capture_to_graph(acc.create_graph()):
        module.host_read()
    assert len(alloc.underway) == 1


@pytest.mark.stub
def test_stub_synchronize_empty_cache_and_seeding_wait_for_another_threads_capture():
    """CUDA capture belongs to the stream, and a device-wide synchronize waits on the capturing stream (an
    empty_cache asserts no capture is under way, in any thread): they wait for the capture lock."""
    import threading

    log: list = []
    module, bindings, _ = make_stub_cuda("2.11", log)
    module.manual_seed_all = lambda seed: log.append(("seed",))
    acc = TorchBackendAccelerator("cuda", module, bindings=bindings)
    inside = threading.Event()

    def capture():
        with acc.capture_to_graph(acc.create_graph()):
            inside.set()
            threading.Event().wait(0.3)  # the main thread's calls are made meanwhile
            log.append("capture body done")

    t = threading.Thread(target=capture)
    t.start()
    assert inside.wait(10)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(1)
    t.join(10)
    done = log.index("capture body done")
    assert done < log.index(("sync",)) and done < log.index(("empty_cache",)) and done < log.index(("seed",))


@pytest.mark.stub
def test_stub_each_thread_warms_up_and_captures_on_its_own_graph_stream():
    import threading

    acc = TorchBackendAccelerator("cuda", make_stub_backend("CUDAGraph", []))
    seen = []
    t = threading.Thread(target=lambda: seen.append(acc.graph_stream()))
    t.start()
    t.join()
    assert seen[0] is not acc.graph_stream() and acc.graph_stream() is acc.graph_stream()
