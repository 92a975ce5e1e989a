"""CPU graph emulation with CUDA-graph capture semantics.

CPU has no native graphs, yet every graph path of this package must run (and
fail) in CPU CI exactly as it would on a GPU: this emulation is the only "GPU"
CI has. Capture therefore records the aten-level operations issued inside it
(:class:`_Recorder`, a dispatch mode, with :class:`_HostSyncGuard` for host
reads the dispatcher never sees), and replay re-issues them without running
any Python model code.

The invariant: what a CUDA graph would refuse, the emulation refuses, and what
a CUDA graph would silently get wrong (stale addresses, uninitialised memory,
rebound outputs) it makes fail or read as garbage. Each rule models one
CUDA-graph rule and is documented where it is enforced:

* what capture freezes (host values, generator state) and undoes (writes to
  pre-existing tensors): :func:`capture_cpu_graph`;
* static outputs, reads by storage, stale addresses: :class:`CPUGraph` and
  :meth:`CPUGraph.replay`, which raises :class:`GraphReplayError`;
* host synchronisations, data-dependent shapes, host-to-device copies and
  in-place metadata changes raise :class:`GraphCaptureError`
  (:meth:`_Recorder._check_permitted`, :class:`_HostSyncGuard`); any refusal
  invalidates the capture even when the body catches it (:func:`_refused`);
* streams, threads and one capture at a time per process: the streams section
  and :class:`CPUStream`; CUDA's capture error modes, which say whether
  another thread's host reads and waits break a capture (``"global"``) or not
  (``"thread_local"``, what the accelerators request): :func:`cpu_capture_error_mode`;
* memory pools, and the recording pool a failed capture leaves:
  :class:`CPUGraphPool`.

No state lives on a device: a graph holds its recorded steps, weak references
to its static outputs, and the pre-existing tensors it reads by storage. The
places where CUDA refuses and the emulation does not are listed in
docs/accelerators.md ("The CPU graph emulation").
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from numbers import Number
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


class GraphCaptureError(RuntimeError):
    """An operation that a device graph cannot record was issued while capturing."""


class GraphReplayError(RuntimeError):
    """A replay would read memory a device graph no longer owns (a stale address)."""


_state = threading.local()


def _refused(message: str) -> GraphCaptureError:
    """The error for a refused operation; it also invalidates this thread's running capture (CUDA:
    ``cudaErrorStreamCaptureInvalidated`` at capture end), so a body that catches it still fails."""
    err = GraphCaptureError(message)
    rec = getattr(_state, "recorder", None)
    if rec is not None and rec.invalidated is None:
        rec.invalidated = err
    return err


def refuse_while_capturing(what: str, why: str) -> None:
    """Raise (and invalidate the capture) if this thread is capturing: for calls CUDA refuses during capture that
    are no op the recorder sees (seeding, emptying the allocator cache)."""
    if getattr(_state, "recorder", None) is not None:
        raise _refused(f"{what} is not permitted while a graph is capturing: {why}")


def _not_permitted(what: str) -> GraphCaptureError:
    return _refused(
        f"{what} is not permitted while capturing a graph: it needs a host synchronisation or a "
        "data-dependent shape. Keep such work outside the captured region."
    )


# By overload packet: every overload (``out=`` too) runs the same host read.
_FORBIDDEN_OPS = {
    aten._local_scalar_dense: "reading a tensor value on the host (.item(), bool(), int(), float())",
    aten.equal: "torch.equal (returns a host bool)",
    aten.is_nonzero: "bool(tensor)",
    aten.nonzero: "torch.nonzero (data-dependent shape)",
    aten.masked_select: "torch.masked_select (data-dependent shape)",
    aten.argwhere: "torch.argwhere (data-dependent shape)",
    aten._unique2: "torch.unique (data-dependent shape)",
    aten.unique_dim: "torch.unique (data-dependent shape)",
    aten.unique_consecutive: "torch.unique_consecutive (data-dependent shape)",
    aten.bincount: "torch.bincount (data-dependent shape)",
    aten.allclose: "torch.allclose (returns a host bool)",
    aten._linalg_check_errors: "a torch.linalg error check (reads the info flags on the host; use the *_ex "
                               "variant with check_errors=False)",
    # CUDA kernels that check their info flags (or, for eig, compute on the host) inside, with no *_ex form.
    aten._linalg_svd: "torch.linalg.svd / svdvals / matrix_rank (the CUDA kernel checks convergence on the "
                      "host)",
    aten.linalg_pinv: "torch.linalg.pinv (an svd or eigh inside, which checks convergence on the host)",
    aten._linalg_eigh: "torch.linalg.eigh / eigvalsh (the CUDA kernel checks convergence on the host)",
    aten.linalg_eig: "torch.linalg.eig / eigvals (computed on the host on CUDA)",
    aten.linalg_eigvals: "torch.linalg.eigvals (computed on the host on CUDA)",
    aten.linalg_lstsq: "torch.linalg.lstsq (the CUDA kernel checks its info flags on the host)",
    # The nn.TransformerEncoder / MultiheadAttention fast paths (eval mode, a padding mask): nested tensors whose
    # sizes are read on the host.
    aten._nested_tensor_from_mask: "torch._nested_tensor_from_mask (the nn.TransformerEncoder fast path with a "
                                   "padding mask: reads the mask on the host; capture the module in train mode, "
                                   "with enable_nested_tensor=False, or without src_key_padding_mask)",
    aten._nested_tensor_from_mask_left_aligned: "torch._nested_tensor_from_mask_left_aligned (returns a host bool; "
                                                "the nn.TransformerEncoder fast path's mask check)",
    aten._nested_from_padded: "torch._nested_from_padded (nested sizes read on the host)",
}
# Ops whose CUDA kernel reads a device value on the host before launching (never visible as a separate op).
_MULTINOMIAL = aten.multinomial
_HISTC = aten.histc
# Without output_size, its CUDA kernel reads the total of the repeats on the host.
_REPEAT_INTERLEAVE = aten.repeat_interleave
# Ops whose CUDA kernel calls ``.item()`` (or ``_unique``) on one of its tensor arguments inside the one aten op the
# recorder sees, for some overloads or arguments: see :func:`_hidden_host_read`.
_TENSOR_VALUE_FILLS = {aten.masked_fill: "masked_fill", aten.masked_fill_: "masked_fill_",
                       aten.index_fill: "index_fill", aten.index_fill_: "index_fill_"}
_SPACES = {aten.linspace: "torch.linspace", aten.logspace: "torch.logspace"}
_NORMAL = aten.normal
_ISIN = aten.isin
_SEGMENT_REDUCE = aten.segment_reduce
# Empty-family ops: on a device their memory holds whatever an earlier replay or graph left there.
_EMPTY_OPS = {op._op for op in (aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                                aten.empty_permuted.default, aten.new_empty.default, aten.new_empty_strided.default)}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_MASK_DTYPES = (torch.bool, torch.uint8)
# The default generator is registered with every CUDA capture: passing it explicitly is legal.
_DEFAULT_GENERATOR = torch.default_generator._cdata
# No output and no mutation, but a device-side assert at every replay: recorded all the same.
_ASSERT_ASYNC = aten._assert_async

_FORBIDDEN_TENSOR_METHODS = {
    torch.Tensor.tolist: "Tensor.tolist() (device-to-host read)",
    torch.Tensor.numpy: "Tensor.numpy() (device-to-host read)",
    torch.Tensor.cpu: "Tensor.cpu() (device-to-host read)",
    torch.Tensor.item: "Tensor.item() (device-to-host read)",
    torch.Tensor.__bool__: "bool(tensor) (device-to-host read)",
    torch.Tensor.__repr__: "printing a tensor (str, repr, print, %s: a device-to-host read)",
    torch.Tensor.__format__: "formatting a tensor (f-string, format: a device-to-host read)",
    torch.Tensor.__array__: "numpy.asarray(tensor) (device-to-host read)",
    torch.Tensor.__dlpack__: "Tensor.__dlpack__ (hands device memory to another library)",
}
# Tensor.to targets that name the host: on a device, a device-to-host copy (as .cpu()).
_TO = torch.Tensor.to
_HOST_NAMES = ("cpu",)
_TYPE = torch.Tensor.type
_SET_DATA = torch.Tensor.data.__set__  # ``t.data = other``: never reaches the dispatcher

_LIFT_OPS = (aten.lift_fresh.default, aten.lift_fresh_copy.default)
_HOST_DATA = (
    "creating a tensor from host data (torch.tensor, torch.as_tensor, torch.from_numpy, "
    "Tensor.new_tensor, a Python list as an index)"
)
_SETITEM = torch.Tensor.__setitem__
_ONE_HOT = torch.nn.functional.one_hot


# ------------------------------------------------------------ nn fast paths
# nn.TransformerEncoder, TransformerEncoderLayer and MultiheadAttention take their fast paths (fused kernels; nested
# tensors from a padding mask, which read the mask on the host) only when ``torch.overrides.has_torch_function``
# is false for their tensors. Any torch-function mode makes it true, the emulation's own (:class:`_HostSyncGuard`)
# included: capture would take the slow path where the eager warm-up and a CUDA capture take the fast one. While a
# thread captures, that check is answered as without the emulation: the capturing thread's guard does not count
# when it is the innermost mode. The original returns once no capture is running.
_HAS_TORCH_FUNCTION = torch.overrides.has_torch_function
_fast_path_lock = threading.Lock()
_fast_path_captures = 0  # captures running in any thread


def _has_torch_function_without_emulation(args: Any) -> bool:
    guard = getattr(_state, "guard", None)
    depth = torch._C._len_torch_function_stack()
    if guard is not None and depth and torch._C._get_function_stack_at(depth - 1) is guard:
        with torch.overrides._pop_mode_temporarily():
            return _HAS_TORCH_FUNCTION(args)
    return _HAS_TORCH_FUNCTION(args)


@contextlib.contextmanager
def _fast_paths_as_without_emulation() -> Iterator[None]:
    global _fast_path_captures
    with _fast_path_lock:
        if _fast_path_captures == 0:
            torch.overrides.has_torch_function = _has_torch_function_without_emulation
        _fast_path_captures += 1
    try:
        yield
    finally:
        with _fast_path_lock:
            _fast_path_captures -= 1
            if _fast_path_captures == 0:
                torch.overrides.has_torch_function = _HAS_TORCH_FUNCTION


def is_cpu_graph_capturing() -> bool:
    """True only between entering and leaving a CPU graph capture."""
    return getattr(_state, "recorder", None) is not None


# ------------------------------------------------------------------- streams
# Capture belongs to the stream, not the thread (CUDA records whatever is issued on a capturing stream, from any
# thread), and PyTorch's rule is one capture at a time per process. So a capture ties its CPUStream to the thread
# that began it, and the emulation refuses, as CUDA would break or corrupt the capture: beginning a capture on a
# stream that is capturing, or that another thread has current; another thread making the capturing stream
# current, or calling wait_stream, synchronize() or query() on it, or recording or waiting on an event there
# (cudaErrorStreamCaptureIsolation); the default stream waiting on a capturing stream; and a device-wide
# synchronize() or empty_cache() from any thread while any capture is under way. A refusal from another thread
# also invalidates the capture it touched. The accelerators take graph_capture_lock() around capture (the runner
# around warm-up and capture too) and make device-wide calls wait for it, so only code that bypasses the lock
# meets these refusals.
#
# CUDA's capture error mode decides the rest. In "global" mode (PyTorch's default, and what a backend whose graph
# API takes no mode captures in) a potentially unsafe call in *any* thread while the capture runs fails ("operation
# not permitted when stream is capturing") and invalidates the capture: there, another thread's host read (a data
# loader's .item(), printing a tensor) or host wait on any stream or event is refused too
# (:func:`_refuse_during_global_captures`). In "thread_local" mode, which every accelerator requests, and
# "relaxed", only the capturing thread is held to the rules, as above. Another thread's waits on an event recorded
# inside a capture are refused in every mode (cudaEventQuery/Synchronize on it conflict with the capture).
#
# Captures under way in any thread, by capture stream: the other threads' stream calls are checked against this.
_captures_lock = threading.RLock()
_captures: dict[CPUStream, _Recorder] = {}

#: CUDA's capture error modes (``cudaStreamCaptureMode``), as ``torch.cuda.graph(capture_error_mode=...)`` names them.
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
#: The mode of a capture that names none (the accelerator's): what every accelerator requests where the graph API
#: takes a mode (``backends.CAPTURE_ERROR_MODE``). :func:`cpu_capture_error_mode` changes it for a thread.
DEFAULT_CAPTURE_ERROR_MODE = "thread_local"
_global_captures = 0  # global-mode captures under way (any thread): while > 0, torch.Tensor's host reads are checked


def _checked_mode(mode: str) -> str:
    if mode not in CAPTURE_ERROR_MODES:
        raise ValueError(f"capture_error_mode must be one of {CAPTURE_ERROR_MODES}, got {mode!r}")
    return mode


@contextlib.contextmanager
def cpu_capture_error_mode(mode: str | None) -> Iterator[None]:
    """Captures this thread begins in the block without naming a mode (the accelerator's ``capture_to_graph``)
    run in ``mode`` (``None``: leave it). ``"global"`` models a backend that captures in CUDA's default mode:
    another thread's host reads and waits then fail and break the capture, as there."""
    if mode is None:
        yield
        return
    _checked_mode(mode)
    prev = getattr(_state, "capture_error_mode", None)
    _state.capture_error_mode = mode
    try:
        yield
    finally:
        _state.capture_error_mode = prev


def _begin_global_mode() -> None:
    """A global-mode capture begins (under ``_captures_lock``): the first one wraps torch.Tensor's host reads."""
    global _global_captures
    _global_captures += 1
    if _global_captures == 1:
        _wrap_host_reads(True)


def _end_global_mode() -> None:
    """A global-mode capture ended (under ``_captures_lock``): the last one puts torch's own methods back."""
    global _global_captures
    _global_captures -= 1
    if _global_captures == 0:
        _wrap_host_reads(False)


def _refuse_if_captured_elsewhere(others: Callable[[], list[_Recorder]], message: Callable[[str], str]) -> None:
    """Raise :func:`_refused` of ``message(<the capturing threads' names>)`` if ``others()`` (read under the lock)
    lists captures, after invalidating them: their end then sees it."""
    with _captures_lock:
        found = others()
        if not found:
            return
        err = _refused(message(", ".join(sorted({repr(rec.thread.name) for rec in found}))))
        for rec in found:
            _invalidate(rec, err)
    raise err


def _refuse_during_global_captures(what: str) -> None:
    """Raise, and invalidate them, while another thread captures in global mode: a potentially unsafe call (a host
    read or wait) that CUDA fails in any thread then (cudaStreamCaptureModeGlobal)."""
    me = threading.current_thread()
    _refuse_if_captured_elsewhere(
        lambda: [rec for rec in _captures.values() if rec.mode == "global" and rec.thread is not me],
        lambda names: (
            f"{what} in thread {me.name!r} while thread {names} is capturing a graph in global capture mode "
            "(capture_error_mode='global', PyTorch's default): CUDA then refuses potentially unsafe calls (host "
            "reads, stream, event and device synchronisations) in every thread with \"operation not permitted when "
            "stream is capturing\" and invalidates the capture. Capture with capture_error_mode='thread_local' (what "
            "the accelerators request where the graph API takes a mode), or keep other threads from reading device "
            "values while a capture runs (they may wait for graph_capture_lock(), which captures hold)."))


def _capture_on(stream: Any) -> _Recorder | None:
    """The capture under way on ``stream`` (any thread's), or None."""
    return _captures.get(stream) if isinstance(stream, CPUStream) else None


def _foreign(rec: _Recorder | None) -> bool:
    return rec is not None and rec.thread is not threading.current_thread()


def _invalidate(rec: _Recorder, err: GraphCaptureError) -> None:
    with _captures_lock:
        if rec.invalidated is None:
            rec.invalidated = err
            me = threading.current_thread()
            rec.invalidated_by = None if me is rec.thread else me.name


def _cross_thread_refusal(what: str, rec: _Recorder) -> GraphCaptureError:
    """The error for ``what`` touching the stream thread ``rec.thread`` captures on; it invalidates that capture
    (CUDA: the other thread's work is recorded into it or breaks it) and this thread's own, if any."""
    err = _refused(
        f"{what} touches {rec.stream!r}, which thread {rec.thread.name!r} is capturing on. CUDA capture belongs to "
        "the stream, not the thread: work another thread issues there is recorded into that graph and never runs, "
        "and a wait or synchronisation across it breaks the capture (cudaErrorStreamCaptureIsolation). PyTorch "
        "allows one capture at a time per process: give each thread (or runner) its own graph stream, and hold "
        "graph_capture_lock() around warm-up and capture."
    )
    _invalidate(rec, err)
    return err


def _check_stream(stream: Any, what: str) -> None:
    rec = _capture_on(stream)
    if _foreign(rec):
        raise _cross_thread_refusal(what, rec)


def _other_threads_captures() -> list[_Recorder]:
    me = threading.current_thread()
    with _captures_lock:
        return [rec for rec in _captures.values() if rec.thread is not me]


def _refuse_during_other_captures(what: str, why: str) -> None:
    """Raise if another thread is capturing (and invalidate its captures): for device-wide calls."""
    _refuse_if_captured_elsewhere(
        _other_threads_captures,
        lambda names: (f"{what} while thread {names} is capturing a graph: {why}. PyTorch allows one capture at a "
                       "time per process; the accelerator's synchronize() and empty_cache() wait for "
                       "graph_capture_lock(), which warm-ups and captures hold."))


def synchronize_device() -> None:
    """A device-wide synchronisation (CUDA's ``cudaDeviceSynchronize``): nothing to wait for on the CPU, but
    refused while any thread is capturing: in the capturing thread as a host synchronisation, from another
    thread because it would wait on the capturing stream."""
    if is_cpu_graph_capturing():
        raise _not_permitted("accelerator.synchronize()")
    _refuse_during_other_captures("accelerator.synchronize()", "a device-wide wait includes the capturing stream")


def check_empty_cache() -> None:
    """Raise where CUDA's ``empty_cache()`` asserts or frees nothing: during any capture, or while a pool of a
    failed capture is still recording."""
    refuse_while_capturing(
        "accelerator.empty_cache()",
        "CUDA's caching allocator asserts no capture is underway when it releases its cached blocks; empty the "
        "cache before or after capture",
    )
    _refuse_during_other_captures("accelerator.empty_cache()", "CUDA's caching allocator asserts no capture is "
                                  "underway (in any thread) when it releases its cached blocks")
    stuck = recording_pools()
    if stuck:
        raise GraphCaptureError(
            f"accelerator.empty_cache(): {len(stuck)} graph pool(s) are still recording: a capture into them failed "
            "and the pool was never ended and released, so CUDA's caching allocator believes a capture is under way "
            "for the rest of the process (empty_cache asserts or frees nothing, record_stream frees and the "
            "free-and-retry on out-of-memory are skipped, the pool's memory leaks). Capture through the accelerator's "
            "capture_to_graph with a pool handle, which ends and releases a failed capture's pool, or call "
            "end_allocating_to_pool(pool) and release_graph_pool(pool)."
        )


class _HostWaits:
    """Host waits on a CPU stream or event: nothing to wait for (CPU work has completed), but refused while a
    graph is capturing, as CUDA refuses them."""

    __slots__ = ()
    _kind = "stream"

    def _check_wait(self, what: str) -> None:
        if is_cpu_graph_capturing():
            raise _not_permitted(f"{self._kind}.{what}()")
        _check_stream(self, f"{self._kind}.{what}()")
        if _global_captures:
            _refuse_during_global_captures(f"{self._kind}.{what}()")

    def synchronize(self) -> None:
        self._check_wait("synchronize")

    def query(self) -> bool:
        """True: all work on it has completed."""
        self._check_wait("query")
        return True


class CPUStream(_HostWaits):
    """A CPU "stream": identity only, since CPU work runs synchronously.

    It exists so that stream discipline (capture on a side stream, never on the
    default one; a capturing stream belongs to the thread capturing on it) is
    exercised in CPU CI as it is on CUDA. CUDA refuses to capture on the
    default stream, and work issued on the default stream during a capture
    breaks it: each thread has a current stream (initially the default one,
    :func:`cpu_stream` selects another), capture refuses to begin while the
    default stream is current, and ops issued on it during a capture raise.
    Another stream takes part in a capture only once forked from it
    (:meth:`wait_stream` on a stream in the capture, or an event recorded
    there), and must rejoin before capture end, as CUDA requires.
    """

    __slots__ = ("_current_in", "is_default", "__weakref__")

    def __init__(self, *, _default: bool = False) -> None:
        self.is_default = _default
        self._current_in: dict[threading.Thread, int] = {}  # threads that have it current (non-default only)

    def wait_stream(self, stream: CPUStream) -> None:
        """Order this stream after ``stream`` (a no-op: CPU work is already ordered)."""
        if not isinstance(stream, CPUStream):
            raise TypeError(f"wait_stream: expected a CPUStream, got {type(stream).__name__}")
        _check_stream(self, "wait_stream")
        _check_stream(stream, "wait_stream")
        rec = _capture_on(stream)
        if self.is_default and rec is not None:
            raise _refused(
                "the default stream waiting on a capturing stream (default.wait_stream(capturing)) is not permitted: "
                "on CUDA it joins the default stream to the capture, which CUDA refuses; wait after capture ends"
            )
        mine = getattr(_state, "recorder", None)
        if mine is not None:
            mine.follow(self, stream)

    def __repr__(self) -> str:
        return f"<CPUStream {'default' if self.is_default else hex(id(self))}>"


class CPUEvent(_HostWaits):
    """A CPU "event" (``torch.cuda.Event`` without timing): recording it is legal during capture (a dependency
    inside the graph on CUDA); waiting on it from the host (``synchronize()``, ``query()``) is refused while
    capturing, as for :class:`CPUStream`. Outside capture, CPU work has always completed."""

    __slots__ = ("_recorded_on", "_recorded_in", "__weakref__")
    _kind = "event"

    def __init__(self) -> None:
        self._recorded_on: CPUStream | None = None  # the stream of its last record()
        self._recorded_in: weakref.ref[_Recorder] | None = None  # the capture its last record() was part of

    def record(self, stream: CPUStream | None = None) -> None:
        if stream is not None and not isinstance(stream, CPUStream):
            raise TypeError(f"record: expected a CPUStream, got {type(stream).__name__}")
        _check_stream(stream, "event.record(stream)")
        self._recorded_on = stream if stream is not None else current_cpu_stream()
        mine = getattr(_state, "recorder", None)
        self._recorded_in = weakref.ref(mine) if mine is not None and mine.in_capture(self._recorded_on) else None

    def _check_wait(self, what: str) -> None:
        """Also refused, in every mode, from another thread while the capture it was recorded in runs (CUDA:
        querying or synchronizing an event recorded inside a capture conflicts with it)."""
        rec = self._recorded_in() if self._recorded_in is not None else None
        if rec is not None and _foreign(rec) and _capture_on(rec.stream) is rec:
            raise _cross_thread_refusal(f"event.{what}() on an event recorded inside the capture", rec)
        super()._check_wait(what)

    def wait(self, stream: CPUStream | None = None) -> None:
        """Make ``stream`` (the current one by default) wait for this event (a no-op: CPU work is ordered);
        during a capture, a fork from or a join into it, as ``stream.wait_stream`` of the recording stream."""
        if stream is not None and not isinstance(stream, CPUStream):
            raise TypeError(f"wait: expected a CPUStream, got {type(stream).__name__}")
        _check_stream(stream, "event.wait(stream)")
        mine = getattr(_state, "recorder", None)
        if mine is not None and self._recorded_on is not None:
            mine.follow(stream if stream is not None else current_cpu_stream(), self._recorded_on)

    def __repr__(self) -> str:
        return f"<CPUEvent {hex(id(self))}>"


_DEFAULT_STREAM = CPUStream(_default=True)


def default_cpu_stream() -> CPUStream:
    return _DEFAULT_STREAM


def current_cpu_stream() -> CPUStream:
    """This thread's current stream (the default stream until one is selected)."""
    return getattr(_state, "stream", _DEFAULT_STREAM)


@contextlib.contextmanager
def cpu_stream(stream: CPUStream | None) -> Iterator[CPUStream | None]:
    """Make ``stream`` current for the block (``None``: leave the current stream).

    Refused when another thread is capturing on ``stream``: what this thread
    issued there would be recorded into that thread's graph."""
    if stream is None:
        yield None
        return
    if not isinstance(stream, CPUStream):
        raise TypeError(f"expected a CPUStream, got {type(stream).__name__}")
    me = threading.current_thread()
    tracked = not stream.is_default
    with _captures_lock:
        rec = _captures.get(stream)
        if tracked and not _foreign(rec):
            stream._current_in[me] = stream._current_in.get(me, 0) + 1
    if _foreign(rec):
        raise _cross_thread_refusal("making the stream current (work issued on it)", rec)
    prev = current_cpu_stream()
    _state.stream = stream
    try:
        yield stream
    finally:
        _state.stream = prev
        if tracked:
            with _captures_lock:
                left = stream._current_in[me] - 1
                if left:
                    stream._current_in[me] = left
                else:
                    del stream._current_in[me]


# --------------------------------------------------------------------- pools
# Pools the "allocator" is still recording to (strong references: on CUDA the allocator keeps the entry whether or
# not anything else holds the pool).
_allocating_pools: set[CPUGraphPool] = set()


class CPUGraphPool:
    """An emulated graph memory pool, shared by every graph captured into it.

    Bytes are accounted at capture time (replay pays nothing for it): the
    static outputs of each graph, plus one workspace sized to the largest
    intermediate peak among its graphs (graphs in a pool replay one at a time,
    so they share it, as on CUDA), plus what each failed capture into it
    allocated until that capture is released. A fresh ``CPUGraphPool()`` is a
    handle, as ``torch.cuda.graph_pool_handle()``: take one to learn a failed
    capture's pool (:meth:`CPUGraph.pool` raises until a capture succeeds).

    A capture that fails (refused, invalidated, or its body raised) leaves its
    pool *recording*, as CUDA's ``capture_end`` throws before it ends
    allocating to the pool when ``cudaStreamEndCapture`` fails, and only a
    capture that ended releases its pool: CUDA's caching allocator then
    believes a capture is under way for the rest of the process. (A body that
    raised without breaking the capture ends it cleanly on CUDA; the emulation
    is stricter.) :func:`end_allocating_to_pool` and :func:`release_graph_pool`
    undo it; the accelerators' ``capture_to_graph`` does both when a capture
    fails.

    Sharing a pool is safe on CUDA only when graphs replay in capture order: a
    graph captured later may have been given blocks an earlier graph used for
    intermediates. Replaying a graph therefore fills the static outputs of
    every graph captured after it into the same pool with garbage, until those
    replay (:meth:`_clobber_after`).
    """

    def __init__(self) -> None:
        # graph -> (static output bytes, intermediate peak bytes)
        self._usage: weakref.WeakKeyDictionary[CPUGraph, tuple[int, int]] = weakref.WeakKeyDictionary()
        self._captures = 0  # graphs finalized into this pool so far: each one's capture order
        self._with_outputs: weakref.WeakSet[CPUGraph] = weakref.WeakSet()  # its graphs that have static outputs
        self._allocating = False  # the "allocator" records into it (a capture is under way, or one failed)
        self._capturing = False  # a capture into it is under way
        self._failed: list[int] = []  # per failed capture not yet released (its reference), the bytes it allocated
        self._begun = False  # a capture into it has begun: once nothing holds it any more, it is freed

    @property
    def num_graphs(self) -> int:
        return len(self._usage)

    @property
    def static_bytes(self) -> int:
        return sum(s for s, _ in self._usage.values())

    @property
    def workspace_bytes(self) -> int:
        return max((w for _, w in self._usage.values()), default=0)

    @property
    def recording(self) -> bool:
        """Whether the allocator still records into this pool: a capture is under way, or one failed and the
        pool was never ended (:func:`end_allocating_to_pool`)."""
        return self._allocating

    @property
    def freed(self) -> bool:
        """Used once, and nothing holds it any more (no graph, no failed capture, no recording): CUDA's allocator
        has released it, and a capture into it would trip its use-count assert."""
        return self._begun and not self._allocating and not self._failed and not self._usage

    def memory_bytes(self) -> int:
        """Bytes this pool holds: static outputs of all its graphs, the shared workspace, and what failed captures
        into it allocated, until they are released."""
        return self.static_bytes + self.workspace_bytes + sum(self._failed)

    def __repr__(self) -> str:
        state = " recording" if self._allocating else ""
        return f"<CPUGraphPool graphs={self.num_graphs} bytes={self.memory_bytes()}{state}>"

    def _clobber_after(self, order: int) -> None:
        """A replay of the graph captured ``order``-th: garble the static outputs of the graphs captured after it
        (their blocks may be its intermediates)."""
        for graph in list(self._with_outputs):
            if graph._order > order:
                _poison(graph._own_outputs())

    def _begin(self) -> None:
        """A capture begins allocating into this pool (CUDA's ``beginAllocateToPool``)."""
        if self._allocating:
            raise GraphCaptureError(
                "beginAllocateToPool: already recording to this pool: "
                + ("another capture into it is under way" if self._capturing else
                   "a capture into it failed and the pool was never ended and released (CUDA's allocator refuses "
                   "every later capture into it); call end_allocating_to_pool(pool) and release_graph_pool(pool), "
                   "or capture through the accelerator, which does")
            )
        if self.freed:
            raise GraphCaptureError(
                "this graph pool was freed: every graph captured into it is gone (reset or collected), so CUDA's "
                "allocator has dropped it, and capturing into it again trips its use-count assert; take a new handle "
                "(the accelerator's graph_pool_handle())"
            )
        self._allocating = self._capturing = self._begun = True
        with _captures_lock:
            _allocating_pools.add(self)

    def _end(self, failed_bytes: int | None) -> None:
        """The capture into this pool ended: allocation ends with it, or, when it failed (``failed_bytes``: what it
        allocated), stays on and keeps a reference, as CUDA's ``capture_end`` throws before ending it."""
        self._capturing = False
        if failed_bytes is None:
            self._allocating = False
            with _captures_lock:
                _allocating_pools.discard(self)
        else:
            self._failed.append(failed_bytes)


def recording_pools() -> list[CPUGraphPool]:
    """Pools left recording by a failed capture (no capture into them under way): while there are any, CUDA's
    allocator believes a capture is under way."""
    with _captures_lock:
        return [p for p in _allocating_pools if not p._capturing]


def end_allocating_to_pool(pool: CPUGraphPool) -> None:
    """Stop recording into ``pool`` after a failed capture (CUDA: ``torch._C._cuda_endAllocateToPool``).

    Raises ``RuntimeError`` when nothing records into it (its capture ended, or was never begun), as CUDA's
    allocator does ("not currently recording to mempool_id"), and while a capture into it is under way."""
    if not isinstance(pool, CPUGraphPool):
        raise TypeError(f"end_allocating_to_pool: expected a CPUGraphPool, got {type(pool).__name__}")
    if pool._capturing:
        raise RuntimeError("end_allocating_to_pool: a capture into this pool is under way; end the capture")
    if not pool._allocating:
        raise RuntimeError("end_allocating_to_pool: not currently recording to this pool")
    pool._allocating = False
    with _captures_lock:
        _allocating_pools.discard(pool)


def release_graph_pool(pool: CPUGraphPool) -> None:
    """Drop the reference a failed capture holds on ``pool`` and the bytes it allocated (CUDA:
    ``torch._C._cuda_releasePool``), after :func:`end_allocating_to_pool`.

    A graph that was captured holds its own reference, released when it is reset or collected: releasing a pool
    no failed capture holds raises ``RuntimeError`` (on CUDA a release too many frees blocks live graphs use)."""
    if not isinstance(pool, CPUGraphPool):
        raise TypeError(f"release_graph_pool: expected a CPUGraphPool, got {type(pool).__name__}")
    if pool._allocating:
        raise RuntimeError("release_graph_pool: the pool is still recording; call end_allocating_to_pool first")
    if not pool._failed:
        raise RuntimeError("release_graph_pool: no failed capture holds this pool (a captured graph releases its "
                           "own reference when it is reset or collected)")
    pool._failed.pop()


def _garbage(dtype: torch.dtype) -> Any:
    """A conspicuous fill value standing in for uninitialised device memory."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        return None
    return info.min if info.min < 0 else info.max


def _poison(tensors: Iterable[torch.Tensor | None]) -> None:
    """Fill the whole storage of each tensor with garbage, once per storage."""
    seen: set[int] = set()
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        value = _garbage(t.dtype)
        if key in seen or value is None:
            continue
        seen.add(key)
        with torch.inference_mode() if t.is_inference() else torch.no_grad():
            t.as_strided((storage.nbytes() // t.element_size(),), (1,), 0).fill_(value)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    """An op argument given by position or by name."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _schema_arg(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """An op argument by its schema name, whatever its position in this overload."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return _arg(args, kwargs, i, name, None)
    return None


def _hidden_host_read(packet: Any, func: Any, args: tuple, kwargs: dict) -> str | None:
    """What the CUDA kernel of this op reads on the host inside the op (with the fix), or None.

    These reads happen inside one aten op, so the recorder never sees a separate ``_local_scalar_dense``."""
    if packet in _TENSOR_VALUE_FILLS:
        if isinstance(_schema_arg(func, args, kwargs, "value"), torch.Tensor):
            fix = "torch.where(mask, value, x)" if packet in (aten.masked_fill, aten.masked_fill_) else None
            return (f"{_TENSOR_VALUE_FILLS[packet]} with a tensor value (its CUDA kernel reads the value with "
                    f".item(); pass a Python scalar{', or use ' + fix if fix else ''})")
    elif packet in _SPACES:
        if any(isinstance(_schema_arg(func, args, kwargs, n), torch.Tensor) for n in ("start", "end")):
            return (f"{_SPACES[packet]} with a tensor start or end (its kernel reads them with .item(); pass "
                    "Python scalars, or compute from torch.arange(steps))")
    elif packet is _NORMAL:
        if isinstance(_schema_arg(func, args, kwargs, "std"), torch.Tensor):
            return ("torch.normal with a tensor std (its CUDA kernel checks std >= 0 with .item(); pass a float "
                    "std, or draw mean + std * torch.randn_like(mean))")
    elif packet is _ISIN:
        elements = _schema_arg(func, args, kwargs, "elements")
        test = _schema_arg(func, args, kwargs, "test_elements")
        n = elements.numel() if isinstance(elements, torch.Tensor) else 1  # isin(scalar, tensor): one element
        # TensorCompare.cpp: from this many test elements on, the sorting path, which calls _unique unless
        # assume_unique.
        if (isinstance(test, torch.Tensor) and n > 0 and not _schema_arg(func, args, kwargs, "assume_unique")
                and test.numel() >= int(10.0 * n ** 0.145)):
            return ("torch.isin with assume_unique=False and this many test elements (its sorting path calls "
                    "torch.unique, a data-dependent shape; pass assume_unique=True when both inputs are unique, "
                    "or compare directly: (elements[..., None] == test_elements.flatten()).any(-1))")
    elif packet is _SEGMENT_REDUCE:
        if (_schema_arg(func, args, kwargs, "offsets") is None
                and isinstance(_schema_arg(func, args, kwargs, "lengths"), torch.Tensor)
                and not _schema_arg(func, args, kwargs, "unsafe")):
            return ("torch.segment_reduce with lengths and unsafe=False (it checks the lengths with .item(); "
                    "pass unsafe=True, or offsets instead of lengths)")
    return None


def _metadata_refused(what: str) -> GraphCaptureError:
    return _refused(
        f"{what} changes the metadata (shape, strides or storage) of a tensor that existed before capture: on a "
        "device that happens once, on the host, at capture, and the graph keeps what its kernels were captured "
        "with; the emulation cannot replay it. Do it before capture, or on a new view (w.t() instead of w.t_())."
    )


def _poisoned_empty(op: Any, garbage: Any) -> Any:
    """``op`` (an empty-family op), then its output filled with ``garbage``, as stale device memory reads."""
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        return op(*args, **kwargs).fill_(garbage)
    return run


def _storage_key(t: torch.Tensor) -> int:
    """The storage's identity (its StorageImpl), which an empty storage has too and a resize keeps."""
    return t.untyped_storage()._cdata


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
        self.externals: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}  # id -> (original, alias, reader)
        self.op: Any = None  # the op being recorded, to name an external's first reader
        self.own_storages: set[int] = set()
        # storage key -> (a tensor on it, its bytes and data pointer at the first write)
        self.snapshots: dict[int, tuple[torch.Tensor, torch.UntypedStorage, int]] = {}
        self.steps: list[_Step] = []
        self.scalar_setitem = 0  # > 0 while ``tensor[idx] = <python or numpy scalar>`` runs
        self.invalidated: GraphCaptureError | None = None  # the first refusal (this thread's, or another's)
        self.invalidated_by: str | None = None  # the name of the other thread whose refusal that was
        self.mode = DEFAULT_CAPTURE_ERROR_MODE  # its capture error mode (CAPTURE_ERROR_MODES)
        self.inference = False  # an op ran under torch.inference_mode
        self.thread = threading.current_thread()  # the thread that owns the capture
        self.stream: CPUStream = current_cpu_stream()  # the stream captured on
        # Side streams forked from the capture (they waited on it), and whether they did work since the capture
        # stream last waited on them: CUDA fails capture end for a fork that never rejoins.
        self.joined: dict[CPUStream, bool] = {}

    def in_capture(self, stream: CPUStream) -> bool:
        """Whether ``stream`` takes part in this capture: the capture stream or a side stream forked from it."""
        return stream is self.stream or stream in self.joined

    def follow(self, waiter: CPUStream, waited: CPUStream) -> None:
        """``waiter`` now waits on ``waited``: a fork joins the capture, and the capture stream rejoins a fork."""
        if not self.in_capture(waited) or waiter.is_default:
            return
        if waiter is self.stream:
            if waited in self.joined:
                self.joined[waited] = False  # rejoined: its work so far is ordered before the capture's
        else:
            self.joined.setdefault(waiter, False)

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
            ext = (value, value.detach(), str(self.op))
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
                raise _refused(f"CPU graph emulation: unsupported tensor list in keyword {k!r}")
            is_slot, v = self._leaf(a)
            base_kwargs[k] = None if is_slot else v
            if is_slot:
                kw_direct.append((k, v))
        return base_args, tuple(direct), tuple(nested), base_kwargs, tuple(kw_direct)

    # -- capture-time safety --------------------------------------------------
    def _check_permitted(self, func, args, kwargs) -> None:
        """Raise :class:`GraphCaptureError` for an op a device graph cannot record.

        * Host synchronisations and data-dependent shapes (``.item()``,
          ``bool(t)``, ``nonzero``, boolean-mask indexing, ``repeat_interleave``
          with tensor repeats and no ``output_size``), in every overload
          (``out=`` too); CUDA: "operation not permitted when stream is
          capturing". ``x[mask] = 3`` stays legal (:meth:`_is_masked_fill`).
        * Ops whose CUDA kernel reads a value on the host inside the one op
          (:data:`_FORBIDDEN_OPS`, ``multinomial``, ``histc``,
          :func:`_hidden_host_read`).
        * Host data materialised inside capture (``torch.tensor``,
          ``torch.as_tensor``, ``torch.from_numpy``, ``Tensor.new_tensor``, a
          Python list as an index): on a device a host-to-device copy. Device
          work with a Python or NumPy scalar (``x * 2 + 5``, ``torch.full``,
          ``x[0] = 1``) stays legal.
        * An explicit ``torch.Generator`` other than the default one, and any op
          issued on the default stream.
        * Metadata changed in place on a pre-existing tensor (``t_``,
          ``unsqueeze_``, ``transpose_``, ``as_strided_``, ``set_``: ops tagged
          ``inplace_view``; :class:`_HostSyncGuard` catches assigning ``.data``).
        """
        packet = func.overloadpacket
        what = _FORBIDDEN_OPS.get(packet)
        if what is not None:
            raise _not_permitted(what)
        if packet is _HISTC and _arg(args, kwargs, 2, "min", 0) == _arg(args, kwargs, 3, "max", 0):
            raise _not_permitted("torch.histc without a range (its CUDA kernel reads the data's min and max on "
                                 "the host)")
        if packet is _MULTINOMIAL and (not _arg(args, kwargs, 2, "replacement", False)
                                       or _arg(args, kwargs, 1, "num_samples", 1) == 1):
            raise _not_permitted("torch.multinomial without replacement or for one sample (its CUDA kernel "
                                 "checks the probabilities with .item())")
        hidden = _hidden_host_read(packet, func, args, kwargs)
        if hidden is not None:
            raise _not_permitted(hidden)
        if (packet is _REPEAT_INTERLEAVE and kwargs.get("output_size") is None
                and isinstance(_schema_arg(func, args, kwargs, "repeats"), torch.Tensor)):
            raise _not_permitted("repeat_interleave with tensor repeats and no output_size (data-dependent shape)")
        if any(isinstance(a, torch.Generator) and a._cdata != _DEFAULT_GENERATOR for a in (*args, *kwargs.values())):
            raise _refused(
                f"{func} draws from an explicit torch.Generator while a graph is capturing: a device graph "
                "freezes that generator's state unless it is registered with the graph; use the default "
                "generator, or counter-based sampling"
            )
        current = current_cpu_stream()
        if current is _DEFAULT_STREAM:
            raise _refused(
                f"{func} was issued on the default stream while a graph is capturing: CUDA forbids work on "
                "the default stream during capture (it would synchronise with the capturing stream)"
            )
        if current is not self.stream:
            if current not in self.joined:
                raise _refused(
                    f"{func} was issued on {current!r}, which has not joined the capture on {self.stream!r}: CUDA "
                    "runs that work once, now, outside the graph, and a replay would not. Fork the side stream "
                    "from the capture first (side.wait_stream(capturing), or an event recorded on it)"
                )
            self.joined[current] = True  # work to rejoin before capture end
        if func in _LIFT_OPS and not (self.scalar_setitem and args[0].dim() == 0):
            # ``x[i] = 3`` lifts a 0-dim CPU scalar; on a device that is a fill, not a host copy.
            raise _refused(
                f"{_HOST_DATA} is not permitted while capturing a graph: on a device it is a host-to-device "
                "copy, which capture cannot record. Allocate it before capture and copy_ into it, or use a "
                "device op with a Python scalar (torch.full, torch.zeros, x * 2 + 5)."
            )
        if func in _INDEX_OPS and not self._is_masked_fill(func, args, kwargs):
            for idx in _arg(args, kwargs, 1, "indices", ()) or ():
                if isinstance(idx, torch.Tensor) and idx.dtype in _MASK_DTYPES:
                    raise _not_permitted("indexing with a boolean mask (data-dependent shape)")
        if torch.Tag.inplace_view in func.tags and id(args[0]) not in self.slot_of:
            raise _metadata_refused(str(func))

    def _is_masked_fill(self, func, args, kwargs) -> bool:
        """``x[mask] = <python or numpy scalar>``: CUDA's ``index_put_`` turns it into ``masked_fill_`` with
        the host scalar (one bool mask, the other indices None, no accumulation): no sync, no shape."""
        if not self.scalar_setitem or func is aten.index.Tensor:
            return False
        indices = _arg(args, kwargs, 1, "indices", ())
        value = _arg(args, kwargs, 2, "values", None)
        masks = [i for i in indices if i is not None]
        return (not _arg(args, kwargs, 3, "accumulate", False) and isinstance(value, torch.Tensor)
                and value.dim() == 0 and len(masks) == 1 and masks[0].dtype in _MASK_DTYPES)

    def _snapshot_written(self, func, args, kwargs) -> None:
        """Save pre-existing storages this op writes (empty ones too: ``out=`` may resize them), to restore
        at capture end."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                key = _storage_key(t)
                if key in self.own_storages or key in self.snapshots:
                    continue
                storage = t.untyped_storage()
                self.snapshots[key] = (t.detach(), storage.clone(), storage.data_ptr())

    # -- the dispatch hook --------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.op = func
        self._check_permitted(func, args, kwargs)
        self._snapshot_written(func, args, kwargs)
        template = self._template(args, kwargs)
        self.inference = self.inference or torch.is_inference_mode_enabled()
        body = None if func.namespace in _NATIVE_NAMESPACES else _custom_op_body(func)
        if body is None:
            out = func(*args, **kwargs)
        else:  # a custom op: its body runs now and again at every replay, so it gets the host-read checks too
            with _HostSyncGuard(self), _OpBodyChecks(self):
                out = body(*args, **kwargs)

        flat_out, _ = tree_flatten(out)
        has_tensor = any(isinstance(o, torch.Tensor) for o in flat_out)
        if not has_tensor and not func._schema.is_mutable and func.overloadpacket is not _ASSERT_ASYNC:
            return out  # a pure host-side query (e.g. SDPA backend choice); nothing to replay
        single = isinstance(out, torch.Tensor) or out is None  # None: replay stores nothing
        if not single and not isinstance(out, (tuple, list)) and has_tensor:
            raise _refused(f"CPU graph emulation: unsupported output structure from {func}")
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


#: Namespaces of torch's own ops; any other op (a ``torch.library`` custom op) runs a body the recorder does not
#: see op by op.
_NATIVE_NAMESPACES = frozenset({"aten", "prim", "prims"})


#: Python kernels of ops defined with ``torch.library.Library`` (their qualified names): :func:`register_op_body`.
_OP_BODIES: dict[str, Any] = {}


def register_op_body(qualname: str, fn: Any) -> None:
    """Tell the emulation the Python function op ``qualname`` (``"ns::name"``) runs, so that a capture runs it
    directly and checks the ops inside (:func:`_custom_op_body`)."""
    _OP_BODIES[qualname] = fn


def _custom_op_body(func: Any) -> Any:
    """The Python function a custom op runs (called here directly, so the aten ops inside reach
    :class:`_OpBodyChecks`; through the dispatcher they would run below its Python key, unseen): one registered
    with :func:`register_op_body`, or a ``torch.library.custom_op``'s; ``None`` for any other op (it runs
    through the dispatcher, unchecked inside)."""
    body = _OP_BODIES.get(func._schema.name)
    if body is not None:
        return body
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:  # torch without torch.library.custom_op
        return None
    opdef = _maybe_get_opdef(func)
    return None if opdef is None else opdef._init_fn


class _OpBodyChecks(TorchDispatchMode):
    """Inside a custom op's body (recorded as one node, replayed by running the body again): the aten ops it
    runs get the recorder's host-read and data-dependent-shape checks (not recorded: the node is the op). A
    device graph would capture the op's kernels, and a host read among them fails there."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _FORBIDDEN_OPS.get(func.overloadpacket) or _hidden_host_read(func.overloadpacket, func, args, kwargs)
        if what is not None:
            raise _not_permitted(f"{what}, inside the custom op {self.rec.op}")
        return func(*args, **kwargs)


