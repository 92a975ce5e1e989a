"""What the decode ops' capability probes share: the device a probe result is cached under, and the rule that
a probe never runs inside a capture.

Why: each op module chooses its implementation per device by running its kernels there once (never by device
name) and caches the answer. ``"cuda"`` and ``"cuda:0"`` must share one answer (and one probe run), and the CPU
has no index, so a probe is keyed by :func:`probe_device`. A probe compares results on the host: inside a capture
that read fails, the failure would read as "no kernel here" and be cached for the process, so a probe asked for
first while capturing refuses (:func:`refuse_while_capturing`).
"""

from __future__ import annotations

import torch

from hybrid_engine.accelerator import is_capturing

__all__ = ["probe_device", "refuse_while_capturing"]


def probe_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index (``0`` where none is given), except the CPU, which has none."""
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        device = torch.device(device.type, 0)
    return device


def refuse_while_capturing(module: str, device: torch.device) -> None:
    """Raise when ``module``'s probe for ``device`` runs for the first time while a graph is capturing (call
    ``implementation(device)`` or run the op once before capturing)."""
    if is_capturing():
        raise RuntimeError(f"{module}: the implementation for {device} was first asked for while a graph was "
                           f"capturing; call hybrid_engine.decode.ops.{module}.implementation(device) (or run the "
                           "ops once) before capturing")
