"""Per-bucket decode state and the one decode step that is captured and replayed.

Graph-safety invariant: everything that changes from one step to the next, or
from one request to the next in a slot, lives in a device tensor allocated once
per :class:`SlotState` and only ever updated in place:

* the static KV cache (K/V buffers, per-row ``write_pos``/``position``/``valid``);
* per slot: the last token fed (``tokens``), the index of the next response
  token (``token_index``), the RNG counters (``seed``, ``request_index``), the
  response budget (``budget``), the ``finished`` flag, and the output rows
  ``out_tokens``/``out_logprobs`` ``[S, width]`` that the step scatters into at
  ``token_index``;
* the EOS ids (``eos_ids``, padded with -1 so its length is fixed) and the pad
  id (``pad_id``).

A capture freezes the host values it sees: the bucket size ``S``, the cache
capacity and output width (shapes), and the sampling knobs (temperature, top-p,
top-k). A graph is therefore keyed on ``(S, capacity, width)`` through its
state and on the sampling knobs through :attr:`SlotState.graphs`. Model weights
are read by address: in-place optimizer updates are seen by the next replay,
and a re-allocated parameter is caught by
:func:`~hybrid_engine.graph_safety.weight_fingerprint`, which
forces a recapture.

The eager path calls exactly the same :meth:`SlotState.step` function without
capture, so eager and graph results are bit-identical by construction.
Finished and idle rows keep running (a static graph cannot skip rows): their
outputs are masked (nothing is recorded, ``tokens`` become pad) and their write
position and position id are parked at the last slot, so they never write out
of bounds however long they idle.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.model_step import decode_one_token
from hybrid_engine.sampling import sample_tokens
from hybrid_engine.static_cache import StaticKVCache

__all__ = ["SlotState"]

_EOS_SLOTS = 8


class SlotState:
    """Device state for ``S`` decode slots sharing one static cache, plus the graphs captured over it."""

    def __init__(
        self,
        model: PreTrainedModel,
        batch_size: int,
        capacity: int,
        width: int,
        *,
        position_limit: int | None,
        device: torch.device,
        dtype: torch.dtype,
        num_eos: int,
    ) -> None:
        self.batch_size = batch_size
        self.capacity = capacity
        self.width = width
        self.cache = StaticKVCache(model.config, batch_size, capacity, device=device, dtype=dtype)
        # Lengths are validated before admission and idle rows are parked, so skip the per-step host read.
        self.cache.bounds_checks = False
        s = batch_size
        i64 = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(s, **i64)
        self.token_index = torch.zeros(s, **i64)
        self.seed = torch.zeros(s, **i64)
        self.request_index = torch.zeros(s, **i64)
        self.budget = torch.ones(s, **i64)
        self.finished = torch.ones(s, dtype=torch.bool, device=device)
        self.out_tokens = torch.zeros(s, width, **i64)
        self.out_logprobs = torch.zeros(s, width, dtype=torch.float32, device=device)
        self.num_eos_slots = max(_EOS_SLOTS, num_eos)
        self.eos_ids = torch.full((self.num_eos_slots,), -1, **i64)
        self.pad_id = torch.zeros((), **i64)
        # Parking spot for rows that are not live: the last cache slot and a legal position id.
        park = capacity - 1
        self._park_write = park
        self._park_position = park if position_limit is None else min(park, position_limit - 1)
        #: sampling key -> captured graph
        self.graphs: dict[tuple, Any] = {}
        self.fingerprint: tuple | None = None
        #: One real eager step has run on this state (lazy kernels and workspaces exist before capture).
        self.warmed_up = False
        self.pool: Any = None

    def fits(self, batch_size: int, capacity: int, width: int, num_eos: int) -> bool:
        return (
            self.batch_size == batch_size
            and self.capacity >= capacity
            and self.width >= width
            and self.num_eos_slots >= num_eos
        )

    def memory_bytes(self) -> int:
        extra = sum(
            t.numel() * t.element_size()
            for t in (
                self.tokens, self.token_index, self.seed, self.request_index, self.budget, self.finished,
                self.out_tokens, self.out_logprobs, self.eos_ids,
            )
        )
        return int(self.cache.memory_bytes()) + extra

    def set_special_ids(self, pad_id: int, eos_ids: tuple[int, ...]) -> None:
        self.pad_id.fill_(pad_id)
        values = list(eos_ids) + [-1] * (self.num_eos_slots - len(eos_ids))
        self.eos_ids.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=False)

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.eos_ids[None, :]).any(dim=-1)

    # ------------------------------------------------------------------ step
    def step(self, model: PreTrainedModel, sampling_key: tuple[float, float, int]) -> None:
        """One decode step for every slot, entirely in device tensors (this is what gets captured)."""
        temperature, top_p, top_k = sampling_key
        cache = self.cache
        logits = decode_one_token(model, cache, self.tokens)
        new_tokens, logprobs = sample_tokens(
            logits,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=self.seed,
            request_index=self.request_index,
            token_index=self.token_index,
        )
        live = ~self.finished
        column = self.token_index.clamp(max=self.width - 1)[:, None]
        old_tok = self.out_tokens.gather(1, column)
        old_lp = self.out_logprobs.gather(1, column)
        self.out_tokens.scatter_(1, column, torch.where(live[:, None], new_tokens[:, None], old_tok))
        self.out_logprobs.scatter_(1, column, torch.where(live[:, None], logprobs[:, None].float(), old_lp))
        self.tokens.copy_(torch.where(live, new_tokens, self.pad_id))
        self.token_index.add_(live.to(torch.int64))
        done = live & (self.is_eos(new_tokens) | (self.token_index >= self.budget))
        self.finished.logical_or_(done)
        parked = self.finished
        cache.write_pos.copy_(torch.where(parked, cache.write_pos.clamp(max=self._park_write), cache.write_pos))
        cache.position.copy_(torch.where(parked, cache.position.clamp(max=self._park_position), cache.position))

    # ------------------------------------------------------------- admission
    def admit(
        self,
        slots: torch.Tensor,
        first_tokens: torch.Tensor,
        first_logprobs: torch.Tensor,
        *,
        seed: int,
        request_index: torch.Tensor,
        budget: torch.Tensor,
    ) -> None:
        """Load freshly prefilled requests into ``slots``; their first token came from the prefill logits."""
        self.out_tokens.index_fill_(0, slots, 0)
        self.out_logprobs.index_fill_(0, slots, 0.0)
        self.out_tokens[:, 0].index_copy_(0, slots, first_tokens)
        self.out_logprobs[:, 0].index_copy_(0, slots, first_logprobs.float())
        self.tokens.index_copy_(0, slots, first_tokens)
        self.token_index.index_fill_(0, slots, 1)
        self.seed.index_fill_(0, slots, seed)
        self.request_index.index_copy_(0, slots, request_index)
        self.budget.index_copy_(0, slots, budget)
        done = self.is_eos(first_tokens) | (budget <= 1)
        self.finished.index_copy_(0, slots, done)

    def release(self, slots: torch.Tensor) -> None:
        """Free slots: nothing live, cache rows emptied (their write position is 0 again)."""
        self.finished.index_fill_(0, slots, True)
        self.tokens.index_copy_(0, slots, self.pad_id.expand(slots.numel()))
        self.cache.reset_rows(slots)
