"""One call at a time per model: generations, and the engine's training calls, are serialised, never interleaved.

Why: a generate call owns mutable state for its whole duration. Its runner's
decode slots, static buffers and captured graphs; the model's train/eval mode,
which ``generate`` switches and restores; the weights it reads at every
position; the RNG draws it makes. Two threads interleaving calls on one
engine, one rollout, or an engine and a rollout built on it (they share the
model and its mode) would silently trample each other's slots and return wrong
tokens, the one failure an RL user cannot detect. A training thread is the same
hazard from the other side: its forward would run in the eval mode generate had
set (no dropout), its ``engine.train()`` would switch dropout on in the middle
of a prefill, and its optimizer step would change the weights under a decode,
so the rollout would come from half-updated weights.

So every ``generate`` and every training entry point of the engine
(``engine(...)``/``forward``, ``backward``, ``step``, ``train``/``eval``) holds
the model's lock: a caller from another thread waits its turn, then runs
exactly as it would alone. Waiting, not raising, because generate calls already
waited for each other, and a trainer that overlaps rollouts with training in
two threads wants a correct order, not an error to retry. The lock is first come,
first served (a tight training loop cannot starve a waiting generation). A call that
cannot be served, because the same thread is already inside a call on this model
(a forward hook or a callback calling back in), raises a ``RuntimeError`` naming
both calls at once instead of deadlocking. The uncontended path costs two
acquires and releases of a plain lock.

Waiting orders the calls within one process only: under ZeRO-3 over several
ranks, generation and training are collectives, and threads must issue them in
the same order on every rank.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

__all__ = ["decode_grad_mode", "eval_for_generation", "exclusive_model_call"]


class _ModelLock:
    """A first-come-first-served lock that knows which thread holds it, and for which call."""

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._owner: tuple[int, str] | None = None
        self._queue: collections.deque[object] = collections.deque()

    @contextlib.contextmanager
    def hold(self, caller: str) -> Iterator[None]:
        me = threading.get_ident()
        with self._condition:
            if self._owner is not None and self._owner[0] == me:
                running = self._owner[1]
                kind = "generate" if running.endswith("generate") else "a training call"
                raise RuntimeError(
                    f"{caller}: this model is in use by {running}, already running in this thread (a forward hook "
                    f"or callback called back in from inside {kind}); calls on one model cannot be nested: call "
                    f"{caller} after {running} returns")
            ticket = object()
            self._queue.append(ticket)
            try:
                while self._owner is not None or self._queue[0] is not ticket:
                    self._condition.wait()
            except BaseException:  # interrupted while waiting: leave the queue to the others
                self._queue.remove(ticket)
                self._condition.notify_all()
                raise
            self._queue.popleft()
            self._owner = (me, caller)
        try:
            yield
        finally:
            with self._condition:
                self._owner = None
                self._condition.notify_all()


_locks: weakref.WeakKeyDictionary[torch.nn.Module, _ModelLock] = weakref.WeakKeyDictionary()
_table_lock = threading.Lock()


def _lock_of(model: torch.nn.Module) -> _ModelLock:
    lock = _locks.get(model)
    if lock is None:
        with _table_lock:
            lock = _locks.get(model)
            if lock is None:
                lock = _locks[model] = _ModelLock()
    return lock


@contextlib.contextmanager
def exclusive_model_call(model: torch.nn.Module, caller: str) -> Iterator[None]:
    """Hold ``model``'s lock for the block, as ``caller`` (see the module docstring): generations and the
    engine's training calls on ``model`` run one at a time."""
    with _lock_of(model).hold(caller):
        yield


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
