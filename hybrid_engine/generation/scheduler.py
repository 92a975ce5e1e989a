"""The executor of a generation call: runs a :class:`~hybrid_engine.generation.schedule_policy.SchedulePolicy`'s
actions on the device, for both generation paths.

``engine.generate`` admits its whole batch at once (static batching);
``HybridEngineRollout`` refills slots as requests finish (continuous
batching). Either way decode steps go to :meth:`DecodeGraphRunner.step` on the
smallest bucket holding the live rows, reading the smallest span of pages
holding the longest of them.

What runs when is the policy's (:mod:`hybrid_engine.generation.schedule_policy`:
admission, how far to decode before looking, harvest, compaction, preemption);
this module carries each action out: admission rounds
(:func:`_admission_round`), pages (:class:`~hybrid_engine.generation.pages.PagePlan`,
consulted here and reported back), decode steps, the host read of the finish
flags, stop-string cuts, harvest. The split keeps the device work in one place
and the rules testable without a model.

The host never looks at tokens while decoding. It knows, per active slot, an
upper bound on the steps left (the budget minus the tokens generated when it
last looked), hence on the tokens the row holds, and reads the device
``finished`` flags and ``token_index`` (one transfer, counted in
``host_syncs``) only when that can change what runs next:

* when enough slots are guaranteed to have finished for waiting requests to
  be admitted, or the live rows would then fit a smaller bucket, or everything
  is done;
* every ``sync_interval`` steps, only while some row can still stop early on
  EOS (a reachable EOS id, past its ``min_tokens``);
* when the page pool cannot give the live rows their next step's pages.

Pages (:mod:`hybrid_engine.generation.pages`): before a run of steps every
live row is given the pages those steps reach (fewer steps when the pool is
short); harvested rows give theirs back. When not even one step fits, the
rows that finished are harvested, then the most recently admitted request
is preempted: its tokens so far go to the result rows, its pages are freed,
and it is requeued at the front, to resume by prefilling its prompt plus
the tokens it had (eagerly) and going on from its next token with the same
sampler counters: it never errors and never loses a request. Admission
waits for pages, a round admitting only the requests that fit. The stage
takes no more prompts than leave their first samples the pages they need
(:meth:`_Staging.next_batch`), so with nothing running a round always starts
a request when the pool holds one, as the front end checks; a loop that
stops making progress raises a ``RuntimeError`` (a bug) instead of spinning.

The host's per-look work stays off the device's path where it can
(``HOST_OVERLAP``): a look queues its read behind the run of steps just
launched (a non-blocking copy into pinned memory and an event,
:func:`~hybrid_engine.accelerator.host_copy.read_to_host`), then, while the
device runs them, reserves the pages of the next run for every live row as if
all continue (tentative pages, given back on demand: the plan's decisions do
not change, :mod:`hybrid_engine.generation.pages`) and writes their table
entries, and only then waits, once. When the read finds nothing finished,
the next run is the one planned ahead (the policy's forecast) and starts at
once; otherwise harvest, admission and compaction follow the read as before.
Run N+1 is never launched before run N's harvest: the harvest frees the slots
and pages that decide admission, the bucket and the next reservation, so an
earlier launch would change what runs (and, short of pages, whom to preempt).
``last_stats["host_ms_overlapped"]`` and ``["host_ms_after_sync"]`` split the
host's time around the reads (:class:`~hybrid_engine.generation.timing.HostSplit`).

Host-built index tensors go the other way without a sync where the
accelerator has pinned memory (:func:`_index`). A request that continues a row
of an earlier call (an episode's next turn) starts on the pages that call kept
(:func:`_continue_round`), and a call may keep its rows' pages for the next
(``kept``).

A request's first token comes from the prefill logits through the decode
step's sampler and counters, so where it runs (slot, round, bucket, span,
resumed or not) does not change what it samples.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hybrid_engine.accelerator.host_copy import device_tensor, read_to_host
from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.kv_pool import NULL_PAGE, HeldPages
from hybrid_engine.decode.slots import DecodeSlots
from hybrid_engine.decode.staging import start_from_logits
from hybrid_engine.generation.pages import AdmittedPages, PagePlan
from hybrid_engine.generation.request import Request
from hybrid_engine.generation.schedule_policy import (
    ADMISSION_COST,
    Action,
    Admit,
    Admitted,
    Compact,
    Decode,
    Done,
    DropStage,
    Harvest,
    Look,
    Preempt,
    Reserve,
    SchedulePolicy,
    Seen,
    may_stop_early,
)
from hybrid_engine.generation.stop_strings import StopStrings
from hybrid_engine.generation.timing import HostSplit, PhaseTimer
from hybrid_engine.graphs.runner import DecodeGraphRunner

__all__ = ["ADMISSION_COST", "HOST_OVERLAP", "Counters", "gather_responses", "run_schedule"]

#: Plan the next run of steps while the device runs the current one (module docstring). Internal switch: off,
#: every look reads, waits, and plans after the read, as before; the tokens are the same either way.
HOST_OVERLAP = True


@dataclass
class Counters:
    timer: PhaseTimer  # "prefill" and "decode" phases
    decode_steps: int = 0
    prefill_forwards: int = 0  # staged prefill batches (unstaged: one per admission round)
    admission_rounds: int = 0
    prefill_rows: int = 0  # prompts prefilled
    prefill_tokens: int = 0  # real tokens run through prefill forwards (staged, unstaged, resumed, continued)
    kv_reused_tokens: int = 0  # prompt tokens not prefilled: their K/V were kept by an earlier call
    kv_row_copies: int = 0  # requests admitted from a prompt an earlier request of the call already used
    host_syncs: int = 0
    harvests: int = 0
    peak_active_batch: int = 0
    compactions: int = 0
    rows_moved: int = 0
    preemptions: int = 0
    kv_pages_peak: int = 0
    kv_pages_held_peak: int = 0  # the page-rounded tokens held when the pool was at its peak
    bucket_steps: dict[int, int] = field(default_factory=dict)
    span_steps: dict[int, int] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    host: HostSplit = field(default_factory=HostSplit)  # host time around the reads


class Results(NamedTuple):
    """A call's result rows on the device, one per request: tokens and logprobs ``[R, width]``, and the ranked
    alternatives ``[R, width, top]`` (``top`` 0 unless asked for)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @classmethod
    def zeros(cls, rows: int, width: int, top: int, device: torch.device) -> Results:
        """Result rows for ``rows`` requests, filled in by harvests."""
        return cls(torch.zeros(rows, width, dtype=torch.int64, device=device),
                   torch.zeros(rows, width, dtype=torch.float32, device=device),
                   torch.zeros(rows, width, top, dtype=torch.int64, device=device),
                   torch.zeros(rows, width, top, dtype=torch.float32, device=device))


