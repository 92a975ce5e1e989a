"""The one place DeepSpeed is imported: optional, and with its JIT-built C++ ops kept off.

It also keeps DeepSpeed's own ``deepspeed.initialize`` reachable when a script has replaced
that attribute with :func:`hybrid_engine.initialize` (the literal drop-in): the engine builds
its ZeRO backend with :func:`deepspeed_initialize`, never through the module attribute, which
would call the engine's own ``initialize`` again and recurse.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["REPLACES_DEEPSPEED_INITIALIZE", "deepspeed_initialize", "import_deepspeed", "remember_initialize"]

#: Attribute set on :func:`hybrid_engine.initialize` (``functools.wraps`` copies it to a wrapper): a function
#: carrying it is not DeepSpeed's ``initialize``.
REPLACES_DEEPSPEED_INITIALIZE = "__hybrid_engine_replaces_deepspeed_initialize__"

_original_initialize: Callable[..., Any] | None = None


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
    remember_initialize()
    return deepspeed


def remember_initialize() -> None:
    """Keep ``deepspeed.initialize`` while it is still DeepSpeed's own (when ``deepspeed`` is imported already)."""
    global _original_initialize
    deepspeed = sys.modules.get("deepspeed")
    fn = getattr(deepspeed, "initialize", None)
    if _original_initialize is None and callable(fn) and not getattr(fn, REPLACES_DEEPSPEED_INITIALIZE, False):
        _original_initialize = fn


def deepspeed_initialize(deepspeed: Any) -> Callable[..., Any]:
    """DeepSpeed's own ``initialize``, even when ``deepspeed.initialize`` was replaced by ours.

    Kept from the first time it was seen unreplaced; otherwise (``deepspeed`` imported and patched before
    hybrid_engine first looked) rebuilt from its definition in ``deepspeed/__init__.py``, in that module's
    namespace."""
    global _original_initialize
    remember_initialize()
    if _original_initialize is not None:
        return _original_initialize
    with open(deepspeed.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=deepspeed.__file__)
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "initialize"]
    if not defs:
        raise RuntimeError("deepspeed.initialize has been replaced by hybrid_engine.initialize and DeepSpeed's own "
                           f"could not be found in {deepspeed.__file__}; import hybrid_engine before replacing it")
    namespace = dict(vars(deepspeed))  # its globals (DeepSpeedEngine, dist, ...), read when it runs
    exec(compile(ast.Module(body=defs, type_ignores=[]), deepspeed.__file__, "exec"), namespace)  # noqa: S102
    _original_initialize = namespace["initialize"]
    return _original_initialize
