"""One generation at a time per model: concurrent callers are serialised, never interleaved.

Why: a generate call owns mutable state for its whole duration. Its runner's
decode slots, static buffers and captured graphs; the model's train/eval mode,
which ``generate`` switches and restores; the RNG draws it makes. Two threads
interleaving calls on one engine, one rollout, or an engine and a rollout
built on it (they share the model and its mode) would silently trample each
other's slots and return wrong tokens, the one failure an RL user cannot
detect.

So every ``generate`` holds the model's lock: a second thread waits until the
first call returns and then gets exactly the answer it would have got alone.
A call that cannot be served, because the same thread is already inside a
``generate`` on this model (a forward hook or a callback calling back in),
raises a ``RuntimeError`` at once instead of deadlocking. The uncontended path
costs one lock acquire and release.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

__all__ = ["decode_grad_mode", "eval_for_generation", "exclusive_generation"]

_locks: weakref.WeakKeyDictionary[torch.nn.Module, tuple[threading.Lock, list[int | None]]] = (
    weakref.WeakKeyDictionary()
)
_table_lock = threading.Lock()


def _lock_of(model: torch.nn.Module) -> tuple[threading.Lock, list[int | None]]:
    entry = _locks.get(model)
    if entry is None:
        with _table_lock:
            entry = _locks.get(model)
            if entry is None:
                entry = _locks[model] = (threading.Lock(), [None])
    return entry


@contextlib.contextmanager
def exclusive_generation(model: torch.nn.Module, caller: str) -> Iterator[None]:
    """Hold ``model``'s generation lock for the block (see the module docstring)."""
    lock, owner = _lock_of(model)
    me = threading.get_ident()
    if owner[0] == me:
        raise RuntimeError(
            f"{caller}: this model is in use by a generate call already running in this thread (a forward hook "
            "or callback called generate from inside generate); generation cannot be nested: call it after the "
            "running one returns"
        )
    with lock:
        owner[0] = me
        try:
            yield
        finally:
            owner[0] = None


@contextlib.contextmanager
def decode_grad_mode() -> Iterator[None]:
    """No autograd and no inference mode, whatever the caller's: what a generation call runs under."""
    with torch.inference_mode(False), torch.no_grad():
        yield


@contextlib.contextmanager
def eval_for_generation(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) for the block; afterwards every submodule gets its own mode back
    (a submodule the caller had put in eval inside a training model stays in eval)."""
    modes = [(module, module.training) for module in model.modules()]
    if not any(training for _, training in modes):
        yield
        return
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
