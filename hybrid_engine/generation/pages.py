"""Which pages each slot and each staged prompt holds during a call: host bookkeeping, written to the device ahead.

The host knows every live row's length bound (its prompt, plus at most one
token per step since it last looked), so it assigns pages before the steps
that fill them, and no decode step reads the device to find a page:

* a staged prompt holds the pages its prefill writes (:meth:`PagePlan.stage`),
  taken only while the pages the first sample of each staged prompt needs to
  start (:meth:`PagePlan.first_sample_pages`) stay free: a stage that took
  them could start no sample with nothing running, and would be dropped and
  staged again forever;
* an admitted sample shares its prompt's full pages (one more reference each)
  and gets its own copy of the partly filled last page (copy-on-write), except
  the prompt's last sample, which takes that page itself (:meth:`PagePlan.admit`);
* before a run of decode steps every live row gets the pages those steps reach
  (:meth:`PagePlan.grow`); the new table entries go to the device in one copy
  (:meth:`PagePlan.flush`);
* while the device runs a run of steps, before the host reads its flags,
  every live row may be given the pages of the next run ahead
  (:meth:`PagePlan.reserve_ahead`, the worst case: every row continues).
  Those pages are *tentative*: the plan's answers to everyone else (what is
  missing, how much room there is, whether an admission gets pages) count
  them as free, and take them back on demand (:meth:`PagePlan._reclaim`)
  before evicting a held row, so every decision is the one the plan would
  make without them; the next reservation commits those its steps need and
  gives the rest back (:meth:`PagePlan.commit_ahead`, :meth:`PagePlan.drop_ahead`);
* a harvested or preempted row gives its pages back (:meth:`PagePlan.free_slot`);
  a page is free once nobody holds it (:class:`~hybrid_engine.decode.kv_pool.PageLedger`);
* a row that a later call continues (an episode's next turn) keeps the pages of
  the tokens it holds past the call (:meth:`PagePlan.keep`), and the later call
  takes them over (:meth:`PagePlan.adopt`). When a call runs short, such held
  rows are evicted, oldest first, before anything waits.

A plan is one call's: pages its slots still hold when the call ends are released with it.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from hybrid_engine.accelerator.host_copy import CountsHostSyncs, device_tensor
from hybrid_engine.decode.kv_pool import NULL_PAGE, HeldPages, PageLedger, pages_for

__all__ = ["AdmittedPages", "PagePlan"]


class AdmittedPages:
    """A sample's block table row, and the page copied (``src``) into its own last page (``dst``)."""

    __slots__ = ("dst", "src", "table")

    def __init__(self, table: list[int], src: int, dst: int) -> None:
        self.table, self.src, self.dst = table, src, dst


