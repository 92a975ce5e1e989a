"""How much memory a device has free right now, asked of the device itself (never inferred from its name).

For an accelerator, ``torch.<type>.mem_get_info`` (CUDA, XPU, NPU, ...): what the driver reports free, which
counts other processes and what the caching allocator has not returned. For the CPU, the kernel's
``MemAvailable`` (what can be allocated without swapping). ``None`` where neither is known.
"""

from __future__ import annotations

import torch

__all__ = ["free_memory"]


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_memory(device: torch.device | str) -> int | None:
    """Bytes ``device`` has free now, or ``None`` where unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        return _host_available()
    info = getattr(getattr(torch, device.type, None), "mem_get_info", None)
    if not callable(info):
        return None
    try:
        return int(info(device)[0])
    except (RuntimeError, TypeError, ValueError, AssertionError):  # no such device here, or a stub without one
        return None
