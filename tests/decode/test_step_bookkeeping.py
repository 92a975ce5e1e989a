"""``hybrid_engine::advance_rows``, a decode step's bookkeeping after its sampler as one op: its reference against
the step's former aten code over random states (bit for bit), one node of a captured CPU graph, the ``live`` /
``advance`` mirrors of ``finished`` kept by every writer, one op in a step whatever its stop sequences, and the
Triton kernel against the reference under ``TRITON_INTERPRET=1`` (skipped where Triton is not installed)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_engine.decode.kv_pool import KVPool
from hybrid_engine.decode.layout import layer_specs
from hybrid_engine.decode.ops import bookkeeping as bk
from hybrid_engine.decode.sampling import MAX_SETTINGS
from hybrid_engine.decode.slots import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, DecodeSlots
from hybrid_engine.tiny_models import build_model

op = torch.ops.hybrid_engine.advance_rows
MUTATED = ("tokens", "token_index", "finished", "live", "advance", "suppress_eos", "out_tokens", "out_logprobs")
READ = ("budget", "min_tokens", "eos_mask", "pad_id", "stop_ids", "knob")


def random_state(seed: int, rows: int = 12, capacity: int = 6, vocab: int = 5, stops: bool = True,
                 lp_dtype: torch.dtype | None = torch.float32, settings: int = MAX_SETTINGS) -> types.SimpleNamespace:
    """A step's state as ``DecodeSlots`` holds it, drawn so that every way of ending happens: small vocabulary
    (EOS ids and stop tokens come up often), token indices up to past the capacity, budgets and min_tokens
    around them, finished rows, and stop sets (right-aligned, ``-1`` wildcards inside some sequences, unused
    entries all ``-1``) per sampling setting."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g)

    finished = torch.rand(rows, generator=g) < 0.25
    stop_ids = torch.full((settings, MAX_STOP_SEQUENCES, MAX_STOP_LENGTH), -1, dtype=torch.int64)
    for k in range(4):
        for i in range(int(ints(0, 6))):
            n = int(ints(1, 4))
            seq = ints(0, vocab, n)
            if n > 1 and float(torch.rand((), generator=g)) < 0.3:
                seq[int(ints(0, n - 1))] = -1  # a wildcard inside the sequence
            stop_ids[k, i, MAX_STOP_LENGTH - n:] = seq
    eos_mask = torch.zeros(vocab + 2, dtype=torch.bool)
    eos_mask[int(ints(0, vocab))] = True
    token_index = ints(0, capacity + 2, rows)
    min_tokens = token_index + ints(-2, 3, rows)
    return types.SimpleNamespace(
        tokens=ints(0, vocab, rows), token_index=token_index, finished=finished, live=~finished,
        advance=(~finished).long(), suppress_eos=token_index < min_tokens, out_tokens=ints(0, vocab, rows, capacity + 1),
        out_logprobs=torch.randn(rows, capacity + 1, generator=g), new_tokens=ints(0, vocab, rows),
        logprobs=None if lp_dtype is None else torch.randn(rows, generator=g).to(lp_dtype),
        budget=token_index + ints(0, 5, rows), min_tokens=min_tokens, eos_mask=eos_mask,
        pad_id=torch.tensor(vocab + 1), stop_ids=stop_ids if stops else None,
        knob=ints(0, 4, rows) if stops else None)


def short_rows_state(settings: int = MAX_SETTINGS) -> types.SimpleNamespace:
    """Rows of one repeated token at token indices 0..3 and a stop sequence of three of it: only rows holding
    three tokens after the step stop (the match must not look before a row's first column)."""
    state = random_state(0, rows=8, stops=True, settings=settings)
    state.out_tokens.fill_(3)
    state.new_tokens.fill_(3)
    state.stop_ids.fill_(-1)
    state.stop_ids[:, 0, -3:] = 3
    state.token_index.copy_(torch.arange(8) % 4)
    state.finished.fill_(False)
    state.live.fill_(True)
    state.advance.fill_(1)
    state.budget.fill_(100)
    state.min_tokens.zero_()
    state.suppress_eos.zero_()
    state.eos_mask.zero_()
    return state


def clone(s: types.SimpleNamespace) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(s).items()})


def args(s: types.SimpleNamespace) -> tuple:
    return (*(getattr(s, n) for n in MUTATED), s.new_tokens, s.logprobs, *(getattr(s, n) for n in READ))


