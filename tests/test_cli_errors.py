"""Bad options of ``hybrid-engine demo`` and ``bench``: one ``error:`` line on stderr, exit status 2, no traceback.

Every check runs before any model is built or any device is touched, so these run in well under a second each
(in-process through ``cli.main``; one case also through ``python -m hybrid_engine``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybrid_engine.accelerator import KNOWN_BACKENDS, set_accelerator
from hybrid_engine.benchmarks.options import UsageError, available_devices, check_generation_length
from hybrid_engine.cli import main
from hybrid_engine.tiny_models import build_config

DEMO = ["demo", "--iterations", "1", "--batch-size", "1", "--samples", "2", "--check-prompts", "1",
        "--check-tokens", "4"]


@pytest.fixture(autouse=True)
def _reset():
    yield
    set_accelerator(None)


def _unavailable_device() -> str:
    have = available_devices()
    missing = [name for name in KNOWN_BACKENDS if name not in have]
    if not missing:  # pragma: no cover - a machine with every backend at once
        pytest.skip("every accelerator backend is available here")
    return missing[0]


def _usage_error(capsys, argv: list[str], *expected: str) -> str:
    """Run the CLI in-process: exit status 2 and one ``error:`` line holding every ``expected`` piece."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for piece in expected:
        assert piece in lines[0], (piece, lines[0])
    return lines[0]


@pytest.mark.parametrize("command", [DEMO, ["bench", "decode"], ["bench", "soak"]])
def test_an_unavailable_device_is_a_usage_error_naming_what_is_available(capsys, command):
    device = _unavailable_device()
    _usage_error(capsys, [*command, "--device", device], f"--device {device}", "not available",
                 f"available: {', '.join(available_devices())}.", "leave --device out")


def test_cuda_without_a_cuda_device_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if "cuda" in available_devices():  # pragma: no cover - torch.accelerator still reports cuda
        pytest.skip("torch.accelerator reports cuda")
    _usage_error(capsys, [*DEMO, "--device", "cuda"], "--device cuda is not available", "available: ")


def test_available_devices_probes_torch(monkeypatch):
    assert available_devices()[-1] == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "cuda" in available_devices()


@pytest.mark.parametrize("command", [DEMO, ["bench", "overhead"]])
def test_an_unknown_device_lists_the_choices(capsys, command):
    _usage_error(capsys, [*command, "--device", "tpu"], "--device 'tpu'", "cuda, npu, xpu, mps, cpu")


def test_demo_new_tokens_past_the_position_limit(capsys):
    _usage_error(capsys, [*DEMO, "--new-tokens", "600"], "--new-tokens 600", "position limit 512",
                 "--new-tokens 500 or less")


def test_demo_check_tokens_past_the_position_limit(capsys):
    _usage_error(capsys, [*DEMO, "--check-tokens", "600"], "--check-tokens 600", "--check-tokens 500 or less")


@pytest.mark.parametrize("bench", ["decode", "rlhf", "overhead", "parity"])
def test_bench_prompt_plus_new_tokens_past_the_position_limit(capsys, bench):
    args = ["--models", "tiny"] if bench == "parity" else ["--model", "tiny"]
    _usage_error(capsys, ["bench", bench, *args, "--prompt-len", "16", "--new-tokens", "600"],
                 "--prompt-len 16 plus --new-tokens 600", "position limit 512", "--new-tokens 496 or less")


@pytest.mark.parametrize("argv,expected", [
    (["bench", "decode", "--repeats", "0"], ("--repeats must be >= 1, got 0",)),
    (["bench", "overhead", "--repeats", "0"], ("--repeats must be >= 1, got 0",)),
    (["bench", "rlhf", "--batch-size", "0"], ("--batch-size must be >= 1, got 0",)),
    (["bench", "soak", "--samples", "0"], ("--samples must be >= 1, got 0",)),
    (["bench", "parity", "--temperature", "-1"], ("--temperature must be > 0, got -1.0",)),
    (["bench", "parity", "--top-p", "0"], ("--temperature/--top-p", "top_p")),
    (["bench", "continuous", "--warmup", "1"], ("--warmup must be >= 2",)),
], ids=["decode-repeats", "overhead-repeats", "rlhf-batch", "soak-samples", "parity-temperature", "parity-top-p",
        "continuous-warmup"])
