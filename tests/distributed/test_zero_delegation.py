"""Accumulation, clipping and the LR scheduler delegate to DeepSpeed under ZeRO 1-3 and match stage 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)


def test_accumulation_clipping_and_scheduler_match_stage_0(tmp_path):
    out = tmp_path / "delegation.pt"
    proc = run_ranks([str(Path(__file__).with_name("delegation_worker.py")), str(out)], nproc=1, timeout_s=180)
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = torch.load(out, weights_only=False)
    ref = results[0]
    assert ref["boundaries"] == [False, True] * 3 and ref["global_steps"] == 3 and ref["micro_steps"] == 6
    assert ref["lrs"] == [1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3, 1.25e-3]  # stepped at boundaries only
    for stage in (1, 2, 3):
        r = results[stage]
        assert r["optimizer"].startswith("DeepSpeedZeroOptimizer") and r["loader"] is None
        assert r["boundaries"] == ref["boundaries"] and r["lrs"] == ref["lrs"] and r["scheduler_is_engines"]
        assert r["global_steps"] == 3 and r["micro_steps"] == 6
        for a, b in zip(r["weights"], ref["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)  # updates are ~1e-2: order noise only
        # DeepSpeed's engine queries, answered by DeepSpeed at ZeRO 1-3 and by stage 0 itself, agree.
        assert r["applied"] == ref["applied"] == [False, True] * 3
        assert r["samples"] == ref["samples"] == [0, 4, 4, 8, 8, 12]  # train_batch_size 4 per optimizer step
        torch.testing.assert_close(r["returned"], ref["returned"], rtol=1e-4, atol=1e-5)  # loss / accumulation
        assert ref["norms"][1] is not None and all(n is not None for n in r["norms"][1::2])
        torch.testing.assert_close(r["norms"][1::2], ref["norms"][1::2], rtol=1e-4, atol=1e-5)
        assert r["queries"] == {**ref["queries"], "zero_stage": stage}
    assert ref["queries"] == {"gradient_clipping": 0.5, "zero_stage": 0, "fp16": False, "bf16": False,
                              "loss_scale": 0.0, "steps_per_print": None, "optimizer_name": "adamw",
                              "mom": [(0.9, 0.999)], "world_size": 1, "dp_world_size": 1, "global_rank": 0,
                              "local_rank": 0, "device": "cpu"}


def test_a_model_parallel_unit_reaches_deepspeed_and_sets_the_data_parallel_world(tmp_path):
    # Two ranks in one model-parallel group, each its own data-parallel group (see mpu_worker.py). Before,
    # initialize accepted mpu= and dropped it: batch sizes were checked against the launched world (2, so
    # train_batch_size 2 with micro batch 2 was refused) and gradients would be averaged over every rank.
    out = tmp_path / "mpu"
    proc = run_ranks([str(Path(__file__).with_name("mpu_worker.py")), str(out)], nproc=2, timeout_s=180)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]
    for d in ranks:
        assert d["mpu_kept"] and d["dp_world_size"] == 1 and d["train_batch_size"] == 2 and d["global_steps"] == 1
        assert {"get_data_parallel_group", "get_data_parallel_world_size"} <= set(d["calls"])
    assert ranks[0]["checksum"] != ranks[1]["checksum"]  # no gradient averaging across data-parallel groups
