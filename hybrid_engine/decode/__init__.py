"""What one decode step does on the device: the KV cache, prefill and one-token steps, sampling, slots, staging.

Everything a step changes lives in device tensors updated in place, so the step
can be captured once and replayed (:mod:`hybrid_engine.graphs`).
"""
