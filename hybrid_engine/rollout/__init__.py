"""Continuous RL rollouts with captured, reused decode graphs and in-graph sampling.

Modules: :mod:`.types` (validated configs, request and batch), :mod:`.rollout`
(``HybridEngineRollout``) and :mod:`.episodes` (multi-turn episodes). The decode slots, the scheduler and the graph runner
are shared with ``engine.generate``: :mod:`hybrid_engine.decode.slots`,
:mod:`hybrid_engine.generation.scheduler`, :mod:`hybrid_engine.graphs.runner`.
"""

from hybrid_engine.rollout.episodes import EpisodeBatch, Episodes
from hybrid_engine.rollout.rollout import HybridEngineRollout, UnsupportedModelError
from hybrid_engine.rollout.types import RolloutBatch, RolloutConfig, RolloutRequest, SamplingConfig

__all__ = [
    "EpisodeBatch",
    "Episodes",
    "HybridEngineRollout",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutRequest",
    "SamplingConfig",
    "UnsupportedModelError",
]
