"""DeepSpeed-style engine configuration: the schema (:mod:`.schema`) and its loading (:mod:`.loading`)."""

from hybrid_engine.config.loading import ConfigSource, load_config
from hybrid_engine.config.schema import EngineConfig, HybridEngineConfig

__all__ = ["ConfigSource", "EngineConfig", "HybridEngineConfig", "load_config"]
