"""CUDA-graph rules the CPU emulation enforces beyond recording ops.

The emulation is the only "GPU" CI has, so each test here pins one place where
CUDA capture fails or misbehaves: the default stream, host data copied in
during capture, host reads (in every overload, and those a CUDA kernel does
inside one op), the nn fast paths, refusals the body catches, metadata changed
in place, host waits on events, seeding and emptying the cache, outputs that
hold garbage until the first replay, and the memory a graph pool holds.
"""

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import BaseTorchFunctionMode

from hybrid_engine.accelerator import (
    Accelerator,
    CPUAccelerator,
    CPUGraphPool,
    CPUStream,
    GraphCaptureError,
    TorchBackendAccelerator,
)


@pytest.fixture
def acc():
    return CPUAccelerator()


def capture(acc, fn, **kw):
    g = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(g, **kw):
        out = fn()
    return g, out


# ------------------------------------------------------------------- streams
def test_cpu_streams(acc):
    default = acc.default_stream()
    assert isinstance(default, CPUStream) and default.is_default
    assert acc.current_stream() is default
    s = acc.Stream()
    assert isinstance(s, CPUStream) and s is not default and s is not acc.Stream()
    with acc.stream(s) as entered:
        assert entered is s and acc.current_stream() is s
    assert acc.current_stream() is default
    with acc.stream(None):
        assert acc.current_stream() is default
    assert s.query() is True
    s.synchronize()
    s.wait_stream(default)
    with pytest.raises(TypeError):
        s.wait_stream("not a stream")
    side = acc.graph_stream()
    assert side is acc.graph_stream() and not side.is_default  # owned, made once
    assert CPUAccelerator().graph_stream() is not side  # one per accelerator
    assert CPUAccelerator(emulate_graphs=False).graph_stream() is not None  # streams without graphs


def test_current_stream_is_per_thread(acc):
    seen = []
    with acc.stream(acc.Stream()):
        t = threading.Thread(target=lambda: seen.append(acc.current_stream()))
        t.start()
        t.join()
    assert seen == [acc.default_stream()]


def test_on_graph_stream_waits_both_ways(acc, monkeypatch):
    log = []
    monkeypatch.setattr(CPUStream, "wait_stream", lambda self, other: log.append((self, other)))
    side, default = acc.graph_stream(), acc.default_stream()
    with acc.on_graph_stream() as s:
        assert s is side and acc.current_stream() is side
        log.append("work")
    assert acc.current_stream() is default
    assert log == [(side, default), "work", (default, side)]
    log.clear()
    capture(acc, lambda: torch.ones(2) + 1)
    assert log == [(side, default), (default, side)]


def test_capture_runs_on_the_owned_side_stream(acc):
    streams = []
    g, _ = capture(acc, lambda: streams.append(acc.current_stream()))
    assert streams == [acc.graph_stream()]
    assert acc.current_stream() is acc.default_stream()
    s = acc.Stream()
    g, _ = capture(acc, lambda: streams.append(acc.current_stream()), stream=s)
    assert streams[-1] is s


def test_warm_up_and_capture_inside_on_graph_stream(acc):
    x = torch.ones(3)
    with acc.on_graph_stream():
        eager = x * 3
        g, y = capture(acc, lambda: x * 3)
    acc.replay_graph(g)
    assert torch.equal(y, eager)


def test_capture_on_the_default_stream_is_refused(acc):
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="non-default stream"):
        with acc.capture_to_graph(g, stream=acc.default_stream()):
            pass
    assert not g.is_captured and not acc.is_current_stream_capturing()
    assert acc.current_stream() is acc.default_stream()
    with pytest.raises(TypeError, match="CPUStream"), acc.capture_to_graph(g, stream="side"):
        pass


def test_work_on_the_default_stream_during_capture_raises(acc):
    x = torch.ones(3)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="default stream"), acc.capture_to_graph(g):
        y = x + 1
        with acc.stream(acc.default_stream()):
            y * 2
    assert not g.is_captured


# ----------------------------------------------------------------- host data
@pytest.mark.parametrize(
    "bad",
    [
        lambda x: torch.tensor([1, 2]),
        lambda x: torch.tensor(3, dtype=torch.int64),
        lambda x: torch.as_tensor([1.0, 2.0]),
        lambda x: torch.from_numpy(np.ones(2)),
        lambda x: x.new_tensor([1.0]),
        lambda x: x[[0, 2]],
        lambda x: x.__setitem__([0, 2], 1.0),
    ],
    ids=["tensor-list", "tensor-int", "as_tensor", "from_numpy", "new_tensor", "list-index", "list-index-setitem"],
)
def test_host_data_inside_capture_raises(acc, bad):
    """On a device these are host-to-device copies (``torch.tensor(v, device=dev)``), illegal in capture.

    The emulation cannot tell a host-side CPU tensor from a device one, so it rejects them all.
    """
    x = torch.zeros(4)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="host data"), acc.capture_to_graph(g):
        bad(x)
    assert not acc.is_current_stream_capturing()
    bad(x)  # fine outside capture


@pytest.mark.parametrize(
    "ok,want",
    [
        (lambda x: x * 2 + 5, [5.0, 7.0, 9.0, 11.0]),
        (lambda x: torch.full((4,), 3.0) + x, [3.0, 4.0, 5.0, 6.0]),
        (lambda x: torch.zeros(4) + x, [0.0, 1.0, 2.0, 3.0]),
        (lambda x: torch.scalar_tensor(2.0) * x, [0.0, 2.0, 4.0, 6.0]),
        (lambda x: torch.where(x > 1, x, 0.0), [0.0, 0.0, 2.0, 3.0]),
        (lambda x: x.masked_fill(x > 2, -1.0), [0.0, 1.0, 2.0, -1.0]),
    ],
    ids=["arith", "full", "zeros", "scalar_tensor", "where-scalar", "masked_fill"],
)
def test_device_work_with_python_scalars_is_capturable(acc, ok, want):
    x = torch.arange(4.0)
    g, y = capture(acc, lambda: ok(x))
    acc.replay_graph(g)
    assert y.tolist() == want


