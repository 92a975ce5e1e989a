"""Checkpoints that survive a crash and cannot run code (stage 0; ZeRO in tests/distributed/test_zero_checkpoint.py).

Found by an adversarial run: ``latest`` was truncated then written (a SIGKILL left it empty and a resume
restarted from step 0), the tag in it was not validated (an absolute path redirected the load), a tampered
``client_state`` was unpickled in full, and flipped bytes loaded as wrong weights.
"""

import copy
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import left_padded_prompts as prompts

from hybrid_engine import initialize
from hybrid_engine.tiny_models import build_model
from hybrid_engine.training.checkpoint import STATE_FILE
from hybrid_engine.training.checkpoint_files import INCOMPLETE_FILE, MANIFEST_FILE

pytestmark = pytest.mark.slow  # launches processes (tests/tiers.py)

HERE = Path(__file__).resolve().parent
KILL_TIMEOUT_S = 150


def new_engine():
    engine, *_ = initialize(model=build_model("tiny-llama", seed=3),
                            config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    return engine


def train_once(engine, seed=0):
    ids = prompts(2, 5, seed=seed)[0]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def snapshot(engine):
    return ({k: v.clone() for k, v in engine.module.state_dict().items()}, copy.deepcopy(engine.optimizer.state_dict()),
            engine.global_steps, torch.get_rng_state())


def assert_unchanged(engine, before):
    weights, opt, steps, rng = before
    assert all(torch.equal(v, weights[k]) for k, v in engine.module.state_dict().items())
    now = engine.optimizer.state_dict()
    assert now["param_groups"] == opt["param_groups"]
    assert all(torch.equal(t, opt["state"][k][n]) for k, v in now["state"].items() for n, t in v.items())
    assert engine.global_steps == steps and torch.equal(torch.get_rng_state(), rng)


@pytest.fixture
def saved(tmp_path):
    """An engine that saved global_step1 (latest) and global_step2, then trained on: (engine, root)."""
    engine, root = new_engine(), tmp_path / "ckpt"
    train_once(engine)
    engine.save_checkpoint(root, client_state={"i": 1})
    train_once(engine)
    engine.save_checkpoint(root, client_state={"i": 2})
    train_once(engine)
    return engine, root


def redigest(directory: Path) -> None:
    """What anyone who can write the files can do: rewrite the manifest to match them."""
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    for name, entry in manifest["files"].items():
        data = (directory / name).read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


# ----------------------------------------------------------------- crash safety
def test_sigkill_during_saves_always_leaves_the_newest_complete_checkpoint_loadable(tmp_path):
    """Before: 4 of 40 kills left latest empty, and load_checkpoint() returned (None, None)."""
    if not hasattr(os, "fork"):
        pytest.skip("the kill loop forks its saving children")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "checkpoint_kill_run.py"), str(tmp_path / "ckpt"), "30", "7"],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=KILL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the kill loop did not finish in {KILL_TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert result["kills"] == 30 and result["saves"] >= 30
    assert result["mid_save"] >= 1  # kills landed inside saves (each was refused by name, then skipped past)
    assert result["refused"] >= result["mid_save"]
    assert result["leftovers_after"] == []  # the next save cleaned what the kills left


def test_an_interrupted_save_leaves_latest_on_the_previous_checkpoint(saved, monkeypatch):
    engine, root = saved
    real_save = torch.save

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as a Ctrl-C half-way through writing the state file

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(root)
    monkeypatch.setattr(torch, "save", real_save)
    assert (root / "latest").read_text() == "global_step2" and (root / "global_step3" / INCOMPLETE_FILE).exists()
    assert not list(root.rglob("*.tmp"))
    before = snapshot(engine)
    with pytest.raises(ValueError, match=r"global_step3 did not complete.*Nothing was loaded.*global_step2"):
        engine.load_checkpoint(root, tag="global_step3")
    assert_unchanged(engine, before)
    assert engine.load_checkpoint(root) == (str(root / "global_step2"), {"i": 2})
    assert engine.global_steps == 2
    train_once(engine)
    engine.save_checkpoint(root)  # the same tag again, completely this time
    assert engine.load_checkpoint(root)[0] == str(root / "global_step3")


def test_leftover_tmp_files_of_ours_are_removed_by_the_next_save(saved):
    engine, root = saved
    ours = [root / "latest.tmp", root / "global_step1" / f"{STATE_FILE}.tmp",
            root / "global_step2" / f"{MANIFEST_FILE}.tmp"]
    theirs = root / "global_step1" / "notes.tmp"
    for path in [*ours, theirs]:
        path.write_bytes(b"half")
    engine.save_checkpoint(root, tag="next")
    assert not any(p.exists() for p in ours) and theirs.exists()


# ----------------------------------------------------------------- latest and tags
def test_a_latest_that_names_no_checkpoint_is_an_error_naming_it_and_the_tags(saved, tmp_path):
    engine, root = saved
    elsewhere = tmp_path / "elsewhere"
    new_engine().save_checkpoint(elsewhere, tag="evil")  # a complete checkpoint outside root
    contents = {"empty": b"", "blank": b"  \n", "binary": b"\xff\xfe\x00\x9c junk", "absolute": str(elsewhere / "evil"),
                "parent": "../elsewhere/evil", "dotdot": "..", "itself": "latest", "huge": "x" * 10_000,
                "absent": "global_step99"}
    before = snapshot(engine)
    latest = root / "latest"
    for label, content in contents.items():
        latest.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ValueError) as info:
            engine.load_checkpoint(root)
        message = str(info.value)
        assert str(latest) in message and "global_step1, global_step2" in message, (label, message)
        assert_unchanged(engine, before)
    latest.unlink()
    latest.mkdir()
    with pytest.raises(ValueError, match=f"{latest} is not a regular file"):
        engine.load_checkpoint(root)
    latest.rmdir()
    assert engine.load_checkpoint(root, tag="global_step2") == (str(root / "global_step2"), {"i": 2})


