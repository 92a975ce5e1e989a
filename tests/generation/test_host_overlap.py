"""Host work off the device's path (issue 40, item 4): a look queues its read behind the run of steps just
launched, reserves the next run's pages while the device runs them, and waits once.

What must hold, checked here on the CPU: the calls give the same batches and the same stats (times aside) with
the overlap on and off (``scheduler.HOST_OVERLAP``, the internal switch), so no decision changed (admissions,
preemptions, page peaks, runs and spans); the pool's free pages after a call are what they were before, with no
tentative page left; a page reserved ahead is given back on demand before a held row is evicted, and is not in
the peak; the host reads the device once per run of steps, the pages reserved between that read's start and its
wait; and a read hands out its values only through its one wait, refused inside a capture as CUDA refuses it.
With the policy's scripted executor (no model), planning ahead takes the very actions it takes without.
"""

from __future__ import annotations

import pytest
import torch
from test_schedule_policy import FakeDevice, Sizes, requests  # the scripted executor of the policy's tests

from hybrid_engine.accelerator import CPUAccelerator, GraphCaptureError
from hybrid_engine.accelerator.host_copy import read_to_host
from hybrid_engine.decode.kv_pool import PageLedger
from hybrid_engine.engine import initialize
from hybrid_engine.generation import scheduler
from hybrid_engine.generation.pages import PagePlan
from hybrid_engine.generation.schedule_policy import (
    Admit,
    Compact,
    Harvest,
    Look,
    Preempt,
    Reserve,
    SchedulePolicy,
    step_spans,
)
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

TIMES = {"prefill_ms", "decode_ms", "overhead_ms", "total_ms", "tokens_per_second", "capture_ms",
         "host_ms_overlapped", "host_ms_after_sync", "profile"}
EOS = 7  # reachable in the tiny vocab: rows end unevenly, the host looks every sync_interval steps
PROMPTS = [7, 4, 6, 5, 3, 8]


def left_padded_prompts(lengths: list[int], seed: int = 0) -> RolloutRequest:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, ids.shape[1] - n:] = torch.randint(8, 384, (n,), generator=gen)
        mask[i, ids.shape[1] - n:] = 1
    return RolloutRequest(ids, mask)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama", seed=6)


def _call(model, monkeypatch, overlap: bool, sampling: SamplingConfig, **config):
    monkeypatch.setattr(scheduler, "HOST_OVERLAP", overlap)
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=EOS, **config))
    request = left_padded_prompts(PROMPTS, seed=3)
    rollout.generate(request, sampling)  # sizes the pool (and captures)
    ledger = rollout.runner.ledger
    free = ledger.free
    batch = rollout.generate(request, sampling)
    assert rollout.runner.ledger is ledger and ledger.tentative == 0
    assert ledger.free == free  # every page the call took, ahead or not, went back
    return batch, dict(rollout.last_stats)


def _same(on, off) -> None:
    (a, sa), (b, sb) = on, off
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_lengths, b.response_lengths)
    assert torch.equal(a.response_logprobs, b.response_logprobs)
    assert {k: v for k, v in sa.items() if k not in TIMES} == {k: v for k, v in sb.items() if k not in TIMES}


CASES = {
    "greedy": (SamplingConfig(max_new_tokens=16, temperature=0.0, n_samples_per_prompt=2), dict(max_batch_size=4)),
    "sampled": (SamplingConfig(max_new_tokens=16, temperature=1.0, top_p=0.9, n_samples_per_prompt=2, seed=2),
                dict(max_batch_size=8)),
    # 12 rows of up to 8 + 20 tokens in 12 pages of 16: preempted and resumed
    "preempted": (SamplingConfig(max_new_tokens=20, temperature=1.0, n_samples_per_prompt=2, seed=4),
                  dict(max_batch_size=8, kv_cache_tokens=192, kv_page_size=16)),
    "stop_sequences": (SamplingConfig(max_new_tokens=16, temperature=1.0, seed=4, n_samples_per_prompt=2,
                                      stop_token_ids=[[11], [12, 13]]), dict(max_batch_size=4)),
}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("case", list(CASES))
def test_results_and_stats_are_those_without_overlap(model, monkeypatch, case, graphs):
    sampling, config = CASES[case]
    on = _call(model, monkeypatch, True, sampling, use_graph_capture=graphs, **config)
    off = _call(model, monkeypatch, False, sampling, use_graph_capture=graphs, **config)
    _same(on, off)
    assert on[1]["host_ms_overlapped"] > 0 and off[1]["host_ms_overlapped"] == 0
    assert on[1]["harvests"] > 1 and on[1]["host_syncs"] > 2  # rows ended at several looks
    if case == "preempted":
        assert on[1]["preemptions"] > 0


