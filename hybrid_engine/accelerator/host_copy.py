"""Small host-built tensors onto the device without a hidden sync, and device values back to the host with one wait.

Host to device (page-table entries, admission rows, slot indices):

A copy from pageable host memory waits for every kernel already queued on the stream (the driver stages it
through a bounce buffer), so each one would stall the host behind the replay queued before it. From pinned
memory with ``non_blocking=True`` the copy is queued in stream order like any kernel, and the caching host
allocator keeps the pinned block until the copy has run, so the host tensor may go out of scope at once.

Where the device is the CPU nothing is copied. Where pinned memory is not available, the copy is pageable and
counted in the caller's ``host_syncs``. Never called during a capture: capture freezes device addresses, and
these tensors are new ones (the graphs read them only after they are copied into the runner's buffers).

Device to host (the scheduler's finish flags, :func:`read_to_host`): the copy is queued behind the work already
on the stream into pinned memory, ``non_blocking``, with an event recorded after it, and the host may go on
planning while the device runs; the values are handed out only by :meth:`PendingRead.wait`, which waits for the
event. Reading them before the wait is impossible by construction (the pending read holds the only reference to
the host buffer until then), on every backend: the CPU, whose copies are done at once, keeps the same discipline
as CUDA, where a read before the wait sees whatever the buffer held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["CountsHostSyncs", "PendingRead", "device_tensor", "host_to_device", "read_to_host"]


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


class PendingRead:
    """A device-to-host copy in flight (:func:`read_to_host`): :meth:`wait` once for its host tensor."""

    __slots__ = ("_event", "_host")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self._host: torch.Tensor | None = host
        self._event = event

    def wait(self) -> torch.Tensor:
        """Wait for the copy (its event) and return the host tensor; one wait per read."""
        host, self._host = self._host, None
        if host is None:
            raise RuntimeError("PendingRead.wait: this read was already waited for (one wait per read)")
        if self._event is not None:
            self._event.synchronize()
        return host


def read_to_host(values: torch.Tensor, accelerator: Any) -> PendingRead:
    """Queue a copy of the device tensor ``values`` to the host behind the work already issued on the current
    stream, without waiting for it; :meth:`PendingRead.wait` waits once. ``accelerator`` (made current on
    ``values``' device by the caller) gives the event; where it has none, or no pinned memory, the copy blocks
    here instead (still one wait per read). On the CPU the copy is a clone (later writes to ``values`` must not
    show through), and its event's wait is checked as CUDA's is (refused inside a capture)."""
    event = accelerator.Event()
    if values.device.type == "cpu":
        host = values.clone()
    else:
        try:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=event is not None)
        except RuntimeError:  # no pinned host memory: a pageable copy waits for the queue
            event, host = None, torch.empty(values.shape, dtype=values.dtype)
        host.copy_(values, non_blocking=event is not None)
    if event is not None:
        event.record()
    return PendingRead(host, event)
