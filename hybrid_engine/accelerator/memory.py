"""How much memory a device has, in all and free right now, asked of the device itself (never inferred from its
name).

For an accelerator, ``torch.<type>.mem_get_info`` (CUDA, XPU, NPU, ...): the total, and what the driver reports
free, which counts other processes and what the caching allocator has not returned. For the CPU, the host's
physical memory and the kernel's ``MemAvailable`` (what can be allocated without swapping). ``None`` where
unknown.
"""

from __future__ import annotations

import os

import torch

__all__ = ["device_memory", "free_memory"]


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mem_get_info(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes from ``torch.<type>.mem_get_info``, or ``None``."""
    info = getattr(getattr(torch, device.type, None), "mem_get_info", None)
    if not callable(info):
        return None
    try:
        free, total = info(device)
    except (RuntimeError, TypeError, ValueError, AssertionError):  # no such device here, or a stub without one
        return None
    return int(free), int(total)


def free_memory(device: torch.device | str) -> int | None:
    """Bytes ``device`` has free now, or ``None`` where unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        return _host_available()
    info = _mem_get_info(device)
    return None if info is None else info[0]


def device_memory(device: torch.device | str) -> int | None:
    """Bytes of memory ``device`` has in all, or ``None`` where unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
            return None
    info = _mem_get_info(device)
    return None if info is None else info[1]
