"""ZeRO-1 checkpoints in one plain process (no launcher): every file verified before DeepSpeed loads one.

Run by ``test_zero_checkpoint.py`` under a hard timeout. Saves after 3 steps, trains a 4th, then tries
to load copies of the checkpoint with one file damaged each; every refusal must leave the engine at
step 4 with its weights. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import torch

from hybrid_engine import initialize
from hybrid_engine.tiny_models import build_model
from hybrid_engine.training.checkpoint_files import MANIFEST_FILE, tag_files


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = initialize(model=build_model("tiny-gpt2", seed=3), config=config)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def params() -> list[torch.Tensor]:
        return [p.detach().clone() for p in engine.module.parameters()]

    for _ in range(3):
        step()
    root = out / "ckpt"
    engine.save_checkpoint(root, client_state={"epoch": 1})
    saved = params()
    directory = root / "global_step3"
    result: dict = {"latest": (root / "latest").read_text(), "files": tag_files(directory),
                    "manifest": sorted(json.loads((directory / MANIFEST_FILE).read_text())["files"]),
                    "tmp_left": sorted(p.name for p in root.rglob("*.tmp"))}
    step()
    at_four = params()

    def unchanged() -> bool:
        return engine.global_steps == 4 and all(torch.equal(a, b) for a, b in zip(params(), at_four))

    def attempt(name: str, damage) -> None:
        case = out / name
        shutil.copytree(root, case)
        damage(case / "global_step3", case)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.load_checkpoint(case)
            result[name] = {"error": None, "warnings": [str(w.message) for w in caught]}
        except Exception as exc:  # noqa: BLE001 - the type is part of what is checked
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        result[name]["unchanged"] = unchanged()

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))

    for file in result["files"]:  # DeepSpeed's files and ours, one damaged at a time
        attempt(f"flip:{file}", lambda d, _, file=file: flip(d / file))
    attempt("flip:manifest", lambda d, _: flip(d / MANIFEST_FILE))
    attempt("latest:binary", lambda _, r: (r / "latest").write_bytes(b"\xff\xfe\x00"))
    attempt("latest:absolute", lambda _, r: (r / "latest").write_text(str(directory)))

    def legacy_bad_rng(d: Path, _: Path) -> None:  # as saved before manifests: the RNG file is checked anyway
        (d / MANIFEST_FILE).unlink()
        (d / "hybrid_engine_rng_rank0.pt").write_bytes(b"not a torch file")

    attempt("legacy:bad-rng", legacy_bad_rng)
    # As saved before manifests, intact: loads, unverified, with a warning saying so.
    attempt("legacy:intact", lambda d, _: (d / MANIFEST_FILE).unlink())
    result["legacy:intact"]["steps"] = engine.global_steps
    step()
    path, client = engine.load_checkpoint(root)
    result["good"] = {"path": path, "client": {"epoch": client.get("epoch")}, "steps": engine.global_steps,
                      "restored": all(torch.equal(a, b) for a, b in zip(params(), saved))}
    engine.destroy()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
