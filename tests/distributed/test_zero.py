"""DeepSpeed (ZeRO 1/2/3, and stage 0's data parallelism) on 2 CPU ranks (gloo, loopback), through
``hybrid_engine.initialize``.

Each case starts ``zero_worker.py`` under torchrun with a hard timeout that
kills the ranks' process group (:func:`hybrid_engine.distributed.launch.run_ranks`), then
asserts on what every rank saved: training matches a stage-0 reference trained
on the whole global batch, rollouts with graphs equal eager ones before and after optimizer
steps (ZeRO 1/2, no recapture), ZeRO-3 refuses graphs and generates from
gathered parameters, and ranks that finish at different lengths never hang.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from hybrid_engine.distributed.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes or ranks (tests/tiers.py)

WORKER = Path(__file__).with_name("zero_worker.py")
TIMEOUT_S = 240
STEPS = 3


def run_worker(tmp_path: Path, stage: int, precision: str, *extra: str) -> list[dict]:
    proc = run_ranks([str(WORKER), str(stage), precision, str(tmp_path), *extra], nproc=2, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_graph_equals_eager(d: dict) -> None:
    for label in ("before", "after"):
        for name in ("greedy", "sampled"):
            assert torch.equal(d[f"{label}_{name}_graph"], d[f"{label}_{name}_eager"]), (label, name)
            assert torch.equal(d[f"{label}_{name}_logprobs_graph"], d[f"{label}_{name}_logprobs_eager"]), (label, name)


def assert_ranks_independent(ranks: list[dict]) -> None:
    # engine.destroy() ran DeepSpeed's teardown; training afterwards is a clear error, not an AttributeError.
    assert all("engine was destroyed" in d["after_destroy"] for d in ranks)
    # Rank 0 stopped after 2 tokens, rank 1 ran 24, then both took a collective training step.
    assert [d["uneven_width"] for d in ranks] == [2, 24]
    assert all(d["after_uneven_steps"] == STEPS + 1 for d in ranks)
    # One prompt for two ranks: rank 1 called with an empty shard and got an empty batch, in step with rank 0.
    assert [d["one_prompt_rows"] for d in ranks] == [1, 0] and all(d["in_step_after_empty_shard"] == 3 for d in ranks)
    # Same prompt, seed and request id: each rank samples its own tokens, reproducibly.
    assert not torch.equal(ranks[0]["same_request_tokens"], ranks[1]["same_request_tokens"])
    assert all(torch.equal(d["same_request_tokens"], d["same_request_again"]) for d in ranks)


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (2, "bf16")])
def test_zero_1_2_train_on_deepspeed_and_replay_graphs_across_steps(tmp_path, stage, precision):
    ranks = run_worker(tmp_path, stage, precision)
    for d in ranks:
        assert d["world"] == 2 and d["zero_stage"] == stage and d["optimizer"] == "DeepSpeedZeroOptimizer"
        assert d["global_steps"] == STEPS and d["skipped_steps"] == 0
        assert d["param_dtype"] == ("torch.bfloat16" if precision == "bf16" else "torch.float32")
        assert d["addresses_kept"]  # DeepSpeed writes each step's weights into the same buffers
        assert_graph_equals_eager(d)
        # Captured once, replayed after three optimizer steps with the new weights: no recapture.
        assert d["before_captures"] > 0 and d["after_captures"] == d["before_captures"]
        assert d["after_refusal"] is None and not d["before_warnings"]
        assert not torch.equal(d["before_greedy_graph"], d["after_greedy_graph"])  # the weights did change
        if precision == "fp32":
            # DeepSpeed with torch AdamW and no clipping: bit for bit the single-process stage-0 run.
            assert d["weights_max_diff"] == 0.0
            assert torch.equal(d["reference_greedy"], d["after_greedy_eager"])
        assert d["checkpoint_restored"] and d["checkpoint_steps"] == STEPS + 1
        assert d["checkpoint_rng_is_this_ranks"]
        # Only rank 1 hashed the damaged file; both refused it by name, before DeepSpeed loaded anything.
        assert f"{d['damaged_file']} does not match its sha256 digest" in d["damaged_refused"]
        assert d["damaged_unchanged"]
        assert "holds a stage-0 (plain PyTorch) checkpoint" in d["stage0_checkpoint_refused"]
        if stage == 2 and precision == "fp32":
            assert re.search(r"cannot read .*ckpt/t at ZeRO stage 3 \(it holds: mp_rank_00_model_states\.pt.*"
                             r"zero_to_fp32", d["cross_stage_refused"]), d["cross_stage_refused"]
        assert d["saved_16bit"] is True
        # HybridEngine.from_deepspeed around an engine built with deepspeed.initialize directly.
        assert d["wrapped_stage"] == stage and d["wrapped_captures"] > 0 and d["wrapped_matches_deepspeed"]
        assert torch.equal(d["wrapped_generate"], d["before_engine_generate"])  # same seeded weights
        assert d["adapter_matches"]  # DeepSpeedRolloutEngine on the same engine
    assert_ranks_independent(ranks)
    # The ranks' DeepSpeed checkpoint, into an engine at stage 0: refused by name, not read as "no checkpoint".
    from hybrid_engine import initialize
    from hybrid_engine.tiny_models import build_model

    local, *_ = initialize(model=build_model("tiny-llama", seed=1), config={})
    with pytest.raises(ValueError, match="holds a DeepSpeed ZeRO checkpoint.*zero_to_fp32"):
        local.load_checkpoint(tmp_path / "ckpt", tag="t")
    weights = torch.load(tmp_path / "weights16" / "pytorch_model.bin", weights_only=True)
    assert weights.keys() == local.module.state_dict().keys()


def test_stage_0_on_two_ranks_trains_data_parallel_on_deepspeed(tmp_path):
    # Plain PyTorch on each rank would train one unsynchronised model per rank; DeepSpeed at stage 0 averages
    # the gradients, as deepspeed.initialize does: each rank's micro batch, the whole-batch reference's weights.
    ranks = run_worker(tmp_path, 0, "fp32")
    for d in ranks:
        assert d["world"] == 2 and d["zero_stage"] == 0 and d["global_steps"] == STEPS
        assert d["weights_max_diff"] == 0.0
        assert torch.equal(d["reference_greedy"], d["after_greedy_eager"])
        assert_graph_equals_eager(d)
        assert d["before_captures"] > 0 and d["after_captures"] == d["before_captures"]
        assert d["after_refusal"] is None and not d["before_warnings"]
        # Checkpoints are DeepSpeed's (rank-aware): weights, steps and each rank's RNG stream come back.
        assert d["checkpoint_restored"] and d["checkpoint_steps"] == STEPS + 1 and d["checkpoint_rng_is_this_ranks"]
        assert d["damaged_file"] in d["damaged_refused"] and d["damaged_unchanged"]
        assert "holds a stage-0 (plain PyTorch) checkpoint" in d["stage0_checkpoint_refused"]
        assert d["saved_16bit"] is True
        assert d["wrapped_stage"] == 0 and d["wrapped_captures"] > 0 and d["wrapped_matches_deepspeed"]
    assert_ranks_independent(ranks)


def test_zero_3_refuses_graphs_and_generates_from_gathered_parameters(tmp_path):
    ranks = run_worker(tmp_path, 3, "fp32")
    for d in ranks:
        assert d["zero_stage"] == 3 and d["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert d["global_steps"] == STEPS
        # ZeRO-3's fetch/release hooks are off while generation decodes on the gathered parameters (a user
        # hook still runs), and back in their places afterwards, where training needs them.
        assert d["offload_hooks_registered"] > 0 and d["offload_hooks_during_decode"]
        assert set(d["offload_hooks_during_decode"]) == {0} and d["hook_tables_restored"]
        assert d["before_captures"] == d["after_captures"] == 0
        assert "ZeRO stage 3" in d["after_refusal"]
        # Warned once per runner (the rollout's and the engine's), not per call.
        assert sum("ZeRO stage 3" in w for w in d["before_warnings"]) == 2 and not d["after_warnings"]
        assert_graph_equals_eager(d)
        # Eager generation on the gathered parameters equals the stage-0 reference's (never on 0-element
        # shards, which could not run at all), and training stays with it.
        assert torch.equal(d["reference_greedy"], d["after_greedy_eager"])
        assert d["weights_max_diff"] < 1e-4
        assert d["adapter_matches"]  # DeepSpeedRolloutEngine decodes on the gathered parameters too
    assert_ranks_independent(ranks)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_zero_3_with_a_gathered_inference_copy_replays_graphs_across_steps(tmp_path, lora):
    if lora:
        pytest.importorskip("peft")
    ranks = run_worker(tmp_path, 3, "fp32", "copy", *(["lora"] if lora else []))
    for d in ranks:
        assert d["trainable"] == (8 if lora else 21)  # LoRA A/B on q and v of 2 layers, or every parameter
        assert d["zero_stage"] == 3 and d["generates_on_copy"] and d["global_steps"] == STEPS
        assert_graph_equals_eager(d)
        # The copy is refreshed in place after each step: captured once, replayed with the new weights.
        assert d["before_captures"] > 0 and d["after_captures"] == d["before_captures"]
        assert d["after_refusal"] is None and not d["before_warnings"]
        assert not torch.equal(d["before_greedy_graph"], d["after_greedy_graph"])
        assert torch.equal(d["reference_greedy"], d["after_greedy_eager"])
        assert d["adapter_matches"]
    assert_ranks_independent(ranks)