# ------------------------------------------------------------- the former code
def former_stop_match(stop_ids, out_tokens, last, knob):
    """``DecodeSlots.ends_in_a_stop_sequence`` as it was before the op (frozen here)."""
    offsets = torch.arange(1 - MAX_STOP_LENGTH, 1, device=out_tokens.device)
    columns = last[:, None] + offsets[None, :]
    tail = out_tokens.gather(1, columns.clamp(min=0)).masked_fill(columns < 0, -2)
    stops = stop_ids[knob]
    wild = stops < 0
    hit = wild | (tail[:, None, :] == stops)
    return (hit.all(dim=-1) & ~wild.all(dim=-1)).any(dim=-1)


def former_bookkeeping(s: types.SimpleNamespace) -> None:
    """``DecodeSlots.step``'s bookkeeping as it was before the op (frozen here), ``live`` from ``finished``."""
    live = ~s.finished
    advance = live.to(torch.int64)
    capacity = s.out_tokens.shape[1] - 1
    column = torch.where(live, s.token_index.clamp(max=capacity - 1), capacity)[:, None]
    s.out_tokens.scatter_(1, column, s.new_tokens[:, None])
    if s.logprobs is not None:
        s.out_logprobs.scatter_(1, column, s.logprobs[:, None].float())
    torch.where(live, s.new_tokens, s.pad_id, out=s.tokens)
    s.token_index.add_(advance)
    done = s.eos_mask[s.new_tokens] | (s.token_index >= s.budget)
    if s.stop_ids is not None:
        done |= former_stop_match(s.stop_ids, s.out_tokens, column[:, 0], s.knob) & (s.token_index > s.min_tokens)
    s.finished.logical_or_(done)


