"""Tensors carved out of one byte range that never moves: what releasable storage (host mmap, CUDA VMM) shares.

Why: an arena's owner drops and takes back its physical memory at the same addresses, so captured graphs that
read the tensors stay valid. Carving the tensors (aligned offsets, zero-filled, remembered for the refill on
wake) is the same whatever backs the range; only releasing and restoring differ (the subclasses).
"""

from __future__ import annotations

import math

import torch

__all__ = ["ALIGN", "Arena"]

ALIGN = 64  # bytes: every tensor carved from an arena starts on a cache line


class Arena:
    """A byte tensor ``_bytes`` of ``nbytes`` at a fixed address, carved into tensors by :meth:`take`. Subclasses
    set ``_bytes`` and ``nbytes`` and implement ``release`` and ``restore``."""

    nbytes: int
    _bytes: torch.Tensor

    def __init__(self) -> None:
        self._used = 0
        self._tensors: list[torch.Tensor] = []
        #: Whether the physical memory is given back (nothing may read the tensors until ``restore``).
        self.released = False

    @staticmethod
    def bytes_for(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Bytes an arena needs to :meth:`take` every ``(shape, dtype)`` of ``shapes`` in order."""
        used = 0
        for shape, dtype in shapes:
            used = -(-used // ALIGN) * ALIGN + math.prod(shape) * dtype.itemsize
        return used

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next ``shape``/``dtype`` tensor of the arena, zero-filled (its memory is touched: resident)."""
        size = math.prod(shape) * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if start + size > self.nbytes:
            raise ValueError(f"{type(self).__name__}: {size} bytes at offset {start} do not fit in {self.nbytes} bytes")
        self._used = start + size
        t = self._bytes[start:start + size].view(dtype).view(shape)
        t.zero_()
        self._tensors.append(t)
        return t

    def refill(self) -> None:
        """After a restore: every floating tensor NaN, the others zero (an owner that forgets to re-zero fails)."""
        for t in self._tensors:
            t.fill_(float("nan") if t.is_floating_point() else 0)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors taken, in order."""
        return list(self._tensors)
