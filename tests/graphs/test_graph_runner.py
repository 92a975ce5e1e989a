"""The decode graph runner's own pieces: staged admission, scheduling decisions, the accelerator it
picks, the policy it shares with rollouts, and capture-safe sampling counters."""

import contextlib
import dataclasses
import types
import warnings

import pytest
import torch
from conftest import left_padded_prompts as prompts

from hybrid_engine.accelerator import (
    CPUAccelerator,
    GraphCaptureError,
    TorchBackendAccelerator,
    set_accelerator,
)
from hybrid_engine.decode import kv_storage
from hybrid_engine.decode.kv_pool import KVPool, PageLedger
from hybrid_engine.decode.layout import layer_specs
from hybrid_engine.decode.sampling import counter_uniform, sample_tokens
from hybrid_engine.decode.slots import DecodeSlots
from hybrid_engine.decode.staging import PromptStage, admission_round, prefill_staged, width_bucket
from hybrid_engine.decode.step import prefill
from hybrid_engine.engine import initialize
from hybrid_engine.generation.pages import PagePlan
from hybrid_engine.generation.schedule_policy import _steps_to_admission, _steps_to_shrink
from hybrid_engine.graphs.keys import AdmissionKey, PrefillKey, default_graph_buckets
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.graphs.runner import EXACT_PROMPT_ROWS, DecodeGraphRunner
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

GREEDY = (0.0, 1.0, -1)


def pool_for(model, pages=32, page_size=4):
    return KVPool(layer_specs(model.config), pages, page_size, device=torch.device("cpu"), dtype=torch.float32)


def slots_for(model, pool, rows=4, capacity=32):
    slots = DecodeSlots(model, rows, capacity, num_eos=1, pool=pool)
    slots.set_special_ids(0, (2,))
    return slots


def rows_kv(cache, row: int, length: int, layer: int = 0) -> torch.Tensor:
    """Row ``row``'s first ``length`` keys of ``layer``, in logical order, read through its block table."""
    slots = cache.pool.page_slots(cache.block_table[row]).flatten()[:length]
    return cache.pool.keys[layer][slots]


def stage_round(model, slots, stage, plan, ids, mask, requests):
    """Stage prompts ``0..p-1`` with pages from ``plan`` and admit ``requests`` ``(slot, prompt, rng)``: each
    prompt's last sample takes its partly filled page, the others copy it."""
    lengths = mask.sum(-1).tolist()
    tables = [plan.stage((p,), n) for p, n in enumerate(lengths)]
    pending = [sum(1 for _, p, _ in requests if p == q) for q in range(len(lengths))]
    meta = []
    for slot, prompt, rng in requests:
        pages = plan.admit(slot, (prompt,), last=pending[prompt] == 1)
        pending[prompt] -= 1
        meta.append([slot, prompt, rng, 5, 0, 7, lengths[prompt], pages.src, pages.dst, 0] + pages.table)
    return stage.stage_prompts(ids, mask, tables, ids.shape[0], 8), meta


