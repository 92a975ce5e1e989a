"""Slot scheduling for both generation paths: admission, shared prefill, pages, harvest, compaction, preemption.

``engine.generate`` admits its whole batch at once (static batching);
``HybridEngineRollout`` refills slots as requests finish (continuous
batching). Either way decode steps go to :meth:`DecodeGraphRunner.step` on the
smallest bucket holding the live rows, reading the smallest span of pages
holding the longest of them.

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

Host-built index tensors go the other way without a sync where the
accelerator has pinned memory (:func:`_index`). Pages, preemption and resuming
are :func:`run_schedule`'s; harvest and compaction are :func:`_harvest`'s and
:func:`_compact`'s; admission rounds are :func:`_admission_round`'s. A request
that continues a row of an earlier call (an episode's next turn) starts on the
pages that call kept (:func:`_continue_round`), and a call may keep its rows'
pages for the next (``kept``).

A request's first token comes from the prefill logits through the decode
step's sampler and counters, so where it runs (slot, round, bucket, span,
resumed or not) does not change what it samples.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hybrid_engine.accelerator.host_copy import device_tensor
from hybrid_engine.decode.kv_pool import NULL_PAGE, HeldPages
from hybrid_engine.decode.slots import DecodeSlots
from hybrid_engine.decode.staging import start_from_logits
from hybrid_engine.decode.step import extend, prefill
from hybrid_engine.generation.pages import PagePlan
from hybrid_engine.generation.stop_strings import StopStrings
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
    prompt_len: int  # real prompt tokens
    min_tokens: int = 0  # EOS is suppressed before this many tokens
    resume_from: int = 0  # tokens it had generated when it was preempted (0: not preempted)
    knob: int = 0  # the index of its sampling setting in the call's table (SamplingKnobs.set_table)
    seed: int | None = None  # its own sampler seed (None: the call's)
    held: HeldPages | None = None  # the pages an earlier call kept of its prompt's first tokens (it continues them)

    def seed_or(self, call_seed: int) -> int:
        return call_seed if self.seed is None else self.seed


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
    page_table_writes: int = 0  # host-to-device copies of new block table entries
    bucket_steps: dict[int, int] = field(default_factory=dict)
    span_steps: dict[int, int] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)


class Results(NamedTuple):
    """A call's result rows on the device, one per request: tokens and logprobs ``[R, width]``, and the ranked
    alternatives ``[R, width, top]`` (``top`` 0 unless asked for)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


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

    def __init__(self, rows: int, shared_prefill: bool, requests: Iterable[RequestSpec]) -> None:
        self.rows = rows
        self.shared = shared_prefill
        self.row_of: dict[Hashable, int] = {}
        self.used: set[Hashable] = set()
        self.pending = Counter(self.unit(r) for r in requests if r.held is None)

    def unit(self, req: RequestSpec) -> tuple[int, ...]:
        """What is prefilled for ``req``: its prompt, shared by its samples, or its own copy of it."""
        return (req.prompt_index,) if self.shared else (req.prompt_index, req.request_index)

    def next_batch(self, upcoming: Iterable[RequestSpec], plan: PagePlan) -> list[tuple[int, ...]]:
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