def _index(values: list[Any], device: torch.device, counters: Counters) -> torch.Tensor:
    """The host's own small tensors (new page-table entries, admission rows, slot indices) go to the device from
    pinned memory, ``non_blocking``, queued in stream order (:mod:`hybrid_engine.accelerator.host_copy`); where an
    accelerator has no pinned memory each such copy waits for the queue and is counted in ``host_syncs``."""
    return device_tensor(values, device, counters=counters)


class _Staging:
    """Which prompts of a call sit in the runner's prompt stage, at which rows, and how many samples still
    read each.

    Rollouts prefill prompts ahead, in batches of the distinct prompts of the next requests
    (:mod:`hybrid_engine.decode.staging`), and a round points slots at them; with shared prefill each prompt is
    prefilled once per call and its samples share its full pages."""

    def __init__(self, rows: int, shared_prefill: bool, requests: Iterable[Request]) -> None:
        self.rows = rows
        self.shared = shared_prefill
        self.row_of: dict[Hashable, int] = {}
        self.used: set[Hashable] = set()
        self.pending = Counter(self.unit(r) for r in requests if r.held is None)

    def unit(self, req: Request) -> tuple[int, ...]:
        """What is prefilled for ``req``: its prompt, shared by its samples, or its own copy of it."""
        return (req.prompt_index,) if self.shared else (req.prompt_index, req.row)

    def next_batch(self, upcoming: Iterable[Request], plan: PagePlan) -> list[tuple[int, ...]]:
        """The next units to prefill, each given its pages: those of the next requests of ``upcoming``, up to as
        many distinct units as the stage has rows and the pool has pages for (with ``n`` samples per prompt that
        covers about ``n`` times as many requests). The last batch's pages go back first.

        A unit is staged only while the pages the first sample of every unit of the batch needs to start (its
        copy of the partial last page, or its first step's page: :meth:`PagePlan.first_sample_pages`) stay
        free. A batch that filled the pool with prompts could start none of their samples with nothing running
        (the scheduler would drop it, stage the same batch again, and spin); this way, with nothing running,
        the first request of the batch always starts when the pool holds one request (prompt and row), as the
        front end checks up front (:func:`~hybrid_engine.decode.kv_pool.pool_pages`).

        A batch replaces the last one, so it must not drop a unit that a request still to be admitted reads,
        or a unit would be prefilled twice. It does not: a batch is taken only when the next request's unit is
        not staged, requests are admitted in queue order, and a prompt's samples are consecutive in the queue,
        so every unit of the last batch has been read by all its requests. A round may need more units than
        one batch holds: its requests past this batch run as another part, after the next batch."""
        self.drop(plan)
        batch: dict[Hashable, None] = {}
        spare = 0  # pages the first samples of the units staged so far need to start
        for req in upcoming:
            if req.resume_from or req.held is not None:
                continue  # resumed and continued requests prefill their own history
            unit = self.unit(req)
            if unit in batch:
                continue
            need = plan.first_sample_pages(req.prompt_len, last=self.pending[unit] == 1)
            if len(batch) == self.rows or plan.stage(unit, req.prompt_len, spare=spare + need) is None:
                break
            spare += need
            batch[unit] = None
        self.row_of = {unit: row for row, unit in enumerate(batch)}
        return list(batch)

    def drop(self, plan: PagePlan) -> None:
        """Let go of the staged batch's pages (samples already admitted keep the pages they share)."""
        for unit in self.row_of:
            plan.unstage(unit)
        self.row_of = {}