# ------------------------------------------------------------------ admission
def test_width_buckets_are_powers_of_two():
    assert [width_bucket(w) for w in (1, 7, 8, 9, 16, 17, 100)] == [8, 8, 8, 16, 16, 32, 128]
    assert default_graph_buckets(3) == (1, 2, 4) and default_graph_buckets(17) == (1, 2, 4, 8, 16, 24)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_staged_batch_and_round_match_an_exact_prefill_and_share_prompt_pages(arch):
    model = build_model(arch, seed=2).eval()
    ids, mask = prompts(3, 5, seed=4)  # left-padded: 5, 4 and 3 real tokens, staged right-aligned at width 8
    exact = slots_for(model, pool_for(model))
    exact.cache.block_table[:3] = torch.arange(1, 25).view(3, 8)
    with torch.no_grad():
        logits = prefill(model, exact.head(3).cache, ids, mask)
    pool = pool_for(model)
    staged = slots_for(model, pool)
    stage = PromptStage(model, 4, 8, pool=pool, requests=4, max_pages=staged.cache.max_pages)
    plan = PagePlan(PageLedger(pool.num_pages), 4, staged.cache.max_pages)
    # Requests into slots 3, 0, 1, 2; requests 2 and 3 are two samples of prompt 2 (4 real tokens: one full
    # page, shared, and nothing partial) and prompt 0 (5 tokens: one full page and one token on a second).
    batch, meta = stage_round(model, staged, stage, plan, ids, mask, [(3, 1, 10), (0, 0, 11), (1, 0, 12),
                                                                       (2, 2, 13)])
    with torch.no_grad():
        prefill_staged(model, batch)
        admission_round(staged, stage.stage_requests(meta, 4), GREEDY)
    torch.testing.assert_close(stage.logits[:3], logits.float(), rtol=1e-5, atol=1e-5)
    first = logits.argmax(-1)
    assert staged.tokens.tolist() == [first[0], first[0], first[2], first[1]]  # slot s holds its request
    assert staged.stream.tolist() == [11, 12, 13, 10] and staged.seed.tolist() == [7] * 4
    assert not staged.finished.any() and staged.token_index.tolist() == [1] * 4
    lengths = mask.sum(-1).tolist()
    for slot, prompt in ((3, 1), (0, 0), (1, 0), (2, 2)):
        torch.testing.assert_close(rows_kv(staged.cache, slot, lengths[prompt]),
                                   rows_kv(exact.cache, prompt, lengths[prompt]), rtol=1e-5, atol=1e-5)
        assert int(staged.cache.write_pos[slot]) == int(staged.cache.position[slot]) == lengths[prompt]
    table = staged.cache.block_table.tolist()
    assert table[0][0] == table[1][0] == plan.unit_pages[(0,)][0][0]  # prompt 0's full page, held once
    assert table[0][1] != table[1][1] == plan.unit_pages[(0,)][0][1]  # its partial page: copied, then taken
    assert table[2][1] == 0  # prompt 2 fills its page: the first response token starts the next one (grow)
    assert plan.ledger.refs(table[0][0]) == 3  # the stage and both samples


def test_staged_batch_and_round_captured_equal_eager():
    model = build_model("tiny-qwen2", seed=3).eval()
    acc = CPUAccelerator()
    ids, mask = prompts(2, 6, seed=5)
    sampled = (0.9, 0.95, 20)
    runs = []
    for _ in range(2):
        pool = pool_for(model)
        slots = slots_for(model, pool)
        stage = PromptStage(model, 2, 8, pool=pool, requests=2, max_pages=slots.cache.max_pages)
        plan = PagePlan(PageLedger(pool.num_pages), 4, slots.cache.max_pages)
        batch, meta = stage_round(model, slots, stage, plan, ids, mask, [(1, 0, 4), (0, 1, 5)])
        slots.knobs.set(*sampled)  # what run_schedule does at the start of a call
        runs.append((slots, stage, batch, stage.stage_requests(meta, 2)))
    (eager, stage_e, batch_e, round_e), (graphed, stage_g, batch_g, round_g) = runs
    with torch.no_grad():
        prefill_staged(model, batch_e)
        admission_round(eager, round_e, sampled)
        prefill_staged(model, batch_g)  # warm-up, then reset what it wrote
        admission_round(graphed, round_g, sampled)
        graphed.release(torch.tensor([0, 1]))
        stage_g.logits.zero_()
        graphs = acc.create_graph(), acc.create_graph()
        with acc.capture_to_graph(graphs[0]):
            prefill_staged(model, batch_g)
        with acc.capture_to_graph(graphs[1]):
            admission_round(graphed, round_g, sampled)
        assert graphed.finished.all() and not stage_g.logits.any()  # capture applied nothing
        for graph in graphs:
            acc.replay_graph(graph)
    for name in ("tokens", "token_index", "seed", "stream", "budget", "finished", "out_logprobs"):
        assert torch.equal(getattr(eager, name), getattr(graphed, name)), name
    assert torch.equal(eager.cache.block_table, graphed.cache.block_table)
    assert torch.equal(eager.pool.values[1], graphed.pool.values[1])