def assert_same_state(got: types.SimpleNamespace, want: types.SimpleNamespace) -> None:
    for name in ("tokens", "token_index", "finished", "out_tokens", "out_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(got.live, ~got.finished) and torch.equal(got.advance, got.live.long())
    assert torch.equal(got.suppress_eos, got.token_index < got.min_tokens)


def _causes(s: types.SimpleNamespace) -> dict[str, int]:
    """How many live rows each way of ending reaches in this state's step (the former formulas)."""
    live = ~s.finished
    capacity = s.out_tokens.shape[1] - 1
    column = torch.where(live, s.token_index.clamp(max=capacity - 1), capacity)
    index = s.token_index + live.long()
    out = s.out_tokens.clone().scatter_(1, column[:, None], s.new_tokens[:, None])
    match = former_stop_match(s.stop_ids, out, column, s.knob) if s.stop_ids is not None else torch.zeros_like(live)
    past = index > s.min_tokens
    return {"eos": int((live & s.eos_mask[s.new_tokens]).sum()), "budget": int((live & (index >= s.budget)).sum()),
            "stop": int((live & match & past).sum()), "stop held by min_tokens": int((live & match & ~past).sum()),
            "at capacity": int((live & (s.token_index >= capacity)).sum()),
            "goes on": int((live & ~s.eos_mask[s.new_tokens] & (index < s.budget) & ~(match & past)).sum())}


@pytest.mark.parametrize("stops", [True, False])
@pytest.mark.parametrize("lp_dtype", [torch.float32, torch.bfloat16, None])
def test_reference_leaves_the_former_step_codes_state_bit_for_bit(stops, lp_dtype):
    seen: dict[str, int] = {}
    for seed in range(40):
        state = random_state(seed, stops=stops, lp_dtype=lp_dtype)
        for cause, n in _causes(state).items():
            seen[cause] = seen.get(cause, 0) + n
        want = clone(state)
        former_bookkeeping(want)
        op(*args(state))  # the CPU runs the reference
        assert_same_state(state, want)
    # The draws reach every way of ending (and of not ending): the comparison covers each.
    assert all(seen[c] > 0 for c in ("eos", "budget", "at capacity", "goes on")), seen
    assert not stops or (seen["stop"] > 0 and seen["stop held by min_tokens"] > 0), seen


def test_a_stop_sequence_longer_than_a_row_does_not_match():
    state = short_rows_state()
    want = clone(state)
    former_bookkeeping(want)
    op(*args(state))
    assert_same_state(state, want)
    assert state.finished.tolist() == [False, False, True, True] * 2  # rows now holding 3 or 4 tokens


def test_stop_match_is_the_former_match():
    for seed in range(20):
        s = random_state(seed)
        last = torch.randint(0, s.out_tokens.shape[1], (s.out_tokens.shape[0],), generator=torch.Generator()
                             .manual_seed(seed))
        got = bk.stop_match(s.out_tokens, last, s.stop_ids, s.knob)
        assert torch.equal(got, former_stop_match(s.stop_ids, s.out_tokens, last, s.knob))


def test_the_op_is_one_node_of_a_captured_cpu_graph_and_replays_as_eager():
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    state = random_state(3)
    eager = clone(state)
    op(*args(state))  # warm-up, as a runner does
    op(*args(eager))
    graph = CPUGraph()
    with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(graph):
        op(*args(state))
    assert graph.num_ops == 1
    assert_same_state(state, eager)  # capture applied nothing
    for seed in (5, 6):  # new tokens and logprobs each replay, as the sampler writes them
        fresh = random_state(seed)
        for s in (state, eager):
            s.new_tokens.copy_(fresh.new_tokens)
            s.logprobs.copy_(fresh.logprobs)
        graph.replay()
        op(*args(eager))
        assert_same_state(state, eager)


def test_cpu_without_the_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bk._probe.cache_clear()
    bk._kernel.cache_clear()
    try:
        assert bk.implementation("cpu") == "reference"
    finally:
        bk._probe.cache_clear()
        bk._kernel.cache_clear()


def test_bad_arguments_are_named():
    s = random_state(0)
    with pytest.raises(ValueError, match="token_index must be int64"):
        op(*args(types.SimpleNamespace(**{**vars(s), "token_index": s.token_index.int()})))
    with pytest.raises(ValueError, match="finished must be bool"):
        op(*args(types.SimpleNamespace(**{**vars(s), "finished": s.finished[:3]})))
    with pytest.raises(ValueError, match="out_logprobs must be float32"):
        op(*args(types.SimpleNamespace(**{**vars(s), "out_logprobs": s.out_logprobs.double()})))
    with pytest.raises(ValueError, match="come together"):
        op(*args(types.SimpleNamespace(**{**vars(s), "knob": None})))


# ------------------------------------------------------------- in DecodeSlots
def _slots(stops: tuple[tuple[int, ...], ...] = (), eos: tuple[int, ...] = ()) -> tuple[torch.nn.Module, DecodeSlots]:
    model = build_model("tiny-llama", seed=1).eval()
    pool = KVPool(layer_specs(model.config), 32, 4, device=torch.device("cpu"), dtype=torch.float32)
    slots = DecodeSlots(model, 4, 16, num_eos=1, pool=pool)
    slots.set_special_ids(0, eos)
    slots.set_stop_sequences([stops])
    slots.begin_call(model, logprobs=True)
    slots.cache.block_table[:, :4] = torch.arange(1, 17).view(4, 4)
    return model, slots


def assert_mirrors(slots: DecodeSlots) -> None:
    assert torch.equal(slots.live, ~slots.finished) and torch.equal(slots.advance, slots.live.long())
    assert torch.equal(slots.suppress_eos, slots.token_index < slots.min_tokens)


def _start(slots: DecodeSlots, rows: list[int], budget: list[int], first: list[int] | None = None,
           min_tokens: list[int] | None = None) -> None:
    n = len(rows)

    def i64(v):
        return torch.tensor(v, dtype=torch.int64)

    slots.start(i64(rows), i64(first or [10 + r for r in rows]), torch.zeros(n), seed=i64([1] * n),
                stream=i64(rows), budget=i64(budget), min_tokens=i64(min_tokens or [0] * n), knob=i64([0] * n))


def test_live_and_advance_mirror_finished_through_every_writer():
    model, slots = _slots()  # no EOS: rows end by their budgets only
    assert_mirrors(slots)  # fresh slots: nothing live
    _start(slots, [0, 2, 3], [8, 1, 8], min_tokens=[3, 0, 0])  # row 2: a budget of one token, finished at once
    assert_mirrors(slots)
    assert slots.live.tolist() == [True, False, False, True]
    with torch.no_grad():
        slots.step(model, (0.0, 1.0, -1))
    assert_mirrors(slots)
    assert slots.token_index.tolist() == [2, 0, 1, 2]  # live rows advanced, the others did not
    assert slots.suppress_eos.tolist() == [True, False, False, False]  # row 0 holds 2 tokens of at least 3
    slots.resume(1, torch.tensor([11, 12, 13]), torch.zeros(3), 3, seed=1, stream=1, budget=8, min_tokens=5)
    assert_mirrors(slots)
    assert slots.live[1] and slots.advance[1] == 1 and slots.suppress_eos[1]
    slots.release(torch.tensor([0]))
    assert_mirrors(slots)
    slots.move(torch.tensor([3]), torch.tensor([0]))
    assert_mirrors(slots)
    assert slots.live.tolist() == [True, True, False, False]
    head = slots.head(2)
    with torch.no_grad():
        head.step(model, (0.0, 1.0, -1))
    assert_mirrors(slots)  # the bucket's view updated the slots' own tensors
    assert slots.token_index.tolist() == [3, 4, 1, 2]


class _Ops(TorchDispatchMode):
    """Every op's name, and whether ``DecodeSlots.step`` issued it itself (not through the forward or the
    sampler)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.own: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        self.names.append(name)
        f = sys._getframe(1)
        while f is not None and "/hybrid_engine/" not in f.f_code.co_filename:
            f = f.f_back
        if f is not None and f.f_code.co_filename.endswith("slots.py") and f.f_code.co_name == "step":
            self.own.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("key", [(0.0, 1.0, -1), (1.0, 0.9, -1)])
def test_a_step_does_its_bookkeeping_in_one_op_with_or_without_stop_sequences(key):
    ops = {}
    for stops in (False, True):
        model, slots = _slots(((5, 6), (7,)) if stops else (), eos=(2,))
        slots.knobs.set(*key)
        _start(slots, [0, 1], [8, 8])
        counter = _Ops()
        with torch.no_grad(), counter:
            slots.step(model, key)
        ops[stops] = counter
    assert ops[True].names == ops[False].names  # matching stop sequences costs no op of its own
    assert ops[True].own == ["hybrid_engine::advance_rows"]  # all the step's own device work


def test_a_stop_sequence_ends_a_row_in_a_step_past_min_tokens_only():
    model, slots = _slots()
    _start(slots, [0, 1], [8, 8], first=[5, 9])
    with torch.no_grad():
        slots.step(model, (0.0, 1.0, -1))
    picked = int(slots.out_tokens[0, 1])  # row 0's greedy token after its first, 5
    for min_tokens, ends in ((0, True), (2, False)):  # after the step, row 0 holds 2 tokens
        model, slots = _slots(stops=((5, picked),))
        _start(slots, [0, 1], [8, 8], first=[5, 9], min_tokens=[min_tokens, 0])
        with torch.no_grad():
            slots.step(model, (0.0, 1.0, -1))
        assert int(slots.out_tokens[0, 1]) == picked
        assert slots.finished[:2].tolist() == [ends, False]
        assert_mirrors(slots)


# ------------------------------------------------------------- Triton kernel
_KERNEL_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_step_bookkeeping import random_state, short_rows_state, clone, args, assert_same_state
from hybrid_engine.decode.ops import bookkeeping as bk
assert bk.implementation("cpu") == "triton", "the probe did not choose the kernel"
op = torch.ops.hybrid_engine.advance_rows
cases = [(0, 48, True, torch.float32), (1, 48, True, torch.bfloat16), (2, 24, True, None),
         (3, 24, False, torch.float32), (4, 24, False, None)]
states = [random_state(seed, rows=rows, stops=stops, lp_dtype=lp, settings=8) for seed, rows, stops, lp in cases]
for state in states + [short_rows_state(settings=8)]:
    want = clone(state)
    bk.reference_advance_rows(*args(want))
    op(*args(state))
    assert_same_state(state, want)
# A bucket's [:n] views of the slots' tensors: the kernel writes them in place.
full = random_state(9, settings=8)
want = clone(full)
views = type(full)(**{{k: v[:5] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 12 else v
                      for k, v in vars(full).items()}})
op(*args(views))
bk.reference_advance_rows(*args(type(want)(**{{k: v[:5] if isinstance(v, torch.Tensor) and v.dim()
                                              and v.shape[0] == 12 else v for k, v in vars(want).items()}})))
assert_same_state(full, want)
print("kernel ok")
"""


@pytest.mark.slow  # a process of its own (tests/tiers.py)
def test_triton_kernel_leaves_the_references_state_under_the_interpreter():
    """In a process of its own: Triton reads ``TRITON_INTERPRET`` when it is imported."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _KERNEL_CHECK.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]
