"""docs/scaling.md's training script runs as written: on 2 gloo ranks for ZeRO-2 and ZeRO-3, and as
``python train.py`` in one process without a launcher."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)

SCALING = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"
HEADING = "## A training script"
#: What a launcher sets; removed for the one-process run.
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
TIMEOUT_S = 180


def training_script(tmp_path: Path, stage: int) -> Path:
    text = SCALING.read_text()
    block = re.search(rf"^{re.escape(HEADING)}\n.*?^```python\n(.*?)^```", text, re.S | re.M).group(1)
    assert "ZERO_STAGE = 2" in block
    script = tmp_path / "train.py"
    script.write_text(block.replace("ZERO_STAGE = 2", f"ZERO_STAGE = {stage}"))
    return script


def check_printed(stdout: str, ranks: int, stage: int) -> None:
    printed = re.findall(r"^(\d+) (\d+) (.*)$", stdout, re.M)
    assert len(printed) == ranks, stdout[-6000:]  # one line per rank: global steps, captures, refusal reason
    for steps, captures, reason in printed:
        assert steps == "3"
        # At ZeRO-3 the graph flag implies the gathered inference copy, on which graphs replay.
        assert int(captures) > 0 and reason == "None", stage


@pytest.mark.parametrize("stage", [2, 3])
def test_scaling_out_script_runs_on_two_ranks(tmp_path, stage):
    proc = run_ranks([str(training_script(tmp_path, stage))], nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_printed(proc.stdout, 2, stage)


def test_scaling_out_script_runs_in_one_process_without_a_launcher(tmp_path):
    """``python train.py``: the engine sets up a one-rank group for DeepSpeed itself."""
    script = training_script(tmp_path, 2)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: nothing outlives the test
        out, _ = proc.communicate()
        pytest.fail(f"python train.py did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    check_printed(out, 1, 2)
