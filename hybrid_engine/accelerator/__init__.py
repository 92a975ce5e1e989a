"""Process-wide accelerator selection.

``get_accelerator()`` returns one accelerator object for the process. It is
forced by ``HYBRID_ENGINE_ACCELERATOR=cuda|npu|xpu|mps|cpu`` or detected through
``torch.accelerator``; ``set_accelerator`` replaces it (tests use this).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from hybrid_engine.accelerator.backends import CPUAccelerator, GraphAPI, TorchBackendAccelerator
from hybrid_engine.accelerator.base import Accelerator, graph_capture_lock
from hybrid_engine.accelerator.cpu_graph import (
    CPUGraph,
    CPUGraphPool,
    CPUStream,
    GraphCaptureError,
    GraphReplayError,
)
from hybrid_engine.accelerator.for_device import accelerator_for, is_capturing

__all__ = [
    "Accelerator",
    "CPUAccelerator",
    "CPUGraph",
    "CPUGraphPool",
    "CPUStream",
    "GraphAPI",
    "GraphCaptureError",
    "GraphReplayError",
    "TorchBackendAccelerator",
    "accelerator_for",
    "build_accelerator",
    "get_accelerator",
    "graph_capture_lock",
    "is_capturing",
    "set_accelerator",
]

ENV_VAR = "HYBRID_ENGINE_ACCELERATOR"
KNOWN_BACKENDS = ("cuda", "npu", "xpu", "mps", "cpu")

_accelerator: Accelerator | None = None


def _backend_module(name: str) -> Any:
    """The torch device module for ``name``, importing ``torch_npu`` for NPUs."""
    if name == "npu":
        torch_npu = importlib.import_module("torch_npu")
        return getattr(torch, "npu", None) or getattr(torch_npu, "npu", None)
    return getattr(torch, name, None)


def build_accelerator(name: str) -> Accelerator:
    """Construct the accelerator for backend ``name`` (one of ``KNOWN_BACKENDS``)."""
    name = name.strip().lower()
    if name not in KNOWN_BACKENDS:
        raise ValueError(f"unknown accelerator {name!r}: choose one of {', '.join(KNOWN_BACKENDS)}")
    if name == "cpu":
        return CPUAccelerator(emulate_graphs=os.environ.get("HYBRID_ENGINE_CPU_GRAPHS", "1") != "0")
    try:
        module = _backend_module(name)
    except ImportError as exc:
        raise ValueError(f"accelerator {name!r} needs its torch extension: {exc}") from exc
    if module is None:
        raise ValueError(f"accelerator {name!r} is not provided by this torch build")
    return TorchBackendAccelerator(name, module)


def _detect() -> str:
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            importlib.import_module("torch_npu")
        except Exception:
            pass
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        # A CUDA build of torch on a host without a GPU still names CUDA unless asked whether it is usable.
        try:
            available = acc.is_available() if hasattr(acc, "is_available") else True
            current = acc.current_accelerator() if available else None
        except Exception:
            current = None
        if current is not None and current.type in KNOWN_BACKENDS:
            return current.type
        return "cpu"
    if torch.cuda.is_available():  # torch without torch.accelerator
        return "cuda"
    return "cpu"


def get_accelerator() -> Accelerator:
    """The process-wide accelerator, created on first use."""
    global _accelerator
    if _accelerator is None:
        forced = os.environ.get(ENV_VAR)
        _accelerator = build_accelerator(forced if forced else _detect())
    return _accelerator


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Replace the process-wide accelerator (``None`` re-runs detection on next use)."""
    global _accelerator
    if accelerator is not None and not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator: expected an Accelerator, got {type(accelerator).__name__}")
    _accelerator = accelerator