def _admission_round(runner: DecodeGraphRunner, plan: PagePlan, slots: list[int], reqs: list[Request],
                     queue: Iterable[Request], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, results: Results,
                     sampling_key: tuple[float, float, int], seed: int, *, staging: _Staging | None,
                     counters: Counters) -> int:
    """Start ``reqs`` in ``slots`` (one admission round), prefilling what they need; returns how many started.

    Continuous batching admits waiting requests into the lowest free slots in
    rounds; a round costs about ``ADMISSION_COST`` decode steps, so free slots
    are held back until idling them would cost more (the policy's rule).

    The round stops at the first request the pool has no pages for; it and the
    ones after it are not started (the policy puts them back). ``staging``: the
    round reads prompts staged ahead, prefilling the next batch when a
    request's prompt is not staged (a round straddling batches runs as one part
    per batch); ``None``: the requests are prefilled eagerly at the batch's own
    width, as transformers prefills them (never graphed). Resumed requests
    prefill their prompt and tokens so far, eagerly. ``queue``: the requests
    waiting after ``reqs``, whose prompts a staged batch may take too.
    """
    counters.admission_rounds += 1
    if staging is None:
        return _unstaged_round(runner, plan, slots, reqs, prompt_ids, prompt_mask, sampling_key, seed, counters)
    part: list[list[int]] = []
    started = 0

    def run_part() -> None:
        if part:
            runner.admission_round(part, sampling_key, counters)
            part.clear()

    while started < len(reqs):
        slot, req = slots[started], reqs[started]
        if req.continues:
            run_part()
            run = next((j for j in range(started, len(reqs)) if not reqs[j].continues), len(reqs))
            started += _continue_round(runner, plan, slots[started:run], reqs[started:run], prompt_ids,
                                       prompt_mask, sampling_key, seed, counters)
            if started < run:
                break
            continue
        if req.resume_from:
            run_part()
            if not _resume(runner, plan, slot, req, prompt_ids, prompt_mask, results, seed, counters):
                break
            started += 1
            continue
        unit = staging.unit(req)
        if unit not in staging.row_of:
            run_part()
            if not _stage_batch(runner, plan, staging, itertools.chain(reqs[started:], queue), prompt_ids,
                                prompt_mask, counters):
                break
        pages = plan.admit(slot, unit, last=staging.pending[unit] == 1)
        if pages is None:
            break
        part.append(_staged_start(staging, unit, slot, req, pages, seed, counters))
        started += 1
    run_part()
    return started


