"""Forward hooks under capture: captured, never dropped, and named when they cannot be captured.

A hook runs inside the captured step like any module code, so one that reads
the host fails the capture. :func:`attributed_hooks` wraps every hook during a
capture so the failure names the module and the hook (:class:`HookCaptureError`);
:func:`hook_fingerprint` is the hook set the runner refuses graphs for while it
stays registered. Hooks transformers and PEFT register for training only
(input-grad hooks) never run in a no-grad decode step and are left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.modules import module as _module_mod

__all__ = ["HookCaptureError", "attributed_hooks", "hook_fingerprint", "hook_registered"]


# Hook tables a forward consults: per module, and process-wide (``register_module_forward_hook``).
_HOOK_DICTS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook"}


_GLOBAL_HOOK_DICTS = {"_global_forward_pre_hooks": "global forward pre-hook",
                      "_global_forward_hooks": "global forward hook"}


class HookCaptureError(RuntimeError):
    """A forward (pre-)hook raised while a decode step was being captured."""

    def __init__(self, module_name: str, kind: str, hook: Callable[..., Any], cause: BaseException,
                 handle_id: int | None = None):
        self.module_name = module_name
        self.kind = kind
        self.handle_id = handle_id  # the hook's registration (RemovableHandle.id)
        self.hook_name = getattr(hook, "__qualname__", None) or type(hook).__name__
        super().__init__(
            f"the {kind} {self.hook_name!r} on module {module_name!r} cannot be captured into a graph "
            f"({type(cause).__name__}: {cause})"
        )


def _hook_tables(model: torch.nn.Module) -> Iterator[tuple[str, str, dict]]:
    """(module name, hook kind, hook dict) for every forward hook table that applies to ``model``."""
    for attr, kind in _GLOBAL_HOOK_DICTS.items():
        yield "<every module>", kind, getattr(_module_mod, attr)
    for name, m in model.named_modules():
        for attr, kind in _HOOK_DICTS.items():
            table = getattr(m, attr, None)
            if table:
                yield name or "<model>", kind, table


# The hook gradient checkpointing registers on the input embeddings (transformers'
# ``enable_input_require_grads``, PEFT's and TRL's copies) only marks the embedding output as requiring
# grad, which changes nothing under no_grad; TRL's trainers register one more at every training step.
_INERT_HOOK_NAMES = ("make_inputs_require_grads", "make_inputs_require_grad")


_INERT_HOOK_PACKAGES = ("transformers", "peft", "trl")


def _inert_for_generation(hook: Callable[..., Any]) -> bool:
    return (getattr(hook, "__name__", None) in _INERT_HOOK_NAMES
            and str(getattr(hook, "__module__", "")).partition(".")[0] in _INERT_HOOK_PACKAGES)


def hook_fingerprint(model: torch.nn.Module) -> tuple:
    """Which forward hooks and pre-hooks are registered, where: changes when one is added or removed
    (except the input-require-grads hooks of gradient checkpointing, which generation cannot see)."""
    return tuple(
        (where, kind, handle_id, id(hook))
        for where, kind, table in _hook_tables(model)
        for handle_id, hook in table.items()
        if not _inert_for_generation(hook)
    )


def hook_registered(model: torch.nn.Module, handle_id: int | None) -> bool:
    """Whether the hook registered under ``handle_id`` still applies to ``model``."""
    return any(handle_id in table for _, _, table in _hook_tables(model))


def _attributed(hook: Callable[..., Any], where: str, kind: str, handle_id: int) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except HookCaptureError:
            raise
        except Exception as exc:
            raise HookCaptureError(where, kind, hook, exc, handle_id) from exc

    return run


@contextlib.contextmanager
def attributed_hooks(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs, an exception raised inside a forward hook becomes a :class:`HookCaptureError`.

    It names the module, so the runner can refuse graphs with a reason the user
    can act on instead of a bare capture error.

    The hooks still run (they are captured); each one is wrapped in place, under
    its own handle id, so keyword/always-call flags keep applying, and restored
    on exit.
    """
    saved = []
    for where, kind, table in _hook_tables(model):
        for handle_id, hook in list(table.items()):
            saved.append((table, handle_id, hook))
            table[handle_id] = _attributed(hook, where, kind, handle_id)
    try:
        yield
    finally:
        for table, handle_id, hook in saved:
            if handle_id in table:
                table[handle_id] = hook
