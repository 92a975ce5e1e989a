"""The per-layer decode ops (``hybrid_engine::rms_norm``, ``::add_rms_norm``, ``::rotary_qk``, ``::silu_mul``):
the references against transformers' own modules bit for bit, the ops through the dispatcher, one node each in a
captured CPU graph, argument checks, and the Triton kernels against the references under ``TRITON_INTERPRET=1``
(skipped where Triton is not installed: ``pip install 'hybrid-engine[dev]'``)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hybrid_engine.decode.ops import layer_ops as lo

ops = torch.ops.hybrid_engine
EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def _norm_inputs(dtype=torch.float32, shape=(2, 3, 40), seed=0):
    """``x``, ``residual``, ``weight`` (transformers' norm weight is the model's dtype)."""
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    weight = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, res, weight


def _rotary_inputs(dtype=torch.float32, b=2, heads=4, kv_heads=2, t=3, dim=16, cos_batch=None, seed=0):
    """``q``/``k`` as transformers makes them (``[B, T, H, D]`` projections viewed as ``[B, H, T, D]``) and real
    cos/sin tables at scattered positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, t, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    positions = torch.randint(0, 512, (cos_batch or b, t), generator=g).double()
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _mlp_inputs(dtype=torch.float32, shape=(2, 3, 56), seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (3.0 * torch.randn(*shape, generator=g)).to(dtype)
    up = torch.randn(*shape, generator=g).to(dtype)
    return gate, up


# ------------------------------------------------------------------ references == transformers
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_norms_are_transformers_rmsnorm_bit_for_bit(dtype):
    x, res, weight = _norm_inputs(dtype)
    norm = LlamaRMSNorm(x.shape[-1], eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(lo.reference_rms_norm(x, norm.weight, EPS), norm(x))
        hidden = res + x
        normed, new_res = lo.reference_add_rms_norm(x, res, norm.weight, EPS)
        assert torch.equal(new_res, hidden) and torch.equal(normed, norm(hidden))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rotary_is_transformers_apply_rotary_pos_emb_bit_for_bit(dtype):
    q, k, cos, sin = _rotary_inputs(dtype)
    got, want = lo.reference_rotary_qk(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_silu_mul_is_transformers_activation_bit_for_bit(dtype):
    gate, up = _mlp_inputs(dtype)
    assert torch.equal(lo.reference_silu_mul(gate, up), ACT2FN["silu"](gate) * up)


# ------------------------------------------------------------------ the ops on the CPU
def _cases(dtype=torch.float32, seed=0):
    """``(op name, args, reference)`` for each op."""
    x, res, weight = _norm_inputs(dtype, seed=seed)
    gate, up = _mlp_inputs(dtype, seed=seed)
    return [("rms_norm", (x, weight, EPS), lo.reference_rms_norm),
            ("add_rms_norm", (x, res, weight, EPS), lo.reference_add_rms_norm),
            ("rotary_qk", _rotary_inputs(dtype, seed=seed), lo.reference_rotary_qk),
            ("silu_mul", (gate, up), lo.reference_silu_mul)]


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_through_the_dispatcher_equal_the_reference_on_cpu(dtype):
    for name, args, reference in _cases(dtype):
        got, want = _as_tuple(getattr(ops, name)(*args)), _as_tuple(reference(*args))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_schema_fake_kernels_and_aot_dispatch(dtype):
    """torch's own custom-op checks: the fake kernels give the real outputs' shapes, dtypes and strides (q and k
    arrive as transposed views; a bf16 input with an fp32 norm weight promotes)."""
    x, res, weight = _norm_inputs(dtype)
    cases = [*_cases(dtype), ("add_rms_norm", (x, res, weight.float(), EPS), None)]
    for name, args, _ in cases:
        torch.library.opcheck(getattr(ops, name), args)


def test_cpu_without_the_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    lo._probe.cache_clear()
    try:
        assert lo.implementation("cpu") == "reference"
    finally:
        lo._probe.cache_clear()


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "rotary_qk", "silu_mul"])
def test_each_op_is_one_node_of_a_captured_cpu_graph_and_replays_new_inputs(name):
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    (_, args, reference), = [case for case in _cases() if case[0] == name]
    op = getattr(ops, name)
    out = {}

    def step():
        out["o"] = _as_tuple(op(*args))

    step()
    graph = CPUGraph()
    with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(graph):
        step()
    assert graph.num_ops == 1
    (_, fresh, _), = [case for case in _cases(seed=1) if case[0] == name]
    for static, new in zip(args, fresh, strict=True):
        if isinstance(static, torch.Tensor):
            static.copy_(new)
    graph.replay()
    want = _as_tuple(reference(*fresh))
    assert all(torch.equal(a, b) for a, b in zip(out["o"], want, strict=True))


@pytest.mark.leaves_pool_recording  # a raw capture that fails, with no runner to clean up (conftest releases it)
def test_a_first_call_inside_a_capture_is_refused_not_probed():
    """The probe reads the device (a capture would fail on it, and cache the failure as "reference")."""
    from hybrid_engine.accelerator.cpu_graph import CPUGraph, CPUStream, capture_cpu_graph, cpu_stream

    gate, up = _mlp_inputs()
    lo._probe.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="before capturing"):
            with cpu_stream(CPUStream()), torch.no_grad(), capture_cpu_graph(CPUGraph()):
                ops.silu_mul(gate, up)
        assert lo._probe.cache_info().currsize == 0  # nothing cached from inside the capture
        assert torch.equal(ops.silu_mul(gate, up), lo.reference_silu_mul(gate, up))
    finally:
        lo._probe.cache_clear()


