"""DeepSpeed-Chat's step 3 on 2 gloo ranks at ZeRO 2 and 3, with ``deepspeed.initialize`` replaced by
``hybrid_engine.initialize`` (issue 42; the trainer: tests/integrations/dschat_step3.py), with and without
``--align_overflow``.

DeepSpeed-Chat's actor config as it is, with the graph flag added (at ZeRO-3 that implies the gathered inference
copy: graphs), and at ZeRO-3 with the copy turned off (eager decode on gathered weights, bf16). bf16 and fp16, each
with and without ``--align_overflow``, fp16 on
DeepSpeed's own fp16 ZeRO optimizers under a test double at a hardware-capability boundary (``cpu_fp16.py``:
DeepSpeed's CPU accelerator reports no fp16; torch computes fp16 on CPU). Each case runs ``dschat_step3_worker.py``
under :func:`hybrid_engine.distributed.launch.run_ranks` with a hard timeout that kills the ranks' group.
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
#: How far below the fp32 argmax a greedy token of a 16-bit path may be (as in tests/integrations/test_dschat_step3.py).
LOGIT_ATOL = {"fp16": 0.5, "bf16": 1.0}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def run_worker(tmp_path: Path, stage: int, copy: str, align: bool = False, precision: str = "bf16") -> list[dict]:
    args = [str(WORKER), str(stage), copy, str(tmp_path), "1" if align else "0", precision]
    proc = run_ranks(args, nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("stage,copy,align,precision", [
    (2, "default", False, "bf16"), (3, "default", False, "bf16"), (3, "off", False, "bf16"),
    (2, "default", True, "bf16"), (3, "default", True, "bf16"), (2, "default", False, "fp16"),
    (3, "default", False, "fp16"), (2, "default", True, "fp16"), (3, "default", True, "fp16")])
def test_step3_drop_in_trains_at_zero_2_and_3(tmp_path, stage, copy, align, precision):
    for d in run_worker(tmp_path, stage, copy, align, precision):
        # deepspeed.initialize = hybrid_engine.initialize did not recurse, and built ZeRO engines.
        assert d["zero_stage"] == stage and d["global_steps"] == (3 if align else 2) and d["num_params_set"]
        if align:  # --align_overflow: check_overflow(external=True) and skip_step on DeepSpeed's ZeRO optimizer
            first, second, third = d["align_log"]
            # The critic overflowed: the actor's step was skipped through skip_step (on both ranks), flag reset.
            assert first["actor_skipped"] == 1 and not first["actor_applied"] and first["actor_skip_flag"] is False
            assert first["critic_skipped"] == 0
            # The actor's gradients held a NaN on rank 1 only: both ranks saw it, so both skipped the critic's step
            # (the actor's own step was skipped by DeepSpeed's check: bf16's, or fp16's overflow check).
            assert second["critic_skipped"] == 1 and second["actor_skipped"] == 2 and not second["actor_applied"]
            # Then both train again.
            assert third["actor_applied"] and third["actor_skipped"] == 2 and third["critic_skipped"] == 1
            assert third["critic_steps"] == 3
            if precision == "fp16":
                # DeepSpeed's scale from 2**8: the requested skip kept it, the NaN overflow used up one of DeepSpeed's
                # 2 hysteresis overflows (no back-off yet); the trainer's get_overflow read the actor's flag.
                assert [it["actor_scale"] for it in d["align_log"]] == [256.0, 256.0, 256.0]
                assert d["overflow_log"] == [(False, False), (True, False), (False, False)]
            else:
                assert [it["actor_scale"] for it in d["align_log"]] == [1.0, 1.0, 1.0]
        # module.generate(synced_gpus=<ZeRO-3>) ran on the fast path (never delegated to transformers).
        assert d["fast_path_calls"] and d["invalidations"] == 0
        if stage == 3 and copy == "off":  # graphs refused on partitioned weights: eager steps on gathered ones
            assert d["captures"] == 0 and d["eager_steps"] > 0 and "delegated" not in (d["refusal"] or "")
        else:
            assert d["captures"] > 0 and d["replays"] > 0 and d["refusal"] is None
        assert d["generate_restored"]
        # Its tokens equal transformers' own generate on the trained (gathered) weights, in one process; where
        # 16-bit rounding could break a near tie, the fp32 teacher-forced logits arbitrate.
        assert all(v.dtype == DTYPE[precision] for v in d["weights"].values() if v.is_floating_point())
        model, arbiter = actor_model(dtype=DTYPE[precision]), actor_model()
        model.load_state_dict(d["weights"])
        arbiter.load_state_dict({k: v.float() for k, v in d["weights"].items()})
        theirs = model.generate(d["ids"], attention_mask=d["mask"], **d["kw"])
        for r in range(d["ids"].shape[0]):
            context = [int(t) for t, m in zip(d["ids"][r], d["mask"][r]) if m]
            assert_greedy_close(arbiter, context, d["graph_tokens"][r, 5:], theirs[r, 5:],
                                logit_atol=LOGIT_ATOL[precision], name=f"stage {stage} {precision} row {r}")
