"""Another thread's calls while a graph captures, as CUDA's capture error modes rule them.

CUDA's stream capture has a mode (``torch.cuda.graph(capture_error_mode=...)``). In ``"global"`` mode,
PyTorch's default and what a backend whose graph API takes no mode gets, a potentially unsafe call in
*any* thread while a capture runs (a host read such as a data loader's ``.item()``, a stream or event
wait) fails with "operation not permitted when stream is capturing" and invalidates the capture. In
``"thread_local"`` mode, which every accelerator requests where the API takes a mode, only the capturing
thread is held to that. A device-wide synchronize, and anything on the capturing stream itself, break a
capture in every mode.

Every test here is ordered by events, never by sleeps: the capture waits, inside, until the other thread
has made its call, and every join has a timeout.
"""

import re
import threading

import numpy as np
import pytest
import torch
from conftest import left_padded_prompts as prompts

from hybrid_engine.accelerator import CPUAccelerator, GraphCaptureError, get_accelerator
from hybrid_engine.accelerator.cpu_graph import (
    CPUGraph,
    capture_cpu_graph,
    cpu_capture_error_mode,
    cpu_stream,
    is_cpu_graph_capturing,
    recording_pools,
    synchronize_device,
)
from hybrid_engine.engine import initialize
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.tiny_models import build_model

JOIN_S = 60
# The refusal another thread's call meets while a capture runs in global mode.
GLOBAL_REFUSAL = r"global capture mode.*operation not permitted when stream is capturing"


@pytest.fixture
def acc():
    return CPUAccelerator()


def in_thread(fn, name):
    """Run ``fn`` in a daemon thread named ``name``; returns (thread, outcome): ["ok", value] or ["raised", exc]."""
    outcome = []

    def run():
        try:
            outcome.extend(["ok", fn()])
        except BaseException as exc:  # checked by the caller
            outcome.extend(["raised", exc])

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, outcome


def capture_while(acc, mode, call, *, raw=False, stream=None, first=None):
    """Capture in a thread named "capturer" in ``mode`` (``None``: the default), through the accelerator or
    ``raw`` (no graph_capture_lock()), on ``stream`` (``None``: a new one); ``call()`` runs in a thread named
    "reader" while the capture is under way (the capture waits for it), after ``first()`` ran in the capture.
    Returns (the capture's outcome, the call's outcome)."""
    inside, called = threading.Event(), threading.Event()
    stream = acc.Stream() if stream is None else stream
    x = torch.ones(3)

    def body():
        with torch.no_grad():
            x * 2
            if first is not None:
                first()
            inside.set()
            assert called.wait(JOIN_S)

    def capture():
        g = acc.create_graph()
        if raw:
            with cpu_stream(stream), capture_cpu_graph(g, capture_error_mode=mode):
                body()
        else:
            with cpu_capture_error_mode(mode), acc.capture_to_graph(g, stream=stream):
                body()
        return g.is_captured

    capturer, captured = in_thread(capture, "capturer")
    try:
        assert inside.wait(JOIN_S)
        reader, called_out = in_thread(call, "reader")
        reader.join(JOIN_S)
        assert not reader.is_alive()
    finally:
        called.set()
        capturer.join(JOIN_S)
    assert not capturer.is_alive()
    return captured, called_out


def refused_in_global_mode(outcome) -> bool:
    return outcome[0] == "raised" and isinstance(outcome[1], GraphCaptureError) and \
        re.search(GLOBAL_REFUSAL, str(outcome[1]), re.S) is not None


def unpatched() -> bool:
    """Whether torch.Tensor's host reads are torch's own (no emulation wrapper in the way)."""
    return (torch.Tensor.item is torch._C.TensorBase.item and torch.Tensor.to is torch._C.TensorBase.to
            and "__bool__" not in torch.Tensor.__dict__ and torch.Tensor.__repr__.__module__ == "torch._tensor")


T = torch.arange(1.0, 5.0)

HOST_READS = {
    "item": lambda: T.sum().item(),
    "tolist": lambda: T.tolist(),
    "bool": lambda: bool(T[0]),
    "if": lambda: 1 if T[0] > 0 else 0,
    "int": lambda: int(T[1]),
    "float": lambda: float(T[1]),
    "index": lambda: [10, 20, 30][T.long()[0]],
    "numpy": lambda: T.numpy(),
    "np.asarray": lambda: np.asarray(T),
    "print": lambda: repr(T),
    "f-string": lambda: f"{T[0]:.1f}",
    "cpu": lambda: T.cpu(),
    "to-cpu": lambda: T.to("cpu"),
}