class PagePlan:
    """One call's page assignments over ``ledger``, for slots of ``max_pages`` pages of ``page_size`` tokens."""

    def __init__(self, ledger: PageLedger, page_size: int, max_pages: int) -> None:
        self.ledger = ledger
        self.page_size = page_size
        self.max_pages = max_pages
        self.slot_pages: dict[int, list[int]] = {}
        self.unit_pages: dict[Hashable, tuple[list[int], int]] = {}  # staged prompt -> (pages, tokens)
        self._pending: dict[tuple[int, int], int] = {}  # (slot, logical page) -> pool page, not yet on the device
        self._ahead: dict[int, int] = {}  # slot -> its last pages that are tentative (reserved ahead)
        self._ticket: tuple[int, int] | None = None  # (steps, epoch) of the last reserve_ahead
        self._epoch = 0  # bumped whenever a live row's tentative pages change (a harvest's go with the row)
        ledger.start_call()
        ledger.tentative = 0  # a call's own (one call plans at a time): none left by an interrupted one counts
        ledger.reset_peak()

    def _allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages, taking tentative pages back and then evicting held rows of earlier calls when too
        few are free; ``None`` (nothing taken) when even that leaves too few."""
        if self.ledger.free < n:
            self._reclaim(n - self.ledger.free)
        pages = self.ledger.allocate(n)
        if pages is None and self.ledger.evict(n):
            pages = self.ledger.allocate(n)
        return pages

    def room(self, n: int) -> int:
        """Free pages, tentative ones included, after evicting held rows for up to ``n`` of them."""
        self.ledger.evict(n - self.ledger.tentative)
        return self.ledger.free + self.ledger.tentative

    # ----------------------------------------------------------- tentative pages
    def _give_back(self, slot: int, k: int) -> None:
        """Slot ``slot``'s last ``k`` pages (tentative) go back to the pool; its table entries for them return
        to the null page (dropped if they never reached the device)."""
        held = self.slot_pages[slot]
        first = len(held) - k
        for i in range(first, len(held)):
            if self._pending.pop((slot, i), None) is None:
                self._pending[(slot, i)] = NULL_PAGE
        self.ledger.release(held[first:])
        del held[first:]
        self.ledger.commit(k)

    def _reclaim(self, n: int) -> None:
        """Take back up to ``n`` tentative pages, newest rows' first."""
        for slot in reversed(list(self._ahead)):
            if n <= 0:
                break
            k = min(n, self._ahead[slot])
            self._give_back(slot, k)
            n -= k
            self._ahead[slot] -= k
            if not self._ahead[slot]:
                del self._ahead[slot]
        self._epoch += 1

    def reserve_ahead(self, targets: list[tuple[int, int]], steps: int) -> bool:
        """Give each ``(slot, tokens)`` of ``targets`` (every live row: the next run of ``steps`` steps if it
        continues) tentative pages to hold ``tokens`` tokens, only when the free pages cover all of them
        (nothing is evicted, nobody waits: the plan gives them back on demand); whether it did. Their table
        entries wait for :meth:`flush`."""
        self._ticket = None
        if self._ahead:
            self.drop_ahead()
        need = [(slot, self._lacks(slot, tokens)) for slot, tokens in targets]
        total = sum(n for _, n in need)
        if total > self.ledger.free:
            return False
        fresh = self.ledger.allocate(total, tentative=True) or []
        for slot, n in need:
            if n:
                held = self.slot_pages[slot]
                for i, page in enumerate(fresh[:n]):
                    self._pending[(slot, len(held) + i)] = page
                held.extend(fresh[:n])
                fresh = fresh[n:]
                self._ahead[slot] = self._ahead.get(slot, 0) + n
        self._ticket = (steps, self._epoch)
        return True

    def ahead_intact(self, steps: int) -> bool:
        """Whether the rows still live of the last :meth:`reserve_ahead`, made for ``steps`` steps, hold every
        tentative page it gave them (rows harvested since took theirs with them)."""
        return self._ticket == (steps, self._epoch)

    def commit_ahead(self) -> None:
        """The tentative pages are needed as they stand (:meth:`ahead_intact`: the caller's rows reserve the
        steps they were reserved for, with the same bounds): they become their rows' own."""
        self.ledger.commit(sum(self._ahead.values()))
        self._ahead.clear()
        self._ticket = None

    def drop_ahead(self) -> None:
        """Give back every tentative page (a reservation took what its steps need)."""
        for slot, k in self._ahead.items():
            self._give_back(slot, k)
        self._ahead.clear()
        self._ticket = None

    # ---------------------------------------------------------------- prompts
    def stage(self, unit: Hashable, tokens: int, *, spare: int = 0) -> list[int] | None:
        """Pages for a staged prompt of ``tokens`` tokens, taken only if ``spare`` more stay free afterwards
        (``None``, nothing taken: not enough free). ``spare``: what the samples of the prompts staged with it
        need to start (:meth:`first_sample_pages`), so the stage never takes the pages its own prompts'
        samples need."""
        n = pages_for(tokens, self.page_size)
        if self.room(n + spare) < n + spare:
            return None
        pages = self._allocate(n)
        if pages is not None:
            self.unit_pages[unit] = (pages, tokens)
        return pages

    def first_sample_pages(self, tokens: int, *, last: bool) -> int:
        """Fresh pages the first sample of a staged prompt of ``tokens`` tokens takes to be admitted and run its
        first decode step (``last``: no other sample reads the prompt): its own copy of the partly filled last
        page (:meth:`admit`), or, where the prompt fills its pages, the page its first response token starts;
        none when it takes the prompt's partial last page itself."""
        return 0 if last and tokens % self.page_size else 1

    def unstage(self, unit: Hashable) -> None:
        """The stage lets go of a prompt's pages (samples that share them keep them)."""
        pages, _ = self.unit_pages.pop(unit)
        self.ledger.release(pages)

    def admit(self, slot: int, unit: Hashable, *, last: bool) -> AdmittedPages | None:
        """Slot ``slot`` starts a sample of the staged ``unit``; ``last``: no later sample of the call reads the
        unit. ``None`` (nothing taken) when no page is free for the sample's own last page."""
        pages, tokens = self.unit_pages[unit]
        full = tokens // self.page_size
        shared = pages[:full]
        if full == len(pages):  # no partial page: the first response token starts a page of its own (grow)
            own, src, dst = [], 0, 0
        elif last:
            own = [pages[full]]
            src = dst = pages[full]
        else:
            fresh = self._allocate(1)
            if fresh is None:
                return None
            own, src, dst = fresh, pages[full], fresh[0]
        self.ledger.retain(shared + ([pages[full]] if last and own else []))
        held = shared + own
        self.slot_pages[slot] = held
        return AdmittedPages(held + [0] * (self.max_pages - len(held)), src, dst)

    def take(self, slot: int, tokens: int) -> list[int] | None:
        """Fresh pages for ``tokens`` tokens of a slot prefilled directly (engine.generate, a resumed
        request); ``None`` when not enough are free. The caller writes the slot's table row."""
        pages = self._allocate(pages_for(tokens, self.page_size))
        if pages is not None:
            self.slot_pages[slot] = pages
        return pages

    def adopt(self, slot: int, held: HeldPages, tokens: int) -> list[int] | None:
        """Slot ``slot`` continues a row on the pages ``held`` kept, and gets fresh ones up to ``tokens`` tokens;
        ``None`` when ``held`` is gone (evicted) or no page is free (``held`` stays as it was). The caller writes
        the slot's table row."""
        pages = self.ledger.take_held(held) if held.live_in(self.ledger) else None
        if pages is None:
            return None
        fresh = self._allocate(max(0, pages_for(tokens, self.page_size) - len(pages)))
        if fresh is None:
            held.pages = pages
            self.ledger.rehold(held)
            return None
        self.slot_pages[slot] = pages + fresh
        return self.slot_pages[slot]

    def keep(self, slot: int, tokens: int) -> HeldPages:
        """Slot ``slot``'s row is harvested, and its first ``tokens`` tokens' K/V stay held past the call (pages
        beyond them go back)."""
        self._forget(slot)
        pages = self.slot_pages.pop(slot)
        n = pages_for(tokens, self.page_size)
        self.ledger.release(pages[n:])
        return self.ledger.hold(pages[:n], tokens)

    # ----------------------------------------------------------------- decode
    def _lacks(self, slot: int, tokens: int) -> int:
        """Pages slot ``slot`` lacks to hold ``tokens`` tokens, its tentative ones counted as held."""
        return max(0, pages_for(min(tokens, self.max_pages * self.page_size), self.page_size)
                   - len(self.slot_pages[slot]))

    def missing(self, slot: int, tokens: int) -> int:
        """Pages slot ``slot`` lacks to hold ``tokens`` tokens (its tentative pages are not its own yet)."""
        return max(0, pages_for(min(tokens, self.max_pages * self.page_size), self.page_size)
                   - len(self.slot_pages[slot]) + self._ahead.get(slot, 0))

    def grow(self, slot: int, tokens: int) -> bool:
        """Give slot ``slot`` the pages to hold ``tokens`` tokens, its own tentative pages first (``False``,
        nothing taken, when not enough are free); the new table entries wait for :meth:`flush`."""
        n = self.missing(slot, tokens)
        if n == 0:
            return True
        own = min(n, self._ahead.get(slot, 0))
        if own:  # committed here, so that a reclaim for the rest takes none of them
            self._ahead[slot] -= own
            if not self._ahead[slot]:
                del self._ahead[slot]
            self.ledger.commit(own)
            self._epoch += 1
        fresh = self._allocate(n - own) if n > own else []
        if fresh is None:
            if own:  # nothing taken: they are tentative again
                self._ahead[slot] = self._ahead.get(slot, 0) + own
                self.ledger.tentative += own
            return False
        held = self.slot_pages[slot]
        for i, page in enumerate(fresh):
            self._pending[(slot, len(held) + i)] = page
        held.extend(fresh)
        return True

    def flush(self, block_table: torch.Tensor, counters: CountsHostSyncs | None = None) -> int:
        """Write the table entries :meth:`grow` made into ``block_table`` (one host-to-device copy); returns how
        many were written. Outside capture, before the steps that reach them."""
        if not self._pending:
            return 0
        entries = device_tensor([(s, i, p) for (s, i), p in self._pending.items()], block_table.device,
                                counters=counters).t()
        block_table.index_put_((entries[0], entries[1]), entries[2])
        n = len(self._pending)
        self._pending.clear()
        return n

    def move(self, src: int, dst: int) -> None:
        """Slot ``src``'s pages now belong to slot ``dst`` (compaction moved its table row)."""
        self.slot_pages[dst] = self.slot_pages.pop(src)
        self._pending = {(dst if s == src else s, i): p for (s, i), p in self._pending.items()}
        if src in self._ahead:
            self._ahead[dst] = self._ahead.pop(src)

    def _forget(self, slot: int) -> None:
        """Slot ``slot`` leaves: its table entries not yet written are dropped, its tentative pages uncounted
        (the caller releases every page it held)."""
        if self._pending:
            self._pending = {k: p for k, p in self._pending.items() if k[0] != slot}
        self.ledger.tentative -= self._ahead.pop(slot, 0)

    def free_slot(self, slot: int) -> None:
        """Slot ``slot`` gives its pages back (harvest, preemption)."""
        self._forget(slot)
        self.ledger.release(self.slot_pages.pop(slot))

    def held_pages(self, tokens: dict[int, int]) -> int:
        """Distinct pages the page-rounded tokens held need: ``tokens[slot]`` per slot (shared prompt pages
        count once), and every staged prompt's. What the ledger holds beyond it was assigned ahead."""
        pages = {p for held, _ in self.unit_pages.values() for p in held}
        for slot, n in tokens.items():
            pages.update(self.slot_pages[slot][: pages_for(n, self.page_size)])
        return len(pages)

    def close(self) -> None:
        """Release everything this call still holds (its end, or an error part-way)."""
        for slot in list(self.slot_pages):
            self.free_slot(slot)
        for unit in list(self.unit_pages):
            self.unstage(unit)
        self.ledger.end_call()

