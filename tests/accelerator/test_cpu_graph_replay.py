"""What a CPU graph capture leaves behind, and what its replays do, as on CUDA.

Capture runs nothing on a device: whatever it wrote to pre-existing tensors is
undone at its end (or, for memory it reallocated, garbage), and it draws
nothing from the default generator (seeding it inside capture fails the
capture). A replay runs every recorded kernel (an async assert included),
whatever the grad mode around it, and refuses memory the graph's baked
addresses no longer point at, static outputs rebound since capture included.
"""

import pytest
import torch
from test_cpu_graph import capture as _capture

from hybrid_engine.accelerator import CPUAccelerator, GraphCaptureError, GraphReplayError


@pytest.fixture
def acc():
    return CPUAccelerator()


def capture(acc, fn, pool=None):
    if pool is None:
        return _capture(acc, fn)
    g = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(g, pool=pool):
        out = fn()
    return g, out


# ------------------------------------------------------------ capture end
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("make", [lambda: torch.empty(0), lambda: torch.zeros(2)], ids=["empty", "wrong-size"])
def test_out_resizing_a_preexisting_buffer_gives_it_garbage_until_the_first_replay(acc, make):
    """On CUDA the resize takes a block of the graph's pool: its contents are garbage until the first replay,
    not the buffer's old values (which cannot be copied back anyway: the sizes differ)."""
    a = torch.arange(4.0)
    buf, counter = make(), torch.zeros(1)

    def step():
        torch.mul(a, 10, out=buf)
        counter.add_(1)

    g, _ = capture(acc, step)
    assert buf.shape == (4,) and torch.isnan(buf).all()
    assert counter.tolist() == [0.0]  # restored too
    acc.replay_graph(g)
    assert buf.tolist() == [0.0, 10.0, 20.0, 30.0] and counter.tolist() == [1.0]


def test_a_failing_restore_still_restores_the_rest_then_raises(acc, monkeypatch):
    first, counter = torch.zeros(2), torch.zeros(1)
    copy_ = torch.UntypedStorage.copy_

    def copy(self, *args, **kwargs):
        if self.data_ptr() == first.data_ptr():
            raise RuntimeError("simulated restore failure")
        return copy_(self, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "copy_", copy)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="restoring .* failed: simulated"), acc.capture_to_graph(g):
        first.add_(1)
        counter.add_(1)
    assert counter.tolist() == [0.0] and not g.is_captured and not acc.is_current_stream_capturing()


def test_capture_leaves_the_default_generator_where_it_was(acc):
    """CUDA records a capture's draws at offsets of its own; the eager state moves only when a replay runs."""
    torch.manual_seed(0)
    first, second = torch.rand(4), torch.rand(4)
    torch.manual_seed(0)
    g, r = capture(acc, lambda: torch.rand(4))
    assert torch.equal(torch.rand(4), first)
    with pytest.raises(GraphCaptureError), acc.capture_to_graph(acc.create_graph()):
        torch.rand(4).item()  # a failed capture draws nothing either
    assert torch.equal(torch.rand(4), second)
    torch.manual_seed(0)
    acc.replay_graph(g)
    assert torch.equal(r, first)
    acc.replay_graph(g)  # fresh numbers at every replay
    assert torch.equal(r, second)


@pytest.mark.parametrize(
    "reseed",
    [lambda acc: torch.manual_seed(1234), lambda acc: torch.seed(), lambda acc: torch.default_generator.manual_seed(7)],
    ids=["torch.manual_seed", "torch.seed", "default_generator.manual_seed"],
)
def test_seeding_the_default_generator_inside_capture_fails_it(acc, reseed):
    """CUDA's generator asserts it is not capturing when seeded. Capture end compares the seed with the one it
    began with (before restoring the generator, which would hide it) and leaves the generator as it was."""
    torch.manual_seed(0)
    first = torch.rand(4)
    torch.manual_seed(0)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="seeded inside the capture"), acc.capture_to_graph(g):
        reseed(acc)
        torch.rand(4)
    assert not g.is_captured and torch.initial_seed() == 0
    assert torch.equal(torch.rand(4), first)


