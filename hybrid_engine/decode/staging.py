"""Prompts prefilled ahead in batches, and admission rounds that only load them: both graphed like a decode step.

Continuous batching admits requests many times per call, a few at a time. If
every round prefilled its own prompts, each round would pay a whole forward's
fixed cost (about two and a half replayed decode steps on the CPU emulation,
a launch-bound forward on a GPU), and the scheduler would have to hold free
slots idle to batch rounds. So a rollout separates the two:

* :func:`prefill_staged` prefills the distinct prompts of the next requests
  of the queue (as many prompts as the stage has rows, however many samples
  each has) into the :class:`PromptStage` cache, and keeps each one's
  last-position logits (float32) there. With shared prefill each prompt is
  prefilled once per call, however many rounds its samples are admitted in.
  The stage's prompt rows are bounded by a token budget
  (:data:`~hybrid_engine.graphs.runner.PREFILL_TOKEN_BUDGET` over the staged
  width, as vLLM bounds a step's prefill tokens), not by the slots: a captured
  prefill keeps its activations in the graph pool for good, and a slot-wide
  batch of wide prompts would hold several times the slots' own K/V there.
* :func:`admission_round` admits a round of requests whose prompts are staged:
  their K/V are copied into their slots (shared prompts fan out by stage row),
  each one's first token is picked from its prompt's logits with the decode
  step's sampler (token 0 of its counters), and the slots are set up. That is
  about a quarter of a decode step on CPU, so rounds are cheap and slots
  rarely wait.

The runner warms up, captures and replays both per key
(:class:`~hybrid_engine.graphs.keys.PrefillKey`,
:class:`~hybrid_engine.graphs.keys.AdmissionKey`). What a capture freezes:
the number of prompt rows (exact up to
:data:`~hybrid_engine.graphs.runner.EXACT_PROMPT_ROWS`, since a padding row
would cost a whole prefill, then the decode buckets), the number of request
rows (decode buckets: a request row costs only its sampling), the staged
width (the call's padded prompt width, rounded up to a power of two, the same
for every batch of a call) and the sampling mode (the knobs' values are device
data, :class:`~hybrid_engine.decode.sampling.SamplingKnobs`). A round may hold as
many requests as there are slots (the stage's request columns are slot-wide);
the prompts it reads are the stage's rows, so a round whose prompts are not
all staged runs as parts, the next prefill batch before each. Everything per
batch or round is device data in the stage: the prompts (right-aligned, the
columns before them masked out) and one ``meta`` column per request (slot,
stage row of its prompt, request index, budget, min_tokens, seed). Prompt
rows past a batch's prompts keep stale prompts that no request reads; request
columns past a round's requests repeat the last request, so their writes are
identical duplicates. Masked columns add exact zeros to attention, so staging
changes a prompt's result no more than another padding width does; eager and
graph runs use the same staged shapes, so their tokens are identical.

``engine.generate`` admits its batch once per call, at its exact width (as
transformers prefills it), and does not stage.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from hybrid_engine.decode.kv_cache import StaticKVCache
from hybrid_engine.decode.slots import DecodeSlots, choose_tokens, logits_width
from hybrid_engine.decode.step import prefill

__all__ = ["PromptStage", "StagedPrompts", "StagedRequests", "start_from_logits", "admission_round", "prefill_staged",
           "staged_width_within", "width_bucket"]


def width_bucket(width: int) -> int:
    """The staged prompt width for prompts of ``width`` tokens: a power of two, at least 8."""
    return max(8, 1 << (width - 1).bit_length())


def staged_width_within(longest: int, room: int) -> int:
    """The staged width for prompts of at most ``longest`` real tokens within ``room`` cache slots (a configured
    cache capacity less ``max_new_tokens``): a power of two where one fits, else a multiple of 64, else ``room``.
    Few distinct widths, so few prefill and admission graphs, whatever ``max_new_tokens`` is."""
    for width in (width_bucket(longest), -(-longest // 64) * 64):
        if width <= room:
            return width
    return room


class StagedPrompts(NamedTuple):
    """A prefill batch's device inputs and outputs, views of an :class:`PromptStage` at fixed addresses."""

    ids: torch.Tensor  # [P, W] prompts, right-aligned
    mask: torch.Tensor  # [P, W]
    cache: StaticKVCache  # P rows, W slots: where the prompts are prefilled
    logits: torch.Tensor  # [P, V] float32: each prompt's last-position logits


class StagedRequests(NamedTuple):
    """An admission round's device inputs, views of an :class:`PromptStage` at fixed addresses."""

    cache: StaticKVCache  # every stage row, W slots: the staged prompts the requests read
    logits: torch.Tensor  # [rows, V] float32
    meta: torch.Tensor  # [6, R]: slot, stage row of the prompt, request index, budget, min_tokens, seed


