"""``hybrid_engine::paged_decode_attention``: the reference against a plain per-row softmax, one node in a
captured CPU graph, the capability probe, and the Triton kernel against the reference under
``TRITON_INTERPRET=1`` (skipped where Triton is not installed: ``pip install 'hybrid-engine[dev]'``)."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.decode.ops import paged_attention as pa

op = torch.ops.hybrid_engine.paged_decode_attention


def _inputs(dtype=torch.float32, group=3, page=8, dim=32):
    g = torch.Generator().manual_seed(4)
    b, kv_heads, pages = 3, 2, 12
    q = torch.randn(b, kv_heads * group, 1, dim, generator=g).to(dtype)
    kp = torch.randn(pages * page, kv_heads, dim, generator=g).to(dtype)
    vp = torch.randn(pages * page, kv_heads, dim, generator=g).to(dtype)
    table = torch.tensor([[1, 4, 7, 10], [2, 3, 9, 0], [5, 6, 8, 11]])
    lengths = torch.tensor([27, 9, 32])  # mid-page, short (unused pages past it), full
    return q, kp, vp, table, lengths, dim**-0.5, page


def _naive(q, kp, vp, table, lengths, scale, page):
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[1] // kp.shape[1]
    for b in range(q.shape[0]):
        slots = [int(table[b, t // page]) * page + t % page for t in range(int(lengths[b]))]
        for h in range(q.shape[1]):
            k, v = kp[slots, h // group].double(), vp[slots, h // group].double()
            w = torch.softmax(k @ q[b, h, 0].double() * scale, 0)
            out[b, h, 0] = w @ v
    return out


def test_reference_is_a_softmax_over_each_rows_own_tokens():
    args = _inputs()
    got = pa.reference_attention(*args)
    assert torch.allclose(got.double(), _naive(*args), atol=1e-5)


def test_the_op_is_one_node_of_a_captured_cpu_graph_and_replays_new_lengths():
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    q, kp, vp, table, lengths, scale, page = _inputs()
    out = {}

    def step():
        out["o"] = op(q, kp, vp, table, lengths, scale, page)

    step()
    graph = CPUGraph()
    with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(graph):
        step()
    assert graph.num_ops == 1
    lengths.copy_(torch.tensor([3, 17, 30]))
    graph.replay()
    assert torch.equal(out["o"], pa.reference_attention(q, kp, vp, table, lengths, scale, page))


def test_cpu_without_the_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pa._probe.cache_clear()
    pa._kernel.cache_clear()
    try:
        assert pa.implementation("cpu") == "reference"
    finally:
        pa._probe.cache_clear()
        pa._kernel.cache_clear()


def test_bad_shapes_are_named():
    q, kp, vp, table, lengths, scale, page = _inputs()
    with pytest.raises(ValueError, match="query must be"):
        op(q[:, :, 0], kp, vp, table, lengths, scale, page)
    with pytest.raises(ValueError, match="not a multiple"):
        op(q[:, :5], kp, vp, table, lengths, scale, page)
    with pytest.raises(ValueError, match="block_table"):
        op(q, kp, vp, table[:2], lengths, scale, page)


_KERNEL_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_paged_decode_attention import _inputs
from hybrid_engine.decode.ops import paged_attention as pa
assert pa.implementation("cpu") == "triton", "the probe did not choose the kernel"
for dtype, group, dim, page, tol in [(torch.float32, 3, 32, 8, 1e-5), (torch.float32, 1, 16, 4, 1e-5),
                                     (torch.bfloat16, 7, 64, 16, 2e-2)]:
    q, kp, vp, table, lengths, scale, page = _inputs(dtype, group, page, dim)
    table = table.clamp(max=kp.shape[0] // page - 1)
    lengths = lengths.clamp(max=table.shape[1] * page)
    got = torch.ops.hybrid_engine.paged_decode_attention(q, kp, vp, table, lengths, scale, page)
    want = pa.reference_attention(q.float(), kp.float(), vp.float(), table, lengths, scale, page)
    err = (got.float() - want).abs().max().item()
    assert err <= tol, (dtype, group, dim, page, err)
print("kernel ok")
"""


@pytest.mark.slow  # a process of its own (tests/tiers.py)
def test_triton_kernel_matches_the_reference_under_the_interpreter():
    """In a process of its own: Triton reads ``TRITON_INTERPRET`` when it is imported (its language functions
    are jitted then), and this process may have imported it without."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _KERNEL_CHECK.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]