def test_scalar_setitem_is_capturable(acc):
    """``t[i] = 3`` lifts a CPU scalar here, but on a device it is a fill kernel: legal in capture. A NumPy
    scalar is a host scalar too."""
    idx = torch.tensor([1])

    def step():
        y = torch.zeros(4)
        y[0] = 7
        y[idx] = 2.5
        y[2:] = True
        n = torch.zeros(2, dtype=torch.int64)
        n[0] = np.int64(3)
        n[1:] = np.int32(4)
        return y, n

    g, (y, n) = capture(acc, step)
    acc.replay_graph(g)
    assert y.tolist() == [7.0, 2.5, 1.0, 1.0] and n.tolist() == [3, 4]


def test_bool_mask_setitem_with_a_scalar_is_a_masked_fill(acc):
    """CUDA's ``index_put_`` turns ``x[mask] = <host scalar>`` into ``masked_fill_``: no nonzero, no sync."""
    x = torch.arange(6.0)
    mask = x > 2

    def step():
        y = x * 1
        y[mask] = float("-inf")
        z = x.long().repeat(2, 1)
        z[:, mask] = np.int64(-1)
        return y, z

    g, (y, z) = capture(acc, step)
    for m in (mask, ~mask):  # the graph reads the mask on the device, at every replay
        mask.copy_(m)
        acc.replay_graph(g)
        assert torch.equal(y, x.masked_fill(mask, float("-inf")))
        assert torch.equal(z, x.long().masked_fill(mask, -1).repeat(2, 1))


@pytest.mark.parametrize(
    "bad",
    [
        lambda x, m: x.__setitem__(m, x[0]),
        lambda x, m: x.index_put_((m,), torch.scalar_tensor(1.0)),
        lambda x, m: x.__setitem__((m, m), 1.0),
        lambda x, m: x.index_put_((m,), torch.ones(()), accumulate=True),
    ],
    ids=["tensor-value", "index_put-0-dim-tensor", "two-masks", "accumulate"],
)
def test_bool_mask_puts_that_need_nonzero_raise(acc, bad):
    """A tensor value, two masks or ``accumulate=True`` take CUDA's ``nonzero`` path: a host sync."""
    x = torch.arange(6.0).reshape(6, 1).expand(6, 6).clone()
    m = torch.arange(6) > 2
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="boolean mask"), acc.capture_to_graph(g):
        bad(x, m)


@pytest.mark.parametrize(
    "bad,what",
    [
        (lambda x: str(x), "printing a tensor"),
        (lambda x: print(x), "printing a tensor"),
        (lambda x: "%s" % (x,), "printing a tensor"),
        (lambda x: f"{x}", "formatting a tensor"),
        (lambda x: np.asarray(x), r"numpy\.asarray"),
        (lambda x: x.__dlpack__(), "__dlpack__"),
        (lambda x: torch.allclose(x, x), "torch.allclose"),
        (lambda x: torch.multinomial(x.softmax(0), 1), "torch.multinomial"),
        (lambda x: torch.multinomial(x.softmax(0), 2, replacement=False), "torch.multinomial"),
        (lambda x: x.to("cpu"), r"Tensor.to\('cpu'\)"),
        (lambda x: x.to("cpu", copy=True), r"Tensor.to\('cpu'\)"),
        (lambda x: x.to(device="cpu:0", copy=True), r"Tensor.to\('cpu'\)"),
        (lambda x: x.type("torch.DoubleTensor"), r"Tensor.type\(<a CPU tensor type>\)"),
        (lambda x: x.type(torch.FloatTensor), r"Tensor.type\(<a CPU tensor type>\)"),
        (lambda x: x.type(dtype="torch.LongTensor"), r"Tensor.type\(<a CPU tensor type>\)"),
        (lambda x: torch.histc(x), "torch.histc without a range"),
        (lambda x: torch.linalg.inv(torch.eye(2) + x[:1, None]), "linalg error check"),
        # out= overloads run the same host read
        (lambda x: torch.nonzero(x, out=torch.empty(0, dtype=torch.long)), "torch.nonzero"),
        (lambda x: torch.masked_select(x, x > 1, out=torch.empty(0)), "torch.masked_select"),
        (lambda x: torch.multinomial(x.softmax(0), 1, out=torch.empty(1, dtype=torch.long)), "torch.multinomial"),
        (lambda x: torch.histc(x, bins=4, out=torch.empty(4)), "torch.histc without a range"),
        # CUDA linalg kernels that check their info flags (or compute) on the host, with no *_ex form
        (lambda x: torch.linalg.svd(x.view(2, 2) + 1), "torch.linalg.svd"),
        (lambda x: torch.linalg.svdvals(x.view(2, 2) + 1), "torch.linalg.svd"),
        (lambda x: torch.linalg.matrix_rank(x.view(2, 2) + 1), "torch.linalg.svd"),
        (lambda x: torch.linalg.pinv(x.view(2, 2) + 1), "torch.linalg.pinv"),
        (lambda x: torch.linalg.eigh(x.view(2, 2) + 1), "torch.linalg.eigh"),
        (lambda x: torch.linalg.eigvalsh(x.view(2, 2) + 1), "torch.linalg.eigh"),
        (lambda x: torch.linalg.eig(x.view(2, 2) + 1), "torch.linalg.eig"),
        (lambda x: torch.linalg.eigvals(x.view(2, 2) + 1), "torch.linalg.eig"),
        (lambda x: torch.linalg.lstsq(x.view(2, 2) + 1, x[:2, None]), "torch.linalg.lstsq"),
        (lambda x: torch.repeat_interleave(x, x.long()), "repeat_interleave with tensor repeats"),
    ],
    ids=["str", "print", "percent-s", "f-string", "numpy", "dlpack", "allclose", "multinomial-1",
         "multinomial-no-replacement", "to-cpu", "to-cpu-copy", "to-device-cpu", "type-name", "type-class",
         "type-keyword", "histc", "linalg-inv", "nonzero-out", "masked_select-out", "multinomial-out", "histc-out",
         "svd", "svdvals", "matrix_rank", "pinv", "eigh", "eigvalsh", "eig", "eigvals", "lstsq",
         "repeat_interleave"],
)
def test_host_reads_hidden_in_printing_and_checking_ops_raise(acc, bad, what):
    """On a device, printing a tensor (a logging hook, say) reads it on the host, and the CUDA kernels of
    ``allclose`` and of ``multinomial`` without replacement call ``.item()``: capture fails. Here the read
    happens where the dispatcher cannot see it, so the emulation refuses the call by name."""
    x = torch.arange(4.0)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match=what), acc.capture_to_graph(g):
        bad(x)
    bad(x)  # fine outside capture


