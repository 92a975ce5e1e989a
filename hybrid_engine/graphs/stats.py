"""The one stats type of a graph runner, shared by ``engine.graph_stats`` and a rollout's ``last_stats``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["GraphStats"]


@dataclasses.dataclass
class GraphStats:
    """Counters of one runner (attribute access; ``to_dict()`` for logging).

    ``captures``, ``replays``, ``warmups`` and ``eager_steps`` count decode
    steps; ``graph_keys`` counts the decode
    graphs held now (each serves every position of its bucket and sampling
    mode). ``admission_captures``/``admission_replays`` count the graphs of
    admission: staged prefill batches and admission rounds (first token, slot
    setup). ``enabled`` says whether the next
    call may replay graphs (capture asked for, nothing refuses it), as read when
    the stats were asked for.
    """

    replays: int = 0
    captures: int = 0
    fallbacks: int = 0
    last_refusal_reason: str | None = None
    enabled: bool = False
    capture_seconds: float = 0.0
    graph_memory_bytes: int = 0
    cache_memory_bytes: int = 0
    graph_keys: int = 0
    invalidations: int = 0
    eager_steps: int = 0
    warmups: int = 0
    buckets: tuple[int, ...] = ()
    admission_captures: int = 0
    admission_replays: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The counters as a plain dict, for logging."""
        return dataclasses.asdict(self)
