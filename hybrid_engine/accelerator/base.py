"""The accelerator interface every backend implements.

Graph code in this package never asks *which* device it runs on. It asks the
accelerator whether it can capture (``create_graph() is not None``) and then
drives capture and replay only through the four capability hooks below. A
backend that cannot capture returns ``None`` from ``create_graph``; it must
never hand out a graph whose replay silently does nothing, because the caller
would then re-read stale static outputs as if they were fresh.
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

    def Stream(self) -> Any:
        return None

    def stream(self, s: Any) -> ContextManager[Any]:
        return contextlib.nullcontext(s)

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

    def reset_peak_memory_stats(self) -> None:
        return None

    # ------------------------------------------------------------ graph hooks
    def create_graph(self) -> Any | None:
        """A fresh graph object, or ``None`` when this backend cannot capture."""
        return None

    @contextlib.contextmanager
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Iterator[None]:
        """Record the work issued inside the ``with`` block into ``graph``."""
        raise RuntimeError(f"{self.device_name()}: graph capture is not supported ({self.graph_unavailable_reason})")
        yield  # pragma: no cover

    def replay_graph(self, graph: Any) -> None:
        raise RuntimeError(f"{self.device_name()}: graph replay is not supported")

    def graph_pool(self, graph: Any) -> Any | None:
        """A handle that lets a later capture share ``graph``'s memory pool."""
        return None

    def is_current_stream_capturing(self) -> bool:
        return False

    @property
    def supports_graph_capture(self) -> bool:
        return self.create_graph() is not None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device={self.device_name()} graph_api={self.graph_api}>"