def _stage_batch(runner: DecodeGraphRunner, plan: PagePlan, staging: _Staging, upcoming: Iterable[Request],
                 prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, counters: Counters) -> bool:
    """Prefill the next batch of prompts into the stage (:meth:`_Staging.next_batch`); ``False`` when not one
    prompt got pages."""
    batch = staging.next_batch(upcoming, plan)
    if not batch:
        return False
    index = _index([u[0] for u in batch], prompt_ids.device, counters)
    runner.prefill_prompts(prompt_ids.index_select(0, index), prompt_mask.index_select(0, index),
                           [plan.unit_pages[u][0] for u in batch], counters)
    counters.prefill_forwards += 1
    counters.prefill_rows += len(batch)
    counters.prefill_tokens += sum(plan.unit_pages[u][1] for u in batch)
    return True


def _staged_start(staging: _Staging, unit: tuple[int, ...], slot: int, req: Request, pages: AdmittedPages,
                  seed: int, counters: Counters) -> list[int]:
    """The round's ``meta`` row (:data:`~hybrid_engine.decode.staging.META`, then the block table row) that
    starts ``req`` in ``slot`` from its staged ``unit``, which it now reads."""
    staging.pending[unit] -= 1
    counters.kv_row_copies += unit in staging.used
    staging.used.add(unit)
    return ([slot, staging.row_of[unit], req.stream, req.budget, req.min_tokens, req.seed_or(seed), req.prompt_len,
             pages.src, pages.dst, req.knob] + pages.table)


def _tables(cache: PagedKVCache, tables: list[list[int]], counters: Counters) -> torch.Tensor:
    """Block table rows on the device: each row's pages, then the null page."""
    return _index([t + [NULL_PAGE] * (cache.max_pages - len(t)) for t in tables], cache.device, counters)


def _unstaged_round(runner: DecodeGraphRunner, plan: PagePlan, slots: list[int], reqs: list[Request],
                    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling_key: tuple[float, float, int],
                    seed: int, counters: Counters) -> int:
    """``engine.generate``'s admission: the requests that get pages are prefilled together, eagerly, at the
    batch's exact width."""
    state = runner.slots
    taken: list[list[int]] = []
    for slot, req in zip(slots, reqs):
        pages = plan.take(slot, req.prompt_len)
        if pages is None:
            break
        taken.append(pages)
    n = len(taken)
    if n == 0:
        return 0
    device = state.device
    counters.prefill_forwards += 1
    counters.prefill_rows += n
    counters.prefill_tokens += sum(r.prompt_len for r in reqs[:n])
    rows = _index(slots[:n], device, counters)
    index = _index([r.prompt_index for r in reqs[:n]], device, counters)
    logits = runner.prefill_rows(rows, _tables(state.cache, taken, counters), prompt_ids.index_select(0, index),
                                 prompt_mask.index_select(0, index))
    _start(state, logits, rows, reqs[:n], sampling_key, seed, counters)
    return n


def _start(state: DecodeSlots, logits: torch.Tensor, rows: torch.Tensor, reqs: list[Request],
           sampling_key: tuple[float, float, int], seed: int, counters: Counters) -> None:
    """Start ``reqs`` in slots ``rows`` from their prompts' last ``logits`` (row ``i`` for request ``i``)."""
    device = state.device
    meta = _index([[r.stream for r in reqs], [r.budget for r in reqs], [r.min_tokens for r in reqs],
                   [r.seed_or(seed) for r in reqs], [r.knob for r in reqs]], device, counters)
    start_from_logits(state, logits, rows, torch.arange(len(reqs), device=device), meta[0], meta[1], meta[2],
                      meta[3], sampling_key, meta[4])


