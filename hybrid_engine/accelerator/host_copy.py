"""Small host-built tensors (page-table entries, admission rows, slot indices) onto the device without a hidden sync.

A copy from pageable host memory waits for every kernel already queued on the stream (the driver stages it
through a bounce buffer), so each one would stall the host behind the replay queued before it. From pinned
memory with ``non_blocking=True`` the copy is queued in stream order like any kernel, and the caching host
allocator keeps the pinned block until the copy has run, so the host tensor may go out of scope at once.

Where the device is the CPU nothing is copied. Where pinned memory is not available, the copy is pageable and
counted in the caller's ``host_syncs``. Never called during a capture: capture freezes device addresses, and
these tensors are new ones (the graphs read them only after they are copied into the runner's buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class CountsHostSyncs(Protocol):
    host_syncs: int


def device_tensor(values: Sequence[Any], device: torch.device, dtype: torch.dtype = torch.int64,
                  counters: CountsHostSyncs | None = None) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, copied from pinned memory without waiting for the
    stream; a pageable copy where pinning is not available, counted in ``counters.host_syncs``."""
    return host_to_device(torch.tensor(values, dtype=dtype), device, counters)


def host_to_device(host: torch.Tensor, device: torch.device, counters: CountsHostSyncs | None = None) -> torch.Tensor:
    """A host tensor built by the caller onto ``device``, as :func:`device_tensor` copies its values."""
    if device.type == "cpu":
        return host
    try:
        host = host.pin_memory()
    except RuntimeError:  # no pinned host memory for this accelerator: the copy waits for the queue
        if counters is not None:
            counters.host_syncs += 1
        return host.to(device)
    return host.to(device, non_blocking=True)
