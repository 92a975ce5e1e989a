"""Generation from ZeRO-3 partitioned parameters: gathered whole for the call, ZeRO-3's module hooks off.

A parameter outside a gather is a 0-element shard and every gather allocates
anew, so graphs are refused here (:mod:`hybrid_engine.graphs.policy`). The one
collective is the all-gather when a call starts, on every rank; the forwards
that follow are local, so ranks finishing at different lengths never wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from hybrid_engine.distributed.deepspeed_import import import_deepspeed
from hybrid_engine.model_access import is_zero3_partitioned

__all__ = ["gathered_for_inference"]


@contextlib.contextmanager
def gathered_for_inference(module: nn.Module) -> Iterator[None]:
    """Run the block with ``module``'s ZeRO-3 parameters gathered whole (no-op for other modules).

    Collective: every rank must enter it. Inside, the parameters are marked
    persistent, and ZeRO-3's per-module fetch/release hooks are taken off
    (:func:`_without_zero3_module_hooks`), so each forward is local to its rank
    and pays nothing for parameter bookkeeping.
    """
    if not is_zero3_partitioned(module):
        yield
        return
    deepspeed = import_deepspeed()
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        persist = [p.ds_persist for p in params]
        for p in params:
            p.ds_persist = True
        try:
            with _without_zero3_module_hooks(module):
                yield
        finally:
            for p, keep in zip(params, persist):
                p.ds_persist = keep


def _zero3_offload(module: nn.Module) -> Any | None:
    """DeepSpeed's ZeRO-3 parameter offload object whose hooks sit on ``module``'s submodules, if any.

    Found through the hooks themselves (each closes over it, under DeepSpeed's wrappers), so a bare
    transformers model works as well as a DeepSpeed engine's.
    """
    seen: set[int] = set()

    def search(fn: Any, depth: int = 0) -> Any | None:
        if depth > 4 or id(fn) in seen:
            return None
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if all(hasattr(value, a) for a in ("forward_hooks", "backward_hooks", "fwd_pre_hook")):
                return value
            if callable(value):
                found = search(value, depth + 1)
                if found is not None:
                    return found
        wrapped = getattr(fn, "__wrapped__", None)
        return search(wrapped, depth + 1) if wrapped is not None else None

    for sub in module.modules():
        for hook in (*sub._forward_pre_hooks.values(), *sub._forward_hooks.values()):
            found = search(hook)
            if found is not None:
                return found
    return None


@contextlib.contextmanager
def _without_zero3_module_hooks(module: nn.Module) -> Iterator[None]:
    """ZeRO-3's fetch/release hooks off every submodule for the block, then back in their places.

    With the parameters gathered and persistent they have nothing to do, yet
    their bookkeeping runs at every module of every forward: with many small
    modules (LoRA adapters) it cost 10-100x the decode itself. TRL takes them
    off for generation the same way. Only the hooks of DeepSpeed's parameter
    offload are taken (by their handles); every other hook stays, in order.
    """
    offload = _zero3_offload(module)
    if offload is None:
        yield
        return
    handles = [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]
    ids = {h.id for h in handles if h is not None}
    taken: list[tuple[dict, list, dict]] = []
    for sub in module.modules():
        for table in (sub._forward_pre_hooks, sub._forward_hooks):
            ours = {k: h for k, h in table.items() if k in ids}
            if ours:
                taken.append((table, list(table), ours))
                for k in ours:
                    del table[k]
    try:
        yield
    finally:
        for table, order, ours in taken:
            added = {k: h for k, h in table.items() if k not in order}  # registered inside the block
            kept = {k: ours[k] if k in ours else table[k] for k in order if k in ours or k in table}
            table.clear()
            table.update(kept)
            table.update(added)
