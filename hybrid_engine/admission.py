"""Admission rounds staged into fixed buffers, so a whole round can be captured like a decode step.

Continuous batching admits requests many times per call, and an eager
prefill forward costs several replayed decode steps (about two on the CPU
emulation, many more on a GPU, where it is launch-bound). So a rollout stages
each admission round into an :class:`AdmissionStage` bucket and runs it with
:func:`admit_staged`: prefill, K/V into the slots, first token, slot setup,
all device work at fixed addresses, which the runner warms up, captures and
replays per :class:`~hybrid_engine.graph_runner.AdmissionKey`.

What a round's capture freezes: the number of prompt rows (exact up to
:data:`~hybrid_engine.graph_runner.EXACT_PROMPT_ROWS`, since a padding row
would cost a whole prefill, then the decode buckets), the number of request
rows (decode buckets: a request row costs only its sampling), the staged
width (the call's padded prompt width, rounded up to a power of two, the same
for every round of a call) and the sampling mode (the knobs' values are device
data, :class:`~hybrid_engine.sampling.SamplingKnobs`).
Everything per round is device data in the stage: the prompts (right-aligned, the columns before them masked out)
and one ``meta`` column per request (slot, source prompt row, request index,
budget, min_tokens, seed). Prompt rows past the round's prompts keep stale
prompts that no request reads; request columns past its requests repeat the
last request, so their writes are identical duplicates. Masked columns add
exact zeros to attention, so staging changes a prompt's result no more than
another padding width does; eager and graph rounds run the same staged
shapes, so their tokens are identical.

``engine.generate`` admits its batch once per call, at its exact width (as
transformers prefills it), and does not stage.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from .decode_state import DecodeSlots, choose_tokens
from .model_step import prefill
from .static_cache import StaticKVCache

__all__ = ["AdmissionStage", "StagedRound", "admit_from_logits", "admit_staged", "width_bucket"]


def width_bucket(width: int) -> int:
    """The staged prompt width for prompts of ``width`` tokens: a power of two, at least 8."""
    return max(8, 1 << (width - 1).bit_length())


class StagedRound(NamedTuple):
    """One admission round's device inputs, views of an :class:`AdmissionStage` at fixed addresses."""

    ids: torch.Tensor  # [P, W] prompts, right-aligned
    mask: torch.Tensor  # [P, W]
    cache: StaticKVCache  # P rows, W slots: where the prompts are prefilled
    meta: torch.Tensor  # [6, R]: slot, source prompt row, request index, budget, min_tokens, seed


class AdmissionStage:
    """Static buffers for admission rounds at the largest shape a call needs, viewed per (P, R, W) bucket.

    A round of ``p`` prompts ``w`` wide for ``r`` requests goes into the smallest
    bucket holding it (see the module docstring for what is padded and how).
    """

    META_ROWS = 6

    def __init__(self, model: PreTrainedModel, rows: int, width: int, *, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.rows = rows
        self.width = width
        self.ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.mask = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.meta = torch.zeros(self.META_ROWS, rows, dtype=torch.int64, device=device)
        self.cache = StaticKVCache(model.config, rows, width, device=device, dtype=dtype)
        self.cache.bounds_checks = False
        self._views: dict[tuple[int, int, int], StagedRound] = {}

    def fits(self, rows: int, width: int, device: torch.device, dtype: torch.dtype) -> bool:
        return (self.rows >= rows and self.width >= width and self.ids.device == device
                and self.cache.dtype == dtype)

    def view(self, prompts: int, requests: int, width: int) -> StagedRound:
        """The ``(prompts, requests, width)`` bucket's views (fixed addresses)."""
        view = self._views.get((prompts, requests, width))
        if view is None:
            view = self._views[(prompts, requests, width)] = StagedRound(
                self.ids[:prompts, :width], self.mask[:prompts, :width],
                self.cache.rows_view(0, prompts, width), self.meta[:, :requests])
        return view

    def stage(self, ids: torch.Tensor, mask: torch.Tensor, meta: list[list[int]], prompts: int, requests: int,
              width: int) -> StagedRound:
        """Copy a round's prompts ``[p, w]`` and per-request ``meta`` (6 lists of ``r`` ints) into a bucket."""
        p, w = ids.shape
        r = len(meta[0])
        view = self.view(prompts, requests, width)
        view.mask[:p, : width - w].zero_()
        view.mask[:p, width - w:].copy_(mask)
        view.ids[:p, width - w:].copy_(ids)
        columns = [row + row[-1:] * (requests - r) for row in meta]  # pad by repeating the last request
        view.meta.copy_(torch.tensor(columns, dtype=torch.int64))
        return view

    def memory_bytes(self) -> int:
        return int(self.cache.memory_bytes()) + self.ids.nbytes + self.mask.nbytes + self.meta.nbytes


def admit_staged(slots: DecodeSlots, model: PreTrainedModel, stage: StagedRound,
                 sampling_key: tuple[float, float, int]) -> None:
    """One admission round, entirely in device tensors (this is what gets captured for rollouts).

    Prefill the staged prompts, load each request's prompt K/V into its slot
    (shared prompts fan out by source row), pick its first token from its
    prompt's logits with the decode step's sampler, and admit it.
    """
    logits = prefill(model, stage.cache, stage.ids, stage.mask, checked=True)
    slot, source = stage.meta[0], stage.meta[1]
    slots.cache.load_rows(slot, stage.cache, sources=source, checked=True)
    admit_from_logits(slots, logits, stage.meta, sampling_key)


def admit_from_logits(slots: DecodeSlots, logits: torch.Tensor, meta: torch.Tensor,
                      sampling_key: tuple[float, float, int]) -> None:
    """Admit the requests of ``meta`` (``[6, R]``, see :class:`StagedRound`), whose prompts are already in
    their slots: each one's first token is picked from its source row of the prefill ``logits`` with the
    decode step's sampler (token 0 of its counters). Capture-safe."""
    slot, source, request_index, budget, min_tokens, seed = meta
    tokens, logprobs = choose_tokens(
        logits.index_select(0, source), sampling_key, eos_mask=slots.eos_mask, suppress_eos=min_tokens > 0,
        seed=seed, request_index=request_index, token_index=0, knobs=slots.knobs,
    )
    slots.admit(slot, tokens, logprobs, seed=seed, request_index=request_index, budget=budget,
                min_tokens=min_tokens)
