"""Slot scheduling for both generation paths: admission, shared prefill, harvest, compaction.

``engine.generate`` admits its whole batch at once (static batching);
``HybridEngineRollout`` refills slots as requests finish (continuous
batching). Either way decode steps go to :meth:`DecodeGraphRunner.step` on the
smallest bucket holding the live rows.

The host never looks at tokens while decoding. It knows, per active slot, an
upper bound on the steps left (the budget minus the tokens generated when it
last looked), and reads the device ``finished`` flags and ``token_index`` (one
transfer, counted in ``host_syncs``) only when that can change what runs next:

* when enough slots are guaranteed to have finished for waiting requests to
  be admitted (see below), or the live rows would then fit a smaller bucket,
  or everything is done;
* every ``sync_interval`` steps, only while some row can still stop early on
  EOS (a reachable EOS id, past its ``min_tokens``).

A harvest copies finished slots' output rows into device result tensors (no
host transfer) and frees the slots. Then, when the live rows fit a smaller
bucket, rows above it move into free slots below it (:meth:`DecodeSlots.move`,
as vLLM compacts its batch), so finished rows stop costing compute.

Continuous batching admits waiting requests into the lowest free slots in
rounds. A round costs about ``ADMISSION_COST`` decode steps, so the scheduler
holds free slots back until idling them would cost more than another round
(:func:`_steps_to_admission`). Rollouts prefill prompts ahead, in batches of
the distinct prompts of the next requests of the queue, as many as the
admission stage has rows (bounded by a token budget, not by the slots: see
:data:`~hybrid_engine.graphs.runner.PREFILL_TOKEN_BUDGET`), and a round only
loads staged prompts into slots (:mod:`hybrid_engine.decode.staging`); both run on
the runner, graphed like a decode step. With shared prefill each distinct
prompt is prefilled once per call and its K/V fan out to the slots of its
samples, whichever rounds admit them. ``engine.generate`` admits its batch
once, eagerly, at its exact width.

A request's first token is picked from the prefill logits by the same
:func:`~hybrid_engine.decode.slots.choose_tokens` and counters (request index,
token 0) as the decode step, so where a request runs (slot, round, bucket)
does not change what it samples.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hybrid_engine.decode.slots import DecodeSlots
from hybrid_engine.decode.staging import start_from_logits
from hybrid_engine.decode.step import prefill
from hybrid_engine.generation.timing import PhaseTimer
from hybrid_engine.graphs.runner import DecodeGraphRunner

__all__ = ["ADMISSION_COST", "Counters", "RequestSpec", "gather_responses", "run_schedule"]

#: What one admission round costs, in decode steps, for the continuous-batching admission rule
#: (:func:`_steps_to_admission`). A round of staged prompts is about a quarter of a step on CPU (the
#: prefill, paid once per prompt whenever it runs, is not part of it); on a GPU it is one replay of ~40 small
#: kernels and two per layer (the K/V copy) beside a decode step's hundreds, so the value is not measured there
#: but errs on the high side.
ADMISSION_COST = 0.5


@dataclass
class RequestSpec:
    request_index: int  # row of the output batch
    prompt_index: int
    budget: int
    rng_index: int  # request counter of the sampler
    min_tokens: int = 0  # EOS is suppressed before this many tokens


@dataclass
class Counters:
    timer: PhaseTimer  # "prefill" and "decode" phases
    decode_steps: int = 0
    prefill_forwards: int = 0  # staged prefill batches (unstaged: one per admission round)
    admission_rounds: int = 0
    prefill_rows: int = 0  # prompts prefilled
    kv_row_copies: int = 0  # requests admitted from a prompt an earlier request of the call already used
    host_syncs: int = 0
    harvests: int = 0
    peak_active_batch: int = 0
    compactions: int = 0
    rows_moved: int = 0
    bucket_steps: dict[int, int] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


class _Staging:
    """Which prompts of a call sit in the runner's admission stage, and at which rows."""

    def __init__(self, rows: int, shared_prefill: bool) -> None:
        self.rows = rows
        self.shared = shared_prefill
        self.row_of: dict[tuple[int, ...], int] = {}
        self.used: set[tuple[int, ...]] = set()

    def unit(self, req: RequestSpec) -> tuple[int, ...]:
        """What is prefilled for ``req``: its prompt, shared by its samples, or its own copy of it."""
        return (req.prompt_index,) if self.shared else (req.prompt_index, req.request_index)

    def next_batch(self, upcoming: Iterable[RequestSpec]) -> list[tuple[int, ...]]:
        """The next units to prefill: those of the next requests of ``upcoming``, up to as many distinct units
        as the stage has rows (with ``n`` samples per prompt that covers about ``n`` times as many requests).

        A batch replaces the last one, so it must not drop a unit that a request still to be admitted reads,
        or a unit would be prefilled twice. It does not: a batch is taken only when the next request's unit is
        not staged, requests are admitted in queue order, and a prompt's samples are consecutive in the queue.
        So the next batch starts at the first request past the run of requests whose units this batch holds,
        and that request's unit appears nowhere before it: each unit is prefilled once per call, whatever the
        batch size. A round may need more units than the stage holds (more requests than rows, or samples of
        more prompts): its requests past this batch run as another part, after the next batch (:func:`_admit`).
        """
        batch: dict[tuple[int, ...], None] = {}
        for req in upcoming:
            unit = self.unit(req)
            if unit not in batch:
                if len(batch) == self.rows:
                    break
                batch[unit] = None
        self.row_of = {unit: row for row, unit in enumerate(batch)}
        return list(batch)


