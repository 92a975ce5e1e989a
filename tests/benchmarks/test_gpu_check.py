"""bench/gpu_check.sh, the prepared device run: its dry run, its argument check, and its CPU rehearsal.

Device time is scarce (minutes per task), so the script must not fail for a reason
CPU CI could have caught. ``--cpu-mini`` runs every step of the real run (install
check, info, parity, decode, continuous with the long-tailed workload, rlhf,
headlines) on CPU with tiny models and sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # rehearses bench/gpu_check.sh in processes (tests/tiers.py)

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
STEPS = ("info", "parity", "kernel_check", "sampler_check", "capture_faults", "decode_gpt2", "continuous", "rlhf_opt13b", "handoff", "decode_qwen05b",
         "decode_opt13b")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def _fetched_wheels(tmp_path: Path) -> dict[str, str]:
    """What --fetch-wheels leaves behind, as far as the script checks (a pydantic wheel), without a download."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "pydantic-2.9.2-py3-none-any.whl").write_bytes(b"")
    return {"GPU_CHECK_WHEELS": str(wheels)}


def test_dry_run_prints_every_step_for_cuda_in_fp16_and_runs_nothing(tmp_path):
    proc = _run("--dry-run", env={"OUT": str(tmp_path / "out"), **_fetched_wheels(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in STEPS:
        line = next(x for x in lines if x.startswith(f"step {name} "))
        if name != "info":
            assert "--device cuda --dtype fp16" in line, line
    assert "--longtail-requests 64" in proc.stdout and "--longtail-model same" in proc.stdout
    qwen = next(x for x in lines if x.startswith("step decode_qwen05b "))  # issue 40's shape, next to transformers
    assert all(a in qwen for a in ("--model qwen2.5-0.5b", "--batch-sizes 64", "--prompt-len 1984", "--per-step",
                                   "--paths engine,transformers")), qwen
    faults = next(x for x in lines if x.startswith("step capture_faults "))
    assert "-m bench.capture_faults" in faults and "--json" in faults
    assert not (tmp_path / "out").exists()


def test_without_fetched_wheels_the_real_and_dry_runs_refuse_at_once_in_one_line(tmp_path):
    """Before, a device run found the missing wheels only at its install step, after its start-up."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    for mode in ("--dry-run", None):
        out = tmp_path / f"out{mode}"
        proc = _run(*([mode] if mode else []), env={"OUT": str(out), "GPU_CHECK_WHEELS": str(empty)}, timeout=20)
        assert proc.returncode == 3 and proc.stdout == "", (mode, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "--fetch-wheels" in proc.stderr and str(empty) in proc.stderr
        assert not out.exists()  # nothing ran


def test_an_unknown_argument_is_refused_with_the_usage():
    proc = _run("--gpu")
    assert proc.returncode == 2 and "usage:" in proc.stderr and "--fetch-wheels" in proc.stderr


def test_cpu_rehearsal_runs_every_step_and_writes_the_headlines(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _run("--cpu-mini", env={"OUT": str(out), "GPU_CHECK_WORK": str(work)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    for name in STEPS:
        assert f"step {name}: ok" in summary, summary
    assert "all steps ok" in summary
    headlines = (work / "headlines.txt").read_text()
    assert "parity: ok=True" in headlines and "long tail (tiny-gpt2, 64 requests, 8 slots)" in headlines
    assert "prefill forwards 8 / 8, admission rounds" in headlines  # prefilled ahead, 8 prompts at a time
    assert "capture faults: failed captures ok=True" in headlines and "two threads ok=True" in headlines
    continuous = json.loads((out / "continuous.json").read_text())
    assert continuous["long_tail"]["step_ratio"] > 3  # the workload's shape, not a timing
    assert (out / "gpu_check_results.tgz").stat().st_size > 0
