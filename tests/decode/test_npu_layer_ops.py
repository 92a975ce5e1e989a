"""The layer ops' ``"npu"`` implementation (torch_npu's fused kernels), against a stub ``torch_npu`` (no NPU here).

What is stubbed, and only that (the hardware boundary): ``torch_npu`` itself. Its kernels compute what torch_npu
documents, in fp32 with one rounding at the output (as a fused kernel does), and refuse what it documents they
refuse: ``npu_rms_norm``/``npu_add_rms_norm`` a ``gamma`` of another dtype or a 1-D input, ``npu_rotary_mul`` a
non-4-D input, ``r1``/``r2`` not broadcastable as BNSD's ``11SD``/``B1SD``/``BNSD`` or outside [-1, 1], and
``npu_swiglu`` a non-contiguous input or an odd split dim. Every launch is logged in ``calls``. The stub runs on
the CPU, so the probe's "runs on the tensor's device" is the CPU here. Nothing here is verified on a real NPU.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from test_layer_ops import EPS, _mlp_inputs, _norm_inputs, _rotary_inputs

from hybrid_engine.accelerator import is_capturing
from hybrid_engine.decode.ops import layer_ops as lo

ops = torch.ops.hybrid_engine


# ------------------------------------------------------------------------------------------------ stub
def make_stub_torch_npu(*, add_rms_norm: bool = True, swiglu: bool = True,
                        error: str | None = None) -> types.ModuleType:
    """A stand-in for ``torch_npu`` with the layer kernels; ``error``: each kernel raises it (a chip without
    them)."""
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.calls = []

    def launch(name: str) -> None:
        mod.calls.append(name)
        if error is not None:
            raise RuntimeError(error)

    def norm(x, gamma, epsilon):
        if gamma.dtype != x.dtype or not 2 <= x.dim() <= 8:
            raise RuntimeError(f"stub torch_npu: rms_norm of {x.dtype} {tuple(x.shape)} with gamma {gamma.dtype}")
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + epsilon)
        return (h * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rms_norm(self, gamma, epsilon=1e-6):
        launch("npu_rms_norm")
        return norm(self, gamma, epsilon)

    def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
        launch("npu_add_rms_norm")
        x = (x1.float() + x2.float()).to(x1.dtype)
        return (*norm(x, gamma, epsilon), x)

    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
        launch("npu_rotary_mul")
        b, n, s, d = input.shape if input.dim() == 4 else (None,) * 4
        if b is None or r1.shape != r2.shape or r1.shape not in {(1, 1, s, d), (b, 1, s, d), (b, n, s, d)}:
            raise RuntimeError(f"stub torch_npu: rotary on {tuple(input.shape)} with r1 {tuple(r1.shape)}")
        # The value check is the stub's (a device kernel does not read values on the host): not while capturing.
        if r1.dtype != input.dtype or (not is_capturing() and (r1.abs().max() > 1 or r2.abs().max() > 1)):
            raise RuntimeError("stub torch_npu: r1/r2 must be in [-1, 1] and of the input's dtype")
        x = input.float()
        rotated = torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)
        return (r1.float() * x + r2.float() * rotated).to(input.dtype)

    def npu_swiglu(input, dim=-1):
        launch("npu_swiglu")
        if not input.is_contiguous() or input.shape[dim] % 2:
            raise RuntimeError(f"stub torch_npu: swiglu of {tuple(input.shape)} along {dim}")
        a, b = input.float().chunk(2, dim=dim)
        return (F.silu(a) * b).to(input.dtype)

    mod.npu_rms_norm, mod.npu_rotary_mul = npu_rms_norm, npu_rotary_mul
    if add_rms_norm:
        mod.npu_add_rms_norm = npu_add_rms_norm
    if swiglu:
        mod.npu_swiglu = npu_swiglu
    return mod


@pytest.fixture
def install(monkeypatch):
    """Installs a stub (``install(**options)``) with the probe's caches cleared around it; the CPU without the
    Triton interpreter, so the Triton candidate does not run here."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def clear():
        lo._probe.cache_clear()
        lo._npu_impl.cache_clear()

    def put(**options):
        stub = make_stub_torch_npu(**options)
        monkeypatch.setitem(sys.modules, "torch_npu", stub)
        clear()
        return stub

    yield put
    clear()


