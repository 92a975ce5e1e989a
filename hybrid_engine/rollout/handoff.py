"""The engine's memory hand-off between phases: rollout memory asleep during training, the optimizer's during
rollouts, every graph kept (issue 41; ``docs/memory-handoff.md``).

Why here: one object reaches both sides of one model, every decode runner of it (its ``generate`` and every
rollout built on it: :func:`~hybrid_engine.graphs.handoff.runners_of`) and its training backend's optimizer
hand-off (:mod:`hybrid_engine.training.handoff`), and it holds the model's call lock
(:func:`~hybrid_engine.generation.call_context.exclusive_model_call`) for every sleep and wake: a running
generation or training call finishes first, and none starts meanwhile. Generation calls wake their own page
pool (:func:`~hybrid_engine.generation.call.run_call`), training calls the optimizer (the backends'
``wake_optimizer``); each such wake is counted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from hybrid_engine.generation.call_context import exclusive_model_call
from hybrid_engine.graphs import handoff

__all__ = ["HandoffStats", "MemoryHandoff", "sleep_optimizer_during_generation"]


@dataclasses.dataclass
class HandoffStats:
    """Counters of an engine's hand-off: sleeps and wakes asked for, wakes made by calls (``kv_cache_wakes``:
    generation calls, summed over the model's runners; ``optimizer_wakes``: training calls), the last sleep's and
    wake's seconds and the bytes the optimizer's last sleep moved. Where a backend cannot keep addresses (no
    VMM), ``kv_cache_drops`` counts the sleeps that dropped a runner's buffers and graphs and ``recaptures`` the
    graphs captured again since (both summed over the runners; 0 where addresses are kept)."""

    sleeps: int = 0
    wakes: int = 0
    kv_cache_wakes: int = 0
    optimizer_wakes: int = 0
    last_sleep_s: float = 0.0
    last_wake_s: float = 0.0
    optimizer_bytes: int = 0
    kv_cache_drops: int = 0
    recaptures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sleep_optimizer_during_generation(engine: Any) -> None:
    """``sleep_between_phases``: the optimizer's memory of ``engine`` (a ``HybridEngine``; anything else has
    none) goes to the host for the generation call about to run; the next training call wakes it. The caller
    holds the model's call lock."""
    opt = getattr(getattr(engine, "training_backend", None), "handoff", None)
    if opt is not None:
        opt.sleep()


class MemoryHandoff:
    """Sleep and wake for ``model`` (its runners) and ``training`` (a backend with ``handoff``, or ``None``)."""

    def __init__(self, model: Any, training: Any = None) -> None:
        self.model = model
        self.training = training
        self._graphs_asked = False
        self._stats = HandoffStats()

    def _optimizer(self, caller: str, *, required: bool) -> Any:
        opt = getattr(self.training, "handoff", None) if self.training is not None else None
        if opt is None and required:
            raise ValueError(f"{caller}: tag 'optimizer' but this engine has no optimizer; leave it out of the tags")
        return opt

    def sleep(self, tags: Any = None, *, caller: str = "HybridEngine.sleep") -> None:
        """Release ``tags`` (``None``: the rollout memory, ``"kv_cache"`` and ``"graphs"``)."""
        tags = handoff.check_tags(tags, caller, default=handoff.ROLLOUT_TAGS)
        opt = self._optimizer(caller, required=True) if handoff.OPTIMIZER in tags else None
        with exclusive_model_call(self.model, caller):
            t0 = time.perf_counter()
            asked = handoff.sleep_runners(handoff.runners_of(self.model), tags)
            self._graphs_asked = self._graphs_asked or asked
            if opt is not None:
                opt.sleep()
                self._stats.optimizer_bytes = opt.bytes_moved
            self._stats.sleeps += 1
            self._stats.last_sleep_s = time.perf_counter() - t0

    def wake(self, tags: Any = None, *, caller: str = "HybridEngine.wake") -> None:
        """Take back ``tags`` (``None``: everything asleep) at the same addresses."""
        tags = handoff.check_tags(tags, caller, default=handoff.TAGS)
        with exclusive_model_call(self.model, caller):
            t0 = time.perf_counter()
            if handoff.KV_CACHE in tags:
                handoff.wake_runners(handoff.runners_of(self.model))
                self._graphs_asked = False
            opt = self._optimizer(caller, required=False)
            if handoff.OPTIMIZER in tags and opt is not None:
                opt.wake()
            self._stats.wakes += 1
            self._stats.last_wake_s = time.perf_counter() - t0

    @property
    def sleeping_tags(self) -> handoff.SleepingTags:
        asleep, kept = handoff.runners_sleeping(handoff.runners_of(self.model), self._graphs_asked)
        opt = self._optimizer("sleeping_tags", required=False)
        if opt is not None and opt.asleep:
            asleep.add(handoff.OPTIMIZER)
        return handoff.SleepingTags(asleep, kept)

    @property
    def stats(self) -> HandoffStats:
        s = dataclasses.replace(self._stats)
        runners = [r.stats for r in handoff.runners_of(self.model)]
        s.kv_cache_wakes = sum(r.wakes for r in runners)
        s.kv_cache_drops = sum(r.sleep_drops for r in runners)
        s.recaptures = sum(r.recaptures for r in runners)
        opt = self._optimizer("stats", required=False)
        s.optimizer_wakes = opt.wakes if opt is not None else 0
        return s
