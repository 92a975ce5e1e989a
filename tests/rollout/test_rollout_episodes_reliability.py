"""Episodes under change, failure and threads (issue 44): kept K/V are reused only with the forward that computed
them, a failed turn gives back every page, per-prompt settings apply, bad rows are refused, and calls from other
threads are refused on busy rows or ordered after the weights they waited for.

Turns that must not reuse kept K/V are compared with a single-turn rollout on the same weights teacher-forced
(``sampled_close``, as test_rollout_episode_kv.py does); "the next normal call" is compared with a fresh rollout's
on the same path, token for token.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch
from conftest import exact_mode_unavailable
from rollout_helpers import left_padded_prompts
from sampled_close import assert_sampled_close
from test_rollout_episode_kv import ROWS, TOOL, _assert_turn_as_single_turn, _rollout, _run, _sampling

from hybrid_engine.decode.kv_pool import PageLedger
from hybrid_engine.generation import call as call_module
from hybrid_engine.generation import call_context, pages, scheduler
from hybrid_engine.graphs.runner import DecodeGraphRunner
from hybrid_engine.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from hybrid_engine.rollout import rollout as rollout_module
from hybrid_engine.tiny_models import build_model

WAIT = 60  # seconds: a hard bound on every wait for another thread


def _scaled(model, factor: float = 1.25) -> dict:
    """New weights: every parameter scaled and shifted (large enough to change the tokens)."""
    gen = torch.Generator().manual_seed(3)
    return {n: p.detach() * factor + 0.02 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


# ---------------------------------------------------------------- changes between turns
def _data_copy(model, rollout):
    new = _scaled(model)
    for name, p in model.named_parameters():
        p.data.copy_(new[name])  # as weight loaders, EMA and syncs write: no version counter moves


def _one_element(model, rollout):
    w = model.model.layers[0].mlp.down_proj.weight
    w.data[3, 5] = torch.nextafter(w.data[3, 5], torch.tensor(float("inf")))  # one ulp of one element


def _buffer(model, rollout):
    rotary = model.model.rotary_emb
    rotary.inv_freq.data.mul_(1.5)


def _data_assigned(model, rollout):
    new = _scaled(model)
    for name, p in model.named_parameters():
        p.data = new[name].clone()


def _load_state_dict(model, rollout):
    model.load_state_dict(_scaled(model), strict=False)


def _hook(model, rollout):
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 1.5)


CHANGES = {"data_copy": _data_copy, "one_element": _one_element, "buffer": _buffer, "data_assigned": _data_assigned,
           "load_state_dict": _load_state_dict, "hook": _hook}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_between_turns_the_engine_does_not_see_drops_the_kept_kv(change):
    model = build_model("tiny-llama", seed=2)
    rollout = _rollout(model)
    batch, stats = _run(rollout, between=lambda t: CHANGES[change](model, rollout) if t == 0 else None)
    assert stats[1]["kv_reused_tokens"] == 0  # K/V of the old forward: prefilled whole
    assert stats[2]["kv_reused_tokens"] > 0  # and kept again from there
    for turn in (1, 2):
        _assert_turn_as_single_turn(rollout, batch, turn)


@pytest.mark.skipif(exact_mode_unavailable() is not None, reason=str(exact_mode_unavailable()))
def test_switching_the_exact_mode_between_turns_is_refused_and_the_kept_kv_stay_valid():
    model = build_model("tiny-llama", seed=2)
    rollout = _rollout(model)

    def switch(turn):
        if turn == 0:
            with pytest.raises(ValueError, match="exact_logprobs"):
                rollout.exact_logprobs = True  # K/V computed without it would be reused: fixed per rollout

    batch, stats = _run(rollout, between=switch)
    assert not rollout.exact_logprobs and stats[1]["kv_reused_tokens"] > 0
    _assert_turn_as_single_turn(rollout, batch, 1)


def test_a_data_write_of_the_same_values_keeps_the_kv():
    model = build_model("tiny-llama", seed=2)
    rollout = _rollout(model)

    def same(turn):
        for p in model.parameters():
            p.data.copy_(p.data.clone())

    _, stats = _run(rollout, between=same)
    assert stats[1]["kv_reused_tokens"] > 0 and stats[2]["kv_reused_tokens"] > 0


def test_a_hook_removed_between_turns_drops_the_kept_kv():
    model = build_model("tiny-llama", seed=2)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 1.5)
    rollout = _rollout(model)
    batch, stats = _run(rollout, between=lambda t: handle.remove() if t == 0 else None)
    assert stats[1]["kv_reused_tokens"] == 0 and stats[2]["kv_reused_tokens"] > 0
    _assert_turn_as_single_turn(rollout, batch, 1)


@pytest.mark.parametrize("first", ["disabled", "enabled"])
def test_a_peft_adapter_toggled_between_turns_drops_the_kept_kv(first):
    peft = pytest.importorskip("peft")
    base = build_model("tiny-llama", seed=2)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    rollout = _rollout(model)
    episodes = rollout.open_episodes(left_padded_prompts([5, 3, 6], seed=7), n_samples_per_prompt=2)
    stats = []
    for turn in range(2):
        context = model.disable_adapter() if (turn == 0) == (first == "disabled") else contextlib.nullcontext()
        with context:
            episodes.turn(_sampling(turn))
        stats.append(dict(rollout.last_stats))
        for r in range(ROWS):
            episodes.append(r, TOOL[r % 3])
    batch = episodes.close()
    assert stats[1]["kv_reused_tokens"] == 0
    context = model.disable_adapter() if first == "enabled" else contextlib.nullcontext()
    with context:  # turn 1's forward, for the single-turn rollout and the teacher-forced check
        _assert_turn_as_single_turn(rollout, batch, 1, (5, 5, 5))


# ---------------------------------------------------------------- per-prompt settings
def test_per_prompt_settings_of_the_request_apply_to_every_turn():
    model = build_model("tiny-qwen2", seed=1)
    rollout = _rollout(model)
    prompts = left_padded_prompts([4, 6], seed=3)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.7, seed=3)
    settings = dict(max_new_tokens=[2, 4], temperature=[1.3, 0.9], seed=[5, None], request_ids=[7, 2])
    episodes = rollout.open_episodes(RolloutRequest(prompts.prompt_ids, prompts.prompt_attention_mask, **settings))
    assert episodes.turn(sampling) == ["length", "length"]
    assert [len(episodes.last_turn(r)) for r in (0, 1)] == [2, 4]  # each prompt's budget
    # Row 0: its own temperature and seed, as a single-turn rollout with them samples.
    history, tokens = episodes.history(0)[:4], episodes.last_turn(0)
    single = rollout.generate(RolloutRequest(torch.tensor([history]), temperature=[1.3], seed=[5], request_ids=[7]),
                              SamplingConfig(max_new_tokens=2, temperature=0.7, seed=3))
    episodes.append(1, [40, 41])
    turn0 = episodes.close([0])
    assert_sampled_close(model, history, tokens, turn0.completion_logprobs[0, :2], single.responses[0].tolist(),
                         single.response_logprobs[0], temperature=1.3, name="turn 0, row 0")
    # Row 1's turn 1 (prompt id 2: request (1 * 8 + 2), U = max(request_ids) + 1 = 8), capped at 4 tokens.
    history = episodes.history(1)
    episodes.turn(SamplingConfig(max_new_tokens=5, temperature=1.0, seed=4), max_new_tokens=[5])
    tokens = episodes.last_turn(1)
    assert len(tokens) == 4
    single = rollout.generate(RolloutRequest(torch.tensor([history]), temperature=[0.9], max_new_tokens=[4],
                                             request_ids=[10]),
                              SamplingConfig(max_new_tokens=5, temperature=1.0, seed=4))
    turn1 = episodes.close()
    assert_sampled_close(model, history, tokens, turn1.completion_logprobs[0, -4:], single.responses[0].tolist(),
                         single.response_logprobs[0], temperature=0.9, name="turn 1, row 1")
    # A prompt's stop ids: the same episode with row 1's second token as its stop sequence stops there (the same
    # path up to that token: equal tokens).
    first = rollout.open_episodes(RolloutRequest(prompts.prompt_ids, prompts.prompt_attention_mask, **settings))
    first.turn(sampling)
    free = first.last_turn(1)
    first.close()
    stops = RolloutRequest(prompts.prompt_ids, prompts.prompt_attention_mask, stop_token_ids=[None, [[free[1]]]],
                           **settings)
    stopped = rollout.open_episodes(stops)
    assert stopped.turn(sampling) == ["length", "stop"]
    assert stopped.last_turn(1) == free[:free.index(free[1]) + 1]
    stopped.close()
    assert rollout.runner.ledger.in_use == 0


def test_request_ids_set_each_turns_sampler_counter():
    model = build_model("tiny-qwen2", seed=1)
    rollout = _rollout(model)
    prompts = left_padded_prompts([4, 6], seed=3)
    request = RolloutRequest(prompts.prompt_ids, prompts.prompt_attention_mask, request_ids=[5, 1])
    episodes = rollout.open_episodes(request, n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    for r in range(4):
        episodes.append(r, [40])
    history = episodes.history(3)
    episodes.turn(_sampling(1), rows=[3])
    # Row 3 is sample 1 of prompt id 1; turn 1: (1 * 6 + 1) * 2 + 1 = 15.
    single = rollout.generate(RolloutRequest(torch.tensor([history]), request_ids=[15]), _sampling(1))
    batch = episodes.close([3])
    n = len(episodes.history(3)) - len(history)
    assert_sampled_close(model, history, episodes.last_turn(3), batch.completion_logprobs[0, -n:],
                         single.responses[0].tolist(), single.response_logprobs[0], name="row 3, turn 1")
    episodes.close()


# ---------------------------------------------------------------- row arguments
def _episode_tokens(rollout) -> torch.Tensor:
    episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
    for t in range(2):
        episodes.turn(_sampling(t))
        for r in range(4):
            episodes.append(r, TOOL[r % 3])
    batch = episodes.close()
    return torch.cat([batch.completion_ids.float(), batch.completion_logprobs], dim=1)


@pytest.mark.parametrize("call, error, names", [
    (lambda e: e.last_turn(-1), ValueError, "row"),
    (lambda e: e.last_turn(99), ValueError, "row"),
    (lambda e: e.history(99), ValueError, "row"),
    (lambda e: e.history(-4), ValueError, "row"),
    (lambda e: e.history(True), TypeError, "row"),
    (lambda e: e.history("0"), TypeError, "row"),
    (lambda e: e.append(-1, [5]), ValueError, "row"),
    (lambda e: e.append(99, [5]), ValueError, "row"),
    (lambda e: e.append(0, torch.tensor([5], device="meta")), ValueError, "token_ids"),
    (lambda e: e.append(0, torch.tensor([5.0])), TypeError, "token_ids"),
    (lambda e: e.append(0, [-1]), TypeError, "token_ids"),
    (lambda e: e.turn(_sampling(0), rows=[-1]), ValueError, "rows"),
    (lambda e: e.turn(_sampling(0), rows=[0, 0]), ValueError, "rows"),
    (lambda e: e.close([4]), ValueError, "rows"),
])
def test_bad_rows_and_token_ids_are_refused_and_the_next_call_is_as_a_fresh_engines(call, error, names):
    model = build_model("tiny-gpt2", seed=5)
    rollout = _rollout(model)
    episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    before = [episodes.history(r) for r in range(4)]
    with pytest.raises(error, match=rf"Episodes\.\w+: .*\b{names}\b"):
        call(episodes)
    assert [episodes.history(r) for r in range(4)] == before
    episodes.close()
    assert torch.equal(_episode_tokens(rollout), _episode_tokens(_rollout(model)))


# ---------------------------------------------------------------- failures at every moment of a turn
class _Fail:
    """Raises ``error`` at the ``at``-th call of whatever it is armed on (0: never); counts the calls."""

    def __init__(self) -> None:
        self.calls, self.at, self.error = 0, 0, RuntimeError

    def arm(self, at: int, error: type[BaseException]) -> None:
        self.calls, self.at, self.error = 0, at, error

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise self.error(f"injected at call {self.at}")


def _wrap(monkeypatch, owner, name: str, fail: _Fail, *, static: bool = False) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        fail()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def _failed_episode(rollout, fail: _Fail, at: int, error: type[BaseException], *, close: bool = True) -> None:
    """Turn 0, tool tokens, then turn 1 with a failure at ``fail``'s ``at``-th call: the rows stay as they were,
    and close gives every page back."""
    episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0), max_new_tokens=[2, 5, 3, 4])
    for r in range(4):
        episodes.append(r, TOOL[r % 3])
    before = [episodes.history(r) for r in range(4)]
    fail.arm(at, error)
    with pytest.raises(error, match="injected"):
        episodes.turn(_sampling(1), max_new_tokens=[1, 4, 2, 5])  # rows finish at different steps
    fail.arm(0, error)
    assert [episodes.history(r) for r in range(4)] == before and episodes.turns == [1] * 4
    ledger = rollout.runner.ledger
    assert not ledger.busy
    if close:
        episodes.close()
        assert ledger.held_rows == 0 and ledger.in_use == 0, (at, error)


def _normal_calls(rollout, fail: _Fail) -> int:
    """How many calls ``fail`` sees in turn 1 of a normal episode (the second one: graphs captured by then)."""
    for _ in range(2):
        episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
        episodes.turn(_sampling(0), max_new_tokens=[2, 5, 3, 4])
        for r in range(4):
            episodes.append(r, TOOL[r % 3])
        fail.arm(0, RuntimeError)
        episodes.turn(_sampling(1), max_new_tokens=[1, 4, 2, 5])
        episodes.close()
    return fail.calls


def _sweep(rollout, fail: _Fail, moments) -> None:
    pages_after_first = None
    for at in moments:
        for error in (RuntimeError, KeyboardInterrupt):
            _failed_episode(rollout, fail, at, error)
            if pages_after_first is None:
                pages_after_first = rollout.runner.kv_pool.num_pages
            assert rollout.runner.kv_pool.num_pages == pages_after_first  # no growth over repeated failures


@pytest.mark.parametrize("graphs", [False, True])
def test_a_failure_at_every_forward_of_a_turn_gives_every_page_back(graphs):
    model = build_model("tiny-llama", seed=2)
    fail = _Fail()
    model.register_forward_pre_hook(lambda module, args: fail())
    rollout = _rollout(model, graphs=graphs, max_batch_size=2)
    forwards = _normal_calls(rollout, fail)
    assert forwards >= 3
    _sweep(rollout, fail, range(1, forwards + 1))
    assert torch.equal(_episode_tokens(rollout), _episode_tokens(_rollout(model, graphs=graphs, max_batch_size=2)))


def test_a_failure_while_a_first_turn_captures_its_graphs_gives_every_page_back():
    """Every forward of a fresh graph rollout's first turn (warm-ups and captures among them)."""
    model = build_model("tiny-llama", seed=2)
    fail = _Fail()
    model.register_forward_pre_hook(lambda module, args: fail())
    reference = _rollout(model, max_batch_size=2)
    fail.arm(0, RuntimeError)
    episodes = reference.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0), max_new_tokens=[2, 5, 3, 4])
    forwards = fail.calls
    episodes.close()
    want = _episode_tokens(reference)
    for at in range(1, forwards + 1):
        for error in (RuntimeError, KeyboardInterrupt):
            rollout = _rollout(model, max_batch_size=2)
            episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
            fail.arm(at, error)
            # A hook that raises while a step is captured refuses graphs (the turn then runs eagerly); anywhere
            # else the turn fails.
            with contextlib.suppress(error):
                episodes.turn(_sampling(0), max_new_tokens=[2, 5, 3, 4])
            fail.arm(0, error)
            episodes.close()
            ledger = rollout.runner.ledger
            assert ledger.held_rows == 0 and ledger.in_use == 0 and not ledger.busy, (at, error)
            assert torch.equal(_episode_tokens(rollout), want), (at, error)  # graph or eager: the same tokens


