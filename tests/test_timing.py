"""PhaseTimer: host timers around synchronize() on CPU; device events where the backend has them.

The event test is a stub test: a stub accelerator stands in for a backend with timing events
(no such hardware here). It checks that no synchronisation happens per phase and that the
events' elapsed times are what gets summed.
"""

import time

import pytest

from hybrid_engine.accelerator import CPUAccelerator
from hybrid_engine.generation.timing import PhaseTimer


def test_host_timing_on_cpu():
    timer = PhaseTimer(CPUAccelerator())
    assert not timer.uses_events
    with timer.phase("decode"):
        time.sleep(0.02)
    with timer.phase("decode"):
        time.sleep(0.01)
    with timer.phase("prefill"):
        pass
    totals = timer.totals_ms()
    assert totals["decode"] >= 30.0
    assert 0.0 <= totals["prefill"] < totals["decode"]


class _StubEvent:
    def __init__(self, log, clock):
        self.log, self.clock, self.t = log, clock, None

    def record(self):
        self.t = self.clock[0]
        self.log.append("record")

    def synchronize(self):
        self.log.append("event-sync")

    def elapsed_time(self, end):
        return end.t - self.t


class _StubEventAccelerator(CPUAccelerator):
    def __init__(self):
        super().__init__()
        self.log, self.clock = [], [0.0]

    def Event(self, enable_timing=False):  # noqa: N802
        return _StubEvent(self.log, self.clock)

    def synchronize(self):
        self.log.append("device-sync")


@pytest.mark.stub
def test_event_timing_defers_synchronisation_to_the_read():
    acc = _StubEventAccelerator()
    timer = PhaseTimer(acc)
    assert timer.uses_events
    for ms in (5.0, 7.0):
        with timer.phase("decode"):
            acc.clock[0] += ms
    assert "device-sync" not in acc.log and "event-sync" not in acc.log
    assert timer.totals_ms() == {"decode": 12.0}
    assert acc.log.count("event-sync") == 1
