"""The two test tiers: ``./run.sh test`` runs everything (CI), ``./run.sh test -m "not slow"`` the everyday tier.

Why: the whole suite takes about 18 minutes on 2 cores, too long to run after every change. Tests that launch
processes or ranks, and the long sweeps, are marked ``slow``; a parametrized test keeps its first cases in the
fast tier, so every path it checks still runs there on one model, and the rest of its matrix runs in CI.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

__all__ = ["fast_first"]


def fast_first(values: Iterable[Any], keep: int = 1) -> list[Any]:
    """``values`` for ``pytest.mark.parametrize``: the first ``keep`` as they are, the rest marked ``slow``."""
    out = []
    for i, value in enumerate(values):
        if i < keep:
            out.append(value)
        elif isinstance(value, type(pytest.param(None))):
            out.append(pytest.param(*value.values, id=value.id, marks=[*value.marks, pytest.mark.slow]))
        else:
            out.append(pytest.param(value, marks=pytest.mark.slow))
    return out
