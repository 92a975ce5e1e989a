"""Phase timing that does not add host synchronisations where the device can time itself.

Where the accelerator has timing events, each phase records a start and an end
event on the current stream and nothing waits until :meth:`PhaseTimer.totals_ms`
is read (one synchronisation for the whole call). Elsewhere (the CPU) a phase is
timed on the host between two ``synchronize()`` calls.

Both run on the model's device (``device``), made current for the event records
and the synchronisations: on a model on ``cuda:1`` while ``cuda:0`` is current,
events on the current device's stream would time the wrong device's work.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, ContextManager

import torch

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Accumulates wall time per named phase (milliseconds), on ``device`` (``None``: the current device)."""

    def __init__(self, accelerator: Any, device: torch.device | None = None):
        self._acc = accelerator
        self._device = device
        self.uses_events = accelerator.Event(enable_timing=True) is not None
        self._pending: list[tuple[str, Any, Any]] = []
        self._totals: dict[str, float] = defaultdict(float)

    def _on_device(self) -> ContextManager[Any]:
        return self._acc.on_device(self._device) if self._device is not None else contextlib.nullcontext()

    def _synchronize(self) -> None:
        with self._on_device():
            self._acc.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.uses_events:
            start, end = self._acc.Event(enable_timing=True), self._acc.Event(enable_timing=True)
            with self._on_device():  # recorded on the model's device's current stream
                start.record()
            try:
                yield
            finally:
                with self._on_device():
                    end.record()
                self._pending.append((name, start, end))
            return
        self._synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self._totals[name] += (time.perf_counter() - t0) * 1e3

    def totals_ms(self) -> dict[str, float]:
        """Per-phase totals; waits once for the events still in flight."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for name, start, end in self._pending:
                self._totals[name] += float(start.elapsed_time(end))
            self._pending.clear()
        return dict(self._totals)