def test_rollout_replays_admission_rounds_and_engine_generate_does_not_stage():
    model = build_model("tiny-llama", seed=6)
    request = RolloutRequest(*prompts(5, 6, seed=8), max_new_tokens=[2, 7, 3, 7, 2])
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.0)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, max_batch_size=2,
                                                              pad_token_id=0, eos_token_id=10_000))
    eager = HybridEngineRollout(model, config=RolloutConfig(max_batch_size=2, pad_token_id=0, eos_token_id=10_000))
    expected = eager.generate(request, sampling)
    for _ in range(3):
        batch = rollout.generate(request, sampling)
        assert torch.equal(batch.input_ids, expected.input_ids)
        assert torch.equal(batch.response_logprobs, expected.response_logprobs)
    st = rollout.last_stats
    # 5 prompts through a 2-row stage: 3 prefill batches, each prompt prefilled once; every batch and round replayed.
    assert st["prefill_forwards"] == 3 and st["prefill_rows"] == 5 and st["admission_rounds"] >= 3
    assert st["admission_graph_replays"] == st["prefill_forwards"] + st["admission_rounds"]
    assert st["admission_graph_captures"] == 0
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    engine.generate(input_ids=request.prompt_ids, attention_mask=request.prompt_attention_mask, max_new_tokens=4)
    s = engine.graph_stats
    assert s.admission_captures == 0 and s.admission_replays == 0 and s.captures >= 1


def test_prefill_batches_run_their_exact_prompt_count_up_to_eight_then_decode_buckets():
    model = build_model("tiny-gpt2", seed=3)
    # 3 prompts in one batch: 3 prompt rows (no padding prefill), their round's requests in a decode bucket (4);
    # rounds of every smaller size are captured up front too (how many a round admits follows the tokens).
    request = RolloutRequest(*prompts(3, 6, seed=4))
    cfg = dict(pad_token_id=0, eos_token_id=10_000, max_batch_size=3)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, **cfg))
    eager = HybridEngineRollout(model, config=RolloutConfig(**cfg)).generate(request, SamplingConfig(max_new_tokens=5))
    for _ in range(3):  # warm-up, capture, replay
        batch = rollout.generate(request, SamplingConfig(max_new_tokens=5))
        assert torch.equal(batch.input_ids, eager.input_ids)
    graphs = rollout.runner.graph_keys
    assert [k.prompts for k in graphs if isinstance(k, PrefillKey)] == [3]
    assert sorted(k.requests for k in graphs if isinstance(k, AdmissionKey)) == [1, 2, 4]
    assert rollout.last_stats["admission_graph_replays"] == 2
    runner = rollout.runner
    assert [runner.prompt_rows_for(n) for n in (1, 3, 5, 7, 8, 9, 17)] == [1, 3, 5, 7, 8, 16, 24]
    assert EXACT_PROMPT_ROWS == 8


# ----------------------------------------------------------------- scheduling
def test_admission_waits_while_idle_slots_cost_less_than_a_round():
    # 1 free slot, the next frees in 1 step: cheaper to wait and admit two together.
    assert _steps_to_admission(1, 5, {0: 1, 1: 30, 2: 30}, 4, 2.0, None) == 1
    # 1 free slot, the next frees in 30 steps: admit now.
    assert _steps_to_admission(1, 5, {0: 30, 1: 30, 2: 30}, 4, 2.0, None) == 0
    # Everything waiting fits: admit now.
    assert _steps_to_admission(2, 2, {0: 1, 1: 30}, 4, 2.0, None) == 0
    # Rows may stop early on EOS: never plan past the sync interval.
    assert _steps_to_admission(0, 5, {0: 40, 1: 40, 2: 40, 3: 40}, 4, 2.0, 4) == 4


def test_host_syncs_only_where_the_bucket_can_shrink():
    runner = DecodeGraphRunner(build_model("tiny-gpt2"))
    # 8 rows in bucket 8: after 3 steps 3 are done (5 left, still bucket 8); after 5 steps 5 are done (3 left: 4).
    assert _steps_to_shrink(runner, {0: 3, 1: 3, 2: 3, 3: 5, 4: 5, 5: 9, 6: 9, 7: 9}, 8) == 5
    assert _steps_to_shrink(runner, {0: 7}, 1) == 7


def test_continuous_batching_admits_in_few_rounds_and_syncs_rarely():
    model = build_model("tiny-gpt2", seed=0)
    budgets = [12 if i % 8 == 0 else 3 + i % 4 for i in range(16)]
    request = RolloutRequest(*prompts(16, 6, seed=9), max_new_tokens=budgets)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    stats = {}
    for continuous in (True, False):
        rollout = HybridEngineRollout(model, config=RolloutConfig(
            use_graph_capture=True, continuous_batching=continuous, max_batch_size=8, pad_token_id=0,
            eos_token_id=10_000))
        batch = rollout.generate(request, sampling)
        assert batch.response_lengths.tolist() == budgets
        stats[continuous] = rollout.last_stats
    cont, static = stats[True], stats[False]
    assert cont["decode_steps"] < static["decode_steps"]
    assert cont["admission_rounds"] < 16 // 2  # batched rounds, not one per freed slot
    assert cont["prefill_forwards"] == static["prefill_forwards"] == 2  # 16 prompts, 8 at a time
    assert cont["host_syncs"] <= cont["admission_rounds"] + len(cont["bucket_steps"]) + 1
    assert static["compactions"] >= 1 and min(static["bucket_steps"]) < 8  # finished rows stop costing compute


