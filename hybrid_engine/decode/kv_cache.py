"""A graph-safe static KV cache that is a transformers ``Cache``.

Why this exists: decode steps are captured once into an accelerator graph and
replayed for every later step. A capture freezes every *host* value (Python
ints, shapes, anything read with ``.item()``) and every tensor *address*. So
all state that changes from one decode step to the next must live in device
tensors that are updated in place, and nothing in the step may read device
state on the host. transformers' own caches keep host-side lengths (4.57) or a
single shared length (5.x ``StaticLayer.cumulative_length``), which cannot
express rows of different lengths; this cache keeps per-row state on device.

Invariants
----------
* K/V live in one buffer, ``kv``, allocated once in ``__init__`` and never
  reallocated or swapped (``reset``/``copy_rows``/``load_rows`` write into it in
  place), so a captured graph keeps reading the right storage. Its shape is
  ``[num_layers, 2, batch_size, num_kv_heads, capacity, head_dim]``; layer ``i``'s
  keys and values are its contiguous ``[i, 0]`` and ``[i, 1]`` views
  (``head_dim`` from the config when it names one, e.g. Qwen3; otherwise
  hidden/heads; GPT-2/OPT have no ``num_key_value_heads`` and use
  ``num_attention_heads``). Moving or emptying rows is therefore one op over
  every layer, whatever the depth (compaction). Loading rows from another cache
  (admission rounds) gathers one layer at a time instead: the gathered rows are
  a temporary, and inside a captured admission round it stays in the graph pool
  for good, so it is one layer's rows, not the whole depth's.
* Per-row device state, all ``[batch_size]``-leading and updated in place:
  ``write_pos`` (int64, next buffer slot each row writes), ``valid`` (bool
  ``[B, capacity]``, which slots a query may attend), ``position`` (int64, the
  next position id of each row; differs from ``write_pos`` under left padding).
* :meth:`update` writes row ``b``'s new keys at ``write_pos[b] + arange(q_len)``
  with ``scatter_`` (no host reads; a prefill, where every ``write_pos`` is 0,
  says so with the host flag ``writes_at_start`` and gets a plain copy) and
  returns the full buffers, or views of the first ``kv_len`` slots when the
  host int ``cache.kv_len`` is set (a per-position graph captures with
  ``kv_len`` frozen). It does NOT advance
  ``write_pos``: the step function does that once per forward, after all layers.
* Host-side checks (bounds, dtype, batch) read device values, so they run only
  when the current stream is not capturing
  (:func:`~hybrid_engine.accelerator.is_capturing`).
* :meth:`get_seq_length` / :meth:`get_query_offset` return a 0-dim device
  tensor (``max(write_pos)``) inside every model step, eager or captured
  (:attr:`StaticKVCache.answer_on_device`; transformers' own 5.x ``StaticLayer``
  also returns a tensor), so model code that calls them (OPT's decoder, at
  every forward) never syncs, and eager steps run what captured ones do; a
  host ``int`` otherwise. With per-row lengths
  there is no single "sequence length": callers must pass an explicit 4D mask
  and position ids (see :mod:`hybrid_engine.decode.step`).
* Host-side state (Python values a captured step would advance) is kept to
  one counter, ``num_updates``, shared by a cache and all its row views, and
  :meth:`host_state`/:meth:`restore_host_state` save and restore it. A capture
  applies none of its device work, so when one fails its owner restores the
  host state too, and the eager fallback runs from where the step started.

Works with transformers 4.57 (``get_mask_sizes(cache_position, layer_idx)``,
``get_max_cache_shape``, ``max_batch_size``/``max_cache_len``) and 5.x
(``get_mask_sizes(query_length, layer_idx)``, ``get_query_offset``,
``get_max_length``, ``update(..., kwargs=...)``, ``is_linear``/``is_dummy``).
Sliding-window attention is not masked here, so configs whose window is smaller
than the capacity are refused.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from hybrid_engine.accelerator import is_capturing

__all__ = ["StaticKVCache", "cache_geometry", "sliding_window"]


class _HostCounters:
    """Host-side counters one cache shares with its row views (the views write the same storage)."""

    __slots__ = ("num_updates",)

    def __init__(self) -> None:
        self.num_updates = 0


def cache_geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder config."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // num_heads
    return num_layers, int(num_kv_heads), int(head_dim)


def sliding_window(config: PretrainedConfig) -> int | None:
    """The sliding-attention window of ``config``'s layers that use one, or ``None``."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if any("sliding" in t or "chunked" in t for t in layer_types) else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


