"""Start N data-parallel ranks on this machine, as torchrun would, with a hard timeout.

Used by ``hybrid-engine bench rlhf --zero-stage N`` and by the distributed
tests. Each rank gets the environment torchrun gives (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), so the ranks
talk over loopback only. Unlike torchrun, which puts every worker in a session
of its own, all ranks share one process group: at the timeout, or as soon as
one rank fails, the whole group is killed, so a hang can never outlive the call.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["LAUNCHED_RANK_ENV", "RanksTimedOut", "exit_launched_rank", "free_port", "run_ranks"]

#: Set to "1" in the environment of every rank :func:`run_ranks` starts.
LAUNCHED_RANK_ENV = "HYBRID_ENGINE_LAUNCHED_RANK"


class RanksTimedOut(RuntimeError):
    """The ranks did not finish within the timeout; their process group was killed."""


def exit_launched_rank(code: int = 0) -> None:
    """End a rank that :func:`run_ranks` started, once its work is done and it has left its process group:
    flush its output and ``os._exit``, skipping interpreter teardown. A no-op in any other process.

    At teardown, gloo and DeepSpeed objects still referenced somewhere are destroyed in C++ after the peer
    rank may have exited, which can abort a rank after its last line (``terminate called without an
    active exception``; about one ``bench rlhf --zero-stage 3`` run in 35 on 2 CPU ranks, even after
    DeepSpeed's own engine and group teardown). The rank's result is complete by then.
    """
    if os.environ.get(LAUNCHED_RANK_ENV) != "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _in_group(group: int) -> dict:
    """``Popen`` keywords that start the child in process group ``group`` (0: a new group it leads)."""
    if sys.version_info >= (3, 11):
        return {"process_group": group}
    return {"preexec_fn": lambda: os.setpgid(0, group)}  # Python 3.10 has no process_group keyword


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(args: Sequence[str], nproc: int, timeout_s: float, env: Mapping[str, str] | None = None,
              capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``python <args>`` as ``nproc`` ranks; returns once all exit, or one fails (then the rest are killed).

    ``args`` is a script path or ``-c``/``-m`` and their arguments. Each rank
    gets ``OMP_NUM_THREADS=1`` unless ``env`` sets it. ``returncode`` is the
    first non-zero exit code, else 0; ``stdout`` is every rank's output, rank by
    rank (``capture=False`` lets the ranks print to this terminal instead).
    Raises :class:`RanksTimedOut` after ``timeout_s`` seconds, with the output so far.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise TypeError(f"run_ranks: nproc must be an int (the number of ranks), got {type(nproc).__name__} {nproc!r}")
    if nproc < 1:
        raise ValueError(f"run_ranks: nproc must be >= 1, got {nproc}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"run_ranks: timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    if isinstance(args, (str, bytes)):
        raise TypeError("run_ranks: args must be a list of arguments (a script path or -c/-m and theirs), not a "
                        f"string: pass [{args!r}]")
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), LAUNCHED_RANK_ENV: "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    with tempfile.TemporaryDirectory(prefix="hybrid-engine-ranks-") as tmp:
        logs = [Path(tmp) / f"rank{r}.log" for r in range(nproc)]
        procs: list[subprocess.Popen] = []
        group = 0
        try:
            for r in range(nproc):
                rank_env = {**base_env, "RANK": str(r), "LOCAL_RANK": str(r)}
                out = open(logs[r], "w") if capture else None  # noqa: SIM115 - closed with the process
                proc = subprocess.Popen([sys.executable, *args], env=rank_env, stdout=out,
                                        stderr=subprocess.STDOUT if capture else None, **_in_group(group))
                if out is not None:
                    out.close()
                group = group or proc.pid  # rank 0 leads the group; the others join it
                procs.append(proc)
            code = _wait(procs, time.monotonic() + timeout_s)
        finally:
            if group:
                _kill_group(group, procs)
        text = "".join(f"[rank {r}]\n{log.read_text(errors='replace')}" for r, log in enumerate(logs)
                       if log.exists()) if capture else None
    if code is None:
        raise RanksTimedOut(f"{nproc} ranks of {' '.join(args)} did not finish in {timeout_s:.0f} s; "
                            f"killed their process group. Output so far:\n{text or ''}")
    return subprocess.CompletedProcess([sys.executable, *args], code, text, None)


def _wait(procs: list[subprocess.Popen], deadline: float) -> int | None:
    """The first non-zero exit code, 0 when all succeeded, or ``None`` at the deadline."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)
    return None


def _kill_group(group: int, procs: list[subprocess.Popen]) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every rank already exited
    for p in procs:
        p.wait()
