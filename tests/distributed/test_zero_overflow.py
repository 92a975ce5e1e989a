"""DeepSpeed-Chat's ``--align_overflow`` surface at ZeRO 1-3 on 2 gloo ranks (issue 42): the optimizer the engine
hands out (DeepSpeed's ZeRO optimizer) answers ``check_overflow(external=True)`` on every rank alike, and
``skip_step = True`` skips the next step on every rank, changing nothing (:mod:`hybrid_engine.training.zero_overflow`).

bf16 only: DeepSpeed's CPU accelerator has no fp16 at ZeRO 1-3 (fp16's loss-scale handling is covered at stage 0 in
tests/integrations/test_dschat_step3.py). Each case runs ``zero_overflow_worker.py`` under
:func:`hybrid_engine.distributed.launch.run_ranks` with a hard timeout that kills the ranks' group.
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


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_check_overflow_and_skip_step_at_zero(tmp_path, stage):
    proc = run_ranks([str(WORKER), str(stage), str(tmp_path)], nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for d in (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)):
        assert d["same_optimizer"] and d["class"].startswith("DeepSpeedZeroOptimizer")
        assert "external" in d.get("bad_external", "")
        # check_overflow(external=True) answers (a bool), the same on both ranks: a NaN on rank 1 only is seen by both.
        assert d["no_grads"] is False and d["after_step"] is False and d["after_skip_check"] is False
        assert d["finite"] is False and d["finite_attr"] is False and d["finite_again"] is False
        assert d["nan"] is True and d["nan_attr"] is True
        # DeepSpeed's own bf16 step skips the NaN step, counted, LR not stepped.
        assert d["first_changed"] and d["nan_kept_weights"]
        assert d["after_nan"]["skipped"] == 1 and d["after_nan"]["global"] == 2 and not d["after_nan"]["applied"]
        # skip_step = True, set on rank 0 only: skipped on both ranks, nothing changed, the flag reset.
        before, after = d["before_skip"], d["after_skip"]
        assert d["skip_flag_after"] is False and d["skip_overflow_attr"] is False
        assert d["skip_kept_weights"] and d["skip_kept_state"] and all(d["grads_after_skip"])
        assert after["skipped"] == before["skipped"] + 1 and after["global"] == before["global"] + 1
        assert after["lr"] == before["lr"] and after["scale"] == before["scale"] == 1.0 and not after["applied"]
        # The next step trains, the LR scheduler steps again, and the weights equal an engine's that never took the
        # two skipped steps: the skip left no gradient, state or schedule behind.
        nxt = d["after_next"]
        assert d["next_changed"] and nxt["applied"] and nxt["skipped"] == after["skipped"] and nxt["lr"] > after["lr"]
        assert d["matches_b"] and d["b_counters"]["lr"] == nxt["lr"] and d["b_counters"]["skipped"] == 0