def test_engine_generate_is_the_same_with_and_without_overlap(model, monkeypatch):
    ids = torch.randint(4, 384, (5, 6), generator=torch.Generator().manual_seed(3))
    out = []
    for overlap in (True, False):
        monkeypatch.setattr(scheduler, "HOST_OVERLAP", overlap)
        engine, *_ = initialize(model=model, config={"hybrid_engine": {
            "enable_graph_capture": True, "max_out_tokens": 32, "kv_cache_tokens": 96, "kv_page_size": 8}})
        tokens = engine.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=EOS)
        out.append((tokens, {k: v for k, v in engine.last_stats.items() if k not in TIMES}))
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]


def test_episode_turns_on_kept_pages_are_the_same_with_and_without_overlap(model, monkeypatch):
    """Multi-turn: each turn's rows keep their pages for the next (``kept``); the pages reserved ahead of the
    last look of a turn are not among those kept, and closing the episodes gives every page back."""
    got = []
    for overlap in (True, False):
        monkeypatch.setattr(scheduler, "HOST_OVERLAP", overlap)
        rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=EOS,
                                                                  use_graph_capture=True, kv_page_size=4))
        episodes = rollout.open_episodes(left_padded_prompts([5, 3, 6], seed=7), n_samples_per_prompt=2)
        stats = []
        for turn in range(3):
            episodes.turn(SamplingConfig(max_new_tokens=9, temperature=1.0, seed=11 + turn))
            stats.append({k: v for k, v in rollout.last_stats.items() if k not in TIMES})
            assert rollout.runner.ledger.tentative == 0
            for row in range(6):
                episodes.append(row, [40 + row, 41])
        batch = episodes.close()
        ledger = rollout.runner.ledger
        assert ledger.held_rows == 0 and ledger.in_use == 0
        got.append((batch.completion_ids, batch.completion_mask, stats))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]) and got[0][2] == got[1][2]
    assert any(s["kv_reused_tokens"] for s in got[0][2][1:])


def test_the_host_reads_once_per_run_and_reserves_ahead_before_it_waits(model, monkeypatch):
    """Each run of steps is followed by one read, its wait after the next run's pages were reserved."""
    log: list[str] = []
    real_read, real_ahead = scheduler.read_to_host, PagePlan.reserve_ahead

    class Read:  # records when the read's one wait happens
        def __init__(self, pending):
            self.pending = pending

        def wait(self):
            log.append("wait")
            return self.pending.wait()

    def read(values, acc):
        log.append("read")
        return Read(real_read(values, acc))

    def ahead(self, targets, steps):
        log.append("ahead")
        return real_ahead(self, targets, steps)

    monkeypatch.setattr(scheduler, "read_to_host", read)
    monkeypatch.setattr(PagePlan, "reserve_ahead", ahead)
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=EOS, max_batch_size=4,
                                                              use_graph_capture=True))
    real_step = rollout.runner.step
    monkeypatch.setattr(rollout.runner, "step", lambda *a: (log.append("step"), real_step(*a))[1])
    rollout.generate(left_padded_prompts(PROMPTS, seed=3),
                     SamplingConfig(max_new_tokens=16, temperature=1.0, n_samples_per_prompt=2, seed=2))
    assert log.count("read") == log.count("wait") == rollout.last_stats["host_syncs"]
    runs = "".join({"step": "s", "read": "r", "wait": "w", "ahead": "a"}[e] for e in log)
    assert "s" in runs and "a" in runs
    for i, c in enumerate(runs):  # every run of steps ends in a read, and a read's wait comes before more steps
        if c == "s" and runs[i + 1:i + 2] != "s":
            assert runs[i + 1] == "r"
        if c == "r":
            assert runs[i + 1:].lstrip("a")[0] == "w"  # only the reservation ahead between a read and its wait


