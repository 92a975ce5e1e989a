"""The accelerator interface every backend implements.

Graph code in this package never asks *which* device it runs on. It asks the
accelerator whether it can capture (``create_graph() is not None``) and then
drives capture and replay only through the four capability hooks below. A
backend that cannot capture returns ``None`` from ``create_graph``; it must
never hand out a graph whose replay silently does nothing, because the caller
would then re-read stale static outputs as if they were fresh.

Streams follow DeepSpeed's accelerator interface. CUDA refuses to capture on
the default stream, so every accelerator owns one side stream
(``graph_stream()``): ``capture_to_graph(stream=None)`` captures on it and
``on_graph_stream()`` runs the eager warm-up on it, with the cross-stream waits
that keep it ordered against the caller's stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ContextManager

import torch


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
        """The side stream this accelerator owns for warm-up and capture on the current device (created on
        first use; one per device, since a stream belongs to the device it was made on).

        ``None`` on backends without streams.
        """
        streams = self.__dict__.setdefault("_owned_graph_streams", {})
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

    def on_graph_stream(self) -> ContextManager[Any]:
        """Run the block on ``graph_stream()``, ordered after and before the caller's stream."""
        return self._ordered_on(self.graph_stream())

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

        ``pool`` is a handle from ``graph_pool`` to share memory with earlier
        graphs. ``stream=None`` captures on ``graph_stream()``; passing the
        default stream fails, as CUDA refuses capture there.
        """
        raise RuntimeError(f"{self.device_name()}: graph capture is not supported ({self.graph_unavailable_reason})")
        yield  # pragma: no cover

    def replay_graph(self, graph: Any) -> None:
        raise RuntimeError(f"{self.device_name()}: graph replay is not supported")

    def graph_pool(self, graph: Any) -> Any | None:
        """A handle that lets a later capture share ``graph``'s memory pool."""
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