@pytest.mark.parametrize(
    "bad,what",
    [
        (lambda x: x.masked_fill(x > 2, x[0]), "masked_fill with a tensor value"),
        (lambda x: (x * 1).masked_fill_(x > 2, torch.scalar_tensor(-1.0)), "masked_fill_ with a tensor value"),
        (lambda x: torch.ops.aten.masked_fill.Tensor_out(x, x > 2, x[0], out=torch.empty(4)),
         "masked_fill with a tensor value"),
        (lambda x: x.index_fill(0, x[:2].long(), x[0]), "index_fill with a tensor value"),
        (lambda x: (x * 1).index_fill_(0, x[:2].long(), x[0]), "index_fill_ with a tensor value"),
        (lambda x: torch.linspace(x[0], x[3], 4), "torch.linspace with a tensor start or end"),
        (lambda x: torch.linspace(x[0], 3.0, 4), "torch.linspace with a tensor start or end"),
        (lambda x: torch.linspace(0.0, x[3], 4, out=torch.empty(4)), "torch.linspace with a tensor start or end"),
        (lambda x: torch.logspace(x[0], x[1], 3), "torch.logspace with a tensor start or end"),
        (lambda x: torch.normal(x, x + 1), "torch.normal with a tensor std"),
        (lambda x: torch.normal(0.0, x + 1), "torch.normal with a tensor std"),
        (lambda x: torch.isin(torch.arange(8), torch.arange(40)), "torch.isin with assume_unique=False"),
        (lambda x: torch.isin(x, x.repeat(3)), "torch.isin with assume_unique=False"),
        (lambda x: torch.isin(3, torch.arange(10)), "torch.isin with assume_unique=False"),
        (lambda x: torch.segment_reduce(x, "sum", lengths=torch.full((2,), 2)), "torch.segment_reduce with lengths"),
    ],
    ids=["masked_fill", "masked_fill_", "masked_fill-out", "index_fill", "index_fill_", "linspace",
         "linspace-tensor-start", "linspace-out", "logspace", "normal", "normal-float-mean", "isin-sorting",
         "isin-repeated", "isin-scalar-element", "segment_reduce-lengths"],
)
def test_host_reads_inside_one_op_raise(acc, bad, what):
    """These CUDA kernels call ``.item()`` (``isin``: ``torch.unique``) on a tensor argument inside the one aten op
    the recorder sees, so no separate host read ever reaches it: the emulation refuses the op by its arguments."""
    x = torch.arange(4.0)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match=what), acc.capture_to_graph(g):
        bad(x)
    assert not g.is_captured
    bad(x)  # fine outside capture


def test_the_same_ops_with_host_scalars_or_without_the_check_are_capturable(acc):
    """A Python scalar value, start, end or std is a kernel parameter; ``isin`` with few test elements (or told
    ``assume_unique``) never calls ``unique``; ``segment_reduce`` with ``unsafe=True`` or ``offsets`` checks
    nothing on the host."""
    x, idx = torch.arange(4.0), torch.tensor([0, 1])
    lengths, offsets = torch.tensor([1, 3]), torch.tensor([0, 1, 4])

    def step():
        filled = x.masked_fill(x > 2, -1.0) + x.index_fill(0, idx, 7.0)
        spaced = torch.linspace(0.0, 3.0, 4) + torch.logspace(0.0, 1.0, 4)
        drawn = torch.normal(x, 0.0)  # std 0: the mean, exactly
        found = torch.isin(x, x[:2]).float() + torch.isin(x, torch.arange(12.0) + 2, assume_unique=True).float()
        reduced = (torch.segment_reduce(x, "sum", lengths=lengths, unsafe=True)
                   + torch.segment_reduce(x, "sum", offsets=offsets))
        return filled, spaced, drawn, found, reduced

    g, outs = capture(acc, step)
    x.add_(1)  # read on the device at every replay
    acc.replay_graph(g)
    assert [o.tolist() for o in outs] == [o.tolist() for o in step()]


def test_one_hot_given_num_classes_is_capturable_and_checks_the_class_values_at_replay(acc):
    """CUDA's ``one_hot`` reads nothing on the host when told ``num_classes`` (a scatter, whose device assert
    fires on an out-of-range class); without it, it reads the maximum with ``.item()``."""
    idx = torch.tensor([[0, 2], [1, 0]])
    g, (out, empty) = capture(acc, lambda: (F.one_hot(idx, num_classes=3), F.one_hot(idx[:0], 3)))
    acc.replay_graph(g)
    assert torch.equal(out, F.one_hot(idx, 3)) and empty.shape == (0, 2, 3)
    idx.copy_(torch.tensor([[2, 2], [0, 1]]))
    acc.replay_graph(g)
    assert torch.equal(out, F.one_hot(idx, 3))
    idx.fill_(3)
    with pytest.raises(RuntimeError, match="out of bounds"):
        acc.replay_graph(g)
    with pytest.raises(GraphCaptureError, match="reading a tensor value"), acc.capture_to_graph(acc.create_graph()):
        F.one_hot(idx)