def _admission_round(
    runner: DecodeGraphRunner,
    plan: PagePlan,
    slots: list[int],
    reqs: list[RequestSpec],
    queue: deque[RequestSpec],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    results: Results,
    sampling_key: tuple[float, float, int],
    seed: int,
    *,
    staging: _Staging | None,
    counters: Counters,
) -> int:
    """Start ``reqs`` in ``slots`` (one admission round), prefilling what they need; returns how many started.

    Continuous batching admits waiting requests into the lowest free slots in
    rounds; a round costs about ``ADMISSION_COST`` decode steps, so free slots
    are held back until idling them would cost more (:func:`_steps_to_admission`).

    The round stops at the first request the pool has no pages for; it and the
    ones after it are not started (the caller puts them back). ``staging``: the
    round reads prompts staged ahead, prefilling the next batch when a
    request's prompt is not staged (a round straddling batches runs as one part
    per batch); ``None``: the requests are prefilled eagerly at the batch's own
    width, as transformers prefills them (never graphed). Resumed requests
    prefill their prompt and tokens so far, eagerly.
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

    for i, (slot, req) in enumerate(zip(slots, reqs)):
        if i < started:  # continued in the run of them below
            continue
        if req.held is not None and not req.resume_from:
            run_part()
            run = next((j for j in range(i, len(reqs)) if reqs[j].held is None or reqs[j].resume_from), len(reqs))
            n = _continue_round(runner, plan, slots[i:run], reqs[i:run], prompt_ids, prompt_mask, sampling_key,
                                seed, counters)
            started += n
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
            batch = staging.next_batch(itertools.chain(reqs[started:], queue), plan)
            if not batch:
                break
            index = _index([u[0] for u in batch], prompt_ids.device, counters)
            runner.prefill_prompts(prompt_ids.index_select(0, index), prompt_mask.index_select(0, index),
                                   [plan.unit_pages[u][0] for u in batch], counters)
            counters.prefill_forwards += 1
            counters.prefill_rows += len(batch)
            counters.prefill_tokens += sum(plan.unit_pages[u][1] for u in batch)
        pages = plan.admit(slot, unit, last=staging.pending[unit] == 1)
        if pages is None:
            break
        staging.pending[unit] -= 1
        counters.kv_row_copies += unit in staging.used
        staging.used.add(unit)
        part.append([slot, staging.row_of[unit], req.rng_index, req.budget, req.min_tokens, req.seed_or(seed),
                     req.prompt_len,
                     pages.src, pages.dst, req.knob] + pages.table)
        started += 1
    run_part()
    return started


def _unstaged_round(runner: DecodeGraphRunner, plan: PagePlan, slots: list[int], reqs: list[RequestSpec],
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
    table = [pages + [NULL_PAGE] * (state.cache.max_pages - len(pages)) for pages in taken]
    state.cache.block_table.index_copy_(0, rows, _index(table, device, counters))
    index = _index([r.prompt_index for r in reqs[:n]], device, counters)
    logits = prefill(runner.model, state.cache, prompt_ids.index_select(0, index), prompt_mask.index_select(0, index),
                     rows=rows, checked=True)
    _start(state, logits, rows, reqs[:n], sampling_key, seed, counters)
    return n


def _start(state: DecodeSlots, logits: torch.Tensor, rows: torch.Tensor, reqs: list[RequestSpec],
           sampling_key: tuple[float, float, int], seed: int, counters: Counters) -> None:
    """Start ``reqs`` in slots ``rows`` from their prompts' last ``logits`` (row ``i`` for request ``i``)."""
    device = state.device
    meta = _index([[r.rng_index for r in reqs], [r.budget for r in reqs], [r.min_tokens for r in reqs],
                   [r.seed_or(seed) for r in reqs], [r.knob for r in reqs]], device, counters)
    start_from_logits(state, logits, rows, torch.arange(len(reqs), device=device), meta[0], meta[1], meta[2],
                      meta[3], sampling_key, meta[4])


