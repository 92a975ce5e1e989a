"""Continuous RL rollouts with captured, reused decode graphs and in-graph sampling.

Modules: :mod:`.types` (validated configs, request and batch) and :mod:`.engine`
(``HybridEngineRollout``). The decode slots, the scheduler and the graph runner
are shared with ``engine.generate``: :mod:`hybrid_engine.decode_state`,
:mod:`hybrid_engine.scheduler`, :mod:`hybrid_engine.graph_runner`.
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
