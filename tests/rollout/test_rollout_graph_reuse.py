"""Capture once, replay many: across calls, across optimizer steps; recapture on re-allocated weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import (
    assert_batches_identical,
    assert_same_samples,
    left_padded_prompts,
    run,
    shared_model,
)

from hybrid_engine.engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model


def _eager(model, request, sampling):
    return run(model, request, sampling, graphs=False, max_batch_size=4)[0]


def test_one_capture_across_prompt_sets_and_optimizer_step():
    model = build_model("tiny-llama", seed=3)
    rollout = HybridEngineRollout(
        model, config=RolloutConfig(use_graph_capture=True, max_batch_size=4, pad_token_id=0, eos_token_id=10_000)
    )
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.9, n_samples_per_prompt=2, seed=5)
    first = left_padded_prompts([4, 6, 3], seed=10)
    second = left_padded_prompts([5, 2, 6], seed=11)  # different prompts, same widths

    captures = []
    a = rollout.generate(first, sampling)
    captures.append(rollout.last_stats["graph_captures"])
    assert_batches_identical(a, _eager(model, first, sampling))
    b = rollout.generate(second, sampling)
    captures.append(rollout.last_stats["graph_captures"])
    assert rollout.last_stats["graph_replays"] == rollout.last_stats["decode_steps"]
    assert_batches_identical(b, _eager(model, second, sampling))

    # A training step in between: in-place parameter updates, read by the same graph.
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.cat([first.prompt_ids, first.prompt_ids], dim=1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert model.training

    c = rollout.generate(first, sampling)
    captures.append(rollout.last_stats["graph_captures"])
    assert model.training, "rollout must restore train mode"
    model.eval()
    expected = _eager(model, first, sampling)
    assert_batches_identical(c, expected)
    assert not torch.equal(c.response_logprobs, a.response_logprobs), "the update must be visible"
    # One capture per bucket the first call visits (4, then 2 as requests finish), none afterwards.
    assert captures[0] == len(rollout.graph_stats.buckets) >= 1 and captures[1:] == [0, 0]
    assert rollout.total_graph_captures == captures[0]


def test_reallocated_weights_force_recapture():
    model = build_model("tiny-gpt2", seed=4)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=2))
    request = left_padded_prompts([3, 5], seed=12)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0)
    rollout.generate(request, sampling)
    captured = rollout.last_stats["graph_captures"]
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 1.5  # new storage: a stale graph would keep reading the old weights
    batch = rollout.generate(request, sampling)
    assert rollout.last_stats["graph_captures"] == captured and rollout.graph_stats.invalidations == 1
    assert_batches_identical(batch, run(model, request, sampling, graphs=False, eos=2)[0])


def test_same_seed_same_samples_whatever_batch_size_or_order():
    model = shared_model("tiny-opt")
    request = left_padded_prompts([4, 2, 6, 3, 5], seed=13)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=50, n_samples_per_prompt=2, seed=21)
    reference, _ = run(model, request, sampling, graphs=True, max_batch_size=None)
    for max_batch_size in (1, 3):
        batch, stats = run(model, request, sampling, graphs=True, max_batch_size=max_batch_size)
        assert stats["peak_active_batch"] == max_batch_size
        # Other batch sizes: logprobs may differ in the last float bits, so the samples are compared as
        # numerically different paths are (equal, or a flip float noise can make, teacher-forced).
        assert_same_samples(reference, batch, model=model, sampling=sampling)

    # Arrival order: the same prompts, reversed, keeping their request ids.
    order = [4, 3, 2, 1, 0]
    reordered = RolloutRequest(
        request.prompt_ids[order], request.prompt_attention_mask[order], request_ids=order
    )
    batch, _ = run(model, reordered, sampling, graphs=True, max_batch_size=3)
    n = sampling.n_samples_per_prompt
    rows = [p * n + j for p in order for j in range(n)]
    assert_same_samples(batch, dataclasses.replace(
        reference, input_ids=reference.input_ids[rows], attention_mask=reference.attention_mask[rows],
        response_logprobs=reference.response_logprobs[rows], response_lengths=reference.response_lengths[rows],
        prompt_index=reference.prompt_index[rows]), model=model, sampling=sampling)

    other, _ = run(model, request, SamplingConfig(**{**sampling.__dict__, "seed": 22}), graphs=True)
    assert not torch.equal(other.input_ids, reference.input_ids)
    # The samples of one prompt differ from each other (distinct request counters).
    assert not torch.equal(reference.input_ids[0], reference.input_ids[1])


def test_hybrid_engine_train_steps_between_rollouts_reuse_the_capture():
    import hybrid_engine

    model = build_model("tiny-qwen2", seed=5)
    engine, *_ = hybrid_engine.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    )
    rollout = hybrid_engine.HybridEngineRollout(
        engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=10_000)
    )
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, n_samples_per_prompt=2, seed=1)
    request = left_padded_prompts([3, 5], seed=14)
    captures = []
    previous = None
    for _ in range(2):
        batch = rollout.generate(request, sampling)
        captures.append(rollout.last_stats["graph_captures"])
        assert_batches_identical(batch, run(model, request, sampling, graphs=False)[0])
        if previous is not None:
            assert not torch.equal(batch.response_logprobs, previous.response_logprobs)
        previous = batch
        engine.train()
        loss = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.input_ids).loss
        engine.backward(loss)
        engine.step()
    assert captures == [1, 0]


STAT_FIELDS = {
    "prefill_ms", "decode_ms", "overhead_ms", "total_ms", "decode_steps", "prefill_forwards", "tokens_generated",
    "tokens_per_second", "graph_replays", "graph_captures", "fallbacks", "peak_active_batch", "cache_capacity",
    "cache_memory_bytes", "host_syncs",
}


def test_last_stats_fields_and_few_host_syncs():
    model = shared_model("tiny-gpt2")
    request = left_padded_prompts([3, 6, 4], seed=15)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    batch, stats = run(model, request, sampling, graphs=True, enable_profiling=True)
    assert STAT_FIELDS <= set(stats)
    assert stats["tokens_generated"] == int(batch.response_lengths.sum()) == 36
    # Warmed up and captured before step 1, at every span the call reaches (one page, then a second).
    assert stats["decode_steps"] == 11 and stats["graph_replays"] == 11 and stats["span_buckets"] == (1, 2)
    assert stats["prefill_forwards"] == 1 and stats["peak_active_batch"] == 3
    assert stats["host_syncs"] <= 4  # one flag read per sync_interval=4 steps, none per token
    # The longest prompt (6 tokens) is staged at width 8; the cache holds that plus the 12 new tokens.
    assert stats["cache_capacity"] == 8 + 12 and stats["cache_memory_bytes"] > 0
    assert stats["total_ms"] >= stats["prefill_ms"] + stats["decode_ms"] - 1e-6
    assert "profile" in stats


def test_host_reading_hook_refuses_graphs_and_device_hook_is_captured():
    """Hooks are never dropped: one that reads the host refuses graphs (naming its module), one that only
    does device work is captured; either way the rollout equals the eager rollout with the same hook."""
    import pytest

    from hybrid_engine.graphs.policy import GraphRefusedWarning

    model = build_model("tiny-gpt2", seed=4)
    request = left_padded_prompts([4, 6], seed=12)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, seed=1)
    rollout = HybridEngineRollout(
        model, config=RolloutConfig(use_graph_capture=True, max_batch_size=4, pad_token_id=0, eos_token_id=10_000)
    )

    def sync_hook(module, args, output):
        output.sum().item()  # a host read: illegal inside capture

    handle = model.lm_head.register_forward_hook(sync_hook)
    expected = _eager(model, request, sampling)
    with pytest.warns(GraphRefusedWarning, match="forward hook .*sync_hook.* on module 'lm_head'"):
        got = rollout.generate(request, sampling)
    assert_batches_identical(got, expected)
    st = rollout.last_stats
    assert st["graph_captures"] == 0 and st["fallbacks"] == 1 and "'lm_head'" in st["last_refusal_reason"]
    handle.remove()

    bias = torch.zeros(model.config.vocab_size)
    bias[42] = 50.0
    handle = model.lm_head.register_forward_hook(lambda m, a, out: out + bias)
    expected = _eager(model, request, sampling)
    assert (expected.responses == 42).all()  # the hook changes the output
    for _ in range(2):
        assert_batches_identical(rollout.generate(request, sampling), expected)
    assert rollout.last_stats["graph_captures"] == 0 and rollout.last_stats["graph_replays"] > 0
    assert rollout.graph_stats.captures >= 1 and rollout.graph_stats.fallbacks == 1
    handle.remove()


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def test_autocast_around_the_call_runs_in_its_precision_and_a_change_recaptures():
    # A mixed-precision loop may call the rollout under autocast: K/V come out bf16 (V) and fp32 (K, after
    # RoPE) against the fp32 cache. Graphs bake the precision in, so switching autocast on or off recaptures.
    model = build_model("tiny-llama", seed=4)
    config = RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=10_000)
    graphed = HybridEngineRollout(model, config=config)
    eager = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=False, pad_token_id=0,
                                                            eos_token_id=10_000))
    request = left_padded_prompts([5, 3, 6], seed=12)
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.8, seed=3)
    logprobs = {}
    for on in (True, True, False, True):
        with _autocast(on):
            batch, ref = graphed.generate(request, sampling), eager.generate(request, sampling)
        assert_batches_identical(batch, ref)
        assert graphed.last_stats["graph_replays"] > 0
        logprobs.setdefault(on, batch.response_logprobs)
        assert torch.equal(batch.response_logprobs, logprobs[on])
    assert not torch.equal(logprobs[True], logprobs[False])  # bf16 compute, not fp32, under autocast
    assert graphed.graph_stats.invalidations == 2  # on -> off -> on

    # The captures cast the weights themselves (autocast's cache would have handed them copies made before
    # them): an in-place update, as an optimizer step makes, is read by the next replay.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    with _autocast(True):
        batch, ref = graphed.generate(request, sampling), eager.generate(request, sampling)
    assert graphed.last_stats["graph_captures"] == 0 and graphed.last_stats["graph_replays"] > 0
    assert_batches_identical(batch, ref)
    assert not torch.equal(batch.response_logprobs, logprobs[True])

    greedy = SamplingConfig(max_new_tokens=7, temperature=0.0)
    with _autocast(True), torch.no_grad():
        batch = graphed.generate(request, greedy)
        hf = model.generate(request.prompt_ids, attention_mask=request.prompt_attention_mask, do_sample=False,
                            max_new_tokens=7, pad_token_id=0, eos_token_id=10_000)
    assert torch.equal(batch.input_ids, hf)


def test_a_forward_replaced_on_the_instance_recaptures():
    # accelerate's mixed precision replaces model.forward with one that enters autocast: graphs taken before
    # it would replay fp32 kernels.
    import types

    model = build_model("tiny-gpt2", seed=4)
    graphed = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10_000))
    request = left_padded_prompts([4, 6], seed=13)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, seed=2)
    before = graphed.generate(request, sampling)
    plain = type(model).forward

    def autocast_forward(self, *args, **kwargs):
        with _autocast(True):
            return plain(self, *args, **kwargs)

    model.forward = types.MethodType(autocast_forward, model)
    try:
        after = graphed.generate(request, sampling)
        assert graphed.graph_stats.invalidations == 1 and graphed.last_stats["graph_replays"] > 0
        assert_batches_identical(after, _eager(model, request, sampling))
        assert not torch.equal(after.response_logprobs, before.response_logprobs)
    finally:
        del model.forward
    assert_batches_identical(graphed.generate(request, sampling), before)
    assert graphed.graph_stats.invalidations == 2


def test_requires_grad_toggled_after_capture_recaptures():
    """Freezing a model (a reference policy, say) changes the kernels some eager forwards pick, so a
    graph captured before must not replay after: found on tiny-opt, where the logprobs moved by an ulp."""
    model = build_model("tiny-opt").eval()
    request = left_padded_prompts([7, 5, 7], seed=0)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=0)
    rollout = HybridEngineRollout(
        model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=10_000))
    rollout.generate(request, sampling)
    rollout.generate(request, sampling)
    captures = rollout.graph_stats.captures
    model.requires_grad_(False)
    assert_batches_identical(rollout.generate(request, sampling), _eager(model, request, sampling))
    assert rollout.graph_stats.captures > captures


def test_graph_stats_enabled_says_whether_the_rollout_replays_graphs():
    model = build_model("tiny-gpt2", seed=3)
    request = left_padded_prompts([4, 3], seed=1)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    for graphs in (True, False):
        rollout = HybridEngineRollout(
            model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0, eos_token_id=10_000))
        rollout.generate(request, sampling)
        stats = rollout.graph_stats
        assert stats.enabled is graphs and (stats.captures > 0) is graphs


def test_a_class_level_kernel_patch_recaptures_and_its_graphs_go_when_it_is_undone(monkeypatch):
    """Patching a module class's forward (as Liger-style patchers do on models that exist already) changes what
    eager steps run: decode and admission graphs captured before must not replay after, and those captured
    under the patch must not outlive it."""
    model = build_model("tiny-llama", seed=3)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, max_batch_size=2,
                                                              pad_token_id=0, eos_token_id=10_000))
    request = left_padded_prompts([4, 6, 3], seed=10)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0)
    before = rollout.generate(request, sampling)
    with monkeypatch.context() as m:
        norm = type(model.model.norm)
        plain = norm.forward
        m.setattr(norm, "forward", lambda self, x: plain(self, x) * -1.0)
        patched = rollout.generate(request, sampling)
        assert_batches_identical(patched, run(model, request, sampling, graphs=False, max_batch_size=2)[0])
        assert not torch.equal(patched.input_ids, before.input_ids)
    assert_batches_identical(rollout.generate(request, sampling), before)
    assert rollout.graph_stats.invalidations == 2 and rollout.last_stats["graph_replays"] > 0


def test_a_sliding_window_set_after_the_graphs_exist_is_masked_from_the_next_call_on():
    """The masks follow the config at every call, and a changed config field recaptures the graphs (the
    fingerprint covers it): the window set on a rollout that already decoded without one gives what a new
    rollout gives (before the paged cache masked windows, it was refused)."""
    model = build_model("tiny-mistral", seed=3)
    request = left_padded_prompts([4, 6], seed=10)
    sampling = SamplingConfig(max_new_tokens=9, temperature=0.0)
    config = RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=10_000)
    for graphs in (True, False):
        rollout = HybridEngineRollout(model, config=dataclasses.replace(config, use_graph_capture=graphs))
        expected = rollout.generate(request, sampling)
        model.config.sliding_window = 4
        try:
            windowed = rollout.generate(request, sampling)
            assert_batches_identical(windowed, HybridEngineRollout(model, config=config).generate(request, sampling))
            assert not torch.equal(windowed.input_ids, expected.input_ids)  # the window changed the tokens
        finally:
            model.config.sliding_window = None
        assert_batches_identical(rollout.generate(request, sampling), expected)


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 160], ids=["growing-cache", "cache_capacity"])
def test_a_response_length_schedule_rebuilds_rarely_and_keeps_tokens(capacity):
    """``max_new_tokens`` rising by a little every call (a length curriculum): before, each new record rebuilt
    the decode buffers and dropped every graph, even with a fixed ``cache_capacity`` (the output columns were
    exactly max_new_tokens wide). The cache now grows by half at least, and output columns span the cache."""
    model = build_model("tiny-gpt2", seed=3)
    cfg = dict(max_batch_size=4, pad_token_id=0, eos_token_id=10_000, cache_capacity=capacity)
    graph = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, **cfg))
    eager = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=False, **cfg))
    request = left_padded_prompts([4, 6, 3], seed=10)
    lengths = list(range(16, 64, 4))  # 12 calls, each 4 tokens longer
    for max_new in lengths:
        sampling = SamplingConfig(max_new_tokens=max_new, temperature=0.8, n_samples_per_prompt=2, seed=max_new)
        assert_batches_identical(graph.generate(request, sampling), eager.generate(request, sampling))
    stats = graph.graph_stats
    assert stats.fallbacks == 0 and stats.replays > 0
    assert stats.invalidations <= (0 if capacity else 4), stats  # 11 before: one per call after the first


def test_a_fixed_cache_capacity_stages_prompts_at_few_widths():
    """With ``cache_capacity`` the staged width is capped by what max_new_tokens leaves; it used to be exactly
    that room, one prefill and admission graph width per max_new_tokens value."""
    model = build_model("tiny-gpt2", seed=3)
    rollout = HybridEngineRollout(model, config=RolloutConfig(
        use_graph_capture=True, max_batch_size=4, pad_token_id=0, eos_token_id=10_000, cache_capacity=300))
    request = left_padded_prompts([130, 40, 9], seed=10)  # staged at 256 where it fits, else at 192
    widths = []
    for max_new in (20, 50, 60, 70, 90):  # room for the prompts: 280, 250, 240, 230, 210
        rollout.generate(request, SamplingConfig(max_new_tokens=max_new))
        widths.append(rollout.runner.prompt_width)
    assert widths == [256, 192, 192, 192, 192]  # was [256, 250, 240, 230, 210]


def test_max_batch_size_none_caps_the_slots_at_the_default():
    """``max_batch_size=None`` once gave every request a slot: a GRPO step's thousands of requests meant a KV row
    each and a captured bucket for every 8 of them."""
    from hybrid_engine.rollout.types import DEFAULT_MAX_BATCH_SIZE

    model = build_model("tiny-gpt2", seed=3)
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=10_000))
    request = left_padded_prompts([3] * 40, seed=10)
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=2, n_samples_per_prompt=8))
    assert batch.input_ids.shape[0] == 320 > DEFAULT_MAX_BATCH_SIZE
    assert rollout.last_stats["peak_active_batch"] == DEFAULT_MAX_BATCH_SIZE == rollout.runner.slots.rows


@pytest.mark.slow
def test_a_long_varied_run_reaches_a_plateau_of_captures_and_every_graph_held_is_counted():
    """12 rollout shapes (prompt widths, samples, budgets, greedy and sampled, a reachable EOS), replayed for
    four epochs with training steps in between, so tokens, EOS times and the admission schedule change: the
    fourth epoch captures nothing (decode graphs are captured per call for every bucket and span it may reach,
    rounds for every size; a prefill shape seen once an epoch is warmed up the first time and captured the
    second, and the pool's growth in the first epoch drops what was warmed up before it), every graph the runner holds is in graph_stats, and the decode keys stay within the
    stated bound. Before, admission graphs kept being captured as the schedule followed the tokens, and no
    stat counted them."""
    model = build_model("tiny-gpt2", seed=11)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 1e-2}}})
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                               eos_token_id=7, max_batch_size=8))
    gen = torch.Generator().manual_seed(0)
    shapes = []
    for i in range(12):
        width = int(torch.randint(3, 20, (1,), generator=gen))
        lengths = torch.randint(1, width + 1, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)
        shapes.append((lengths.tolist(), SamplingConfig(
            max_new_tokens=int(torch.randint(4, 40, (1,), generator=gen)), temperature=0.0 if i % 2 else 0.9,
            n_samples_per_prompt=1 + i % 3, seed=i)))
    epochs = []
    for _ in range(4):
        for i, (lengths, sampling) in enumerate(shapes):
            batch = rollout.generate(left_padded_prompts(lengths, seed=i), sampling)
            s = rollout.graph_stats
            assert s.graph_keys + s.admission_graph_keys == len(rollout.runner.graph_keys)  # nothing held uncounted
            assert rollout.runner.ledger.in_use == 0  # a call gives back every page it took
            engine.train()
            loss = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          labels=batch.input_ids).loss
            engine.backward(loss)
            engine.step()
            engine.eval()
        epochs.append(s.captures + s.admission_captures)
    assert epochs[0] > 0 and epochs[2] == epochs[3], epochs  # the plateau
    modes = 2  # greedy and sampled (top-k 50, as SamplingConfig defaults)
    assert s.graph_keys <= modes * s.graph_key_bound and s.fallbacks == 0
