"""Per-row states of state layers (gated delta rule, Mamba mixers, short convolutions), beside the paged K/V.

Why: such a layer caches no K/V per token but one fixed-size state per
sequence: the last inputs of its causal convolution and its recurrent matrix.
transformers' modeling code reads and writes them through the cache
(``get_conv_state``/``update_conv_state``, ``get_recurrent_state``/
``update_recurrent_state``), one batch row per sequence. So each cache row has
its own states here, in storage allocated once and updated in place: a captured
step reads and writes fixed addresses, and a row's state is device data.

What moves with a row (the K/V's pages are shared; states never are):
admission copies its staged prompt's states into its slot, once per sample;
compaction moves them with the row; a resumed request's prefill rewrites them.
Shapes come from one probe forward of the model
(:func:`hybrid_engine.decode.model_support.state_shapes`), so every buffer
exists before anything is captured.

Sleep and wake (issue 41): the buffers of a store made with its shapes live in
one releasable arena (:class:`~hybrid_engine.decode.kv_storage.ReleasableTensors`,
as the page pool's), so ``"kv_cache"`` sleep drops rings and states at fixed
addresses with the pages, and wake zeroes them again (zero is every state's
initial value, and a ring's unwritten slots are read with zero weight, where
NaN would poison the sum). A lazy store (probes, eager use) keeps plain tensors.
"""

from __future__ import annotations

import torch

from hybrid_engine.accelerator import is_capturing
from hybrid_engine.decode.kv_storage import ReleasableTensors

__all__ = ["Shapes", "StateKey", "StateStore", "StateView"]

#: ``(kind, layer, index)``: kind ``"conv"`` or ``"recurrent"`` (index: transformers' state index), or ``"ring"``
#: (a windowed layer's last tokens; index 0 keys, 1 values).
StateKey = tuple[str, int, int]
Shapes = dict[StateKey, tuple[tuple[int, ...], torch.dtype]]


class StateStore:
    """``rows`` rows of every linear layer's states; ``shapes`` (per row) allocate them now, else (a probe) at
    the first write of each, which must not be captured."""

    def __init__(self, rows: int, device: torch.device, shapes: Shapes, *, lazy: bool = False) -> None:
        self.rows = rows
        self.device = device
        self.lazy = lazy
        # One more row than the cache's: writes nobody reads go there (as the null page for pages).
        full = [((rows + 1, *shape), dtype) for shape, dtype in shapes.values()]
        #: The buffers' storage, releasable at fixed addresses where the device has it (``None``: lazy).
        self.storage = None if lazy else ReleasableTensors(full, device)
        made = self.storage.tensors if self.storage is not None else [
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in full]
        self.tensors: dict[StateKey, torch.Tensor] = dict(zip(shapes, made))

    # ------------------------------------------------------------ sleep/wake
    @property
    def releasable(self) -> bool:
        """Whether :meth:`sleep` can drop the buffers at fixed addresses (not a lazy store, not a device
        without releasable storage)."""
        return self.storage is not None and self.storage.releasable

    @property
    def asleep(self) -> bool:
        """Whether the buffers' memory is released (nothing may read them until :meth:`wake`)."""
        return self.storage is not None and self.storage.released

    def sleep(self) -> None:
        """Drop the buffers' physical memory, addresses kept (every row's states are lost); the caller has
        synchronised the device and runs no step until :meth:`wake`."""
        if not self.releasable:
            raise RuntimeError(f"StateStore.sleep: no releasable storage on {self.device}")
        self.storage.release()

    def wake(self) -> bool:
        """Take the memory back (NaN-filled by the backend) and zero every buffer: each state's initial value.
        Returns whether the buffers moved (then rebound here; graphs over the old ones are stale)."""
        moved = self.storage.restore()
        if moved:
            self.tensors = dict(zip(self.tensors, self.storage.tensors))
        self.zero_states()
        return moved

    def zero_states(self) -> None:
        """Every buffer zero, the spare row included."""
        for t in self.tensors.values():
            t.zero_()

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.rows + 1, *shape, dtype=dtype, device=self.device)

    def shapes(self) -> Shapes:
        return {key: (tuple(t.shape[1:]), t.dtype) for key, t in self.tensors.items() if key[0] != "ring"}

    def tensor(self, key: StateKey, like: torch.Tensor | None = None) -> torch.Tensor:
        found = self.tensors.get(key)
        if found is None:
            if not self.lazy or like is None or is_capturing():
                raise RuntimeError(f"linear-attention state {key} has no buffer; the cache was built without the "
                                   "model's state shapes (hybrid_engine.decode.model_support.state_shapes)")
            found = self.tensors[key] = self._zeros(tuple(like.shape[1:]), like.dtype)
        return found

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, source: StateStore | None = None) -> None:
        """Rows ``dst[i]`` take the states of rows ``src[i]`` (of ``source``, default this store); capture-safe."""
        source = self if source is None else source
        for key, t in self.tensors.items():
            t.index_copy_(0, dst, source.tensors[key].index_select(0, src))

    def nbytes(self) -> int:
        """Bytes of the buffers held now: 0 while asleep."""
        return 0 if self.asleep else sum(t.nbytes for t in self.tensors.values())


class StateView:
    """The rows of a :class:`StateStore` one cache (or row view) reads and writes: a slice (decode steps update
    it in place, as transformers' single-token kernels do) or an index tensor (a prefill into chosen slots)."""

    __slots__ = ("rows", "store")

    def __init__(self, store: StateStore, rows: slice | torch.Tensor) -> None:
        self.store, self.rows = store, rows

    def sub(self, rows: slice | torch.Tensor) -> StateView:
        """Rows ``rows`` of this view (a slice within it, or indices relative to it)."""
        start = self.rows.start if isinstance(self.rows, slice) else None
        if start is None:
            return StateView(self.store, self.rows[rows])
        if isinstance(rows, slice):
            return StateView(self.store, slice(start + rows.start, start + rows.stop))
        return StateView(self.store, rows + start)

    def read(self, key: StateKey) -> torch.Tensor:
        t = self.store.tensor(key)
        return t[self.rows] if isinstance(self.rows, slice) else t.index_select(0, self.rows)

    def write(self, key: StateKey, value: torch.Tensor) -> None:
        t = self.store.tensor(key, like=value)
        if isinstance(self.rows, slice):
            t[self.rows].copy_(value)
        else:
            t.index_copy_(0, self.rows, value.to(t.dtype))

    def write_ring(self, key: StateKey, slot: torch.Tensor, keep: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values [B, T, ...]`` at ring slots ``slot [B, T]`` of this view's rows where ``keep``, into the
        store's spare row elsewhere (capture-safe)."""
        t = self.store.tensor(key)
        ring = t.shape[1]
        if isinstance(self.rows, slice):
            rows = torch.arange(self.rows.start, self.rows.stop, device=t.device)
        else:
            rows = self.rows
        flat = torch.where(keep, rows[:, None] * ring + slot, self.store.rows * ring).flatten()
        t.view(-1, *t.shape[2:]).index_copy_(0, flat, values.reshape(-1, *t.shape[2:]).to(t.dtype))
