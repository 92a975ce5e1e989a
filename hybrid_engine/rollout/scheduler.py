"""Slot scheduling for continuous rollouts: admission, shared prefill, harvest.

The host never looks at tokens while decoding. It knows, per active slot, an
upper bound on the steps left (the budget minus the tokens generated when it
last looked), and reads the device ``finished`` flags and ``token_index``
(one transfer, counted in ``host_syncs``) only

* every ``sync_interval`` steps, or earlier when a slot is guaranteed to have
  used up its budget, and
* never more often than that, whether or not requests are waiting.

A harvest copies finished slots' output rows into device result tensors
(no host transfer), empties their cache rows and frees the slots; pending
requests are then prefilled into free slots in one batched forward per round.
With shared prefill each distinct prompt of a round is prefilled once and its
KV rows are copied (``StaticKVCache.copy_rows``) into the slots of its other
samples, which works unchanged with captured graphs because the copy writes
into the cache's fixed buffers.

A request's first token is sampled from the prefill logits with the same
counter-based sampler and counters (request index, token 0) as the decode
step, so where a request runs (slot, round, batch size) does not change what
it samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from hybrid_engine.model_step import prefill
from hybrid_engine.sampling import sample_tokens
from hybrid_engine.timing import PhaseTimer

from .decode_graph import SlotState
from .types import SamplingConfig

__all__ = ["Counters", "RequestSpec", "run_schedule"]


@dataclass
class RequestSpec:
    request_index: int  # row of the output batch
    prompt_index: int
    budget: int
    rng_index: int  # request counter of the sampler


@dataclass
class Counters:
    timer: PhaseTimer  # "prefill" and "decode" phases
    capture_s: float = 0.0
    decode_steps: int = 0
    prefill_forwards: int = 0
    prefill_rows: int = 0
    kv_row_copies: int = 0
    graph_replays: int = 0
    graph_captures: int = 0
    eager_steps: int = 0
    fallbacks: int = 0
    host_syncs: int = 0
    harvests: int = 0
    admission_rounds: int = 0
    peak_active_batch: int = 0
    lengths: dict[int, int] = field(default_factory=dict)


def _admit(
    model: PreTrainedModel,
    state: SlotState,
    slots: list[int],
    reqs: list[RequestSpec],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_lengths: list[int],
    sampling: SamplingConfig,
    shared_prefill: bool,
    counters: Counters,
) -> None:
    device = state.tokens.device
    # Which prompt each admitted request reads its first logits from, and which slots get prefilled.
    if shared_prefill:
        first_slot: dict[int, int] = {}
        for slot, req in zip(slots, reqs):
            first_slot.setdefault(req.prompt_index, slot)
        prompts = list(first_slot)
        prefill_slots = [first_slot[p] for p in prompts]
        row_of_prompt = {p: k for k, p in enumerate(prompts)}
        logit_rows = [row_of_prompt[r.prompt_index] for r in reqs]
        copies = [(first_slot[r.prompt_index], s) for s, r in zip(slots, reqs) if first_slot[r.prompt_index] != s]
    else:
        prompts = [r.prompt_index for r in reqs]
        prefill_slots = list(slots)
        logit_rows = list(range(len(reqs)))
        copies = []
    width = max(prompt_lengths[p] for p in prompts)
    index = torch.tensor(prompts, dtype=torch.int64, device=prompt_ids.device)
    ids = prompt_ids.index_select(0, index)[:, -width:]
    mask = prompt_mask.index_select(0, index)[:, -width:]
    pre_slots = torch.tensor(prefill_slots, dtype=torch.int64, device=device)
    logits = prefill(model, state.cache, ids, mask, rows=pre_slots)
    counters.prefill_forwards += 1
    counters.prefill_rows += len(prompts)
    if copies:
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=device)
        state.cache.copy_rows(src, dst)
        counters.kv_row_copies += len(copies)
    logits = logits.index_select(0, torch.tensor(logit_rows, dtype=torch.int64, device=logits.device))
    request_index = torch.tensor([r.rng_index for r in reqs], dtype=torch.int64, device=device)
    tokens, logprobs = sample_tokens(
        logits,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=torch.full((len(reqs),), sampling.seed, dtype=torch.int64, device=device),
        request_index=request_index,
        token_index=torch.zeros(len(reqs), dtype=torch.int64, device=device),
    )
    state.admit(
        torch.tensor(slots, dtype=torch.int64, device=device),
        tokens.to(device),
        logprobs.to(device),
        seed=sampling.seed,
        request_index=request_index,
        budget=torch.tensor([r.budget for r in reqs], dtype=torch.int64, device=device),
    )


def run_schedule(
    model: PreTrainedModel,
    state: SlotState,
    step: Callable[[], None],
    requests: list[RequestSpec],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: SamplingConfig,
    *,
    max_active: int,
    continuous: bool,
    shared_prefill: bool,
    sync_interval: int,
    counters: Counters,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate every request; return device ``(tokens, logprobs)`` ``[R, max_new_tokens]`` (lengths in counters)."""
    device = state.tokens.device
    width = sampling.max_new_tokens
    num_requests = len(requests)
    out_tokens = torch.zeros(num_requests, width, dtype=torch.int64, device=device)
    out_logprobs = torch.zeros(num_requests, width, dtype=torch.float32, device=device)
    prompt_lengths = prompt_mask.sum(dim=1).tolist()
    queue = deque(requests)
    free = list(range(state.batch_size))
    active: dict[int, RequestSpec] = {}  # slot -> request
    left: dict[int, int] = {}  # slot -> upper bound on decode steps before it must have finished

    while queue or active:
        can_admit = continuous or not active
        n_admit = min(len(queue), max_active - len(active), len(free)) if can_admit else 0
        if n_admit > 0:
            slots = [free.pop(0) for _ in range(n_admit)]
            reqs = [queue.popleft() for _ in range(n_admit)]
            with counters.timer.phase("prefill"):
                _admit(model, state, slots, reqs, prompt_ids, prompt_mask, prompt_lengths, sampling,
                       shared_prefill, counters)
            for slot, req in zip(slots, reqs):
                active[slot] = req
                left[slot] = req.budget - 1
            counters.admission_rounds += 1
            counters.peak_active_batch = max(counters.peak_active_batch, len(active))

        waiting = bool(queue) and continuous
        bound = min(left.values()) if waiting else max(left.values())
        n_steps = max(0, min(sync_interval, bound))
        if n_steps:
            with counters.timer.phase("decode"):
                for _ in range(n_steps):
                    step()
            counters.decode_steps += n_steps
            for slot in left:
                left[slot] -= n_steps

        # One host read of the per-slot flags: what scheduling needs, nothing per token.
        flags = torch.stack([state.finished.to(torch.int64), state.token_index]).cpu()
        counters.host_syncs += 1
        finished_flags, generated = flags[0].tolist(), flags[1].tolist()
        done = [slot for slot in active if finished_flags[slot]]
        for slot in active:
            left[slot] = active[slot].budget - generated[slot]
        if not done:
            continue
        counters.harvests += 1
        done_slots = torch.tensor(done, dtype=torch.int64, device=device)
        rows = torch.tensor([active[s].request_index for s in done], dtype=torch.int64, device=device)
        out_tokens.index_copy_(0, rows, state.out_tokens.index_select(0, done_slots)[:, :width])
        out_logprobs.index_copy_(0, rows, state.out_logprobs.index_select(0, done_slots)[:, :width])
        for slot in done:
            counters.lengths[active[slot].request_index] = generated[slot]
            del active[slot]
            del left[slot]
        state.release(done_slots)
        free = sorted(free + done)
    return out_tokens, out_logprobs