# --------------------------------------------------------------- nn fast paths
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("mask_check", [True, False], ids=["mask-check", "no-mask-check"])
def test_the_transformer_encoder_fast_path_with_a_padding_mask_raises(acc, mask_check):
    """In eval mode with a padding mask, ``nn.TransformerEncoder`` converts its input to a nested tensor: on CUDA
    the sizes come from the mask, read on the host, and capture fails. The emulation must take the fast path
    (the warm-up's) during capture too, and refuse its nested-tensor ops."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True, mask_check=mask_check).eval()
    src = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="_nested_tensor_from_mask"):
        with torch.no_grad(), acc.capture_to_graph(g):
            enc(src, src_key_padding_mask=pad)
    assert torch.overrides.has_torch_function is torch._C._has_torch_function  # restored after a failed capture
    sizes = torch.tensor([[5, 8], [3, 8]])
    with pytest.raises(GraphCaptureError, match="_nested_from_padded"), acc.capture_to_graph(acc.create_graph()):
        torch._nested_from_padded(src, sizes)


def test_nn_fast_path_checks_see_what_they_would_without_the_emulation(acc):
    """The emulation's torch-function mode would make ``has_torch_function`` true for every tensor, sending nn
    modules down their slow path during capture only. It answers as without the emulation while capturing (and
    is the original again after), but still counts a mode of the caller's own."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0).eval()
    src = torch.randn(2, 5, 8)
    original = torch.overrides.has_torch_function
    g = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(g):
        assert not torch.overrides.has_torch_function((src,))
        with BaseTorchFunctionMode():
            assert torch.overrides.has_torch_function((src,))
        out = layer(src)
    assert torch.overrides.has_torch_function is original
    assert g.num_ops < 5  # the fused fast-path kernel, not the ~40 ops of the slow path
    acc.replay_graph(g)
    with torch.no_grad():
        torch.testing.assert_close(out, layer(src))


def test_device_moves_and_checked_forms_that_read_nothing_on_the_host_are_capturable(acc):
    """``x.to(<the device>)`` and ``x.type(<a dtype>)`` stay on the device on a GPU too; ``histc`` with a range,
    the ``*_ex`` linalg forms without an error check and ``repeat_interleave`` told its ``output_size`` read
    nothing on the host."""
    x = torch.arange(4.0)
    reps = torch.tensor([0, 2, 1, 0])

    def step():
        a = x.to(x.device) + x.to(torch.device("cpu"), torch.float64).float() + x.type(torch.float64).float()
        assert x.type() == "torch.FloatTensor"  # a name, no copy
        h = torch.histc(x, bins=4, min=0, max=4)
        inv, _ = torch.linalg.inv_ex(torch.eye(2) * 2)
        r = torch.repeat_interleave(x, reps, output_size=3) + x.repeat_interleave(reps, dim=0, output_size=3)
        return a + h + inv.sum(), r

    g, (out, r) = capture(acc, step)
    acc.replay_graph(g)
    assert out.tolist() == [2.0, 5.0, 8.0, 11.0]
    assert r.tolist() == [2.0, 2.0, 4.0]


def test_multinomial_with_replacement_is_capturable(acc):
    """Its CUDA kernel for several samples with replacement reads nothing on the host."""
    p = torch.tensor([0.0, 0.0, 1.0, 0.0])
    g, out = capture(acc, lambda: torch.multinomial(p, 3, replacement=True))
    acc.replay_graph(g)
    assert out.tolist() == [2, 2, 2]


@pytest.mark.parametrize(
    "draw",
    [
        lambda gen: torch.rand(3, generator=gen),
        lambda gen: torch.poisson(torch.full((3,), 3.0), generator=gen),  # passed on positionally
        lambda gen: torch._standard_gamma(torch.ones(3), gen),
    ],
    ids=["keyword", "poisson", "positional"],
)
def test_an_explicit_generator_inside_capture_raises(acc, draw):
    """A device graph freezes an unregistered generator's state; the emulation has no registration, so it
    refuses any explicit generator but the default one, which CUDA registers with every capture (it advances
    at every replay, as CUDA's philox offsets do)."""
    gen = torch.Generator().manual_seed(0)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="explicit torch.Generator"), acc.capture_to_graph(g):
        draw(gen)
    g, out = capture(acc, lambda: draw(torch.default_generator))
    acc.replay_graph(g)
    first = out.clone()
    acc.replay_graph(g)
    assert not torch.equal(first, out)


@pytest.mark.parametrize(
    "refused,what",
    [
        (lambda y: int(y.sum()), "reading a tensor value on the host"),
        (lambda y: print("debug", y), "printing a tensor"),
        (lambda y: torch.tensor([1, 2]), "host data"),
    ],
    ids=["int", "print", "tensor"],
)
def test_a_refusal_the_body_catches_still_fails_the_capture(acc, refused, what):
    """On CUDA the illegal call invalidates the capture (``cudaErrorStreamCaptureInvalidated`` at capture end),
    so a body that tolerates the error (a fallback, a logging hook) still gets no graph."""
    x = torch.arange(4.0)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match=f"invalidated.*The first: .*{what}"), acc.capture_to_graph(g):
        y = x * 2
        for bad in (refused, lambda y: y.tolist()):  # the first refusal is the one named
            try:
                bad(y)
            except GraphCaptureError:
                pass
    assert not g.is_captured and not acc.is_current_stream_capturing()
    g, y = capture(acc, lambda: x * 2)  # the next capture starts clean
    acc.replay_graph(g)
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize(
    "change",
    [
        lambda w, other: w.t_(),
        lambda w, other: w.unsqueeze_(0),
        lambda w, other: w.squeeze_(),
        lambda w, other: w.transpose_(0, 1),
        lambda w, other: w.as_strided_((2, 2), (1, 2)),
        lambda w, other: w.set_(other),
        lambda w, other: w.set_(other.untyped_storage(), 0, (2, 2), (2, 1)),
        lambda w, other: setattr(w, "data", other),
    ],
    ids=["t_", "unsqueeze_", "squeeze_", "transpose_", "as_strided_", "set_", "set_-storage", "data"],
)
def test_changing_a_preexisting_tensors_metadata_in_place_raises(acc, change):
    """On a device this changes host metadata once, at capture, and kernels captured after it keep the new
    shape or storage; re-issuing it at every replay (what a recording of ops does) alternates shapes or reads
    the wrong storage, so the emulation refuses it (before it runs)."""
    w, other, x = torch.eye(2), torch.full((2, 2), 3.0), torch.ones(1, 2)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="metadata .* of a tensor that existed before capture"):
        with acc.capture_to_graph(g):
            x @ w
            change(w, other)
            x @ w
    assert not g.is_captured and torch.equal(w, torch.eye(2))


