"""``paged_decode_attention``'s ``"npu"`` implementation (torch_npu's paged incremental attention), against a stub
``torch_npu`` (no NPU here).

What is stubbed, and only that (the hardware boundary): ``torch_npu`` itself. Its ``npu_incre_flash_attention``
computes what torch_npu documents for page attention, in fp32 with one rounding at the output (as a fused kernel
does), and refuses what the documentation says it refuses: K/V not fp16/bf16 or not of the query's dtype,
non-contiguous inputs, a ``block_size`` not aligned to 16, a query not ``"BSH"`` ``[B, 1, num_heads * D]``, a KV
cache not ``(blocknum, blocksize, H)``, a ``block_table`` not 2-D int32 ``[B, >= blocks needed]`` or with block ids
outside ``[0, blocknum - 1]``, ``actual_seq_lengths`` missing or not a host list of ints (a device tensor there is
what it cannot take), an ``atten_mask`` not bool/int8/uint8 or shorter than the table's span. ``scale_value`` defaults to 1.0 as torch_npu's does, and a row with every key masked comes
out NaN (undefined in a fused kernel: the stub takes the worst case). Every launch is logged in ``calls``. The stub
runs on the CPU, so the probe's "runs on the tensor's device" is the CPU here. Nothing here is verified on a real
NPU.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest
import torch

from hybrid_engine.accelerator import is_capturing
from hybrid_engine.decode.ops import paged_attention as pa

op = torch.ops.hybrid_engine.paged_decode_attention


# ------------------------------------------------------------------------------------------------ stub
def make_stub_torch_npu(*, kernel: bool = True, error: str | None = None) -> types.ModuleType:
    """A stand-in for ``torch_npu`` with ``npu_incre_flash_attention``; ``error``: it raises that at every call (a
    chip without the kernel)."""
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.calls = []

    def npu_incre_flash_attention(query, key, value, *, padding_mask=None, pse_shift=None, atten_mask=None,
                                  actual_seq_lengths=None, block_table=None, kv_padding_size=None, num_heads=1,
                                  scale_value=1.0, input_layout="BSH", num_key_value_heads=0, block_size=0,
                                  inner_precise=1, **_):
        mod.calls.append({"query": query, "key": key, "value": value, "atten_mask": atten_mask,
                          "actual_seq_lengths": actual_seq_lengths, "block_table": block_table,
                          "num_heads": num_heads, "scale_value": scale_value, "input_layout": input_layout,
                          "num_key_value_heads": num_key_value_heads, "block_size": block_size})
        if error is not None:
            raise RuntimeError(error)
        dtypes = (torch.float16, torch.bfloat16)
        if query.dtype not in dtypes or key.dtype != query.dtype or value.dtype != query.dtype:
            raise RuntimeError(f"stub torch_npu: dtypes {query.dtype}/{key.dtype}/{value.dtype}")
        if input_layout != "BSH" or query.dim() != 3 or query.shape[1] != 1 or query.shape[2] % num_heads:
            raise RuntimeError(f"stub torch_npu: query {tuple(query.shape)} is not BSH for {num_heads} heads")
        b, d = query.shape[0], query.shape[2] // num_heads
        kv_heads = num_key_value_heads or num_heads
        if num_heads % kv_heads or key.dim() != 3 or key.shape != value.shape or key.shape[2] != kv_heads * d:
            raise RuntimeError(f"stub torch_npu: KV cache {tuple(key.shape)} is not (blocknum, blocksize, H)")
        if block_table is None or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != b or block_size % 16 or key.shape[1] != block_size:
            raise RuntimeError("stub torch_npu: page attention needs an int32 [B, blocks] block_table and a "
                               "block_size aligned to 16 equal to the cache's")
        if not isinstance(actual_seq_lengths, list) or len(actual_seq_lengths) not in (1, b) \
                or not all(type(n) is int for n in actual_seq_lengths):
            raise TypeError(f"stub torch_npu: actual_seq_lengths must be a host List[int], got "
                            f"{type(actual_seq_lengths).__name__}")
        if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
            raise RuntimeError("stub torch_npu: non-contiguous query/key/value")
        # The range check is the stub's (a device kernel does not read values on the host): not while capturing.
        if not is_capturing() and (block_table.min() < 0 or block_table.max() >= key.shape[0]):
            raise RuntimeError("stub torch_npu: block_table values must lie in [0, blocknum - 1]")
        span = block_table.shape[1] * block_size
        if max(actual_seq_lengths) > span:
            raise RuntimeError("stub torch_npu: block_table has fewer blocks than actual_seq_lengths needs")
        if atten_mask is not None and (atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8)
                                       or atten_mask.shape[0] != b or atten_mask.shape[-1] < span):
            raise RuntimeError(f"stub torch_npu: atten_mask {atten_mask.dtype} {tuple(atten_mask.shape)}")
        slots_of = key.shape[0] * block_size
        k_all, v_all = key.reshape(slots_of, kv_heads, d).float(), value.reshape(slots_of, kv_heads, d).float()
        q = query.view(b, num_heads, d).float()
        out = torch.empty(b, num_heads, d)
        for row in range(b):
            n = actual_seq_lengths[row if len(actual_seq_lengths) == b else 0]
            slots = (block_table[row, :, None].long() * block_size + torch.arange(block_size)).flatten()[:n]
            k = k_all[slots].repeat_interleave(num_heads // kv_heads, 1)  # [n, heads, d]
            v = v_all[slots].repeat_interleave(num_heads // kv_heads, 1)
            s = torch.einsum("hd,nhd->hn", q[row], k) * scale_value
            if atten_mask is not None:
                s = s.masked_fill(atten_mask[row].reshape(-1)[:n].bool()[None, :], float("-inf"))
            out[row] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)  # every key masked: NaN
        return out.reshape(b, 1, num_heads * d).to(query.dtype)

    if kernel:
        mod.npu_incre_flash_attention = npu_incre_flash_attention
    return mod


@pytest.fixture
def install(monkeypatch):
    """Installs a stub (``install(**options)``) with the probe's caches cleared around it; the CPU without the
    Triton interpreter, so the Triton candidate does not run here."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def clear():
        pa._probe.cache_clear()
        pa._npu_attention.cache_clear()
        pa._kernel.cache_clear()

    def put(**options):
        stub = make_stub_torch_npu(**options)
        monkeypatch.setitem(sys.modules, "torch_npu", stub)
        clear()
        return stub

    yield put
    clear()


