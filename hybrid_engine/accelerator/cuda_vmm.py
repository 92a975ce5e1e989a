"""CUDA page-pool storage over the driver's virtual memory management (VMM), for the memory hand-off (issue 41).

Why: a captured CUDA graph reads the K/V pool by address. ``cuMemAddressReserve`` keeps a virtual range for the
pool's lifetime; ``cuMemCreate`` + ``cuMemMap`` back it with physical memory, and ``cuMemUnmap`` +
``cuMemRelease`` give that memory back (``mem_get_info`` sees it free) while the range, and so every graph's
addresses, stay. Wake maps fresh physical memory at the same range (its contents are undefined: the owner
re-zeroes it). This is what vLLM's and SGLang's sleep modes do (through a pluggable allocator); here it is a
few driver calls over ``cuda-bindings`` (the optional extra ``hybrid-engine[cuda-vmm]``), imported lazily,
nothing compiled, wrapped as a torch tensor through ``__cuda_array_interface__``.

STATUS: written without a GPU and NOT YET RUN ON ONE. :func:`vmm_unavailable` probes the whole cycle once per
device (reserve, create, map, write through torch, unmap, release, map again at the same range, read) and
anything that fails there keeps the plain storage (drop and recapture); ``HYBRID_ENGINE_CUDA_VMM=0`` turns it
off.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybrid_engine.accelerator.arena import Arena

__all__ = ["VmmArena", "vmm_unavailable"]

_PROBED: dict[int, str | None] = {}


def _driver() -> Any:
    from cuda.bindings import driver  # the optional extra; lazily, so nothing imports it on other machines

    return driver


def _check(result: Any, what: str) -> Any:
    """A driver call's result tuple ``(err, *values)``: the values, or a ``RuntimeError`` naming the call."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA VMM: {what} failed with {err!r}")
    return values[0] if len(values) == 1 else values


class _Mapping:
    """A reserved range and the physical memory mapped at it now (``handle``; ``None``: released). Freed when
    the arena and every tensor aliasing it are gone (the tensors hold it through their :class:`_Window`), so
    no tensor outlives its memory."""

    def __init__(self, nbytes: int, index: int) -> None:
        d = self.driver = _driver()
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self.prop, self.handle, self.ptr = prop, None, None
        gran = int(_check(d.cuMemGetAllocationGranularity(
            prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity"))
        self.nbytes = -(-max(int(nbytes), 1) // gran) * gran
        self.ptr = int(_check(d.cuMemAddressReserve(self.nbytes, 0, 0, 0), "cuMemAddressReserve"))

    def map(self) -> None:
        d = self.driver
        self.handle = _check(d.cuMemCreate(self.nbytes, self.prop, 0), "cuMemCreate")
        _check(d.cuMemMap(self.ptr, self.nbytes, 0, self.handle, 0), "cuMemMap")
        access = d.CUmemAccessDesc()
        access.location = self.prop.location
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(d.cuMemSetAccess(self.ptr, self.nbytes, [access], 1), "cuMemSetAccess")

    def unmap(self) -> None:
        d = self.driver
        _check(d.cuMemUnmap(self.ptr, self.nbytes), "cuMemUnmap")
        _check(d.cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None

    def __del__(self) -> None:
        try:
            if self.handle is not None:
                self.unmap()
            if self.ptr is not None:
                self.driver.cuMemAddressFree(self.ptr, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass


class _Window:
    """What ``torch.as_tensor`` needs to alias a mapping's bytes on the device (no copy); it keeps the mapping."""

    def __init__(self, mapping: _Mapping) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {"shape": (mapping.nbytes,), "typestr": "|u1", "data": (mapping.ptr, False),
                                         "version": 3}


class VmmArena(Arena):
    """The :class:`~hybrid_engine.decode.kv_storage.HostArena` interface on CUDA VMM (see the module docstring)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        with torch.cuda.device(index):
            torch.cuda.init()  # the primary context current on this thread before any driver call
            torch.empty(0, device=self.device)
            self._mapping = _Mapping(nbytes, index)
            self._mapping.map()
        self.nbytes = self._mapping.nbytes
        self._bytes = torch.as_tensor(_Window(self._mapping), device=self.device)

    def release(self) -> None:
        """Give the physical memory back (the caller synchronised the device); the range stays reserved."""
        with torch.cuda.device(self.device):
            self._mapping.unmap()
        self.released = True

    def restore(self) -> bool:
        """Fresh physical memory at the same range, NaN-filled (the owner re-zeroes); never moves."""
        with torch.cuda.device(self.device):
            self._mapping.map()
        self.refill()
        self.released = False
        return False


def vmm_unavailable(device: torch.device) -> str | None:
    """Why CUDA VMM storage is not used on ``device`` (``None``: it is): switched off, no ``cuda-bindings``, or
    the probe's round trip failed (its error). Probed once per device."""
    if os.environ.get("HYBRID_ENGINE_CUDA_VMM", "1") == "0":
        return "HYBRID_ENGINE_CUDA_VMM=0"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{device.type}: not a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        _PROBED[index] = _probe(torch.device("cuda", index))
    return _PROBED[index]


def _probe(device: torch.device) -> str | None:
    try:
        _driver()
    except ImportError:
        return "cuda-bindings is not installed (pip install 'hybrid-engine[cuda-vmm]')"
    try:
        arena = VmmArena(1, device)
        t = arena.take((256,), torch.float32)
        ptr = t.data_ptr()
        t.fill_(3.0)
        torch.cuda.synchronize(device)
        arena.release()
        arena.restore()
        t.zero_()
        torch.cuda.synchronize(device)
        if t.data_ptr() != ptr or bool(t.any()):
            return "the probe's storage moved or kept stale contents"
        del t, arena
        return None
    except Exception as exc:  # noqa: BLE001 - any failure keeps the plain storage, and says why
        return f"the probe failed: {type(exc).__name__}: {exc}"
