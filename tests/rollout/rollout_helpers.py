"""Helpers for the rollout tests: tiny seeded models, left-padded prompts, runners."""

from __future__ import annotations

import torch
from sampled_close import assert_rollouts_sampled_close

from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

ARCHS = ("tiny-gpt2", "tiny-opt", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
NO_EOS = 10_000  # an id outside the tiny vocab: never sampled


_MODELS: dict[str, torch.nn.Module] = {}


def shared_model(name: str) -> torch.nn.Module:
    """A cached tiny model for tests that do not modify weights."""
    if name not in _MODELS:
        _MODELS[name] = build_model(name, seed=0)
    return _MODELS[name]


def rss_anon() -> int:
    """This process's resident anonymous memory in bytes (what a released private mapping gives back)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def left_padded_prompts(lengths: list[int], seed: int = 0, pad: int = 0) -> RolloutRequest:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(lengths), width), dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(4, 384, (n,), generator=gen)
        mask[i, width - n :] = 1
    return RolloutRequest(ids, mask)


def run(model, request, sampling: SamplingConfig, *, graphs: bool, eos=NO_EOS, **config):
    rollout = HybridEngineRollout(
        model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0, eos_token_id=eos, **config)
    )
    batch = rollout.generate(request, sampling)
    return batch, rollout.last_stats


def responses(batch) -> list[list[int]]:
    """Real response tokens per row."""
    out = []
    for row, n in zip(batch.input_ids[:, batch.response_start_idx :], batch.response_lengths.tolist()):
        out.append(row[:n].tolist())
    return out


def assert_batches_identical(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.response_lengths, b.response_lengths)
    assert torch.equal(a.response_logprobs, b.response_logprobs)
    assert a.response_start_idx == b.response_start_idx


def assert_same_tokens(a, b, atol: float = 1e-5) -> None:
    """Identical tokens, logprobs equal to ``atol``: for two runs of the same numerics (graph replay and eager of
    the same steps, the same call again, the same batch shapes), where equal tokens are the project's guarantee."""
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.response_lengths, b.response_lengths)
    torch.testing.assert_close(a.response_logprobs, b.response_logprobs, rtol=0, atol=atol)


def assert_same_samples(a, b, *, model, sampling: SamplingConfig, request: RolloutRequest | None = None,
                        atol: float = 1e-5) -> list[int]:
    """The same request run two numerically different ways (other batch compositions or shapes, preemption and a
    prefill again, shared or per-sample prompt pages): their logprobs may differ in the last float bits, so a
    sampled (or greedy) token may flip where the draw lies within that noise of a boundary, on some CPU. Compared
    as ``sampled_close`` compares such paths (issue 38): equal tokens with logprobs equal to ``atol``, or at a
    row's first difference a flip that float noise can make (teacher-forced on ``model``), not compared past it;
    where no row differs, the batches are equal as a whole. ``sampling`` (and ``request``'s per-prompt values)
    give each row's temperature, top-p and top-k. Returns each row's first difference."""
    assert sampling.logprobs == "sampling", "compares logprobs under the distribution sampled from"
    settings = None if request is None else request.settings(sampling)
    return assert_rollouts_sampled_close(model, a, b, temperature=sampling.temperature, top_p=sampling.top_p,
                                         top_k=sampling.top_k, settings=settings, atol=atol)
