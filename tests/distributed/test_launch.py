"""``run_ranks``: a hang ends at the timeout, and a failure at once, with the ranks' process group killed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from hybrid_engine.distributed.launch import RanksTimedOut, exit_launched_rank, run_ranks

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)


def test_hung_ranks_are_killed_at_the_timeout(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"pathlib.Path({str(pids)!r}, os.environ['RANK']).write_text(str(os.getpid()))\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], flush=True)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    with pytest.raises(RanksTimedOut, match="did not finish in 8 s") as info:
        run_ranks([str(script)], nproc=2, timeout_s=8)
    assert time.monotonic() - start < 30
    assert "rank 0 of 2 127.0.0.1" in str(info.value) or "rank 1 of 2 127.0.0.1" in str(info.value)
    found = sorted(p.name for p in pids.iterdir())
    assert found == ["0", "1"]
    for p in pids.iterdir():
        pid = int(p.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone: killed with the group


def test_one_failing_rank_ends_the_others_at_once():
    # Rank 1 fails at once; rank 0 would wait 600 s (as a rank blocked in a collective would).
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(600)"
    start = time.monotonic()
    proc = run_ranks(["-c", code], nproc=2, timeout_s=120)
    assert proc.returncode == 3 and time.monotonic() - start < 30
    ok = run_ranks(["-c", "import os; print('hello from', os.environ['RANK'])"], nproc=2, timeout_s=60)
    assert ok.returncode == 0 and "hello from 0" in ok.stdout and "hello from 1" in ok.stdout
    with pytest.raises(ValueError, match="nproc"):
        run_ranks(["-c", "pass"], nproc=0, timeout_s=5)


def test_a_launched_rank_exits_without_interpreter_teardown(tmp_path):
    """exit_launched_rank ends a rank with its output flushed and without running teardown (where gloo and
    DeepSpeed destructors can abort a finished rank); anywhere else it does nothing."""
    code = ("import atexit, sys\n"
            "from hybrid_engine.distributed.launch import exit_launched_rank\n"
            "atexit.register(lambda: print('teardown ran', flush=True))\n"
            "print('done, unflushed', end='')\n"
            "exit_launched_rank()\n"
            "sys.exit(5)\n")
    proc = run_ranks(["-c", code], nproc=2, timeout_s=60)
    assert proc.returncode == 0
    assert proc.stdout.count("done, unflushed") == 2 and "teardown ran" not in proc.stdout
    exit_launched_rank()  # not a launched rank: returns


@pytest.mark.parametrize("kwargs,error,match", [
    ({"nproc": "2"}, TypeError, "nproc must be an int"),
    ({"nproc": 0}, ValueError, "nproc must be >= 1"),
    ({"nproc": 1, "timeout_s": 0}, ValueError, "timeout_s must be a number of seconds > 0"),
    ({"nproc": 1, "args": "-c pass"}, TypeError, "args must be a list"),
])
def test_bad_arguments_are_named_before_anything_starts(kwargs, error, match):
    call = {"args": ["-c", "pass"], "timeout_s": 10, **kwargs}
    with pytest.raises(error, match=match):
        run_ranks(**call)


def test_ranks_share_one_process_group_on_python_3_10_too(tmp_path):
    """requires-python is >= 3.10, whose Popen has no process_group keyword: launch.py (stdlib only) is loaded
    on its own into a Python 3.10 found on this machine, and its ranks must still share one group."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [shutil.which("python3.10"), *map(str, sorted(pyenv.glob("3.10*/bin/python3.10")))]
    runs = [p for p in found if p and subprocess.run([p, "-c", "pass"], capture_output=True).returncode == 0]
    if not runs:
        pytest.skip("no Python 3.10 on this machine")
    python310 = runs[0]
    launch = Path(__file__).resolve().parents[2] / "hybrid_engine" / "distributed" / "launch.py"
    script = tmp_path / "check.py"
    script.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('launch', {str(launch)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "p = m.run_ranks(['-c', 'import os; print(\"group\", os.getpgid(0))'], nproc=2, timeout_s=30)\n"
        "groups = {line.split()[1] for line in p.stdout.splitlines() if line.startswith('group')}\n"
        "print(sys.version_info[:2], p.returncode, len(groups))\n"
    )
    out = subprocess.run([python310, str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("(3, 10) 0 1"), out.stdout + out.stderr