def _names_the_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to``'s target is the host by name (``"cpu"``, ``"cpu:0"``, ``device="cpu"``): on a
    device that is a device-to-host copy. A ``torch.device`` object stays legal: the emulation's own device is
    the CPU, so ``x.to(model_device)`` is a same-device no-op as it is on a GPU."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] in _HOST_NAMES


def _names_a_host_type(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.type``'s target is a CPU tensor type (``"torch.FloatTensor"``, ``torch.FloatTensor``):
    on a device, a device-to-host copy. A dtype stays legal."""
    target = kwargs.get("dtype", args[0] if args else None)
    if isinstance(target, type):
        target = f"{target.__module__}.{target.__name__}"
    return isinstance(target, str) and not target.startswith("torch.cuda.")


def _one_hot_as_on_a_device(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.one_hot`` given ``num_classes``, as its CUDA kernel runs it (Onehot.cpp): no host check of the class
    values (the CPU kernel reads their min and max with ``.item()``), just a scatter, whose bounds check raises
    at capture and at every replay where CUDA's device assert would fire. ``None``: run the op itself (no
    ``num_classes``, which reads the max on CUDA too, or arguments it rejects)."""
    t = _arg(args, kwargs, 0, "input", None)
    num_classes = _arg(args, kwargs, 1, "num_classes", -1)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or type(num_classes) is not int or num_classes < 1:
        return None
    out = torch.zeros((*t.shape, num_classes), dtype=t.dtype, device=t.device)
    return out.scatter_(-1, t.unsqueeze(-1), 1)


class _HostSyncGuard(TorchFunctionMode):
    """Rejects Python-level host reads that never reach the aten dispatcher.

    Printing or formatting a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``,
    ``numpy.asarray``, ``__dlpack__``, ``Tensor.to("cpu")`` and
    ``Tensor.type("torch.FloatTensor")`` (device-to-host copies on a device),
    and assigning ``.data`` on a pre-existing tensor, raise. It also runs
    ``F.one_hot`` as on CUDA (:func:`_one_hot_as_on_a_device`) and marks
    ``tensor[idx] = <scalar>`` for :meth:`_Recorder._is_masked_fill`."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        func = _UNWRAPPED.get(func, func)  # torch's own method, while a global-mode capture wraps it
        what = _FORBIDDEN_TENSOR_METHODS.get(func)
        if what is not None:
            raise _not_permitted(what)
        if func is _TO and _names_the_host(args[1:], kwargs or {}):
            raise _not_permitted("Tensor.to('cpu') (device-to-host read)")
        if func is _TYPE and _names_a_host_type(args[1:], kwargs or {}):
            raise _not_permitted("Tensor.type(<a CPU tensor type>) (device-to-host read)")
        if func == _SET_DATA and id(args[0]) not in self.rec.slot_of:
            raise _metadata_refused("assigning Tensor.data")
        if func is _ONE_HOT:
            out = _one_hot_as_on_a_device(args, kwargs or {})
            if out is not None:
                return out
        if func is _SETITEM and len(args) == 3 and isinstance(args[2], Number):
            self.rec.scalar_setitem += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.rec.scalar_setitem -= 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------ other threads' host reads (global capture mode)
# No dispatch or torch-function mode reaches another thread (both are per thread), so while a global-mode capture
# runs, torch.Tensor's Python entry points for host reads are wrapped: those _HostSyncGuard refuses in the capturing
# thread, and the conversions (int, float, index, complex) the recorder sees as _local_scalar_dense there. The
# capturing thread goes through them unchecked (its guard and recorder refuse as ever); any other thread is refused
# (:func:`_refuse_during_global_captures`). Ops that read the host inside one aten op (torch.equal, nonzero, ...)
# pass in other threads. torch's own methods are put back when the last global-mode capture ends, so nothing is
# wrapped, and nothing costs more, while no capture runs or captures run in thread_local mode.
def _host_target_any(args: tuple, kwargs: dict) -> bool:
    return True


_OTHER_THREAD_READS: dict[str, tuple[str, Callable[[tuple, dict], bool]]] = {
    **{m.__name__: (what, _host_target_any) for m, what in _FORBIDDEN_TENSOR_METHODS.items()},
    "__int__": ("int(tensor) (device-to-host read)", _host_target_any),
    "__float__": ("float(tensor) (device-to-host read)", _host_target_any),
    "__index__": ("using a tensor as a Python index (device-to-host read)", _host_target_any),
    "__complex__": ("complex(tensor) (device-to-host read)", _host_target_any),
    "to": ("Tensor.to('cpu') (device-to-host read)", _names_the_host),
    "type": ("Tensor.type(<a CPU tensor type>) (device-to-host read)", _names_a_host_type),
}


def _checked_in_other_threads(name: str, what: str, reads: Callable[[tuple, dict], bool]) -> Callable[..., Any]:
    original = getattr(torch.Tensor, name)

    def checked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _global_captures and reads(args, kwargs):
            _refuse_during_global_captures(what)
        return original(self, *args, **kwargs)

    checked.__name__, checked.__qualname__, checked.__doc__ = name, f"Tensor.{name}", original.__doc__
    return checked


# (name, torch.Tensor's own attribute or None where it inherits it from TensorBase, the wrapper)
_HOST_READ_WRAPPERS = [(name, torch.Tensor.__dict__.get(name), _checked_in_other_threads(name, what, reads))
                       for name, (what, reads) in _OTHER_THREAD_READS.items()]
_UNWRAPPED = {checked: getattr(torch.Tensor, name) for name, _, checked in _HOST_READ_WRAPPERS}


def _wrap_host_reads(on: bool) -> None:
    """Install (``on``) or remove the wrappers on torch.Tensor (under ``_captures_lock``)."""
    for name, own, checked in _HOST_READ_WRAPPERS:
        if on:
            setattr(torch.Tensor, name, checked)
        elif torch.Tensor.__dict__.get(name) is checked:  # left alone if someone replaced it meanwhile
            if own is not None:
                setattr(torch.Tensor, name, own)
            else:
                delattr(torch.Tensor, name)


class CPUGraph:
    """A recorded sequence of aten ops, replayable without Python model code.

    * Tensors allocated inside capture hold garbage until the first replay
      (CUDA only reserves their memory). Every static output (a tensor
      allocated inside capture and still referenced when it ends) is poisoned
      at capture end: NaN for floating point, the most extreme value for
      integers, ``True`` for bool. So is a pre-existing tensor that an ``out=``
      op resized inside capture (CUDA gives it a block of the graph's pool).
    * Pre-existing tensors are read *by storage*, as a GPU graph reads by
      address: an in-place update (``param.add_``) is seen by the next replay,
      but a tensor whose storage was swapped (``param.data = ...``) keeps being
      read from the old storage, so stale-weight bugs show up on CPU as they
      would on a GPU.
    """

    def __init__(self) -> None:
        self._steps: list[_Step] | None = None
        self._num_slots = 0
        self._static_outputs: list[tuple[int, weakref.ref]] = []
        self._output_layouts: list[tuple] = []  # per static output, its _layout at capture end (the address baked in)
        self._externals: list[torch.Tensor] = []
        self._guards: list[_StorageGuard] = []
        self._forget: Callable[[], Any] = lambda: None  # takes the guards' references out of the registry
        self._pool = CPUGraphPool()
        self._order = 0  # capture order within the pool
        self._inference = False  # captured under torch.inference_mode: replayed under it
        self.static_bytes = 0  # bytes of static outputs (capture time)
        self.workspace_bytes = 0  # peak bytes of live intermediates during one replay

    @property
    def is_captured(self) -> bool:
        return self._steps is not None

    @property
    def num_ops(self) -> int:
        return len(self._steps or ())

    def pool(self) -> CPUGraphPool:
        """The pool this graph allocates from; pass it as ``pool=`` to share it with later captures.

        Raises until the graph has been captured, as CUDA's ``pool()`` does ("without a preceding successful
        capture"): a failed capture's pool is known only to a caller that passed a handle."""
        if self._steps is None:
            raise RuntimeError("CPUGraph.pool() called without a preceding successful capture; pass a pool handle "
                               "(CPUGraphPool(), the accelerator's graph_pool_handle()) to capture into instead")
        return self._pool

    def reset(self) -> None:
        self._pool._usage.pop(self, None)
        self._pool._with_outputs.discard(self)
        self._steps = None
        self._static_outputs = []
        self._output_layouts = []
        self._externals = []
        self._forget()
        self._guards = []
        self.static_bytes = self.workspace_bytes = 0

    def _finalize(self, rec: _Recorder, pool: CPUGraphPool) -> None:
        steps = rec.steps
        own = rec.own_storages
        # Storage of each slot when allocated inside capture (None: a view of a pre-existing tensor).
        slot_key, nbytes = _own_storages_of(rec.slot_tensors, own)
        refs = [weakref.ref(t) for t in rec.slot_tensors]
        dtypes = [t.dtype for t in rec.slot_tensors]
        rec.slot_tensors.clear()
        rec.slot_of.clear()
        # No gc.collect() here (it costs ~0.4 s per capture): a tensor kept alive only by a
        # reference cycle is treated as a static output, which costs one copy per replay.
        static = [(slot, ref) for slot, ref in enumerate(refs) if slot_key[slot] is not None and ref() is not None]
        static_keys = {slot_key[s] for s, _ in static}
        # Free each non-static slot after its last use (read or write) in replay.
        last_use: dict[int, int] = {}
        for k, step in enumerate(steps):
            for _, s in step.direct:
                last_use[s] = k
            for _, _, subs, _ in step.nested:
                for _, s in subs:
                    last_use[s] = k
            for _, s in step.kw_direct:
                last_use[s] = k
            for s in step.out_slots:
                if s is not None:
                    last_use[s] = k
        keep = {s for s, _ in static}
        frees: dict[int, list[int]] = {}
        for s, k in last_use.items():
            if s not in keep:
                frees.setdefault(k, []).append(s)
        for k, step in enumerate(steps):
            step.free = tuple(frees.get(k, ()))
        for step in steps:
            if step.fn in _EMPTY_OPS and step.single_out and step.out_slots[0] is not None:
                garbage = _garbage(dtypes[step.out_slots[0]])
                if garbage is not None:
                    step.fn = _poisoned_empty(step.fn, garbage)
        self.workspace_bytes = _peak_intermediate_bytes(steps, slot_key, nbytes, static_keys)
        self.static_bytes = sum(nbytes[key] for key in static_keys)
        _poison(ref() for _, ref in static)  # garbage until the first replay, as on a device
        self._steps = steps
        self._num_slots = len(refs)
        self._static_outputs = static
        self._output_layouts = [_layout(ref()) for _, ref in static]
        self._inference = rec.inference
        readers = [(alias, reader) for _, alias, reader in rec.externals.values()]
        rec.externals.clear()  # the originals: only what outside the graph holds may count as held
        self._externals = [alias for alias, _ in readers]
        self._guards = _storage_guards(readers)
        self._forget = weakref.finalize(self, _forget_guards, [(g.cdata, g.aliases) for g in self._guards])
        self._pool = pool
        pool._usage[self] = (self.static_bytes, self.workspace_bytes)
        pool._captures += 1
        self._order = pool._captures
        if static:
            pool._with_outputs.add(self)

    def _own_outputs(self) -> Iterator[torch.Tensor]:
        """The static outputs still alive and still on the memory the graph writes (not rebound since)."""
        for (_, ref), layout in zip(self._static_outputs, self._output_layouts):
            static = ref()
            if static is not None and _layout(static) == layout:
                yield static

    def replay(self) -> None:
        """Re-issue the recorded ops and update every static output in place.

        A graph captured under ``torch.inference_mode`` replays under it,
        wherever it is replayed (CUDA replays kernels whatever the grad mode).
        Raises :class:`GraphReplayError` where CUDA would silently go wrong:

        * A stale address. A device graph holds no reference to what it uses:
          once nothing but graphs holds a storage a graph uses, that memory is
          free on a device, and a replay would use whatever was allocated there
          next. Only storages something outside the graphs held when capture
          ended are checked (:func:`_storage_guards`). A storage whose memory
          moved (``Tensor.resize_`` growing a graph input) is stale too.
        * A rebound static output: its storage changed since capture
          (``out.data = ...``, ``out.set_(...)``, ``resize_`` growing it), so the
          rebound tensor would stop seeing the results CUDA keeps writing to the
          captured address; or its view of its storage changed
          (``out.resize_(2, 2)``, ``out.t_()``), and CUDA writes the captured
          layout, which copying into the new view would not reproduce.
        """
        steps = self._steps
        if steps is None:
            raise RuntimeError("CPUGraph.replay(): the graph has not been captured")
        if is_cpu_graph_capturing():
            raise _refused("replaying a graph while capturing another is not permitted")
        for guard in self._guards:
            if _use_count(guard.cdata) <= _graph_refs.get(guard.cdata, 0) + _PY_STORAGE_REFS:
                raise _stale(guard, "which nothing but graphs holds any more")
            if guard.alias.data_ptr() != guard.ptr:
                raise _stale(guard, "whose memory was reallocated since capture (Tensor.resize_ growing it)")
        for (_, ref), layout in zip(self._static_outputs, self._output_layouts):
            static = ref()
            if static is not None and _layout(static) != layout:
                raise _rebound(static, layout)
        vals: list[Any] = [None] * self._num_slots
        with torch.inference_mode() if self._inference else torch.no_grad(), torch.autocast("cpu", enabled=False):
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
        if self._pool._with_outputs:
            self._pool._clobber_after(self._order)


def _layout(t: torch.Tensor) -> tuple:
    """Where a static output lives: its storage (identity and memory) and its view of it."""
    storage = t.untyped_storage()
    return storage._cdata, storage.data_ptr(), storage.nbytes(), t.storage_offset(), tuple(t.shape), t.stride()


def _rebound(static: torch.Tensor, layout: tuple) -> GraphReplayError:
    shape = list(layout[4])
    now = "its shape or strides" if _layout(static)[:3] == layout[:3] else "its storage"
    return GraphReplayError(
        f"CPU graph emulation: a static output of this graph (captured as a {shape} "
        f"{str(static.dtype).removeprefix('torch.')} tensor) no longer lives where the graph writes it: {now} "
        "changed since capture (out.data = ..., out.set_(...), out.resize_(...), an in-place view op). On a device "
        "the graph keeps writing the captured address, so that tensor would no longer see the results. Don't "
        "rebind graph outputs: copy them (out.clone(), buf.copy_(out)) and leave the output itself alone."
    )


def _stale(guard: _StorageGuard, why: str) -> GraphReplayError:
    return GraphReplayError(
        f"CPU graph emulation: this replay would use freed memory, a stale address: {guard.what}, {why} (on a "
        "device the graph reads and writes whatever was allocated there since). Keep every tensor a graph uses "
        "alive and update it in place (copy_), or capture a new graph after replacing it."
    )


class _StorageGuard(NamedTuple):
    ref: StorageWeakRef  # keeps ``cdata`` valid without keeping the memory alive
    cdata: int
    aliases: int  # references this graph holds
    what: str
    alias: torch.Tensor  # one of them (the graph holds it anyway)
    ptr: int  # its data pointer at capture end: the address the graph baked in


_use_count = torch._C._storage_Use_Count


def _python_storage_refs() -> int:
    """References a storage's preserved Python object adds to its use count (1 on current torch)."""
    t = torch.zeros(1)
    ref = StorageWeakRef(t.untyped_storage())
    return _use_count(ref.cdata) - 1


_PY_STORAGE_REFS = _python_storage_refs()
# Per guarded storage, the references all live graphs hold: several graphs read the same weights, and each
# one's references must not count as "held outside" for the others.
_graph_refs: dict[int, int] = {}
# Re-entrant: a graph collected while a capture end holds it (a GC pass inside _storage_guards) runs
# _forget_guards in the same thread.
_graph_refs_lock = threading.RLock()


def _storage_guards(readers: list[tuple[torch.Tensor, str]]) -> list[_StorageGuard]:
    """One guard per storage the graph reads that something outside the graphs held at capture end.

    The rest (scalars the dispatcher wrapped) are the graph's own. Holding a storage means holding a tensor on
    it: a bare ``UntypedStorage`` object, or a NumPy array behind a dropped ``from_numpy`` tensor, does not count
    (refused where CUDA might still work)."""
    found: dict[int, list[Any]] = {}
    for alias, reader in readers:
        storage = alias.untyped_storage()  # materialises the Python object: counted in _PY_STORAGE_REFS
        if storage.nbytes() == 0:
            continue
        ref = StorageWeakRef(storage)
        del storage
        entry = found.get(ref.cdata)
        if entry is None:
            found[ref.cdata] = [ref, 1, alias, reader]
        else:
            entry[1] += 1
    guards = []
    with _graph_refs_lock:
        for cdata, (ref, aliases, alias, reader) in found.items():
            held_by_graphs = _graph_refs.get(cdata, 0) + aliases
            if _use_count(cdata) > held_by_graphs + _PY_STORAGE_REFS:
                _graph_refs[cdata] = held_by_graphs
                what = f"a {list(alias.shape)} {str(alias.dtype).removeprefix('torch.')} tensor (first used by {reader})"
                guards.append(_StorageGuard(ref, cdata, aliases, what, alias, alias.data_ptr()))
    return guards


def _forget_guards(counts: list[tuple[int, int]]) -> None:
    """A graph's references are gone (reset or collected): take them out of :data:`_graph_refs`."""
    with _graph_refs_lock:
        for cdata, aliases in counts:
            left = _graph_refs.get(cdata, 0) - aliases
            if left > 0:
                _graph_refs[cdata] = left
            else:
                _graph_refs.pop(cdata, None)


def _own_storages_of(tensors: list[torch.Tensor], own: set[int]) -> tuple[list[int | None], dict[int, int]]:
    """Per slot, its storage key when allocated inside capture (else None), and each storage's bytes."""
    keys: list[int | None] = []
    nbytes: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        key = storage._cdata
        if storage.nbytes() > 0 and key in own:
            keys.append(key)
            nbytes[key] = storage.nbytes()
        else:
            keys.append(None)
    return keys, nbytes


def _peak_intermediate_bytes(
    steps: list[_Step], slot_key: list[int | None], nbytes: dict[int, int], static_keys: set[int]
) -> int:
    """Peak bytes of intermediate storages alive at once while replaying ``steps``."""
    views: dict[int, int] = {}  # storage -> slots still holding it
    for key in slot_key:
        if key is not None and key not in static_keys:
            views[key] = views.get(key, 0) + 1
    live = peak = 0
    born: set[int] = set()
    for step in steps:
        for s in step.out_slots:
            key = slot_key[s] if s is not None else None
            if key in views and key not in born:
                born.add(key)
                live += nbytes[key]
        peak = max(peak, live)
        for s in step.free:
            key = slot_key[s]
            if key in views:
                views[key] -= 1
                if views[key] == 0:
                    live -= nbytes[key]
    return peak


@contextlib.contextmanager
def capture_cpu_graph(
    graph: CPUGraph, pool: CPUGraphPool | None = None, *, capture_error_mode: str | None = None
) -> Iterator[None]:
    """Record the work issued inside the block into ``graph`` (CUDA capture semantics).

    The current stream must not be the default stream (CUDA refuses to capture
    there), nor one that is capturing or that another thread has current; it
    belongs to this thread until the capture ends. ``pool`` shares a
    :class:`CPUGraphPool` with earlier graphs (``None``: the graph's own). A
    capture that fails leaves its pool recording (see :class:`CPUGraphPool`).

    * Host values (Python ints, shapes, counters read in Python) are frozen
      into the recording, as a CUDA graph freezes kernel launch parameters.
    * Capture runs nothing on the device, so it must not change pre-existing
      tensors: ops run for real (so Python can keep going), storages they
      mutate are snapshotted on first write and restored at capture end. The
      first real execution is the first replay.
    * Capture does not advance the default generator (CUDA records draws at
      offsets of its own): its state is restored at capture end, and each
      replay draws fresh numbers from it. Seeding it inside capture fails the
      capture (CUDA's generator asserts it is not capturing): the
      accelerator's ``manual_seed`` raises at once, and capture end compares
      the generator's seed with the one it began with, before restoring it,
      which catches ``torch.manual_seed`` with another seed and ``torch.seed()``.
    * ``capture_error_mode`` is CUDA's (:data:`CAPTURE_ERROR_MODES`; ``None``:
      this thread's :func:`cpu_capture_error_mode`, else
      :data:`DEFAULT_CAPTURE_ERROR_MODE`). In ``"thread_local"``, which every
      backend path requests, and ``"relaxed"`` (the same here: the emulation
      models no allocations), another thread's work on other streams, its host
      reads and its waits neither break a capture nor are recorded into it. In
      ``"global"`` (PyTorch's default) another thread's host read or wait is
      refused and invalidates the capture, as CUDA fails both. The capturing
      thread's own rules, and those of the capturing stream, are the same in
      every mode.
    """
    mode = _checked_mode(capture_error_mode or getattr(_state, "capture_error_mode", None)
                         or DEFAULT_CAPTURE_ERROR_MODE)
    if is_cpu_graph_capturing():
        raise _refused("nested graph capture is not permitted")
    if graph.is_captured:
        raise RuntimeError("this graph was already captured; call reset() or create a new graph")
    if pool is not None and not isinstance(pool, CPUGraphPool):
        raise TypeError(f"pool must be a CPUGraphPool from graph_pool() or graph_pool_handle(), got "
                        f"{type(pool).__name__}")
    stream = current_cpu_stream()
    if stream is _DEFAULT_STREAM:
        raise GraphCaptureError(
            "graphs must be captured on a non-default stream (CUDA refuses capture on the default "
            "stream); capture_to_graph(stream=None) captures on the accelerator's graph_stream()"
        )
    pool = pool if pool is not None else graph._pool
    rec = _Recorder()
    rec.mode = mode
    me = threading.current_thread()
    with _captures_lock:
        if _captures:
            busy = next(iter(_captures.values()))
            raise GraphCaptureError(
                f"thread {busy.thread.name!r} is capturing on {busy.stream!r}: one capture at a time per process "
                "(PyTorch's rule for CUDA graphs; the caching allocator and capture isolation assume it). Hold "
                "graph_capture_lock() around warm-up and capture, as the accelerators and the decode runner do."
            )
        others = [t.name for t in stream._current_in if t is not me]
        if others:
            raise GraphCaptureError(
                f"{stream!r} is the current stream of thread(s) {others} too: on CUDA their work on it would be "
                "recorded into this graph and never run. Give each thread (or runner) its own graph stream."
            )
        pool._begin()
        _captures[stream] = rec
        if mode == "global":
            _begin_global_mode()
    guard = _HostSyncGuard(rec)
    rng = torch.default_generator.get_state()
    seed = torch.default_generator.initial_seed()
    _state.recorder = rec
    _state.guard = guard
    ok = finalized = False
    failed = None
    try:
        try:
            with _fast_paths_as_without_emulation(), guard, rec:
                yield
            ok = True
        finally:
            _state.recorder = None
            _state.guard = None
            with _captures_lock:
                del _captures[stream]
                if mode == "global":
                    _end_global_mode()
            # Before the restore below puts the old seed back: CUDA refuses to seed while capturing.
            reseeded = torch.default_generator.initial_seed() != seed
            torch.default_generator.set_state(rng)  # a capture draws nothing: CUDA keeps the eager offset
            failed = _restore(rec.snapshots.values())
            rec.snapshots.clear()
            if not ok:
                rec.externals.clear()
        # the body completed
        if failed is not None:
            raise GraphCaptureError(f"CPU graph emulation: restoring what the capture wrote failed: {failed}") from failed
        if rec.invalidated_by is not None:
            raise GraphCaptureError(
                f"the capture was invalidated by thread {rec.invalidated_by!r}, whose call was refused while it ran "
                f"(CUDA: cudaErrorStreamCaptureInvalidated at capture end). Its refusal: {rec.invalidated}"
            ) from rec.invalidated
        if rec.invalidated is not None:
            raise GraphCaptureError(
                "the capture was invalidated by an operation refused inside it, although the body caught the "
                f"error (CUDA: cudaErrorStreamCaptureInvalidated at capture end). The first: {rec.invalidated}"
            ) from rec.invalidated
        if reseeded:
            raise GraphCaptureError(
                "the default generator was seeded inside the capture (torch.manual_seed with another seed, "
                "torch.seed(), torch.default_generator.manual_seed or set_state): CUDA refuses to seed its "
                "generator while a capture is running. Seed before capture; the graph draws fresh numbers from the "
                "default generator at every replay."
            )
        unjoined = [stream for stream, pending in rec.joined.items() if pending]
        if unjoined:
            raise GraphCaptureError(
                f"side stream(s) {unjoined} forked from the capture did work that never rejoined it (the capture "
                "stream never waited on them afterwards): CUDA fails capture end (cudaErrorStreamCaptureUnjoined). "
                "End the fork with capturing.wait_stream(side) before the capture ends"
            )
        graph._finalize(rec, pool)
        finalized = True
    finally:
        rec.externals.clear()
        if finalized:
            pool._end(None)
        else:  # its pool keeps recording, holding what the capture allocated
            _, nbytes = _own_storages_of(rec.slot_tensors, rec.own_storages)
            rec.slot_tensors.clear()
            rec.slot_of.clear()
            pool._end(sum(nbytes.values()))


def _restore(snapshots: Iterable[tuple[torch.Tensor, torch.UntypedStorage, int]]) -> Exception | None:
    """Undo capture-time writes to pre-existing storages; the first failure, after trying every one.

    A storage the capture resized (an ``out=`` op; empty ones included) got new memory, which on a device is a
    block of the graph's pool: garbage until the first replay, not its old contents."""
    failed = None
    for alias, saved, ptr in snapshots:
        storage = alias.untyped_storage()
        try:
            if storage.nbytes() != saved.nbytes() or storage.data_ptr() != ptr:
                _poison((alias,))
            else:
                storage.copy_(saved)
        except Exception as e:  # noqa: BLE001 - restore the rest first
            failed = failed or e
    return failed
