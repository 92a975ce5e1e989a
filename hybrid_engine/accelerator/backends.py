"""Concrete accelerators and graph-API discovery by capability.

Which graph API a backend uses is found by probing what exists, never by
comparing device names: ``torch.accelerator.Graph`` when the current backend
registers an implementation (constructing one is the probe), else the backend
module's own graph class (``CUDAGraph``/``NPUGraph``/``XPUGraph`` with its
``graph`` capture context). A backend with neither reports ``create_graph() is
None`` and graph code runs eagerly.

Captures use ``capture_error_mode="thread_local"`` where the API takes it
(:data:`CAPTURE_ERROR_MODE`), the per-thread rule the CPU emulation keeps.

Capture always happens on a non-default stream, because CUDA refuses to
capture on the default one: ``capture_to_graph(stream=None)`` resolves to the
accelerator's ``graph_stream()`` (this thread's) on every path, and the
accelerator makes the stream current before ``capture_begin``, which captures
on the current stream. Native graph classes are driven with
``capture_begin(pool, capture_error_mode=...)`` and ``capture_end()`` directly,
not through ``torch.cuda.graph``'s context, whose ``__enter__`` synchronizes the
device and empties the allocator's cache at every capture (dropping the cached
blocks training needs again, once per bucket that ``capture_buckets`` captures).

A failed capture is cleaned up by :meth:`TorchBackendAccelerator._release_failed_capture`
with the private allocator bindings the installed torch offers
(``torch._C._cuda_endAllocateToPool`` or, before torch 2.8,
``_cuda_endAllocateCurrentStreamToPool``, and ``_cuda_releasePool``); the
order covers torch versions whose ``capture_end`` leaves the pool recording and
those whose ``reset()`` releases a failed capture's pool itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from hybrid_engine.accelerator.base import Accelerator, graph_capture_lock
from hybrid_engine.accelerator.cpu_graph import (
    CPUEvent,
    CPUGraph,
    CPUGraphPool,
    CPUStream,
    capture_cpu_graph,
    check_empty_cache,
    cpu_stream,
    current_cpu_stream,
    default_cpu_stream,
    end_allocating_to_pool,
    is_cpu_graph_capturing,
    refuse_while_capturing,
    release_graph_pool,
    synchronize_device,
)

logger = logging.getLogger(__name__)

# Backend-module attribute names of native graph classes; probed with hasattr.
_NATIVE_GRAPH_CLASSES = ("CUDAGraph", "NPUGraph", "XPUGraph")


@dataclass(frozen=True)
class GraphAPI:
    """How one backend captures and replays: the four hooks, as callables."""

    name: str
    new_graph: Callable[[], Any]
    #: ``capture(graph, pool, stream)``; ``stream`` is already resolved and current.
    capture: Callable[[Any, Any, Any], ContextManager[Any]]
    replay: Callable[[Any], None]
    pool_of: Callable[[Any], Any]
    is_capturing: Callable[[], bool] | None


_capture_flag = threading.local()

#: Captures forbid unsafe calls (syncs, allocations outside the pool) in the capturing thread only, as
#: torch.compile's CUDA graph trees capture: another thread's engine or training on the same device
#: neither fails nor breaks this capture (under "global" its next host read would do both). Requested where
#: the API takes a mode: torch.xpu.graph takes none, and XPU's torch.accelerator.Graph falls back to its default.
CAPTURE_ERROR_MODE = "thread_local"


def _takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` accepts keyword ``name`` (False when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@contextlib.contextmanager
def _flag_capturing() -> Iterator[None]:
    """Track capture ourselves for APIs without ``is_current_stream_capturing``."""
    prev = getattr(_capture_flag, "on", False)
    _capture_flag.on = True
    try:
        yield
    finally:
        _capture_flag.on = prev


def _end_failed_capture(end: Callable[[], Any]) -> None:
    """End a capture whose body raised, keeping the body's exception as the one that propagates.

    On CUDA, work the body could not record (a host read in a hook, say)
    invalidates the capture, and ending it then raises too ("operation failed due
    to a previous error during capture"); raised while unwinding, that error
    would replace the cause the runner reports and acts on.
    """
    try:
        end()
    except Exception:
        pass


@contextlib.contextmanager
def _between_begin_and_end(graph: Any) -> Iterator[None]:
    """The body of a capture the caller has begun: ``graph.capture_end()`` after it, or, when it raises,
    :func:`_end_failed_capture` and the body's exception."""
    try:
        yield
    except BaseException:
        _end_failed_capture(graph.capture_end)
        raise
    graph.capture_end()


_said_at_capture: set[str] = set()


def _begin_quietly(graph: Any, backend_name: str) -> None:
    """``graph.capture_begin()``, with what it warns said once, in the log: XPU's implementation warns at every
    capture that it falls back from the requested (thread-local) error mode to its default, which would be a
    warning per capture, and under ``-W error`` a failed capture each time."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph.capture_begin()
    for w in caught:
        text = f"{backend_name}: {w.message}"
        if text not in _said_at_capture:
            _said_at_capture.add(text)
            logger.info("Graph capture on %s", text)


def _probe_accelerator_graph(backend_name: str, synchronize: Callable[[], Any]) -> GraphAPI | None:
    """``torch.accelerator.Graph`` if the current backend implements it."""
    graph_cls = getattr(getattr(torch, "accelerator", None), "Graph", None)
    if graph_cls is None:
        return None
    try:
        current = torch.accelerator.current_accelerator()
        if current is None or current.type != backend_name:
            return None
        graph_cls()  # raises when the backend registers no implementation
    except Exception:
        return None

    @contextlib.contextmanager
    def capture(graph: Any, pool: Any, stream: Any) -> Iterator[None]:
        # capture_begin captures on the current stream: the accelerator has made ``stream`` current.
        if pool is not None:
            graph.graph_pool = pool
        if hasattr(graph, "capture_error_mode"):
            graph.capture_error_mode = CAPTURE_ERROR_MODE
        synchronize()  # as torch.cuda.graph does: no pending work may leak into the capture
        with _flag_capturing():
            _begin_quietly(graph, backend_name)
            with _between_begin_and_end(graph):
                yield

    return GraphAPI(
        name="torch.accelerator.Graph",
        new_graph=graph_cls,
        capture=capture,
        replay=lambda g: g.replay(),
        pool_of=lambda g: g.pool(),
        is_capturing=None,
    )


def _probe_module_graph(module: Any, module_label: str) -> GraphAPI | None:
    """The backend module's own graph class, e.g. ``torch.cuda.CUDAGraph``."""
    if module is None:
        return None
    for cls_name in _NATIVE_GRAPH_CLASSES:
        graph_cls = getattr(module, cls_name, None)
        graph_ctx = getattr(module, "graph", None)
        if graph_cls is not None and callable(graph_ctx):
            break
    else:
        return None

    begin = getattr(graph_cls, "capture_begin", None)
    direct = callable(begin) and callable(getattr(graph_cls, "capture_end", None))
    mode_of = begin if direct else graph_ctx
    mode = {"capture_error_mode": CAPTURE_ERROR_MODE} if _takes(mode_of, "capture_error_mode") else {}

    @contextlib.contextmanager
    def capture(graph: Any, pool: Any, stream: Any) -> Iterator[None]:
        with _flag_capturing():
            if direct and stream is not None:
                # ``stream`` is current (the accelerator made it so): capture_begin captures on it. No device
                # synchronize and no empty_cache per capture, which torch.cuda.graph's __enter__ would add.
                graph.capture_begin(**({"pool": pool} if pool is not None else {}), **mode)
                with _between_begin_and_end(graph):
                    yield
                return
            # No streams to make current (the context's own side stream then applies), or a class without
            # capture_begin/capture_end: the backend's capture context.
            ctx = graph_ctx(graph, pool=pool, stream=stream, **mode)
            ctx.__enter__()
            try:
                yield
            except BaseException as exc:
                _end_failed_capture(functools.partial(ctx.__exit__, type(exc), exc, exc.__traceback__))
                raise
            ctx.__exit__(None, None, None)

    native_capturing = getattr(module, "is_current_stream_capturing", None)
    return GraphAPI(
        name=f"{module_label}.{cls_name}",
        new_graph=graph_cls,
        capture=capture,
        replay=lambda g: g.replay(),
        pool_of=lambda g: g.pool() if hasattr(g, "pool") else None,
        is_capturing=native_capturing if callable(native_capturing) else None,
    )


class TorchBackendAccelerator(Accelerator):
    """An accelerator backed by a torch device module (``torch.cuda``, ``torch.npu``, ...).

    ``module`` is injectable so stub modules can stand in for hardware in tests,
    and so is ``bindings``, where the private allocator functions that clean up
    a failed capture are looked up (``_<name>_endAllocateToPool``,
    ``_<name>_releasePool``; default ``torch._C``).
    """

    def __init__(self, name: str, module: Any, module_label: str | None = None, bindings: Any = None):
        self._name = name
        self._module = module
        self._bindings = torch._C if bindings is None else bindings
        label = module_label or f"torch.{name}"
        api = _probe_accelerator_graph(name, lambda: self._call("synchronize")) or _probe_module_graph(module, label)
        self._graph_api = api
        self.graph_api = api.name if api else None
        self.graph_unavailable_reason = (
            None if api else f"neither torch.accelerator.Graph nor {label} provides a graph class for '{name}'"
        )

    def _call(self, attr: str, *args: Any, default: Any = None) -> Any:
        fn = getattr(self._module, attr, None)
        return fn(*args) if callable(fn) else default

    def device(self) -> torch.device:
        idx = self._call("current_device")
        return torch.device(self._name, idx) if isinstance(idx, int) else torch.device(self._name)

    def is_available(self) -> bool:
        return bool(self._call("is_available", default=False))

    def synchronize(self) -> None:
        with graph_capture_lock():  # never during another thread's capture: it would wait on the capturing stream
            self._call("synchronize")

    def current_device_index(self) -> int | None:
        index = self._call("current_device")
        return index if isinstance(index, int) else None

    def on_device(self, device: torch.device) -> ContextManager[Any]:
        ctx = getattr(self._module, "device", None)  # torch.cuda.device, torch.xpu.device, torch.npu.device
        if device.index is None or not callable(ctx) or device.index == self.current_device_index():
            return contextlib.nullcontext()
        return ctx(device.index)

    def current_stream(self) -> Any:
        return self._call("current_stream")

    def default_stream(self) -> Any:
        return self._call("default_stream")

    def Stream(self) -> Any:  # noqa: N802
        return self._call("Stream")

    def Event(self, enable_timing: bool = False) -> Any | None:  # noqa: N802
        event_cls = getattr(self._module, "Event", None)
        return event_cls(enable_timing=enable_timing) if callable(event_cls) else None

    def stream(self, s: Any) -> ContextManager[Any]:
        ctx = getattr(self._module, "stream", None)
        if callable(ctx):
            return ctx(s)
        if s is not None and callable(getattr(self._module, "set_stream", None)):
            return self._set_stream_ctx(s)
        return contextlib.nullcontext(s)

    @contextlib.contextmanager
    def _set_stream_ctx(self, s: Any) -> Iterator[Any]:
        prev = self.current_stream()
        self._module.set_stream(s)
        try:
            yield s
        finally:
            self._module.set_stream(prev)

    def manual_seed(self, seed: int) -> None:
        with graph_capture_lock():  # CUDA's generator refuses a seed while a capture is under way
            torch.manual_seed(seed)
            self._call("manual_seed_all", seed)

    def empty_cache(self) -> None:
        with graph_capture_lock():  # CUDA's allocator asserts no capture is under way, in any thread
            self._call("empty_cache")

    def memory_allocated(self) -> int:
        return int(self._call("memory_allocated", default=0) or 0)

    def max_memory_allocated(self) -> int:
        return int(self._call("max_memory_allocated", default=0) or 0)

    def memory_reserved(self) -> int:
        return int(self._call("memory_reserved", default=0) or 0)

    def reset_peak_memory_stats(self) -> None:
        self._call("reset_peak_memory_stats")

    # graph hooks ---------------------------------------------------------
    def create_graph(self) -> Any | None:
        return self._graph_api.new_graph() if self._graph_api else None

    @contextlib.contextmanager
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Iterator[None]:
        if self._graph_api is None:
            raise RuntimeError(f"{self._name}: graph capture unavailable ({self.graph_unavailable_reason})")
        with graph_capture_lock():
            s = self.graph_stream() if stream is None else stream
            if pool is None:  # a handle this call holds: graph.pool() raises after a failed capture
                pool = self.graph_pool_handle()
            device = self.current_device_index()
            try:
                with self._ordered_on(s), self._graph_api.capture(graph, pool, s):
                    yield
            except BaseException:
                self._release_failed_capture(graph, pool, device)
                raise

    def graph_pool_handle(self) -> Any | None:
        handle = getattr(self._module, "graph_pool_handle", None)  # torch.cuda.graph_pool_handle
        return handle() if callable(handle) else None

    def _allocator_binding(self, *names: str) -> Callable[..., Any] | None:
        for name in names:
            fn = getattr(self._bindings, f"_{self._name}_{name}", None)
            if callable(fn):
                return fn
        return None

    def _release_failed_capture(self, graph: Any, pool: Any, device: int | None) -> bool:
        """Leave the allocator as before a capture that failed; ``False`` where this torch offers no way.

        CUDA's ``capture_end`` ends allocating to the pool only after ``cudaStreamEndCapture`` succeeded, and only
        an ended capture releases its pool (torch before pytorch#180395): a failed one leaves the allocator
        "recording" for the rest of the process. Later versions end it in ``capture_end`` and release it in
        ``reset()``. So: ``reset()`` first (it releases whatever the graph holds, on every version), then end the
        allocation; if that succeeds, the capture never got to end it, nothing released its pool either, and it
        is released here, exactly once. Errors are logged, never raised: the capture's own error propagates.
        """
        end = self._allocator_binding("endAllocateToPool", "endAllocateCurrentStreamToPool")
        release = self._allocator_binding("releasePool")
        if pool is None or end is None or release is None:
            logger.debug("No allocator cleanup for a failed %s capture (pool %r, bindings %s)", self._name, pool,
                         "found" if end and release else "missing")
            return False
        index = 0 if device is None else device
        try:
            reset = getattr(graph, "reset", None)
            if callable(reset):
                reset()
        except Exception:  # a graph left in an odd state by the failure: the allocator is what matters here
            logger.debug("reset() of a failed %s capture raised", self._name, exc_info=True)
        try:
            end(index, pool)
        except Exception:  # "not currently recording": the capture (or reset) ended it
            return True
        try:
            release(index, pool)
        except Exception:
            logger.warning("Releasing the pool of a failed %s graph capture failed; its memory stays reserved",
                           self._name, exc_info=True)
            return False
        return True

    def replay_graph(self, graph: Any) -> None:
        if self._graph_api is None:
            raise RuntimeError(f"{self._name}: graph replay unavailable")
        self._graph_api.replay(graph)

    def graph_pool(self, graph: Any) -> Any | None:
        return self._graph_api.pool_of(graph) if self._graph_api else None

    def graph_memory_bytes(self, pool: Any) -> int | None:
        """The segments the allocator holds for ``pool`` (``torch.cuda.memory_snapshot(mempool_id=...)``):
        not a difference of reserved memory, which capture itself changes (``torch.cuda.graph`` empties the
        cache first). ``None`` where the module cannot say."""
        snapshot = getattr(self._module, "memory_snapshot", None)
        if not isinstance(pool, tuple) or not callable(snapshot) or not _takes(snapshot, "mempool_id"):
            return None
        extra = {"include_traces": False} if _takes(snapshot, "include_traces") else {}
        try:
            segments = snapshot(mempool_id=pool, **extra)
        except Exception:  # an older or partial implementation: the runner falls back to reserved memory
            return None
        return sum(int(seg.get("total_size", 0)) for seg in segments)

    def is_current_stream_capturing(self) -> bool:
        api = self._graph_api
        if api is None:
            return False
        if api.is_capturing is not None:
            return bool(api.is_capturing())
        return bool(getattr(_capture_flag, "on", False))


class CPUAccelerator(Accelerator):
    """The host CPU, with graph capture provided by :mod:`.cpu_graph` emulation.

    ``emulate_graphs=False`` gives a CPU that cannot capture (like MPS), which is
    how the eager-fallback paths are exercised without special-casing devices.
    Streams (:class:`CPUStream`) exist either way.
    """

    _name = "cpu"

    def __init__(self, emulate_graphs: bool = True):
        self._emulate = emulate_graphs
        self.graph_api = "hybrid_engine CPU graph emulation" if emulate_graphs else None
        self.graph_unavailable_reason = None if emulate_graphs else "CPU graph emulation is disabled"

    def synchronize(self) -> None:
        """Nothing to wait for on CPU; waits for another thread's capture, and is refused inside one's own (or
        during a capture that bypassed the lock), as a device synchronisation is."""
        with graph_capture_lock():
            synchronize_device()

    # streams -------------------------------------------------------------
    def Stream(self) -> CPUStream:  # noqa: N802
        return CPUStream()

    def current_stream(self) -> CPUStream:
        return current_cpu_stream()

    def default_stream(self) -> CPUStream:
        return default_cpu_stream()

    def stream(self, s: CPUStream | None) -> ContextManager[CPUStream | None]:
        return cpu_stream(s)

    def graph_stream(self) -> CPUStream:
        return super().graph_stream()

    def Event(self, enable_timing: bool = False) -> CPUEvent | None:  # noqa: N802
        """A :class:`CPUEvent` for ordering and host waits (refused while capturing, as on CUDA). No timing
        events: the CPU has no device clock, so ``enable_timing=True`` gives ``None`` and callers time on the host
        (``PhaseTimer`` does)."""
        return None if enable_timing else CPUEvent()

    # refused while capturing, as CUDA refuses them -----------------------
    def manual_seed(self, seed: int) -> None:
        with graph_capture_lock():
            refuse_while_capturing(
                "seeding (accelerator.manual_seed)",
                "CUDA's generator asserts it is not capturing when seeded; seed before capture",
            )
            super().manual_seed(seed)

    def empty_cache(self) -> None:
        """Refused inside a capture, during another thread's capture that bypassed the lock, and while a failed
        capture's pool still records, where CUDA's allocator asserts or frees nothing."""
        with graph_capture_lock():
            check_empty_cache()
            super().empty_cache()

    # graph hooks ---------------------------------------------------------
    def create_graph(self) -> CPUGraph | None:
        return CPUGraph() if self._emulate else None

    @contextlib.contextmanager
    def capture_to_graph(
        self, graph: Any, pool: CPUGraphPool | None = None, stream: CPUStream | None = None
    ) -> Iterator[None]:
        if not isinstance(graph, CPUGraph):
            raise TypeError(f"capture_to_graph: expected a CPUGraph from create_graph(), got {type(graph).__name__}")
        s = self.graph_stream() if stream is None else stream
        if not isinstance(s, CPUStream):
            raise TypeError(f"capture_to_graph: expected a CPUStream, got {type(s).__name__}")
        if pool is not None and not isinstance(pool, CPUGraphPool):
            raise TypeError(f"capture_to_graph: pool must be a CPUGraphPool from graph_pool() or "
                            f"graph_pool_handle(), got {type(pool).__name__}")
        pool = CPUGraphPool() if pool is None else pool  # a handle this call holds, to release on failure
        with graph_capture_lock():
            try:
                with self._ordered_on(s), capture_cpu_graph(graph, pool=pool):
                    yield
            except BaseException:
                # As the CUDA path: a failed capture's pool is ended and released, so nothing stays recording.
                if pool.recording and not pool._capturing:
                    end_allocating_to_pool(pool)
                if pool._failed:
                    release_graph_pool(pool)
                raise

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def graph_pool(self, graph: Any) -> CPUGraphPool | None:
        return graph.pool() if isinstance(graph, CPUGraph) else None

    def graph_pool_handle(self) -> CPUGraphPool | None:
        return CPUGraphPool() if self._emulate else None

    def graph_memory_bytes(self, pool: Any) -> int | None:
        if pool is None:
            return None
        if not isinstance(pool, CPUGraphPool):
            raise TypeError(f"graph_memory_bytes: expected a CPUGraphPool from graph_pool(), got {type(pool).__name__}")
        return pool.memory_bytes()

    def is_current_stream_capturing(self) -> bool:
        return is_cpu_graph_capturing()
