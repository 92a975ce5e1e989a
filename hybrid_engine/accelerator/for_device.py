"""The accelerator that owns a given device, and whether any of them is capturing.

Graphs are captured by the accelerator of the model's device, not by the
process-wide one: a CPU model on a host with a GPU must never get CUDA graphs
wrapped around CPU work. Capture-sensitive code (the paged KV cache, the decode
step) asks :func:`is_capturing`, which covers every accelerator handed out here.
"""

from __future__ import annotations

import torch

from hybrid_engine.accelerator.base import Accelerator

__all__ = ["accelerator_for", "is_capturing"]

_other: dict[str, Accelerator] = {}  # device type -> accelerator, for devices other than the process one


def accelerator_for(device: torch.device | str) -> Accelerator:
    """The process accelerator when ``device`` is its device type, else one built for ``device``'s type."""
    from hybrid_engine.accelerator import build_accelerator, get_accelerator

    kind = torch.device(device).type
    process = get_accelerator()
    if process.device().type == kind:
        return process
    acc = _other.get(kind)
    if acc is None:
        acc = _other[kind] = build_accelerator(kind)
    return acc


def is_capturing() -> bool:
    """True while any accelerator (the process one or one from :func:`accelerator_for`) is capturing."""
    from hybrid_engine.accelerator import get_accelerator

    return get_accelerator().is_current_stream_capturing() or any(
        acc.is_current_stream_capturing() for acc in _other.values()
    )
