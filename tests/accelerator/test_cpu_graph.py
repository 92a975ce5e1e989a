"""Semantics of the CPU graph emulation: it must behave like a CUDA graph."""

import pytest
import torch

from hybrid_engine.accelerator import CPUAccelerator, GraphCaptureError, GraphReplayError


@pytest.fixture
def acc():
    return CPUAccelerator()


def capture(acc, fn):
    g = acc.create_graph()
    with torch.no_grad(), acc.capture_to_graph(g):
        out = fn()
    return g, out


def test_python_counter_is_frozen_device_counter_advances(acc):
    host = {"n": 0}
    dev = torch.zeros((), dtype=torch.int64)
    seen = torch.zeros(4, dtype=torch.int64)

    def step():
        host["n"] += 1
        dev.add_(1)
        return seen + host["n"] + dev

    g, out = capture(acc, step)
    assert host["n"] == 1
    values = []
    for _ in range(3):
        acc.replay_graph(g)
        values.append(int(out[0]))
    # host value frozen at 1, device counter advances 1, 2, 3
    assert values == [2, 3, 4]
    assert host["n"] == 1
    assert int(dev) == 3


def test_capture_does_not_apply_work_to_preexisting_tensors(acc):
    buf = torch.arange(6, dtype=torch.float32)
    view_target = torch.zeros(2, 3)
    before = buf.clone()

    def step():
        buf.mul_(10)
        view_target[1].copy_(buf[:3])
        buf[0] = -1.0
        return buf.sum()

    g, total = capture(acc, step)
    assert torch.equal(buf, before)
    assert torch.equal(view_target, torch.zeros(2, 3))
    acc.replay_graph(g)  # first real execution
    assert torch.equal(buf, torch.tensor([-1.0, 10, 20, 30, 40, 50]))
    assert torch.equal(view_target[1], torch.tensor([0.0, 10, 20]))
    assert float(total) == pytest.approx(149.0)


def test_replay_outputs_are_the_captured_objects_with_fresh_values(acc):
    x = torch.randn(3, 5)
    w = torch.randn(5, 4)
    g, (y, z) = capture(acc, lambda: (torch.relu(x @ w), (x @ w).softmax(-1)))
    y_id, z_id = id(y), id(z)
    for _ in range(3):
        x.copy_(torch.randn(3, 5))
        acc.replay_graph(g)
        assert id(y) == y_id and id(z) == z_id
        assert torch.equal(y, torch.relu(x @ w))
        assert torch.equal(z, (x @ w).softmax(-1))


def test_in_place_weight_update_is_seen_but_swapped_storage_is_stale(acc):
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    g, y = capture(acc, lambda: lin(x))
    with torch.no_grad():
        lin.weight.add_(1.0)  # in place: same storage, the graph sees it
    acc.replay_graph(g)
    assert torch.allclose(y, lin(x))
    old = lin(x).detach().clone()
    kept = lin.weight.data  # the old storage stays allocated: a device graph still reads the old values there
    lin.weight.data = torch.randn(4, 4)
    acc.replay_graph(g)
    assert torch.allclose(y, old)
    assert not torch.allclose(y, lin(x))
    del kept  # now nothing but the graph holds that memory: on a device it is free, and reused
    with pytest.raises(GraphReplayError, match=r"stale address: a \[4, 4\] float32 tensor \(first used by aten\.t"):
        acc.replay_graph(g)


def test_replay_refuses_an_input_freed_after_capture(acc):
    """CUDA graphs keep no reference to their inputs: reading one that was freed reads reused memory."""
    x = torch.randn(3, 5)
    w = torch.randn(5, 2)
    inputs = {"view": x[1:]}  # read through a view: what counts is the storage, which x keeps alive
    g, y = capture(acc, lambda: torch.where(inputs["view"] > 0, inputs["view"], 0.0) @ w)  # 0.0: the graph's own
    del inputs["view"]
    acc.replay_graph(g)
    assert torch.equal(y, torch.where(x[1:] > 0, x[1:], 0.0) @ w)
    del x
    with pytest.raises(GraphReplayError, match=r"\[2, 5\] float32 tensor .*which nothing but graphs holds"):
        acc.replay_graph(g)


