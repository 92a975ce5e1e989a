"""The stats types of a graph runner: :class:`GraphStats` (``engine.graph_stats``, ``rollout.graph_stats``, and what
a rollout's ``last_stats`` is computed from) and :class:`CallStats`, the schema of ``rollout.last_stats``.

Why one schema: ``last_stats`` was built by two hand-kept dicts, and an empty request's had 19 of a normal call's
40 keys (issue 38), so ``last_stats["decode_ms"]`` raised ``KeyError`` on an empty data-parallel shard. Every
call now fills the same dataclass, whose defaults say "nothing happened".
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["CallStats", "GraphStats"]


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
    wakes: int = 0  # page pools woken by a generation call (asleep after sleep())
    sleep_drops: int = 0  # sleeps that dropped the buffers and graphs (no storage kept its addresses: no VMM)
    recaptures: int = 0  # graphs captured again after such a sleep dropped them

    def to_dict(self) -> dict[str, Any]:
        """The counters as a plain dict, for logging."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CallStats:
    """One rollout call's counters: every key of ``HybridEngineRollout.last_stats``, listed once.

    Each call (an empty request, a normal one, an episode turn) fills the same fields, so ``last_stats`` has
    the same keys whatever happened; what a call did not do keeps its default (0, ``()``, ``{}`` or ``None``).
    Counters and times are the call's own (graph counters as the difference of the runner's
    :class:`GraphStats` before and after); ``cache_memory_bytes``, ``kv_page_size`` and ``kv_pages_total``
    describe the runner's buffers after the call. ``profile`` is a dict only with
    ``RolloutConfig(enable_profiling=True)``.
    """

    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    overhead_ms: float = 0.0  # total_ms less prefill and decode
    total_ms: float = 0.0
    decode_steps: int = 0
    prefill_forwards: int = 0
    tokens_generated: int = 0
    tokens_per_second: float = 0.0
    graph_replays: int = 0
    graph_captures: int = 0
    admission_graph_replays: int = 0
    admission_graph_captures: int = 0
    fallbacks: int = 0
    peak_active_batch: int = 0
    cache_capacity: int = 0  # the per-row KV length the call used (0: no slots)
    cache_memory_bytes: int = 0
    kv_page_size: int = 0
    kv_pages_total: int = 0
    kv_pages_peak: int = 0
    kv_pages_held_peak: int = 0
    kv_bytes_peak: int = 0
    preemptions: int = 0
    span_buckets: tuple[int, ...] = ()
    span_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    host_syncs: int = 0
    host_ms_overlapped: float = 0.0  # host planning while the device ran a run of steps, before its read's wait
    host_ms_after_sync: float = 0.0  # host work from a read's wait to the next run's launch (admissions left out)
    eager_steps: int = 0
    capture_ms: float = 0.0
    graph_batch_size: int = 0  # the bucket the call's slots were sized for (0: none)
    use_graph_capture: bool = False
    last_refusal_reason: str | None = None
    prefill_rows: int = 0
    prefill_tokens: int = 0
    kv_reused_tokens: int = 0
    kv_row_copies: int = 0
    admission_rounds: int = 0
    harvests: int = 0
    compactions: int = 0
    rows_moved: int = 0
    bucket_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    num_sequences: int = 0
    wakes: int = 0  # 1 when this call woke its page pool from sleep() first
    recaptures: int = 0  # graphs this call captured again because a sleep dropped them (a backend without VMM)
    profile: dict[str, Any] | None = None

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key of ``last_stats``, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The ``last_stats`` dict: every field, values as they are (not deep-copied)."""
        return {name: getattr(self, name) for name in self.keys()}