def test_bench_counts_and_sampling_knobs_are_checked_up_front(capsys, argv, expected):
    _usage_error(capsys, argv, *expected)


def test_bench_rlhf_on_zero_ranks_checks_before_starting_any_rank(capsys, monkeypatch):
    import hybrid_engine.distributed.launch as launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started before the options were checked")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "run_ranks", no_ranks)
    _usage_error(capsys, ["bench", "rlhf", "--zero-stage", "2", "--model", "tiny", "--prompt-len", "16",
                          "--new-tokens", "600"], "--prompt-len 16 plus --new-tokens 600")


def test_bench_soak_new_tokens_past_the_position_limit(capsys):
    _usage_error(capsys, ["bench", "soak", "--new-tokens", "600"], "--new-tokens 600", "--new-tokens 500 or less")


def test_bench_continuous_mixed_budget_past_the_position_limit(capsys):
    _usage_error(capsys, ["bench", "continuous", "--model", "tiny", "--mixed-max-new", "600"],
                 "--mixed-prompt-len 32 plus --mixed-max-new 600", "--mixed-max-new 480 or less")


@pytest.mark.parametrize("extra,expected", [
    (["--longtail-long", "600"], ("--longtail-prompt-len 32 plus --longtail-long 600", "limit 512 of tiny-gpt2",
                                  "--longtail-long 480 or less")),
    (["--longtail-model", "same", "--longtail-long", "1000"], ("limit 1024 of gpt2", "--longtail-long 992 or less")),
    (["--longtail-prompt-len", "512"], ("--longtail-prompt-len 512 leaves no room",)),
    (["--longtail-model", "nope"], ("--longtail-model 'nope' is not a model name",)),
    (["--longtail-slots", "0"], ("--longtail-slots", "must be >= 1")),
])
def test_bench_continuous_long_tail_options_are_checked_before_part_1_runs(capsys, extra, expected):
    # Part 3 runs its own model (tiny-gpt2 on CPU unless --longtail-model), so the main model's check misses it.
    _usage_error(capsys, ["bench", "continuous", "--mixed-requests", "0", *extra], *expected)


@pytest.mark.parametrize("command", [DEMO, ["bench", "decode"], ["bench", "parity"]])
def test_a_missing_model_path(capsys, command, tmp_path):
    missing = tmp_path / "nonexistent"
    _usage_error(capsys, [*command, "--model-path", str(missing)], f"--model-path {missing} does not exist")


def test_a_model_path_that_is_not_a_checkpoint(capsys, tmp_path):
    _usage_error(capsys, [*DEMO, "--model-path", str(tmp_path)], "--model-path", "no config.json")
    (tmp_path / "weights.bin").write_text("x")
    _usage_error(capsys, [*DEMO, "--model-path", str(tmp_path / "weights.bin")], "--model-path", "is not a directory")


def test_a_model_path_without_weights(capsys, tmp_path):
    build_config("tiny-gpt2").save_pretrained(tmp_path)  # config.json only
    for command in (DEMO, ["bench", "decode"]):
        _usage_error(capsys, [*command, "--model-path", str(tmp_path)], "--model-path",
                     "not a loadable causal LM checkpoint")


