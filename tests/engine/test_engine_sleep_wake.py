"""Issue 41: the engine's memory hand-off. ``engine.sleep``/``wake``/``sleeping_tags`` reach the page pools of
``generate`` and of every rollout on the model, and (``"optimizer"``, stage 0) the optimizer's states and fp32
masters: training with a hand-off between every step is bit-identical to training without, no parameter moves,
and the calls that need what sleeps wake it themselves (counted)."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine import initialize
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

NO_EOS = 10_000


def _engine(dtype: str | None = "bf16", graphs: bool = True):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "hybrid_engine": {"enable_graph_capture": graphs}}
    if dtype is not None:
        config[dtype] = {"enabled": True}
    engine, *_ = initialize(model=build_model("tiny-llama", seed=3), config=config)
    return engine


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(4, 300, (2, 7), generator=torch.Generator().manual_seed(seed))


def _train(engine, steps: int, between=None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    losses = []
    for s in range(steps):
        ids = _ids(s)
        engine.train()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
        if between is not None:
            between(s)
    return losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("dtype", ["bf16", None])
def test_optimizer_sleep_between_steps_trains_bit_identically_and_moves_no_parameter(dtype):
    reference_losses, reference = _train(_engine(dtype), 4)
    engine = _engine(dtype)
    pointers = {n: p.data_ptr() for n, p in engine.module.named_parameters()}
    woken = []

    def between(step: int) -> None:
        engine.sleep(["optimizer"])
        assert engine.sleeping_tags == {"optimizer"}
        assert engine.handoff_stats.optimizer_bytes > 0  # states (and masters under bf16) went to the host
        if step % 2:
            engine.wake(["optimizer"])  # asked for; otherwise backward wakes it
        woken.append(step)

    losses, weights = _train(engine, 4, between)
    for a, b in zip(losses, reference_losses):
        assert torch.equal(a, b)
    for name, w in weights.items():
        assert torch.equal(w, reference[name]), name
    assert {n: p.data_ptr() for n, p in engine.module.named_parameters()} == pointers
    # Steps 0 and 2 left it asleep: the next backward woke it; steps 1 and 3 woke it with wake().
    assert engine.handoff_stats.optimizer_wakes == 2
    assert engine.sleeping_tags == frozenset()
    engine.sleep("optimizer")
    engine.wake()
    assert engine.sleeping_tags == frozenset()


def test_engine_sleep_reaches_generate_and_every_rollout_and_calls_wake_them():
    engine = _engine()
    ids = _ids(9)
    mask = torch.ones_like(ids)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=0, pad_token_id=0,
               eos_token_id=NO_EOS)
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                               eos_token_id=NO_EOS, max_batch_size=2))
    request = RolloutRequest(ids, mask)
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, seed=5)
    for _ in range(3):
        torch.manual_seed(0)
        out = engine.generate(**gen)
        batch = rollout.generate(request, sampling)
    engine.sleep()
    assert engine.generate_runner.sleeping and rollout.runner.sleeping
    tags = engine.sleeping_tags
    assert tags == {"kv_cache"} and "graphs" in tags.kept
    torch.manual_seed(0)
    assert torch.equal(engine.generate(**gen), out)
    assert engine.last_stats["wakes"] == 1 and engine.last_stats["graph_captures"] == 0
    assert rollout.runner.sleeping  # a generate wakes only its own pool
    again = rollout.generate(request, sampling)
    assert rollout.last_stats["wakes"] == 1 and rollout.last_stats["graph_captures"] == 0
    assert torch.equal(again.input_ids, batch.input_ids)
    assert engine.handoff_stats.kv_cache_wakes == 2
    assert engine.sleeping_tags == frozenset()


def test_bad_sleep_requests_are_refused_and_the_engine_stays_usable():
    engine = _engine()
    with pytest.raises(ValueError, match="unknown tag 'weights'"):
        engine.sleep("weights")
    bare, *_ = initialize(model=build_model("tiny-llama", seed=3), config={})
    with pytest.raises(ValueError, match="no optimizer"):
        bare.sleep(["kv_cache", "optimizer"])
    assert bare.sleeping_tags == frozenset()  # refused before anything slept
    _train(engine, 1)


def _rl_loop(engine, rollout, steps: int = 3):
    """Generate with the engine and the rollout, then train on it, ``steps`` times; every output and loss."""
    outs, losses = [], []
    ids = _ids(4)
    mask = torch.ones_like(ids)
    request, sampling = RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4, temperature=1.0, seed=2)
    for s in range(steps):
        torch.manual_seed(s)
        outs.append(engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=0,
                                    pad_token_id=0, eos_token_id=NO_EOS))
        outs.append(rollout.generate(request, sampling).input_ids)
        asleep = engine.sleeping_tags
        engine.train()
        loss = engine(input_ids=outs[-1], labels=outs[-1]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return outs, losses, asleep


def _phase_engine(**he):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
              "hybrid_engine": {"enable_graph_capture": True, **he}}
    engine, *_ = initialize(model=build_model("tiny-llama", seed=3), config=config)
    rollout = HybridEngineRollout(engine, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                               eos_token_id=NO_EOS, max_batch_size=2))
    return engine, rollout


def test_sleep_between_phases_gives_the_same_rl_loop_and_captures_nothing_more():
    plain_engine, plain_rollout = _phase_engine()
    plain_outs, plain_losses, plain_asleep = _rl_loop(plain_engine, plain_rollout)
    engine, rollout = _phase_engine(sleep_between_phases=True)
    outs, losses, asleep = _rl_loop(engine, rollout)
    assert plain_asleep == frozenset()
    assert asleep == {"kv_cache", "optimizer"}  # after the rollouts: both pools asleep, the optimizer too
    for a, b in zip(outs, plain_outs):
        assert torch.equal(a, b)
    for a, b in zip(losses, plain_losses):
        assert torch.equal(a, b)
    for (n, p), q in zip(engine.module.named_parameters(), plain_engine.module.named_parameters()):
        assert torch.equal(p, q[1]), n
    assert engine.graph_stats.captures == plain_engine.graph_stats.captures
    assert rollout.graph_stats.captures == plain_rollout.graph_stats.captures
    stats = engine.handoff_stats
    assert stats.optimizer_wakes == 3  # each training step woke it
    assert stats.kv_cache_wakes == 4  # the engine's and the rollout's pools, woken by calls 2 and 3
    assert engine.sleeping_tags == {"kv_cache"}  # training woke the optimizer; the pools sleep on


def test_release_inference_cache_is_the_hand_off_with_graphs_kept():
    engine, rollout = _phase_engine(release_inference_cache=True)
    plain_engine, plain_rollout = _phase_engine()
    outs, _, asleep = _rl_loop(engine, rollout, steps=3)
    plain_outs, _, _ = _rl_loop(plain_engine, plain_rollout, steps=3)
    for a, b in zip(outs, plain_outs):
        assert torch.equal(a, b)
    assert asleep == {"kv_cache"}  # the optimizer is not part of release_inference_cache
    assert engine.graph_stats.captures == plain_engine.graph_stats.captures > 0
    assert engine.graph_stats.last_refusal_reason is None and engine.last_stats["wakes"] == 1


def test_engine_sleep_releases_the_rings_of_generate_and_reports_what_it_holds():
    """Windowed layers whose rows reach past twice the window keep rings beside the pages: ``"kv_cache"`` releases
    them with the pool (the held memory reported falls by their bytes), and the next generate, woken by the call,
    gives the same tokens and captures nothing."""
    engine, *_ = initialize(model=build_model("tiny-mistral", seed=3, sliding_window=8),
                            config={"hybrid_engine": {"enable_graph_capture": True}})
    ids = _ids(9)
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=True, top_k=0,
               pad_token_id=0, eos_token_id=NO_EOS)
    for _ in range(3):
        torch.manual_seed(0)
        out = engine.generate(**gen)
    buffers = engine.generate_runner.buffers
    stores = buffers.state_stores()
    rings = sum(s.nbytes() for s in stores)
    assert stores and all(k[0] == "ring" for s in stores for k in s.tensors) and rings > 0
    held = engine.graph_stats.cache_memory_bytes
    engine.sleep()
    assert all(s.asleep for s in stores) and engine.sleeping_tags == {"kv_cache"}
    assert engine.graph_stats.cache_memory_bytes == held - rings - buffers.kv_pool.page_bytes * \
        buffers.kv_pool.num_pages
    torch.manual_seed(0)
    assert torch.equal(engine.generate(**gen), out)
    assert engine.last_stats["wakes"] == 1 and engine.last_stats["graph_captures"] == 0
    assert not any(s.asleep for s in stores) and engine.graph_stats.cache_memory_bytes == held
