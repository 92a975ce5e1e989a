"""bench/layer_ops_check.py, the layer ops' device check: its CPU rehearsal (tiny shapes, the Triton kernels under
``TRITON_INTERPRET=1``), so a device run does not fail for a reason CPU CI could have caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a process of its own, interpreted kernels (tests/tiers.py)

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_rehearsal_checks_every_op_on_the_kernels(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "layer_ops.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "bench.layer_ops_check", "--device", "cpu", "--mini", "--json",
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["implementation"] == "triton" and summary["ok"]
    checked = {(r["dtype"], r["op"]) for r in summary["results"]}
    ops = {"rms_norm", "add_rms_norm", "add_rms_norm residual", "rotary_qk q", "rotary_qk k", "silu_mul"}
    assert checked == {(dtype, op) for dtype in ("float32", "bfloat16") for op in ops}
    assert all(r["equal_fraction"] == 1.0 for r in summary["results"] if r["op"].startswith("rotary_qk"))