def _check(name, got, want, dtype, exact=False):
    tol = 0.0 if exact else 1e-5 if dtype == torch.float32 else 1e-2  # a fused kernel rounds once
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"{name} {dtype}: {m}")


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_picks_torch_npus_kernels_and_each_op_launches_them(install, dtype):
    stub = install()
    assert lo.implementation("cpu") == "npu"
    x, res, w = _norm_inputs(dtype)
    q, k, cos, sin = _rotary_inputs(dtype)
    gate, up = _mlp_inputs(dtype)
    for name, args, kernels in [
            ("rms_norm", (x, w, EPS), ["npu_rms_norm"]),
            ("add_rms_norm", (x, res, w, EPS), ["npu_add_rms_norm"]),
            ("rotary_qk", (q, k, cos, sin), ["npu_rotary_mul", "npu_rotary_mul"]),
            ("silu_mul", (gate, up), ["npu_swiglu"])]:
        stub.calls.clear()
        got, want = getattr(ops, name)(*args), getattr(lo, f"reference_{name}")(*args)
        assert stub.calls == kernels, name
        _check(name, got, want, dtype)
        if name == "add_rms_norm":
            _check("the residual sum", got[1], want[1], dtype, exact=True)


def test_without_npu_add_rms_norm_the_sum_then_npu_rms_norm(install):
    stub = install(add_rms_norm=False)
    assert lo.implementation("cpu") == "npu"
    x, res, w = _norm_inputs(torch.bfloat16)
    got = ops.add_rms_norm(x, res, w, EPS)
    assert stub.calls[-1:] == ["npu_rms_norm"]
    assert torch.equal(got[1], res + x)
    _check("add_rms_norm", got, lo.reference_add_rms_norm(x, res, w, EPS), torch.bfloat16)


@pytest.mark.parametrize("options", [{"swiglu": False}, {"error": "EZ1001: this SoC does not support the op"}],
                         ids=["a kernel missing", "kernels that fail on this chip"])
def test_torch_npu_without_working_kernels_leaves_the_reference(install, options):
    install(**options)
    assert lo.implementation("cpu") == "reference"
    x, _, w = _norm_inputs()
    assert torch.equal(ops.rms_norm(x, w, EPS), lo.reference_rms_norm(x, w, EPS))


def test_calls_outside_a_kernels_contract_take_the_reference(install):
    stub = install()
    assert lo.implementation("cpu") == "npu"
    stub.calls.clear()
    x, _, w = _norm_inputs(torch.bfloat16)
    q, k, cos, sin = _rotary_inputs(torch.bfloat16, b=1000, t=1)  # past npu_rotary_mul's B < 1000
    gate, up = _mlp_inputs(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w.float(), EPS), lo.reference_rms_norm(x, w.float(), EPS))  # mixed dtypes
    assert torch.equal(ops.rms_norm(x[0, 0], w, EPS), lo.reference_rms_norm(x[0, 0], w, EPS))  # 1-D
    got, want = ops.rotary_qk(q, k, cos, sin), lo.reference_rotary_qk(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(ops.silu_mul(gate, up.float()), lo.reference_silu_mul(gate, up.float()))
    assert stub.calls == []


def test_an_npu_op_is_one_node_of_a_captured_cpu_graph(install):
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    stub = install()
    q, k, cos, sin = _rotary_inputs()
    out = {}

    def step():
        out["qk"] = ops.rotary_qk(q, k, cos, sin)

    step()
    graph = CPUGraph()
    with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(graph):
        step()
    assert graph.num_ops == 1
    fresh = _rotary_inputs(seed=1)
    for static, new in zip((q, k, cos, sin), fresh, strict=True):
        static.copy_(new)
    stub.calls.clear()
    graph.replay()
    assert stub.calls == ["npu_rotary_mul", "npu_rotary_mul"]  # replay re-issues the op, which launches both
    _check("rotary_qk replay", out["qk"], lo.reference_rotary_qk(*fresh), torch.float32)
