"""The decode cache as a transformers ``Cache``: per-row block tables into a shared paged pool.

Why: decode steps are captured once and replayed, and a capture freezes every
host value and every address. So all per-row state lives in device tensors
updated in place, and nothing in a step reads the device on the host.
transformers' own caches keep host-side lengths (4.57) or one shared length
(5.x), which cannot express rows of different lengths.

Device state, all ``[rows]``-leading: ``block_table`` (int64 ``[rows, max_pages]``:
the pool page holding each row's logical page; :data:`~hybrid_engine.decode.kv_pool.NULL_PAGE`
where none), ``write_pos`` (tokens the row holds: the logical index its next
token is written at) and ``position`` (its next position id). A row's tokens
sit at logical indices ``0..write_pos-1`` with no padding between them, so a
query attends keys ``j <= write_pos`` and nothing else needs a mask.

What one forward reads besides the tables travels as one
:class:`ForwardIndices`, set in one place (:meth:`PagedKVCache.set_forward`,
called by the step functions of :mod:`hybrid_engine.decode.step`, which
compute it) and cleared after: ``write_slots`` (the pool slot of every new
token; padding and finished rows write the null page) and, unless ``fresh`` (a
prefill attends over its own new states), ``read_slots``: the slots of the
first ``span`` pages of every row, gathered in logical order. What a capture
freezes is the span (a host int: one graph per span bucket) and the shapes;
the pages a row reads are table data.

Host-side checks (shapes, dtype, bounds) read device values, so they run only
outside capture. ``get_seq_length``/``get_query_offset`` answer a 0-dim device
tensor inside a model step (while a :class:`ForwardIndices` is set) and while capturing.
Works with transformers 4.57 and 5.x. Two kinds of layers keep per-row data
instead of pages (:attr:`states`, :mod:`hybrid_engine.decode.linear_states`):
state layers (5.x: linear attention, Mamba mixers), read and written through
transformers' linear-attention cache methods, and windowed layers of rows
longer than twice their window, which keep a ring of their window.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from hybrid_engine.accelerator import is_capturing
from hybrid_engine.decode.kv_pool import DEFAULT_PAGE_SIZE, NULL_PAGE, KVPool, pages_for
from hybrid_engine.decode.layout import exact_length, layer_specs, linear_layers
from hybrid_engine.decode.linear_states import Shapes, StateStore, StateView

__all__ = ["ForwardIndices", "MAX_STEP_TABLES", "PagedKVCache"]

#: Tables one owner module may keep on a cache (:meth:`PagedKVCache.step_table`): one per dtype and layout.
MAX_STEP_TABLES = 4


@dataclasses.dataclass(frozen=True)
class ForwardIndices:
    """The device indices and host values one forward over a :class:`PagedKVCache` reads (module docstring).

    Computed by the step functions from device state before the forward; a captured step freezes their
    addresses and the host values (``kv_len``, ``fresh``), never their contents.
    """

    write_slots: torch.Tensor  # [rows * T]: the pool slot of every new token
    kv_len: int  # the K/V length ``update`` returns (what the 4D mask spans)
    read_slots: torch.Tensor | None = None  # [rows * span tokens]: what ``update`` gathers (None when fresh)
    # [rows * span pages]: the same span as whole pages (a decode step's): ``update`` then gathers page blocks,
    # the same bytes in a sixteenth of the index entries (a CPU's gather is per index entry).
    read_pages: torch.Tensor | None = None
    fresh: bool = False  # a prefill: ``update`` returns the new states themselves (a prompt attends to itself)
    # Ring layers only: the new tokens' positions [B, T], which of them are real, and (a prefill) each row's
    # length, so that a ring keeps the row's last tokens.
    token_pos: torch.Tensor | None = None
    token_keep: torch.Tensor | None = None
    token_len: torch.Tensor | None = None
    # A decode step whose attention reads the pool in place (decode/ops/paged_attention.py): ``update`` writes
    # the new token and returns the pool's own tensors, gathering nothing.
    paged: bool = False


class _HostCounters:
    """Host-side state one cache shares with its row views (the views write the same storage): its counters, and
    the device tables its steps derive once from a model (:meth:`PagedKVCache.step_table`)."""

    __slots__ = ("num_updates", "tables")

    def __init__(self) -> None:
        self.num_updates = 0
        # owner module -> {key: tensor}: weakly keyed, so a table lives no longer than the module it came from.
        self.tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PagedKVLayer(CacheLayerMixin):
    """One layer's view of a :class:`PagedKVCache` (what ``cache.layers[i]`` holds)."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    supports_early_init = True

    def __init__(self, owner: "PagedKVCache", layer_idx: int):
        super().__init__()
        # A proxy, not a reference: the cache holds its layers, and a cycle would keep the pool alive after
        # release() until Python's cyclic collector happened to run.
        self._owner = weakref.proxy(owner)
        self.layer_idx = layer_idx
        self.keys = owner.pool.keys[layer_idx]  # token-major pool storage [slots, heads, dim]
        self.values = owner.pool.values[layer_idx]
        self.is_initialized = True
        self.device = self.keys.device
        self.max_cache_len = owner.capacity
        self.max_batch_size = self.batch_size = owner.batch_size
        self.num_heads = self.keys.shape[1]

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:  # storage exists from the start
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
        raise NotImplementedError("PagedKVCache pages have fixed addresses and cannot be offloaded")

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PagedKVCache does not reorder beams; beam search is delegated to transformers")

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("PagedKVCache does not support crop(); use reset_rows()")

    # transformers' linear-attention layer API (5.x), for state layers: the per-row states live in the owner.
    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self._owner.update_conv_state(conv_states, self.layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Any, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self._owner.update_recurrent_state(recurrent_states, self.layer_idx, state_idx, **kwargs)

    def increase_count(self, state_idx: int = 0) -> None:
        self._owner.increase_count(self.layer_idx, state_idx)

    def activate_past_recording(self, *args: Any, **kwargs: Any) -> None:
        self._owner.activate_past_recording(*args, **kwargs)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PagedKVCache has a fixed batch size; share pages through the block table")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("PagedKVCache has a fixed batch size; use copy_rows() to compact rows")


class PagedKVCache(Cache):
    """Per-row block tables, write positions and position ids over a :class:`~hybrid_engine.decode.kv_pool.KVPool`.

    ``capacity`` is the longest sequence one row may hold. Without ``pool``, the
    cache owns a pool in which row ``b`` holds pages ``1 + b * max_pages ...``
    for good (a self-contained cache, as for one ``prefill`` and decode loop);
    with ``pool``, every table entry starts at the null page and the owner
    assigns pages (:class:`~hybrid_engine.decode.kv_pool.PageLedger`).
    """

    def __init__(self, config: PretrainedConfig, batch_size: int, capacity: int, *,
                 page_size: int = DEFAULT_PAGE_SIZE, pool: KVPool | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 state_shapes: Shapes | None = None) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"PagedKVCache: batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"PagedKVCache: capacity must be a positive int, got {capacity!r}")
        limit = exact_length(config)
        if limit is not None and limit.tokens < capacity:
            raise ValueError(
                f"PagedKVCache: the config's {limit.why} makes this cache exact only up to {limit.tokens} tokens, "
                f"less than capacity {capacity}; use a capacity of at most {limit.tokens}"
            )
        if pool is None:
            if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
                raise ValueError(f"PagedKVCache: page_size must be a positive int, got {page_size!r}")
            if dtype is None:
                cfg_dtype = getattr(config, "dtype", None)  # 4.57 and 5.x; `torch_dtype` is deprecated
                dtype = cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.get_default_dtype()
            device = torch.device(device) if device is not None else torch.device("cpu")
            max_pages = pages_for(capacity, page_size)
            pool = KVPool(layer_specs(config), 1 + batch_size * max_pages, page_size, device=device, dtype=dtype)
            table = 1 + torch.arange(batch_size * max_pages, device=device).view(batch_size, max_pages)
            owns = True
        else:
            if len(pool.layers) != len(layer_specs(config)):
                raise ValueError(f"PagedKVCache: the pool has {len(pool.layers)} layers, the config "
                                 f"{len(layer_specs(config))}")
            max_pages = pages_for(capacity, pool.page_size)
            table = torch.full((batch_size, max_pages), NULL_PAGE, dtype=torch.int64, device=pool.device)
            owns = False
        i64 = dict(dtype=torch.int64, device=pool.device)
        linear = linear_layers(config)
        # Per-row states: state layers' (buffers of ``state_shapes``, the model's from model_support.state_shapes,
        # or, without them, made at the first write: probes and eager use only) and ring layers' last tokens.
        rings = {("ring", i, kv): ((s.ring, s.heads, s.key_dim if kv == 0 else s.value_dim), pool.dtype)
                 for i, s in enumerate(pool.layers) if s.ring for kv in (0, 1)}
        states = None
        if any(linear) or rings:
            store = StateStore(batch_size, pool.device, {**(state_shapes or {}), **rings},
                               lazy=state_shapes is None)
            states = StateView(store, slice(0, batch_size))
        self._setup(pool, table, torch.zeros(batch_size, **i64), torch.zeros(batch_size, **i64), capacity,
                    states=states, linear=linear)
        #: Whether this cache made its pool (row ``b`` then holds its pages for good).
        self._owns_pool = owns
        self._owns_states = states is not None

    def _setup(self, pool: KVPool, block_table: torch.Tensor, write_pos: torch.Tensor, position: torch.Tensor,
               capacity: int, host: _HostCounters | None = None, *, states: StateView | None = None,
               linear: list[bool] | None = None) -> None:
        self.pool = pool
        #: The rows' state-layer states and windowed rings (``None``: the model has neither).
        self.states = states
        self._linear = linear if linear is not None else [False] * len(pool.layers)
        self._owns_states = False
        #: Per layer: the tokens a windowed layer keeps per row, in a ring of the states (``None``: paged).
        self.rings = [s.ring for s in pool.layers]
        self.block_table = block_table
        self.write_pos = write_pos
        self.position = position
        self._capacity = capacity
        self._batch_size = block_table.shape[0]
        super().__init__(layers=[_PagedKVLayer(self, i) for i in range(len(pool.layers))])
        #: The current forward's indices (``None``: no forward runs; see :meth:`set_forward`).
        self.forward_indices: ForwardIndices | None = None
        self._check_updates = True  # whether ``update`` checks its inputs (not while capturing): set per forward
        #: Read write positions on the host to bounds-check each write (outside capture only).
        #: Owners that validate lengths up front (the engines) turn it off: it costs a sync per step.
        self.bounds_checks = True
        self._host = host if host is not None else _HostCounters()
        self._owns_host = host is None  # its step tables count in this cache's memory_bytes, not a view's
        self._owns_pool = False

    def set_forward(self, indices: ForwardIndices | None) -> None:
        """Set the indices of the forward about to run (``None``: it ran). While they are set, sequence-length
        queries answer a device tensor, as while capturing, so an eager step reads nothing on the host either.
        Whether a capture is running is asked here, once per forward, not at every layer's ``update``."""
        self.forward_indices = indices
        self._check_updates = indices is None or not is_capturing()

    @property
    def fresh(self) -> bool:
        """Whether the current forward is a prefill (attends over its own new states)."""
        return self.forward_indices is not None and self.forward_indices.fresh

    @property
    def num_updates(self) -> int:
        """``update`` calls on this cache's storage, through it or any row view (probes models that ignore it)."""
        return self._host.num_updates

    @num_updates.setter
    def num_updates(self, value: int) -> None:
        self._host.num_updates = value

    def step_table(self, owner: torch.nn.Module, key: tuple, make: Any) -> torch.Tensor:
        """A device tensor this cache's steps read, derived once from ``owner`` (a module) under ``key``:
        ``make()``, kept while this cache (and its row views) and ``owner`` live, so a graph captured on the
        cache reads the same tensor for as long as it can replay. One made while capturing is not kept: a
        capture runs none of its work, so its tensors hold their values only after a replay. A few keys per
        owner at most (say, a dtype): past :data:`MAX_STEP_TABLES` the owner's tables are made again."""
        tables = self._host.tables.get(owner)
        value = None if tables is None else tables.get(key)
        if value is None:
            value = make()
            if not is_capturing():
                if tables is None or len(tables) >= MAX_STEP_TABLES:
                    tables = self._host.tables[owner] = {}
                tables[key] = value
        return value

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
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_kv_heads(self) -> int:
        return self.pool.layers[0].heads

    @property
    def head_dim(self) -> int:
        return self.pool.layers[0].key_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

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
        return list(self._linear)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_croppable(self) -> bool:
        return False

    def span_tokens(self, span: int | None = None) -> int:
        """Tokens of each row that a step over ``span`` pages reads (``None``: all pages)."""
        return (self.max_pages if span is None else span) * self.page_size

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self._capacity

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._capacity

    def get_mask_sizes(self, query_length_or_cache_position: Any = None, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the K/V length the current forward returns (outside one: the whole table),
        offset 0.

        Accepts both the 4.57 form ``(cache_position, layer_idx)`` and the 5.x form ``(query_length, layer_idx)``.
        """
        return (self.forward_indices.kv_len if self.forward_indices is not None else self.span_tokens()), 0

    def get_seq_length(self, layer_idx: int | None = 0) -> Any:
        """``max(write_pos)``: a 0-dim device tensor inside a model step (:attr:`forward` set, by
        :mod:`hybrid_engine.decode.step`) and while capturing; a host int otherwise."""
        longest = self.write_pos.max()
        if self.forward_indices is not None or is_capturing():
            return longest
        return int(longest)

    def get_query_offset(self, layer_idx: int = 0) -> Any:
        """Logical index of the next query (rows written in lockstep); same type rules as :meth:`get_seq_length`."""
        return self.get_seq_length(layer_idx)

    def memory_bytes(self) -> int:
        """Bytes of the block table, per-row state and step tables (and of the pool, for a cache that made its
        own)."""
        own = self.block_table.nbytes + self.write_pos.nbytes + self.position.nbytes
        if self._owns_states:
            own += self.states.store.nbytes()
        if self._owns_host:
            own += sum(t.nbytes for tables in list(self._host.tables.values()) for t in tables.values())
        return own + (self.pool.memory_bytes() if self._owns_pool else 0)

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={len(self.layers)}, batch_size={self._batch_size}, capacity={self._capacity}, "
                f"page_size={self.page_size}, pool_pages={self.pool.num_pages}, dtype={self.dtype}, "
                f"device={self.device})")

    # ------------------------------------------------------------ indices
    def token_slots(self, logical: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Pool slots of each row's logical token indices ``logical [rows, T]`` (capture-safe); where ``keep``
        is false, the null page's first slot."""
        page_index = torch.div(logical, self.page_size, rounding_mode="floor").clamp_(0, self.max_pages - 1)
        slots = self.block_table.gather(1, page_index) * self.page_size + logical.remainder(self.page_size)
        return slots if keep is None else torch.where(keep, slots, NULL_PAGE * self.page_size)

    def span_write_slots(self, read_slots: torch.Tensor, write_pos: torch.Tensor,
                         keep: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows]``: the pool slot of each row's token at ``write_pos`` (inside its span), read off the span's
        slots ``read_slots`` (:meth:`span_slots`): one gather, not a page and offset computed again; where
        ``keep [rows, 1]`` is false, the null page's first slot, as :meth:`token_slots` gives. Rows past the span
        (only ones that are not kept may be) read its last slot."""
        table = read_slots.view(write_pos.shape[0], -1)
        slots = table.gather(1, write_pos.clamp(max=table.shape[1] - 1)[:, None])
        return (slots if keep is None else torch.where(keep, slots, NULL_PAGE * self.page_size)).flatten()

    def span_slots(self, span: int | None = None) -> torch.Tensor:
        """The pool slots of every row's first ``span`` pages (``None``: all), ``[rows * span_tokens]``
        (capture-safe)."""
        span = self.max_pages if span is None else span
        return self.pool.page_slots(self.block_table[:, :span]).flatten()

    # ----------------------------------------------------------------- update
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q_len, D]`` states at the forward's ``write_slots``; return them (``fresh``), else the
        rows' spans gathered from the pool (its ``read_slots``) as ``[B, H, span_tokens, D]``."""
        dtype = self.pool.dtype
        if (key_states.dtype != dtype or value_states.dtype != dtype) \
                and torch.is_autocast_enabled(key_states.device.type):
            # Autocast mixes dtypes (bf16 projections, fp32 RoPE): store each in the cache's dtype, as exactly as
            # transformers' DynamicCache keeps them, since attention under autocast casts its inputs down anyway.
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        if self._check_updates:
            self._check_update(layer_idx, key_states, value_states)
        if self.rings[layer_idx]:
            return self._update_ring(key_states, value_states, layer_idx, self.rings[layer_idx])
        b, h, t = key_states.shape[:3]
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        forward = self.forward_indices
        keys.index_copy_(0, forward.write_slots, key_states.transpose(1, 2).reshape(b * t, h, keys.shape[2]))
        values.index_copy_(0, forward.write_slots, value_states.transpose(1, 2).reshape(b * t, h, values.shape[2]))
        self._host.num_updates += 1
        if forward.fresh:
            return key_states, value_states
        if forward.paged:
            return keys, values
        if forward.read_pages is not None:
            pages, p = forward.read_pages, self.page_size
            return (keys.view(-1, p, h, keys.shape[2]).index_select(0, pages).view(b, -1, h, keys.shape[2])
                    .transpose(1, 2),
                    values.view(-1, p, h, values.shape[2]).index_select(0, pages).view(b, -1, h, values.shape[2])
                    .transpose(1, 2))
        read = forward.read_slots
        span = read.numel() // b
        return (keys.index_select(0, read).view(b, span, h, keys.shape[2]).transpose(1, 2),
                values.index_select(0, read).view(b, span, h, values.shape[2]).transpose(1, 2))

    def _update_ring(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                     ring: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A windowed layer: position ``p`` of a row goes to slot ``p % ring`` of its ring (a prefill writes only
        each row's last ``ring`` tokens); a step reads the whole ring, which :func:`~hybrid_engine.decode.step.
        build_ring_mask` masks by the position each slot holds."""
        forward = self.forward_indices
        pos, keep = forward.token_pos, forward.token_keep
        if forward.token_len is not None:
            keep = keep & (pos >= forward.token_len[:, None] - ring)
        slot = pos.remainder(ring)
        self.states.write_ring(("ring", layer_idx, 0), slot, keep, key_states.transpose(1, 2))
        self.states.write_ring(("ring", layer_idx, 1), slot, keep, value_states.transpose(1, 2))
        self.num_updates += 1
        if forward.fresh:
            return key_states, value_states
        return (self.states.read(("ring", layer_idx, 0)).transpose(1, 2),
                self.states.read(("ring", layer_idx, 1)).transpose(1, 2))

    def _check_update(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        spec = self.pool.layers[layer_idx]
        q_len = key_states.shape[2]
        expected_k = (self._batch_size, spec.heads, q_len, spec.key_dim)
        expected_v = (self._batch_size, spec.heads, q_len, spec.value_dim)
        if tuple(key_states.shape) != expected_k or tuple(value_states.shape) != expected_v:
            raise ValueError(
                f"PagedKVCache.update: key/value states of shape {tuple(key_states.shape)}/"
                f"{tuple(value_states.shape)} do not match the cache layout {expected_k}/{expected_v}"
            )
        if key_states.dtype != self.dtype or value_states.dtype != self.dtype:
            raise ValueError(
                f"PagedKVCache.update: key/value states have dtypes {key_states.dtype}/{value_states.dtype}, the "
                f"cache holds {self.dtype}; build the cache with dtype=model.dtype"
            )
        forward = self.forward_indices
        if forward is None or forward.write_slots.numel() != self._batch_size * q_len:
            raise ValueError("PagedKVCache.update: no write slots for this forward; run the model through "
                             "hybrid_engine.decode.step.prefill or decode_one_token")
        if not forward.fresh and (forward.read_slots is None or forward.read_slots.numel() % self._batch_size):
            raise ValueError("PagedKVCache.update: no read slots for this forward")

    def check_room(self, q_len: int, span: int | None = None) -> None:
        """Outside capture, with ``bounds_checks``: refuse ``q_len`` more tokens in a row past the capacity or
        ``span`` pages (``None``: all; one host read)."""
        if is_capturing() or not self.bounds_checks:
            return
        end = int(self.write_pos.max()) + q_len
        limit = min(self._capacity, self.span_tokens(span))
        if end > limit:
            what = "capacity" if limit == self._capacity else "span"
            raise ValueError(
                f"PagedKVCache: writing {q_len} token(s) at write position {end - q_len} would end at {end}, past "
                f"{what}={limit}; the cache is full"
            )

    # -------------------------------------------------------------- row views
    def rows_view(self, start: int, stop: int) -> "PagedKVCache":
        """A cache over rows ``start..stop-1`` sharing this cache's pool, tables and state.

        A graph captured on a view reads and writes exactly those rows, so graphs
        of several batch buckets share one allocation.
        """
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= self._batch_size):
            raise ValueError(f"PagedKVCache.rows_view: need 0 <= start < stop <= {self._batch_size}, got "
                             f"{start!r}, {stop!r}")
        view = PagedKVCache.__new__(PagedKVCache)
        view._setup(self.pool, self.block_table[start:stop], self.write_pos[start:stop], self.position[start:stop],
                    self._capacity, self._host, states=None if self.states is None else self.states.sub(
                        slice(start, stop)), linear=self._linear)
        view.bounds_checks = self.bounds_checks
        view._owns_pool = self._owns_pool
        return view

    def forward_view(self, block_table: torch.Tensor, write_pos: torch.Tensor, position: torch.Tensor,
                     states: StateView | None = None) -> "PagedKVCache":
        """A cache over some rows, given by their block table rows, write positions and position ids (tensors the
        caller made), sharing this cache's pool and host counters: what a prefill or an extend runs its forward
        on, so that the forward's writes land in those rows' pages."""
        view = PagedKVCache.__new__(PagedKVCache)
        view._setup(self.pool, block_table, write_pos, position, self._capacity, self._host, states=states,
                    linear=self._linear)
        return view

    def _rows(self, rows: torch.Tensor | Any, name: str, checked: bool = False) -> torch.Tensor:
        """``rows`` as an int64 device tensor; its range is checked (two host reads) unless ``checked``."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        if rows.dim() != 1:
            raise ValueError(f"PagedKVCache: {name} must be a 1-D tensor of row indices, got shape {tuple(rows.shape)}")
        if checked or is_capturing():
            return rows
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self._batch_size):
            raise ValueError(f"PagedKVCache: {name} must lie in 0..{self._batch_size - 1}")
        return rows

    def reset(self) -> None:
        """Every row empty (in place). A cache that owns its pool keeps its pages; a shared pool's rows let go
        of theirs (their owner frees them)."""
        if not self._owns_pool:
            self.block_table.fill_(NULL_PAGE)
        self.write_pos.zero_()
        self.position.zero_()

    def reset_rows(self, rows: torch.LongTensor, *, checked: bool = False) -> None:
        """Empty the given rows: no pages (shared pool), write position and position id 0."""
        rows = self._rows(rows, "rows", checked)
        if not self._owns_pool:
            self.block_table.index_fill_(0, rows, NULL_PAGE)
        self.write_pos.index_fill_(0, rows, 0)
        self.position.index_fill_(0, rows, 0)

    def copy_rows(self, src_rows: torch.LongTensor, dst_rows: torch.LongTensor, *, checked: bool = False) -> None:
        """Point rows ``dst_rows[i]`` at the pages of ``src_rows[i]`` and copy their lengths and positions.

        No K/V moves: the rows share pages afterwards, so moving a row (compaction) costs its table entry.
        Sources are gathered before anything is written, so overlapping sets are fine.
        """
        src = self._rows(src_rows, "src_rows", checked)
        dst = self._rows(dst_rows, "dst_rows", checked)
        if src.shape != dst.shape:
            raise ValueError(f"PagedKVCache.copy_rows: src_rows has {src.numel()} rows, dst_rows {dst.numel()}")
        for t in (self.block_table, self.write_pos, self.position):
            t.index_copy_(0, dst, t.index_select(0, src))
        if self.states is not None:  # a row's state moves with it (pages are shared, states are not)
            base = self.states.rows.start
            self.states.store.copy_rows(src + base, dst + base)

    # ------------------------------------------------- linear-attention states
    # transformers' linear-attention cache API (5.x), per row: a prefill (``fresh``) starts every state from
    # zero; later forwards continue them. A decode step's conv update writes the returned view in place.
    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self.fresh

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.states.read(("conv", layer_idx, state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """Keep the last ``conv_kernel_size`` inputs of each row; return what the convolution sees (the kept
        inputs before the new ones, or the new ones left-padded to the kernel)."""
        key = ("conv", layer_idx, state_idx)
        kernel = conv_kernel_size or conv_states.shape[-1]
        if self.fresh:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0))
        else:
            full = torch.cat([self.states.read(key).to(conv_states.dtype), conv_states], dim=-1)
        self.states.write(key, full[..., -kernel:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.states.read(("recurrent", layer_idx, state_idx))

    def update_recurrent_state(self, recurrent_states: torch.Tensor | list[torch.Tensor], layer_idx: int,
                               state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """Keep each row's state after the forward. 5.25+ may pass the states after each of the last tokens as a
        list (only when asked for by :meth:`get_recurrent_states_to_keep`, which answers 0): the last is kept."""
        if not isinstance(recurrent_states, torch.Tensor):
            recurrent_states = recurrent_states[-1]
        self.states.write(("recurrent", layer_idx, state_idx), recurrent_states)
        return recurrent_states

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """5.25+: a decode step's conv kernel updated the state in place. Nothing to count: each row's length is
        ``write_pos``, which the step functions advance on the device."""
        return None

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """5.25+: intermediate recurrent states a forward should return for a later ``crop``: none (no crop)."""
        return 0

    def activate_past_recording(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("PagedKVCache does not record past states for crop() (assisted decoding is "
                                  "delegated to transformers' own generate)")

    # ------------------------------------------------- the rest of transformers' Cache API
    # Pages have fixed addresses that captured graphs read, and rows are compacted through the block table: what
    # would move or reshape storage is refused with the alternative named.
    def early_initialization(self, *args: Any, **kwargs: Any) -> None:  # storage exists from the start
        return None

    def prefetch(self, layer_idx: int = 0, only_non_sliding: bool = True) -> None:
        return None

    def offload(self, layer_idx: int = 0, only_non_sliding: bool = True) -> None:
        raise NotImplementedError("PagedKVCache pages have fixed addresses and cannot be offloaded")

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("PagedKVCache does not support crop(); use reset_rows()")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PagedKVCache does not reorder beams; beam search is delegated to transformers")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PagedKVCache has a fixed batch size; share pages through the block table")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("PagedKVCache has a fixed batch size; use copy_rows() to compact rows")

    def update_indexer(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("PagedKVCache does not keep sparse-attention indexer keys (DeepSeek-V3.2-style "
                                  "indexed attention runs on transformers' own cache)")
