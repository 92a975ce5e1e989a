"""hybrid-engine: train a causal LM and generate its RL rollouts in one engine, with graph-captured decode."""

from hybrid_engine.accelerator import get_accelerator, set_accelerator
from hybrid_engine.decode import npu_attention  # noqa: F401  (registers attn_implementation "npu_graph" with transformers)
from hybrid_engine.decode.sampling import logprobs_of
from hybrid_engine.engine import GraphStats, HybridEngine, initialize
from hybrid_engine.exact import exact_forward
from hybrid_engine.rollout import (
           HybridEngineRollout,
           RolloutBatch,
           RolloutConfig,
           RolloutRequest,
           SamplingConfig,
)

__version__ = "0.1.0"

__all__ = ["get_accelerator", "set_accelerator", "__version__", "GraphStats", "HybridEngine", "initialize",
           "HybridEngineRollout", "RolloutBatch", "RolloutConfig", "RolloutRequest", "SamplingConfig", "exact_forward", "logprobs_of"]