def test_metadata_changed_in_place_on_a_tensor_made_inside_capture_replays(acc):
    """A tensor made inside capture is made afresh at every replay: changing its metadata replays faithfully."""
    x = torch.arange(6.0)

    def step():
        y = (x * 1).view(2, 3)
        y.t_()
        y.unsqueeze_(0)
        return y + 0

    g, out = capture(acc, step)
    for _ in range(3):
        acc.replay_graph(g)
        assert out.shape == (1, 3, 2) and torch.equal(out[0], x.view(2, 3).t())


def test_synchronising_or_querying_inside_capture_raises(acc):
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="synchronize"), acc.capture_to_graph(g):
        acc.synchronize()
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="synchronize"), acc.capture_to_graph(g):
        acc.current_stream().synchronize()
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="query"), acc.capture_to_graph(g):
        acc.current_stream().query()
    acc.synchronize()  # fine outside capture
    assert acc.current_stream().query() is True


def test_events_record_inside_capture_but_host_waits_on_them_raise(acc):
    """Recording an event inside capture is legal on CUDA (a dependency inside the graph); waiting for it on the
    host is not. The CPU has no device clock: no timing events."""
    ev = acc.Event()
    ev.record()
    ev.wait(acc.Stream())
    assert ev.query() is True
    ev.synchronize()
    assert acc.Event(enable_timing=True) is None
    for wait in ("synchronize", "query"):
        g = acc.create_graph()
        with pytest.raises(GraphCaptureError, match=f"event.{wait}"), acc.capture_to_graph(g):
            y = torch.ones(2) * 2
            ev.record()
            ev.wait()
            getattr(ev, wait)()
        assert not g.is_captured
    g, y = capture(acc, lambda: (ev.record(acc.current_stream()), torch.ones(2) * 2)[1])
    acc.replay_graph(g)
    assert y.tolist() == [2.0, 2.0]
    with pytest.raises(TypeError, match="CPUStream"):
        ev.record("not a stream")


@pytest.mark.parametrize(
    "call,what",
    [
        (lambda acc: acc.manual_seed(1), "accelerator.manual_seed"),
        (lambda acc: acc.empty_cache(), r"accelerator.empty_cache\(\)"),
    ],
    ids=["manual_seed", "empty_cache"],
)
def test_seeding_or_emptying_the_cache_inside_capture_raises(acc, call, what):
    """CUDA's generator asserts it is not capturing when seeded; its allocator asserts no capture is underway when
    it empties its cache. A body that catches the error still gets no graph."""
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match=f"invalidated.*The first: .*{what}"), acc.capture_to_graph(g):
        torch.ones(2) * 2
        with pytest.raises(GraphCaptureError, match=what):
            call(acc)
    assert not g.is_captured
    call(acc)  # fine outside capture


def test_empty_memory_read_in_a_graph_is_garbage_at_every_replay(acc):
    """``torch.empty`` inside a graph gets a block whose contents are whatever the last replay (or another
    graph) left there; the emulation fills it with garbage at every replay, so reading it cannot pass."""
    x = torch.arange(3.0)

    def step():
        scratch = torch.empty(3)
        scratch[:2] = x[:2]  # the last element is never written
        permuted = torch.empty_permuted((3,), (0,))
        permuted[1:] = x[1:]
        return scratch + 1, permuted + 1, torch.empty_like(x, dtype=torch.int64)

    g, (y, p, ints) = capture(acc, step)
    for _ in range(2):
        acc.replay_graph(g)
        assert y[:2].tolist() == [1.0, 2.0] and torch.isnan(y[2])
        assert torch.isnan(p[0]) and p[1:].tolist() == [2.0, 3.0]
        assert (ints == torch.iinfo(torch.int64).min).all()


# ------------------------------------------- outputs are garbage until replay
def test_outputs_hold_garbage_until_the_first_replay(acc):
    x = -torch.arange(1.0, 5.0)

    def step():
        return x * 2, x.argmax().reshape(1), x > 0, (x < 0).to(torch.uint8), (x * 3)[1:]

    g, (f, i, b, u, view) = capture(acc, step)
    # capture ran nothing on the "device": reading an output now reads garbage
    assert torch.isnan(f).all() and torch.isnan(view).all()
    assert i.tolist() == [torch.iinfo(torch.int64).min]
    assert b.all()  # the right answer is all False
    assert (u == 255).all()  # the right answer is all 1
    acc.replay_graph(g)
    assert f.tolist() == [-2.0, -4.0, -6.0, -8.0]
    assert i.tolist() == [0]
    assert not b.any()
    assert u.tolist() == [1, 1, 1, 1]
    assert view.tolist() == [-6.0, -9.0, -12.0]


def test_preexisting_tensors_and_their_views_are_not_poisoned(acc):
    buf = torch.arange(4.0)

    def step():
        buf.add_(1)
        return buf[:2]

    g, head = capture(acc, step)
    assert head.tolist() == [0.0, 1.0] and buf.tolist() == [0.0, 1.0, 2.0, 3.0]
    acc.replay_graph(g)
    assert head.tolist() == [1.0, 2.0]


def test_poisoning_inference_mode_outputs(acc):
    x = torch.ones(2)
    g = acc.create_graph()
    with torch.inference_mode(), acc.capture_to_graph(g):
        y = x + 1
    assert torch.isnan(y).all()
    with torch.inference_mode():
        acc.replay_graph(g)
    assert y.tolist() == [2.0, 2.0]