HOST_WAITS = {
    "own-stream-sync": lambda acc: acc.Stream().synchronize(),
    "own-stream-query": lambda acc: acc.Stream().query(),
    "default-stream-sync": lambda acc: acc.default_stream().synchronize(),
    "event-sync": lambda acc: acc.Event().synchronize(),
    "event-query": lambda acc: acc.Event().query(),
}


# ----------------------------------------------------------------- global mode: refused, capture broken
@pytest.mark.parametrize("read", list(HOST_READS))
def test_global_mode_another_threads_host_read_is_refused_and_breaks_the_capture(acc, read):
    """A data loader's ``.item()`` during the engine's capture, in CUDA's global mode: the call fails, the
    capture is invalidated, and the accelerator ends and releases the failed capture's pool."""
    captured, called = capture_while(acc, "global", HOST_READS[read])
    assert refused_in_global_mode(called), called
    assert "'reader'" in str(called[1]) and "'capturer'" in str(called[1])
    assert captured[0] == "raised" and isinstance(captured[1], GraphCaptureError), captured
    assert "invalidated by thread 'reader'" in str(captured[1])
    assert recording_pools() == [] and unpatched()
    HOST_READS[read]()  # no capture under way: fine again


@pytest.mark.parametrize("wait", list(HOST_WAITS))
def test_global_mode_another_threads_stream_or_event_wait_is_refused_and_breaks_the_capture(acc, wait):
    """cudaStreamSynchronize, cudaEventSynchronize and cudaEventQuery on streams that take no part in the capture
    (the NCCL watchdog's query is the known case): unsafe in every thread under global mode."""
    captured, called = capture_while(acc, "global", lambda: HOST_WAITS[wait](acc))
    assert refused_in_global_mode(called), called
    assert captured[0] == "raised" and "invalidated by thread 'reader'" in str(captured[1]), captured
    assert recording_pools() == []


@pytest.mark.leaves_pool_recording  # a raw capture: nobody ends its pool
def test_global_mode_on_a_raw_capture_too(acc):
    captured, called = capture_while(acc, "global", HOST_READS["item"], raw=True)
    assert called[0] == "raised" and captured[0] == "raised", (called, captured)
    assert "invalidated by thread 'reader'" in str(captured[1])


def test_global_mode_the_capturing_threads_own_host_reads_are_still_refused(acc):
    """While a global capture runs, torch.Tensor's host reads are wrapped for the other threads; the capturing
    thread's own reads must still be refused, by name."""
    x = torch.ones(3)
    for read, what in [(lambda y: y.tolist(), r"Tensor.tolist\(\)"), (lambda y: y.to("cpu"), r"Tensor.to\('cpu'\)"),
                       (lambda y: repr(y), "printing a tensor"), (lambda y: y.sum().item(), "Tensor.item"),
                       (lambda y: y.numpy(), r"Tensor.numpy\(\)")]:
        g = acc.create_graph()
        with pytest.raises(GraphCaptureError, match=what), cpu_capture_error_mode("global"), torch.no_grad(), \
                acc.capture_to_graph(g):
            read(x * 2)
        assert not g.is_captured and unpatched()
    g = acc.create_graph()
    with cpu_capture_error_mode("global"), torch.no_grad(), acc.capture_to_graph(g):
        out = x.to(torch.float64) * 2  # a device-side dtype cast stays legal
    g.replay()
    assert out.tolist() == [2.0, 2.0, 2.0] and unpatched()


# ----------------------------------------------------------------- thread_local mode: other threads are free
@pytest.mark.parametrize("call", list(HOST_READS) + list(HOST_WAITS))
def test_thread_local_mode_another_threads_host_reads_and_waits_are_allowed(acc, call):
    """What every accelerator requests: CUDA holds only the capturing thread to the rules, so another thread's
    engine, trainer or data loader runs on. No wrapper is installed either (nothing slows down)."""
    fn = HOST_READS.get(call) or (lambda: HOST_WAITS[call](acc))

    def checked():
        assert unpatched() and is_cpu_graph_capturing() is False
        return fn()

    captured, called = capture_while(acc, "thread_local", checked)
    assert called[0] == "ok", called
    assert captured == ["ok", True]