def _meta(slots: list[int], sources: list[int], reqs: list[RequestSpec], seed: int) -> list[list[int]]:
    """An admission round's six meta rows, one entry per request
    (see :class:`~hybrid_engine.decode.staging.StagedRequests`)."""
    return [slots, sources, [r.rng_index for r in reqs], [r.budget for r in reqs], [r.min_tokens for r in reqs],
            [seed] * len(reqs)]


def _admission_round(
    runner: DecodeGraphRunner,
    slots: list[int],
    reqs: list[RequestSpec],
    queue: deque[RequestSpec],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling_key: tuple[float, float, int],
    seed: int,
    *,
    staging: _Staging | None,
    counters: Counters,
) -> None:
    """Load ``reqs`` into ``slots`` (one admission round), prefilling what they need.

    ``staging``: the round reads prompts staged ahead, prefilling the next batch
    when a request's prompt is not staged (a round straddling batches runs as
    one part per batch); ``None``: the whole batch is prefilled eagerly at its own
    width into slots 0..n-1, exactly as transformers prefills it (never graphed).
    """
    counters.admission_rounds += 1
    device = prompt_ids.device
    if staging is None:
        if slots != list(range(len(slots))):
            raise ValueError("unstaged admission takes one prompt per request into slots 0..n-1")
        counters.prefill_forwards += 1
        counters.prefill_rows += len(reqs)
        index = _index([r.prompt_index for r in reqs], device)
        state = runner.slots
        logits = prefill(runner.model, state.head(len(slots)).cache, prompt_ids.index_select(0, index),
                         prompt_mask.index_select(0, index), checked=True)
        meta = _meta(slots, list(range(len(reqs))), reqs, seed)
        start_from_logits(state, logits, torch.tensor(meta, dtype=torch.int64, device=state.device), sampling_key)
        return
    start = 0
    for i in range(len(reqs) + 1):
        if i < len(reqs) and staging.unit(reqs[i]) in staging.row_of:
            continue
        if i > start:  # the requests whose prompts are staged now
            part = reqs[start:i]
            meta = _meta(slots[start:i], [staging.row_of[staging.unit(r)] for r in part], part, seed)
            for r in part:
                unit = staging.unit(r)
                counters.kv_row_copies += unit in staging.used
                staging.used.add(unit)
            runner.admission_round(meta, sampling_key)
        if i < len(reqs):
            batch = staging.next_batch(itertools.chain(reqs[i:], queue))
            index = _index([unit[0] for unit in batch], device)
            runner.prefill_prompts(prompt_ids.index_select(0, index), prompt_mask.index_select(0, index))
            counters.prefill_forwards += 1
            counters.prefill_rows += len(batch)
            start = i


