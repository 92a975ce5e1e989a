"""What the decode ops' capability probes share: the device a probe result is cached under.

Why: each op module chooses its implementation per device by running its kernels there once (never by device
name) and caches the answer. ``"cuda"`` and ``"cuda:0"`` must share one answer (and one probe run), and the CPU
has no index, so a probe is keyed by :func:`probe_device`.
"""

from __future__ import annotations

import torch

__all__ = ["probe_device"]


def probe_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index (``0`` where none is given), except the CPU, which has none."""
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        device = torch.device(device.type, 0)
    return device