def test_a_pending_read_hands_out_its_values_only_through_its_one_wait():
    acc = CPUAccelerator()
    values = torch.tensor([[0, 1, 0], [3, 4, 5]])
    read = read_to_host(values, acc)
    values.add_(100)  # a later write on the "device" does not show through
    assert not hasattr(read, "values") and read.wait().tolist() == [[0, 1, 0], [3, 4, 5]]
    with pytest.raises(RuntimeError, match="already waited"):
        read.wait()


def test_waiting_for_a_read_inside_a_capture_is_refused_as_cuda_refuses_it():
    acc = CPUAccelerator()
    values = torch.arange(4)
    graph = acc.create_graph()
    with pytest.raises(GraphCaptureError), acc.capture_to_graph(graph):
        read_to_host(values + 1, acc).wait()


def test_the_wait_is_the_events_on_a_backend_with_events():
    """STUB at the hardware boundary: an accelerator whose events log their record and synchronize (a CUDA
    event's host wait); the read records at once and synchronizes only in its wait."""
    log: list[str] = []

    class Event:
        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("synchronize")

    class Acc:
        def Event(self):  # noqa: N802 - the accelerator interface's name
            return Event()

    read = read_to_host(torch.ones(3), Acc())
    assert log == ["record"]
    assert read.wait().tolist() == [1.0, 1.0, 1.0] and log == ["record", "synchronize"]


def test_tentative_pages_are_free_to_everyone_else_and_not_in_the_peak():
    """A plan over 12 pages: two rows of 2 pages each reserve 3 more ahead (tentative); an allocation that needs
    them takes them back before evicting a held row; what is not used goes back; the peak never counts them."""
    ledger = PageLedger(13)  # 12 pages and the null page
    held = ledger.hold(ledger.allocate(2), tokens=8)  # an earlier call's row: evicted only as a last resort
    plan = PagePlan(ledger, page_size=4, max_pages=8)
    assert plan.take(0, 8) is not None and plan.take(1, 8) is not None  # 2 pages each
    assert ledger.free == 6 and ledger.peak == 6
    assert plan.reserve_ahead([(0, 20), (1, 16)], steps=12)  # 3 + 2 tentative pages
    assert ledger.free == 1 and ledger.tentative == 5 and ledger.peak == 6
    assert plan.room(0) == 6 and plan.missing(0, 20) == 3  # counted as free, and not yet the row's own
    assert not plan.reserve_ahead([(0, 64), (1, 64)], steps=40)  # more than is free: nothing taken ahead
    assert ledger.tentative == 0 and ledger.free == 6  # (the earlier tentative pages went back first)
    assert plan.reserve_ahead([(0, 20), (1, 16)], steps=12) and ledger.free == 1
    assert plan.take(2, 20) is not None  # 5 pages: 1 free + 4 taken back, the held row kept
    assert ledger.holds(held) and ledger.tentative == 1 and ledger.peak == 11
    assert not plan.ahead_intact(12)  # some were taken back: the next reservation is worked out afresh
    assert plan.missing(0, 12) == 1 and plan.grow(0, 12)  # row 0 keeps its tentative page: its own now
    assert ledger.tentative == 0 and ledger.free == 0 and ledger.peak == 12 and ledger.holds(held)
    assert plan.take(3, 4) is not None and not ledger.holds(held)  # nothing tentative left: the held row goes
    plan.close()
    assert ledger.free == 12 and ledger.tentative == 0


