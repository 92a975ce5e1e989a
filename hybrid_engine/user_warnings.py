"""Warnings that point at the user's line, not at ours or pydantic's.
"""

from __future__ import annotations

import sys

__all__ = ["user_stacklevel"]


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for its caller, of the first frame outside hybrid_engine and pydantic.

    A warning raised while a config is validated then points at the user's line, not at pydantic's, whichever
    entry point (``initialize``, ``load_config``, a model constructor) led there.
    """
    frame = sys._getframe(1)  # the caller, which warns: stacklevel 1
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("hybrid_engine",
                                                                                          "pydantic"):
        frame = frame.f_back
        level += 1
    return level
