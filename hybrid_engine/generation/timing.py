"""Phase timing that does not add host synchronisations where the device can time itself, and the host's time
around its reads of the device.

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

__all__ = ["HostSplit", "PhaseTimer"]


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


class HostSplit:
    """Host time around a call's reads of the device (``last_stats["host_ms_overlapped"]`` and
    ``["host_ms_after_sync"]``), on the host clock.

    * ``overlapped_ms``: planning done after a run of steps was launched and before the host waited for its
      read (:meth:`overlapped`): the device was busy meanwhile (on an accelerator; the CPU runs its steps
      before the host gets here, so there it only says what moved);
    * ``after_sync_ms``: from the end of each wait (:meth:`synced`) to the launch of the next run of steps, or
      the call's end (:meth:`launched`): host work the device waits for. Admission rounds inside it
      (:meth:`excluded`) are device work of their own, timed as the prefill phase, and left out.
    """

    def __init__(self) -> None:
        self.overlapped_ms = 0.0
        self.after_sync_ms = 0.0
        self._since: float | None = None

    @contextlib.contextmanager
    def overlapped(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.overlapped_ms += (time.perf_counter() - t0) * 1e3

    def synced(self) -> None:
        """A wait for a read just ended."""
        self._since = time.perf_counter()

    def launched(self) -> None:
        """A run of steps is being launched (or the call ends): the host time since the last wait counts."""
        if self._since is not None:
            self.after_sync_ms += (time.perf_counter() - self._since) * 1e3
            self._since = None

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._since is not None:
                self._since += time.perf_counter() - t0
