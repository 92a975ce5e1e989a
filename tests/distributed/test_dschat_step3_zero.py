"""DeepSpeed-Chat's step 3 on 2 gloo ranks at ZeRO 2 and 3, with ``deepspeed.initialize`` replaced by
``hybrid_engine.initialize`` (issue 42; the trainer: tests/integrations/dschat_step3.py), with and without
``--align_overflow``.

bf16 only: DeepSpeed's CPU accelerator has no fp16 (fp16 is covered at stage 0 in
tests/integrations/test_dschat_step3.py). Each case runs ``dschat_step3_worker.py`` under
:func:`hybrid_engine.distributed.launch.run_ranks` with a hard timeout that kills the ranks' group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402
from tests.integrations.dschat_step3 import actor_model  # noqa: E402
from tests.sampled_close import assert_greedy_close  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)

WORKER = Path(__file__).with_name("dschat_step3_worker.py")
TIMEOUT_S = 300


def run_worker(tmp_path: Path, stage: int, copy: bool, align: bool = False) -> list[dict]:
    args = [str(WORKER), str(stage), "1" if copy else "0", str(tmp_path), "1" if align else "0"]
    proc = run_ranks(args, nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("stage,copy,align", [(2, False, False), (3, False, False), (3, True, False),
                                              (2, False, True), (3, False, True)])
def test_step3_drop_in_trains_at_zero_2_and_3(tmp_path, stage, copy, align):
    for d in run_worker(tmp_path, stage, copy, align):
        # deepspeed.initialize = hybrid_engine.initialize did not recurse, and built ZeRO engines.
        assert d["zero_stage"] == stage and d["global_steps"] == (3 if align else 2) and d["num_params_set"]
        if align:  # --align_overflow: check_overflow(external=True) and skip_step on DeepSpeed's ZeRO optimizer
            first, second, third = d["align_log"]
            # The critic overflowed: the actor's step was skipped through skip_step (on both ranks), flag reset.
            assert first["actor_skipped"] == 1 and not first["actor_applied"] and first["actor_skip_flag"] is False
            assert first["critic_skipped"] == 0
            # The actor's gradients held a NaN on rank 1 only: both ranks saw it, so both skipped the critic's step
            # (the actor's own step was skipped by DeepSpeed's bf16 check).
            assert second["critic_skipped"] == 1 and second["actor_skipped"] == 2 and not second["actor_applied"]
            # Then both train again.
            assert third["actor_applied"] and third["actor_skipped"] == 2 and third["critic_skipped"] == 1
            assert third["critic_steps"] == 3
        # module.generate(synced_gpus=<ZeRO-3>) ran on the fast path (never delegated to transformers).
        assert d["fast_path_calls"] and d["invalidations"] == 0
        if stage == 3 and not copy:  # graphs refused on partitioned weights: eager steps on gathered ones
            assert d["captures"] == 0 and d["eager_steps"] > 0 and "delegated" not in (d["refusal"] or "")
        else:
            assert d["captures"] > 0 and d["replays"] > 0 and d["refusal"] is None
        assert d["generate_restored"]
        # Its tokens equal transformers' own generate on the trained (gathered) weights, in one process; where
        # bf16 rounding could break a near tie, the fp32 teacher-forced logits arbitrate.
        model, arbiter = actor_model(dtype=torch.bfloat16), actor_model()
        model.load_state_dict(d["weights"])
        arbiter.load_state_dict({k: v.float() for k, v in d["weights"].items()})
        theirs = model.generate(d["ids"], attention_mask=d["mask"], **d["kw"])
        for r in range(d["ids"].shape[0]):
            context = [int(t) for t, m in zip(d["ids"][r], d["mask"][r]) if m]
            assert_greedy_close(arbiter, context, d["graph_tokens"][r, 5:], theirs[r, 5:], logit_atol=1.0,
                                name=f"stage {stage} row {r}")
