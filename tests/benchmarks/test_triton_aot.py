"""``bench kernels --compile-for``: every Triton kernel of the decode ops compiles for an NVIDIA target with
Triton's own compiler (no GPU here, and no interpreter), at a decode step's real widths, and fits the target's
shared memory; a kernel the compiler refuses, or one too big for the target, fails the command."""

from __future__ import annotations

import json
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA back end to compile with")

from hybrid_engine.benchmarks import kernel_check, triton_aot  # noqa: E402
from hybrid_engine.cli import main  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                reason="compiles kernels: not under Triton's interpreter")


def test_every_decode_kernel_compiles_for_sm90_in_bf16(tmp_path, capsys):
    out = tmp_path / "aot.json"
    assert main(["bench", "kernels", "--compile-for", "sm_90", "--dtype", "bf16", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["ok"] and d["compile_for"] == ["sm_90"]
    rows = d["rows"]
    # Every launch of the checks compiled at least one kernel, and each is the op's own.
    assert {r["op"] for r in rows} == {name for name, _ in kernel_check.LAUNCHES}
    kernels = {r["op"]: r["kernel"] for r in rows}
    assert kernels["rms_norm"] == "_rms_norm_kernel" and kernels["silu_mul"] == "_silu_mul_kernel"
    assert kernels["sample_rows top-p 0.9"] == "sample_kernel"
    for r in rows:
        assert r["ok"] and r["error"] is None and r["dtype"] == "bfloat16", r
        assert 0 <= r["shared_bytes"] <= triton_aot.SHARED_MEMORY_LIMIT[90]
        assert r["registers"] is None or 0 < r["registers"] <= 255
    assert "every kernel compiled and fits" in capsys.readouterr().out


@triton.jit
def _not_a_power_of_two(x_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)  # the compiler needs a power of two here
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)


def test_a_kernel_the_compiler_refuses_fails_the_command(monkeypatch, capsys):
    def launch(device, dtype, g):
        _not_a_power_of_two[(1,)](torch.zeros(48, dtype=dtype), BLOCK=48)

    monkeypatch.setattr(kernel_check, "LAUNCHES", [("bad arange", launch)])
    with pytest.raises(SystemExit) as exc:
        main(["bench", "kernels", "--compile-for", "sm_80", "--dtype", "fp32"])
    assert exc.value.code == 1
    printed = capsys.readouterr().out
    assert "SOME KERNELS DO NOT COMPILE" in printed and "bad arange" in printed and "NO:" in printed


def test_a_kernel_over_the_targets_shared_memory_fails(monkeypatch):
    monkeypatch.setitem(triton_aot.SHARED_MEMORY_LIMIT, 90, 16)  # a target whose blocks get 16 bytes
    monkeypatch.setattr(kernel_check, "LAUNCHES", [kernel_check.LAUNCHES[0]])  # paged attention: 2 KiB
    rows = triton_aot.compile_kernels([90], [torch.float16])
    assert rows and not any(r["ok"] for r in rows)
    assert "shared memory, sm_90 gives a block 16" in rows[0]["error"]


def test_an_op_that_launches_nothing_is_reported(monkeypatch):
    monkeypatch.setattr(kernel_check, "LAUNCHES", [("no kernel", lambda device, dtype, g: None)])
    (row,) = triton_aot.compile_kernels([80], [torch.float32])
    assert not row["ok"] and row["error"] == "the op launched no Triton kernel"


def test_bad_targets_are_refused_by_name(capsys):
    with pytest.raises(ValueError, match="sm_75"):
        triton_aot.parse_targets("sm_75")
    with pytest.raises(SystemExit, match="--compile-for takes NVIDIA targets"):
        main(["bench", "kernels", "--compile-for", "sm_90,volta"])
