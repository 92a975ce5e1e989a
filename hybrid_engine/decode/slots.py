"""Decode slots: the device state of up to ``S`` rows and the one decode step that is captured.

Graph-safety invariant. A replayed graph reads and writes fixed addresses and
re-runs fixed kernels, so everything that changes from one step to the next,
or from one request to the next in a slot, lives in a device tensor allocated
once here and only ever updated in place:

* the cache rows: a block table into the runner's page pool, ``write_pos`` and
  ``position`` per slot (:class:`~hybrid_engine.decode.kv_cache.PagedKVCache`);
* per slot: the last token fed (``tokens``), the index of the next response
  token (``token_index``), the RNG counters (``seed``, ``stream``), the
  response budget (``budget``), the EOS floor (``min_tokens``: EOS is masked
  out while ``token_index < min_tokens``), the ``finished`` flag, their
  mirrors ``live``, ``advance`` and ``suppress_eos`` (what the next step reads;
  kept by the step's one bookkeeping op, ``hybrid_engine::advance_rows``, and
  by every other writer), and the output rows ``out_tokens``/``out_logprobs``
  ``[S, capacity + 1]`` that the step scatters into at ``token_index`` (rows that are not live write the
  spare last column, so the step reads no old value to keep);
* the EOS ids and mask, the stop sequences (matched against each row's last
  tokens in the step, so stopping needs no host read), the pad id and the
  sampling knobs' values, all written before a call.

Everything is allocated for the largest batch bucket ``S``; bucket ``n`` is
:meth:`DecodeSlots.head`, the ``[:n]`` view of every tensor at the same
addresses, so graphs of every bucket share one allocation, and a request moves
to a smaller bucket by moving its row: its table entry, not its K/V.

What a capture freezes: the bucket size, the span of pages attention reads,
the capacity (shapes), the sampling mode and whether the call has stop sequences (which ops run). No position,
length, counter, page or knob value is a host value, so one graph serves every
decode position and every temperature. The eager path runs exactly the same
:meth:`DecodeSlots.step`, so eager and graph results are bit-identical.
Finished and free rows keep running (a static graph cannot skip rows): they
feed the pad id, write the null page and do not advance, and nothing they
produce is recorded.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import PreTrainedModel

from hybrid_engine.accelerator.host_copy import device_tensor, host_to_device
from hybrid_engine.decode.fused_forward import resolve_fused_decode
from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.kv_pool import KVPool
from hybrid_engine.decode.layout import AttentionKind, attention_kinds
from hybrid_engine.decode.model_support import state_shapes
from hybrid_engine.decode.ops.bookkeeping import advance_rows, stop_match
from hybrid_engine.decode.sampling import MAX_SETTINGS, RowKnobs, SamplingKnobs, sample_tokens_and_top
from hybrid_engine.decode.step import decode_one_token, model_dtype, reads_pages_in_place
from hybrid_engine.exact.mode import uses_exact_attention

__all__ = ["DecodeSlots", "choose_tokens", "logits_width", "vocab_sizes"]

#: EOS ids a slot table holds at least (more when a model declares more).
MIN_EOS_SLOTS = 8
#: Stop token sequences one call may set, and their longest length: a fixed table, so graphs keep one shape.
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 16

# Per-row tensors, all ``[S, ...]``: a bucket views ``[:n]`` of each, a move copies rows of each.
_ROW_TENSORS = ("tokens", "token_index", "seed", "stream", "budget", "min_tokens", "knob", "finished", "live",
                "advance", "suppress_eos", "out_tokens", "out_logprobs", "out_top_ids", "out_top_logprobs")


def logits_width(model: PreTrainedModel) -> int:
    """How many logits the model produces per token (its output embedding rows, else ``vocab_size``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.config.vocab_size)


def vocab_sizes(model: PreTrainedModel) -> tuple[int, int]:
    """(logits width, input-embedding rows): what the slots' EOS mask and pad token are sized by."""
    width = logits_width(model)
    return width, getattr(model.get_input_embeddings(), "num_embeddings", None) or width


