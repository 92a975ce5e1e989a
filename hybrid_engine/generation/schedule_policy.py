"""What a generation call runs next: the scheduling decisions, apart from the device work that carries them out.

:class:`SchedulePolicy` holds the waiting queue, the running set (slot ->
:class:`~hybrid_engine.generation.request.Request`) and the free slots, and
answers ``next(reply)`` with one action: :class:`Admit`, :class:`Compact`,
:class:`Reserve`, :class:`Decode`, :class:`Look`, :class:`Harvest`,
:class:`Preempt`, :class:`DropStage` or :class:`Done`. The executor
(:func:`~hybrid_engine.generation.scheduler.run_schedule`) runs each one on
the device and replies with what only it can know: how many of an admission
started (:class:`Admitted`), how many steps the page pool could reserve, and
what one host read of the finish flags saw (:class:`Seen`).

Why the split: the rules (when to admit, how far to decode before looking,
whom to preempt) are host arithmetic over upper bounds, and keeping them free
of torch, the model and the runner lets them be tested step by step with a
scripted executor, while the executor stays a list of device operations. The
invariant the policy keeps is that the host never needs to look at tokens
to decide: it knows per running request an upper bound on the steps left
(``Request.left``), tightened at every :class:`Look`, and it plans only what
those bounds guarantee.

Pages stay with :class:`~hybrid_engine.generation.pages.PagePlan`, on the
executor's side: the policy asks for ``n`` steps (:class:`Reserve`) and is told
how many the pool holds; a round admits the requests that get pages and says
how many those were. That keeps one owner for the page ledger, and the policy's
decisions depend on pages only through those two replies.

The policy is a generator inside: each action is yielded at the very point the
old single loop ran it, so the order of operations (and with it the tokens,
stats and graphs of a call) is the same as before the split.

Planning ahead (``plan_ahead``): a :class:`Look` follows a run of steps the
device may still be running, so the policy works out there, before the read,
what it would run next if no row finished (:class:`_Forecast`: whether it
admits, the run's length and spans) and tells the executor the run's length
(``Look.ahead``), which reserves those pages while the device works. A look
that finds nothing finished changes no bound, so the forecast *is* the next
decision: it is used as it stands, and the host's work between the read and
the next run is the look itself. Anything that changes the running set or a
bound drops it, and the next run is worked out afresh; the pages reserved
ahead still stand for the rows that go on, as long as no row's bound changed
and the run is as long as forecast (``Reserve.ahead``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from hybrid_engine.generation.request import Request, Status

_NONE = -(1 << 62)  # below any token count: the max over an empty set of rows

__all__ = ["ADMISSION_COST", "Action", "Admit", "Admitted", "Compact", "Decode", "Done", "DropStage", "Harvest", "Look",
           "Preempt", "Reserve", "SchedulePolicy", "Seen", "Sizes", "may_stop_early", "step_spans"]

#: What one admission round costs, in decode steps, for the continuous-batching admission rule
#: (:func:`_steps_to_admission`). A round of staged prompts is about a quarter of a step on CPU (the
#: prefill, paid once per prompt whenever it runs, is not part of it); on a GPU it is one replay of ~40 small
#: kernels and two per layer (the K/V copy) beside a decode step's hundreds, so the value is not measured there
#: but errs on the high side.
ADMISSION_COST = 0.5


class Sizes(Protocol):
    """The graph sizes a call runs at (:class:`~hybrid_engine.graphs.runner.DecodeGraphRunner` is one)."""

    def bucket_for(self, n: int) -> int: ...  # the smallest batch bucket holding n rows

    def span_for(self, tokens: int) -> int: ...  # the span bucket rows of up to ``tokens`` tokens read


# ----------------------------------------------------------------- actions
@dataclass(frozen=True)
class Admit:
    """Start ``requests`` in ``slots`` (one admission round); reply :class:`Admitted`. ``waiting``: the queue
    after them, which the round may stage prompts ahead for."""

    slots: list[int]
    requests: list[Request]
    waiting: Iterable[Request]


@dataclass(frozen=True)
class Admitted:
    started: int  # the first ``started`` requests of the round got pages and started
    staged: bool  # the stage holds prompts (and their pages) after the round


@dataclass(frozen=True)
class DropStage:
    """Let go of the staged prompts' pages."""


