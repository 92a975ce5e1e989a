"""The demo (``hybrid-engine demo``) end to end on tiny sizes, plus its reward and advantage helpers."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_engine.accelerator import set_accelerator
from hybrid_engine.benchmarks.toy_grpo import group_advantages, word_token_ids
from hybrid_engine.cli import main
from hybrid_engine.tiny_models import build_tokenizer


def test_group_advantages_are_normalised_per_prompt():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.2, 0.4])
    adv = group_advantages(rewards, 2).view(3, 2)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(3), atol=1e-6)
    assert adv[0, 0] < 0 < adv[0, 1]
    assert torch.equal(adv[1], torch.zeros(2))  # equal rewards: no signal


def test_word_targets_are_words_only():
    tok = build_tokenizer()
    mask = word_token_ids(tok, len(tok))
    words = {tok.decode([i]) for i in range(len(tok)) if mask[i]}
    assert {"the", "water", "people"} <= words
    assert not any(w.startswith("tok") or len(w) < 2 for w in words)


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama", "qwen2"])
def test_the_demo_policy_has_no_dropout_so_training_scores_what_was_sampled(arch):
    """OPT applies dropout with F.dropout at a float rate (no Dropout module): before, the demo's training
    forward under --model opt differed from the rollout's log-probs by 0.1-0.3."""
    import argparse

    from hybrid_engine.benchmarks.toy_grpo import build_model_and_tokenizer

    model, _ = build_model_and_tokenizer(argparse.Namespace(model_path=None, model=arch, seed=0),
                                         torch.device("cpu"))
    ids = torch.randint(4, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()
        eval_logits = model(ids).logits
        model.train()
        train_logits = model(ids).logits
    assert torch.allclose(train_logits, eval_logits, atol=1e-5)


@pytest.mark.parametrize("graphs", [True, False])
def test_demo_runs_and_reports(tmp_path, capsys, graphs):
    out = tmp_path / "demo.json"
    argv = ["demo", "--iterations", "2", "--batch-size", "2", "--samples", "2", "--new-tokens", "4",
            "--check-prompts", "2", "--check-tokens", "8", "--json", str(out)]
    if not graphs:
        argv.append("--no-graphs")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["history"]) == 2
    for row in data["history"]:
        assert 0.0 <= row["reward"] <= 1.0
        assert row["generate_ms"] > 0 and row["train_ms"] > 0 and row["iteration_ms"] > 0
        assert row["logprob_gap"] < 1e-3  # the training forward scores what the rollout sampled
    assert "mean reward" in printed and "2/2" in printed
    if graphs:
        assert data["token_agreement"] == {"identical": 16, "total": 16}
        assert data["sampled_token_agreement"] == {"identical": 16, "total": 16}
        assert data["captures_training"] >= 1
        assert data["speedup"]["eager_ms"] > 0 and data["speedup"]["graph_ms"] > 0
        assert "16/16 tokens identical" in printed
    else:
        assert "token_agreement" not in data


def test_demo_with_the_memory_hand_off_trains_and_samples_as_without(tmp_path, capsys):
    runs = {}
    for flag in (False, True):
        out = tmp_path / f"demo{flag}.json"
        argv = ["demo", "--iterations", "2", "--batch-size", "2", "--samples", "2", "--new-tokens", "4",
                "--check-prompts", "2", "--check-tokens", "8", "--json", str(out)]
        assert main(argv + (["--sleep-between-phases"] if flag else [])) == 0
        runs[flag] = json.loads(out.read_text())
    capsys.readouterr()
    plain, slept = runs[False], runs[True]
    assert [r["reward"] for r in slept["history"]] == [r["reward"] for r in plain["history"]]
    assert slept["captures_training"] == plain["captures_training"]
    assert slept["handoff"]["optimizer_wakes"] == 2 and slept["handoff"]["kv_cache_wakes"] >= 1
    assert "handoff" not in plain


def test_demo_on_a_backend_that_cannot_capture_says_so_instead_of_comparing_eager_with_eager(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYBRID_ENGINE_CPU_GRAPHS", "0")
    set_accelerator(None)
    try:
        out = tmp_path / "demo.json"
        assert main(["demo", "--iterations", "1", "--batch-size", "1", "--samples", "2", "--new-tokens", "4",
                     "--check-prompts", "1", "--check-tokens", "4", "--json", str(out)]) == 0
    finally:
        set_accelerator(None)
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert "graphs refused (The accelerator cannot capture graphs" in printed
    assert "graph vs eager" not in printed and "token_agreement" not in data and data["graphs"] is False
    assert "CPU graph emulation is disabled" in data["graph_refusal"]


def test_demo_loads_a_local_checkpoint_with_model_path(tmp_path, capsys):
    from hybrid_engine.tiny_models import build_model

    ckpt = tmp_path / "ckpt"
    build_model("tiny-opt", seed=5).save_pretrained(ckpt)
    build_tokenizer().save_pretrained(ckpt)
    out = tmp_path / "demo.json"
    argv = ["demo", "--model-path", str(ckpt), "--iterations", "1", "--batch-size", "2", "--samples", "2",
            "--new-tokens", "4", "--check-prompts", "2", "--check-tokens", "6", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["token_agreement"] == {"identical": 12, "total": 12}
