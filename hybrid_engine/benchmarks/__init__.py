"""``hybrid-engine bench``: the reference's tables, eager and graph measured side by side in one run.

Sub-benchmarks (one module each): :mod:`.decode`, :mod:`.rlhf`, :mod:`.continuous`,
:mod:`.overhead`, :mod:`.memory`, :mod:`.exact`, :mod:`.multiturn`, :mod:`.handoff`, :mod:`.parity` (the token-identity check the GPU script runs) and
:mod:`.soak` (a long run: memory and captures must stay flat). Each has ``add_arguments(parser)`` and ``run(args) -> dict``
(the JSON payload); shared helpers live in :mod:`.common`.
"""

from __future__ import annotations

import importlib

SUBCOMMANDS = {
    "decode": "ms per decode step and tok/s over batch sizes, engine and rollout paths, eager vs graph",
    "rlhf": "RLHF-style iteration (eval, generate, train, step): phase table, peak memory, capture cost",
    "continuous": "continuous rollouts: eager vs graph reuse latency; continuous vs static batching",
    "overhead": "our eager generate vs transformers' model.generate on the same inputs (ratio <= 1.05)",
    "parity": "graph vs eager tokens on the engine and rollout paths, greedy and sampled (exit 1 on mismatch)",
    "soak": "a long RL run (rollout + train, graphs on): memory and captures over time must stay flat",
    "memory": "decode ms/step and K/V pages/bytes against cache_capacity, vs transformers' caches",
    "exact": "exact_logprobs vs default: rollout and train-step time, rollout-vs-train and batch-composition drift",
    "kernels": "device ops per layer and per step and K/V bytes of one decode step, ours vs transformers",
    "multiturn": "tool-use episodes: K/V kept between turns vs re-prefilled vs transformers generate per turn",
    "handoff": "memory hand-off: an RL loop with and without sleep_between_phases, memory per phase, sleep/wake",
}


def module(name: str):
    """The benchmark module for ``name`` (imported lazily: torch/transformers load only when needed)."""
    if name not in SUBCOMMANDS:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")