def test_graphs_reading_the_same_storage_do_not_keep_it_alive_for_each_other(acc):
    """Every decode bucket's graph reads the same weights: one graph's references must not hide another's
    stale read."""
    weights = {"w": torch.randn(4, 4)}
    x = torch.randn(2, 4)
    g1, _ = capture(acc, lambda: x @ weights["w"])
    g2, _ = capture(acc, lambda: (x @ weights["w"]).relu())
    acc.replay_graph(g1)
    acc.replay_graph(g2)
    del weights["w"]
    for g in (g1, g2):
        with pytest.raises(GraphReplayError, match="stale address"):
            acc.replay_graph(g)
    del g2  # a collected graph takes its references out of the count; the other stays refused
    with pytest.raises(GraphReplayError, match="stale address"):
        acc.replay_graph(g1)
    g1.reset()
    y = torch.randn(4, 4)
    g3, out = capture(acc, lambda: x @ y)
    acc.replay_graph(g3)  # a storage at the same address later is guarded on its own terms
    assert torch.equal(out, x @ y)


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: t.sum().item(),
        lambda t: bool(t.sum() > 0),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: t.cpu(),
        lambda t: torch.nonzero(t),
        lambda t: t[t > 0],
        lambda t: int(t[0]),
        lambda t: torch.unique(t),
    ],
    ids=["item", "bool", "tolist", "numpy", "cpu", "nonzero", "bool-mask-index", "int", "unique"],
)
def test_host_syncs_raise_while_capturing(acc, bad):
    t = torch.randn(5)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError, match="not permitted while capturing"), acc.capture_to_graph(g):
        bad(t)
    assert not acc.is_current_stream_capturing()
    assert t.sum().item() == t.sum().item()  # fine again outside capture


def test_failed_capture_restores_state_and_graph_stays_uncaptured(acc):
    buf = torch.ones(3)
    g = acc.create_graph()
    with pytest.raises(GraphCaptureError), acc.capture_to_graph(g):
        buf.add_(5)
        buf.item()
    assert torch.equal(buf, torch.ones(3))
    with pytest.raises(RuntimeError, match="not been captured"):
        acc.replay_graph(g)


def test_is_capturing_only_inside_capture(acc):
    flags = []
    assert acc.is_current_stream_capturing() is False
    g = acc.create_graph()
    with acc.capture_to_graph(g):
        flags.append(acc.is_current_stream_capturing())
    assert flags == [True]
    assert acc.is_current_stream_capturing() is False


def test_nested_capture_and_recapture_are_rejected(acc):
    g1, g2 = acc.create_graph(), acc.create_graph()
    with pytest.raises(GraphCaptureError, match="nested"), acc.capture_to_graph(g1):
        with acc.capture_to_graph(g2):
            pass
    g3, _ = capture(acc, lambda: torch.ones(2) * 2)
    with pytest.raises(RuntimeError, match="already captured"), acc.capture_to_graph(g3):
        pass


def test_replay_runs_no_python_model_code(acc):
    calls = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            calls.append(1)
            return x * 2 + 1

    m = Probe()
    x = torch.randn(3)
    g, y = capture(acc, lambda: m(x))
    assert calls == [1]
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    acc.replay_graph(g)
    assert calls == [1]
    assert torch.equal(y, torch.tensor([3.0, 5.0, 7.0]))


def test_ops_on_captured_intermediates_and_tuple_outputs(acc):
    x = torch.randn(4, 6)
    pos = torch.tensor([2])

    def step():
        vals, idx = torch.topk(x, 3, dim=-1)
        parts = torch.split(x, 2, dim=-1)
        cat = torch.cat([parts[0], parts[2]], dim=-1)
        gathered = x.index_select(1, pos)
        return vals, idx, cat, gathered

    g, outs = capture(acc, step)
    for _ in range(2):
        x.copy_(torch.randn(4, 6))
        pos.fill_(int(torch.randint(0, 6, ())))
        acc.replay_graph(g)
        for got, want in zip(outs, step()):
            assert torch.equal(got, want)


def test_random_ops_draw_fresh_numbers_each_replay(acc):
    g, r = capture(acc, lambda: torch.rand(8))
    acc.replay_graph(g)
    first = r.clone()
    acc.replay_graph(g)
    assert not torch.equal(first, r)


def test_disabled_emulation_cannot_capture():
    acc = CPUAccelerator(emulate_graphs=False)
    assert acc.create_graph() is None
    assert acc.supports_graph_capture is False
    assert acc.graph_unavailable_reason
