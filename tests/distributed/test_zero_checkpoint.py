"""ZeRO checkpoints are verified before DeepSpeed reads a file, in one process without a launcher.

Before: ``latest`` was DeepSpeed's (truncate-then-write), and a corrupt ``hybrid_engine_rng_rank0.pt``
raised a raw ``UnpicklingError`` after DeepSpeed had loaded the weights and the counters (``global_steps``
3 -> 1). The worker runs in a subprocess (the process group is process-wide) killed whole at the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)

pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("zero_checkpoint_worker.py")
TIMEOUT_S = 300
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
DEEPSPEED_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
RNG_FILE = "hybrid_engine_rng_rank0.pt"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero_checkpoint")
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out)], env={**clean, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"the ZeRO-1 checkpoint worker did not finish in {TIMEOUT_S} s:\n{text[-4000:]}")
    assert proc.returncode == 0, text[-6000:]
    line = next(line for line in text.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_the_manifest_lists_deepspeeds_files_and_ours_and_latest_is_written_last(result):
    assert result["files"] == sorted([*DEEPSPEED_FILES, RNG_FILE]) == result["manifest"]
    assert result["latest"] == "global_step3" and result["tmp_left"] == []
    good = result["good"]
    assert "/global_step3/" in good["path"] and good["client"]["epoch"] == 1  # DeepSpeed returns a file path
    assert good["steps"] == 3 and good["restored"]


@pytest.mark.parametrize("name", [*DEEPSPEED_FILES, RNG_FILE])
def test_a_damaged_file_is_refused_by_name_before_deepspeed_loads_anything(result, name):
    case = result[f"flip:{name}"]
    assert case["error"] is not None and case["error"].startswith("ValueError: load_checkpoint: ")
    assert f"{name} does not match its sha256 digest" in case["error"] and "Nothing was loaded" in case["error"]
    assert case["unchanged"]  # still at step 4 with its own weights: DeepSpeed never ran


def test_a_damaged_manifest_or_latest_is_refused_by_name(result):
    assert "hybrid_engine_manifest.json" in result["flip:manifest"]["error"] and result["flip:manifest"]["unchanged"]
    for case in ("latest:binary", "latest:absolute"):
        assert result[case]["error"].startswith("ValueError: load_checkpoint: ") and "/latest " in result[case]["error"]
        assert "global_step3" in result[case]["error"] and result[case]["unchanged"]  # the tags present


def test_without_a_manifest_the_rng_file_is_still_checked_first_and_an_intact_one_loads_with_a_warning(result):
    bad = result["legacy:bad-rng"]
    assert bad["error"].startswith("ValueError: load_checkpoint: ") and RNG_FILE in bad["error"]
    assert bad["unchanged"]  # before: global_steps 3 -> 1 and a raw UnpicklingError
    intact = result["legacy:intact"]
    assert intact["error"] is None and intact["steps"] == 3
    assert any("loaded unverified" in w for w in intact["warnings"])
