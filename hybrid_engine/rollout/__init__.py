"""Continuous RL rollouts with captured, reused decode graphs and in-graph sampling.

Modules: :mod:`.types` (validated configs, request and batch), :mod:`.decode_graph`
(per-bucket device state and the captured decode step), :mod:`.scheduler` (slots,
admission, shared prefill, harvest) and :mod:`.engine` (``HybridEngineRollout``).
"""

from .engine import HybridEngineRollout, UnsupportedModelError
from .types import RolloutBatch, RolloutConfig, RolloutRequest, SamplingConfig

__all__ = [
    "HybridEngineRollout",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutRequest",
    "SamplingConfig",
    "UnsupportedModelError",
]
