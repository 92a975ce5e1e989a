"""Prompts prefilled ahead in batches, and admission rounds that only point slots at them: both graphed.

Continuous batching admits requests many times per call, a few at a time. If
every round prefilled its own prompts, each round would pay a whole forward's
fixed cost, and the scheduler would have to hold free slots idle to batch
rounds. So a rollout separates the two: :func:`prefill_staged` prefills the
distinct prompts of the next requests, each once per call however many rounds
its samples are admitted in, and :func:`admission_round` admits a round of
requests whose prompts are staged, sharing their full pages.

What a capture freezes: the number of prompt rows (exact up to
:data:`~hybrid_engine.graphs.buffers.EXACT_PROMPT_ROWS`, then the decode
buckets) and the staged width for a prefill; the number of request rows (decode
buckets) and the sampling mode for a round. Everything per batch or round is
device data in the stage: the prompts (right-aligned), their block tables, and
one ``meta`` row per request (:data:`META`, then its slot's block table row).
Eager and graph runs use the same staged shapes (:class:`PromptStage`), so
their tokens are identical.

``engine.generate`` admits its batch once per call, at its exact width (as
transformers prefills it), and does not stage.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from hybrid_engine.accelerator.host_copy import CountsHostSyncs, device_tensor
from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.kv_pool import KVPool
from hybrid_engine.decode.linear_states import StateStore
from hybrid_engine.decode.model_support import state_shapes
from hybrid_engine.decode.slots import DecodeSlots, choose_tokens, logits_width
from hybrid_engine.decode.step import prefill

__all__ = ["META", "PromptStage", "StagedPrompts", "StagedRequests", "admission_round", "prefill_staged",
           "staged_width_within", "start_from_logits", "width_bucket"]

#: The columns of one request's ``meta`` row, before its slot's block table row: the slot, the stage row of its
#: prompt, its sampler stream, its budget, its EOS floor, the seed, its prompt's real tokens,
#: and the page copied (source) into its own last page (destination).
META = ("slot", "row", "stream", "budget", "min_tokens", "seed", "length", "copy_src", "copy_dst", "knob")


def width_bucket(width: int) -> int:
    """The staged prompt width for prompts of ``width`` tokens: a power of two, at least 8."""
    return max(8, 1 << (width - 1).bit_length())


def staged_width_within(longest: int, room: int) -> int:
    """The staged width for prompts of at most ``longest`` real tokens within ``room`` cache slots (a configured
    cache capacity less ``max_new_tokens``): a power of two where one fits, else a multiple of 64, else ``room``.
    Few distinct widths, so few prefill graphs, whatever ``max_new_tokens`` is."""
    for width in (width_bucket(longest), -(-longest // 64) * 64):
        if width <= room:
            return width
    return room


class StagedPrompts(NamedTuple):
    """A prefill batch's device inputs and outputs, views of a :class:`PromptStage` at fixed addresses."""

    ids: torch.Tensor  # [P, W] prompts, right-aligned
    mask: torch.Tensor  # [P, W]
    cache: PagedKVCache  # P rows: each prompt's pages
    logits: torch.Tensor  # [P, V] float32: each prompt's last-position logits


class StagedRequests(NamedTuple):
    """An admission round's device inputs, views of a :class:`PromptStage` at fixed addresses."""

    logits: torch.Tensor  # [rows, V] float32
    meta: torch.Tensor  # [R, len(META) + max_pages]
    states: StateStore | None  # the prompts' linear-attention states (None: no such layer)


