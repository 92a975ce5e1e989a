"""``hybrid-engine bench rlhf --zero-stage N`` starts its own 2 ranks and reports for all of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)

pytest.importorskip("deepspeed")


def run_bench(tmp_path, stage: int, *extra: str) -> dict:
    out = tmp_path / f"zero{stage}.json"
    command = [sys.executable, "-m", "hybrid_engine", "bench", "rlhf", "--zero-stage", str(stage),
               "--prompt-len", "8", "--new-tokens", "6", "--batch-size", "2", "--iterations", "1",
               "--timeout", "200", "--json", str(out), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("bench rlhf --zero-stage did not finish in 240 s")
    assert proc.returncode == 0, text[-4000:]
    assert f"ZeRO stage {stage}" in text and "(DeepSpeed) on 2 ranks" in text
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage,extra", [(0, ("--world-size", "2")), (2, ()), (3, ()), (3, ("--no-zero3-inference-copy",))])
def test_bench_rlhf_zero_stage_runs_on_two_ranks(tmp_path, stage, extra):
    payload = run_bench(tmp_path, stage, *extra)
    assert payload["settings"]["zero_stage"] == stage and payload["settings"]["world_size"] == 2
    agreement = payload["token_agreement_all_iterations"]
    assert agreement["total"] == 2 * 2 * 6 * 2 and agreement["identical"] == agreement["total"]  # both ranks
    captures = payload["capture"]["captures"]
    # ZeRO-3: the graph flag implies the gathered inference copy, unless --no-zero3-inference-copy.
    assert payload["settings"]["zero3_inference_copy"] == (stage == 3 and not extra)
    if stage == 3 and extra:
        assert captures == 0 and "ZeRO stage 3" in payload["graph"]["graph"]["refusal"]
    else:
        assert captures >= 1 and payload["capture"]["captures_per_iteration"][1:] == [0]