def _inputs(dtype=torch.bfloat16, group=3, page=16, dim=32, seed=4):
    g = torch.Generator().manual_seed(seed)
    b, kv_heads, pages = 4, 2, 12
    q = torch.randn(b, 1, kv_heads * group, dim, generator=g).to(dtype).transpose(1, 2)  # as transformers has it
    kp = torch.randn(pages * page, kv_heads, dim, generator=g).to(dtype)
    vp = torch.randn(pages * page, kv_heads, dim, generator=g).to(dtype)
    table = torch.tensor([[1, 4, 7], [2, 3, 9], [5, 6, 8], [10, 11, 0]])
    lengths = torch.tensor([2 * page + 5, page - 3, 3 * page, 0])  # mid-page, short, full, empty
    return q, kp, vp, table, lengths, dim**-0.5, page


def _close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # one rounding in the kernel, several in the reference's SDPA
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_probe_picks_torch_npus_kernel_and_the_op_calls_it_as_documented(install, dtype):
    stub = install()
    assert pa.implementation("cpu") == "npu"
    q, kp, vp, table, lengths, scale, page = _inputs(dtype)
    stub.calls.clear()
    got = op(q, kp, vp, table, lengths, scale, page)
    live = lengths > 0  # an empty row (an idle slot, its output discarded) is only asked to be finite: the
    # reference's value there depends on whether its dtype's finfo.min swamps the scores
    _close(got[live], pa.reference_attention(q, kp, vp, table, lengths, scale, page)[live], dtype)
    assert torch.isfinite(got).all()
    assert len(stub.calls) == 1
    call = stub.calls[0]
    b, hq, _, d = q.shape
    span = table.shape[1] * page
    assert call["input_layout"] == "BSH" and call["query"].shape == (b, 1, hq * d)
    assert (call["num_heads"], call["num_key_value_heads"], call["block_size"]) == (hq, kp.shape[1], page)
    assert call["scale_value"] == pytest.approx(scale)  # always passed: torch_npu's default is 1.0
    for name, pool in (("key", kp), ("value", vp)):  # the pool itself as (blocknum, blocksize, H): a view, no copy
        assert call[name].shape == (kp.shape[0] // page, page, kp.shape[1] * d)
        assert call[name].data_ptr() == pool.data_ptr() and call[name]._base is pool
    assert call["block_table"].dtype == torch.int32 and torch.equal(call["block_table"].long(), table)
    # Lengths go in as the device mask; the host list holds only the table's span (a shape): no device read.
    assert call["actual_seq_lengths"] == [span] * b
    mask = call["atten_mask"]
    assert mask.dtype == torch.bool and mask.shape == (b, 1, 1, span)
    seen = torch.arange(span)[None, :] < lengths[:, None]
    assert torch.equal(~mask[:3, 0, 0], seen[:3])  # True = masked out: each row's tokens past its length
    assert not mask[3].any()  # the empty row attends its whole span, never 0/0


@pytest.mark.parametrize("page", [32, 64])
def test_other_page_sizes_and_mha(install, page):
    install()
    assert pa.implementation("cpu") == "npu"
    q, kp, vp, table, lengths, scale, page = _inputs(torch.bfloat16, group=1, page=page, dim=64, seed=7)
    lengths[3] = 1
    _close(op(q, kp, vp, table, lengths, scale, page),
           pa.reference_attention(q, kp, vp, table, lengths, scale, page), torch.bfloat16)


def test_calls_outside_the_kernels_limits_take_the_reference(install):
    stub = install()
    assert pa.implementation("cpu") == "npu"
    stub.calls.clear()
    for dtype, page in [(torch.float32, 16), (torch.bfloat16, 8)]:  # fp32 K/V; a page not aligned to 16
        args = _inputs(dtype, page=page)
        assert torch.equal(op(*args), pa.reference_attention(*args))
    q, kp, vp, table, lengths, scale, page = _inputs()
    kp, vp = (torch.cat((pool, pool), dim=-1)[..., :q.shape[-1]] for pool in (kp, vp))  # pools that are not
    assert not kp.is_contiguous()  # contiguous: no (blocknum, blocksize, H) view of them
    assert torch.equal(op(q, kp, vp, table, lengths, scale, page),
                       pa.reference_attention(q, kp, vp, table, lengths, scale, page))
    assert stub.calls == []


@pytest.mark.parametrize("options", [{"kernel": False}, {"error": "EZ1001: this SoC does not support the op"}],
                         ids=["the kernel missing", "a kernel that fails on this chip"])
def test_torch_npu_without_a_working_kernel_leaves_the_reference(install, options):
    install(**options)
    assert pa.implementation("cpu") == "reference"
    args = _inputs()
    assert torch.equal(op(*args), pa.reference_attention(*args))


def test_no_torch_npu_leaves_the_reference(install, monkeypatch):
    install()
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    pa._npu_attention.cache_clear()
    pa._probe.cache_clear()
    assert pa.implementation("cpu") == "reference"


def test_the_npu_op_is_one_node_of_a_captured_cpu_graph_and_replays_new_lengths(install):
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    stub = install()
    q, kp, vp, table, lengths, scale, page = _inputs()
    out = {}

    def step():
        out["o"] = op(q, kp, vp, table, lengths, scale, page)

    step()  # the probe runs here, outside capture
    graph = CPUGraph()
    with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(graph):
        step()  # a host read of the lengths would raise GraphCaptureError here
    assert graph.num_ops == 1
    lengths.copy_(torch.tensor([3, 2 * page + 1, page, 3 * page]))
    table.copy_(table.roll(1, 0))
    captured = stub.calls[-1]["actual_seq_lengths"]
    stub.calls.clear()
    graph.replay()
    assert len(stub.calls) == 1  # replay re-issues the op, which launches the kernel
    # A device graph replays the captured launch with its host arguments frozen; the emulation re-runs the op's
    # body, so check here that those host arguments do not depend on device values (new lengths, same list).
    assert stub.calls[0]["actual_seq_lengths"] == captured
    _close(out["o"], pa.reference_attention(q, kp, vp, table, lengths, scale, page), torch.bfloat16)


def test_the_stub_refuses_host_lengths_as_a_tensor():
    """The stub holds the kernel to its documented contract (a host ``List[int]``), so the op's call shape is
    checked, not assumed."""
    stub = make_stub_torch_npu()
    q = torch.zeros(1, 1, 32, dtype=torch.float16)
    kv = torch.zeros(2, 16, 32, dtype=torch.float16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="List"):
        stub.npu_incre_flash_attention(q, kv, kv, actual_seq_lengths=torch.tensor([4]), block_table=table,
                                       num_heads=1, block_size=16)
    got = stub.npu_incre_flash_attention(q, kv, kv, actual_seq_lengths=[4], block_table=table, num_heads=1,
                                         block_size=16, scale_value=1 / math.sqrt(32))
    assert got.shape == q.shape
