"""Per-position decode graphs: capture once per position, replay on later calls.

Graph-safety invariant. A captured graph freezes every host value (shapes,
Python ints such as the decode position and ``cache.kv_len``, sampling knobs)
and every tensor address it touched. So:

* All state that changes between steps lives in device tensors owned by one
  :class:`GraphEntry` and never re-allocated while its graphs live: the
  :class:`~hybrid_engine.static_cache.StaticKVCache` (K/V, ``write_pos``,
  ``valid``, ``position``), the token buffer ``tokens[B, N]`` (the graph of
  position ``p`` reads column ``p`` and writes column ``p + 1``), the sampling
  seed and the row indices.
* Everything baked into a graph is in its :class:`GraphKey` (batch, prompt
  width, generation length, dtype, sampling parameters, suppressed EOS ids).
  A call with another key uses another entry; entries live in a small LRU.
  A change of generation length drops the entries of other lengths.
* Weights are read by address. In-place updates (optimizer steps) are seen by
  the next replay; a re-allocated parameter or buffer changes the weight
  :func:`weight_fingerprint`, which is checked before any replay and drops all
  graphs so the call recaptures.
* Forward (pre-)hooks registered on the model are suspended while capturing
  (:func:`suspended_hooks`): a hook that synchronises with the host cannot be
  recorded, and no Python runs at replay anyway, so hooks never run in graphed
  decode steps.
* A capture that fails raises :class:`CaptureFailed`; the caller discards the
  key's graphs and reruns the whole call eagerly, so a sequence is never part
  replayed, part eager.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .graph_safety import suspended_hooks, weight_fingerprint
from .static_cache import StaticKVCache

__all__ = [
    "DEFAULT_MAX_KEYS",
    "MAX_CAPTURE_FAILURES",
    "CaptureFailed",
    "DecodeLengthError",
    "GraphEntry",
    "GraphKey",
    "GraphStats",
    "PositionGraphs",
]

#: Capture failures after which graphs are disabled for the engine.
MAX_CAPTURE_FAILURES = 3
#: Graph keys (each with its own cache and graphs) kept at once.
DEFAULT_MAX_KEYS = 4


class CaptureFailed(RuntimeError):
    """Capturing the decode step of one position raised; ``__cause__`` holds the error."""

    def __init__(self, position: int, cause: BaseException):
        super().__init__(f"capturing decode position {position} failed: {type(cause).__name__}: {cause}")
        self.position = position


class DecodeLengthError(RuntimeError):
    """A graphed decode ran past the generation length it was declared with."""


@dataclass
class GraphStats:
    """Counters of one engine's graph store (attribute access; ``to_dict()`` for logging)."""

    captured_positions: int = 0
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GraphKey:
    """Everything a decode graph bakes in."""

    batch: int
    prompt_width: int
    new_tokens: int
    dtype: torch.dtype
    device: str
    sampling: tuple  # (do_sample, temperature, top_k, top_p)
    suppressed_eos: tuple[int, ...]


@dataclass
class GraphEntry:
    """The device state and graphs of one key. Buffers keep their addresses for the entry's life."""

    key: GraphKey
    cache: StaticKVCache
    tokens: torch.Tensor  # [B, N] int64
    seed: torch.Tensor  # [] int64
    rows: torch.Tensor  # [B] int64, request index of each row
    suppress: torch.Tensor | None  # [E] int64 EOS ids suppressed below min_new_tokens
    graphs: dict[int, Any] = field(default_factory=dict)
    pool: Any = None
    warmed_up: bool = False