def _resume(runner: DecodeGraphRunner, plan: PagePlan, slot: int, req: Request, prompt_ids: torch.Tensor,
            prompt_mask: torch.Tensor, results: Results, seed: int,
            counters: Counters) -> bool:
    """Resume a preempted request in ``slot``: prefill its prompt and all its tokens but the last (eagerly), and
    go on from the last with its own counters. ``False`` (nothing taken) when the pool has no pages for it."""
    generated = req.resume_from
    pages = plan.take(slot, req.prompt_len + generated - 1)
    if pages is None:
        return False
    state = runner.slots
    device = state.device
    out_tokens, out_logprobs, top_ids, top_lp = results
    history = out_tokens[req.row, : generated - 1]
    ids = torch.cat([prompt_ids[req.prompt_index], history])[None]
    mask = torch.cat([prompt_mask[req.prompt_index], torch.ones_like(history)])[None]
    runner.prefill_rows(_index([slot], device, counters), _tables(state.cache, [pages], counters), ids, mask)
    state.resume(slot, out_tokens[req.row], out_logprobs[req.row], generated,
                 seed=req.seed_or(seed),
                 stream=req.stream, budget=req.budget, min_tokens=req.min_tokens,
                 out_top=(top_ids[req.row], top_lp[req.row]), knob=req.knob)
    counters.prefill_forwards += 1
    counters.prefill_rows += 1
    counters.prefill_tokens += req.prompt_len + generated - 1
    return True


def _continue_round(runner: DecodeGraphRunner, plan: PagePlan, slots: list[int], reqs: list[Request],
                    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling_key: tuple[float, float, int],
                    seed: int, counters: Counters) -> int:
    """Start requests that continue rows of an earlier call (``req.held``: the pages it kept of the first
    ``held.tokens`` tokens of the prompt) in ``slots``: only the prompt's tokens after those are prefilled, onto
    the same pages, together and eagerly (:func:`~hybrid_engine.decode.step.extend`); returns how many started.

    A request whose held pages were evicted meanwhile is prefilled whole the same way. The first token is
    sampled as any request's, from the logits of the prompt's last token."""
    state = runner.slots
    cache = state.cache
    tables, cached = [], []
    for slot, req in zip(slots, reqs):
        tokens = req.held.tokens
        pages = plan.adopt(slot, req.held, req.prompt_len)
        if pages is None and req.held.live_in(plan.ledger):
            break  # held, but no page for its new tokens: wait
        if pages is None:
            pages, tokens = plan.take(slot, req.prompt_len), 0  # evicted: prefill it all
            if pages is None:
                break
        tables.append(pages)
        cached.append(tokens)
    n = len(tables)
    if n == 0:
        return 0
    device = state.device
    new = [r.prompt_len - c for r, c in zip(reqs, cached)]
    width = max(new)
    rows = _index(slots[:n], device, counters)
    index = _index([r.prompt_index for r in reqs[:n]], device, counters)
    pad = width - _index(new, device, counters)
    ids = prompt_ids.index_select(0, index)[:, -width:]
    mask = (torch.arange(width, device=device)[None, :] >= pad[:, None]).to(prompt_mask.dtype)
    logits = runner.extend_rows(rows, _tables(cache, tables, counters), _index(cached, device, counters), ids, mask,
                                runner.span_for(max(r.prompt_len for r in reqs[:n])))
    _start(state, logits, rows, reqs[:n], sampling_key, seed, counters)
    counters.prefill_forwards += 1
    counters.prefill_rows += n
    counters.prefill_tokens += sum(new)
    counters.kv_reused_tokens += sum(cached)
    return n


def _cut_at_stop_strings(state: DecodeSlots, stop: StopStrings, active: dict[int, Request],
                         generated: list[int], done: list[int], counters: Counters) -> list[int]:
    """The slots done once stop strings are looked for (one more host read: the live rows' tokens); a row
    that holds one gets its length cut in ``generated``. ``Request.checked``: a prefix known to hold none."""
    slots = list(active)
    longest = max(generated[s] for s in slots)
    if not longest:
        return done
    rows = state.out_tokens[:, :longest].index_select(0, _index(slots, state.device, counters)).tolist()
    counters.host_syncs += 1
    ended = set(done)
    for slot, row in zip(slots, rows):
        req, n = active[slot], generated[slot]
        cut = stop.cut(row[:n], req.checked, req.min_tokens)
        if cut is not None:
            generated[slot] = cut
            ended.add(slot)
        elif n > req.min_tokens:
            req.checked = n
    return [s for s in active if s in ended]


