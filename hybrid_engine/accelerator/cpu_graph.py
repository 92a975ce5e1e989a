"""CPU graph emulation with CUDA-graph capture semantics.

CPU has no native graphs, yet every graph path of this package must run (and
fail) in CPU CI exactly as it would on a GPU. Capture therefore records the
aten-level operations issued inside it, and replay re-issues them without
running any Python model code. The semantics mirror a CUDA graph:

* Host values (Python ints, shapes, counters read in Python) are frozen into
  the recording, as a CUDA graph freezes kernel launch parameters.
* Capture does not apply its work to pre-existing tensors: storages that the
  captured work mutates are snapshotted on first write and restored when the
  capture ends. The first real execution is the first replay.
* Pre-existing tensors are read *by storage*, as a GPU graph reads by address:
  an in-place update (``param.add_``) is seen by the next replay, but a tensor
  whose storage was swapped (``param.data = ...``) keeps being read from the
  old storage, so stale-weight bugs show up on CPU as they would on a GPU.
* Tensors allocated inside capture belong to the graph. The ones still
  referenced when capture ends (the "static outputs") are updated in place by
  every replay.
* Host synchronisations and data-dependent shapes (``.item()``, ``bool(t)``,
  ``.tolist()``, ``.numpy()``, ``.cpu()``, ``nonzero``, boolean-mask indexing)
  raise :class:`GraphCaptureError` while capturing.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


class GraphCaptureError(RuntimeError):
    """An operation that a device graph cannot record was issued while capturing."""


def _not_permitted(what: str) -> GraphCaptureError:
    return GraphCaptureError(
        f"{what} is not permitted while capturing a graph: it needs a host synchronisation or a "
        "data-dependent shape. Keep such work outside the captured region."
    )


_FORBIDDEN_OPS = {
    aten._local_scalar_dense.default: "reading a tensor value on the host (.item(), bool(), int(), float())",
    aten.equal.default: "torch.equal (returns a host bool)",
    aten.is_nonzero.default: "bool(tensor)",
    aten.nonzero.default: "torch.nonzero (data-dependent shape)",
    aten.masked_select.default: "torch.masked_select (data-dependent shape)",
    aten.argwhere.default: "torch.argwhere (data-dependent shape)",
    aten._unique2.default: "torch.unique (data-dependent shape)",
    aten.unique_dim.default: "torch.unique (data-dependent shape)",
    aten.unique_consecutive.default: "torch.unique_consecutive (data-dependent shape)",
    aten.bincount.default: "torch.bincount (data-dependent shape)",
    aten.repeat_interleave.Tensor: "repeat_interleave with tensor repeats (data-dependent shape)",
}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

_FORBIDDEN_TENSOR_METHODS = {
    torch.Tensor.tolist: "Tensor.tolist() (device-to-host read)",
    torch.Tensor.numpy: "Tensor.numpy() (device-to-host read)",
    torch.Tensor.cpu: "Tensor.cpu() (device-to-host read)",
    torch.Tensor.item: "Tensor.item() (device-to-host read)",
    torch.Tensor.__bool__: "bool(tensor) (device-to-host read)",
}

_state = threading.local()


def is_cpu_graph_capturing() -> bool:
    """True only between entering and leaving a CPU graph capture."""
    return getattr(_state, "recorder", None) is not None


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Step:
    """One recorded op with its argument template, ready for replay."""

    __slots__ = ("args", "direct", "fn", "free", "kw_direct", "kwargs", "nested", "out_slots", "single_out")

    def __init__(self, fn, args, kwargs, direct, nested, kw_direct, out_slots, single_out):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.direct = direct
        self.nested = nested
        self.kw_direct = kw_direct
        self.out_slots = out_slots
        self.single_out = single_out
        self.free: tuple[int, ...] = ()


class _Recorder(TorchDispatchMode):
    """Runs each op for real (so Python can keep going) and records it."""

    def __init__(self) -> None:
        super().__init__()
        self.slot_of: dict[int, int] = {}  # id(tensor made inside capture) -> slot
        self.slot_tensors: list[torch.Tensor] = []  # strong refs during capture
        self.externals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, storage alias)
        self.own_storages: set[int] = set()
        self.snapshots: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.steps: list[_Step] = []

    # -- argument templates -------------------------------------------------
    def _leaf(self, value: Any) -> tuple[bool, Any]:
        """(is_slot, slot index or constant) for one argument leaf."""
        if not isinstance(value, torch.Tensor):
            return False, value
        slot = self.slot_of.get(id(value))
        if slot is not None:
            return True, slot
        ext = self.externals.get(id(value))
        if ext is None:
            # Read by storage from now on, like a device graph reads an address.
            ext = (value, value.detach())
            self.externals[id(value)] = ext
        return False, ext[1]

    def _template(self, args: tuple, kwargs: dict):
        base_args, direct, nested = [], [], []
        for i, a in enumerate(args):
            if isinstance(a, (list, tuple)):
                items, subs = [], []
                for j, x in enumerate(a):
                    is_slot, v = self._leaf(x)
                    items.append(None if is_slot else v)
                    if is_slot:
                        subs.append((j, v))
                if subs:
                    nested.append((i, tuple(items), tuple(subs), type(a) is tuple))
                    base_args.append(None)
                else:
                    base_args.append(type(a)(items))
            else:
                is_slot, v = self._leaf(a)
                base_args.append(None if is_slot else v)
                if is_slot:
                    direct.append((i, v))
        base_kwargs, kw_direct = {}, []
        for k, a in kwargs.items():
            if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
                raise GraphCaptureError(f"CPU graph emulation: unsupported tensor list in keyword {k!r}")
            is_slot, v = self._leaf(a)
            base_kwargs[k] = None if is_slot else v
            if is_slot:
                kw_direct.append((k, v))
        return base_args, tuple(direct), tuple(nested), base_kwargs, tuple(kw_direct)

    # -- capture-time safety --------------------------------------------------
    def _check_permitted(self, func, args, kwargs) -> None:
        what = _FORBIDDEN_OPS.get(func)
        if what is not None:
            raise _not_permitted(what)
        if func in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            for idx in indices or ():
                if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                    raise _not_permitted("indexing with a boolean mask (data-dependent shape)")

    def _snapshot_written(self, func, args, kwargs) -> None:
        """Save pre-existing storages this op writes, to restore at capture end."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                    continue
                key = _storage_key(t)
                if key in self.own_storages or key in self.snapshots:
                    continue
                storage = t.untyped_storage()
                self.snapshots[key] = (storage, storage.clone())

    # -- the dispatch hook --------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check_permitted(func, args, kwargs)
        self._snapshot_written(func, args, kwargs)
        template = self._template(args, kwargs)
        out = func(*args, **kwargs)

        flat_out, _ = tree_flatten(out)
        has_tensor = any(isinstance(o, torch.Tensor) for o in flat_out)
        if not has_tensor and not func._schema.is_mutable:
            return out  # a pure host-side query (e.g. SDPA backend choice); nothing to replay
        single = isinstance(out, torch.Tensor)
        if not single and not isinstance(out, (tuple, list)) and has_tensor:
            raise GraphCaptureError(f"CPU graph emulation: unsupported output structure from {func}")
        outs = (out,) if single else (out if isinstance(out, (tuple, list)) else ())
        input_storages = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out_slots = []
        for o in outs:
            if not isinstance(o, torch.Tensor) or id(o) in self.externals:
                out_slots.append(None)
                continue
            slot = self.slot_of.get(id(o))
            if slot is None:
                slot = len(self.slot_tensors)
                self.slot_tensors.append(o)
                self.slot_of[id(o)] = slot
                key = _storage_key(o)
                if key not in input_storages or key in self.own_storages:
                    self.own_storages.add(key)
            out_slots.append(slot)
        base_args, direct, nested, base_kwargs, kw_direct = template
        self.steps.append(
            _Step(func._op, base_args, base_kwargs, direct, nested, kw_direct, tuple(out_slots), single)
        )
        return out