def _compact(state: DecodeSlots, active: dict[int, RequestSpec], left: dict[int, int], free: list[int],
             target: int, counters: Counters) -> list[int]:
    """Move live rows at slots >= ``target`` into free slots below it; return the new free list."""
    movers = sorted(s for s in active if s >= target)
    holes = sorted(s for s in free if s < target)[: len(movers)]
    device = state.device
    state.move(_index(movers, device), _index(holes, device))
    for src, dst in zip(movers, holes):
        active[dst] = active.pop(src)
        left[dst] = left.pop(src)
    counters.compactions += 1
    counters.rows_moved += len(movers)
    return sorted((set(free) - set(holes)) | set(movers))


def _may_stop_early(state: DecodeSlots, requests: Iterable[RequestSpec]) -> bool:
    """Whether a row may stop on EOS before its budget: then the host must look, and rows end unevenly."""
    return state.eos_reachable and any(r.min_tokens < r.budget for r in requests)


def _steps_to_admission(room: int, waiting: int, left: dict[int, int], max_active: int, cost: float,
                        cap: int | None) -> int:
    """Continuous batching: in how many steps to admit waiting requests (0: now).

    An admission round costs about ``cost`` decode steps (loading staged prompts
    and the slot setup, whatever its rows; the prefill is paid once per prompt
    whenever it runs). Holding ``room`` free slots for the ``w`` steps
    until another slot is guaranteed free leaves them idle, about
    ``room * w / max_active`` steps of wall time; so admit at the first moment
    that is no cheaper, or when everything waiting fits. ``left`` holds upper
    bounds on each live row's remaining steps; while rows may stop early on EOS
    the host must look every ``cap`` steps anyway, so no plan reaches past that.
    """
    bounds = sorted(left.values())
    now, done = 0, 0  # bounds[:done] are <= now: those slots are free by then
    while True:
        while done < len(bounds) and bounds[done] <= now:
            done += 1
        free = min(waiting, room + done)
        if free >= waiting or done == len(bounds):
            return now
        nxt = bounds[done]  # the next slot guaranteed to free
        w = nxt - now if cap is None else min(nxt - now, cap)
        if free and free * w >= cost * max_active:
            return now
        if cap is not None and nxt > cap:
            return cap
        now = nxt


def _steps_to_shrink(runner: DecodeGraphRunner, left: dict[int, int], bucket: int) -> int:
    """Steps until a host sync can change what runs: the live rows fit a smaller bucket, or every slot
    is done. ``left`` holds upper bounds, so the slots counted done are done."""
    bounds = sorted(left.values())
    for done, steps in enumerate(bounds, start=1):
        remaining = len(bounds) - done
        if remaining == 0 or runner.bucket_for(remaining) < bucket:
            return steps
    return bounds[-1]


