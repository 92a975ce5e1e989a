"""The README's usage example runs as written (on CPU, through the graph emulation)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    block = re.search(r"## Use it\n\n```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    engine, batch, rollout = scope["engine"], scope["batch"], scope["rollout"]
    assert engine.graph_stats.captures > 0 and engine.graph_stats.fallbacks == 0
    # One capture per bucket the call may reach (EOS can end rows early, so every bucket up to 16) and span of
    # pages its rows reach: no key twice.
    assert rollout.graph_stats.buckets == (1, 2, 4, 8, 16)
    assert rollout.last_stats["graph_captures"] == rollout.graph_stats.graph_keys
    assert batch.response_logprobs.shape[0] == 16  # 4 prompts x 4 samples
    assert engine.global_steps == 1


def test_readme_deepspeed_rollout_example_runs():
    import pytest

    pytest.importorskip("deepspeed")
    text = README.read_text()
    block = re.search(r"## Use with DeepSpeed's rollout interface\n.*?```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    engine, rollout = scope["engine"], scope["rollout"]
    assert engine.global_steps == 3
    stats = rollout.rollout.graph_stats
    assert stats.captures > 0 and stats.fallbacks == 0