class _HostSyncGuard(TorchFunctionMode):
    """Rejects Python-level host reads that never reach the aten dispatcher."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _FORBIDDEN_TENSOR_METHODS.get(func)
        if what is not None:
            raise _not_permitted(what)
        return func(*args, **(kwargs or {}))


class CPUGraph:
    """A recorded sequence of aten ops, replayable without Python model code."""

    def __init__(self) -> None:
        self._steps: list[_Step] | None = None
        self._num_slots = 0
        self._static_outputs: list[tuple[int, weakref.ref]] = []
        self._externals: list[torch.Tensor] = []

    @property
    def is_captured(self) -> bool:
        return self._steps is not None

    @property
    def num_ops(self) -> int:
        return len(self._steps or ())

    def pool(self) -> CPUGraph:
        """Opaque pool handle; CPU memory needs no sharing, so it is the graph itself."""
        return self

    def reset(self) -> None:
        self._steps = None
        self._static_outputs = []
        self._externals = []

    def _finalize(self, rec: _Recorder) -> None:
        steps = rec.steps
        refs = [weakref.ref(t) for t in rec.slot_tensors]
        own = rec.own_storages
        rec.slot_tensors.clear()
        rec.slot_of.clear()
        # No gc.collect() here (it costs ~0.4 s per capture): a tensor kept alive only by a
        # reference cycle is treated as a static output, which costs one copy per replay.
        static = []
        for slot, ref in enumerate(refs):
            t = ref()
            if t is not None and t.untyped_storage().nbytes() > 0 and _storage_key(t) in own:
                static.append((slot, ref))
        # Free each intermediate after its last read, except static outputs.
        last_use: dict[int, int] = {}
        for k, step in enumerate(steps):
            for _, s in step.direct:
                last_use[s] = k
            for _, _, subs, _ in step.nested:
                for _, s in subs:
                    last_use[s] = k
            for _, s in step.kw_direct:
                last_use[s] = k
        keep = {s for s, _ in static}
        frees: dict[int, list[int]] = {}
        for s, k in last_use.items():
            if s not in keep:
                frees.setdefault(k, []).append(s)
        for k, slots in frees.items():
            steps[k].free = tuple(slots)
        self._steps = steps
        self._num_slots = len(refs)
        self._static_outputs = static
        self._externals = [alias for _, alias in rec.externals.values()]

    def replay(self) -> None:
        steps = self._steps
        if steps is None:
            raise RuntimeError("CPUGraph.replay(): the graph has not been captured")
        if is_cpu_graph_capturing():
            raise GraphCaptureError("replaying a graph while capturing another is not permitted")
        vals: list[Any] = [None] * self._num_slots
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for st in steps:
                args = st.args
                if st.direct or st.nested:
                    args = list(args)
                    for i, s in st.direct:
                        args[i] = vals[s]
                    for i, items, subs, is_tuple in st.nested:
                        seq = list(items)
                        for j, s in subs:
                            seq[j] = vals[s]
                        args[i] = tuple(seq) if is_tuple else seq
                kwargs = st.kwargs
                if st.kw_direct:
                    kwargs = dict(kwargs)
                    for k, s in st.kw_direct:
                        kwargs[k] = vals[s]
                out = st.fn(*args, **kwargs)
                if st.single_out:
                    s = st.out_slots[0]
                    if s is not None:
                        vals[s] = out
                else:
                    for s, o in zip(st.out_slots, out):
                        if s is not None:
                            vals[s] = o
                for s in st.free:
                    vals[s] = None
            for slot, ref in self._static_outputs:
                static = ref()
                if static is not None:  # outputs the caller dropped need no update
                    static.copy_(vals[slot])


@contextlib.contextmanager
def capture_cpu_graph(graph: CPUGraph, pool: Any = None) -> Iterator[None]:
    """Record the work issued inside the block into ``graph`` (CUDA capture semantics)."""
    if is_cpu_graph_capturing():
        raise GraphCaptureError("nested graph capture is not permitted")
    if graph.is_captured:
        raise RuntimeError("this graph was already captured; call reset() or create a new graph")
    rec = _Recorder()
    _state.recorder = rec
    ok = False
    try:
        with _HostSyncGuard(), rec:
            yield
        ok = True
    finally:
        _state.recorder = None
        for storage, saved in rec.snapshots.values():
            storage.copy_(saved)
        rec.snapshots.clear()
        if ok:
            graph._finalize(rec)
        rec.externals.clear()