def test_a_reservation_ahead_is_committed_as_it_stands_when_nothing_changed():
    ledger = PageLedger(9)
    plan = PagePlan(ledger, page_size=4, max_pages=8)
    plan.take(0, 4)
    plan.take(1, 4)
    assert plan.reserve_ahead([(0, 9), (1, 5)], steps=5)  # 2 + 1 pages ahead
    assert ledger.peak == 2
    assert not plan.ahead_intact(4) and plan.ahead_intact(5)  # made for a run of 5 steps
    plan.commit_ahead()
    assert ledger.tentative == 0 and ledger.peak == 5 and plan.missing(0, 9) == 0 and plan.missing(1, 5) == 0
    block_table = torch.zeros(2, 8, dtype=torch.int64)
    assert plan.flush(block_table) == 3  # the pages reserved ahead (the caller wrote the rows' first ones)
    assert block_table[0, 1:3].tolist() == plan.slot_pages[0][1:] and block_table[1, 1] == plan.slot_pages[1][1]
    plan.free_slot(0)
    plan.close()
    assert ledger.free == 8


def test_step_spans_are_the_span_of_each_steps_longest_row():
    """The O(rows + steps) spans equal the per-step maximum over every row, as the policy computed them."""
    class Sizes:
        def span_for(self, tokens):
            return -(-tokens // 8) * 8

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows, n = int(torch.randint(1, 9, (), generator=gen)), int(torch.randint(0, 10, (), generator=gen))
        bounds = [(int(h), int(left) % 13) for h, left in torch.randint(0, 60, (rows, 2), generator=gen)]
        want = [Sizes().span_for(max(h + min(i, left) for h, left in bounds) + 1) for i in range(n)]
        assert step_spans(Sizes(), bounds, n) == want



def _script(plan_ahead: bool, budgets, max_active, eos, pages, **kw):
    pol = SchedulePolicy(requests(budgets), Sizes(), max_active=max_active, plan_ahead=plan_ahead, **kw)
    out = []
    for a in FakeDevice(pol, max_active, eos=eos, pages=pages).run():
        if isinstance(a, (Look, Reserve)):  # their ahead fields aside
            out.append((type(a).__name__, getattr(a, "steps", None), [r.row for r in a.requests]))
        elif isinstance(a, (Admit, Harvest)):
            out.append((type(a).__name__, list(a.slots), [r.row for r in a.requests]))
        elif isinstance(a, Preempt):
            out.append(("Preempt", a.slot, a.request.row))
        elif isinstance(a, Compact):
            out.append(("Compact", a.movers, a.holes))
        else:
            out.append(a)
    return out


def _pages(short: bool):
    """Reservation replies: every third one gets two steps fewer (none for a run of two) when ``short``."""
    calls = [0]

    def pages(steps: int) -> int:
        calls[0] += 1
        return steps if not short or calls[0] % 3 else max(0, steps - 2)

    return pages


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("short", [False, True], ids=["pages", "short"])
def test_the_policy_planning_ahead_takes_the_actions_it_takes_without(continuous, short):
    """Scripted device: rows end on EOS at various lengths, more requests than slots; the forecast made before
    each look, used where nothing finished, gives the same actions (and runs and spans) as working them out
    after the read. ``short``: some reservations get fewer steps or none (starvation, preemption)."""
    budgets = [9, 4, 12, 7, 3, 10, 6, 8, 5, 11]
    eos = {0: 5, 2: 3, 5: 8, 7: 2}
    preempted = 0
    for sync_interval in (2, 3, 1000):
        kw = dict(continuous=continuous, can_stop=True, sync_interval=sync_interval)
        ahead = _script(True, budgets, 4, eos, _pages(short), **kw)
        assert ahead == _script(False, budgets, 4, eos, _pages(short), **kw)
        preempted += sum(isinstance(a, tuple) and a[0] == "Preempt" for a in ahead)
    assert (preempted > 0) == short