@dataclass(frozen=True)
class Compact:
    """Move the rows of slots ``movers`` into slots ``holes`` (pairwise), for a smaller bucket."""

    movers: list[int]
    holes: list[int]


@dataclass(frozen=True)
class Reserve:
    """Give every running request (in ``requests``, by ``slot``, ``left`` and ``tokens_bound()``) the pages of
    its next ``steps`` steps, or of as many as the pool allows; reply the steps reserved (0: not one)."""

    steps: int
    requests: list[Request]
    #: The last Look's ``ahead``, where no bound of the requests it looked at changed since (their pages for that
    #: many steps were reserved then); 0 otherwise. Requests admitted since have no pages reserved ahead.
    ahead: int = 0


@dataclass(frozen=True)
class Decode:
    """``len(spans)`` decode steps at ``bucket``, step ``i`` reading ``spans[i]`` pages a row."""

    bucket: int
    spans: list[int]


@dataclass(frozen=True)
class Look:
    """Read the finish flags and generated counts of ``requests`` (the running ones); reply :class:`Seen`.
    ``ahead``: the steps of the next run if no row finishes (0: no forecast), whose pages the executor may
    reserve before it waits for the read (:meth:`~hybrid_engine.generation.pages.PagePlan.reserve_ahead`)."""

    requests: list[Request]
    ahead: int = 0


@dataclass(frozen=True)
class Seen:
    done: list[int]  # running slots that finished, in the order of ``Look.requests``
    generated: list[int]  # per slot: tokens generated (cut at a stop string where one ended the row)


@dataclass(frozen=True)
class Harvest:
    """Copy the finished ``requests`` (their ``length`` set) out of ``slots`` and free them; ``keep``: their
    rows keep the pages of the tokens they hold past the call."""

    slots: list[int]
    requests: list[Request]
    keep: bool


@dataclass(frozen=True)
class Preempt:
    """Copy ``request``'s tokens so far out of ``slot`` and free it; it waits to resume from
    ``request.resume_from``."""

    slot: int
    request: Request


@dataclass(frozen=True)
class Done:
    """Every request finished."""


Action = Admit | DropStage | Compact | Reserve | Decode | Look | Harvest | Preempt | Done


@dataclass(frozen=True)
class _Forecast:
    """What the next pass does if the coming look finds no row finished (its state is then unchanged)."""

    admit: bool  # it admits first (then the rest is worked out afresh)
    bucket: int
    wanted: int  # steps it reserves for
    spans: list[int]  # the span of each of those steps


# ------------------------------------------------------------------- rules
def step_spans(sizes: Sizes, bounds: list[tuple[int, int]], n: int) -> list[int]:
    """The span of each of the next ``n`` steps of rows with ``bounds`` (tokens held bound, steps left bound):
    step ``i`` reads ``span_for(max(h + min(i, left)) + 1)``. In O(rows + n) (rows grow by one token a step
    until their bound): ``max(h + i)`` over rows with ``left >= i``, and ``max(h + left)`` over the others."""
    if n <= 0:
        return []
    top = [_NONE] * (n + 1)  # by min(left, n): the longest row still growing
    flat = [_NONE] * (n + 1)  # by left < n: the longest row that stopped at its bound
    for h, left in bounds:
        c = min(left, n)
        if h > top[c]:
            top[c] = h
        if left < n and h + left > flat[left]:
            flat[left] = h + left
    for c in range(n - 1, -1, -1):
        top[c] = max(top[c], top[c + 1])
    spans, stopped = [], _NONE
    for i in range(n):
        longest = max(top[i] + i if top[i] != _NONE else _NONE, stopped)
        spans.append(sizes.span_for(longest + 1))
        stopped = max(stopped, flat[i])
    return spans


def may_stop_early(can_stop: bool, requests: Iterable[Request]) -> bool:
    """Whether a row may stop before its budget (``can_stop``: an EOS id is reachable, or stop sequences or
    strings are set) past its ``min_tokens``: then the host must look, and rows end unevenly."""
    return can_stop and any(r.min_tokens < r.budget for r in requests)


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


