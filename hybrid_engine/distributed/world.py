"""Which world this process is in: world size and rank, a one-rank group without a launcher, teardown.

Read from torch.distributed once it is initialised, else from the launcher's
environment (``torchrun``, ``deepspeed``). Nothing here communicates except
:func:`destroy_process_group`.
"""

from __future__ import annotations

import os
import sys

__all__ = ["LAUNCHER_VARIABLES", "destroy_process_group", "one_rank_without_launcher", "rank", "world_size"]


def world_size() -> int:
    """The data-parallel world size: torch.distributed's when initialised, else the launcher's ``WORLD_SIZE``.

    Batch sizes are derived and checked as DeepSpeed does, against this; a config
    loaded in a ``torchrun``/``deepspeed`` rank is checked before any work.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"the WORLD_SIZE environment variable must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"the WORLD_SIZE environment variable must be >= 1, got {value}")
    return value


def destroy_process_group() -> None:
    """Leave ``torch.distributed`` (call it on every rank, after a barrier), through DeepSpeed's own
    ``deepspeed.comm.destroy_process_group`` once DeepSpeed has set up its communication.

    DeepSpeed keeps module-level references to the groups it makes, a clone of
    the world group above all (``deepspeed.utils.groups``). Its own teardown drops
    them; ``torch.distributed.destroy_process_group`` does not, and a gloo group
    kept alive that way is torn down at interpreter shutdown, possibly after the
    peer rank has exited, where it can abort the process after its last line
    (``terminate called without an active exception``).
    """
    import torch.distributed as dist

    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and comm.is_initialized():
        comm.destroy_process_group()
    elif dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


#: The variables a launcher (torchrun, ``deepspeed``) sets for each rank, which DeepSpeed reads.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def one_rank_without_launcher() -> None:
    """Let DeepSpeed set up a one-rank process group when the script runs without a launcher.

    ``python train.py`` at ZeRO 1-3 would otherwise reach DeepSpeed's MPI discovery
    (``mpi4py``) or its ``LOCAL_RANK`` assertion. As accelerate does for a single
    process, the launcher variables DeepSpeed reads are filled in for rank 0 of 1,
    on loopback with a free port; variables already set are kept. A partial launch
    (``WORLD_SIZE`` above 1 with the rest missing) is refused, naming how to launch.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts it even on a group the caller made
        return
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if not missing:
        return
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} are not: launch the ranks with "
            "`torchrun --nproc_per_node N train.py` or `deepspeed train.py`, or unset WORLD_SIZE to train in one "
            "process")
    from hybrid_engine.distributed.launch import free_port

    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())}
    for name in missing:
        os.environ[name] = defaults[name]


def rank() -> int:
    """This process's data-parallel rank: torch.distributed's when initialised, else the launcher's ``RANK``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raw = os.environ.get("RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"the RANK environment variable must be an integer, got {raw!r}") from None
