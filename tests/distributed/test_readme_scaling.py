"""The README's "Scaling out" script runs as written on 2 gloo ranks, for ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("stage", [2, 3])
def test_readme_scaling_out_script_runs_on_two_ranks(tmp_path, stage):
    block = re.search(r"## Scaling out\n.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "ZERO_STAGE = 2" in block
    script = tmp_path / "train.py"
    script.write_text(block.replace("ZERO_STAGE = 2", f"ZERO_STAGE = {stage}"))
    proc = run_ranks([str(script)], nproc=2, timeout_s=180)
    assert proc.returncode == 0, proc.stdout[-6000:]
    printed = re.findall(r"^(\d+) (\d+) (.*)$", proc.stdout, re.M)
    assert len(printed) == 2  # one line per rank: global steps, captures, refusal reason
    for steps, captures, reason in printed:
        assert steps == "3"
        if stage == 2:
            assert int(captures) > 0 and reason == "None"
        else:
            assert captures == "0" and "ZeRO stage 3" in reason
