"""SchedulePolicy with a scripted executor, no model: which actions it takes, in which order, for which slots.

The fake device generates one token per step for every running row; a row finishes at its budget or at the
length its script sets (an EOS). Page replies are scripted too, so starvation and preemption are exact."""

from __future__ import annotations

import pytest

from hybrid_engine.generation.request import Request, Status
from hybrid_engine.generation.schedule_policy import (
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
)


class Sizes:
    """Buckets 1, 2, 4, 8; spans of 4-token pages, a power of two of them."""

    def bucket_for(self, n: int) -> int:
        return next((b for b in (1, 2, 4, 8) if b >= n), n)

    def span_for(self, tokens: int) -> int:
        pages = max(1, -(-tokens // 4))
        return 1 << (pages - 1).bit_length()


class FakeDevice:
    """Plays the executor. ``eos[row]``: the row ends after that many tokens; ``pages(steps)``: the steps a
    Reserve gets (default all); ``admits(requests)``: how many of a round start (default all)."""

    def __init__(self, policy: SchedulePolicy, slots: int, *, eos=None, pages=None, admits=None, staged=False):
        self.policy, self.eos = policy, eos or {}
        self.pages = pages or (lambda steps: steps)
        self.admits = admits or (lambda reqs: len(reqs))
        self.staged = staged
        self.generated = [0] * slots
        self.row_in: dict[int, Request] = {}  # slot -> request
        self.actions: list = []

    def ended(self, req: Request, n: int) -> bool:
        return n >= req.budget or n >= self.eos.get(req.row, req.budget)

    def run(self, limit: int = 1000) -> list:
        reply = None
        for _ in range(limit):
            action = self.policy.next(reply)
            self.actions.append(action)
            if isinstance(action, Done):
                return self.actions
            reply = self.execute(action)
        raise AssertionError("the policy did not finish")

    def execute(self, action):
        if isinstance(action, Admit):
            started = self.admits(action.requests)
            for slot, req in zip(action.slots[:started], action.requests[:started]):
                self.row_in[slot] = req
                self.generated[slot] = max(1, req.resume_from)
            return Admitted(started, self.staged)
        if isinstance(action, Reserve):
            return self.pages(action.steps)
        if isinstance(action, Decode):
            for _ in action.spans:
                for slot, req in self.row_in.items():
                    if not self.ended(req, self.generated[slot]):
                        self.generated[slot] += 1
        elif isinstance(action, Look):
            done = [r.slot for r in action.requests if self.ended(r, self.generated[r.slot])]
            return Seen(done, list(self.generated))
        elif isinstance(action, (Harvest, Preempt)):
            for slot in action.slots if isinstance(action, Harvest) else [action.slot]:
                del self.row_in[slot]
        elif isinstance(action, Compact):
            for src, dst in zip(action.movers, action.holes):
                self.row_in[dst] = self.row_in.pop(src)
                self.generated[dst] = self.generated[src]
        elif isinstance(action, DropStage):
            self.staged = False
        return None


def requests(budgets: list[int], prompt_len: int = 3) -> list[Request]:
    return [Request(row=i, prompt_index=i, budget=b, stream=100 + i, prompt_len=prompt_len)
            for i, b in enumerate(budgets)]


def policy(reqs: list[Request], max_active: int, *, continuous: bool = True, can_stop: bool = False,
           sync_interval: int = 1000, keep_pages: bool = False) -> SchedulePolicy:
    return SchedulePolicy(reqs, Sizes(), max_active=max_active, continuous=continuous, sync_interval=sync_interval,
                          can_stop=can_stop, keep_pages=keep_pages, describe_pages=lambda: "3 of 8 pages free")


def kinds(actions: list) -> list[str]:
    return [type(a).__name__ for a in actions]


def admitted_rows(actions: list) -> list[list[int]]:
    return [[r.row for r in a.requests] for a in actions if isinstance(a, Admit)]


def at(actions: list, action) -> int:
    """The position of ``action`` itself (actions compare by value: two rounds of the same slots are equal)."""
    return next(i for i, a in enumerate(actions) if a is action)


def steps(actions: list) -> int:
    return sum(len(a.spans) for a in actions if isinstance(a, Decode))


# ------------------------------------------------------------------ admission
def test_a_free_slot_waits_while_the_next_one_frees_sooner_than_a_round_costs():
    # Row 0 ends on EOS at 3 tokens; row 1 (budget 4) then has 1 step left. One free slot now costs less idle
    # time than a round (1 * 1 < ADMISSION_COST * 4), so the policy decodes one step and admits rows 4 and 5
    # together into slots 0 and 1.
    reqs = requests([20, 4, 30, 30, 30, 30])
    actions = FakeDevice(policy(reqs, 4, can_stop=True, sync_interval=2), 4, eos={0: 3}).run()
    assert kinds(actions)[:12] == ["Admit", "Reserve", "Decode", "Look", "Harvest",
                                   "Reserve", "Decode", "Look", "Harvest", "Admit", "Reserve", "Decode"]
    assert [a.slots for a in actions if isinstance(a, Harvest)][:2] == [[0], [1]]
    second = [a for a in actions if isinstance(a, Admit)][1]
    assert second.slots == [0, 1] and [r.row for r in second.requests] == [4, 5]
    assert len(actions[6].spans) == 1  # the one step until row 1's slot is sure to be free


def test_a_free_slot_is_filled_at_once_when_the_next_frees_late():
    # The same, but row 1 has a long budget: holding the slot would idle it for many steps, so row 4 goes in now.
    reqs = requests([20, 30, 30, 30, 30, 30])
    actions = FakeDevice(policy(reqs, 4, can_stop=True, sync_interval=2), 4, eos={0: 3}).run()
    assert kinds(actions)[:6] == ["Admit", "Reserve", "Decode", "Look", "Harvest", "Admit"]
    assert admitted_rows(actions)[1] == [4] and actions[5].slots == [0]


def test_requests_beyond_max_active_wait_in_order():
    reqs = requests([2, 5, 3, 4, 2])
    pol = policy(reqs, 2)
    actions = FakeDevice(pol, 2).run()
    rows = admitted_rows(actions)
    assert rows[0] == [0, 1] and [r for rs in rows for r in rs] == [0, 1, 2, 3, 4]
    assert all(len(a.slots) <= 2 for a in actions if isinstance(a, Admit))
    assert pol.peak == 2 and all(r.status is Status.FINISHED and r.slot is None for r in reqs)
    assert [r.length for r in reqs] == [2, 5, 3, 4, 2]


def test_static_batching_admits_all_at_once_and_the_rest_only_when_every_row_ended():
    reqs = requests([2, 6, 3, 4, 2, 2])
    actions = FakeDevice(policy(reqs, 4, continuous=False), 4).run()
    admits = [i for i, a in enumerate(actions) if isinstance(a, Admit)]
    assert admitted_rows(actions) == [[0, 1, 2, 3], [4, 5]]
    harvested = [r.row for a in actions[: admits[1]] if isinstance(a, Harvest) for r in a.requests]
    assert sorted(harvested) == [0, 1, 2, 3]  # the second round waited for all four


def test_a_round_that_starts_some_puts_the_rest_back_first_in_line_and_waits_for_a_finish():
    reqs = requests([3, 6, 4, 4, 2])  # row 4 waits behind the first round
    rounds = iter([2])  # the first round has pages for two requests, later rounds for all
    actions = FakeDevice(policy(reqs, 4), 4, admits=lambda r: min(len(r), next(rounds, len(r)))).run()
    assert admitted_rows(actions)[:2] == [[0, 1, 2, 3], [2, 3, 4]]  # rows 2 and 3 before row 4
    assert [a.slots for a in actions if isinstance(a, Admit)][1] == [0, 2, 3]  # row 0's slot, and the two
    first_harvest = kinds(actions).index("Harvest")
    assert kinds(actions).index("Admit", 1) > first_harvest  # blocked until a row finished


# ------------------------------------------------------------ pages, preemption
def test_no_page_for_a_step_harvests_what_finished_instead_of_preempting():
    # Row 1 ends on EOS at its first token; the pool has no page for the first step: the look finds row 1 done,
    # its harvest frees pages, and decoding goes on without a preemption.
    reqs = requests([5, 5])
    replies = iter([0])
    pol = policy(reqs, 2, can_stop=True, sync_interval=8)
    actions = FakeDevice(pol, 2, eos={1: 1}, pages=lambda n: next(replies, n)).run()
    assert kinds(actions)[:6] == ["Admit", "Reserve", "Look", "Harvest", "Reserve", "Decode"]
    assert actions[3].slots == [1] and "Preempt" not in kinds(actions)
    assert [r.length for r in reqs] == [5, 1]


def test_starved_rows_preempt_the_newest_admitted_which_resumes_first_from_where_it_was():
    # Slot 0 frees early and row 3 is admitted into it: the newest admission, though not the highest slot.
    reqs = requests([2, 9, 9, 9, 3])  # row 4 waits behind them
    replies = iter([1, 1, 0])  # pages for the first two runs of steps, then none
    pol = policy(reqs, 3)
    device = FakeDevice(pol, 3, pages=lambda n: next(replies, n))
    actions = device.run()
    preempts = [a for a in actions if isinstance(a, Preempt)]
    assert len(preempts) == 1 and preempts[0].slot == 0 and preempts[0].request is reqs[3]
    i = at(actions, preempts[0])
    assert kinds(actions)[i - 2:i] == ["Reserve", "Look"]  # no step fit, nothing finished
    assert reqs[3].resume_from == 2  # its first token and one step
    # It is first in line, admitted again only once a row finished (its pages would preempt again).
    later = [a for a in actions[i:] if isinstance(a, Admit)]
    assert later[0].requests[0] is reqs[3]
    assert [r.row for a in later for r in a.requests][:2] == [3, 4]  # requeued at the front, before row 4
    assert "Harvest" in kinds(actions[i:at(actions, later[0])])
    assert reqs[3].status is Status.FINISHED and reqs[3].length == 9


def test_the_last_running_row_drops_the_stage_before_it_is_preempted():
    reqs = requests([9])
    replies = iter([0])
    actions = FakeDevice(policy(reqs, 1), 1, staged=True, pages=lambda n: next(replies, n)).run()
    assert kinds(actions)[:5] == ["Admit", "Reserve", "Look", "DropStage", "Reserve"]
    assert "Preempt" not in kinds(actions)


@pytest.mark.parametrize("keep", [False, True])
def test_finished_rows_keep_their_pages_only_when_asked(keep):
    reqs = requests([2, 9, 9])
    replies = iter([1, 0])
    actions = FakeDevice(policy(reqs, 2, keep_pages=keep), 2, pages=lambda n: next(replies, n)).run()
    harvests = [a for a in actions if isinstance(a, Harvest)]
    assert harvests and all(h.keep is keep for h in harvests)
    assert any(isinstance(a, Preempt) for a in actions)  # a preempted row never keeps: it has no keep flag


# -------------------------------------------------------------------- compaction
def test_rows_left_in_high_slots_move_down_to_the_smallest_bucket_holding_them():
    reqs = requests([2, 2, 2, 12])
    pol = policy(reqs, 4)
    actions = FakeDevice(pol, 4).run()
    compacts = [a for a in actions if isinstance(a, Compact)]
    assert compacts == [Compact(movers=[3], holes=[0])]
    after = actions[at(actions, compacts[0]) + 1:]
    assert [a.bucket for a in after if isinstance(a, Decode)] == [1]
    assert [a.bucket for a in actions[: at(actions, compacts[0])] if isinstance(a, Decode)] == [4]
    assert next(a for a in after if isinstance(a, Harvest)).requests == [reqs[3]]
    assert steps(actions) == 11


def test_decode_runs_until_the_rows_fit_a_smaller_bucket():
    # Four rows, bucket 4: after 2 steps rows 0 and 1 are done and the other two fit bucket 2, so the host looks.
    reqs = requests([3, 3, 5, 9])
    actions = FakeDevice(policy(reqs, 4), 4).run()
    decodes = [a for a in actions if isinstance(a, Decode)]
    assert (decodes[0].bucket, len(decodes[0].spans)) == (4, 2)
    assert decodes[1].bucket == 2
    # Spans follow the longest row: step 0 writes its first token after the 3 prompt tokens (4 tokens: one
    # page of 4), step 1 its second (5 tokens: two pages).
    assert decodes[0].spans == [1, 2]


# ------------------------------------------------------------------ guards
def test_a_round_that_starts_nothing_with_nothing_running_is_a_bug():
    with pytest.raises(RuntimeError, match="admission made no progress.*request 0.*3 of 8 pages free"):
        FakeDevice(policy(requests([4]), 1), 1, admits=lambda r: 0).run()


def test_a_round_that_starts_nothing_drops_the_stage_once_then_is_a_bug():
    device = FakeDevice(policy(requests([4]), 1), 1, admits=lambda r: 0, staged=True)
    with pytest.raises(RuntimeError, match="admission made no progress"):
        device.run()
    assert kinds(device.actions) == ["Admit", "DropStage", "Admit"]


def test_passes_that_neither_decode_nor_finish_anything_are_a_bug():
    # Never a page: every pass preempts the row it admitted.
    device = FakeDevice(policy(requests([4]), 2), 2, pages=lambda n: 0)
    with pytest.raises(RuntimeError, match="made no progress in 25 passes"):
        device.run()
    assert kinds(device.actions).count("Preempt") == 25


def test_a_request_is_one_calls():
    reqs = requests([2])
    FakeDevice(policy(reqs, 1), 1).run()
    with pytest.raises(ValueError, match="WAITING"):
        policy(reqs, 1)
