"""The accelerator interface every backend implements.

Graph code in this package never asks *which* device it runs on. It asks the
accelerator whether it can capture (``create_graph() is not None``) and then
drives capture and replay only through the four capability hooks below. A
backend that cannot capture returns ``None`` from ``create_graph``; it must
never hand out a graph whose replay silently does nothing, because the caller
would then re-read stale static outputs as if they were fresh.

Streams follow DeepSpeed's accelerator interface. CUDA refuses to capture on
the default stream, so every accelerator hands out side streams
(``graph_stream()``, one per thread and device): ``capture_to_graph(stream=None)``
captures on it and ``on_graph_stream()`` runs the eager warm-up on it, with the
cross-stream waits that keep it ordered against the caller's stream.

One capture at a time per process (PyTorch's rule for CUDA graphs). Capture
belongs to a stream, not a thread: work another thread issues on a capturing
stream is recorded into that graph, and a wait across it breaks the capture.
So captures run under one process-wide lock, :func:`graph_capture_lock` (a
re-entrant lock: ``capture_to_graph`` takes it, and the decode runner holds it
around each warm-up and capture), and the device-wide calls that CUDA refuses
or that would wait on a capturing stream (``synchronize``, ``empty_cache``,
``manual_seed``) wait for it instead of running during another thread's
capture. Each thread also warms up and captures on a stream of its own, so no
two threads share a capture stream.

A capture that fails must leave the allocator as it found it: CUDA's
``capture_end`` throws before it ends allocating to the graph's pool when
``cudaStreamEndCapture`` fails, and the allocator then believes a capture is
under way for the rest of the process. ``capture_to_graph`` therefore always
captures into a known pool (``graph_pool_handle()`` when the caller passes
none), and ends and releases it when the capture fails, with what the backend
offers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, ContextManager

import torch

__all__ = ["Accelerator", "graph_capture_lock"]

# Re-entrant: the thread that holds it for a capture may synchronize (which the emulation then refuses, as CUDA
# does) without deadlocking, and the runner's hold around a warm-up and capture nests capture_to_graph's own.
_CAPTURE_LOCK = threading.RLock()


def graph_capture_lock() -> ContextManager[Any]:
    """The process-wide lock that warm-ups and captures hold, and device-wide waits take: one capture at a time
    per process, and no ``synchronize``/``empty_cache`` from another thread while one runs."""
    return _CAPTURE_LOCK


class Accelerator:
    """Device-agnostic facade over one torch backend.

    Subclasses set ``_name`` and, where the backend can capture, override the
    graph hooks. Memory counters return 0 where a backend has none.
    """

    _name: str = "cpu"
    #: Human-readable name of the graph API in use, or ``None``.
    graph_api: str | None = None
    #: Why graph capture is unavailable, or ``None`` when it is available.
    graph_unavailable_reason: str | None = "this backend has no graph capture API"

    # ------------------------------------------------------------------ device
    def device_name(self, index: int | None = None) -> str:
        return self._name if index is None else f"{self._name}:{index}"

    def device(self) -> torch.device:
        return torch.device(self._name)

    def is_available(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def current_stream(self) -> Any:
        return None

    def default_stream(self) -> Any:
        """The backend's default stream, or ``None`` where it has no streams."""
        return None

    def Stream(self) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        return None

    def stream(self, s: Any) -> ContextManager[Any]:
        """Make ``s`` the current stream for the ``with`` block."""
        return contextlib.nullcontext(s)

    def graph_stream(self) -> Any:
        """A side stream this accelerator owns for warm-up and capture: one per thread and device (created on
        first use), since a stream belongs to the device it was made on, and a capturing stream to the thread
        capturing on it.

        ``None`` on backends without streams.
        """
        local = self.__dict__.setdefault("_owned_graph_streams", threading.local())
        streams = local.__dict__.setdefault("by_device", {})
        key = self.current_device_index()
        s = streams.get(key)
        if s is None:
            s = streams[key] = self.Stream()
        return s

    def current_device_index(self) -> int | None:
        """The index of the backend's current device (``None`` where devices have no index)."""
        return None

    def on_device(self, device: torch.device) -> ContextManager[Any]:
        """Make ``device`` the backend's current device for the block (as ``torch.cuda.device``): streams,
        warm-ups, captures and replays must all be on the device of the tensors they touch."""
        return contextlib.nullcontext()

    def on_graph_stream(self, stream: Any = None) -> ContextManager[Any]:
        """Run the block on ``stream`` (``None``: ``graph_stream()``), ordered after and before the caller's
        stream."""
        return self._ordered_on(self.graph_stream() if stream is None else stream)

    @contextlib.contextmanager
    def _ordered_on(self, s: Any) -> Iterator[Any]:
        """Make ``s`` wait on the current stream, run the block on ``s``, then the reverse wait."""
        if s is None:
            yield None
            return
        prev = self.current_stream()
        same = prev is None or prev == s
        if not same:
            s.wait_stream(prev)
        try:
            with self.stream(s):
                yield s
        finally:
            if not same:
                prev.wait_stream(s)

    def Event(self, enable_timing: bool = False) -> Any | None:  # noqa: N802 - mirrors torch.cuda.Event
        """A device event (``record()``, ``synchronize()``, ``elapsed_time()``), or ``None`` where the backend has none."""
        return None

    def manual_seed(self, seed: int) -> None:
        with _CAPTURE_LOCK:  # CUDA's generator refuses a seed while a capture is under way
            torch.manual_seed(seed)

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        """Bytes the backend's caching allocator holds from the device (graph pools included), or 0."""
        return 0

    def reset_peak_memory_stats(self) -> None:
        return None

    # ------------------------------------------------------------ graph hooks
    def create_graph(self) -> Any | None:
        """A fresh graph object, or ``None`` when this backend cannot capture."""
        return None

    @contextlib.contextmanager
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Iterator[None]:
        """Record the work issued inside the ``with`` block into ``graph``.

        ``pool`` is a handle from ``graph_pool_handle`` or ``graph_pool`` to share
        memory with earlier graphs. ``stream=None`` captures on ``graph_stream()``;
        passing the default stream fails, as CUDA refuses capture there. Holds
        :func:`graph_capture_lock` for the capture. When the capture fails, its
        pool is ended and released before the error propagates.
        """
        raise RuntimeError(f"{self.device_name()}: graph capture is not supported ({self.graph_unavailable_reason})")
        yield  # pragma: no cover

    def replay_graph(self, graph: Any) -> None:
        raise RuntimeError(f"{self.device_name()}: graph replay is not supported")

    def graph_pool(self, graph: Any) -> Any | None:
        """A handle that lets a later capture share ``graph``'s memory pool (``graph`` must have been captured:
        CUDA's ``pool()`` raises after a failed capture)."""
        return None

    def graph_pool_handle(self) -> Any | None:
        """A fresh memory-pool handle to capture into (``torch.cuda.graph_pool_handle()``), or ``None`` where the
        backend has none. Capturing into a handle the caller holds is what lets a failed capture's pool be
        ended and released."""
        return None

    def graph_memory_bytes(self, pool: Any) -> int | None:
        """Bytes the graph memory pool ``pool`` holds, or ``None`` where the backend cannot tell.

        On ``None`` callers fall back to ``memory_reserved()`` deltas around capture.
        """
        return None

    def is_current_stream_capturing(self) -> bool:
        return False

    @property
    def supports_graph_capture(self) -> bool:
        try:
            return self.create_graph() is not None
        except Exception as exc:  # e.g. torch.cuda.CUDAGraph of a CPU-only torch build: a dummy class
            self.graph_unavailable_reason = f"creating a graph failed ({type(exc).__name__}: {exc})"
            return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device={self.device_name()} graph_api={self.graph_api}>"
