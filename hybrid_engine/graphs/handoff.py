"""The memory hand-off's vocabulary and the runners it reaches: tags, their checks, and every runner of a model.

Why one place: ``engine.sleep``/``wake`` and ``HybridEngineRollout.sleep``/``wake`` take the same tags and say
the same thing about what they kept (:class:`SleepingTags`), and an engine's sleep must reach every runner its
model decodes on (its ``generate`` and every rollout built on it), which only the runners themselves know:
each registers here (:func:`register`), weakly, so a dropped rollout is not kept alive.

What each tag releases (``docs/memory-handoff.md``):

* ``"kv_cache"``: every runner's page pool, rings and linear states, at fixed addresses
  (:mod:`hybrid_engine.decode.kv_storage`).
* ``"graphs"``: the graphs' private memory. No backend here can release it without losing what replays read
  (the CPU graph emulation keeps its recorded tensors; CUDA would need a VMM-backed graph pool), so it is kept
  and said so in :attr:`SleepingTags.kept`. A backend whose ``"kv_cache"`` cannot keep its addresses (no VMM)
  drops the buffers and so the graphs that read them: ``"graphs"`` sleeps there, and the next call recaptures.
* ``"optimizer"``: optimizer states, fp32 masters and gradients (:mod:`hybrid_engine.training.handoff`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["GRAPHS", "GRAPHS_KEPT", "KV_CACHE", "OPTIMIZER", "ROLLOUT_TAGS", "TAGS", "SleepingTags", "check_tags",
           "register", "runners_of", "runners_sleeping", "sleep_runners", "wake_runners"]

KV_CACHE, GRAPHS, OPTIMIZER = "kv_cache", "graphs", "optimizer"
#: Every tag, in the order sleep releases them.
TAGS = (KV_CACHE, GRAPHS, OPTIMIZER)
#: What ``sleep(tags=None)`` releases: the rollout memory.
ROLLOUT_TAGS = (KV_CACHE, GRAPHS)
#: Why ``"graphs"`` is kept on every backend so far.
GRAPHS_KEPT = ("graph memory kept: no backend here can release it at fixed addresses without losing what replays "
               "read (the CPU graph emulation replays its recorded tensors; no VMM graph pool on accelerators yet)")


class SleepingTags(frozenset):
    """The tags asleep now (a frozenset of tag names); :attr:`kept` maps a tag that was asked to sleep but
    keeps its memory to why."""

    kept: dict[str, str]

    def __new__(cls, tags: Iterable[str] = (), kept: dict[str, str] | None = None) -> SleepingTags:
        self = super().__new__(cls, tags)
        self.kept = dict(kept or {})
        return self

    def __repr__(self) -> str:
        kept = f", kept={self.kept!r}" if self.kept else ""
        return f"SleepingTags({sorted(self)!r}{kept})"


def check_tags(tags: Any, caller: str, *, default: tuple[str, ...], allowed: tuple[str, ...] = TAGS
               ) -> tuple[str, ...]:
    """``tags`` as a tuple of known tag names (``None``: ``default``); a clear error otherwise."""
    if tags is None:
        return default
    if isinstance(tags, str):
        tags = (tags,)
    try:
        tags = tuple(tags)
    except TypeError:
        raise TypeError(f"{caller}: tags must be None, a tag name or a list of them ({', '.join(allowed)}), "
                        f"got {type(tags).__name__}") from None
    for tag in tags:
        if tag not in allowed:
            raise ValueError(f"{caller}: unknown tag {tag!r}; use one of {', '.join(map(repr, allowed))} "
                             "(or None)")
    return tuple(t for t in TAGS if t in tags)


_RUNNERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet] = weakref.WeakKeyDictionary()


def register(model: Any, runner: Any) -> None:
    """``runner`` decodes ``model`` (kept weakly)."""
    _RUNNERS.setdefault(model, weakref.WeakSet()).add(runner)


def runners_of(model: Any) -> list[Any]:
    """The live runners decoding ``model``."""
    runners = _RUNNERS.get(model)
    return list(runners) if runners is not None else []


def sleep_runners(runners: Iterable[Any], tags: tuple[str, ...]) -> bool:
    """Put ``tags``' rollout memory of ``runners`` to sleep (``"kv_cache"``: each pool, rings and states);
    returns whether ``"graphs"`` was asked (kept, see :data:`GRAPHS_KEPT`). The caller holds the model's call lock."""
    if KV_CACHE in tags:
        for runner in runners:
            runner.sleep()
    return GRAPHS in tags


def wake_runners(runners: Iterable[Any]) -> None:
    """Wake every page pool of ``runners`` that sleeps (the caller holds the model's call lock)."""
    for runner in runners:
        runner.wake()


def runners_sleeping(runners: Iterable[Any], graphs_asked: bool) -> tuple[set[str], dict[str, str]]:
    """``(asleep, kept)`` of ``runners``' rollout memory: ``"kv_cache"`` while any page pool sleeps, and
    ``"graphs"`` in ``kept`` while it does and a sleep asked for graphs. Where a sleep dropped a runner's buffers
    (a backend without storage at fixed addresses), its graphs went with them: ``"graphs"`` is asleep then,
    asked for or not (the next call captures them again, counted in ``recaptures``)."""
    sleeping = [r for r in runners if r.sleeping]
    asleep = {KV_CACHE} if sleeping else set()
    if any(r.dropped for r in sleeping):
        asleep.add(GRAPHS)
    return asleep, ({GRAPHS: GRAPHS_KEPT} if graphs_asked and sleeping and GRAPHS not in asleep else {})
