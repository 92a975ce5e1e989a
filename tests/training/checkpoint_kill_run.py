"""SIGKILL during saves, in a loop: ``python checkpoint_kill_run.py DIR KILLS SEED``, run by test_checkpoint_safety.py.

The process builds an engine, then KILLS times forks a child that saves checkpoints back to back (tag
``global_step<i>``, ``client_state={"i": i}``, reporting each ``i`` through a pipe once its save returned)
and SIGKILLs it after a random delay, mostly in the middle of a save. After each kill, here:

* ``latest`` reads, and the checkpoint it names loads, with its own ``client_state``;
* it is the last save that returned, or the next (killed after writing ``latest``, before reporting);
* every complete directory newer than it (killed between its manifest and ``latest``) loads too, and was
  never reported as saved; every directory still marked incomplete is refused by name.

Prints ``RESULT {json}`` at the end; any failed check raises (non-zero exit).
"""

import json
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

from hybrid_engine import initialize
from hybrid_engine.tiny_models import build_model
from hybrid_engine.training.checkpoint_files import INCOMPLETE_FILE, MANIFEST_FILE, read_latest


def index(tag: str) -> int:
    return int(tag.removeprefix("global_step"))


def saving_child(engine, root: Path, start: int, report: int) -> None:
    i = start
    while True:
        engine.save_checkpoint(root, tag=f"global_step{i}", client_state={"i": i})
        os.write(report, f"{i}\n".encode())
        i += 1


def reported(fd: int) -> list[int]:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return [int(x) for x in data.split()]


def main(root: str, kills: str, seed: str) -> None:
    torch.set_num_threads(1)
    root_dir = Path(root)
    rand = random.Random(int(seed))
    engine, *_ = initialize(model=build_model("tiny-llama", seed=3),
                            config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    ids = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # optimizer state to save too
    engine.save_checkpoint(root_dir, tag="global_step0", client_state={"i": 0})
    reported_all: set[int] = set()
    done, start, mid_save, refused = 0, 1, 0, 0  # the tag latest named after the last kill; the next child's first
    for _ in range(int(kills)):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: saves until killed (never returns)
            os.close(read_end)
            try:
                saving_child(engine, root_dir, start, write_end)
            finally:
                os._exit(3)
        os.close(write_end)
        time.sleep(rand.uniform(0.005, 0.25))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"the saving child exited on its own (status {status})"
        returned = reported(read_end)
        os.close(read_end)
        tag = read_latest(root_dir)
        assert tag is not None, "latest is missing"
        # The last save that returned, or the one after it (killed between writing latest and reporting).
        after = returned[-1] + 1 if returned else start
        assert index(tag) in ((returned[-1] if returned else done), after), (tag, returned[-3:], done, start)
        done = index(tag)
        path, client = engine.load_checkpoint(root_dir)
        assert path == str(root_dir / tag) and client == {"i": index(tag)}, (path, client)
        reported_all.update(returned)
        complete = [d for d in root_dir.iterdir() if (d / MANIFEST_FILE).is_file() and not (d / INCOMPLETE_FILE).exists()]
        # Newer complete directories than latest: only saves killed between their manifest and latest.
        newer = [d for d in complete if index(d.name) > index(tag)]
        assert not any(index(d.name) in reported_all for d in newer), (tag, newer)
        for directory in newer:
            assert engine.load_checkpoint(root_dir, tag=directory.name)[1] == {"i": index(directory.name)}
        for directory in root_dir.iterdir():
            if (directory / INCOMPLETE_FILE).exists():
                mid_save += index(directory.name) >= start
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # an empty directory: "no checkpoint" is the other answer
                    try:
                        engine.load_checkpoint(root_dir, tag=directory.name)
                    except ValueError as exc:
                        assert "did not complete" in str(exc), exc
                        refused += 1
                    else:
                        raise AssertionError(f"the interrupted save {directory} loaded")
        # The next child saves past whatever this one left, as a resumed run would.
        start = max(index(d.name) for d in root_dir.iterdir() if d.is_dir()) + 1
    leftovers_before = sorted(str(p.relative_to(root_dir)) for p in root_dir.rglob("*.tmp"))
    engine.save_checkpoint(root_dir, tag="final")
    leftovers_after = sorted(str(p.relative_to(root_dir)) for p in root_dir.rglob("*.tmp"))
    print("RESULT " + json.dumps({"kills": int(kills), "mid_save": mid_save, "refused": refused,
                                  "saves": start - 1, "leftovers_before": leftovers_before,
                                  "leftovers_after": leftovers_after}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
