"""What the decode ops' capability probes share: the device a probe result is cached under, the rule that a
probe never runs inside a capture, and the one warning when a kernel meant for the device fails there.

Why: each op module chooses its implementation per device by running its kernels there once (never by device
name) and caches the answer. ``"cuda"`` and ``"cuda:0"`` must share one answer (and one probe run), and the CPU
has no index, so a probe is keyed by :func:`probe_device`. A probe compares results on the host: inside a capture
that read fails, the failure would read as "no kernel here" and be cached for the process, so a probe asked for
first while capturing refuses (:func:`refuse_while_capturing`).

A probe that refuses a kernel falls back to the op's reference: the same results, slower. On a device the
kernel is built for (Triton's GPUs, torch_npu's NPUs) that is a fault worth one warning, with the reason
(:func:`warn_fallback`); elsewhere (a CPU without Triton's interpreter, an NPU asked to run Triton) it is the
expected answer and says nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybrid_engine.accelerator import is_capturing
from hybrid_engine.user_warnings import user_stacklevel

__all__ = ["KERNEL_DEVICES", "failure", "first_serving", "probe_device", "refuse_while_capturing", "warn_fallback"]

#: The device types each kind of kernel is built for. Only whether a refusal is news (a warning) reads it; which
#: implementation runs is always the probe's answer.
KERNEL_DEVICES = {"triton": frozenset({"cuda", "xpu"}), "npu": frozenset({"npu"})}
_WARNED: set[tuple[str, torch.device]] = set()


def probe_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index (``0`` where none is given), except the CPU, which has none."""
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        device = torch.device(device.type, 0)
    return device


def refuse_while_capturing(module: str, device: torch.device) -> None:
    """Raise when ``module``'s probe for ``device`` runs for the first time while a graph is capturing (call
    ``implementation(device)`` or run the op once before capturing)."""
    if is_capturing():
        raise RuntimeError(f"{module}: the implementation for {device} was first asked for while a graph was "
                           f"capturing; call hybrid_engine.decode.ops.{module}.implementation(device) (or run the "
                           "ops once) before capturing")


def warn_fallback(module: str, device: torch.device, candidate: str, reason: str) -> None:
    """Warn once per op module and device that ``candidate``'s kernel failed its probe on ``device`` (``reason``)
    and the reference runs there, where ``device`` is one the kernel is built for (:data:`KERNEL_DEVICES`)."""
    if device.type not in KERNEL_DEVICES.get(candidate, ()) or (module, device) in _WARNED:
        return
    _WARNED.add((module, device))
    warnings.warn(f"hybrid_engine.decode.ops.{module}: the {candidate} kernel failed its probe on {device} ({reason});"
                  f" the reference implementation runs there instead (the same results, slower). `hybrid-engine bench "
                  f"kernels --check --device {device.type}` shows each op's error", RuntimeWarning,
                  stacklevel=user_stacklevel())


def failure(exc: BaseException) -> str:
    """A probe's reason for an exception: its type and first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def first_serving(module: str, device: torch.device, candidates: Mapping[str, Callable[[], Any]],
                  disagreement: Callable[[str, Any], str | None]) -> str:
    """The name of the first candidate whose build is not ``None`` and whose ``disagreement(name, built)`` is
    ``None`` on ``device``, else ``"reference"``; each one refused is passed to :func:`warn_fallback`."""
    for name, build in candidates.items():
        built = build()
        if built is None:
            continue
        reason = disagreement(name, built)
        if reason is None:
            return name
        warn_fallback(module, device, name, reason)
    return "reference"