def test_a_prompt_whose_samples_span_several_rounds_is_prefilled_once():
    """GRPO-style: 2 prompts x 6 samples through 4 slots. The samples of a prompt are admitted over several
    rounds, all from its one staged prefill, with the tokens of a call that admits them all at once."""
    model = build_model("tiny-qwen2", seed=2)
    request = RolloutRequest(*prompts(2, 7, seed=5))
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.9, top_p=0.9, n_samples_per_prompt=6, seed=3)
    budgets_vary = RolloutRequest(request.prompt_ids, request.prompt_attention_mask, max_new_tokens=[6, 3])
    cfg = dict(pad_token_id=0, eos_token_id=10_000)
    for req in (request, budgets_vary):
        wide = HybridEngineRollout(model, config=RolloutConfig(max_batch_size=12, **cfg)).generate(req, sampling)
        eager = None
        for graphs in (False, True):
            rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, max_batch_size=4,
                                                                      **cfg))
            for _ in range(3 if graphs else 1):  # warm-up, capture, replay
                batch = rollout.generate(req, sampling)
                assert torch.equal(batch.input_ids, wide.input_ids)
                # Other prefill batch shapes round the logits differently in the last bits; the same ones do not.
                torch.testing.assert_close(batch.response_logprobs, wide.response_logprobs, rtol=0, atol=1e-5)
                eager = batch if eager is None else eager
                assert torch.equal(batch.response_logprobs, eager.response_logprobs)
            st = rollout.last_stats
            # A batch holds as many distinct prompts as the stage has rows (4, however many samples): here both.
            assert st["admission_rounds"] >= 3 and st["prefill_forwards"] == 1 and st["prefill_rows"] == 2
            assert st["kv_row_copies"] == 12 - 2
        assert [k.prompts for k in rollout.runner.graph_keys if isinstance(k, PrefillKey)] == [2]


# ------------------------------------------------------------ the accelerator
@pytest.mark.stub
def test_cpu_model_on_a_gpu_host_never_gets_gpu_graphs():
    """Stub CUDA process accelerator, model on the CPU: the runner uses the CPU's (emulated) graphs."""
    log = []

    class StubGraph:
        def __init__(self):
            log.append("cuda graph constructed")

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append("cuda capture")
        yield

    stub = types.SimpleNamespace(CUDAGraph=StubGraph, graph=graph, is_available=lambda: True,
                                 current_device=lambda: 0, synchronize=lambda: None)
    cuda = TorchBackendAccelerator("cuda", stub)
    set_accelerator(cuda)
    model = build_model("tiny-gpt2", seed=1)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    ids, mask = prompts(2, 4)
    out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5)
    runner = engine.generate_runner
    assert isinstance(runner.accelerator, CPUAccelerator) and runner.accelerator is not cuda
    assert engine.graph_stats.captures == 1 and log == []
    set_accelerator(CPUAccelerator())
    eager, *_ = initialize(model=model, config={})
    assert torch.equal(out, eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5))


# ------------------------------------------------------------ shared policy
@pytest.mark.parametrize("he,match", [({"inference_tp_size": 2}, "inference_tp_size"),
                                       ({"release_inference_cache": True}, "release_inference_cache")])
def test_rollout_honours_the_engine_config_gates(he, match, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # inference_tp_size may not exceed the launched ranks
    monkeypatch.setattr(kv_storage, "supports_release", lambda device: False)  # stand-in: a device without releasable storage
    model = build_model("tiny-opt", seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = initialize(model=model, config={"hybrid_engine": he})
    request = RolloutRequest(*prompts(2, 4))
    sampling = SamplingConfig(max_new_tokens=4)
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                               eos_token_id=10_000))
    with pytest.warns(GraphRefusedWarning, match=match):
        batch = rollout.generate(request, sampling)
    eager = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=10_000))
    assert torch.equal(batch.input_ids, eager.generate(request, sampling).input_ids)
    st = rollout.last_stats
    assert st["graph_captures"] == 0 and st["fallbacks"] == 1 and match in st["last_refusal_reason"]
    assert (rollout.runner.slots is None) == (match == "release_inference_cache")  # buffers freed after the call


