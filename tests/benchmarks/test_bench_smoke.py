"""Smoke tests of ``hybrid-engine bench``: each sub-benchmark on a tiny model with tiny sizes.

They run the real CLI in-process (CPU graph emulation) and check the JSON:
the expected fields are there and graph tokens agree with eager ones, all of them.
"""

from __future__ import annotations

import json

import pytest

from hybrid_engine.cli import main

pytestmark = pytest.mark.slow  # runs the benches in processes (tests/tiers.py)

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
    assert d["graph_side_problems"] == []


def test_bench_decode_per_step_next_to_transformers(tmp_path, capsys):
    """``--per-step`` leaves the prefill out; ``--paths transformers`` adds transformers' generate (eager only)."""
    d = _run(tmp_path, capsys, "bench", "decode", "--model", "tiny-qwen2", "--batch-sizes", "2", "--prompt-len", "8",
             "--new-tokens", "4", "--repeats", "1", "--paths", "engine,transformers", "--per-step")
    assert d["settings"]["per_step"] is True
    rows = {r["path"]: r for r in d["rows"]}
    assert set(rows) == {"engine", "transformers"}
    assert rows["engine"]["graph_ms_per_step"] > 0 and rows["engine"]["tokens_identical"] == 2 * 2 * 4
    hf = rows["transformers"]
    assert hf["eager_ms_per_step"] > 0 and hf["graph_ms_per_step"] is None and hf["speedup"] is None


def test_bench_decode_per_step_needs_two_new_tokens(capsys):
    assert main(["bench", "decode", "--model", "tiny", "--batch-sizes", "1", "--prompt-len", "8", "--new-tokens",
                 "1", "--per-step"]) != 0
    assert "--per-step needs --new-tokens of at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("bench", [
    ["decode", "--batch-sizes", "1", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1"],
    ["continuous", "--prompt-len", "8", "--new-tokens", "4", "--measured", "1", "--mixed-requests", "0",
     "--longtail-requests", "0"],
    ["rlhf", "--batch-size", "2", "--prompt-len", "8", "--new-tokens", "4", "--warmup", "1", "--iterations", "1"],
])
def test_a_graph_side_that_ran_eagerly_fails_the_bench_after_its_report(tmp_path, capsys, bench):
    """A backend that cannot capture makes the graph side run eagerly: its figures would read as a ~1.0x
    speedup. The bench reports, writes its JSON, then exits 1 saying so."""
    from hybrid_engine.accelerator import CPUAccelerator, set_accelerator

    set_accelerator(CPUAccelerator(emulate_graphs=False))
    out = tmp_path / "result.json"
    try:
        with pytest.warns(UserWarning), pytest.raises(SystemExit, match="the graph side ran eagerly"):
            main(["bench", *bench, "--model", "tiny", "--device", "cpu", "--json", str(out)])
    finally:
        set_accelerator(None)
    assert "NOT VALID" in capsys.readouterr().out
    assert json.loads(out.read_text())["graph_side_problems"]


def test_bench_rlhf(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "rlhf", "--model", "tiny", "--batch-size", "2", "--prompt-len", "8",
             "--new-tokens", "4", "--warmup", "1", "--iterations", "2")
    assert set(d["phases"]) == {"generate", "train step", "iteration"}
    for phase in d["phases"].values():
        assert phase["eager_ms"] > 0 and phase["graph_ms"] > 0 and phase["speedup"] > 0
    assert set(d["peak_memory"]) == {"eager_bytes", "graph_bytes"}
    cap = d["capture"]
    assert cap["captures"] > 0 and cap["capture_seconds"] > 0
    # Captures per iteration: graph_stats differences around each generate, summing to the engine's total.
    per_iter, per_iter_s = cap["captures_per_iteration"], cap["capture_seconds_per_iteration"]
    assert len(per_iter) == len(per_iter_s) == 1 + 2
    assert sum(per_iter) == cap["captures"] == d["graph"]["graph"]["captures"]
    assert sum(per_iter_s) == pytest.approx(cap["capture_seconds"])
    assert per_iter[0] > 0 and per_iter_s[0] > 0  # the first iteration captures ...
    assert per_iter[1:] == [0, 0]  # ... later ones of the same shape replay
    assert cap["eager_captures_per_iteration"] == [0, 0, 0]
    assert d["token_agreement"]["total"] == 2 * 4
    _total(d["token_agreement"])
    _total(d["token_agreement_all_iterations"])