MOMENTS = {  # (owner, name, static)
    "admission": (scheduler, "_admission_round", False),
    "continue": (scheduler, "_continue_round", False),
    "harvest": (scheduler, "_harvest", False),
    "adopt": (pages.PagePlan, "adopt", False),
    "keep": (pages.PagePlan, "keep", False),
    "hold": (PageLedger, "hold", False),
    "step": (DecodeGraphRunner, "step", False),
    "sampler": (__import__("hybrid_engine.decode.slots", fromlist=["x"]), "sample_tokens_and_top", False),
    "gather": (call_module, "gather_responses", False),
    "assemble": (HybridEngineRollout, "_assemble", True),
    "stats": (call_module, "_call_stats", False),
    "eos_ids": (HybridEngineRollout, "_special_ids", False),
}


@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_a_failure_anywhere_in_a_turn_gives_every_page_back(moment, monkeypatch):
    owner, name, static = MOMENTS[moment]
    model = build_model("tiny-llama", seed=2)
    fail = _Fail()
    _wrap(monkeypatch, owner, name, fail, static=static)
    rollout = _rollout(model, graphs=moment == "step", max_batch_size=2)
    calls = _normal_calls(rollout, fail)
    assert calls >= 1
    _sweep(rollout, fail, sorted({1, (calls + 1) // 2, calls}))
    monkeypatch.undo()
    fresh = _rollout(model, graphs=moment == "step", max_batch_size=2)
    assert torch.equal(_episode_tokens(rollout), _episode_tokens(fresh))


def test_failed_episodes_dropped_unclosed_give_their_pages_back_and_a_retried_turn_samples_as_before():
    model = build_model("tiny-llama", seed=2)
    fail = _Fail()
    model.register_forward_pre_hook(lambda module, args: fail())
    rollout = _rollout(model, graphs=False, max_batch_size=2)
    forwards = _normal_calls(rollout, fail)
    pages_before = None
    for _ in range(4):
        _failed_episode(rollout, fail, forwards // 2, KeyboardInterrupt, close=False)
        gc.collect()  # the episode (in a cycle through the stored traceback) is collected
        pages_before = pages_before or rollout.runner.kv_pool.num_pages
        assert rollout.runner.ledger.held_rows == 0 and rollout.runner.ledger.in_use == 0
        assert rollout.runner.kv_pool.num_pages == pages_before
    # A turn retried after a failure samples what the turn would have.
    reference = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
    episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
    for ep in (reference, episodes):
        ep.turn(_sampling(0), max_new_tokens=[2, 5, 3, 4])
        for r in range(4):
            ep.append(r, TOOL[r % 3])
    reference.turn(_sampling(1), max_new_tokens=[1, 4, 2, 5])
    fail.arm(forwards // 2, RuntimeError)
    with pytest.raises(RuntimeError, match="injected"):
        episodes.turn(_sampling(1), max_new_tokens=[1, 4, 2, 5])
    fail.arm(0, RuntimeError)
    episodes.turn(_sampling(1), max_new_tokens=[1, 4, 2, 5])
    a, b = reference.close(), episodes.close()
    for r in range(4):
        context = b.prompt_ids[r][b.prompt_mask[r].bool()].tolist()
        n = int(b.completion_mask[r].sum())
        assert int(a.completion_mask[r].sum()) == n
        assert_sampled_close(model, context, b.completion_ids[r, :n], b.completion_logprobs[r, :n],
                             a.completion_ids[r, :n], a.completion_logprobs[r, :n], name=f"row {r}")


# ---------------------------------------------------------------- threads
def test_a_turn_waiting_for_a_training_call_checks_the_weights_after_it(monkeypatch):
    model = build_model("tiny-llama", seed=2)
    rollout = _rollout(model)
    episodes = rollout.open_episodes(left_padded_prompts([5, 3, 6], seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    for r in range(ROWS):
        episodes.append(r, TOOL[r % 3])
    held, waiting, done = threading.Event(), threading.Event(), threading.Event()
    original = rollout_module.exclusive_model_call

    @contextlib.contextmanager
    def announced(model_, caller):
        waiting.set()  # the turn is about to wait for the model: everything before the wait has run
        with original(model_, caller):
            yield

    monkeypatch.setattr(rollout_module, "exclusive_model_call", announced)
    new = _scaled(model)
    errors = []

    def trainer():
        try:
            with call_context.exclusive_model_call(model, "HybridEngine.step"):
                held.set()
                assert waiting.wait(WAIT)
                for name, p in model.named_parameters():
                    p.data.copy_(new[name])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    assert held.wait(WAIT)
    episodes.turn(_sampling(1))
    assert done.wait(WAIT) and not errors, errors
    thread.join(WAIT)
    assert rollout.last_stats["kv_reused_tokens"] == 0
    for r in range(ROWS):
        episodes.append(r, TOOL[r % 3])
    monkeypatch.undo()
    _assert_turn_as_single_turn(rollout, episodes.close(), 1, (5, 5))


class Pause:
    """A forward pre-hook that, once ``armed``, stops the next forward: it sets ``inside`` and waits for
    ``release`` (within :data:`WAIT`), so another thread acts while a turn is under way."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inside, self.release, self.armed = threading.Event(), threading.Event(), False
        model.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        if self.armed:
            self.armed = False
            self.inside.set()
            assert self.release.wait(WAIT)


def test_calls_on_rows_in_another_threads_turn_are_refused_and_others_go_ahead():
    model = build_model("tiny-llama", seed=2)
    pause = Pause(model)
    rollout = _rollout(model, graphs=False)
    request = left_padded_prompts([5, 3], seed=7)
    episodes = rollout.open_episodes(request, n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    before = [episodes.history(r) for r in range(4)]
    results, errors = [], []

    def turn():
        try:
            results.append(episodes.turn(_sampling(1), rows=[0, 1]))
        except BaseException as exc:
            errors.append(exc)

    pause.armed = True
    thread = threading.Thread(target=turn, daemon=True)
    thread.start()
    try:
        assert pause.inside.wait(WAIT)
        for call, arg in ((lambda: episodes.turn(_sampling(1), rows=[1, 2]), "rows"),
                          (lambda: episodes.turn(_sampling(1)), "rows"),
                          (lambda: episodes.append(0, [7]), "row"),
                          (lambda: episodes.close([1]), "rows")):
            with pytest.raises(ValueError, match=rf"Episodes\.\w+: {arg}: rows \[\d(, \d)*\] are in an Episodes\.turn"):
                call()
        assert episodes.history(0) == before[0]  # the turn has not committed
        episodes.append(2, [7, 8])  # rows outside the turn go ahead
    finally:
        pause.release.set()
        thread.join(WAIT)
    assert not thread.is_alive() and not errors and results == [["length", "length"]]
    episodes.turn(_sampling(2), rows=[2, 3])
    got = episodes.close()
    # The same calls one after the other, on a fresh rollout.
    serial = _rollout(model, graphs=False).open_episodes(request, n_samples_per_prompt=2)
    serial.turn(_sampling(0))
    serial.turn(_sampling(1), rows=[0, 1])
    serial.append(2, [7, 8])
    serial.turn(_sampling(2), rows=[2, 3])
    want = serial.close()
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_logprobs, want.completion_logprobs)
    assert rollout.runner.ledger.in_use == 0


def test_a_hook_calling_back_into_its_own_turns_rows_is_refused_not_deadlocked():
    model = build_model("tiny-gpt2", seed=5)
    seen = []
    episodes = None

    def reenter(module, args):
        if episodes is not None and not seen:
            for call in (lambda: episodes.append(0, [7]), lambda: episodes.turn(_sampling(1), rows=[0])):
                try:
                    call()
                except ValueError as exc:
                    seen.append(str(exc))

    model.register_forward_pre_hook(reenter)
    rollout = _rollout(model, graphs=False)
    episodes = rollout.open_episodes(left_padded_prompts([5], seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    assert len(seen) == 2 and all("Episodes.turn that has not returned" in s for s in seen), seen
    episodes.close()


def test_drop_kv_from_another_thread_during_a_turn_drops_what_the_turn_keeps(monkeypatch):
    from hybrid_engine.rollout import episodes as episodes_module

    model = build_model("tiny-llama", seed=2)
    pause, waiting = Pause(model), threading.Event()
    rollout = _rollout(model, graphs=False)
    episodes = rollout.open_episodes(left_padded_prompts([5, 3], seed=7), n_samples_per_prompt=2)
    episodes.turn(_sampling(0))
    original = episodes_module.exclusive_model_call

    @contextlib.contextmanager
    def announced(model_, caller):
        waiting.set()  # drop_kv is about to wait for the turn's call
        with original(model_, caller):
            yield

    monkeypatch.setattr(episodes_module, "exclusive_model_call", announced)
    errors = []

    def run(call):
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    pause.armed = True
    turn = threading.Thread(target=run, args=(lambda: episodes.turn(_sampling(1)),), daemon=True)
    turn.start()
    assert pause.inside.wait(WAIT)
    drop = threading.Thread(target=run, args=(episodes.drop_kv,), daemon=True)
    drop.start()
    try:
        assert waiting.wait(WAIT)
    finally:
        pause.release.set()
        turn.join(WAIT)
        drop.join(WAIT)
    assert not turn.is_alive() and not drop.is_alive() and not errors, errors
    monkeypatch.undo()
    episodes.turn(_sampling(2))
    assert rollout.last_stats["kv_reused_tokens"] == 0  # whichever came last, the turn's K/V were dropped
    episodes.close()
    assert rollout.runner.ledger.in_use == 0