def test_the_accelerators_captures_default_to_thread_local(acc):
    captured, called = capture_while(acc, None, HOST_READS["item"])
    assert called == ["ok", 10.0] and captured == ["ok", True]


# ----------------------------------------------------------------- in every mode
@pytest.mark.leaves_pool_recording
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_a_device_wide_synchronize_from_another_thread_breaks_a_capture_in_every_mode(acc, mode):
    """cudaDeviceSynchronize waits on the capturing stream whatever the mode. The accelerator's synchronize()
    waits for graph_capture_lock() instead; code that bypasses it is refused."""
    captured, called = capture_while(acc, mode, synchronize_device, raw=True)
    assert called[0] == "raised" and "while thread 'capturer' is capturing" in str(called[1]), called
    assert captured[0] == "raised" and "invalidated by thread 'reader'" in str(captured[1]), captured


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_the_accelerators_synchronize_waits_for_the_capture_and_leaves_it_intact(acc, mode):
    """Ordered by the lock itself: the capture holds graph_capture_lock(), so the reader's synchronize() cannot
    run before the capture has ended, whenever the reader gets there."""
    inside, reading = threading.Event(), threading.Event()
    g = acc.create_graph()

    def capture():
        with cpu_capture_error_mode(mode), torch.no_grad(), acc.capture_to_graph(g):
            torch.ones(3) * 2
            inside.set()
            assert reading.wait(JOIN_S)  # the reader is about to synchronize (or already waits)

    def read():
        assert inside.wait(JOIN_S)
        reading.set()
        acc.synchronize()
        return g.is_captured  # the capture ended (and succeeded) before synchronize() ran

    capturer, captured = in_thread(capture, "capturer")
    reader, called = in_thread(read, "reader")
    capturer.join(JOIN_S)
    reader.join(JOIN_S)
    assert not capturer.is_alive() and not reader.is_alive()
    assert captured == ["ok", None] and called == ["ok", True], (captured, called)


@pytest.mark.leaves_pool_recording
@pytest.mark.parametrize("mode", ["global", "thread_local"])
@pytest.mark.parametrize("how", ["raw", "accelerator"])
def test_a_second_capture_on_the_capturing_stream_is_refused_and_breaks_the_first(acc, mode, how):
    """Beginning a capture on a stream another thread captures on: CUDA fails the begin and the capture under way.
    The capturer here bypasses graph_capture_lock() (a raw capture): through the lock the second would wait."""
    s = acc.Stream()

    def second():
        g = acc.create_graph()
        if how == "raw":
            with cpu_stream(s), capture_cpu_graph(g):
                torch.ones(2) + 1
        else:
            with acc.capture_to_graph(g, stream=s):
                torch.ones(2) + 1

    captured, called = capture_while(acc, mode, second, raw=True, stream=s)
    assert called[0] == "raised" and isinstance(called[1], GraphCaptureError), called
    assert "which thread 'capturer' is capturing on" in str(called[1])
    assert captured[0] == "raised" and "invalidated by thread 'reader'" in str(captured[1]), captured


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_a_second_capture_on_another_stream_is_refused_and_leaves_the_first_intact(acc, mode):
    """PyTorch's one capture at a time per process; beginning one on a stream of one's own touches nothing of the
    capture under way, so that one goes on."""

    def second():
        with cpu_stream(acc.Stream()), capture_cpu_graph(CPUGraph()):
            torch.ones(2) + 1

    captured, called = capture_while(acc, mode, second, raw=True)
    assert called[0] == "raised" and "one capture at a time per process" in str(called[1]), called
    assert captured == ["ok", True]


def test_capture_error_modes_are_checked_and_scoped(acc):
    with pytest.raises(ValueError, match="capture_error_mode"):
        with capture_cpu_graph(CPUGraph(), capture_error_mode="local"):
            pass
    with pytest.raises(ValueError, match="capture_error_mode"):
        with cpu_capture_error_mode("strict"):
            pass
    with cpu_capture_error_mode("global"):
        with cpu_capture_error_mode("relaxed"):  # nests, and puts the outer mode back
            # The mode is this thread's: a capture another thread begins keeps the default (thread_local).
            helper, seen = in_thread(lambda: capture_while(acc, None, HOST_READS["item"]), "helper")
            helper.join(JOIN_S)
        assert seen == ["ok", (["ok", True], ["ok", 10.0])], seen
        g = acc.create_graph()
        with pytest.raises(GraphCaptureError, match="invalidated by thread 'reader'"), torch.no_grad(), \
                acc.capture_to_graph(g):
            torch.ones(1) + 1
            reader, called = in_thread(lambda: torch.ones(1).item(), "reader")
            reader.join(JOIN_S)
        assert refused_in_global_mode(called), called
    assert unpatched()