def test_bench_continuous(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "continuous", "--model", "tiny", "--prompt-len", "8", "--new-tokens", "4",
             "--measured", "2", "--mixed-requests", "5", "--mixed-max-batch", "2", "--mixed-max-new", "5",
             "--mixed-prompt-len", "8", "--mixed-repeats", "1", "--longtail-requests", "0")
    assert d["long_tail"] is None  # 0 skips the long-tailed workload
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


def test_bench_continuous_long_tail(tmp_path, capsys):
    # 16 requests in 8 slots, one long (12 tokens) per group of 8, the rest 3..6: behaviour, never timing ratios.
    d = _run(tmp_path, capsys, "bench", "continuous", "--model", "tiny", "--prompt-len", "8", "--new-tokens", "2",
             "--warmup", "2", "--measured", "1", "--mixed-requests", "0", "--longtail-requests", "16",
             "--longtail-long", "12", "--longtail-prompt-len", "8", "--longtail-repeats", "2")
    lt = d["long_tail"]
    assert lt["requests"] == 16 and lt["slots"] == 8 and lt["model"] == "tiny-gpt2"
    budgets = lt["budgets"]
    assert [b for i, b in enumerate(budgets) if i % 8 == 0] == [12, 12]
    assert all(3 <= b <= 6 for i, b in enumerate(budgets) if i % 8)
    assert lt["lengths_match_budgets"] is True  # EOS unreachable: the budgets decide the lengths
    for key in ("step_ratio", "wall_ratio", "wall_target", "wall_target_met", "agreement"):
        assert key in lt, key
    cont, stat = lt["continuous"], lt["static"]
    for mode in (cont, stat):
        for key in ("ms", "tok_s", "decode_steps", "prefill_forwards", "host_syncs", "graph_captures",
                    "graph_captures_warmup", "graph_replays"):
            assert key in mode, key
        assert mode["ms"] > 0 and mode["tok_s"] > 0 and len(mode["all_ms"]) == 2
        assert mode["tokens"] == sum(budgets)
        assert mode["prefill_forwards"] > 0 and mode["host_syncs"] > 0
        assert mode["graph_captures_warmup"] >= 1 and mode["graph_replays"] > 0  # graphs on in both modes
        assert mode["graph_captures"] == 0  # the warm-up captured every bucket the workload visits
    # Static runs each group of 8 until its long request ends; continuous refills slots.
    assert stat["decode_steps"] >= 2 * (12 - 1)
    assert cont["decode_steps"] < stat["decode_steps"]
    assert lt["step_ratio"] == pytest.approx(stat["decode_steps"] / cont["decode_steps"])
    agree = lt["agreement"]
    assert agree["requests_identical"] == agree["requests"] == 2 * 16  # both measured pairs
    assert agree["total"] == 2 * sum(budgets)
    _total(agree)
    _total(d["token_agreement"])


def test_bench_memory(tmp_path, capsys):
    """Behaviour only (never timing): the same tokens at every capacity, pages that follow the tokens held, a
    shared prompt held once, a budget that bounds the pool at a large capacity, and transformers' paged
    continuous batching run on the same requests (or its failure reported, not fatal)."""
    d = _run(tmp_path, capsys, "bench", "memory", "--model", "tiny", "--capacities", "24,96", "--prompts", "4",
             "--samples", "2", "--prompt-len", "6", "--long", "12", "--short", "3", "--slots", "4",
             "--page-size", "4", "--repeats", "1")
    assert d["benchmark"] == "memory" and d["tokens_identical_across_capacities"] is True
    assert [(r["capacity"], r["kv_cache_tokens"]) for r in d["rows"]] == [(24, None), (96, None), (96, 4 * d["rows"][0]["kv_pages_total"])]
    for r in d["rows"]:
        assert r["graph_replays"] > 0 and r["fallbacks"] == 0
        assert 0 < r["kv_pages_held_peak"] <= r["kv_pages_peak"] < r["kv_pages_total"]
        assert r["kv_bytes_peak"] == d["rows"][0]["kv_bytes_peak"]  # the tokens held, not the capacity
    default_96, budget_96 = d["rows"][1]["pool_bytes"], d["rows"][2]["pool_bytes"]
    assert budget_96 < default_96  # the pool follows the budget, not cache_capacity
    assert d["page_ratio"] <= d["target_page_ratio"] and d["step_ratio"] > 0
    assert d["shared_prompt"]["prompt_held_once"] is True
    cb = d["transformers_continuous"]
    assert "error" in cb or (cb["cache_bytes"] > 0 and cb["responses"] == 8), cb
    assert d["transformers_generate"]["kv_bytes_peak"] > 0
    assert d["graph_side_problems"] == []