def test_bad_arguments_are_named():
    x, res, weight = _norm_inputs()
    q, k, cos, sin = _rotary_inputs()
    gate, up = _mlp_inputs()
    with pytest.raises(ValueError, match="rms_norm: weight must be"):
        ops.rms_norm(x, weight[:-1], EPS)
    with pytest.raises(ValueError, match="eps must be"):
        ops.rms_norm(x, weight, -1.0)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        ops.rms_norm(x.long(), weight, EPS)
    with pytest.raises(ValueError, match="add_rms_norm: residual must"):
        ops.add_rms_norm(x, res[:1], weight, EPS)
    with pytest.raises(ValueError, match="rotary_qk: q must be"):
        ops.rotary_qk(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="rotary_qk: k must be"):
        ops.rotary_qk(q, k[:, :, :2], cos, sin)
    odd_q, odd_k = q[..., :15], k[..., :15]
    with pytest.raises(ValueError, match="head_dim must be even"):
        ops.rotary_qk(odd_q, odd_k, cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="rotary_qk: cos must be"):
        ops.rotary_qk(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="rotary_qk: sin must"):
        ops.rotary_qk(q, k, cos, sin.double())
    with pytest.raises(ValueError, match="silu_mul: up must"):
        ops.silu_mul(gate, up[..., :8])
    assert torch.equal(ops.silu_mul(gate, up), lo.reference_silu_mul(gate, up))  # still usable


# ------------------------------------------------------------------ Triton kernels, interpreted
_KERNEL_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_layer_ops import EPS, _mlp_inputs, _norm_inputs, _rotary_inputs
from hybrid_engine.decode.ops import layer_kernels as lk, layer_ops as lo
assert lo.implementation("cpu") == "triton", "the probe did not choose the kernels"
ops = torch.ops.hybrid_engine

def close(name, got, want, dtype, exact=False):
    # exact: elementwise IEEE arithmetic rounded where the reference rounds (rotary; the residual sum); else one
    # rounding step's worth (the variance's summation order, rsqrt and exp are the kernel's own)
    tol = 0.0 if exact else 1e-5 if dtype == torch.float32 else 1e-2
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, equal_nan=True,
                                   msg=lambda m: f"{{name}} {{dtype}}: {{m}}")

def add_norm(name, args, dtype):
    got, want = ops.add_rms_norm(*args), lo.reference_add_rms_norm(*args)
    close(name, got[0], want[0], dtype)
    close(name + " residual", got[1], want[1], dtype, exact=True)