@pytest.mark.parametrize("mode", ["global", "thread_local"])
@pytest.mark.parametrize("wait", ["synchronize", "query"])
def test_waiting_on_an_event_recorded_inside_another_threads_capture_is_refused_in_every_mode(acc, mode, wait):
    """cudaEventSynchronize/cudaEventQuery on an event recorded inside a capture conflict with it in every mode
    (CUDA's own example of a call even relaxed mode refuses)."""
    ev = acc.Event()
    captured, called = capture_while(acc, mode, getattr(ev, wait), first=lambda: ev.record())
    assert called[0] == "raised" and f"event.{wait}() on an event recorded inside the capture" in str(called[1])
    assert captured[0] == "raised" and "invalidated by thread 'reader'" in str(captured[1]), captured
    assert getattr(ev, wait)() in (None, True)  # the capture is over: nothing to wait for


# ----------------------------------------------------------------- the engine falls back cleanly
def test_a_capture_another_thread_breaks_falls_back_to_eager_with_the_same_tokens(monkeypatch):
    """engine.generate with graphs, its captures in global mode: while the first capture is under way (the
    model's lm_head signals it and waits), a data-loader thread reads a value and synchronizes. Its read is
    refused, its synchronize() waits for the capture; the engine's call counts one fallback, releases the failed
    capture's pool and returns the eager tokens; the next call captures and replays."""
    model = build_model("tiny-llama", seed=7)
    graph, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    eager, *_ = initialize(model=model, config={})
    ids, mask = prompts(3, 5, seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
    want = eager.generate(**kw)

    acc = get_accelerator()
    pools = []
    real_handle = acc.graph_pool_handle
    monkeypatch.setattr(acc, "graph_pool_handle", lambda: pools.append(real_handle()) or pools[-1])

    inside, read_done = threading.Event(), threading.Event()
    fired = []
    real_forward = model.lm_head.forward

    def forward(x):
        if is_cpu_graph_capturing() and not fired:  # the first capture only
            fired.append(True)
            inside.set()
            assert read_done.wait(JOIN_S)
        return real_forward(x)

    monkeypatch.setattr(model.lm_head, "forward", forward)
    loader_seen = {}
    batch = torch.arange(6.0)

    def data_loader():
        assert inside.wait(JOIN_S)
        try:
            with pytest.raises(GraphCaptureError, match=GLOBAL_REFUSAL):
                batch.sum().item()
        finally:
            read_done.set()
        acc.synchronize()  # waits for graph_capture_lock(): the capture has ended by the time it runs
        loader_seen["sum"] = batch.sum().item()

    loader, outcome = in_thread(data_loader, "loader")
    with cpu_capture_error_mode("global"), pytest.warns(GraphRefusedWarning, match="invalidated by thread 'loader'"):
        got = graph.generate(**kw)
    loader.join(JOIN_S)
    assert not loader.is_alive() and outcome == ["ok", None], outcome
    assert loader_seen == {"sum": 15.0} and fired == [True]
    assert torch.equal(got, want)
    s = graph.graph_stats
    assert s.fallbacks == 1 and s.captures == 0 and s.replays == 0, s
    assert "loader" in s.last_refusal_reason
    assert recording_pools() == [] and unpatched()
    assert len(pools) == 1 and not pools[0].recording and acc.graph_memory_bytes(pools[0]) == 0
    acc.empty_cache()  # raises while a failed capture's pool still records

    with cpu_capture_error_mode("global"):
        again = graph.generate(**kw)  # no other thread now: captures and replays
        third = graph.generate(**kw)
    assert torch.equal(again, want) and torch.equal(third, want)
    s2 = graph.graph_stats
    assert s2.fallbacks == 1 and s2.captures >= 1 and s2.replays > 0, s2
    assert len(pools) == 2 and acc.graph_memory_bytes(pools[1]) > 0
