"""DeepSpeed-Chat's ``--align_overflow`` surface at ZeRO 1-3 on 2 gloo ranks (issue 42): the optimizer the engine
hands out (DeepSpeed's ZeRO optimizer) answers ``check_overflow(external=True)`` on every rank alike, and
``skip_step = True`` skips the next step on every rank, changing nothing (:mod:`hybrid_engine.training.zero_overflow`).

bf16 at ZeRO 1-3; fp16 at ZeRO 2 and 3 with DeepSpeed's own loss scaler, under a test double at a hardware-capability
boundary (``cpu_fp16.py``: DeepSpeed's CPU accelerator reports no fp16; torch computes fp16 on CPU): a DeepSpeed
overflow is skipped and backs the scale off after ``hysteresis`` overflows, a requested skip leaves the scaler as it
was. Each case runs ``zero_overflow_worker.py`` under :func:`hybrid_engine.distributed.launch.run_ranks` with a hard
timeout that kills the ranks' group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)

WORKER = Path(__file__).with_name("zero_overflow_worker.py")
TIMEOUT_S = 240


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp16"), (3, "fp16")])
def test_check_overflow_and_skip_step_at_zero(tmp_path, stage, precision):
    proc = run_ranks([str(WORKER), str(stage), str(tmp_path), precision], nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # fp16: DeepSpeed's dynamic scale from 2**8; bf16 has no loss scale.
    scale0 = 256.0 if precision == "fp16" else 1.0
    for d in (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)):
        assert d["same_optimizer"] and d["class"].startswith("DeepSpeedZeroOptimizer")
        assert d["dtype"] == getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])
        assert d["scale0"] == scale0
        assert "external" in d.get("bad_external", "")
        # check_overflow(external=True) answers (a bool), the same on both ranks: a NaN on rank 1 only is seen by both.
        assert d["no_grads"] is False and d["after_step"] is False and d["after_skip_check"] is False
        assert d["finite"] is False and d["finite_attr"] is False and d["finite_again"] is False
        assert d["nan"] is True and d["nan_attr"] is True
        # DeepSpeed's own step skips the NaN step, counted, LR not stepped; under fp16 the first overflow only uses
        # up one of the 2 hysteresis overflows, so the scale stays.
        assert d["first_changed"] and d["nan_kept_weights"]
        assert d["after_nan"]["skipped"] == 1 and d["after_nan"]["global"] == 2 and not d["after_nan"]["applied"]
        assert d["after_nan"]["scale"] == scale0
        # skip_step = True, set on rank 0 only: skipped on both ranks, nothing changed, the flag reset.
        before, after = d["before_skip"], d["after_skip"]
        assert d["skip_flag_after"] is False and d["skip_overflow_attr"] is False
        assert d["skip_kept_weights"] and d["skip_kept_state"] and all(d["grads_after_skip"])
        assert after["skipped"] == before["skipped"] + 1 and after["global"] == before["global"] + 1
        assert after["lr"] == before["lr"] and after["scale"] == before["scale"] == scale0 and not after["applied"]
        # The loss scaler is as it was (fp16: hysteresis still at 1, where an overflow would halve the scale).
        assert d["scaler_after_skip"] == d["scaler_before_skip"]
        if precision == "fp16":
            assert d["scaler_before_skip"]["cur_hysteresis"] == 1
        # The next step trains, the LR scheduler steps again, and the weights equal an engine's that never took the
        # two skipped steps: the skip left no gradient, state or schedule behind.
        nxt = d["after_next"]
        assert d["next_changed"] and nxt["applied"] and nxt["skipped"] == after["skipped"] and nxt["lr"] > after["lr"]
        assert d["matches_b"] and d["b_counters"]["lr"] == nxt["lr"] and d["b_counters"]["skipped"] == 0
        # A second DeepSpeed overflow (NaN on rank 1): skipped on both ranks; under fp16 the hysteresis is used up, so
        # the scale backs off by DeepSpeed's factor 2, the same on both ranks.
        last = d["after_second_nan"]
        assert d["second_nan_kept_weights"] and last["skipped"] == nxt["skipped"] + 1 and not last["applied"]
        assert last["scale"] == (scale0 / 2 if precision == "fp16" else 1.0)
