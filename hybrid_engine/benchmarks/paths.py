"""The two generation paths the benchmarks drive, behind one small interface.

* engine path: ``hybrid_engine.initialize(...)`` then ``engine.generate`` with a
  pinned length (``min_new_tokens == max_new_tokens``), greedy; per-position
  decode graphs when ``enable_graph_capture`` is on.
* rollout path: ``HybridEngineRollout(model).generate(RolloutRequest, SamplingConfig)``
  with continuous batching; decode graphs per batch bucket when
  ``use_graph_capture`` is on. EOS is set to an id outside the vocabulary so
  every row generates exactly ``new_tokens`` tokens (a pinned length, as in the
  reference benchmarks), unless a caller passes a real EOS.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig, initialize
from hybrid_engine.benchmarks.common import precision_config


def engine_config(*, graphs: bool, max_out_tokens: int, batch_size: int, dtype: torch.dtype,
                  lr: float = 1e-5, zero_stage: int = 0, inference_copy: bool | None = None) -> dict[str, Any]:
    """``inference_copy`` ``None``: the key left out, so at ZeRO-3 graphs imply the gathered inference copy."""
    copy = {} if inference_copy is None else {"zero3_gathered_inference_copy": inference_copy}
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        **precision_config(dtype),
        # ``enabled`` is left to follow the graphs: given explicitly it is DeepSpeed's switch, which also routes the
        # model's own generate and prints DeepSpeed's per-iteration latency line at every eval().
        "hybrid_engine": {"max_out_tokens": max_out_tokens, "enable_graph_capture": graphs, **copy},
    }


def make_engine(model: torch.nn.Module, *, graphs: bool, max_out_tokens: int, batch_size: int,
                dtype: torch.dtype, lr: float = 1e-5, zero_stage: int = 0, inference_copy: bool | None = None):
    engine, *_ = initialize(
        model=model, optimizer=None,
        config=engine_config(graphs=graphs, max_out_tokens=max_out_tokens, batch_size=batch_size, dtype=dtype, lr=lr,
                             zero_stage=zero_stage, inference_copy=inference_copy),
    )
    return engine


def engine_generate(engine: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Pinned-length greedy generation; returns only the new tokens ``[B, new_tokens]``."""
    engine.eval()
    out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)
    return out[:, ids.shape[1]:]


def unreachable_eos(model: torch.nn.Module) -> int:
    """A token id no model output can produce: pins rollout lengths to ``max_new_tokens``."""
    return int(model.config.vocab_size) + 7


def make_rollout(model_or_engine: Any, *, graphs: bool, pad_token_id: int, eos_token_id: int | tuple[int, ...],
                 continuous: bool = True, max_batch_size: int | None = None, graph_batch_sizes=None,
                 cache_capacity: int | None = None):
    cfg = RolloutConfig(
        use_graph_capture=graphs, continuous_batching=continuous, max_batch_size=max_batch_size,
        cache_capacity=cache_capacity, graph_batch_sizes=graph_batch_sizes,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id,
    )
    return HybridEngineRollout(model_or_engine, config=cfg)


def rollout_generate(rollout: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *,
                     temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, n_samples: int = 1,
                     budgets: list[int] | None = None) -> Any:
    req = RolloutRequest(ids, mask, max_new_tokens=budgets)
    sc = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                                      n_samples_per_prompt=n_samples, seed=seed)
    return rollout.generate(req, sc)


def rollout_tokens(batch: Any) -> torch.Tensor:
    """The response tokens ``[R, L]`` of a rollout batch (padding included)."""
    return batch.input_ids[:, batch.response_start_idx:]


def graph_counts(obj: Any) -> dict[str, Any]:
    """Capture/replay counters of an engine (``graph_stats``) or a rollout (``last_stats``)."""
    stats = getattr(obj, "graph_stats", None)
    if stats is not None:
        d = stats.to_dict() if hasattr(stats, "to_dict") else dict(vars(stats))
        return {"captures": d.get("captures"), "replays": d.get("replays"), "fallbacks": d.get("fallbacks"),
                "capture_seconds": d.get("capture_seconds"), "graph_memory_bytes": d.get("graph_memory_bytes"),
                "refusal": d.get("last_refusal_reason")}
    last = getattr(obj, "last_stats", None) or {}
    return {"captures": last.get("graph_captures"), "replays": last.get("graph_replays"),
            "fallbacks": last.get("fallbacks"), "refusal": last.get("last_refusal_reason")}