# ---------------------------------------------------------------------- pools
def chain(x, n):
    """n elementwise ops; each intermediate is read only by the next one."""
    y = x
    for k in range(n):
        y = y * 2 if k % 2 == 0 else y + 1
    return y.sum()


def test_pool_with_nothing_captured_reports_zero(acc):
    pool = acc.graph_pool_handle()
    assert isinstance(pool, CPUGraphPool) and not pool.recording
    assert acc.graph_memory_bytes(pool) == 0
    assert CPUAccelerator(emulate_graphs=False).graph_pool_handle() is None
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        acc.graph_pool(acc.create_graph())  # as CUDA's pool(): a handle is what a caller must hold
    assert acc.graph_memory_bytes(None) is None
    with pytest.raises(TypeError, match="CPUGraphPool"):
        acc.graph_memory_bytes(acc.create_graph())


def test_pool_bytes_after_capture(acc):
    x = torch.randn(1000)
    g, out = capture(acc, lambda: chain(x, 4))
    pool = acc.graph_pool(g)
    # static output: one float32; intermediates: at most two 4000-byte buffers alive at once
    assert g.static_bytes == 4 and g.workspace_bytes == 8000
    assert acc.graph_memory_bytes(pool) == 8004
    acc.replay_graph(g)
    assert torch.allclose(out, chain(x, 4))


def test_graphs_in_one_pool_share_the_workspace(acc):
    small, big = torch.randn(1000), torch.randn(3000)
    g1, _ = capture(acc, lambda: chain(small, 2))
    shared = acc.graph_pool(g1)
    g2, _ = capture(acc, lambda: chain(big, 4), pool=shared)
    assert acc.graph_pool(g2) is shared and shared.num_graphs == 2

    h1, _ = capture(acc, lambda: chain(small, 2))
    h2, _ = capture(acc, lambda: chain(big, 4))
    separate = acc.graph_memory_bytes(acc.graph_pool(h1)) + acc.graph_memory_bytes(acc.graph_pool(h2))
    assert separate == (4 + 8000) + (4 + 24000)
    assert acc.graph_memory_bytes(shared) == 4 + 4 + 24000  # both outputs, one workspace: the larger
    assert acc.graph_memory_bytes(shared) < separate


def test_reset_and_failed_capture_leave_the_pool(acc):
    x = torch.randn(10)
    g, _ = capture(acc, lambda: x * 2)
    pool = acc.graph_pool(g)
    bad = acc.create_graph()
    with pytest.raises(GraphCaptureError), acc.capture_to_graph(bad, pool=pool):
        (x * 3).item()
    assert pool.num_graphs == 1
    g.reset()
    assert acc.graph_memory_bytes(pool) == 0
    with pytest.raises(TypeError, match="CPUGraphPool"), acc.capture_to_graph(acc.create_graph(), pool=g):
        pass


def test_a_shared_pool_replayed_out_of_capture_order_garbles_the_later_outputs(acc):
    # On CUDA a graph captured later into a shared pool may own blocks an earlier graph used for
    # intermediates: replaying the earlier graph overwrites the later one's outputs.
    x = torch.arange(4.0)
    g1, out1 = capture(acc, lambda: chain(x, 4))
    g2, out2 = capture(acc, lambda: x * 3, pool=acc.graph_pool(g1))
    acc.replay_graph(g1)
    acc.replay_graph(g2)  # capture order: both outputs hold their values
    assert out1.item() == chain(x, 4).item() and out2.tolist() == [0.0, 3.0, 6.0, 9.0]
    acc.replay_graph(g1)  # out of order: g2's output is garbage, g1's own is fine
    assert torch.isnan(out2).all() and out1.item() == chain(x, 4).item()
    acc.replay_graph(g2)
    assert out2.tolist() == [0.0, 3.0, 6.0, 9.0]
    acc.replay_graph(g2)  # a later graph never garbles an earlier one's outputs
    assert out1.item() == chain(x, 4).item()


def test_graphs_in_separate_pools_or_reset_never_garble_each_other(acc):
    x = torch.arange(4.0)
    g1, _ = capture(acc, lambda: x + 1)
    g2, out2 = capture(acc, lambda: x * 3)  # its own pool
    acc.replay_graph(g2)
    acc.replay_graph(g1)
    assert out2.tolist() == [0.0, 3.0, 6.0, 9.0]
    shared = acc.graph_pool(g1)
    g3, out3 = capture(acc, lambda: x * 5, pool=shared)
    acc.replay_graph(g3)
    g3.reset()  # a reset graph has left the pool: its old output is the caller's to keep
    acc.replay_graph(g1)
    assert out3.tolist() == [0.0, 5.0, 10.0, 15.0]


def test_backends_that_cannot_tell_report_none():
    assert Accelerator().graph_memory_bytes(object()) is None
    import types

    mps = TorchBackendAccelerator("mps", types.SimpleNamespace(is_available=lambda: False))
    assert mps.graph_memory_bytes(object()) is None


# ------------------------------------------------- failed captures and the allocator
def raw_capture(fn, pool=None, stream=None):
    """``fn`` captured with the emulation's own capture (no accelerator: nothing cleans up after a failure)."""
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, capture_cpu_graph, cpu_stream

    g = CPUGraph()
    with cpu_stream(stream or CPUStream()), torch.no_grad(), capture_cpu_graph(g, pool=pool):
        fn()
    return g


def refused_read(x):
    (x * 2).sum().item()  # 4000 + 4 bytes allocated, then a host read: refused


def caught_refusal(x):
    try:
        (x * 2).sum().item()
    except GraphCaptureError:
        pass  # the capture stays invalidated


def body_error(x):
    (x * 2).sum()
    raise ValueError("the body's own error")


