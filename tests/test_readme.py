"""Every example in README.md and docs/*.md runs as written (on CPU, through the graph emulation).

Each ```python block is found by the file and the heading it sits under, run in a fresh scope in a
temporary directory, and checked by the function registered for it in :data:`CHECKS`. A block with
no check fails :func:`test_every_python_block_is_exercised`, so a new example cannot go untested.
The multi-rank script (:data:`MULTI_RANK`) needs launched ranks: tests/distributed/test_readme_scaling.py
runs it. ```json blocks must be configs that ``load_config`` accepts, and relative links must resolve.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # runs every example of the README and docs/ (tests/tiers.py)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]

_HEADING = re.compile(r"^#+ (.+?)\s*$", re.M)


def fenced_blocks(path: Path, language: str) -> list[tuple[str, str]]:
    """``(heading, code)`` of every ```language block of ``path``; heading: the nearest one above it."""
    text = path.read_text()
    blocks = []
    for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.S | re.M):
        headings = _HEADING.findall(text, 0, match.start())
        blocks.append((headings[-1] if headings else "", match.group(1)))
    return blocks


def python_block(name: str, heading: str) -> str:
    """The one ```python block of ``name`` (relative to the repository) under ``heading``."""
    found = [code for h, code in fenced_blocks(ROOT / name, "python") if h == heading]
    assert len(found) == 1, f"{name}: expected one python block under {heading!r}, found {len(found)}"
    return found[0]


# ----------------------------------------------------------------------------- checks, one per block


def check_use_it(scope: dict) -> None:
    engine, batch, rollout = scope["engine"], scope["batch"], scope["rollout"]
    assert engine.graph_stats.captures > 0 and engine.graph_stats.fallbacks == 0
    # One capture per bucket the call may reach (EOS can end rows early, so every bucket up to 16) and span of
    # pages its rows reach: no key twice.
    assert rollout.graph_stats.buckets == (1, 2, 4, 8, 16)
    assert rollout.last_stats["graph_captures"] == rollout.graph_stats.graph_keys
    assert batch.response_logprobs.shape[0] == 16  # 4 prompts x 4 samples
    assert engine.global_steps == 1


def check_refusal(scope: dict) -> None:
    from hybrid_engine.graphs.policy import GraphRefusedWarning

    engine = scope["engine"]
    stats = engine.graph_stats
    # release_inference_cache on the CPU: the memory hand-off, graphs kept (issue 41)
    assert stats.captures > 0 and stats.replays > 0 and stats.last_refusal_reason is None
    assert not [w for w in scope["caught"] if issubclass(w.category, GraphRefusedWarning)]
    assert engine.sleeping_tags == {"kv_cache"} and engine.last_stats["wakes"] == 1
    assert engine.last_stats["graph_captures"] == 0
    assert scope["out"].shape == (2, 16)


def check_detection(scope: dict) -> None:
    stats = scope["engine"].graph_stats
    assert stats.captures > 0 and stats.invalidations == 1 and stats.last_refusal_reason is None
    assert torch.equal(scope["first"], scope["again"])


def check_generate_contract(scope: dict) -> None:
    assert torch.equal(scope["fast"], scope["reference"])  # greedy: token-identical to transformers
    assert "num_beams" in scope["engine"].graph_stats.last_refusal_reason
    assert scope["beams"].shape == (2, 24)


def check_scheduler_and_queries(scope: dict) -> None:
    engine = scope["engine"]
    assert engine.global_steps == 2 and engine.micro_steps == 4
    assert engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 2
    assert scope["lr_scheduler"] is engine.lr_scheduler is not None
    lr = engine.get_lr()[0]
    assert 0 < lr < 1e-3  # still warming up, after two scheduler steps


def check_checkpoint(scope: dict) -> None:
    assert Path(scope["path"]).name == "global_step1" and scope["client_state"] == {"epoch": 3}
    assert Path("ckpt/latest").read_text().strip() == "global_step1"
    assert Path("weights/pytorch_model.bin").is_file()


def check_config(scope: dict) -> None:
    cfg = scope["cfg"]
    assert cfg.train_batch_size == 8 and cfg.hybrid_engine.max_out_tokens == 512
    assert cfg.hybrid_engine.enable_graph_capture
    assert "did you mean 'max_out_tokens'" in scope["message"]


def check_accelerator(scope: dict) -> None:
    from hybrid_engine.accelerator import CPUGraph

    assert isinstance(scope["graph"], CPUGraph)
    assert scope["cpu"].graph_stream() is not None


def check_kv_budget(scope: dict) -> None:
    roomy, tight = scope["roomy"].last_stats, scope["s"]  # s: the tight call's stats, before the refused one
    assert torch.equal(scope["a"].input_ids, scope["b"].input_ids)  # preempted and resumed: the same tokens
    assert tight["preemptions"] > 0 and roomy["preemptions"] == 0
    assert tight["kv_pages_total"] == 10 and tight["kv_pages_peak"] <= 10 < roomy["kv_pages_peak"]
    assert "raise RolloutConfig.kv_cache_tokens to at least 224" in scope["message"]


def check_trl(scope: dict) -> None:
    assert scope["trainer"].state.global_step == 2
    stats = scope["fn"].rollout.graph_stats
    assert stats.captures > 0 and stats.fallbacks == 0 and stats.last_refusal_reason is None


def check_trl_tools(scope: dict) -> None:
    assert scope["trainer"].state.global_step == 1
    stats = scope["fn"].tool_loop.last_stats
    assert stats["rows"] == 4 and len(stats["turns"]) == 4  # the tool loop ran (a random model rarely calls)


def check_deepspeed_rollout(scope: dict) -> None:
    engine, rollout = scope["engine"], scope["rollout"]
    assert engine.global_steps == 3
    stats = rollout.rollout.graph_stats
    assert stats.captures > 0 and stats.fallbacks == 0


def check_exact(scope: dict) -> None:
    real, new, batch = scope["real"], scope["new"], scope["batch"]
    assert int(real.sum()) > 0 and torch.equal(new[real], batch.response_logprobs[real])
    assert scope["rollout"].last_stats["graph_replays"] > 0


def check_handoff(scope: dict) -> None:
    assert torch.equal(scope["again"].input_ids, scope["first"].input_ids)
    assert scope["rollout"].last_stats["wakes"] == 1 and scope["rollout"].last_stats["graph_captures"] == 0
    engine = scope["engine"]
    assert engine.sleeping_tags == frozenset() and engine.handoff_stats.optimizer_wakes == 1


#: (file, heading) -> (the modules the example imports beyond the core, its check).
CHECKS: dict[tuple[str, str], tuple[tuple[str, ...], Callable[[dict], None]]] = {
    ("README.md", "Use it"): ((), check_use_it),
    ("docs/graphs.md", "Refusals"): ((), check_refusal),
    ("docs/graphs.md", "What is detected before a replay"): ((), check_detection),
    ("docs/generation.md", "`engine.generate`"): ((), check_generate_contract),
    ("docs/training.md", "`initialize` and the LR scheduler"): ((), check_scheduler_and_queries),
    ("docs/checkpoints.md", "Checkpoints"): ((), check_checkpoint),
    ("docs/config.md", "Config"): ((), check_config),
    ("docs/accelerators.md", "Accelerators and graph capture"): ((), check_accelerator),
    ("docs/kv-cache.md", "Sizing the pool"): ((), check_kv_budget),
    ("docs/memory-handoff.md", "API"): ((), check_handoff),
    ("docs/exact.md", "Exact on-policy logprobs"): ((), check_exact),
    ("docs/trl.md", "TRL's `GRPOTrainer`"): (("trl", "datasets"), check_trl),
    ("docs/trl.md", "Tools and environments"): (("trl", "datasets"), check_trl_tools),
    ("docs/deepspeed-rollout.md", "DeepSpeed's rollout interface"): (("deepspeed",), check_deepspeed_rollout),
}

#: Blocks that need launched ranks, run by tests/distributed/test_readme_scaling.py.
MULTI_RANK = {("docs/scaling.md", "A training script")}


def test_every_python_block_is_exercised():
    found = [(str(path.relative_to(ROOT)), heading) for path in DOC_FILES
             for heading, _ in fenced_blocks(path, "python")]
    assert len(found) == len(set(found)), f"two python blocks under one heading: {found}"
    assert set(found) == set(CHECKS) | MULTI_RANK


@pytest.mark.parametrize("key", list(CHECKS), ids=[f"{name}:{heading}" for name, heading in CHECKS])
def test_example_runs(key, tmp_path, monkeypatch):
    needs, check = CHECKS[key]
    for module in needs:
        pytest.importorskip(module)
    code = python_block(*key)
    monkeypatch.chdir(tmp_path)  # examples that write (checkpoints, trainer output) write here
    scope: dict = {"__name__": "__example__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exec(compile(code, f"{key[0]} ({key[1]})", "exec"), scope)
    check(scope)


def test_json_blocks_are_configs_load_config_accepts():
    from hybrid_engine.config import load_config

    blocks = [(path.name, code) for path in DOC_FILES for _, code in fenced_blocks(path, "json")]
    assert blocks
    for name, code in blocks:
        data = json.loads(code)
        cfg = load_config(data)  # validated: a typo or an unresolved "auto" raises
        for section, value in data.items():
            if isinstance(value, dict) and "enabled" in value:
                assert getattr(cfg, section).enabled == value["enabled"], (name, section)


def test_relative_links_resolve():
    for path in [*DOC_FILES, ROOT / "BENCHMARKS.md", *sorted((ROOT / "bench" / "notes").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"