def choose_tokens(
    logits: torch.Tensor,
    sampling_key: tuple[float, float, int],
    *,
    eos_mask: torch.Tensor,
    suppress_eos: torch.Tensor,
    seed: torch.Tensor | int,
    stream: torch.Tensor,
    token_index: torch.Tensor | int,
    knobs: RowKnobs | None,
    top: int = 0,
    checked: bool = False,
    want_logprobs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(tokens [B], logprobs [B], top_ids [B, top], top_logprobs [B, top])`` from ``logits [B, V]``; EOS is
    masked out on rows where ``suppress_eos``.

    Capture-safe: every per-row input is a device tensor, and so are the knob
    values (``knobs``, set to ``sampling_key`` before the call; the key only
    picks the filters). Prefill admission and the decode step both pick
    through here, so they cannot diverge.
    """
    temperature, top_p, top_k = sampling_key
    return sample_tokens_and_top(logits, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                 stream=stream, token_index=token_index, knobs=knobs, top=top, checked=checked,
                                 want_logprobs=want_logprobs, eos_mask=eos_mask, suppress_eos=suppress_eos)


@dataclasses.dataclass
class CallSettings:
    """What a call sets on the host for its steps (:meth:`DecodeSlots.begin_call`, ``set_stop_sequences``); a
    captured step freezes them, so the graph key holds the first two and ``fused``."""

    stops: bool = False  # the call has stop sequences: steps match them
    logprobs: bool = True  # steps report their tokens' logprobs
    mask_kinds: dict[str | None, AttentionKind | None] | None = None  # None: read off the config each step
    dtype: torch.dtype | None = None  # the model's dtype (None: read each step)
    paged: bool | None = None  # steps read pages in place (step.reads_pages_in_place; None: asked each step)
    fused: bool = False  # steps run the fused decode forward (fused_forward.resolve_fused_decode)


class DecodeSlots:
    """Device state for ``rows`` decode slots sharing one paged KV cache (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        capacity: int,
        *,
        num_eos: int,
        pool: KVPool,
        top_logprobs: int = 0,
    ) -> None:
        self.rows = rows
        self.capacity = capacity
        device = pool.device
        self.cache = PagedKVCache(model.config, rows, capacity, pool=pool, state_shapes=state_shapes(model))
        # Lengths and pages are planned on the host before every step: skip the per-step host read.
        self.cache.bounds_checks = False
        i64 = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(rows, **i64)
        self.token_index = torch.zeros(rows, **i64)
        self.seed = torch.zeros(rows, **i64)
        self.stream = torch.zeros(rows, **i64)
        self.budget = torch.ones(rows, **i64)
        self.min_tokens = torch.zeros(rows, **i64)
        self.knob = torch.zeros(rows, **i64)  # the index of the request's setting in ``knobs``
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)
        # ``~finished``, as bool and as int64 (what a step advances by), and ``token_index < min_tokens`` (EOS
        # masked out): kept by every writer of what they mirror, so a step reads them without computing them
        # (hybrid_engine::advance_rows keeps them after each step).
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)
        self.advance = torch.zeros(rows, **i64)
        self.suppress_eos = torch.zeros(rows, dtype=torch.bool, device=device)
        # One spare column past the width: where rows that are not live write a step's output.
        self.out_tokens = torch.zeros(rows, capacity + 1, **i64)
        self.out_logprobs = torch.zeros(rows, capacity + 1, dtype=torch.float32, device=device)
        #: The ``top_logprobs`` most likely ids of each position's distribution and their logprobs (``[S, width,
        #: 0]`` when none are asked for: the step then ranks nothing).
        self.top_logprobs = top_logprobs
        self.out_top_ids = torch.zeros(rows, capacity + 1, top_logprobs, **i64)
        self.out_top_logprobs = torch.zeros(rows, capacity + 1, top_logprobs, dtype=torch.float32, device=device)
        self.num_eos_slots = max(MIN_EOS_SLOTS, num_eos)
        self.eos_ids = torch.full((self.num_eos_slots,), -1, **i64)
        self.eos_mask = torch.zeros(logits_width(model), dtype=torch.bool, device=device)
        # Right-aligned, -1 before a shorter sequence's first token (it matches anything); all -1: unused.
        # One set per sampling setting of the call (a row's ``knob`` picks both).
        self.stop_ids = torch.full((MAX_SETTINGS, MAX_STOP_SEQUENCES, MAX_STOP_LENGTH), -1, **i64)
        self._stop_sets: list[tuple[tuple[int, ...], ...]] = [()]  # what stop_ids holds (nothing yet)
        #: The call's host settings, one object shared with every bucket's view (views outlive calls).
        self.call = CallSettings()
        #: The token fed to rows that are not live (what they emit is never read): the pad id where the
        #: embedding has it, else 0, since configs may carry any int there (old Llama ones: -1).
        self.pad_id = torch.zeros((), **i64)
        self.knobs = SamplingKnobs(device)
        self.vocab = vocab_sizes(model)  # (logits width, input-embedding rows)
        self.eos_reachable = False
        # Views by row count; never ``self`` nor shared with a view: a reference cycle would keep the KV cache
        # alive after release() until Python's cyclic collector happens to run.
        self._heads: dict[int, DecodeSlots] = {}

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def pool(self) -> KVPool:
        return self.cache.pool

    def fits(self, rows: int, capacity: int, num_eos: int, pool: KVPool,
             vocab: tuple[int, int], top_logprobs: int = 0) -> bool:
        """Whether a call needing these sizes can run on these slots as they are (``vocab``:
        :func:`vocab_sizes`, which ``resize_token_embeddings`` changes)."""
        return (self.rows >= rows and self.capacity >= capacity
                and self.num_eos_slots >= num_eos and self.pool is pool and self.vocab == vocab
                and self.top_logprobs >= top_logprobs)

    def head(self, n: int) -> DecodeSlots:
        """The first ``n`` slots, as slots sharing these tensors (what the graph of bucket ``n`` runs on)."""
        if n == self.rows:
            return self
        view = self._heads.get(n)
        if view is None:
            if not 1 <= n <= self.rows:
                raise ValueError(f"DecodeSlots.head: n must be in 1..{self.rows}, got {n}")
            view = object.__new__(DecodeSlots)
            view.__dict__.update(self.__dict__)
            view._heads = {}
            view.rows = n
            view.cache = self.cache.rows_view(0, n)
            for name in _ROW_TENSORS:
                setattr(view, name, getattr(self, name)[:n])
            self._heads[n] = view
        return view

    def memory_bytes(self) -> int:
        """Bytes of the block tables and every per-slot tensor (the pool is the runner's)."""
        extra = sum(getattr(self, name).nbytes for name in _ROW_TENSORS)
        return int(self.cache.memory_bytes()) + extra + self.eos_ids.nbytes + self.eos_mask.nbytes \
            + self.stop_ids.nbytes

    def set_special_ids(self, pad_id: int, eos_ids: tuple[int, ...]) -> None:
        """Pad and EOS ids for the next call (outside capture). EOS ids outside the vocabulary (negative
        ones included, as transformers ignores them) never match."""
        self.pad_id.fill_(pad_id if 0 <= pad_id < self.vocab[1] else 0)
        self.eos_ids.fill_(-1)
        self.eos_mask.zero_()
        vocab = self.eos_mask.numel()
        reachable = [e for e in eos_ids if 0 <= e < vocab]
        #: Whether a row can emit an EOS at all (host-side; then the scheduler must look for early stops).
        self.eos_reachable = bool(reachable)
        if eos_ids:
            self.eos_ids[: len(eos_ids)].copy_(device_tensor(eos_ids, self.device))
        if reachable:
            self.eos_mask.index_fill_(0, device_tensor(reachable, self.device), True)

    def set_stop_sequences(self, sets: list[tuple[tuple[int, ...], ...]]) -> None:
        """Stop token sequences for the next call (outside capture), one set per sampling setting (``knob``): a
        row stops once its last tokens are one of its set's (they stay in its response, as an EOS does)."""
        if not 1 <= len(sets) <= MAX_SETTINGS:
            raise ValueError(f"1 to {MAX_SETTINGS} stop sets, got {len(sets)}")
        for sequences in sets:
            if len(sequences) > MAX_STOP_SEQUENCES or any(not 1 <= len(q) <= MAX_STOP_LENGTH for q in sequences):
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences of 1 to {MAX_STOP_LENGTH} tokens each")
        self.call.stops = any(sets)
        if sets == self._stop_sets:
            return  # the table the graphs read already holds them
        table = torch.full((MAX_SETTINGS, MAX_STOP_SEQUENCES, MAX_STOP_LENGTH), -1, dtype=torch.int64)
        for knob, sequences in enumerate(sets):
            for i, q in enumerate(sequences):
                table[knob, i, MAX_STOP_LENGTH - len(q):] = torch.tensor(q, dtype=torch.int64)
        table[len(sets):] = table[len(sets) - 1]  # unused knobs repeat the last set
        self.stop_ids.copy_(host_to_device(table, self.device))
        self._stop_sets = list(sets)

    def begin_call(self, model: PreTrainedModel, *, logprobs: bool, fused: bool | str = "auto") -> None:
        """Settle the next call's host settings (outside capture): whether its steps report their tokens'
        logprobs (greedy steps without them skip a log-softmax over the vocabulary), what the steps'
        attention masks are built for (read off the model's config once a call, not once a step), and whether
        they run the fused decode forward (``fused``: ``hybrid_engine.fused_decode``, resolved here)."""
        self.call.logprobs = logprobs
        self.call.mask_kinds = attention_kinds(model.config)
        self.call.dtype = model_dtype(model)
        self.call.paged = reads_pages_in_place(model, self.cache, self.call.mask_kinds)
        self.call.fused = resolve_fused_decode(fused, model, self.cache, self.call.mask_kinds)
        self.knobs.exact = uses_exact_attention(model)  # the exact mode's pick keeps the reference sampler

    @property
    def has_stop_sequences(self) -> bool:
        """Whether the call has stop sequences (host-side, in the graph key: ``GraphKey.stops``)."""
        return self.call.stops

    @property
    def logprobs_wanted(self) -> bool:
        """Whether the call's steps report logprobs (host-side, in the graph key: ``GraphKey.logprobs``)."""
        return self.call.logprobs

    @property
    def fused_decode(self) -> bool:
        """Whether the call's steps run the fused decode forward (host-side, in the graph key: ``GraphKey.fused``)."""
        return self.call.fused

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: whether each token is an EOS id (one lookup in the vocabulary-sized mask)."""
        return self.eos_mask[tokens]

    def ends_in_a_stop_sequence(self, out_tokens: torch.Tensor, last: torch.Tensor, knob: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: whether row ``b`` of ``out_tokens`` ends, at column ``last[b]``, in a sequence of stop set
        ``knob[b]``. Device ops only (captured with the step)."""
        return stop_match(out_tokens, last, self.stop_ids, knob)

    # ------------------------------------------------------------------ step
    def step(self, model: PreTrainedModel, sampling_key: tuple[float, float, int], span: int | None = None) -> None:
        """One decode step for every slot reading ``span`` pages a row (``None``: all), entirely in device tensors
        (this is what gets captured)."""
        live, advance = self.live, self.advance  # ~finished, as bool and int64: kept by every writer of finished
        call = self.call
        logits = decode_one_token(model, self.cache, self.tokens, live, span, kinds=call.mask_kinds,
                                  dtype=call.dtype, advance=advance, paged=call.paged, fused=call.fused)
        new_tokens, logprobs, top_ids, top_lp = choose_tokens(
            logits, sampling_key, eos_mask=self.eos_mask, suppress_eos=self.suppress_eos,
            seed=self.seed, stream=self.stream, token_index=self.token_index,
            knobs=self.knobs.for_rows(self.knob, sampling_key) if sampling_key[0] > 0 else None,
            top=self.top_logprobs, checked=True, want_logprobs=call.logprobs,
        )
        if self.top_logprobs:  # the ranked alternatives, at the column advance_rows writes the token at
            column = torch.where(live, self.token_index.clamp(max=self.capacity - 1), self.capacity)[:, None]
            at = column[:, :, None].expand(-1, 1, self.top_logprobs)
            self.out_top_ids.scatter_(1, at, top_ids[:, None])
            self.out_top_logprobs.scatter_(1, at, top_lp[:, None].float())
        # One op: record, feed, advance, finish (EOS, budget, stop sequences: call.stops is in the graph key).
        stops = call.stops
        advance_rows(self.tokens, self.token_index, self.finished, live, advance, self.suppress_eos,
                     self.out_tokens, self.out_logprobs, new_tokens, logprobs, self.budget, self.min_tokens,
                     self.eos_mask, self.pad_id, self.stop_ids if stops else None, self.knob if stops else None)

    # ------------------------------------------------------------- admission
    def start(
        self,
        slots: torch.Tensor,
        first_tokens: torch.Tensor,
        first_logprobs: torch.Tensor,
        *,
        seed: torch.Tensor,
        stream: torch.Tensor,
        budget: torch.Tensor,
        min_tokens: torch.Tensor,
        knob: torch.Tensor,
        first_top: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Start freshly prefilled requests in ``slots``; their first token came from the prefill logits (and
        ``first_top``, its ranked alternatives, when the slots keep them).

        Every argument is a per-request device tensor (capture-safe). Output columns past
        a request's length keep stale values: harvests read only up to it.
        """
        self.out_tokens[:, 0].index_copy_(0, slots, first_tokens)
        self.out_logprobs[:, 0].index_copy_(0, slots, first_logprobs.float())
        if self.top_logprobs and first_top is not None:
            self.out_top_ids[:, 0].index_copy_(0, slots, first_top[0])
            self.out_top_logprobs[:, 0].index_copy_(0, slots, first_top[1].float())
        self.tokens.index_copy_(0, slots, first_tokens)
        self.token_index.index_fill_(0, slots, 1)
        self.seed.index_copy_(0, slots, seed)
        self.stream.index_copy_(0, slots, stream)
        self.budget.index_copy_(0, slots, budget)
        self.min_tokens.index_copy_(0, slots, min_tokens)
        self.knob.index_copy_(0, slots, knob)
        stopped = self.ends_in_a_stop_sequence(self.out_tokens.index_select(0, slots), torch.zeros_like(slots),
                                               knob) & (min_tokens < 1)
        done = self.is_eos(first_tokens) | stopped | (budget <= 1)
        self.finished.index_copy_(0, slots, done)
        self.live.index_copy_(0, slots, ~done)
        self.advance.index_copy_(0, slots, (~done).long())
        self.suppress_eos.index_copy_(0, slots, min_tokens > 1)  # token index 1 < min_tokens

    def resume(self, slot: int, out_tokens: torch.Tensor, out_logprobs: torch.Tensor, generated: int, *,
               seed: int, stream: int, budget: int, min_tokens: int,
               out_top: tuple[torch.Tensor, torch.Tensor] | None = None, knob: int = 0) -> None:
        """Go on with a preempted request in ``slot``, whose prompt and first ``generated - 1`` tokens were just
        prefilled: its output row gets back the tokens and logprobs it had (``out_tokens``/``out_logprobs``, its
        result row), and its last token is fed next, at token index ``generated``. Eager (resumes are rare)."""
        width = out_tokens.shape[0]
        self.out_tokens[slot, :width].copy_(out_tokens)
        self.out_logprobs[slot, :width].copy_(out_logprobs)
        if self.top_logprobs and out_top is not None:
            k = out_top[0].shape[-1]
            self.out_top_ids[slot, :width, :k].copy_(out_top[0])
            self.out_top_logprobs[slot, :width, :k].copy_(out_top[1])
        self.tokens[slot] = out_tokens[generated - 1]
        for name, value in (("token_index", generated), ("seed", seed), ("stream", stream),
                            ("budget", budget), ("min_tokens", min_tokens), ("knob", knob)):
            getattr(self, name)[slot] = value
        self.finished[slot] = False
        self.live[slot] = True
        self.advance[slot] = 1
        self.suppress_eos[slot] = generated < min_tokens

    def release(self, slots: torch.Tensor) -> None:
        """Free slots: nothing live, no pages (the null page in every table entry), write position and position
        id back to 0. The pages' K/V are left as they are: the host ledger frees or reuses them."""
        self.finished.index_fill_(0, slots, True)
        self.live.index_fill_(0, slots, False)
        self.advance.index_fill_(0, slots, 0)
        self.tokens.index_copy_(0, slots, self.pad_id.expand(slots.numel()))
        self.cache.reset_rows(slots, checked=True)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move live rows ``src[i]`` into free slots ``dst[i]`` (their table entries, no K/V), then free ``src``."""
        self.cache.copy_rows(src, dst, checked=True)
        for name in _ROW_TENSORS:
            t = getattr(self, name)
            t.index_copy_(0, dst, t.index_select(0, src))
        self.release(src)