@pytest.mark.leaves_pool_recording
@pytest.mark.parametrize("fail", [refused_read, caught_refusal, body_error])
def test_a_failed_capture_leaves_its_pool_recording_until_it_is_ended_and_released(acc, fail):
    """CUDA's capture_end throws before it ends allocating to the pool when cudaStreamEndCapture fails, and only
    an ended capture releases its pool: the allocator then believes a capture is under way for good. (A body that
    raised without breaking the capture ends cleanly on CUDA; the emulation is stricter and keeps it recording.)"""
    from hybrid_engine.accelerator.cpu_graph import (
        end_allocating_to_pool,
        recording_pools,
        release_graph_pool,
    )

    x = torch.ones(1000)
    pool = CPUGraphPool()  # a handle, as torch.cuda.graph_pool_handle()
    with pytest.raises((GraphCaptureError, ValueError)):
        raw_capture(lambda: fail(x), pool=pool)
    assert pool.recording and recording_pools() == [pool]
    assert acc.graph_memory_bytes(pool) == 4000 + 4  # what the capture allocated stays counted
    with pytest.raises(GraphCaptureError, match="still recording"):
        acc.empty_cache()
    with pytest.raises(GraphCaptureError, match="already recording to this pool"):
        raw_capture(lambda: x + 1, pool=pool)
    with pytest.raises(RuntimeError, match="still recording"):
        release_graph_pool(pool)  # end first, as CUDA's allocator wants
    end_allocating_to_pool(pool)
    assert not pool.recording and recording_pools() == []
    acc.empty_cache()  # the allocator is out of capture mode
    assert acc.graph_memory_bytes(pool) > 0  # the failed capture still holds its pool's memory ...
    release_graph_pool(pool)
    assert acc.graph_memory_bytes(pool) == 0  # ... until it is released
    with pytest.raises(RuntimeError, match="not currently recording"):
        end_allocating_to_pool(pool)
    with pytest.raises(RuntimeError, match="no failed capture holds this pool"):
        release_graph_pool(pool)  # a release too many (on CUDA it frees blocks live graphs use)
    with pytest.raises(GraphCaptureError, match="pool was freed"):
        raw_capture(lambda: x + 1, pool=pool)  # its use count fell to zero: take a new handle


@pytest.mark.leaves_pool_recording
def test_after_a_failed_capture_without_a_handle_its_pool_cannot_be_named():
    """The graph's pool() raises after a failed capture, as CUDA's does: a capture into pool=None that fails poisons
    the allocator for good. Capturing into a handle is what makes the cleanup possible."""
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, capture_cpu_graph, cpu_stream, recording_pools

    g = CPUGraph()
    with pytest.raises(GraphCaptureError), cpu_stream(CPUStream()), capture_cpu_graph(g):
        torch.ones(4).sum().item()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.pool()
    assert len(recording_pools()) == 1


def test_the_accelerator_ends_and_releases_a_failed_captures_pool_ten_times_in_a_row(acc):
    from hybrid_engine.accelerator.cpu_graph import recording_pools

    x = torch.ones(1000)
    shared = acc.graph_pool_handle()
    for k in range(10):
        pool = shared if k % 2 else None  # a shared handle, and the one capture_to_graph takes itself
        with pytest.raises(GraphCaptureError):
            capture(acc, lambda: refused_read(x), pool=pool)
        assert recording_pools() == [] and acc.graph_memory_bytes(shared) == 0
        acc.empty_cache()
    g, out = capture(acc, lambda: x * 3, pool=acc.graph_pool_handle())
    acc.replay_graph(g)
    assert out.tolist() == [3.0] * 1000


def test_a_pool_whose_graphs_are_all_gone_is_freed(acc):
    x = torch.ones(4)
    pool = CPUGraphPool()
    g1, _ = capture(acc, lambda: x + 1, pool=pool)
    g2, _ = capture(acc, lambda: x + 2, pool=pool)
    g1.reset()
    capture(acc, lambda: x + 3, pool=pool)  # g2 still holds it
    g2.reset()
    del g2
    import gc

    gc.collect()  # the third graph, never kept, is gone too
    assert pool.freed
    with pytest.raises(GraphCaptureError, match="pool was freed"):
        capture(acc, lambda: x + 4, pool=pool)


# -------------------------------------------- capture belongs to a stream and a thread
def hold_a_capture(stream, inside, release, result, pool=None):
    """In a thread named "capturer": capture on ``stream`` until ``release`` is set; the outcome in ``result``."""
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, capture_cpu_graph, cpu_stream

    def run():
        x = torch.ones(3)
        try:
            with cpu_stream(stream), torch.no_grad(), capture_cpu_graph(CPUGraph(), pool=pool):
                x * 2
                inside.set()
                release.wait(10)
            result.append("captured")
        except GraphCaptureError as exc:
            result.append(str(exc))

    t = threading.Thread(target=run, name="capturer")
    t.start()
    assert inside.wait(10)
    return t


@pytest.mark.leaves_pool_recording  # the broken capture is the emulation's own, with no one to clean up
@pytest.mark.parametrize("touch,what", [
    (lambda s, acc: acc.stream(s).__enter__(), "making the stream current"),
    (lambda s, acc: s.wait_stream(acc.default_stream()), "wait_stream"),
    (lambda s, acc: acc.Stream().wait_stream(s), "wait_stream"),
    (lambda s, acc: s.synchronize(), r"stream.synchronize\(\)"),
    (lambda s, acc: s.query(), r"stream.query\(\)"),
    (lambda s, acc: acc.Event().record(s), r"event.record\(stream\)"),
    (lambda s, acc: acc.Event().wait(s), r"event.wait\(stream\)"),
    (lambda s, acc: acc.synchronize(), r"accelerator.synchronize\(\) while thread 'capturer' is capturing"),
    (lambda s, acc: acc.empty_cache(), r"accelerator.empty_cache\(\) while thread 'capturer' is capturing"),
], ids=["make-current", "wait-on-it", "others-wait-on-it", "stream-sync", "stream-query", "event-record",
        "event-wait", "device-sync", "empty-cache"])