def test_bench_overhead(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "overhead", "--model", "tiny", "--batch-size", "2", "--prompt-len", "8",
             "--new-tokens", "6", "--repeats", "1")
    for key in ("ours_median_ms", "hf_median_ms", "ratio", "target_ratio", "within_target"):
        assert key in d
    assert d["ratio"] > 0 and d["target_ratio"] == 1.05
    _total(d["token_agreement"])
    # Next to DeepSpeed's own HybridEngineRollout on the same work (its module ships with the deepspeed extra).
    pytest.importorskip("deepspeed.runtime.rollout")
    rows = {r["mode"]: r for r in d["rollout_vs_deepspeed"]}
    assert set(rows) == {"greedy", "sampled"} and d["rollout_target_ratio"] == 1.0
    assert all(r["ratio"] > 0 and len(r["ours_ms"]) == len(r["deepspeed_ms"]) == 1 for r in rows.values())
    _total(rows["greedy"]["token_agreement"])  # greedy: DeepSpeed's tokens are ours
    assert rows["sampled"]["token_agreement"] is None
    for r in rows.values():  # ours with graphs on too: it replayed, and its tokens are the eager ones
        assert r["graphs_ratio"] > 0 and r["graph_replays"] > 0 and r["graph_tokens_equal_eager"]


def test_bench_overhead_without_the_rollout_comparison(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "overhead", "--model", "tiny", "--batch-size", "1", "--prompt-len", "4",
             "--new-tokens", "3", "--repeats", "1", "--rollout-modes", "none")
    assert d["rollout_vs_deepspeed"] == []


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


def test_bench_parity_that_fails_says_why(tmp_path, capsys):
    """Before: every row 'N/N identical' with ok=NO and a bare 'FAIL', the reason only in a warning above."""
    from hybrid_engine.accelerator import CPUAccelerator, set_accelerator

    set_accelerator(CPUAccelerator(emulate_graphs=False))
    out = tmp_path / "parity.json"
    try:
        with pytest.warns(UserWarning), pytest.raises(SystemExit):
            main(["bench", "parity", "--models", "tiny-llama", "--batch-size", "1", "--prompt-len", "4",
                  "--new-tokens", "2", "--device", "cpu", "--json", str(out)])
    finally:
        set_accelerator(None)
    printed = capsys.readouterr().out
    failures = json.loads(out.read_text())["failures"]
    assert len(failures) == 4 and all("the graph side ran eagerly" in f for f in failures)
    assert "-> FAIL\n  tiny-llama/engine/greedy: the graph side ran eagerly" in printed


def test_bench_parity_model_checks_that_one_model(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "parity", "--model", "tiny-opt", "--batch-size", "1", "--prompt-len", "4",
             "--new-tokens", "2")
    assert {r["model"] for r in d["rows"]} == {"tiny-opt"} and d["ok"] is True


def test_figures_that_do_not_exist_are_null_in_strict_json(tmp_path, capsys):
    """--measured 0 (a command BENCHMARKS.md shows) times nothing in part 1: null, not NaN, which strict JSON
    parsers refuse."""
    out = tmp_path / "result.json"
    assert main(["bench", "continuous", "--model", "tiny", "--prompt-len", "8", "--new-tokens", "4", "--measured",
                 "0", "--mixed-requests", "0", "--longtail-requests", "0", "--json", str(out)]) == 0
    assert "skipped (--measured 0)" in capsys.readouterr().out
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    latency = json.loads(text)["latency"]
    assert latency["speedup"] is None and latency["eager_median_ms"] is None


def test_bench_soak(tmp_path, capsys):
    # RSS is measured by the real soak run (BENCHMARKS.md); here the bound is loose, captures are what count.
    # Decode graphs are keyed by span too, captured when a call first reaches one: the warm-up is half the run.
    d = _run(tmp_path, capsys, "bench", "soak", "--model", "tiny", "--iterations", "12", "--checkpoints", "4",
             "--batch-size", "3", "--samples", "2", "--new-tokens", "6", "--max-rss-growth-mb", "512",
             "--warmup-fraction", "0.5")
    assert d["benchmark"] == "soak" and [p["iteration"] for p in d["samples"]] == [3, 6, 9, 12]
    for p in d["samples"]:
        assert p["rss_mb"] > 0 and p["decode_graphs"] >= 1 and p["fallbacks"] == 0
    after = d["after_warmup"]
    assert set(after) == {"from_iteration", "captures", "rss_growth_mb", "device_growth_mb", "flat"}
    assert after["captures"] == (d["samples"][-1]["captures"] + d["samples"][-1]["admission_captures"]
                                 - next(p["captures"] + p["admission_captures"] for p in d["samples"]
                                        if p["iteration"] == after["from_iteration"]))
    _total(d["token_agreement"])