def _reserve(plan: PagePlan, reqs: list[Request], n_steps: int) -> int:
    """Give every running request the pages of its next ``n_steps`` steps, or of as many steps as the pool
    allows (nothing is taken for steps that do not fit); returns the steps reserved (0: not even one)."""
    def missing(n: int) -> int:
        return sum(plan.missing(r.slot, r.tokens_bound() + min(n, r.left)) for r in reqs)

    wanted = missing(n_steps)
    free = plan.room(wanted)  # tentative pages count as free: they are given back on demand
    if wanted > free:
        lo, hi = 0, n_steps  # the largest n with missing(n) <= free: missing grows with n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if missing(mid) <= free else (lo, mid - 1)
        n_steps = lo
    for r in reqs:
        if not plan.grow(r.slot, r.tokens_bound() + min(n_steps, r.left)):
            raise RuntimeError("page reservation exceeded the free pages it counted")  # a bug, not an input
    plan.drop_ahead()  # tentative pages these steps do not reach go back
    return n_steps


def run_schedule(
    runner: DecodeGraphRunner,
    requests: list[Request],
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
    logprobs: str = "sampling",
    top_logprobs: int = 0,
    settings: list[tuple[float, float, int]] | None = None,
    stop_strings: StopStrings | None = None,
    kept: dict[int, HeldPages] | None = None,
) -> Results:
    """Generate every request on ``runner.slots``; return its device :class:`Results`, the logprobs under the
    sampled distribution or the full softmax at the temperature (``logprobs``), with the ``top_logprobs`` best
    alternatives of each position (the slots must keep at least that many).

    Lengths go to ``counters.lengths``. ``staged`` prefills prompts ahead through
    :meth:`DecodeGraphRunner.prefill_prompts` and admits each round through
    :meth:`DecodeGraphRunner.admission_round` (graph replay where allowed);
    otherwise requests are prefilled eagerly at their own width, as transformers does.

    Pages, preemption and the no-progress errors: see the module docstring.

    ``kept`` (a dict, filled in): every finished request keeps the pages of the tokens it holds past the call
    (:class:`~hybrid_engine.decode.kv_pool.HeldPages`, by request row) for a later request that continues it
    (``Request.held``); the caller releases them.
    """
    state = runner.slots
    plan = PagePlan(runner.ledger, runner.kv_pool.page_size, state.cache.max_pages)
    staging = _Staging(runner.stage.rows, shared_prefill, requests) if staged else None
    # Every slot starts free, whatever an interrupted earlier call left live.
    state.release(torch.arange(state.rows, device=state.device))
    # The values the graphs of this sampling mode read; several settings: sampling_key is their union_mode.
    state.knobs.set_table(settings or [sampling_key], logprobs=logprobs)
    results = Results.zeros(len(requests), width, top_logprobs, state.device)
    policy: SchedulePolicy | None = None
    try:
        # The special ids and stop sets were set before the call: whether a row can stop early is fixed.
        can_stop = bool(state.eos_reachable or state.has_stop_sequences or stop_strings is not None)
        _capture(runner, requests, sampling_key, max_active=max_active, staged=staged,
                 shrink=may_stop_early(can_stop, requests))
        overlap = HOST_OVERLAP
        policy = SchedulePolicy(requests, runner, max_active=max_active, continuous=continuous,
                                sync_interval=sync_interval, can_stop=can_stop, keep_pages=kept is not None,
                                describe_pages=lambda: f"{plan.ledger.free} of {plan.ledger.capacity} pages free",
                                plan_ahead=overlap)
        _Executor(runner, plan, staging, prompt_ids, prompt_mask, results, sampling_key, seed,
                  counters=counters, stop_strings=stop_strings, kept=kept).run(policy)
    finally:
        if policy is not None:
            counters.peak_active_batch = max(counters.peak_active_batch, policy.peak)
        counters.kv_pages_peak = plan.ledger.peak
        plan.close()
    return results


