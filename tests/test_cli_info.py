"""`hybrid-engine info` on this CPU machine: versions, accelerator, graph capability."""

import subprocess
import sys

import pytest

from hybrid_engine.accelerator import CPUAccelerator, set_accelerator
from hybrid_engine.cli import main


@pytest.fixture(autouse=True)
def _reset():
    yield
    set_accelerator(None)


def test_info_reports_cpu_graph_emulation(capsys):
    set_accelerator(CPUAccelerator())
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out
    assert "accelerator    cpu" in out
    assert "graph capture  available via hybrid_engine CPU graph emulation" in out


def test_info_reports_why_capture_is_unavailable(capsys):
    set_accelerator(CPUAccelerator(emulate_graphs=False))
    main(["info"])
    assert "graph capture  unavailable: CPU graph emulation is disabled" in capsys.readouterr().out


@pytest.mark.slow  # a fresh interpreter
def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "hybrid_engine", "info"], capture_output=True, text=True,
                          timeout=120, env={"HYBRID_ENGINE_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "available via hybrid_engine CPU graph emulation" in proc.stdout


def test_info_names_the_optional_extras_and_how_to_install_a_missing_one(capsys, monkeypatch):
    from importlib import metadata

    import hybrid_engine.cli as cli

    set_accelerator(CPUAccelerator())
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: (_ for _ in ()).throw(metadata.PackageNotFoundError(name))
                        if name == "peft" else real(name))
    main(["info"])
    out = capsys.readouterr().out
    ds = cli._version_of("deepspeed")
    assert (f"deepspeed      {ds} (ZeRO 1-3)" if ds else "deepspeed      not installed (pip install") in out
    assert "peft           not installed (pip install 'hybrid-engine[peft]' for PEFT LoRA)" in out
    assert cli._version_of("no-such-distribution-here") is None


def test_info_with_a_forced_accelerator_this_machine_lacks_reports_it(capsys, monkeypatch):
    """info is what one runs to diagnose the environment: a forced accelerator that cannot work here is a
    line of its report, not a traceback."""
    import torch

    set_accelerator(None)
    monkeypatch.setenv("HYBRID_ENGINE_ACCELERATOR", "bogus")
    assert main(["info"]) == 1
    assert "accelerator    unavailable: unknown accelerator 'bogus'" in capsys.readouterr().out
    if torch.cuda.is_available():  # pragma: no cover - a machine with CUDA
        return
    set_accelerator(None)
    monkeypatch.setenv("HYBRID_ENGINE_ACCELERATOR", "cuda")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "accelerator    cuda (TorchBackendAccelerator, not available on this machine)" in out
    assert "graph capture  unavailable: " in out and "Traceback" not in out
