"""TRL's GRPOTrainer on DeepSpeed ZeRO-3 (2 CPU ranks, gloo, loopback) with hybrid-engine rollouts.

Each case runs ``trl_zero3_worker.py`` on 2 ranks under a hard timeout that
kills their process group (:func:`hybrid_engine.distributed.launch.run_ranks`). At every
training step the rollout's completions and log-probabilities must equal an
eager rollout of the same request on the trainer's gathered parameters, and the
weights must have moved between steps. By default graphs are refused with one
warning and every call decodes eagerly on the gathered parameters (LoRA
adapters trained through TRL's ``peft_config`` included); with
``zero3_gathered_inference_copy`` the copy (with the same LoRA adapters, where
the trainer trains some) is refreshed to the gathered weights at every call and
graphs are captured once, then replayed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("trl")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)

WORKER = Path(__file__).with_name("trl_zero3_worker.py")
TIMEOUT_S = 240
STEPS = 3


def run_worker(tmp_path: Path, mode: str) -> list[dict]:
    if mode.startswith("lora"):
        pytest.importorskip("peft")
    proc = run_ranks([str(WORKER), mode, str(tmp_path)], nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for d in ranks:
        assert d["world"] == 2 and d["zero_stage"] == 3 and d["distributed_type"].endswith("DEEPSPEED")
        assert d["global_step"] == STEPS
        calls = d["calls"]
        assert [c["step"] for c in calls] == list(range(STEPS))  # one rollout call per step
        for c in calls:  # what trained equals an eager rollout on the gathered weights of that step
            assert c["completion_ids"] == c["eager_completion_ids"]
            assert c["logprobs"] == c["eager_logprobs"]
            assert all(1 <= len(row) <= 8 for row in c["completion_ids"])
        sums = [c["weight_sum"] for c in calls]
        assert len(set(sums)) == STEPS, sums  # every step trained the (partitioned) weights
    return ranks


@pytest.mark.parametrize("mode", ["gathered", "lora"])
def test_rollouts_gather_the_partitioned_weights_and_decode_eagerly(tmp_path, mode):
    for d in run_worker(tmp_path, mode):
        assert d["graph_refused_warnings"] == 1
        for c in d["calls"]:
            assert c["generates_on_trainer_model"] and c["generation_model_partitioned"]
            assert c["stats"]["use_graph_capture"] is False and c["stats"]["graph_replays"] == 0
            assert "ZeRO stage 3" in c["stats"]["last_refusal_reason"]


@pytest.mark.parametrize("mode", ["copy", "lora_copy"])
def test_the_inference_copy_follows_every_step_and_replays_graphs_captured_once(tmp_path, mode):
    for d in run_worker(tmp_path, mode):
        assert d["graph_refused_warnings"] == 0
        calls = d["calls"]
        for c in calls:
            assert not c["generates_on_trainer_model"] and not c["generation_model_partitioned"]
            assert c["copy_equals_gathered"]  # refreshed in place to this step's weights
            assert c["stats"]["use_graph_capture"] is True and c["stats"]["last_refusal_reason"] is None
        assert calls[0]["stats"]["graph_captures"] > 0
        assert all(c["stats"]["graph_captures"] == 0 and c["stats"]["graph_replays"] > 0 for c in calls[1:])


def test_the_example_trains_identically_on_the_copy_with_graphs_and_on_gathered_weights():
    example = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    proc = run_ranks([str(example), "--zero3", "--compare", "--steps", "2", "--max-completion-length", "8"],
                     nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rank0 = proc.stdout.split("[rank 1]")[0]
    assert "completions identical at every step: yes" in rank0  # rank 1 compares too: it would exit 1
    # 5 admission graphs: a prefill batch, and a round of each size up to the 8 slots (captured up front)
    assert "| on | 2 | 4 | 5 |" in rank0 and "| off | 2 | 0 | 0 |" in rank0