# ----------------------------------------------------------------- replay
def test_an_async_assert_is_checked_at_every_replay(acc):
    """``torch._assert_async`` is a device-side assert on CUDA: it has no output, yet every replay runs it."""
    x = torch.ones(4)
    g, y = capture(acc, lambda: (torch._assert_async((x > 0).all(), "x must be positive"), x * 2)[1])
    acc.replay_graph(g)
    assert y.tolist() == [2.0] * 4
    x.fill_(-1.0)
    with pytest.raises(RuntimeError, match="x must be positive"):
        acc.replay_graph(g)


def test_ops_without_an_output_replay(acc):
    xs = [torch.zeros(2), torch.ones(3)]
    g, _ = capture(acc, lambda: torch._foreach_add_(xs, 1.0))
    acc.replay_graph(g)
    acc.replay_graph(g)
    assert xs[0].tolist() == [2.0, 2.0] and xs[1].tolist() == [3.0, 3.0, 3.0]


def test_a_graph_captured_under_inference_mode_replays_outside_it(acc):
    """CUDA replays kernels whatever the grad mode around the replay."""
    x = torch.ones(3)
    with torch.inference_mode():
        buf = torch.zeros(3)  # an inference tensor: updated in place by the graph
    g = acc.create_graph()
    with torch.inference_mode(), acc.capture_to_graph(g):
        buf.add_(x)
        y = buf * 2
    acc.replay_graph(g)
    acc.replay_graph(g)
    assert buf.tolist() == [2.0] * 3 and y.tolist() == [4.0] * 3


def test_replay_refuses_an_input_whose_memory_moved(acc):
    """``resize_`` growing a tensor keeps its storage object but reallocates its memory: the graph's baked
    address is freed, as if the tensor had been dropped. Shrinking moves nothing."""
    x, z = torch.ones(4), torch.ones(4)
    g, (y, w) = capture(acc, lambda: (x * 2, z * 3))
    z.resize_(2)
    acc.replay_graph(g)
    assert y.tolist() == [2.0] * 4 and w.tolist() == [3.0] * 4
    x.resize_(1 << 20)
    with pytest.raises(GraphReplayError, match=r"stale address: a \[4\] float32 tensor .*reallocated"):
        acc.replay_graph(g)


@pytest.mark.parametrize(
    "rebind",
    [
        lambda out: setattr(out, "data", torch.zeros(4)),
        lambda out: out.set_(torch.full((4,), 9.0)),
        lambda out: out.resize_(1000),
        lambda out: out.resize_(2, 2),
        lambda out: out.unsqueeze_(0),
    ],
    ids=["data", "set_", "resize_-grow", "resize_-reshape", "unsqueeze_"],
)
def test_replay_refuses_a_static_output_rebound_since_capture(acc, rebind):
    """A CUDA graph keeps writing the address it captured: an output whose storage was swapped (or whose view of
    it changed) would silently stop seeing the results, so the emulation refuses to replay, before running."""
    x = torch.arange(4.0)
    g, out = capture(acc, lambda: x * 2)
    acc.replay_graph(g)
    rebind(out)
    before = out.clone()
    x.add_(1)
    with pytest.raises(GraphReplayError, match="static output .* copy them"):
        acc.replay_graph(g)
    torch.testing.assert_close(out, before, rtol=0, atol=0, equal_nan=True)  # garbage, if resize_ grew it


def test_a_shared_pool_never_garbles_memory_an_output_was_rebound_to(acc):
    """Replaying an earlier graph of a pool garbles the pool's blocks of later graphs' outputs, not a tensor the
    caller rebound such an output to (that memory is not the pool's)."""
    x = torch.arange(4.0)
    g1, _ = capture(acc, lambda: x + 1)
    g2, out2 = capture(acc, lambda: x * 3, pool=acc.graph_pool(g1))
    acc.replay_graph(g2)
    out2.data = torch.ones(4)
    acc.replay_graph(g1)
    assert out2.tolist() == [1.0] * 4