def test_a_fifo_as_latest_is_refused_without_blocking(saved):
    engine, root = saved
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(ValueError, engine.load_checkpoint, root)))
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive():  # blocked opening the FIFO: unblock it, then fail
        with open(root / "latest", "wb"):
            pass
        thread.join(timeout=5)
        pytest.fail("load_checkpoint blocked reading a FIFO as latest")
    assert errors and "is not a regular file" in str(errors[0].value)


@pytest.mark.parametrize("tag", ["latest", "", "   ", " padded", "a/b", "/abs/path", "..", ".", "tab\there",
                                 "x" * 300])
def test_tags_that_are_no_plain_name_are_refused_at_save_and_load(tmp_path, tag):
    """Before: "latest" saved, then the load failed with IsADirectoryError; blank tags saved."""
    engine = new_engine()
    with pytest.raises(ValueError, match="tag must be a plain directory name"):
        engine.save_checkpoint(tmp_path / "root", tag=tag)
    assert not (tmp_path / "root").exists()
    engine.save_checkpoint(tmp_path / "root", tag="ok")
    with pytest.raises(ValueError, match="tag must be a plain directory name"):
        engine.load_checkpoint(tmp_path / "root", tag=tag)
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["latest", "ok"]


# ----------------------------------------------------------------- corruption
def tamper_state_flip(directory):
    data = bytearray((directory / STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (directory / STATE_FILE).write_bytes(bytes(data))


def tamper_state_truncate(directory):
    data = (directory / STATE_FILE).read_bytes()
    (directory / STATE_FILE).write_bytes(data[:-100])


def tamper_manifest_digest(directory):
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    entry = manifest["files"][STATE_FILE]
    entry["sha256"] = ("0" if entry["sha256"][0] != "0" else "1") + entry["sha256"][1:]
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


TAMPERED = {
    "state-file-byte-flipped": (tamper_state_flip, f"{STATE_FILE} does not match its sha256 digest"),
    "state-file-truncated": (tamper_state_truncate, f"{STATE_FILE} is \\d+ bytes, but \\d+ were saved"),
    "state-file-removed": (lambda d: (d / STATE_FILE).unlink(), f"{STATE_FILE} is missing"),
    "manifest-removed": (lambda d: (d / MANIFEST_FILE).unlink(), "has no manifest"),
    "manifest-garbage": (lambda d: (d / MANIFEST_FILE).write_bytes(b"{\xff not json"),
                         f"{MANIFEST_FILE} is not a readable manifest"),
    "manifest-not-sha256": (lambda d: (d / MANIFEST_FILE).write_text('{"files": {}, "algorithm": "md5"}'),
                            "is not a manifest of sha256 digests"),
    "manifest-digest-changed": (tamper_manifest_digest, f"{STATE_FILE} does not match its sha256 digest"),
    "manifest-lists-outside": (lambda d: (d / MANIFEST_FILE).write_text(json.dumps(
        {"algorithm": "sha256", "files": {"../../etc/passwd": {"sha256": "0" * 64, "size": 1}}})),
        "lists paths outside its directory"),
    "incomplete-mark": (lambda d: (d / INCOMPLETE_FILE).write_bytes(b""), "did not complete"),
    "file-added": (lambda d: (d / "extra.pt").write_bytes(b"x"), "holds files the save did not write .extra.pt"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_every_file_the_engine_writes_is_verified_before_anything_loads(saved, case):
    engine, root = saved
    tamper, match = TAMPERED[case]
    tamper(root / "global_step2")
    before = snapshot(engine)
    with pytest.raises(ValueError, match=match) as info:
        engine.load_checkpoint(root)
    present = "global_step1" if case == "incomplete-mark" else "global_step1, global_step2"  # the loadable ones
    assert "Nothing was loaded" in str(info.value) and f"checkpoints in {root}: {present};" in str(info.value)
    assert_unchanged(engine, before)
    assert engine.load_checkpoint(root, tag="global_step1") == (str(root / "global_step1"), {"i": 1})


def test_byte_flips_anywhere_in_the_state_file_are_caught(saved):
    """Before: 20 of 20 single-byte flips inside tensor records loaded with no error (18 gave wrong weights)."""
    engine, root = saved
    path = root / "global_step2" / STATE_FILE
    good = path.read_bytes()
    positions = torch.randint(0, len(good), (20,), generator=torch.Generator().manual_seed(3)).tolist()
    before = snapshot(engine)
    for position in positions:
        data = bytearray(good)
        data[position] ^= 1 << (position % 8)
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=f"{path} does not match its sha256 digest"):
            engine.load_checkpoint(root)
        assert_unchanged(engine, before)
    path.write_bytes(good)
    assert engine.load_checkpoint(root) == (str(root / "global_step2"), {"i": 2})


# ----------------------------------------------------------------- code execution
@dataclasses.dataclass
class Note:  # beyond plain data: the safe unpickler refuses it
    text: str


class RunsCode:
    """Unpickled in full, it makes a directory: the stand-in for os.system."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def swap_client_state(directory: Path, value, encoding: str | None) -> None:
    state = torch.load(directory / STATE_FILE, weights_only=True)
    packed = None
    if value is not None:
        import io

        buffer = io.BytesIO()
        torch.save(value, buffer)
        packed = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).clone()
    torch.save({**state, "client_state": packed, "client_state_encoding": encoding}, directory / STATE_FILE)
    if (directory / MANIFEST_FILE).exists():
        redigest(directory)


LOADS = {"plain": {}, "load_module_only": {"load_module_only": True},
         "custom_load_fn": {"custom_load_fn": lambda src, dst: dst.load_state_dict(src)}}


@pytest.mark.parametrize("how", sorted(LOADS))
def test_a_tampered_client_state_does_not_run_code_without_the_opt_in(saved, tmp_path, how):
    """Before: a tampered stage-0 checkpoint ran os.system on load, under load_module_only and custom_load_fn
    too, even one saved without client_state."""
    engine, root = saved
    marker = tmp_path / "code-ran"
    directory = root / "global_step2"
    before = snapshot(engine)
    for encoding in ("pickle", "plain", None):  # what the save recorded, or a tamperer wrote
        swap_client_state(directory, {"x": RunsCode(str(marker))}, encoding)
        for trust in (False, True) if encoding != "pickle" else (False,):
            with pytest.raises(ValueError, match="client_state") as info:
                engine.load_checkpoint(root, trust_client_state=trust, **LOADS[how])
            if encoding == "pickle":
                assert "trust_client_state=True" in str(info.value) and "can run code" in str(info.value)
            assert not marker.exists(), (encoding, trust)
            assert_unchanged(engine, before)
    # The opt-in is what lets a recorded pickle be unpickled in full (and only then does code run).
    swap_client_state(directory, {"x": RunsCode(str(marker))}, "pickle")
    engine.load_checkpoint(root, trust_client_state=True, **LOADS[how])
    assert marker.is_dir()


def test_code_in_the_engines_own_state_never_runs_even_with_the_opt_in(saved, tmp_path):
    engine, root = saved
    marker = tmp_path / "code-ran"
    directory = root / "global_step2"
    state = torch.load(directory / STATE_FILE, weights_only=True)
    torch.save({**state, "global_steps": RunsCode(str(marker))}, directory / STATE_FILE)
    redigest(directory)
    before = snapshot(engine)
    with pytest.raises(ValueError, match="is not a hybrid-engine checkpoint"):
        engine.load_checkpoint(root, trust_client_state=True)
    assert not marker.exists()
    assert_unchanged(engine, before)


def test_format_3_checkpoints_without_manifest_still_load_plain_client_state_safely(saved):
    engine, root = saved
    directory = root / "global_step2"
    state = torch.load(directory / STATE_FILE, weights_only=True)
    state.pop("client_state_encoding")
    torch.save({**state, "format": 3}, directory / STATE_FILE)
    (directory / MANIFEST_FILE).unlink()
    assert engine.load_checkpoint(root) == (str(directory), {"i": 2}) and engine.global_steps == 2
    swap_client_state(directory, {"note": Note("hi")}, None)  # format 3 pickled any client_state in full
    with pytest.raises(ValueError, match=r"test_checkpoint_safety.Note.*trust_client_state=True"):
        engine.load_checkpoint(root)
    assert engine.load_checkpoint(root, trust_client_state=True)[1] == {"note": Note("hi")}