for dtype in (torch.float32, torch.bfloat16):
    for shape in [(2, 3, 40), (5, 8200)]:  # leading dims; a row longer than one block (two passes)
        x, res, w = _norm_inputs(dtype, shape)
        close("rms_norm", ops.rms_norm(x, w, EPS), lo.reference_rms_norm(x, w, EPS), dtype)
        add_norm("add_rms_norm", (x, res, w, EPS), dtype)
    x, res, w = _norm_inputs(dtype, (4, 6, 2, 16))  # a head norm on a transposed view: not viewable as rows
    xt, rt = x.transpose(1, 2), res.transpose(1, 2)
    close("rms_norm (strided)", ops.rms_norm(xt, w, EPS), lo.reference_rms_norm(xt, w, EPS), dtype)
    add_norm("add_rms_norm (strided)", (xt, rt, w, EPS), dtype)
    close("rms_norm (fp32 weight)", ops.rms_norm(x, w.float(), EPS), lo.reference_rms_norm(x, w.float(), EPS), dtype)
    for kw in [{{}}, {{"heads": 7, "kv_heads": 1, "t": 1, "dim": 8}}, {{"cos_batch": 1}}, {{"dim": 12}}]:
        q, k, cos, sin = _rotary_inputs(dtype, **kw)
        close(f"rotary_qk {{kw}}", ops.rotary_qk(q, k, cos, sin), lo.reference_rotary_qk(q, k, cos, sin), dtype,
              exact=True)
    q, k, cos, sin = _rotary_inputs(dtype)
    qc, kc = q.contiguous(), k.transpose(2, 3).contiguous().transpose(2, 3)  # contiguous; last dim strided
    close("rotary_qk (layouts)", ops.rotary_qk(qc, kc, cos, sin), lo.reference_rotary_qk(qc, kc, cos, sin), dtype,
          exact=True)
    gate, up = _mlp_inputs(dtype, (2, 3, 2 * 1100))  # a row of two blocks; gate and up halves of one tensor
    g, u = gate[..., :1100], gate[..., 1100:]
    close("silu_mul", ops.silu_mul(g, u), lo.reference_silu_mul(g, u), dtype)
    gate, up = _mlp_inputs(dtype)
    close("silu_mul", ops.silu_mul(gate, up), lo.reference_silu_mul(gate, up), dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -30.0, 30.0]).to(dtype)
    close("silu_mul (specials)", ops.silu_mul(special, special), lo.reference_silu_mul(special, special), dtype)
    assert torch.equal(ops.silu_mul(gate, up), lk.triton_silu_mul(gate, up)), "the op did not run the kernel"
print("kernels ok")
"""


@pytest.mark.slow  # a process of its own (tests/tiers.py)
def test_triton_kernels_match_the_reference_under_the_interpreter():
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
    assert done.returncode == 0 and "kernels ok" in done.stdout, done.stderr[-3000:]


# ------------------------------------------------------------------ Triton kernels, compiled for a GPU target
_COMPILE_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybrid_engine.decode.ops import layer_kernels as lk

def compile_(fn, signature, constexprs, **options):
    src = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**lk.LAUNCH_OPTIONS, **options})

strides = "qs_b qs_h qs_t ks_b ks_h ks_t cs_b cs_t qo_b qo_h qo_t ko_b ko_h ko_t".split()
for ty in ("fp32", "bf16", "fp16"):
    p = "*" + ty
    for has_res in (True, False):
        compile_(lk._rms_norm_kernel, {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p, "hidden_ptr": p, "n": "i32",
                                       "x_stride": "i64", "res_stride": "i64", "eps": "fp32"},
                 {"HAS_RES": has_res, "BLOCK": 1024})
    pointers = dict.fromkeys(["q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr"], p)
    rotary = compile_(lk._rotary_qk_kernel, {**pointers, "heads": "i32", "seq": "i32", **dict.fromkeys(strides, "i64")},
                      {"DIM": 128, "DIM_PAD": 128}, num_warps=1)
    compile_(lk._rotary_qk_kernel, {**pointers, "heads": "i32", **dict.fromkeys(strides, "i64")},  # a decode step:
             {"seq": 1, "DIM": 64, "DIM_PAD": 64}, num_warps=1)  # Triton specializes an int argument of 1
    silu = compile_(lk._silu_mul_kernel, {"g_ptr": p, "u_ptr": p, "out_ptr": p, "n": "i32", "g_stride": "i64",
                                          "u_stride": "i64"}, {"BLOCK": 1024})
    if ty == "fp32":  # the launch options keep a product and a sum two roundings, as in the reference
        assert "fma" not in rotary.asm["ptx"] and "fma" not in silu.asm["ptx"], "contracted into fma"
print("compiled ok")
"""


@pytest.mark.slow  # compiles 18 kernels in a process of its own
def test_triton_kernels_compile_for_an_sm90_target_without_contraction(tmp_path):
    """What the interpreter cannot check: the kernels lower to PTX and through ptxas for an H100 (no GPU needed,
    nothing runs), and fp32 rotary/SiLU·mul keep the reference's separate roundings (no ``fma``)."""
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("written against Triton 3.9's ASTSource (signatures by name)")  # the kernels need only 3.0
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled ok" in done.stdout, done.stderr[-3000:]