def test_touching_a_stream_another_thread_captures_on_is_refused_and_breaks_that_capture(acc, touch, what):
    """Today's sharing pattern (every runner warms up and captures on the one graph stream of the process-wide
    accelerator): on CUDA the second thread's warm-up is recorded into the first's graph and never runs, or its
    wait_stream breaks the capture. A device-wide wait (synchronize, empty_cache) includes the capturing stream."""
    s = acc.Stream()
    inside, release, result = threading.Event(), threading.Event(), []
    t = hold_a_capture(s, inside, release, result)
    try:
        with pytest.raises(GraphCaptureError, match=what):
            touch(s, acc)
    finally:
        release.set()
        t.join(10)
    assert len(result) == 1 and "invalidated" in result[0] and "capturer" in result[0], result
    assert acc.current_stream() is acc.default_stream()


def test_one_capture_at_a_time_per_process_and_never_on_a_stream_another_thread_has_current(acc):
    """PyTorch's rule for CUDA graphs; another thread's capture on its own stream is refused too."""
    inside, release, result = threading.Event(), threading.Event(), []
    t = hold_a_capture(acc.Stream(), inside, release, result)
    try:
        with pytest.raises(GraphCaptureError, match="one capture at a time per process"):
            raw_capture(lambda: torch.ones(2) + 1)
    finally:
        release.set()
        t.join(10)
    assert result == ["captured"]  # refusing the second capture did not break the first
    shared, entered, leave = acc.Stream(), threading.Event(), threading.Event()

    def keep_current():
        with acc.stream(shared):
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=keep_current, name="holder")
    t.start()
    assert entered.wait(10)
    try:
        with pytest.raises(GraphCaptureError, match="current stream of thread"):
            raw_capture(lambda: torch.ones(2) + 1, stream=shared)
    finally:
        leave.set()
        t.join(10)
    raw_capture(lambda: torch.ones(2) + 1, stream=shared)  # alone on it: fine


def test_the_default_stream_may_not_wait_on_a_capturing_stream(acc):
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="default stream waiting on a capturing stream"):
        with acc.capture_to_graph(g):
            acc.default_stream().wait_stream(acc.current_stream())
    assert not g.is_captured


def test_graph_streams_are_per_thread(acc):
    seen = []
    t = threading.Thread(target=lambda: seen.append(acc.graph_stream()))
    t.start()
    t.join()
    assert seen[0] is not acc.graph_stream() and acc.graph_stream() is acc.graph_stream()


def test_synchronize_and_empty_cache_wait_for_a_capture_under_the_capture_lock(acc):
    """What the accelerator's own captures hold: another thread's device-wide call waits, instead of running
    during the capture (which the emulation refuses, as above)."""
    order, inside, release = [], threading.Event(), threading.Event()

    def captures():
        g = acc.create_graph()
        with torch.no_grad(), acc.capture_to_graph(g):
            torch.ones(2) * 2
            inside.set()
            release.wait(0.3)  # the other thread's calls are made meanwhile, and must wait
            order.append("capture ends")
        order.append("captured" if g.is_captured else "failed")

    t = threading.Thread(target=captures)
    t.start()
    assert inside.wait(10)
    acc.synchronize()
    order.append("synchronized")
    acc.empty_cache()
    t.join(10)
    assert order == ["capture ends", "captured", "synchronized"]


# ------------------------------------------------------------ side streams in a capture
def test_work_on_a_side_stream_that_never_joined_the_capture_is_refused(acc):
    """CUDA runs such work once, outside the graph: a replay would not run it. It was recorded as if it joined."""
    x = torch.ones(3)
    side = acc.Stream()
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="has not joined the capture"), torch.no_grad(), \
            acc.capture_to_graph(g):
        y = x + 1
        with acc.stream(side):
            y * 2
    assert not g.is_captured


@pytest.mark.parametrize("join", ["wait_stream", "event"])
def test_a_fork_that_rejoins_is_captured_and_replays_its_side_stream_work(acc, join):
    x = torch.ones(3)
    side = acc.Stream()
    g = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(g):
        capturing = acc.current_stream()
        y = x + 1
        if join == "wait_stream":
            side.wait_stream(capturing)
        else:
            forked = acc.Event()
            forked.record(capturing)
            forked.wait(side)
        with acc.stream(side):
            z = y * 3
        if join == "wait_stream":
            capturing.wait_stream(side)
        else:
            done = acc.Event()
            done.record(side)
            done.wait(capturing)
        out = z + y
    x.fill_(2.0)
    g.replay()
    assert out.tolist() == [12.0, 12.0, 12.0]  # (2 + 1) * 3 + (2 + 1)


def test_a_fork_that_never_rejoins_fails_capture_end(acc):
    x = torch.ones(3)
    side = acc.Stream()
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="never rejoined.*cudaErrorStreamCaptureUnjoined"), torch.no_grad(), \
            acc.capture_to_graph(g):
        side.wait_stream(acc.current_stream())
        with acc.stream(side):
            x * 2
    assert not g.is_captured


# ------------------------------------------------- custom ops: their bodies are checked too
@torch.library.custom_op("hybrid_engine_test::reads_the_host", mutates_args=())
def _reads_the_host(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "item":
        return x + int(x.sum().item())
    if how == "tolist":
        return x + len(x.tolist())
    if how == "nonzero":
        return x + x.nonzero().shape[0]
    return x * 2  # "none": device work only


@_reads_the_host.register_fake
def _(x, how):
    return torch.empty_like(x)


@pytest.mark.parametrize("how", ["item", "tolist", "nonzero"])
def test_a_host_read_inside_a_custom_op_fails_the_capture(acc, how):
    """A custom op is recorded as one node, and its body runs again at every replay; a device graph would capture
    its kernels, so a host read (or a data-dependent shape) inside it must fail the capture as it would outside."""
    x = torch.ones(3)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="not permitted while capturing"), torch.no_grad(), \
            acc.capture_to_graph(g):
        _reads_the_host(x, how)


def test_a_custom_op_without_host_reads_is_one_node_and_replays(acc):
    x = torch.ones(3)
    g, y = capture(acc, lambda: _reads_the_host(x, "none"))
    x.fill_(5.0)
    g.replay()
    assert torch.equal(y, torch.full((3,), 10.0))