def _capture(runner: DecodeGraphRunner, requests: list[Request], sampling_key: tuple[float, float, int], *,
             max_active: int, staged: bool, shrink: bool) -> None:
    """Capture up front the decode graphs (and staged admission rounds) the call may replay. ``shrink``: rows
    can finish at different times (EOS, unequal budgets, more requests than slots), so the call may compact
    into every smaller bucket, and those are captured too."""
    shrink = shrink or len({r.budget for r in requests}) > 1 or len(requests) > max_active
    top = runner.bucket_for(min(max_active, len(requests)))
    if any(r.budget > 1 for r in requests):  # some row decodes at all
        spans = runner.spans_between(min(r.prompt_len for r in requests) + 1,
                                     max(r.prompt_len + r.budget for r in requests) - 1)
        runner.capture_buckets(top, spans, sampling_key, shrink)
    if staged and len(requests) > 1:  # rounds of every size this call may admit (single rounds need no graph)
        runner.capture_rounds(top, sampling_key)
        runner.slots.release(torch.arange(runner.slots.rows, device=runner.slots.device))


class _Executor:
    """Runs one call's scheduling actions on ``runner``'s slots: prefill and admission rounds, page reservation
    (through ``plan``, whose answers go back to the policy), decode steps, host reads of the finish flags,
    harvest into ``results``."""

    def __init__(self, runner: DecodeGraphRunner, plan: PagePlan, staging: _Staging | None,
                 prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, results: Results,
                 sampling_key: tuple[float, float, int], seed: int, *, counters: Counters,
                 stop_strings: StopStrings | None, kept: dict[int, HeldPages] | None) -> None:
        self.runner, self.state, self.plan, self.staging = runner, runner.slots, plan, staging
        self.prompt_ids, self.prompt_mask, self.results = prompt_ids, prompt_mask, results
        self.sampling_key, self.seed, self.counters = sampling_key, seed, counters
        self.stop_strings, self.kept = stop_strings, kept
        self.looked: set[int] = set()  # ids of the requests the last look reserved pages ahead for

    def run(self, policy: SchedulePolicy) -> None:
        """Execute the policy's actions, each reply going back to it, until it is done."""
        reply = None
        while not isinstance(action := policy.next(reply), Done):
            reply = self.execute(action)
        self.counters.host.launched()  # the host work after the last read

    def execute(self, action: Action) -> Admitted | Seen | int | None:
        """Carry out ``action``; its reply for the policy (``None`` where it has none)."""
        match action:
            case Admit():
                return self.admit(action)
            case Reserve():
                n_steps = self.reserve(action)
                self.plan.flush(self.state.cache.block_table, self.counters)
                return n_steps
            case Decode():
                self.decode(action)
            case Look():
                return self.look(action)
            case Compact():
                self.compact(action.movers, action.holes)
            case Harvest():
                _harvest(self.state, self.plan, action.slots, action.requests, self.results, self.counters,
                         finished=True, kept=self.kept if action.keep else None)
            case Preempt():
                _harvest(self.state, self.plan, [action.slot], [action.request], self.results, self.counters,
                         finished=False)
                self.counters.preemptions += 1
            case DropStage():
                assert self.staging is not None, "only a staged call drops its stage"
                self.staging.drop(self.plan)
            case _:
                raise TypeError(f"unknown scheduling action {action!r}")
        return None

    def reserve(self, action: Reserve) -> int:
        """Pages for the next run: those reserved ahead at the last look, committed as they stand where the
        run is the one they were reserved for (and the rows admitted since get theirs now), else worked out
        afresh (:func:`_reserve`). Either way the answer is the one a plan that never reserved ahead gives."""
        plan, steps, looked = self.plan, action.steps, self.looked
        self.looked = set()
        if action.ahead == steps and plan.ahead_intact(steps):
            new = [(r.slot, r.tokens_bound() + min(steps, r.left)) for r in action.requests if id(r) not in looked]
            need = plan.ledger.tentative + sum(plan.missing(slot, tokens) for slot, tokens in new)
            if plan.room(need) >= need:  # what _reserve finds for these steps: they all fit
                plan.commit_ahead()
                for slot, tokens in new:
                    if not plan.grow(slot, tokens):
                        raise RuntimeError("page reservation exceeded the free pages it counted")  # a bug
                return steps
        return _reserve(plan, action.requests, steps)

    def admit(self, action: Admit) -> Admitted:
        with self.counters.host.excluded(), self.counters.timer.phase("prefill"):
            started = _admission_round(self.runner, self.plan, action.slots, action.requests, action.waiting,
                                       self.prompt_ids, self.prompt_mask, self.results, self.sampling_key,
                                       self.seed, staging=self.staging, counters=self.counters)
        return Admitted(started, self.staging is not None and bool(self.staging.row_of))

    def decode(self, action: Decode) -> None:
        counters = self.counters
        counters.host.launched()
        with counters.timer.phase("decode"):
            for span in action.spans:
                self.runner.step(action.bucket, span, self.sampling_key)
                counters.span_steps[span] = counters.span_steps.get(span, 0) + 1
        n_steps = len(action.spans)
        counters.decode_steps += n_steps
        counters.bucket_steps[action.bucket] = counters.bucket_steps.get(action.bucket, 0) + n_steps

    def look(self, action: Look) -> Seen:
        """One host read of the per-slot flags: what scheduling needs, nothing per token. The read is queued
        behind the steps just launched; the pages of the next run (``action.ahead`` steps) are reserved while
        the device runs them, and the host waits once."""
        state, plan, counters, acc = self.state, self.plan, self.counters, self.runner.accelerator
        with acc.on_device(state.device):
            read = read_to_host(torch.stack([state.finished.to(torch.int64), state.token_index]), acc)
        counters.host_syncs += 1
        if action.ahead:
            with counters.host.overlapped():
                reqs = action.requests
                if plan.reserve_ahead([(r.slot, r.tokens_bound() + min(action.ahead, r.left)) for r in reqs],
                                      action.ahead):
                    plan.flush(state.cache.block_table, counters)
                    self.looked = {id(r) for r in reqs}
        with acc.on_device(state.device):
            flags = read.wait()
        counters.host.synced()
        finished_flags, generated = flags[0].tolist(), flags[1].tolist()
        requests = action.requests
        active = {r.slot: r for r in requests}
        done = [slot for slot in active if finished_flags[slot]]
        if self.stop_strings is not None:
            done = _cut_at_stop_strings(state, self.stop_strings, active, generated, done, counters)
        if plan.ledger.committed == plan.ledger.peak:  # at the peak: how much of it the tokens held need
            held = {s: r.prompt_len + generated[s] - 1 for s, r in active.items()}
            counters.kv_pages_held_peak = max(counters.kv_pages_held_peak, plan.held_pages(held))
        return Seen(done, generated)

    def compact(self, movers: list[int], holes: list[int]) -> None:
        """Move the rows of ``movers`` into ``holes``: with their table rows, no K/V."""
        device = self.state.device
        self.state.move(_index(movers, device, self.counters), _index(holes, device, self.counters))
        for src, dst in zip(movers, holes):
            self.plan.move(src, dst)
        self.counters.compactions += 1
        self.counters.rows_moved += len(movers)