def _resume(runner: DecodeGraphRunner, plan: PagePlan, slot: int, req: RequestSpec, prompt_ids: torch.Tensor,
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
    state.cache.block_table[slot].copy_(_index(pages + [NULL_PAGE] * (state.cache.max_pages - len(pages)), device, counters))
    history = out_tokens[req.request_index, : generated - 1]
    ids = torch.cat([prompt_ids[req.prompt_index], history])[None]
    mask = torch.cat([prompt_mask[req.prompt_index], torch.ones_like(history)])[None]
    prefill(runner.model, state.cache, ids, mask, rows=_index([slot], device, counters), checked=True)
    state.resume(slot, out_tokens[req.request_index], out_logprobs[req.request_index], generated,
                 seed=req.seed_or(seed),
                 request_index=req.rng_index, budget=req.budget, min_tokens=req.min_tokens,
                 out_top=(top_ids[req.request_index], top_lp[req.request_index]), knob=req.knob)
    counters.prefill_forwards += 1
    counters.prefill_rows += 1
    counters.prefill_tokens += req.prompt_len + generated - 1
    return True


def _continue_round(runner: DecodeGraphRunner, plan: PagePlan, slots: list[int], reqs: list[RequestSpec],
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
    cache.block_table.index_copy_(0, rows, _index([t + [NULL_PAGE] * (cache.max_pages - len(t)) for t in tables],
                                                  device, counters))
    start = _index(cached, device, counters)
    cache.write_pos.index_copy_(0, rows, start)
    cache.position.index_copy_(0, rows, start)
    index = _index([r.prompt_index for r in reqs[:n]], device, counters)
    pad = width - _index(new, device, counters)
    ids = prompt_ids.index_select(0, index)[:, -width:]
    mask = (torch.arange(width, device=device)[None, :] >= pad[:, None]).to(prompt_mask.dtype)
    logits = extend(runner.model, cache, ids, mask, rows,
                    runner.span_for(max(r.prompt_len for r in reqs[:n])))
    _start(state, logits, rows, reqs[:n], sampling_key, seed, counters)
    counters.prefill_forwards += 1
    counters.prefill_rows += n
    counters.prefill_tokens += sum(new)
    counters.kv_reused_tokens += sum(cached)
    return n


def _compact(state: DecodeSlots, plan: PagePlan, active: dict[int, RequestSpec], left: dict[int, int],
             free: list[int], order: list[int], target: int, counters: Counters) -> list[int]:
    """Move live rows at slots >= ``target`` into free slots below it; return the new free list.

    Run when the live rows fit a smaller bucket: the rows move with their table rows, no K/V, so finished rows
    stop costing compute."""
    movers = sorted(s for s in active if s >= target)
    holes = sorted(s for s in free if s < target)[: len(movers)]
    device = state.device
    state.move(_index(movers, device, counters), _index(holes, device, counters))
    for src, dst in zip(movers, holes):
        active[dst] = active.pop(src)
        left[dst] = left.pop(src)
        plan.move(src, dst)
        order[order.index(src)] = dst
    counters.compactions += 1
    counters.rows_moved += len(movers)
    return sorted((set(free) - set(holes)) | set(movers))


def _may_stop_early(state: DecodeSlots, requests: Iterable[RequestSpec], strings: bool = False) -> bool:
    """Whether a row may stop on EOS, a stop sequence or a stop string before its budget: then the host must
    look, and rows end unevenly."""
    return ((state.eos_reachable or state.has_stop_sequences or strings)
            and any(r.min_tokens < r.budget for r in requests))


def _cut_at_stop_strings(state: DecodeSlots, stop: StopStrings, active: dict[int, RequestSpec],
                         generated: list[int], done: list[int], checked: dict[int, int],
                         counters: Counters) -> list[int]:
    """The slots done once stop strings are looked for (one more host read: the live rows' tokens); a row
    that holds one gets its length cut in ``generated``. ``checked``: per request, a prefix known to hold none."""
    slots = list(active)
    longest = max(generated[s] for s in slots)
    if not longest:
        return done
    rows = state.out_tokens[:, :longest].index_select(0, _index(slots, state.device, counters)).tolist()
    counters.host_syncs += 1
    ended = set(done)
    for slot, row in zip(slots, rows):
        req, n = active[slot], generated[slot]
        cut = stop.cut(row[:n], checked.get(req.request_index, 0), req.min_tokens)
        if cut is not None:
            generated[slot] = cut
            ended.add(slot)
        elif n > req.min_tokens:
            checked[req.request_index] = n
    return [s for s in active if s in ended]


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


def _held(req: RequestSpec, left: int) -> int:
    """An upper bound on the tokens a row holds now (its prompt, and every token but the last one generated)."""
    return req.prompt_len + req.budget - left - 1


def _reserve(plan: PagePlan, active: dict[int, RequestSpec], left: dict[int, int], n_steps: int) -> int:
    """Give every live row the pages of its next ``n_steps`` steps, or of as many steps as the pool allows
    (nothing is taken for steps that do not fit); returns the steps reserved (0: not even one)."""
    def missing(n: int) -> int:
        return sum(plan.missing(s, _held(r, left[s]) + min(n, left[s])) for s, r in active.items())

    free = plan.room(missing(n_steps))
    if missing(n_steps) > free:
        lo, hi = 0, n_steps  # the largest n with missing(n) <= free: missing grows with n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if missing(mid) <= free else (lo, mid - 1)
        n_steps = lo
    for s, r in active.items():
        if not plan.grow(s, _held(r, left[s]) + min(n_steps, left[s])):
            raise RuntimeError("page reservation exceeded the free pages it counted")  # a bug, not an input
    return n_steps


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

    ``kept`` (a dict, filled in): every finished request keeps the pages of the tokens it holds past the call
    (:class:`~hybrid_engine.decode.kv_pool.HeldPages`, by request index) for a later request that continues it
    (``RequestSpec.held``); the caller releases them.
    """
    state = runner.slots
    device = state.device
    plan = PagePlan(runner.ledger, runner.kv_pool.page_size, state.cache.max_pages)
    staging = _Staging(runner.stage.rows, shared_prefill, requests) if staged else None
    # Every slot starts free, whatever an interrupted earlier call left live.
    state.release(torch.arange(state.rows, device=device))
    # The values the graphs of this sampling mode read; several settings: sampling_key is their union_mode.
    state.knobs.set_table(settings or [sampling_key], logprobs=logprobs)
    num_requests = len(requests)
    results = Results(torch.zeros(num_requests, width, dtype=torch.int64, device=device),
                      torch.zeros(num_requests, width, dtype=torch.float32, device=device),
                      torch.zeros(num_requests, width, top_logprobs, dtype=torch.int64, device=device),
                      torch.zeros(num_requests, width, top_logprobs, dtype=torch.float32, device=device))
    queue = deque(requests)
    free = list(range(max_active))
    active: dict[int, RequestSpec] = {}  # slot -> request
    left: dict[int, int] = {}  # slot -> upper bound on decode steps before it must have finished
    order: list[int] = []  # active slots, oldest admission first (the newest is preempted first)
    try:
        # Rows can finish at different times (EOS, unequal budgets, more requests than slots): the call may
        # compact into every smaller bucket, so those are captured up front too.
        strings = stop_strings is not None
        checked: dict[int, int] = {}  # request -> a prefix of its response known to hold no stop string
        shrink = (_may_stop_early(state, requests, strings) or len({r.budget for r in requests}) > 1
                  or len(requests) > max_active)
        if any(r.budget > 1 for r in requests):  # some row decodes at all
            spans = runner.spans_between(min(r.prompt_len for r in requests) + 1,
                                         max(r.prompt_len + r.budget for r in requests) - 1)
            runner.capture_buckets(runner.bucket_for(min(max_active, len(requests))), spans, sampling_key, shrink)
        if staged and len(requests) > 1:  # rounds of every size this call may admit (single rounds need no graph)
            runner.capture_rounds(runner.bucket_for(min(max_active, len(requests))), sampling_key)
            state.release(torch.arange(state.rows, device=device))
        starved = False
        blocked = False  # a round found no pages for its next request: admit again once pages are freed
        retried = False  # with nothing running, a round started nothing and the stage let go of its prompts
        idle = 0  # loop passes in a row that neither decoded nor harvested
        while queue or active:
            stepped = False
            room = min(len(queue), max_active - len(active), len(free))
            cap = sync_interval if _may_stop_early(state, active.values(), strings) else None
            if room and not starved and not (blocked and active) and (not active or (continuous and _steps_to_admission(
                    room, len(queue), left, max_active, ADMISSION_COST, cap) == 0)):
                slots, free = free[:room], free[room:]
                reqs = [queue.popleft() for _ in range(room)]
                with counters.timer.phase("prefill"):
                    started = _admission_round(runner, plan, slots, reqs, queue, prompt_ids, prompt_mask,
                                               results, sampling_key, seed, staging=staging,
                                               counters=counters)
                queue.extendleft(reversed(reqs[started:]))  # no pages for them yet: first in line
                free = sorted(free + slots[started:])
                blocked = started < len(reqs)
                for slot, req in zip(slots[:started], reqs[:started]):
                    active[slot] = req
                    left[slot] = req.budget - max(1, req.resume_from)
                    order.append(slot)
                counters.peak_active_batch = max(counters.peak_active_batch, len(active))
                if not active:
                    # A staged batch leaves its first samples their pages (_Staging.next_batch), but pages it
                    # holds can keep a resumed request out: let go of them, once. A second round that starts
                    # nothing on an otherwise empty pool would be staged the same way again, forever.
                    if staging is not None and staging.row_of and not retried:
                        staging.drop(plan)
                        blocked, retried = False, True
                        continue
                    raise RuntimeError(
                        f"admission made no progress: with nothing running, a round could not start request "
                        f"{reqs[0].request_index} (a prompt of {reqs[0].prompt_len} tokens, budget {reqs[0].budget}, "
                        f"resumed at {reqs[0].resume_from}) with {plan.ledger.free} of {plan.ledger.capacity} pages "
                        f"free; the pool holds one request, which the front end checks up front: this is a bug")
                retried = False

            if not starved:
                target = runner.bucket_for(len(active))
                if max(active) >= target:
                    free = _compact(state, plan, active, left, free, order, target, counters)
                bucket = runner.bucket_for(max(active) + 1)
                cap = sync_interval if _may_stop_early(state, active.values(), strings) else None
                if blocked:  # pages come back when a row finishes: look then
                    n_steps = min((v for v in left.values() if v > 0), default=1)
                elif continuous and queue:
                    room = min(len(queue), max_active - len(active), len(free))
                    n_steps = _steps_to_admission(room, len(queue), left, max_active, ADMISSION_COST, cap)
                else:
                    n_steps = _steps_to_shrink(runner, left, bucket)
                if cap is not None:
                    n_steps = min(n_steps, cap)
                wanted = max(0, n_steps)
                n_steps = _reserve(plan, active, left, wanted) if wanted else 0
                counters.page_table_writes += plan.flush(state.cache.block_table, counters) > 0
                if n_steps:
                    stepped = True
                    with counters.timer.phase("decode"):
                        held = [(_held(r, left[s]), left[s]) for s, r in active.items()]
                        for i in range(n_steps):
                            span = runner.span_for(max(h + min(i, lft) for h, lft in held) + 1)
                            runner.step(bucket, span, sampling_key)
                            counters.span_steps[span] = counters.span_steps.get(span, 0) + 1
                    counters.decode_steps += n_steps
                    counters.bucket_steps[bucket] = counters.bucket_steps.get(bucket, 0) + n_steps
                    for slot in left:
                        left[slot] = max(0, left[slot] - n_steps)
                elif wanted:
                    starved = True  # no page for the next step: look, harvest, then preempt if still short

            # One host read of the per-slot flags: what scheduling needs, nothing per token.
            flags = torch.stack([state.finished.to(torch.int64), state.token_index]).cpu()
            counters.host_syncs += 1
            finished_flags, generated = flags[0].tolist(), flags[1].tolist()
            done = [slot for slot in active if finished_flags[slot]]
            if strings:
                done = _cut_at_stop_strings(state, stop_strings, active, generated, done, checked, counters)
            for slot in active:
                left[slot] = active[slot].budget - generated[slot]
            if plan.ledger.in_use == plan.ledger.peak:  # at the peak: how much of it the tokens held need
                held = {s: r.prompt_len + generated[s] - 1 for s, r in active.items()}
                counters.kv_pages_held_peak = max(counters.kv_pages_held_peak, plan.held_pages(held))
            if done:
                _harvest(state, plan, done, active, left, order, results, width, counters,
                         generated, kept)
                free = sorted(free + done)
                starved = blocked = False
            elif starved and len(active) == 1 and staging is not None and staging.row_of:
                staging.drop(plan)  # the staged prompts' pages go before the last running request's progress
                starved = False
            elif starved:
                victim = order[-1]
                req = active[victim]
                _harvest(state, plan, [victim], active, left, order, results, width, counters,
                         None)
                queue.appendleft(dataclasses.replace(req, resume_from=generated[victim]))
                free = sorted(free + [victim])
                counters.preemptions += 1
                # No admission (the preempted request first) until a row finishes: resuming it at once would
                # take back the pages the others need, and preempt again.
                starved, blocked = False, True
            # Between a decode step or a harvest and the next, a pass admits, preempts one row or lets go of the
            # stage: at most about one pass per slot. Far more means the rules above stopped making progress.
            idle = 0 if stepped or done else idle + 1
            if idle > 4 * max_active + 16:
                raise RuntimeError(
                    f"the scheduler made no progress in {idle} passes (no decode step, no request finished) with "
                    f"{len(active)} rows running, {len(queue)} requests waiting and {plan.ledger.free} of "
                    f"{plan.ledger.capacity} pages free: this is a bug")
    finally:
        counters.kv_pages_peak = plan.ledger.peak
        plan.close()
    return results


def _harvest(state: DecodeSlots, plan: PagePlan, done: list[int], active: dict[int, RequestSpec],
             left: dict[int, int], order: list[int], results: Results,
             width: int, counters: Counters, generated: list[int] | None,
             kept: dict[int, HeldPages] | None = None) -> None:
    """Copy ``done`` slots' output rows into the result rows and free the slots and their pages; ``generated``
    (the host's read of ``token_index``) records their lengths (``None``: preempted, not finished). With
    ``kept``, finished rows keep the pages of the tokens they hold (their prompt and all but the last token).

    The result rows are device tensors: a harvest makes no host transfer."""
    device = state.device
    done_slots = _index(done, device, counters)
    rows = _index([active[s].request_index for s in done], device, counters)
    # Only the columns kept are gathered (the slots' output rows span the whole cache).
    results.tokens.index_copy_(0, rows, state.out_tokens[:, :width].index_select(0, done_slots))
    results.logprobs.index_copy_(0, rows, state.out_logprobs[:, :width].index_select(0, done_slots))
    top = results.top_ids.shape[-1]
    if top:
        results.top_ids.index_copy_(0, rows, state.out_top_ids[:, :width, :top].index_select(0, done_slots))
        results.top_logprobs.index_copy_(0, rows,
                                         state.out_top_logprobs[:, :width, :top].index_select(0, done_slots))
    for slot in done:
        req = active[slot]
        if generated is not None:
            counters.lengths[req.request_index] = generated[slot]
        del active[slot]
        del left[slot]
        order.remove(slot)
        if generated is not None and kept is not None:
            kept[req.request_index] = plan.keep(slot, req.prompt_len + generated[slot] - 1)
        else:
            plan.free_slot(slot)
    if generated is not None:
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
