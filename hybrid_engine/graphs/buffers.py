"""DecodeBuffers: the device storage a runner's graphs read and write, its sizing and its growth.

Why it is its own object: a captured graph reads every buffer by address, so
what matters to the graphs is one question, "has any storage moved since the
capture?". :attr:`DecodeBuffers.epoch` answers it: it changes whenever any
tensor a graph reads is reallocated (the page pool, the slots, the prompt
stage) or released, and the runner folds it into the fingerprint it checks
before replaying (:meth:`~hybrid_engine.graphs.runner.DecodeGraphRunner.prepare`),
so a graph captured against old storage can never replay.

What lives on the device: one :class:`~hybrid_engine.decode.kv_pool.KVPool` of
K/V pages (its host :class:`~hybrid_engine.decode.kv_pool.PageLedger` says
which page is whose), one :class:`~hybrid_engine.decode.slots.DecodeSlots`
allocated at the largest batch bucket a call needs (bucket ``n`` runs on its
``[:n]`` head, at the same addresses) and, for staged admission, one
:class:`~hybrid_engine.decode.staging.PromptStage`. Unconfigured, all of them
only grow, by half at least, so calls a little larger each time reallocate (and
recapture) rarely; a configured page budget makes the pool exactly that size.

The ladders live here too, since they size the storage: batch buckets
(:meth:`DecodeBuffers.bucket_for`), prompt-row buckets
(:meth:`DecodeBuffers.prompt_rows_for`, bounded by :data:`PREFILL_TOKEN_BUDGET`)
and span buckets (:meth:`DecodeBuffers.span_for`: pages a row's attention reads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.kv_pool import (
    DEFAULT_PAGE_SIZE,
    KVBudget,
    KVPool,
    LayerSpec,
    PageLedger,
    pages_for,
    pool_pages,
)
from hybrid_engine.decode.layout import exact_length, layer_specs
from hybrid_engine.decode.linear_states import StateStore
from hybrid_engine.decode.slots import DecodeSlots, vocab_sizes
from hybrid_engine.decode.staging import PromptStage
from hybrid_engine.exact.mode import uses_exact_attention
from hybrid_engine.graphs.keys import default_graph_buckets
from hybrid_engine.model_access import model_device

__all__ = ["DecodeBuffers", "EXACT_PROMPT_ROWS", "PREFILL_TOKEN_BUDGET"]


#: Prefill batches of up to this many prompts run at their exact count (above it, in the decode buckets):
#: a padding row costs a whole prefill of the staged width, where a decode step's padding row costs one token.
EXACT_PROMPT_ROWS = 8


#: Prompt tokens (rows x staged width) one staged prefill batch holds at most, as vLLM's
#: ``max_num_batched_tokens`` bounds a step's prefill: the admission stage has
#: ``min(slots, max(EXACT_PROMPT_ROWS, PREFILL_TOKEN_BUDGET // staged width))`` prompt rows (rounded down to a
#: prompt-row bucket). A captured prefill keeps its activations in the graph pool for good, so with one prompt row
#: per slot the pool would grow with slots x width (3x the slots' own K/V at 256 slots of 256-token prompts on a
#: tiny model); bounded, more prompts than fit are prefilled in more batches, each prompt still once per call.
#: At least :data:`EXACT_PROMPT_ROWS` prompts a batch, however wide they are.
PREFILL_TOKEN_BUDGET = 8192


class DecodeBuffers:
    """The page pool, its ledger, the decode slots and the prompt stage of one runner (see the module docstring).

    ``buckets`` fixes the batch buckets (``None``: :func:`default_graph_buckets`,
    unbounded). ``on_move`` is called right before storage moves (after the
    epoch changed), so that whoever holds graphs over the old storage can free
    them before the new storage is allocated: the old and the new are never
    both held.
    """

    def __init__(self, model: PreTrainedModel, buckets: tuple[int, ...] | None = None, *,
                 on_move: Callable[[], None] | None = None) -> None:
        self.model = model
        self.buckets = tuple(sorted(set(buckets))) if buckets else None
        self.slots: DecodeSlots | None = None
        self.stage: PromptStage | None = None
        #: The K/V page pool the slots and the stage point into, and its host ledger.
        self.kv_pool: KVPool | None = None
        self.ledger: PageLedger | None = None
        #: The width prompts are staged at this call (set by :meth:`allocate` when it is given one).
        self.prompt_width = 0
        #: Changes whenever storage a graph reads moves (reallocation, growth, release).
        self.epoch = 0
        self._on_move = on_move

    # --------------------------------------------------------------- ladders
    def bucket_for(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows."""
        sizes = self.buckets or default_graph_buckets(n)
        return next((s for s in sizes if s >= n), n)

    def buckets_up_to(self, top: int) -> tuple[int, ...]:
        """The bucket ladder as far as it goes for ``top`` rows."""
        return self.buckets or default_graph_buckets(top)

    def prompt_rows_for(self, n: int) -> int:
        """The prompt rows a prefill batch of ``n`` prompts runs: ``n`` up to :data:`EXACT_PROMPT_ROWS`,
        else the smallest decode bucket holding them."""
        return n if n <= EXACT_PROMPT_ROWS else self.bucket_for(n)

    def stage_rows(self, slots: int, width: int) -> int:
        """The admission stage's prompt rows for ``slots`` slots at staged ``width``: as many as the slots, at most
        :data:`PREFILL_TOKEN_BUDGET` tokens (at least :data:`EXACT_PROMPT_ROWS` rows), and a count that
        :meth:`prompt_rows_for` keeps (rounded down to a bucket), so any batch of up to that many prompts fits."""
        limit = min(slots, max(EXACT_PROMPT_ROWS, PREFILL_TOKEN_BUDGET // width))
        if self.prompt_rows_for(limit) > limit:  # between two buckets: the largest bucket below it
            sizes = self.buckets_up_to(limit)
            limit = max([EXACT_PROMPT_ROWS] + [b for b in sizes if b <= limit])
        return limit

    def span_for(self, tokens: int) -> int:
        """The span bucket (pages each row's attention reads) for rows of up to ``tokens`` tokens: the next
        power of two pages, within the slots' pages."""
        pages = max(1, pages_for(tokens, self.kv_pool.page_size))
        return min(1 << (pages - 1).bit_length(), self.slots.cache.max_pages)

    def spans_between(self, shortest: int, longest: int) -> list[int]:
        """The span buckets rows of ``shortest`` to ``longest`` tokens read."""
        spans, span = [], self.span_for(shortest)
        while True:
            spans.append(span)
            if span >= self.span_for(longest):
                return spans
            span = self.span_for(span * self.kv_pool.page_size + 1)

    def key_bound(self) -> int:
        """How many decode graphs one sampling mode can reach at most on these slots (buckets x span buckets)."""
        if self.slots is None:
            return 0
        sizes = self.buckets_up_to(self.slots.rows)
        spans = self.slots.cache.max_pages.bit_length() + 1  # 1, 2, 4, ... pages, and the whole row
        return len([b for b in sizes if b <= self.slots.rows]) * spans

    # ------------------------------------------------------------ allocation
    def allocate(self, *, rows: int, capacity: int, num_eos: int, budget: KVBudget | None = None,
                 prompt_width: int | None = None, top_logprobs: int = 0) -> DecodeSlots:
        """Storage for a call: a page pool, slots for ``rows`` concurrent rows, a prompt stage when
        ``prompt_width`` is given. What fits is kept (same addresses, same epoch); what does not is reallocated.

        The pool holds what ``budget`` says (:func:`~hybrid_engine.decode.kv_pool.pool_pages`; the null page
        comes on top; ``None``: unconfigured, pages of :data:`~hybrid_engine.decode.kv_pool.DEFAULT_PAGE_SIZE`).
        The slots' rows reach ``capacity`` tokens, and their output rows span it too. ``prompt_width`` (the width
        prompts are staged at): request rows for a round on every slot, prompt rows within
        :data:`PREFILL_TOKEN_BUDGET` (:meth:`stage_rows`).
        """
        model = self.model
        device = model_device(model)
        dtype = next(model.parameters()).dtype
        if budget is None:
            budget = KVBudget(DEFAULT_PAGE_SIZE, None, None, "kv_cache", 1, 1)
        need = self.bucket_for(rows)
        slots = self.slots
        limit = exact_length(model.config)
        same_kind = slots is not None and slots.device == device and slots.dtype == dtype
        if same_kind and capacity > slots.capacity:  # grow by half at least: calls a little longer each time (a
            # response-length schedule) then rebuild the buffers and recapture a few times, not every call
            grown = max(capacity, slots.capacity + slots.capacity // 2)
            # never past a sliding window the call itself fits in
            capacity = grown if limit is None else max(capacity, min(grown, limit.tokens))
        if same_kind:
            need, capacity = max(need, slots.rows), max(capacity, slots.capacity)
            num_eos = max(num_eos, slots.num_eos_slots)
            top_logprobs = max(top_logprobs, slots.top_logprobs)
        stage_width = max(prompt_width or 0, self.stage.width if self.stage is not None else 0)
        # Windowed layers keep rings of their window per row where the rows reach past twice it (not in the exact
        # mode, whose attention sums key blocks in position order).
        specs = layer_specs(model.config, capacity=None if uses_exact_attention(model) else capacity)
        page_bytes = sum(s.paged_elements for s in specs) * dtype.itemsize * budget.page_size
        pages, fixed = pool_pages(budget, page_bytes=page_bytes, slots=need, capacity=capacity,
                                  stage_rows=self.stage_rows(need, stage_width) if prompt_width else 0,
                                  stage_width=stage_width)
        if not fixed and self.ledger is not None:  # rows kept for later calls hold pages on top of this call's
            pages += self.ledger.held_pages
        self._allocate_pool(specs, pages + 1, budget.page_size, fixed, device, dtype)
        slots = self._allocate_slots(need, capacity, num_eos, top_logprobs)
        # Checked on allocation too: the config may have changed since.
        if limit is not None and limit.tokens < slots.capacity:
            raise ValueError(
                f"the model's config now has {limit.why}, which makes the paged cache exact only up to "
                f"{limit.tokens} tokens, less than the decode cache's capacity {slots.capacity}; use a capacity of at most "
                f"{limit.tokens}"
            )
        if prompt_width is not None:
            self.prompt_width = prompt_width
            self._allocate_stage(need, prompt_width)
        return slots

    def _moving(self) -> None:
        """Storage a graph reads is about to move: a new epoch, and the holder of graphs lets go of them."""
        self.epoch += 1
        if self._on_move is not None:
            self._on_move()

    def _allocate_pool(self, specs: list[LayerSpec], num_pages: int, page_size: int, fixed: bool,
                       device: torch.device, dtype: torch.dtype) -> None:
        """Keep the page pool when the call fits it (exactly its size when ``fixed``), else build a new one."""
        pool = self.kv_pool
        same_kind = (pool is not None and pool.device == device and pool.dtype == dtype
                     and pool.page_size == page_size and pool.layers == tuple(specs))
        if same_kind and (pool.num_pages == num_pages if fixed else pool.num_pages >= num_pages):
            return
        if same_kind and not fixed:
            num_pages = max(num_pages, pool.num_pages + pool.num_pages // 2)
        ledger = self.ledger
        # Rows kept for later calls (episodes between turns) move into a larger pool of the same layout.
        carry = same_kind and ledger is not None and ledger.held_rows and num_pages >= pool.num_pages
        self.release()  # the slots and the stage point into the old pool: free them before allocating
        self.kv_pool = KVPool(specs, num_pages, page_size, device=device, dtype=dtype)
        if carry:
            self.kv_pool.copy_from(pool)
            ledger.grow(num_pages)
            self.ledger = ledger
        else:
            self.ledger = PageLedger(num_pages)

    def _allocate_slots(self, need: int, capacity: int, num_eos: int, top_logprobs: int) -> DecodeSlots:
        """Keep the slots when the call fits them, else allocate new ones (the old ones freed first)."""
        slots, pool = self.slots, self.kv_pool
        if slots is None or not slots.fits(need, capacity, num_eos, pool, vocab_sizes(self.model),
                                           top_logprobs):
            self._moving()
            self.slots = slots = None  # free the old buffers before allocating the new ones
            self.slots = slots = DecodeSlots(self.model, need, capacity, num_eos=num_eos, pool=pool,
                                             top_logprobs=top_logprobs)
        return slots

    def _allocate_stage(self, need: int, prompt_width: int) -> None:
        """Keep the prompt stage when the call fits it, else allocate a new one. Prompt rows within the token
        budget at the stage's width (it only grows), request rows for a round as many as the slots: a batch of
        this call's narrower prompts stays within the budget too."""
        stage, slots, pool = self.stage, self.slots, self.kv_pool
        reusable = stage is not None and stage.pool is pool
        stage_width = max(prompt_width, stage.width) if reusable else prompt_width
        max_pages = slots.cache.max_pages
        if stage is None or not stage.fits(self.stage_rows(need, stage_width), prompt_width, pool,
                                           vocab_sizes(self.model)[0], need, max_pages):
            requests = max(need, slots.rows)
            self._moving()
            self.stage = None
            self.stage = PromptStage(self.model, self.stage_rows(requests, stage_width), stage_width, pool=pool,
                                     requests=requests, max_pages=max_pages)

    def release(self) -> None:
        """Drop every buffer, the page pool included (the next :meth:`allocate` allocates again)."""
        self._moving()
        self.slots = None
        self.stage = None
        self.kv_pool = None
        self.ledger = None

    # ------------------------------------------------------------ sleep/wake
    def state_stores(self) -> list[StateStore]:
        """The rings' and linear states' stores of the slots and of the stage (those that have one)."""
        return [c.states.store for c in self.caches() if c.states is not None]

    @property
    def releasable(self) -> bool:
        """Whether :meth:`sleep` can release every buffer it releases at fixed addresses (else it drops them)."""
        return self.kv_pool is not None and self.kv_pool.releasable and all(
            s.releasable for s in self.state_stores())

    @property
    def asleep(self) -> bool:
        """Whether the page pool's or any state store's memory is released (:meth:`sleep`); nothing may read them
        until :meth:`wake`."""
        return self.kv_pool is not None and (self.kv_pool.asleep or any(s.asleep for s in self.state_stores()))

    def sleep(self) -> bool:
        """Release the page pool's memory and the rings' and linear states' (``"kv_cache"``); returns whether
        anything was released. Every held row (an episode's K/V between turns) is evicted first, since the
        contents go: its next turn prefills again. Where all of them have releasable storage the addresses and
        the :attr:`epoch` stay (every graph stays valid); elsewhere the buffers are dropped (a new epoch: the next
        call allocates and captures again). Between calls only, the device synchronised by the caller."""
        pool, ledger = self.kv_pool, self.ledger
        if pool is None or self.asleep:
            return False
        if ledger is not None:
            ledger.evict(ledger.capacity)  # every held row gives its pages back
            ledger.reclaim()
        if not self.releasable:
            self.release()
            return True
        pool.sleep()
        for store in self.state_stores():
            store.sleep()
        return True

    def wake(self) -> bool:
        """Take the memory back (:meth:`KVPool.wake`, :meth:`StateStore.wake`: NaN from the backend, then every
        page and state zeroed). A backend that reallocated moves the epoch and drops the slots and the stage
        pointing into the old storage; returns whether it did (the graphs over them are gone)."""
        if not self.asleep:
            return False
        moved = self.kv_pool.wake() if self.kv_pool.asleep else False
        for store in self.state_stores():
            if store.asleep:
                moved = store.wake() or moved
        if moved:
            self._moving()
            self.slots = None
            self.stage = None
        return moved

    # ----------------------------------------------------------------- reads
    def caches(self) -> list[PagedKVCache]:
        """The caches of the slots and of the stage (those that exist)."""
        return [b.cache for b in (self.slots, self.stage) if b is not None]

    def memory_bytes(self) -> int:
        """Bytes of the slots, the stage and the page pool held now (released storage counts 0)."""
        total = sum(b.memory_bytes() for b in (self.slots, self.stage) if b is not None)
        return total + (self.kv_pool.memory_bytes() if self.kv_pool is not None else 0)