@pytest.mark.parametrize(("argv", "expected"), [
    ([*DEMO, "--iterations", "0"], "--iterations must be >= 1, got 0"),
    ([*DEMO, "--check-prompts", "0"], "--check-prompts must be >= 1"),
    ([*DEMO, "--threads", "0"], "--threads must be >= 1"),
    ([*DEMO, "--lr", "-1"], "--lr must be a finite number >= 0"),
    ([*DEMO, "--lr", "inf"], "--lr must be a finite number >= 0"),
    (["bench", "decode", "--dtype", "fp8"], "--dtype 'fp8'"),
    (["bench", "decode", "--threads", "-1"], "--threads must be >= 1"),
    (["bench", "decode", "--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["bench", "overhead", "--model", "tiny-nothing"], "--model 'tiny-nothing' is not a model name"),
    (["bench", "parity", "--models", "tiny,nothing"], "--models 'nothing' is not a model name"),
])
def test_other_bad_options(capsys, argv, expected):
    _usage_error(capsys, argv, expected)


@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", "continuous", "--measured", "-2"], "--measured must be >= 0"),
    (["bench", "continuous", "--mixed-repeats", "0"], "--mixed-repeats must be >= 1, got 0"),
    (["bench", "continuous", "--mixed-max-batch", "0"], "--mixed-max-batch must be >= 1, got 0"),
    (["bench", "continuous", "--mixed-max-new", "0"], "--mixed-max-new must be >= 1, got 0"),
    (["bench", "continuous", "--mixed-prompt-len", "0"], "--mixed-prompt-len must be >= 1, got 0"),
    (["bench", "continuous", "--mixed-requests", "0", "--longtail-repeats", "0"], "--longtail-repeats must be >= 1"),
    (["bench", "parity", "--models", ","], "--models ',' names no model"),
    (["bench", "parity", "--temperature", "0"], "--temperature must be > 0"),
    (["bench", "rlhf", "--lr", "-1"], "--lr must be a finite number >= 0"),
    (["bench", "rlhf", "--lr", "nan"], "--lr must be a finite number >= 0"),
    (["bench", "rlhf", "--zero-stage", "1", "--timeout", "-1"], "--timeout must be a number of seconds > 0"),
    (["bench", "soak", "--lr", "-1"], "--lr must be a finite number >= 0"),
    (["bench", "soak", "--max-rss-growth-mb", "-1"], "--max-rss-growth-mb must be a finite number >= 0"),
    (["bench", "soak", "--max-rss-growth-mb", "nan"], "--max-rss-growth-mb must be a finite number >= 0"),
    (["bench", "soak", "--warmup-fraction", "1.5"], "--warmup-fraction must be in [0, 1), got 1.5"),
    (["bench", "soak", "--checkpoints", "0"], "--checkpoints must be >= 1, got 0"),
], ids=["measured", "mixed-repeats", "mixed-max-batch", "mixed-max-new", "mixed-prompt-len", "longtail-repeats",
        "parity-no-models", "parity-temperature-0", "rlhf-lr", "rlhf-lr-nan", "rlhf-timeout",
        "soak-lr", "soak-rss-negative", "soak-rss-nan", "soak-warmup-fraction", "soak-checkpoints"])
def test_options_that_failed_mid_run_are_checked_up_front(capsys, argv, expected):
    """Each of these ran part of a bench, then raised an internal error (or passed an empty parity check)."""
    _usage_error(capsys, argv, expected)


