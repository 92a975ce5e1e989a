"""The one place DeepSpeed is imported: optional, and with its JIT-built C++ ops kept off.
"""

from __future__ import annotations

from typing import Any

__all__ = ["import_deepspeed"]


def import_deepspeed(needed_for: str | None = None) -> Any:
    """``deepspeed``, with its C++ ops that would be JIT-built on first use on a CPU turned off.

    ``needed_for`` says what needs it, for the ``ImportError`` when it is missing.
    """
    try:
        import deepspeed
    except ImportError as exc:
        what = needed_for or "zero_optimization.stage 1-3 trains on DeepSpeed"
        way_out = "" if needed_for else " (or use zero_optimization.stage 0)"
        raise ImportError(
            f"{what}, which is not installed; install it with `pip install 'hybrid-engine[deepspeed]'`{way_out}"
        ) from exc
    # The shared-memory CPU collective is a C++ op built at first use; plain torch.distributed does its job.
    compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    return deepspeed