def test_a_short_soak_counts_the_admission_captures_as_warm_up_and_a_growing_one_fails(tmp_path, capsys,
                                                                                       monkeypatch):
    """The second call captures the admission graphs: a run shorter than 20 iterations took them for growth
    (warm-up = 10 % of the run) and reported NOT flat, yet exited 0 even when it was not flat."""
    argv = ["bench", "soak", "--model", "tiny", "--iterations", "4", "--checkpoints", "4", "--batch-size", "2",
            "--samples", "2", "--new-tokens", "4"]
    d = _run(tmp_path, capsys, *argv, "--max-rss-growth-mb", "512")
    assert d["after_warmup"]["from_iteration"] == 2 and d["after_warmup"]["captures"] == 0
    assert d["after_warmup"]["flat"] is True
    import itertools

    import hybrid_engine.benchmarks.soak as soak

    grows = itertools.count(1000, 100)  # a leak of 100 MiB per sample
    monkeypatch.setattr(soak, "resident_mb", lambda: float(next(grows)))
    with pytest.raises(SystemExit, match="captures or memory grew after the warm-up"):
        main([*argv, "--json", str(tmp_path / "grown.json")])
    assert "NOT flat" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [None, ["--iters", "0"], ["--batch", "0"]], ids=["runs", "iters-0", "batch-0"])
def test_bench_cpu_graph_replay_script(tmp_path, bad):
    """bench/cpu_graph_replay.py at a tiny shape: replayed logits equal eager ones; bad counts are one usage line
    (before, --iters 0 ended in a StatisticsError traceback)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "cpu_graph_replay.py"
    out = tmp_path / "replay.json"
    argv = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--batch", "1", "--iters", "2",
            "--json", str(out), *(bad or [])]
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    if bad is None:
        assert proc.returncode == 0, proc.stderr
        assert all(row["logits_identical"] for row in json.loads(out.read_text())["rows"])
    else:
        assert proc.returncode == 2 and f"{bad[0]}" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_exact(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "exact", "--model", "tiny-llama", "--dtypes", "fp32", "--prompts", "2",
             "--samples", "2", "--prompt-len", "6", "--new-tokens", "6", "--repeats", "1")
    assert d["benchmark"] == "exact" and d["ok"] and not d["graph_side_problems"]
    rows = {r["mode"]: r for r in d["rows"]}
    assert set(rows) == {"default", "exact"}
    assert rows["exact"]["max_rollout_vs_train"] == 0 and rows["exact"]["max_batch1_vs_batch"] == 0
    assert rows["exact"]["rollout_s"] > 0 and d["cost"]["fp32"]["train_step"] > 0


def test_bench_multiturn(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "multiturn", "--model", "tiny-llama", "--prompts", "2", "--samples", "2",
             "--prompt-len", "8", "--turns", "2", "--new-tokens", "6", "--repeats", "1")
    assert d["benchmark"] == "multiturn" and d["ok"] and d["same_tokens"] and not d["graph_side_problems"]
    rows = {r["path"]: r for r in d["rows"]}
    assert set(rows) == {"reuse", "re-prefill", "transformers"}
    # Turn 2 prefills every history whole without reuse; with it, only each row's last token and the
    # environment's tokens.
    assert rows["reuse"]["prefill_tokens"] < rows["re-prefill"]["prefill_tokens"]
    assert rows["reuse"]["tokens_generated"] == rows["re-prefill"]["tokens_generated"] > 0
    assert all(r["wall_s"] > 0 for r in d["rows"])


def test_bench_handoff(tmp_path, capsys):
    d = _run(tmp_path, capsys, "bench", "handoff", "--model", "tiny-llama", "--iterations", "2", "--kv-cache-mb", "64")
    assert d["benchmark"] == "handoff" and d["tokens_identical"] and d["losses_identical"]
    plain, slept = d["plain"], d["phase_mode"]
    assert plain["captures"] == slept["captures"] > 0 and d["pool_keeps_addresses"]
    assert [r["wakes"] for r in slept["iterations"]] == [0, 1] and slept["handoff"]["optimizer_wakes"] == 2
    # RssAnon during training: the 64 MiB pool is asleep in the phase mode, held in the plain run.
    assert d["training_memory_saved_mib"] >= 0.9 * 64


@pytest.mark.parametrize("flag", ["--zero3-inference-copy", "--no-zero3-inference-copy"])
def test_bench_rlhf_refuses_the_inference_copy_switch_below_zero_3(flag, capsys):
    assert main(["bench", "rlhf", "--model", "tiny", flag]) == 2
    err = capsys.readouterr().err
    assert "need --zero-stage 3" in err and "Traceback" not in err