# ------------------------------------------------------------ sampling counters
def test_python_int_counters_capture_as_device_fills():
    """A Python-int counter used to become torch.tensor(...) inside capture: a host-to-device copy, which
    the strict emulation (like CUDA) refuses. It is a device fill now, frozen into the graph."""
    acc = CPUAccelerator()
    logits = torch.randn(3, 50)
    seed = torch.tensor([5, 6, 7])
    rows = torch.arange(3)
    graph = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(graph):
        tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.9, seed=seed, stream=rows, token_index=4)
        u = counter_uniform(11, 3, 2)
    acc.replay_graph(graph)
    want, _ = sample_tokens(logits, temperature=1.0, top_p=0.9, seed=seed, stream=rows, token_index=4)
    assert torch.equal(tokens, want) and float(u) == float(counter_uniform(11, 3, 2))
    with pytest.raises(GraphCaptureError, match="host data"), acc.capture_to_graph(acc.create_graph()):
        torch.tensor(4) + seed  # what the old counter code did


# ------------------------------------------------------------ interrupted calls
def test_a_call_interrupted_mid_decode_leaves_the_next_one_correct(monkeypatch):
    """An exception between steps (a bug, a KeyboardInterrupt) must not leak live slots into the next call."""
    model = build_model("tiny-gpt2", seed=3)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, max_batch_size=4,
                                                              pad_token_id=0, eos_token_id=10_000))
    eager = HybridEngineRollout(model, config=RolloutConfig(max_batch_size=4, pad_token_id=0, eos_token_id=10_000))
    big = RolloutRequest(*prompts(4, 5, seed=1))
    three = RolloutRequest(*prompts(3, 5, seed=2))  # bucket 4: slot 3 is in the bucket but never admitted
    sampling = SamplingConfig(max_new_tokens=30, temperature=0.0)
    real, calls = DecodeGraphRunner.step, {"n": 0}

    def failing_step(self, bucket, span, key):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, bucket, span, key)

    monkeypatch.setattr(DecodeGraphRunner, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        rollout.generate(big, sampling)
    monkeypatch.setattr(DecodeGraphRunner, "step", real)
    for request in (three, big):  # slots were left live: the next calls must not run them
        got = rollout.generate(request, sampling)
        assert torch.equal(got.input_ids, eager.generate(request, sampling).input_ids)


def test_one_graph_per_bucket_and_sampling_mode_serves_every_temperature_of_a_schedule():
    # An annealed temperature (or top-p, top-k) changes only device values: nothing is captured again.
    model = build_model("tiny-llama", seed=2)
    config = RolloutConfig(use_graph_capture=True, max_batch_size=4, pad_token_id=0, eos_token_id=10_000)
    graphed, eager = HybridEngineRollout(model, config=config), HybridEngineRollout(
        model, config=dataclasses.replace(config, use_graph_capture=False))
    request = RolloutRequest(*prompts(6, 5, seed=4), max_new_tokens=[3, 6, 2, 6, 4, 5])
    captures, outputs = [], []
    # Two calls warm every key up and capture it (a key first seen once is captured by the next call).
    schedule = [(1.0, 0.9, 40), (1.0, 0.9, 40), (0.9, 0.8, 20), (0.6, 0.95, 400), (0.3, 0.5, 5)]
    for step, (t, p, k) in enumerate(schedule):
        sampling = SamplingConfig(max_new_tokens=6, temperature=t, top_p=p, top_k=k, seed=step % 2)
        batch = graphed.generate(request, sampling)
        assert torch.equal(batch.input_ids, eager.generate(request, sampling).input_ids)
        assert torch.equal(batch.response_logprobs, eager.generate(request, sampling).response_logprobs)
        captures.append(graphed.last_stats["graph_captures"] + graphed.last_stats["admission_graph_captures"])
        outputs.append(batch.response_logprobs)
    assert captures[0] > 0 and captures[2:] == [0, 0, 0]
    assert len({tuple(o.flatten().tolist()) for o in outputs[1:]}) == 4  # every call sampled with its own knobs
    modes = {key.sampling for key in graphed.runner.graph_keys if not isinstance(key, PrefillKey)}  # prefill: no sampling
    assert modes == {(True, True, True)}


# ------------------------------------------------------------ buffers and their epoch
def test_the_buffers_epoch_changes_exactly_when_storage_moves():
    """Buffers that fit are kept at the same addresses (same epoch); growth, reallocation and release each
    change the epoch."""
    from hybrid_engine.graphs.buffers import DecodeBuffers

    moves = []
    buffers = DecodeBuffers(build_model("tiny-llama", seed=1), on_move=lambda: moves.append(buffers.epoch))
    slots = buffers.allocate(rows=2, capacity=8, num_eos=1)
    first, pool = buffers.epoch, buffers.kv_pool
    assert buffers.allocate(rows=2, capacity=8, num_eos=1) is slots and buffers.epoch == first
    assert buffers.allocate(rows=1, capacity=4, num_eos=1) is slots and buffers.kv_pool is pool  # smaller fits
    grown = buffers.allocate(rows=2, capacity=64, num_eos=1)
    assert grown is not slots and grown.capacity == 64 and buffers.epoch > first
    second = buffers.epoch
    buffers.allocate(rows=2, capacity=64, num_eos=1, prompt_width=8)  # a prompt stage: new storage
    assert buffers.stage is not None and buffers.epoch > second
    third = buffers.epoch
    buffers.release()
    assert buffers.slots is None and buffers.kv_pool is None and buffers.epoch == third + 1
    assert moves and moves[-1] == buffers.epoch  # the holder hears of every move, after the epoch changed


def _capture_one_bucket(runner: DecodeGraphRunner, capacity: int) -> None:
    slots = runner.prepare(rows=2, capacity=capacity, num_eos=1, graphs=True)
    slots.set_special_ids(0, (2,))
    runner.capture_buckets(2, [1], GREEDY, shrink=False)


def test_graphs_captured_against_old_storage_never_replay():
    """The epoch is part of what a call checks before replaying: storage that moved drops every graph, even
    where nothing else told the runner (no on_move hook)."""
    runner = DecodeGraphRunner(build_model("tiny-llama", seed=1))
    _capture_one_bucket(runner, 8)
    keys = runner.graph_keys
    assert keys and all(runner.graph(k) is not None for k in keys) and runner.stats.captures == 1
    _capture_one_bucket(runner, 8)  # same storage: the graph is kept
    assert runner.graph_keys == keys and runner.stats.captures == 1 and runner.stats.invalidations == 0
    runner.buffers._on_move = None  # the epoch alone must keep stale graphs from replaying
    runner.prepare(rows=2, capacity=64, num_eos=1, graphs=True)  # the slots grow: new addresses
    assert runner.graph_keys == () and runner.graph(keys[0]) is None and runner.stats.invalidations == 1


def test_the_policy_combines_static_and_learnt_refusals():
    from hybrid_engine.graphs.policy import MAX_CAPTURE_FAILURES, GraphPolicy

    model = build_model("tiny-llama", seed=1)
    policy = GraphPolicy(model, CPUAccelerator(emulate_graphs=True))
    assert policy.refusal() is None
    assert all(policy.capture_failed() is None for _ in range(MAX_CAPTURE_FAILURES - 1))
    assert "disabled" in policy.capture_failed() and "disabled" in policy.refusal()
    hooked = GraphPolicy(model, CPUAccelerator(emulate_graphs=True))
    handle = model.model.layers[0].register_forward_hook(lambda *a: None)
    hooked.refuse_hooks(handle.id, "that hook")
    assert hooked.refusal() == "that hook"
    other = GraphPolicy(model, CPUAccelerator(emulate_graphs=True))  # another runner of the same model
    assert other.refusal() is None and other.known_hook_refusal() == "that hook" and other.refusal() == "that hook"
    handle.remove()
    assert hooked.refusal() is None and other.known_hook_refusal() is None
    assert "cannot capture" in GraphPolicy(model, CPUAccelerator(emulate_graphs=False)).refusal()


def test_a_runner_let_go_of_frees_its_page_pool_without_the_cyclic_collector():
    """The buffers call back into the runner through a weak reference: no cycle keeps the pool alive."""
    import gc
    import weakref

    runner = DecodeGraphRunner(build_model("tiny-llama", seed=1))
    _capture_one_bucket(runner, 8)
    assert runner.graph_keys
    pool = weakref.ref(runner.kv_pool)
    gc.disable()
    try:
        del runner
        assert pool() is None
    finally:
        gc.enable()