def run_schedule(
    runner: DecodeGraphRunner,
    requests: list[RequestSpec],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling_key: tuple[float, float, int],
    seed: int,
    *,
    width: int,
    max_active: int,
    continuous: bool,
    shared_prefill: bool,
    staged: bool,
    sync_interval: int,
    counters: Counters,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate every request on ``runner.slots``; return device ``(tokens, logprobs)`` ``[R, width]``.

    Lengths go to ``counters.lengths``. ``staged`` prefills prompts ahead through
    :meth:`DecodeGraphRunner.prefill_prompts` and admits each round through
    :meth:`DecodeGraphRunner.admission_round`, staged at the call's prompt width (graph
    replay where allowed; a round straddling prefill batches runs as one
    admission per batch); otherwise the batch is prefilled eagerly at its own width, as
    transformers does.
    """
    state = runner.slots
    device = state.device
    staging = _Staging(runner.stage.rows, shared_prefill) if staged else None
    # Every slot starts free, whatever an interrupted earlier call left live.
    state.release(torch.arange(state.rows, device=device))
    state.knobs.set(*sampling_key)  # the values the graphs of this sampling mode read
    # Rows can finish at different times (EOS, unequal budgets, more requests than slots): the call may
    # compact into every smaller bucket, so those are captured up front too.
    shrink = _may_stop_early(state, requests) or len({r.budget for r in requests}) > 1 or len(requests) > max_active
    if any(r.budget > 1 for r in requests):  # some row decodes at all
        runner.capture_buckets(runner.bucket_for(min(max_active, len(requests))), sampling_key, shrink)
    num_requests = len(requests)
    out_tokens = torch.zeros(num_requests, width, dtype=torch.int64, device=device)
    out_logprobs = torch.zeros(num_requests, width, dtype=torch.float32, device=device)
    queue = deque(requests)
    free = list(range(max_active))
    active: dict[int, RequestSpec] = {}  # slot -> request
    left: dict[int, int] = {}  # slot -> upper bound on decode steps before it must have finished

    while queue or active:
        room = min(len(queue), max_active - len(active), len(free))
        cap = sync_interval if _may_stop_early(state, active.values()) else None
        if room and (not active or (continuous and _steps_to_admission(room, len(queue), left, max_active,
                                                                       ADMISSION_COST, cap) == 0)):
            slots, free = free[:room], free[room:]
            reqs = [queue.popleft() for _ in range(room)]
            with counters.timer.phase("prefill"):
                _admission_round(runner, slots, reqs, queue, prompt_ids, prompt_mask, sampling_key, seed, staging=staging,
                       counters=counters)
            for slot, req in zip(slots, reqs):
                active[slot] = req
                left[slot] = req.budget - 1
            counters.peak_active_batch = max(counters.peak_active_batch, len(active))

        target = runner.bucket_for(len(active))
        if max(active) >= target:
            free = _compact(state, active, left, free, target, counters)
        bucket = runner.bucket_for(max(active) + 1)
        cap = sync_interval if _may_stop_early(state, active.values()) else None
        if continuous and queue:
            room = min(len(queue), max_active - len(active), len(free))
            n_steps = _steps_to_admission(room, len(queue), left, max_active, ADMISSION_COST, cap)
        else:
            n_steps = _steps_to_shrink(runner, left, bucket)
        if cap is not None:
            n_steps = min(n_steps, cap)
        n_steps = max(0, n_steps)
        if n_steps:
            with counters.timer.phase("decode"):
                for _ in range(n_steps):
                    runner.step(bucket, sampling_key)
            counters.decode_steps += n_steps
            counters.bucket_steps[bucket] = counters.bucket_steps.get(bucket, 0) + n_steps
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
        done_slots = _index(done, device)
        rows = _index([active[s].request_index for s in done], device)
        # Only the columns kept are gathered (the slots' output rows span the whole cache).
        out_tokens.index_copy_(0, rows, state.out_tokens[:, :width].index_select(0, done_slots))
        out_logprobs.index_copy_(0, rows, state.out_logprobs[:, :width].index_select(0, done_slots))
        for slot in done:
            counters.lengths[active[slot].request_index] = generated[slot]
            del active[slot]
            del left[slot]
        state.release(done_slots)
        free = sorted(free + done)
    return out_tokens, out_logprobs


def gather_responses(out_tokens: torch.Tensor, lengths: dict[int, int], pad_id: int,
                     out_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(responses, logprobs, lengths)``: rows cut to the longest response, ``pad_id``/0 past each length.

    ``out_tokens``/``out_logprobs`` are :func:`run_schedule`'s result buffers, consumed here: padding is written
    into them in place, and ``responses`` is a view of ``out_tokens`` (its callers only concatenate it after the
    prompts), so no second ``[R, width]`` buffer is made for it. ``logprobs`` is returned to users: it is
    ``out_logprobs`` itself where the longest response spans its width, else a contiguous copy of its first
    columns. Besides those, one boolean ``[R, width]`` mask.
    """
    device = out_tokens.device
    n = torch.tensor([lengths[r] for r in range(out_tokens.shape[0])], dtype=torch.int64, device=device)
    width = max(1, max(lengths.values()))
    padding = torch.arange(width, device=device)[None, :] >= n[:, None]
    responses = out_tokens[:, :width].masked_fill_(padding, pad_id)
    logprobs = None
    if out_logprobs is not None:
        logprobs = out_logprobs[:, :width]
        logprobs = (logprobs if logprobs.is_contiguous() else logprobs.contiguous()).masked_fill_(padding, 0.0)
    return responses, logprobs, n