def _harvest(state: DecodeSlots, plan: PagePlan, slots: list[int], reqs: list[Request], results: Results,
             counters: Counters, *, finished: bool, kept: dict[int, HeldPages] | None = None) -> None:
    """Copy ``slots``' output rows (those of ``reqs``) into the result rows and free the slots and their pages;
    ``finished``: they ended (``Request.length`` holds their lengths, recorded), else they were preempted.
    With ``kept``, finished rows keep the pages of the tokens they hold (their prompt and all but the last
    token).

    The result rows are device tensors: a harvest makes no host transfer."""
    device = state.device
    width = results.tokens.shape[1]
    done_slots = _index(slots, device, counters)
    rows = _index([r.row for r in reqs], device, counters)
    # Only the columns kept are gathered (the slots' output rows span the whole cache).
    results.tokens.index_copy_(0, rows, state.out_tokens[:, :width].index_select(0, done_slots))
    results.logprobs.index_copy_(0, rows, state.out_logprobs[:, :width].index_select(0, done_slots))
    top = results.top_ids.shape[-1]
    if top:
        results.top_ids.index_copy_(0, rows, state.out_top_ids[:, :width, :top].index_select(0, done_slots))
        results.top_logprobs.index_copy_(0, rows,
                                         state.out_top_logprobs[:, :width, :top].index_select(0, done_slots))
    for slot, req in zip(slots, reqs):
        if finished:
            counters.lengths[req.row] = req.length
        if finished and kept is not None:
            kept[req.row] = plan.keep(slot, req.prompt_len + req.length - 1)
        else:
            plan.free_slot(slot)
    if finished:
        counters.harvests += 1
    state.release(done_slots)


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
