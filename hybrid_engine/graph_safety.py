"""What a captured decode graph silently depends on, checked or neutralised around capture.

A graph reads every weight by address, so a parameter or buffer that is
re-allocated (``load_state_dict(assign=True)``, ``.to(dtype)``, a LoRA merge)
would be read stale by later replays: :func:`weight_fingerprint` records the
addresses a capture saw, and owners compare it before replaying. Forward
hooks run Python that a graph cannot record (and may synchronise with the
host): :func:`suspended_hooks` detaches them while capturing; replay runs no
Python, so hooks never run in graphed decode steps either way.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch

__all__ = ["suspended_hooks", "weight_fingerprint"]


def weight_fingerprint(model: torch.nn.Module) -> tuple:
    """(name, address, dtype, shape, device) of every parameter and buffer: changes when any is re-allocated."""
    return tuple(
        (name, t.data_ptr(), t.dtype, tuple(t.shape), str(t.device))
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
    )


@contextlib.contextmanager
def suspended_hooks(model: torch.nn.Module) -> Iterator[None]:
    """Detach every module's forward (pre-)hooks for the duration of the block, then restore them."""
    saved = []
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks"):
            hooks = getattr(m, attr, None)
            if hooks:
                saved.append((m, attr, hooks))
                setattr(m, attr, OrderedDict())
    try:
        yield
    finally:
        for m, attr, hooks in saved:
            setattr(m, attr, hooks)
