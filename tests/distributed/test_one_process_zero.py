"""ZeRO 1-3 in one process started as ``python train.py``: no torchrun, no launcher variables.

DeepSpeed alone would reach MPI discovery (``mpi4py``) or assert ``LOCAL_RANK``;
the engine sets up a one-rank group on loopback first. Each run is a subprocess
(the group is process-wide) in a session of its own, killed whole at the timeout.
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

WORKER = Path(__file__).with_name("one_process_worker.py")
TIMEOUT_S = 300
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def run_worker(*cases: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    proc = subprocess.Popen([sys.executable, str(WORKER), *cases], env={**clean, **(env or {}), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"one-process ZeRO run did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    return proc.returncode, out


def results(out: str) -> dict:
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_zero_1_2_3_train_in_one_process_without_a_launcher_as_stage_0_does():
    code, out = run_worker("0:fp32", "1:fp32", "2:fp32", "3:fp32", "2:bf16", "3:fp32:uncopyable", "0:fp32:lora",
                           "3:fp32:lora")
    assert code == 0, out[-6000:]
    r = results(out)
    assert r["world"] == 1
    for case in ("1:fp32", "2:fp32", "3:fp32", "3:fp32:uncopyable", "3:fp32:lora"):
        got, reference = r[case], r["0:fp32:lora" if case.endswith("lora") else "0:fp32"]
        assert got["zero_stage"] == int(case[0]) and got["global_steps"] == 3
        # The same AdamW steps on the same batch as plain PyTorch at stage 0.
        assert got["losses"] == pytest.approx(reference["losses"], abs=1e-4), case
        assert got["tokens"] == reference["tokens"], case
    # The graph flag alone at ZeRO-3: generation on the gathered inference copy it implies, captured and replayed;
    # with LoRA layers injected by hand, on a structural copy.
    for case in ("3:fp32", "3:fp32:lora"):
        zero3 = r[case]
        assert zero3["inference_copy"] and zero3["captures"] > 0 and zero3["replays"] > 0, case
        assert zero3["refusal"] is None and not zero3["init_warnings"] and zero3["config_refusal"] is None, case
    # A layer no copy can mirror: one warning naming it and the way to silence it, then eager on gathered weights.
    injected = r["3:fp32:uncopyable"]
    assert not injected["inference_copy"] and injected["captures"] == 0 and "ZeRO stage 3" in injected["refusal"]
    assert "ZeRO stage 3" in injected["config_refusal"]  # the copy taken back stays off when the config is reloaded
    (warning,) = injected["init_warnings"]
    assert "transformer.h.0.extra.weight" in warning and "zero3_gathered_inference_copy to false" in warning
    bf16 = r["2:bf16"]
    assert bf16["global_steps"] == 3 and bf16["losses"][-1] < bf16["losses"][0]


def test_exact_logprobs_hold_at_zero_2_and_3_in_one_process():
    from conftest import exact_mode_unavailable

    if exact_mode_unavailable() is not None:
        pytest.skip(str(exact_mode_unavailable()))
    code, out = run_worker("2:fp32:exact", "3:fp32:exact", "2:bf16:exact")
    assert code == 0, out[-6000:]
    r = results(out)
    for case, stage in (("2:fp32:exact", 2), ("3:fp32:exact", 3), ("2:bf16:exact", 2)):
        assert r[case]["zero_stage"] == stage and r[case]["tokens"] == 32
        assert r[case]["max_diff"] == 0.0, case  # rollout logprobs bit for bit the training forward's


def test_episode_kv_is_kept_between_turns_and_dropped_after_a_step_at_zero_1_to_3():
    code, out = run_worker("1:fp32:episode", "2:fp32:episode", "3:fp32:episode")
    assert code == 0, out[-6000:]
    r = results(out)
    for stage in (1, 2, 3):
        got = r[f"{stage}:fp32:episode"]
        assert got["zero_stage"] == stage
        first, second, after_step, fourth = got["reused"]
        assert first == 0 and second > 0 and fourth > 0, got  # kept between turns...
        assert after_step == 0, got  # ...but not across the optimizer step
        assert got["same_tokens"], got  # the continued turn samples what a single turn on its history does


def test_a_partial_launch_is_refused_in_one_sentence_naming_the_launcher():
    code, out = run_worker("1:fp32", env={"WORLD_SIZE": "2"})
    assert code != 0
    assert "WORLD_SIZE=2 is set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not: launch the ranks with " \
           "`torchrun" in out
    assert "mpi4py" not in out


def test_fp16_at_zero_trains_in_one_process():
    """On every CPU: the worker reports fp16 support for DeepSpeed's CPU accelerator (tests/distributed/cpu_fp16.py,
    a test double of its capability report; on a CPU with oneDNN's fp16 kernels it says so already)."""
    code, out = run_worker("1:fp16")
    assert code == 0, out[-6000:]
    got = results(out)["1:fp16"]
    assert got["zero_stage"] == 1 and got["global_steps"] == 3 and got["losses"][-1] < got["losses"][0]
