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
    steps; ``graph_keys`` counts the decode graphs held now (each serves every
    position of its bucket, span and sampling mode), ``buckets`` and
    ``span_buckets`` the batch and span sizes among them, and
    ``graph_key_bound`` how many decode graphs a sampling mode can reach at most
    (buckets x span buckets). ``admission_captures``/``admission_replays``
    count the graphs of admission (staged prefill batches and admission rounds)
    and ``admission_graph_keys`` how many of them are held; every graph held
    is in ``graph_memory_bytes``. The ``kv_*`` fields describe the page pool:
    page size, pages a call can hold, and the last call's peak in pages and
    bytes; ``preemptions`` counts requests preempted for pages (and resumed).
    ``enabled`` says whether the next call may replay graphs (capture asked
    for, nothing refuses it), as read when the stats were asked for.
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
    admission_graph_keys: int = 0
    span_buckets: tuple[int, ...] = ()
    graph_key_bound: int = 0
    kv_page_size: int = 0
    kv_pages_total: int = 0
    kv_pages_peak: int = 0
    kv_bytes_peak: int = 0
    preemptions: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The counters as a plain dict, for logging."""
        return dataclasses.asdict(self)