class PositionGraphs:
    """An LRU of :class:`GraphEntry` plus capture/replay of per-position graphs, with stats."""

    def __init__(self, accelerator: Any, max_keys: int = DEFAULT_MAX_KEYS):
        if max_keys < 1:
            raise ValueError(f"PositionGraphs: max_keys must be >= 1, got {max_keys}")
        self.accelerator = accelerator
        self.max_keys = max_keys
        self._entries: OrderedDict[GraphKey, GraphEntry] = OrderedDict()
        self._fingerprint: tuple | None = None
        self.failures = 0
        self.disabled = False
        self.stats = GraphStats()

    # ----------------------------------------------------------- bookkeeping
    def _refresh(self) -> None:
        s = self.stats
        s.captured_positions = sum(len(e.graphs) for e in self._entries.values())
        s.graph_keys = len(self._entries)
        caches = {id(e.cache): e.cache for e in self._entries.values()}
        s.cache_memory_bytes = sum(c.memory_bytes() for c in caches.values())

    def keys(self) -> list[GraphKey]:
        return list(self._entries)

    def clear(self) -> None:
        """Drop every entry (graphs and caches)."""
        if self._entries:
            self.stats.invalidations += 1
        self._entries.clear()
        self._fingerprint = None
        self._refresh()

    def discard(self, key: GraphKey) -> None:
        self._entries.pop(key, None)
        self._refresh()

    def check_weights(self, model: torch.nn.Module) -> bool:
        """Drop all graphs if a parameter or buffer was re-allocated since capture; True if dropped."""
        fp = weight_fingerprint(model)
        stale = self._fingerprint is not None and fp != self._fingerprint
        if stale:
            self.clear()
        self._fingerprint = fp
        return stale

    def _shared_cache(self, key: GraphKey, capacity: int) -> StaticKVCache | None:
        """A live entry's cache that ``key`` can use: same batch, dtype and device, large enough.

        Keys of one batch size share one cache (each call's prefill resets it), so a new prompt
        width or length costs graphs, not another cache.
        """
        for e in self._entries.values():
            k = e.key
            if (k.batch, k.dtype, k.device) == (key.batch, key.dtype, key.device) and e.cache.capacity >= capacity:
                return e.cache
        return None

    def entry(self, key: GraphKey, model: torch.nn.Module, capacity: int) -> GraphEntry:
        """The entry of ``key`` (most recently used), creating it and evicting the oldest if needed.

        ``capacity`` is the cache length to allocate (the engine passes ``max_out_tokens``).
        """
        # A change of generation length invalidates the graphs of other lengths.
        other_lengths = [k for k in self._entries if k.new_tokens != key.new_tokens]
        if other_lengths:
            for k in other_lengths:
                del self._entries[k]
            self.stats.invalidations += 1
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            return found
        while len(self._entries) >= self.max_keys:
            self._entries.popitem(last=False)
        device = torch.device(key.device)
        cache = self._shared_cache(key, capacity)
        if cache is None:
            cache = StaticKVCache(model.config, key.batch, capacity, device=device, dtype=key.dtype)
            cache.bounds_checks = False  # lengths were validated up front; skip the per-step host read
        suppress = torch.tensor(key.suppressed_eos, dtype=torch.int64, device=device) if key.suppressed_eos else None
        entry = GraphEntry(
            key=key,
            cache=cache,
            tokens=torch.zeros(key.batch, key.new_tokens, dtype=torch.int64, device=device),
            seed=torch.zeros((), dtype=torch.int64, device=device),
            rows=torch.arange(key.batch, dtype=torch.int64, device=device),
            suppress=suppress,
        )
        self._entries[key] = entry
        self._refresh()
        return entry

    # -------------------------------------------------------- capture/replay
    def _warm_up(self, entry: GraphEntry, step: Callable[[int], None], position: int) -> None:
        """Run the step once eagerly before its first capture, leaving the cache state as it was."""
        cache = entry.cache
        saved = (cache.write_pos.clone(), cache.position.clone(), cache.valid.clone())
        step(position)
        cache.write_pos.copy_(saved[0])
        cache.position.copy_(saved[1])
        cache.valid.copy_(saved[2])
        entry.warmed_up = True

    def run_position(
        self, entry: GraphEntry, position: int, step: Callable[[int], None], model: torch.nn.Module
    ) -> None:
        """Run decode ``position`` of ``entry``: replay its graph, capturing it first if needed.

        ``step(position)`` must read ``entry.tokens[:, position]`` and write
        ``entry.tokens[:, position + 1]``. Raises :class:`DecodeLengthError` past
        the declared length and :class:`CaptureFailed` if capture raises.
        """
        last = entry.key.new_tokens - 2
        if not 0 <= position <= last:
            raise DecodeLengthError(
                f"decode position {position} is past the declared generation length "
                f"({entry.key.new_tokens} new tokens: positions 0..{last} are decoded); "
                "graphs are captured for a fixed length, start a new generate call for more tokens"
            )
        acc = self.accelerator
        graph = entry.graphs.get(position)
        if graph is None:
            if not entry.warmed_up:
                self._warm_up(entry, step, position)
            t0 = time.perf_counter()
            mem0 = acc.memory_allocated()
            graph = acc.create_graph()
            try:
                with suspended_hooks(model), acc.capture_to_graph(graph, pool=entry.pool):
                    step(position)
            except Exception as exc:
                raise CaptureFailed(position, exc) from exc
            self.stats.captures += 1
            self.stats.capture_seconds += time.perf_counter() - t0
            self.stats.graph_memory_bytes += max(0, acc.memory_allocated() - mem0)
            if entry.pool is None:
                entry.pool = acc.graph_pool(graph)
            entry.graphs[position] = graph
            self._refresh()
        acc.replay_graph(graph)
        self.stats.replays += 1

    def record_failure(self) -> bool:
        """Count a capture failure; True when this one disables graphs for good."""
        self.failures += 1
        self.stats.fallbacks += 1
        if self.failures >= MAX_CAPTURE_FAILURES and not self.disabled:
            self.disabled = True
            self._entries.clear()
            self._refresh()
            return True
        return False
