"""The exact mode: the training forward and the decode steps run the same batch-invariant kernels.

Why: a rollout's logprob for a token is bit-for-bit the training forward's
only if both sides compute every contraction with the same reduction order,
whatever the batch. Two switches make that so, and nothing else changes:

* :func:`exact_kernels` (a whole generate call, or a training forward)
  switches the model's ``_attn_implementation`` to :data:`EXACT_ATTENTION`
  (registered with transformers' attention and mask interfaces on import):
  the fixed-block attention, reading transformers' additive float masks;
* :func:`exact_ops`, a ``TorchFunctionMode`` entered around each model
  forward under that attention (:mod:`hybrid_engine.decode.step` and
  :func:`exact_forward` enter it), sends ``F.linear`` and ``torch.addmm``
  (GPT-2's ``Conv1D``) to :mod:`hybrid_engine.exact.kernels`. Only around
  forwards: the scheduler's host code keeps torch's plain dispatch.

Norms, softmax and ``log_softmax`` reduce within a row already. Graphs
captured under the mode record its kernels (the attention implementation is
part of a graph's fingerprint, so a graph of one mode never replays in the
other). Gradients flow through the kernels, with the usual formulas.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hybrid_engine.exact.chunks import NoInvariantChunk, chunk_rows, heads_invariant
from hybrid_engine.exact.kernels import (
    attention_calls,
    block_attention,
    exact_addmm,
    exact_linear,
    recorded_heads,
)
from hybrid_engine.exact.rows import packed_forward
from hybrid_engine.model_access import attention_implementation, decode_model

__all__ = ["EXACT_ATTENTION", "check_exact_support", "exact_forward", "exact_kernels", "exact_ops", "register",
           "uses_exact_attention"]

#: The attention implementation name the exact mode registers with transformers.
EXACT_ATTENTION = "hybrid_exact"


class _ExactOps(TorchFunctionMode):
    """Routes the row-mixing matmuls of a forward to their batch-invariant versions."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return exact_linear(*args, **kwargs)
        if func is torch.addmm and "out" not in kwargs and args[1].dim() == 2:
            return exact_addmm(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def exact_kernels(model: torch.nn.Module | None, enabled: bool = True) -> Iterator[None]:
    """Run the block with ``model``'s attention switched to :data:`EXACT_ATTENTION` (``enabled=False``: as it
    is). Its forwards run under :func:`exact_ops` (the decode steps enter it where the attention says so)."""
    if not enabled:
        yield
        return
    if model is not None:  # a mode switched on after the model was checked (a config changed since) is refused too
        _check_layer_kinds(decode_model(model))
    _probe_chunks(model)  # before the block: the probe reads results, which no capture may
    with attention_implementation(getattr(model, "config", None), EXACT_ATTENTION):
        yield


def exact_ops() -> _ExactOps:
    """The block's ``F.linear`` and ``torch.addmm`` calls run row-invariant (one model forward: scheduling code
    around it keeps torch's dispatch without a Python hop per op)."""
    return _ExactOps()


def uses_exact_attention(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs under :func:`exact_kernels` now."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == EXACT_ATTENTION


def exact_forward(model: torch.nn.Module, *args: Any, forward: Callable[..., Any] | None = None,
                  **kwargs: Any) -> Any:
    """``model(*args, **kwargs)`` as the exact mode's training forward: batch-invariant kernels, rows packed so a
    token's column is its position (:func:`~hybrid_engine.exact.rows.packed_forward`), ``logits`` returned in
    the caller's columns. Gradients flow. ``forward`` runs instead of ``model`` (the engine passes its training
    backend's). A rollout with ``exact_logprobs`` reports, for each response token, exactly
    ``logprobs_of(exact_forward(model, ...).logits, ...)`` at that token."""
    inner = decode_model(model)
    if args:  # positional order differs between models (GPT-2 takes past_key_values second): bind by name
        signature = inspect.signature(inner.forward)
        named: dict[str, Any] = {}
        for name, value in signature.bind_partial(*args, **kwargs).arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
        kwargs = named
    keep = kwargs.pop("logits_to_keep", 0)  # of the caller's columns, not the packed ones
    kwargs.setdefault("use_cache", False)  # a cache of packed rows would not be the caller's
    before = attention_calls()
    with exact_kernels(inner), exact_ops():
        out = packed_forward(forward if forward is not None else model, **kwargs)
    if attention_calls() == before:
        raise ValueError(_bypassed(inner))
    if isinstance(keep, int) and keep > 0:
        out.logits = out.logits[:, -keep:]
    elif isinstance(keep, torch.Tensor):
        out.logits = out.logits[:, keep]
    return out


#: Layer kinds whose every product the exact kernels replace (attention and linears; feed-forward blocks).
_EXACT_LAYER_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "mlp", "moe"}


def _check_layer_kinds(inner: torch.nn.Module) -> None:
    """Refuse layers the exact kernels do not cover (from the config: no forward, so every switch can ask)."""
    other = sorted(set(getattr(getattr(inner, "config", None), "layer_types", None) or ()) - _EXACT_LAYER_KINDS)
    if other:  # linear attention's chunked prefill and per-token recurrence sum in different orders
        kind = getattr(inner.config, "model_type", type(inner).__name__)
        raise ValueError(f"exact_logprobs: {kind}'s layers of kind {', '.join(map(repr, other))} have no "
                         "batch-invariant kernels; turn exact_logprobs off for this model")


def check_exact_support(model: torch.nn.Module) -> None:
    """Refuse, with a ``ValueError`` that names the model type, a model whose attention does not go through
    transformers' attention interface (the exact kernels would not run there), or whose attention heads have a
    size at which this machine's products are not row-invariant; one one-token forward."""
    inner = decode_model(model)
    _check_layer_kinds(inner)
    _probe_chunks(inner)  # raises NoInvariantChunk (a ValueError) where this machine has no invariant chunk
    before = attention_calls()
    device = next(inner.parameters()).device
    training = inner.training
    inner.eval()  # no dropout in the probe
    try:
        with torch.no_grad(), exact_kernels(inner), exact_ops(), recorded_heads() as heads:
            inner(input_ids=torch.zeros(1, 1, dtype=torch.int64, device=device), use_cache=False)
    finally:
        inner.train(training)
    if attention_calls() == before:
        raise ValueError(_bypassed(inner))
    for key_dim, value_dim in sorted(heads):
        if not heads_invariant(key_dim, value_dim):  # the probe covers heads of 16 to 128; this model's own here
            kind = getattr(getattr(inner, "config", None), "model_type", type(inner).__name__)
            size = f"{key_dim}" if key_dim == value_dim else f"{key_dim} (keys) / {value_dim} (values)"
            raise NoInvariantChunk(
                f"exact_logprobs: {kind}'s attention heads of size {size} (head_dim) give other bits for the same "
                "row in batches of other sizes on this machine's matmul kernels, so its logprobs cannot be made "
                "exact here; turn exact_logprobs off for this model")


def _bypassed(model: torch.nn.Module) -> str:
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return (f"exact_logprobs: {kind}'s attention does not run through transformers' attention interface, so the "
            "exact kernels cannot replace it; turn exact_logprobs off for this model")


def _probe_chunks(model: torch.nn.Module | None) -> None:
    param = next(model.parameters(), None) if model is not None else None
    chunk_rows(param.dtype if param is not None and param.is_floating_point() else torch.float32)
    chunk_rows()


def _exact_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' eager (additive float) mask, which :func:`~hybrid_engine.exact.kernels.block_attention`
    reads; passed through unchanged (the arguments differ between transformers 4.57 and 5.x)."""
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionMaskInterface._global_mapping["eager"](*args, **kwargs)


def register() -> None:
    """Register :data:`EXACT_ATTENTION` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(EXACT_ATTENTION, block_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, _exact_mask)


register()