class PromptStage:
    """Static buffers for prefill batches and admission rounds at the largest shape a call needs.

    ``rows`` prompt rows ``width`` wide (ids, mask, block tables into ``pool``,
    logits) and ``requests`` request rows of ``meta``, each followed by a block
    table row of ``max_pages`` (the slots'). A batch of ``p`` prompts goes into
    the smallest prompt bucket holding it, a round of ``r`` requests into the
    smallest request bucket. Prompt rows past a batch's prompts keep stale
    prompts no request reads; request rows past a round's requests repeat the
    last request, so their writes are identical duplicates.
    """

    def __init__(self, model: PreTrainedModel, rows: int, width: int, *, pool: KVPool, requests: int,
                 max_pages: int) -> None:
        device = pool.device
        self.rows = rows
        self.width = width
        self.requests = requests
        self.max_pages = max_pages
        self.ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.mask = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.meta = torch.zeros(requests, len(META) + max_pages, dtype=torch.int64, device=device)
        # float32 holds any logits dtype exactly, and the sampler computes in float32 anyway.
        self.logits = torch.zeros(rows, logits_width(model), dtype=torch.float32, device=device)
        self.cache = PagedKVCache(model.config, rows, width, pool=pool, state_shapes=state_shapes(model))
        self.cache.bounds_checks = False
        self._prompt_views: dict[tuple[int, int], StagedPrompts] = {}
        self._request_views: dict[int, StagedRequests] = {}

    @property
    def pool(self) -> KVPool:
        return self.cache.pool

    def fits(self, rows: int, width: int, pool: KVPool, vocab: int, requests: int, max_pages: int) -> bool:
        """Whether ``rows`` prompt rows ``width`` wide and ``requests`` request rows of ``max_pages`` fit."""
        return (self.rows >= rows and self.width >= width and self.requests >= requests
                and self.max_pages == max_pages and self.pool is pool and self.logits.shape[1] == vocab)

    def prompts_view(self, prompts: int, width: int) -> StagedPrompts:
        """The ``(prompts, width)`` prefill bucket's views (fixed addresses)."""
        view = self._prompt_views.get((prompts, width))
        if view is None:
            view = self._prompt_views[(prompts, width)] = StagedPrompts(
                self.ids[:prompts, :width], self.mask[:prompts, :width], self.cache.rows_view(0, prompts),
                self.logits[:prompts])
        return view

    def requests_view(self, requests: int) -> StagedRequests:
        """The ``requests`` admission bucket's views (fixed addresses)."""
        view = self._request_views.get(requests)
        if view is None:
            states = None if self.cache.states is None else self.cache.states.store
            view = self._request_views[requests] = StagedRequests(self.logits, self.meta[:requests], states)
        return view

    def stage_prompts(self, ids: torch.Tensor, mask: torch.Tensor, tables: list[list[int]], prompts: int,
                      width: int, counters: CountsHostSyncs | None = None) -> StagedPrompts:
        """Copy a batch's left-padded prompts ``[p, w]`` into its bucket, right-aligned (prompt ``i`` at row
        ``i``), and their pages (``tables[i]``, the prompt's pages in order) into the stage's block table."""
        p, w = ids.shape
        view = self.prompts_view(prompts, width)
        view.mask[:p, : width - w].zero_()
        view.mask[:p, width - w:].copy_(mask)
        view.ids[:p, width - w:].copy_(ids)
        pages = self.cache.max_pages
        rows = [table + [0] * (pages - len(table)) for table in tables]
        self.cache.block_table[:p].copy_(device_tensor(rows, self.cache.device, counters=counters))
        return view

    def stage_requests(self, meta: list[list[int]], requests: int,
                       counters: CountsHostSyncs | None = None) -> StagedRequests:
        """Copy a round's per-request rows (each :data:`META` then a slot block table row) into its bucket."""
        view = self.requests_view(requests)
        rows = [row + [0] * (len(META) + self.max_pages - len(row)) for row in meta]
        rows += rows[-1:] * (requests - len(rows))  # pad by repeating the last request
        view.meta.copy_(device_tensor(rows, view.meta.device, counters=counters))
        return view

    def memory_bytes(self) -> int:
        return (int(self.cache.memory_bytes()) + self.ids.nbytes + self.mask.nbytes + self.meta.nbytes
                + self.logits.nbytes)


def prefill_staged(model: PreTrainedModel, staged: StagedPrompts) -> None:
    """Prefill a staged batch into its prompts' pages and keep each prompt's last logits (captured for rollouts).

    The batch is the distinct prompts of the next requests of the queue; the host has given each prompt its
    pages and written them into the stage's block table (:meth:`PromptStage.stage_prompts`). The logits kept are
    the last position's, in float32. Prompt rows are bounded by a token budget
    (:data:`~hybrid_engine.graphs.buffers.PREFILL_TOKEN_BUDGET`), as vLLM bounds a step's prefill tokens: a
    captured prefill keeps its activations in the graph pool for good."""
    staged.logits.copy_(prefill(model, staged.cache, staged.ids, staged.mask, checked=True))


def admission_round(slots: DecodeSlots, staged: StagedRequests, sampling_key: tuple[float, float, int]) -> None:
    """One admission round of staged prompts, entirely in device tensors (captured for rollouts).

    Each slot's block table row becomes its prompt's full pages, shared by every
    sample of the prompt, and its own copy of the partly filled last page
    (copy-on-write: the sample writes its response there; a prompt's last sample
    takes the page itself, and copying a page onto itself is a no-op). Its first
    token is picked from its prompt's logits with the decode step's sampler
    (token 0 of its counters), and the slot is started.
    """
    meta = staged.meta
    slot, row, stream, budget, min_tokens, seed, length, copy_src, copy_dst, knob = meta[:, : len(META)].t()
    cache = slots.cache
    cache.block_table.index_copy_(0, slot, meta[:, len(META):])
    cache.pool.copy_pages(copy_src, copy_dst)
    if staged.states is not None:  # each sample gets its own copy of its prompt's state
        cache.states.store.copy_rows(row, slot, source=staged.states)
    cache.write_pos.index_copy_(0, slot, length)
    cache.position.index_copy_(0, slot, length)
    start_from_logits(slots, staged.logits, slot, row, stream, budget, min_tokens, seed, sampling_key, knob)


def start_from_logits(slots: DecodeSlots, logits: torch.Tensor, slot: torch.Tensor, source: torch.Tensor,
                      stream: torch.Tensor, budget: torch.Tensor, min_tokens: torch.Tensor,
                      seed: torch.Tensor, sampling_key: tuple[float, float, int], knob: torch.Tensor) -> None:
    """Start requests whose prompts are already in their slots (per-request device tensors): each one's first
    token is picked from its source row of the prefill ``logits`` with the decode step's sampler (token 0 of
    its counters). Capture-safe."""
    tokens, logprobs, top_ids, top_lp = choose_tokens(
        logits.index_select(0, source), sampling_key, eos_mask=slots.eos_mask, suppress_eos=min_tokens > 0,
        seed=seed, stream=stream, token_index=0,
        knobs=slots.knobs.for_rows(knob), top=slots.top_logprobs,
    )
    slots.start(slot, tokens, logprobs, seed=seed, stream=stream, budget=budget,
                min_tokens=min_tokens, first_top=(top_ids, top_lp), knob=knob)
