"""PhaseTimer: host timers around synchronize() on CPU; device events where the backend has them.

The event test is a stub test: a stub accelerator stands in for a backend with timing events
(no such hardware here). It checks that no synchronisation happens per phase and that the
events' elapsed times are what gets summed.
"""

import contextlib
import time

import pytest
import torch

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
    def __init__(self, log, clock, device):
        self.log, self.clock, self.t, self.device = log, clock, None, device

    def record(self):
        self.t = self.clock[0]
        self.log.append(("record", self.device[0]))

    def synchronize(self):
        self.log.append("event-sync")

    def elapsed_time(self, end):
        return end.t - self.t


class _StubEventAccelerator(CPUAccelerator):
    """Events (or, with ``events=False``, none) on a backend whose current device is ``cuda:0``."""

    def __init__(self, events=True):
        super().__init__()
        self.log, self.clock, self.device, self.events = [], [0.0], [0], events

    def Event(self, enable_timing=False):  # noqa: N802
        return _StubEvent(self.log, self.clock, self.device) if self.events else None

    @contextlib.contextmanager
    def on_device(self, device):
        prev, self.device[0] = self.device[0], device.index
        try:
            yield
        finally:
            self.device[0] = prev

    def synchronize(self):
        self.log.append(("device-sync", self.device[0]))


@pytest.mark.stub
def test_event_timing_defers_synchronisation_to_the_read():
    acc = _StubEventAccelerator()
    timer = PhaseTimer(acc)
    assert timer.uses_events
    for ms in (5.0, 7.0):
        with timer.phase("decode"):
            acc.clock[0] += ms
    assert all(e[0] == "record" for e in acc.log) and "event-sync" not in acc.log
    assert timer.totals_ms() == {"decode": 12.0}
    assert acc.log.count("event-sync") == 1


@pytest.mark.stub
@pytest.mark.parametrize("events", [True, False], ids=["events", "host-timing"])
def test_phases_are_timed_on_the_models_device_not_the_current_one(events):
    """A model on cuda:1 while cuda:0 is current: events recorded on cuda:0's stream (or a synchronize of cuda:0)
    would time the other device's work."""
    acc = _StubEventAccelerator(events)
    timer = PhaseTimer(acc, torch.device("cuda", 1))
    with timer.phase("decode"):
        acc.clock[0] += 3.0
    timer.totals_ms()
    kinds = [e for e in acc.log if e != "event-sync"]
    assert kinds == ([("record", 1)] * 2 if events else [("device-sync", 1)] * 2)
    assert acc.device == [0]  # the current device is put back


def test_the_rollouts_timing_and_final_synchronize_run_on_the_models_device():
    from conftest import left_padded_prompts

    from hybrid_engine.accelerator import set_accelerator
    from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
    from hybrid_engine.tiny_models import build_model

    class Logging(CPUAccelerator):
        def __init__(self):
            super().__init__()
            self.on, self.syncs = [], []

        @contextlib.contextmanager
        def on_device(self, device):
            self.on.append(device)
            try:
                yield
            finally:
                self.on.pop()

        def synchronize(self):
            self.syncs.append(tuple(self.on))
            super().synchronize()

    acc = Logging()
    set_accelerator(acc)
    model = build_model("tiny-gpt2")
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=False, pad_token_id=0))
    rollout.generate(RolloutRequest(*left_padded_prompts(2, 4)), SamplingConfig(max_new_tokens=3))
    assert acc.syncs and all(on and on[-1] == torch.device("cpu") for on in acc.syncs), acc.syncs