def _steps_to_shrink(sizes: Sizes, left: dict[int, int], bucket: int) -> int:
    """Steps until a host sync can change what runs: the live rows fit a smaller bucket, or every slot
    is done. ``left`` holds upper bounds, so the slots counted done are done."""
    bounds = sorted(left.values())
    for done, steps in enumerate(bounds, start=1):
        remaining = len(bounds) - done
        if remaining == 0 or sizes.bucket_for(remaining) < bucket:
            return steps
    return bounds[-1]


# ------------------------------------------------------------------ policy
class SchedulePolicy:
    """One call's scheduling decisions over ``requests`` (all WAITING), in up to ``max_active`` slots.

    ``continuous``: refill slots as requests finish (else a round waits for the running ones to end);
    ``can_stop``: rows may end before their budget (EOS reachable, stop sequences or strings), so the host looks
    at least every ``sync_interval`` steps; ``keep_pages``: finished rows keep their pages past the call;
    ``describe_pages``: the pool's state, for the no-progress errors."""

    def __init__(self, requests: list[Request], sizes: Sizes, *, max_active: int, continuous: bool,
                 sync_interval: int, can_stop: bool, keep_pages: bool = False,
                 describe_pages: Callable[[], str] = lambda: "pages unknown", plan_ahead: bool = True) -> None:
        if any(r.status is not Status.WAITING for r in requests):
            raise ValueError("SchedulePolicy: every request must be WAITING (a Request is one call's)")
        self.sizes = sizes
        self.max_active = max_active
        self.continuous = continuous
        self.sync_interval = sync_interval
        self.can_stop = can_stop
        self.keep_pages = keep_pages
        self.describe_pages = describe_pages
        self.waiting: deque[Request] = deque(requests)
        self.running: dict[int, Request] = {}  # slot -> request
        self.order: list[Request] = []  # running, oldest admission first (the newest is preempted first)
        self.free: list[int] = list(range(max_active))
        self.peak = 0  # most requests running at once
        self.staged = False  # the stage holds prompts (as the last admission or DropStage left it)
        self.starved = False  # no page for the next step: look, harvest, then preempt if still short
        self.blocked = False  # a round found no pages for its next request: admit again once pages are freed
        self.retried = False  # with nothing running, a round started nothing and the stage let go of its prompts
        self.idle = 0  # loop passes in a row that neither decoded nor harvested
        self.plan_ahead = plan_ahead  # forecast the next run before each look (module docstring)
        self._forecast: _Forecast | None = None  # made before the last look; dropped once anything changed
        self._ahead = 0  # the last look's ahead steps while the bounds of the rows it looked at hold
        self._run = self._passes()

    def next(self, reply: Any = None) -> Action:
        """The next action, given the reply to the last one (``None`` for the first, and for actions that
        have none)."""
        try:
            return self._run.send(reply)
        except StopIteration:
            return Done()

    # Every running request's bound on its steps left, by slot (the rules' view of the running set).
    def _lefts(self) -> dict[int, int]:
        return {slot: r.left for slot, r in self.running.items()}

    def _room(self) -> int:
        return min(len(self.waiting), self.max_active - len(self.running), len(self.free))

    def _cap(self) -> int | None:
        return self.sync_interval if may_stop_early(self.can_stop, self.running.values()) else None

    def _passes(self) -> Generator[Action, Any, None]:
        """The scheduling loop: a pass admits, decodes, looks, then harvests, preempts or drops the stage."""
        while self.waiting or self.running:
            if self._may_admit():
                if not (yield from self._admit()):
                    continue  # the stage was dropped: admit again
            stepped = False if self.starved else (yield from self._decode())
            ahead = self._forecast_next() if stepped and self.plan_ahead else 0
            seen: Seen = yield Look(list(self.running.values()), ahead)
            done, kept = set(seen.done), True  # kept: no bound of a row going on changed
            for slot, req in self.running.items():
                left = req.budget - seen.generated[slot]
                kept = kept and (left == req.left or slot in done)
                req.left = left
            self._ahead = ahead if kept else 0
            if done or not kept:
                self._forecast = None
            yield from self._settle(seen)
            self._check_progress(stepped or bool(seen.done))

    def _forecast_next(self) -> int:
        """Before a look: what the next pass does if no row finished (:class:`_Forecast`); the steps it would
        reserve for every running row (0: none)."""
        self._forecast = None
        going = [r for r in self.running.values() if r.left > 0]
        if len(going) < len(self.running):  # rows at their bound finish at this look: no forecast to keep
            return self._steps_after(going, len(self.running) - len(going)) if going else 0
        admit = self._may_admit()
        bucket = self.sizes.bucket_for(max(self.running) + 1)  # the last _decode compacted this running set
        wanted = self._steps_wanted(bucket)
        bounds = [(r.tokens_bound(), r.left) for r in self.running.values()]
        self._forecast = _Forecast(admit, bucket, wanted, step_spans(self.sizes, bounds, wanted))
        return self._steps_after(going, 0) if admit else wanted

    def _steps_after(self, going: list[Request], freed: int) -> int:
        """A guess at the next run's length, for the pages reserved ahead of a look (any guess is safe: a run
        of another length has its pages worked out afresh), where rows finish or an admission comes first:
        only ``going`` run on, their ``freed`` slots are free again, and a round starts what it takes."""
        lefts = {i: r.left for i, r in enumerate(going)}
        waiting = len(self.waiting)
        room = min(waiting, self.max_active - len(going), len(self.free) + freed)
        blocked = self.blocked and not freed
        rows = list(going)
        cap = self.sync_interval if may_stop_early(self.can_stop, rows) else None
        if room and not (blocked and going) and (not going or (self.continuous and _steps_to_admission(
                room, waiting, lefts, self.max_active, ADMISSION_COST, cap) == 0)):
            for r in itertools.islice(self.waiting, room):
                lefts[len(rows)] = r.budget - max(1, r.resume_from)
                rows.append(r)
            waiting, room, blocked = waiting - room, 0, False
            cap = self.sync_interval if may_stop_early(self.can_stop, rows) else None
        if blocked:
            n_steps = min((left for left in lefts.values() if left > 0), default=1)
        elif self.continuous and waiting:
            n_steps = _steps_to_admission(room, waiting, lefts, self.max_active, ADMISSION_COST, cap)
        else:
            n_steps = _steps_to_shrink(self.sizes, lefts, self.sizes.bucket_for(len(lefts))) if lefts else 0
        return max(0, n_steps if cap is None else min(n_steps, cap))

    def _may_admit(self) -> bool:
        if self._forecast is not None:
            return self._forecast.admit
        room = self._room()
        return bool(room and not self.starved and not (self.blocked and self.running) and (
            not self.running or (self.continuous and _steps_to_admission(
                room, len(self.waiting), self._lefts(), self.max_active, ADMISSION_COST, self._cap()) == 0)))

    def _admit(self) -> Generator[Action, Any, bool]:
        """One admission round into the lowest free slots; ``False`` when it started nothing and the stage was
        dropped for another try."""
        room = self._room()
        self._forecast = None
        slots, self.free = self.free[:room], self.free[room:]
        reqs = [self.waiting.popleft() for _ in range(room)]
        reply: Admitted = yield Admit(slots, reqs, self.waiting)
        started, self.staged = reply.started, reply.staged
        self.waiting.extendleft(reversed(reqs[started:]))  # no pages for them yet: first in line
        self.free = sorted(self.free + slots[started:])
        self.blocked = started < len(reqs)
        for slot, req in zip(slots[:started], reqs[:started]):
            req.status, req.slot, req.left = Status.RUNNING, slot, req.budget - max(1, req.resume_from)
            self.running[slot] = req
            self.order.append(req)
        self.peak = max(self.peak, len(self.running))
        if self.running:
            self.retried = False
            return True
        # A staged batch leaves its first samples their pages, but pages it holds can keep a resumed request
        # out: let go of them, once. A second round that starts nothing on an otherwise empty pool would be
        # staged the same way again, forever.
        if self.staged and not self.retried:
            yield DropStage()
            self.staged, self.blocked, self.retried = False, False, True
            return False
        first = reqs[0]
        raise RuntimeError(
            f"admission made no progress: with nothing running, a round could not start request "
            f"{first.row} (a prompt of {first.prompt_len} tokens, budget {first.budget}, "
            f"resumed at {first.resume_from}) with {self.describe_pages()}; the pool holds one request, which "
            f"the front end checks up front: this is a bug")

    def _decode(self) -> Generator[Action, Any, bool]:
        """Compact if the running rows fit a smaller bucket, then decode until a look can change what runs
        (as far as the pages allow); whether any step ran."""
        fc, self._forecast = self._forecast, None
        if fc is not None:  # nothing changed since it was made: it is this pass's decision
            bucket, wanted = fc.bucket, fc.wanted
        else:
            target = self.sizes.bucket_for(len(self.running))
            if max(self.running) >= target:
                yield self._compact(target)
            bucket = self.sizes.bucket_for(max(self.running) + 1)
            wanted = self._steps_wanted(bucket)
        ahead, self._ahead = self._ahead, 0
        n_steps = (yield Reserve(wanted, list(self.running.values()), ahead)) if wanted else 0
        if not n_steps:
            self.starved = bool(wanted)  # no page for the next step: look, harvest, then preempt if still short
            return False
        if fc is not None and n_steps <= len(fc.spans):
            spans = fc.spans[:n_steps]
        else:
            spans = step_spans(self.sizes, [(r.tokens_bound(), r.left) for r in self.running.values()], n_steps)
        yield Decode(bucket, spans)
        for req in self.running.values():
            req.left = max(0, req.left - n_steps)
        return True

    def _steps_wanted(self, bucket: int) -> int:
        """How many steps to run at ``bucket`` before a look can change what runs (0: none)."""
        cap = self._cap()
        if self.blocked:  # pages come back when a row finishes: look then
            n_steps = min((r.left for r in self.running.values() if r.left > 0), default=1)
        elif self.continuous and self.waiting:
            n_steps = _steps_to_admission(self._room(), len(self.waiting), self._lefts(), self.max_active,
                                          ADMISSION_COST, cap)
        else:
            n_steps = _steps_to_shrink(self.sizes, self._lefts(), bucket)
        if cap is not None:
            n_steps = min(n_steps, cap)
        return max(0, n_steps)

    def _compact(self, target: int) -> Compact:
        """Move running rows at slots >= ``target`` into free slots below it: rows move with their table rows,
        no K/V, so finished rows stop costing compute."""
        movers = sorted(s for s in self.running if s >= target)
        holes = sorted(s for s in self.free if s < target)[: len(movers)]
        for src, dst in zip(movers, holes):
            self.running[dst] = self.running.pop(src)
            self.running[dst].slot = dst
        self.free = sorted((set(self.free) - set(holes)) | set(movers))
        return Compact(movers, holes)

    def _settle(self, seen: Seen) -> Generator[Action, Any, None]:
        """After a look: harvest what finished; else, short of pages, drop the stage (before the last running
        request's progress) or preempt the newest admitted request."""
        if seen.done or self.starved:
            self._forecast = None
        if seen.done:
            reqs = [self._stop(slot, Status.FINISHED) for slot in seen.done]
            for req, slot in zip(reqs, seen.done):
                req.length = seen.generated[slot]
            yield Harvest(list(seen.done), reqs, self.keep_pages)
            self.free = sorted(self.free + seen.done)
            self.starved = self.blocked = False
        elif self.starved and len(self.running) == 1 and self.staged:
            yield DropStage()  # the staged prompts' pages go before the last running request's progress
            self.staged = self.starved = False
        elif self.starved:
            victim = self.order[-1]
            slot = victim.slot
            self._stop(slot, Status.PREEMPTED)
            victim.resume_from = seen.generated[slot]
            yield Preempt(slot, victim)
            self.waiting.appendleft(victim)
            self.free = sorted(self.free + [slot])
            # No admission (the preempted request first) until a row finishes: resuming it at once would take
            # back the pages the others need, and preempt again.
            self.starved, self.blocked = False, True

    def _stop(self, slot: int, status: Status) -> Request:
        """The request in ``slot`` leaves the running set with ``status``."""
        req = self.running.pop(slot)
        self.order.remove(req)
        req.status, req.slot = status, None
        return req

    def _check_progress(self, progressed: bool) -> None:
        """Between a decode step or a harvest and the next, a pass admits, preempts one row or lets go of the
        stage: at most about one pass per slot. Far more means the rules above stopped making progress."""
        self.idle = 0 if progressed else self.idle + 1
        if self.idle > 4 * self.max_active + 16:
            raise RuntimeError(
                f"the scheduler made no progress in {self.idle} passes (no decode step, no request finished) "
                f"with {len(self.running)} rows running, {len(self.waiting)} requests waiting and "
                f"{self.describe_pages()}: this is a bug")
