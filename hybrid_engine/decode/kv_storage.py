"""Decode storage (the page pool, rings and linear states) that can drop its physical memory and take it back at the same addresses.

Why: captured graphs read the pool by address. Freeing the pool's tensors and
allocating new ones between rollouts would invalidate every graph (a recapture
per bucket and span on wake); keeping the virtual range and dropping only the
physical pages keeps every graph valid, as vLLM's and SGLang's sleep modes do
with CUDA VMM (``cuMemUnmap``/``cuMemMap`` at the same address).

On the CPU the storage is a private anonymous mapping (:class:`HostArena`):
``madvise(MADV_DONTNEED)`` returns its pages to the OS (RssAnon falls) and the
next touch maps fresh zero pages at the same virtual addresses. The tensors
wrapping it (``torch.frombuffer``) never move. Released storage is marked
(:attr:`HostArena.released`); its owner refuses any step that would read it,
because zeros read from a released page would hide the bug (CUDA faults there).
On wake the whole arena is filled with NaN, so anything that relies on contents
kept across a sleep, or on a page nobody re-zeroed, fails visibly.

On CUDA, where ``cuda-bindings`` is installed and its probe passes, the storage
is CUDA VMM (:mod:`hybrid_engine.accelerator.cuda_vmm`: not yet run on a GPU).
Other devices (CUDA without it, NPU, XPU: no VMM reachable from Python here) get
plain ``torch.zeros`` storage (:func:`make_arena` returns ``None``); their
owners drop the buffers on sleep and recapture after (counted in the runner's
``sleep_drops`` and ``recaptures``).

:class:`ReleasableTensors` is the one mechanism every owner uses (the page pool,
each state store of rings and linear states): tensors over one arena where the
device has one, released and restored together.
"""

from __future__ import annotations

import mmap
import sys

import torch

from hybrid_engine.accelerator import cuda_vmm
from hybrid_engine.accelerator.arena import Arena

__all__ = ["HostArena", "ReleasableTensors", "make_arena", "supports_release"]


def supports_release(device: torch.device) -> bool:
    """Whether :func:`make_arena` gives ``device`` releasable storage at fixed addresses."""
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_vmm.vmm_unavailable(device) is None
    # Linux: MADV_DONTNEED on a private anonymous mapping returns the pages at once (elsewhere it is advisory).
    return device.type == "cpu" and hasattr(mmap, "MADV_DONTNEED") and sys.platform.startswith("linux")


class HostArena(Arena):
    """``nbytes`` bytes of host memory over an anonymous mapping (private unless ``shared``), carved into tensors
    by :meth:`take`. :meth:`release` drops the physical pages, :meth:`restore` takes them back (NaN-filled) at
    the same addresses. ``shared`` exists for tests: a shared mapping keeps its pages on ``MADV_DONTNEED``."""

    def __init__(self, nbytes: int, *, shared: bool = False) -> None:
        super().__init__()
        self.nbytes = max(int(nbytes), 1)
        flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS
        self._map = mmap.mmap(-1, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def release(self) -> None:
        """Drop the physical pages (their contents are lost); the addresses stay mapped."""
        self._map.madvise(mmap.MADV_DONTNEED)
        self.released = True

    def restore(self) -> bool:
        """Take the pages back, every floating tensor NaN-filled (others zero); returns whether any tensor moved
        (never, here: the addresses are the mapping's)."""
        self.refill()
        self.released = False
        return False


def make_arena(nbytes: int, device: torch.device) -> HostArena | cuda_vmm.VmmArena | None:
    """Releasable storage of ``nbytes`` for ``device``, or ``None`` where there is none (plain tensors then)."""
    if not supports_release(device):
        return None
    return cuda_vmm.VmmArena(nbytes, device) if torch.device(device).type == "cuda" else HostArena(nbytes)


class ReleasableTensors:
    """Zero-filled tensors of ``shapes`` (``[(shape, dtype)]``, in order) over one arena of :func:`make_arena`
    where ``device`` has one, else plain ``torch.zeros`` (not releasable: the owner drops them instead).

    :meth:`release` drops their physical memory at fixed addresses; :meth:`restore` takes it back NaN-filled
    (the owner re-zeroes what needs it: a missing re-zero fails visibly). :attr:`tensors` are rebound when a
    backend hands the memory back elsewhere (``restore`` then returns ``True``)."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self._arena = make_arena(Arena.bytes_for(shapes), device) if shapes else None
        if self._arena is not None:
            self.tensors = [self._arena.take(shape, dtype) for shape, dtype in shapes]
        else:
            self.tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes]

    @property
    def releasable(self) -> bool:
        """Whether :meth:`release` can drop the memory at fixed addresses."""
        return self._arena is not None

    @property
    def released(self) -> bool:
        """Whether the memory is given back (nothing may read the tensors until :meth:`restore`)."""
        return self._arena is not None and self._arena.released

    def release(self) -> None:
        """Drop the physical memory, addresses kept (contents lost); the caller synchronised the device."""
        if self._arena is None:
            raise RuntimeError("ReleasableTensors.release: no releasable storage on this device; drop the "
                               "tensors instead")
        self._arena.release()

    def restore(self) -> bool:
        """Take the memory back, NaN-filled (others zero); whether the tensors moved (then rebound here)."""
        moved = self._arena.restore()
        if moved:
            self.tensors = self._arena.tensors()
        return moved