def test_bench_parity_has_no_plot_option(capsys):
    """Its result is pass or fail: there is nothing to draw, so --help does not offer --plot and argparse refuses it."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "parity", "--plot", "p.png"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --plot" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["bench", "decode"], ["bench", "parity"], DEMO])
def test_an_unwritable_json_path_is_refused_before_the_run(capsys, command, tmp_path):
    _usage_error(capsys, [*command, "--json", str(tmp_path)], "--json", "is a directory")
    blocker = tmp_path / "file"
    blocker.write_text("")
    _usage_error(capsys, [*command, "--json", str(blocker / "out.json")], "--json", "cannot create its directory")


@pytest.mark.parametrize("value", ["bogus", "cuda"])
def test_an_unusable_accelerator_in_the_environment_gives_way_to_device_or_is_one_error(capsys, monkeypatch, value):
    if value == "cuda" and torch.cuda.is_available():  # pragma: no cover - a GPU machine
        pytest.skip("CUDA is usable here")
    monkeypatch.setenv("HYBRID_ENGINE_ACCELERATOR", value)
    set_accelerator(None)
    _usage_error(capsys, ["bench", "decode", "--model", "tiny"], "no usable accelerator",
                 "HYBRID_ENGINE_ACCELERATOR", "--device")
    set_accelerator(None)
    from hybrid_engine.benchmarks.common import select_device

    assert select_device("cpu").device().type == "cpu"  # an explicit --device wins over the variable


def test_usage_error_outside_main_still_exits_with_its_message():
    err = UsageError("--x is wrong;\n use --y")
    assert isinstance(err, SystemExit)
    assert err.code == "error: --x is wrong; use --y"


def test_position_limit_boundary_is_allowed():
    config = build_config("tiny-gpt2")
    check_generation_length(config, "tiny-gpt2", prompt_tokens=12, new_tokens=500)
    with pytest.raises(UsageError, match="--new-tokens 500 or less"):
        check_generation_length(config, "tiny-gpt2", prompt_tokens=12, new_tokens=501)


@pytest.mark.slow  # a fresh interpreter
def test_python_dash_m_prints_one_line_and_exits_2():
    device = _unavailable_device()
    env = {k: v for k, v in os.environ.items() if k != "HYBRID_ENGINE_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "hybrid_engine", *DEMO, "--device", device],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith(f"error: --device {device} is not available")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("argv", "expected"), [
    ([*DEMO, "--seed", "1180591620717411303424"], "--seed must be an integer in [0, 4294967295]"),
    ([*DEMO, "--seed", "-1"], "--seed must be an integer in [0, 4294967295] (2**32 - 1), got -1"),
    (["bench", "decode", "--seed", str(2**70)], f"--seed must be an integer in [0, 4294967295] (2**32 - 1), got {2**70}"),
    (["bench", "soak", "--seed", str(2**32)], "--seed must be an integer"),
    ([*DEMO, "--samples", "100000000"], "--batch-size 1 x --samples 100000000 is 100000000 sequences per call"),
    (["demo", "--batch-size", "100000"], "--batch-size 100000 x --samples 4 is 400000 sequences per call, more than "
                                         "the 4096"),
    ([*DEMO, "--check-prompts", "100000"], "--check-prompts 100000 is more than 4096"),
    (["bench", "soak", "--batch-size", "2048", "--samples", "4"], "--batch-size 2048 x --samples 4 is 8192"),
    (["bench", "soak", "--samples", "100000000"], "--batch-size 8 x --samples 100000000"),
    (["bench", "rlhf", "--batch-size", "100000"], "--batch-size 100000 is more than 4096, the most sequences one call"),
    (["bench", "rlhf", "--zero-stage", "1", "--batch-size", "100000"], "--batch-size 100000 is more than 4096"),
    (["bench", "parity", "--batch-size", "100000"], "--batch-size 100000 is more than 4096"),
    (["bench", "overhead", "--batch-size", "100000"], "--batch-size 100000 x --samples 2 is 200000 sequences"),
    (["bench", "continuous", "--batch-size", "100000"], "--batch-size 100000 is more than 4096"),
    (["bench", "continuous", "--mixed-requests", "100000"], "--mixed-requests 100000 is more than 4096"),
    (["bench", "continuous", "--longtail-slots", "100000"], "--longtail-slots 100000 is more than 4096"),
    (["bench", "decode", "--batch-sizes", "1,100000"], "--batch-sizes 1,100000 holds a batch size above 4096"),
], ids=["demo-seed-2**70", "demo-seed-negative", "decode-seed", "soak-seed", "demo-samples", "demo-batch",
        "demo-check-prompts", "soak-rows", "soak-samples", "rlhf-batch", "rlhf-ranks-batch", "parity-batch",
        "overhead-batch", "continuous-batch", "continuous-mixed-requests", "continuous-longtail-slots",
        "decode-batch-sizes"])
def test_seeds_and_sizes_past_their_bounds_are_one_error_line(capsys, monkeypatch, argv, expected):
    """--seed 2**70 was an overflow traceback from torch.manual_seed, --samples 100000000 a traceback from the
    rollout, --batch-size 100000 an allocator error or a minute's run: each is now checked before any work."""
    import hybrid_engine.distributed.launch as launch

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("ranks started before the check"))
    _usage_error(capsys, argv, expected)


def test_seeds_and_sizes_at_their_bounds_pass_the_checks():
    from hybrid_engine import demo
    from hybrid_engine.cli import build_parser

    args = build_parser().parse_args([*DEMO, "--seed", str(2**32 - 1), "--batch-size", "1024", "--samples", "4"])
    demo.check_arguments(args)  # raises UsageError otherwise; nothing is built here
