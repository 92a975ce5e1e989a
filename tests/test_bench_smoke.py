"""Smoke tests of ``hybrid-engine bench``: each sub-benchmark on a tiny model with tiny sizes.

They run the real CLI in-process (CPU graph emulation) and check the JSON:
the expected fields are there and graph tokens agree with eager ones, all of them.
"""

from __future__ import annotations

import json

import pytest

from hybrid_engine.cli import main

ENV_FIELDS = {"date", "hardware", "device", "torch", "transformers", "command"}


def _run(tmp_path, capsys, *argv: str) -> dict:
    out = tmp_path / "result.json"
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert ENV_FIELDS <= set(data["environment"])
    assert data["environment"]["command"].startswith("hybrid-engine bench")
    assert "| " in printed  # a table was printed
    return data


def _total(agreement: dict) -> None:
    assert agreement["total"] > 0
    assert agreement["identical"] == agreement["total"], agreement


def test_bench_decode(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "decode", "--model", "tiny", "--batch-sizes", "1,2", "--prompt-len", "8",
             "--new-tokens", "4", "--repeats", "1")
    assert d["benchmark"] == "decode"
    assert {(r["path"], r["batch"]) for r in d["rows"]} == {("engine", 1), ("engine", 2), ("rollout", 1),
                                                           ("rollout", 2)}
    for r in d["rows"]:
        for key in ("eager_ms_per_step", "graph_ms_per_step", "eager_tok_s", "graph_tok_s", "speedup"):
            assert r[key] > 0, key
        assert r["tokens_identical"] == r["tokens_total"] == 2 * r["batch"] * 4
        assert r["graph"]["replays"] > 0  # the graph side really replayed
    _total(d["token_agreement"])


def test_bench_rlhf(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "rlhf", "--model", "tiny", "--batch-size", "2", "--prompt-len", "8",
             "--new-tokens", "4", "--warmup", "1", "--iterations", "1")
    assert set(d["phases"]) == {"generate", "train step", "iteration"}
    for phase in d["phases"].values():
        assert phase["eager_ms"] > 0 and phase["graph_ms"] > 0 and phase["speedup"] > 0
    assert set(d["peak_memory"]) == {"eager_bytes", "graph_bytes"}
    assert d["capture"]["captures"] > 0 and d["capture"]["capture_seconds"] > 0
    assert d["token_agreement"]["total"] == 2 * 4
    _total(d["token_agreement"])
    _total(d["token_agreement_all_iterations"])


def test_bench_continuous(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "continuous", "--model", "tiny", "--prompt-len", "8", "--new-tokens", "4",
             "--measured", "2", "--mixed-requests", "5", "--mixed-max-batch", "2", "--mixed-max-new", "5",
             "--mixed-prompt-len", "8", "--mixed-repeats", "1")
    lat = d["latency"]
    for key in ("eager_median_ms", "graph_median_ms", "speedup", "eager_tok_s", "graph_tok_s", "first_graph_call_ms"):
        assert lat[key] > 0, key
    assert [c["prompt_seed"] for c in lat["seed_checks"]] == [1234, 1235]
    assert lat["seed_checks"][0]["graph_captures_this_call"] >= 1
    assert lat["captures_in_second_prompt_call"] == 0  # the second prompt reuses the first capture
    for c in lat["seed_checks"]:
        assert c["identical"] == c["total"] == 4
    mixed = d["mixed"]
    for mode in ("continuous", "static"):
        assert mixed[mode]["tok_s"] > 0 and mixed[mode]["tokens"] == sum(mixed["budgets"])
    _total(mixed["agreement"])
    _total(d["token_agreement"])


def test_bench_overhead(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "overhead", "--model", "tiny", "--batch-size", "2", "--prompt-len", "8",
             "--new-tokens", "6", "--repeats", "1")
    for key in ("ours_median_ms", "hf_median_ms", "ratio", "target_ratio", "within_target"):
        assert key in d
    assert d["ratio"] > 0 and d["target_ratio"] == 1.05
    _total(d["token_agreement"])


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "overhead", "--model", "tiny", "--plot", str(tmp_path / "x.png")])
    assert "pip install 'hybrid-engine[plot]'" in str(exc.value)


def test_bench_parity(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "parity", "--models", "tiny-llama", "--batch-size", "2",
             "--prompt-len", "6", "--new-tokens", "4")
    combos = {(r["model"], r["path"], r["mode"]) for r in d["rows"]}
    assert len(combos) == 4 and d["ok"] is True
    assert all(r["replayed"] for r in d["rows"])
    _total(d["token_agreement"])
