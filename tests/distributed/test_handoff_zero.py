"""Issue 41 at ZeRO 1/2 on 2 CPU ranks (gloo, loopback): ``engine.sleep(["optimizer"])`` is DeepSpeed's
``offload_states`` for ``optim_states``, ``hp_params``, ``lp_grads`` and ``contiguous_grad_buffer`` (never
``lp_params``); training with it between steps is bit-identical to training without, no parameter moves, and
the training calls that found it asleep woke it (counted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # launches ranks (tests/tiers.py)

WORKER = Path(__file__).with_name("handoff_zero_worker.py")


def test_zero_3_refusal_names_deepspeeds_limit_and_leaves_the_engine_training(tmp_path):
    proc = run_ranks([str(WORKER), "3", str(tmp_path)], nproc=2, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for r in range(2):
        d = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        # DeepSpeed 0.19 offloads stage-3 states only for its FusedAdam (CUDA); the message is DeepSpeed's own.
        assert "at ZeRO stage 3: DeepSpeed's offload_states refused" in d["error"], d.get("error")
        assert d["tags_after_error"] == [] and d["trained_after_error"]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_optimizer_sleep_trains_bit_identically(tmp_path, stage):
    proc = run_ranks([str(WORKER), str(stage), str(tmp_path)], nproc=2, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for r in range(2):
        d = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert "error" not in d, d["error"]
        assert all(torch.equal(a, b) for a, b in zip(d["losses"], d["plain_losses"]))
        assert d["weights_equal"] and d["addresses_kept"]
        # Asleep, and DeepSpeed offloaded the states (its contiguous grad buffer only where it has one; never
        # lp_params, the weights the graphs read).
        for t in d["tags"]:
            assert t[0] == "optimizer" and {"hp_params", "lp_grads", "optim_states"} <= set(t[1:]), t
            assert "lp_params" not in t
        assert d["stats"]["optimizer_wakes"] == 2  # steps 0 and 2 left it asleep for the next backward