class PromptStage:
    """Static buffers for prefill batches and admission rounds at the largest shape a call needs.

    ``rows`` prompt rows ``width`` wide (ids, mask, K/V cache, logits) and
    ``requests`` request columns of ``meta`` (default ``rows``). A batch of
    ``p`` prompts ``w`` wide goes into the smallest prompt bucket holding it, a
    round of ``r`` requests into the smallest request bucket (see the module
    docstring for what is padded and how).
    """

    META_ROWS = 6

    def __init__(self, model: PreTrainedModel, rows: int, width: int, *, device: torch.device,
                 dtype: torch.dtype, requests: int | None = None) -> None:
        self.rows = rows
        self.width = width
        self.requests = rows if requests is None else requests
        self.ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.mask = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.meta = torch.zeros(self.META_ROWS, self.requests, dtype=torch.int64, device=device)
        # float32 holds any logits dtype exactly, and the sampler computes in float32 anyway.
        self.logits = torch.zeros(rows, logits_width(model), dtype=torch.float32, device=device)
        self.cache = StaticKVCache(model.config, rows, width, device=device, dtype=dtype)
        self.cache.bounds_checks = False
        self._prompt_views: dict[tuple[int, int], StagedPrompts] = {}
        self._request_views: dict[tuple[int, int], StagedRequests] = {}

    def fits(self, rows: int, width: int, device: torch.device, dtype: torch.dtype, vocab: int,
             requests: int | None = None) -> bool:
        """Whether ``rows`` prompt rows ``width`` wide and ``requests`` request columns (default ``rows``) fit."""
        requests = rows if requests is None else requests
        return (self.rows >= rows and self.width >= width and self.requests >= requests
                and self.ids.device == device and self.cache.dtype == dtype and self.logits.shape[1] == vocab)

    def prompts_view(self, prompts: int, width: int) -> StagedPrompts:
        """The ``(prompts, width)`` prefill bucket's views (fixed addresses)."""
        view = self._prompt_views.get((prompts, width))
        if view is None:
            view = self._prompt_views[(prompts, width)] = StagedPrompts(
                self.ids[:prompts, :width], self.mask[:prompts, :width], self.cache.rows_view(0, prompts, width),
                self.logits[:prompts])
        return view

    def requests_view(self, requests: int, width: int) -> StagedRequests:
        """The ``(requests, width)`` admission bucket's views (fixed addresses)."""
        view = self._request_views.get((requests, width))
        if view is None:
            view = self._request_views[(requests, width)] = StagedRequests(
                self.cache.rows_view(0, self.rows, width), self.logits, self.meta[:, :requests])
        return view

    def stage_prompts(self, ids: torch.Tensor, mask: torch.Tensor, prompts: int, width: int) -> StagedPrompts:
        """Copy a batch's left-padded prompts ``[p, w]`` into its bucket, right-aligned: prompt ``i`` at row ``i``."""
        p, w = ids.shape
        view = self.prompts_view(prompts, width)
        view.mask[:p, : width - w].zero_()
        view.mask[:p, width - w:].copy_(mask)
        view.ids[:p, width - w:].copy_(ids)
        return view

    def stage_requests(self, meta: list[list[int]], requests: int, width: int) -> StagedRequests:
        """Copy a round's per-request ``meta`` (6 lists of ``r`` ints) into its bucket."""
        r = len(meta[0])
        view = self.requests_view(requests, width)
        columns = [row + row[-1:] * (requests - r) for row in meta]  # pad by repeating the last request
        view.meta.copy_(torch.tensor(columns, dtype=torch.int64))
        return view

    def memory_bytes(self) -> int:
        return (int(self.cache.memory_bytes()) + self.ids.nbytes + self.mask.nbytes + self.meta.nbytes
                + self.logits.nbytes)


def prefill_staged(model: PreTrainedModel, staged: StagedPrompts) -> None:
    """Prefill a staged batch into the stage cache and keep each prompt's last logits (captured for rollouts)."""
    staged.logits.copy_(prefill(model, staged.cache, staged.ids, staged.mask, checked=True))


def admission_round(slots: DecodeSlots, staged: StagedRequests, sampling_key: tuple[float, float, int]) -> None:
    """One admission round of staged prompts, entirely in device tensors (captured for rollouts).

    Load each request's prompt K/V from its stage row into its slot (shared
    prompts fan out), pick its first token from its prompt's logits with the
    decode step's sampler, and admit it.
    """
    slots.cache.load_rows(staged.meta[0], staged.cache, sources=staged.meta[1], checked=True)
    start_from_logits(slots, staged.logits, staged.meta, sampling_key)


def start_from_logits(slots: DecodeSlots, logits: torch.Tensor, meta: torch.Tensor,
                      sampling_key: tuple[float, float, int]) -> None:
    """Admit the requests of ``meta`` (``[6, R]``, see :class:`StagedRequests`), whose prompts are already in
    their slots: each one's first token is picked from its source row of the prefill ``logits`` with the
    decode step's sampler (token 0 of its counters). Capture-safe."""
    slot, source, request_index, budget, min_tokens, seed = meta
    tokens, logprobs = choose_tokens(
        logits.index_select(0, source), sampling_key, eos_mask=slots.eos_mask, suppress_eos=min_tokens > 0,
        seed=seed, request_index=request_index, token_index=0, knobs=slots.knobs,
    )
    slots.start(slot, tokens, logprobs, seed=seed, request_index=request_index, budget=budget,
                min_tokens=min_tokens)