class _StaticKVLayer(CacheLayerMixin):
    """One layer's view of a :class:`StaticKVCache` (what ``cache.layers[i]`` holds)."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    supports_early_init = True

    def __init__(self, owner: "StaticKVCache", layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        # A proxy, not a reference: the cache holds its layers, and a cycle would keep the KV buffers alive
        # after release() until Python's cyclic collector happened to run.
        self._owner = weakref.proxy(owner)
        self.layer_idx = layer_idx
        self.keys = keys
        self.values = values
        self.is_initialized = True
        self.device = keys.device
        self.max_cache_len = keys.shape[2]
        self.max_batch_size = keys.shape[0]
        self.batch_size = keys.shape[0]
        self.num_heads = keys.shape[1]

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:  # buffers exist from the start
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self._owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self._owner.get_mask_sizes(0, self.layer_idx)

    def get_seq_length(self) -> Any:
        return self._owner.get_seq_length(self.layer_idx)

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self._owner.reset()

    def offload(self) -> None:
        raise NotImplementedError("StaticKVCache buffers have fixed addresses and cannot be offloaded")

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.device)))
        self.values.copy_(self.values.index_select(0, beam_idx.to(self.device)))

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("StaticKVCache does not support crop(); use reset_rows()")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("StaticKVCache has a fixed batch size; use copy_rows() to replicate rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("StaticKVCache has a fixed batch size; use copy_rows() to compact rows")


class StaticKVCache(Cache):
    """Fixed-address KV cache with per-row write positions, validity and position ids (see module docstring)."""

    def __init__(
        self,
        config: PretrainedConfig,
        batch_size: int,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"StaticKVCache: batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"StaticKVCache: capacity must be a positive int, got {capacity!r}")
        window = sliding_window(config)
        if window is not None and window < capacity:
            raise ValueError(
                f"StaticKVCache: the config uses sliding-window attention (window {window}) smaller than "
                f"capacity {capacity}; sliding windows are not supported by this cache"
            )
        if dtype is None:
            cfg_dtype = getattr(config, "dtype", None)  # 4.57 and 5.x; `torch_dtype` is deprecated
            dtype = cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.device("cpu")
        num_layers, num_kv_heads, head_dim = cache_geometry(config)
        kv = torch.zeros((num_layers, 2, batch_size, num_kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self._setup(
            kv,
            torch.zeros(batch_size, dtype=torch.int64, device=device),
            torch.zeros(batch_size, dtype=torch.int64, device=device),
            torch.zeros(batch_size, capacity, dtype=torch.bool, device=device),
        )

    def _setup(self, kv: torch.Tensor, write_pos: torch.Tensor, position: torch.Tensor, valid: torch.Tensor,
               host: _HostCounters | None = None) -> None:
        super().__init__(layers=[_StaticKVLayer(self, i, kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])])
        #: Every layer's K and V, ``[num_layers, 2, batch_size, num_kv_heads, capacity, head_dim]``.
        self.kv = kv
        self._batch_size = kv.shape[2]
        self._capacity = kv.shape[4]
        self._dtype = kv.dtype
        self._device = kv.device
        self.num_kv_heads = kv.shape[3]
        self.head_dim = kv.shape[5]
        self.write_pos = write_pos
        self.position = position
        self.valid = valid
        #: Host int set by the caller: attention spans only the first ``kv_len`` slots (None: all).
        self.kv_len: int | None = None
        #: Read write positions on the host to bounds-check each write (outside capture only).
        #: Owners that validate lengths up front (the engines) turn it off: it costs a sync per step.
        self.bounds_checks = True
        #: Set around a model forward by :mod:`hybrid_engine.decode.step`: sequence-length queries get a device
        #: tensor, as while capturing, so an eager step reads nothing on the host either.
        self.answer_on_device = False
        #: Host flag set by :func:`~hybrid_engine.decode.step.prefill` while every row's ``write_pos`` is 0:
        #: ``update`` then copies into the first ``q_len`` slots, a plain copy instead of a scatter.
        self.writes_at_start = False
        self._host = host if host is not None else _HostCounters()

    @property
    def num_updates(self) -> int:
        """``update`` calls on this cache's storage, through it or any row view (probes models that ignore it)."""
        return self._host.num_updates

    @num_updates.setter
    def num_updates(self, value: int) -> None:
        self._host.num_updates = value

    def host_state(self) -> tuple[int, ...]:
        """The host-side counters a step advances (shared with every row view); see :meth:`restore_host_state`."""
        return (self._host.num_updates,)

    def restore_host_state(self, state: tuple[int, ...]) -> None:
        """Put back counters saved by :meth:`host_state` (after a capture that failed part-way)."""
        (self._host.num_updates,) = state

    # ------------------------------------------------------------------ shape
    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_batch_size(self) -> int:
        return self._batch_size

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_cache_len(self) -> int:
        return self._capacity

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_croppable(self) -> bool:
        return False

    def _span(self) -> int:
        return self._capacity if self.kv_len is None else self.kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self._capacity

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._capacity

    def get_mask_sizes(self, query_length_or_cache_position: Any = None, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the span attention sees (``kv_len`` or capacity), offset 0.

        Accepts both the 4.57 form ``(cache_position, layer_idx)`` and the 5.x form ``(query_length, layer_idx)``.
        """
        return self._span(), 0

    def get_seq_length(self, layer_idx: int | None = 0) -> Any:
        """``max(write_pos)``: a 0-dim device tensor inside a model step (:attr:`answer_on_device`, set by
        :mod:`hybrid_engine.decode.step`) and while capturing; a host int otherwise."""
        longest = self.write_pos.max()
        if self.answer_on_device or is_capturing():
            return longest
        return int(longest)

    def get_query_offset(self, layer_idx: int = 0) -> Any:
        """Slot of the next query (rows written in lockstep); same type rules as :meth:`get_seq_length`."""
        return self.get_seq_length(layer_idx)

    def memory_bytes(self) -> int:
        """Bytes held by the K/V buffers and the per-row state."""
        return self.kv.nbytes + self.write_pos.nbytes + self.position.nbytes + self.valid.nbytes

    def __repr__(self) -> str:
        return (
            f"StaticKVCache(layers={len(self.layers)}, batch_size={self._batch_size}, capacity={self._capacity}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self._dtype}, device={self._device})"
        )

    # ----------------------------------------------------------------- update
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q_len, D]`` states at each row's ``write_pos``; return the (``kv_len``-sliced) buffers."""
        layer = self.layers[layer_idx]
        q_len = key_states.shape[2]
        if torch.is_autocast_enabled(key_states.device.type):
            # Autocast mixes dtypes (bf16 projections, fp32 RoPE): store each in the cache's dtype, as exactly as
            # transformers' DynamicCache keeps them, since attention under autocast casts its inputs down anyway.
            key_states, value_states = key_states.to(self._dtype), value_states.to(self._dtype)
        if not is_capturing():
            self._check_update(layer, key_states, value_states, q_len)
        if self.writes_at_start:
            layer.keys[:, :, :q_len].copy_(key_states)
            layer.values[:, :, :q_len].copy_(value_states)
        else:
            slots = self.write_pos[:, None] + torch.arange(q_len, device=self.write_pos.device)
            index = slots[:, None, :, None].expand(key_states.shape)
            layer.keys.scatter_(2, index, key_states)
            layer.values.scatter_(2, index, value_states)
        self.num_updates += 1
        if self.kv_len is None:
            return layer.keys, layer.values
        return layer.keys[:, :, : self.kv_len], layer.values[:, :, : self.kv_len]

    def _check_update(self, layer: _StaticKVLayer, key_states: torch.Tensor, value_states: torch.Tensor,
                      q_len: int) -> None:
        expected = (self._batch_size, self.num_kv_heads, q_len, self.head_dim)
        if tuple(key_states.shape) != expected or tuple(value_states.shape) != expected:
            raise ValueError(
                f"StaticKVCache.update: key/value states of shape {tuple(key_states.shape)}/"
                f"{tuple(value_states.shape)} do not match the cache layout {expected}"
            )
        if key_states.dtype != self._dtype or value_states.dtype != self._dtype:
            raise ValueError(
                f"StaticKVCache.update: key/value states have dtypes {key_states.dtype}/{value_states.dtype}, the "
                f"cache holds {self._dtype}; build the cache with dtype=model.dtype"
            )
        if self.kv_len is not None and not 1 <= self.kv_len <= self._capacity:
            raise ValueError(f"StaticKVCache: kv_len={self.kv_len} is outside 1..capacity={self._capacity}")
        if not self.bounds_checks:
            return
        end = int(self.write_pos.max()) + q_len
        limit = self._span()
        if end > limit:
            what = "capacity" if self.kv_len is None else "kv_len"
            raise ValueError(
                f"StaticKVCache.update: writing {q_len} token(s) at write position {end - q_len} would end at "
                f"{end}, past {what}={limit}"
            )

    def rows_view(self, start: int, stop: int, capacity: int | None = None) -> "StaticKVCache":
        """A cache over rows ``start..stop-1`` (and slots ``0..capacity-1``) sharing this cache's storage.

        A graph captured on a view reads and writes exactly those addresses of this
        cache, so graphs of several batch buckets share one allocation; a prefill into
        contiguous rows writes them directly.
        """
        capacity = self._capacity if capacity is None else capacity
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= self._batch_size
                and isinstance(capacity, int) and 1 <= capacity <= self._capacity):
            raise ValueError(f"StaticKVCache.rows_view: need 0 <= start < stop <= {self._batch_size} and "
                             f"1 <= capacity <= {self._capacity}, got {start!r}, {stop!r}, {capacity!r}")
        view = StaticKVCache.__new__(StaticKVCache)
        view._setup(
            self.kv[:, :, start:stop, :, :capacity],
            self.write_pos[start:stop],
            self.position[start:stop],
            self.valid[start:stop, :capacity],
            self._host,
        )
        view.bounds_checks = self.bounds_checks
        return view

    # -------------------------------------------------------------- row state
    def _row_state(self) -> tuple[torch.Tensor, ...]:
        """The per-row tensors besides ``kv`` (rows on dim 0; ``kv`` holds them on dim 2)."""
        return self.valid, self.write_pos, self.position

    def _rows(self, rows: torch.Tensor | Any, name: str, checked: bool = False) -> torch.Tensor:
        """``rows`` as an int64 device tensor; its range is checked (two host reads) unless ``checked``."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self._device)
        if rows.dim() != 1:
            raise ValueError(f"StaticKVCache: {name} must be a 1-D tensor of row indices, got shape {tuple(rows.shape)}")
        if checked or is_capturing():
            return rows
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self._batch_size):
            raise ValueError(f"StaticKVCache: {name} must lie in 0..{self._batch_size - 1}")
        return rows

    def reset(self) -> None:
        """Empty every row (in place; addresses unchanged)."""
        self.kv.zero_()
        for t in self._row_state():
            t.zero_()

    def reset_rows(self, rows: torch.LongTensor) -> None:
        """Empty the given rows: K/V zeroed, nothing valid, write position and position id 0."""
        rows = self._rows(rows, "rows")
        self.kv.index_fill_(2, rows, 0)
        for t in self._row_state():
            t.index_fill_(0, rows, 0)

    def copy_rows(self, src_rows: torch.LongTensor, dst_rows: torch.LongTensor, *, checked: bool = False) -> None:
        """Copy K/V, ``valid``, ``write_pos`` and ``position`` of ``src_rows[i]`` into ``dst_rows[i]``.

        Sources are gathered before anything is written, so overlapping sets are fine
        (e.g. compaction). Use it to fan one prefilled prompt out to ``n`` rows.
        ``checked=True``: the caller guarantees the rows are in range (no host read).
        """
        src = self._rows(src_rows, "src_rows", checked)
        dst = self._rows(dst_rows, "dst_rows", checked)
        if src.shape != dst.shape:
            raise ValueError(f"StaticKVCache.copy_rows: src_rows has {src.numel()} rows, dst_rows {dst.numel()}")
        self.kv.index_copy_(2, dst, self.kv.index_select(2, src))
        for t in self._row_state():
            t.index_copy_(0, dst, t.index_select(0, src))

    def load_rows(self, rows: torch.LongTensor, other: "StaticKVCache", sources: torch.LongTensor | None = None, *,
                  checked: bool = False) -> None:
        """Copy rows of ``other`` (capacity <= ours) into ``rows``: its first ``len(rows)`` rows, or ``sources``.

        ``sources[i]`` is the row of ``other`` that goes to ``rows[i]`` (a device index;
        repeated sources fan one prompt out to several rows). Slots beyond
        ``other.capacity`` are marked invalid; their K/V are left as they were (no query
        attends an invalid slot), so loading a short prompt costs its own length, not
        the capacity. ``checked=True``: the caller guarantees the rows are in range (no
        host read; also capture-safe then).

        K/V are gathered and copied one layer at a time: the gathered rows are a temporary
        (``len(rows)`` x ``other.capacity`` K/V), which a captured admission round keeps in its
        graph pool for good, so it stays one layer's size whatever the depth (at the cost of two
        ops per layer instead of two in all).
        """
        rows = self._rows(rows, "rows", checked)
        if sources is None and rows.numel() > other.batch_size:
            raise ValueError(f"StaticKVCache.load_rows: {rows.numel()} rows but other has {other.batch_size}")
        if sources is not None and sources.shape != rows.shape:
            raise ValueError(f"StaticKVCache.load_rows: {sources.numel()} sources for {rows.numel()} rows")
        if other.capacity > self._capacity:
            raise ValueError(
                f"StaticKVCache.load_rows: other capacity {other.capacity} exceeds capacity {self._capacity}"
            )
        if (len(other.layers), other.num_kv_heads, other.head_dim) != (
            len(self.layers), self.num_kv_heads, self.head_dim
        ):
            raise ValueError("StaticKVCache.load_rows: the two caches have different layer/head geometry")

        def pick(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
            return t.narrow(dim, 0, rows.numel()) if sources is None else t.index_select(dim, sources)

        self.valid.index_fill_(0, rows, False)
        n = other.capacity
        for layer in range(self.kv.shape[0]):
            self.kv[layer, :, :, :, :n].index_copy_(1, rows, pick(other.kv[layer], 1).to(self._dtype))
        self.valid[:, :n].index_copy_(0, rows, pick(other.valid))
        self.write_pos.index_copy_(0, rows, pick(other.write_pos))
        self.position.index_copy_(0, rows, pick(other.position))
