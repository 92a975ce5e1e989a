"""``run_ranks``: a hang ends at the timeout, and a failure at once, with the ranks' process group killed."""

from __future__ import annotations

import os
import time

import pytest

from hybrid_engine.launch import RanksTimedOut, exit_launched_rank, run_ranks


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
            "from hybrid_engine.launch import exit_launched_rank\n"
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
