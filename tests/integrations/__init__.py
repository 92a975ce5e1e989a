"""Tests of ``hybrid_engine.integrations`` (TRL, PEFT, DeepSpeed); each module skips when its library is missing."""
