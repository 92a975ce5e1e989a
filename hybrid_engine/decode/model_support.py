"""Which models can decode on the engine's cache: the architectures known to, and a probe for the rest.

A model qualifies when its forward takes an external ``Cache``, writes every
layer's K/V through it, and its attention honours an explicit 4D additive mask.
Refusals are ``TypeError``/``ValueError`` naming the model and the fix, raised
before any work.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.layout import layout_refusal, linear_layers
from hybrid_engine.decode.linear_states import Shapes
from hybrid_engine.decode.npu_attention import NPU_GRAPH_ATTENTION
from hybrid_engine.decode.step import _forward_signature, decode_one_token, model_dtype, prefill

__all__ = ["SUPPORTED_ATTN_IMPLEMENTATIONS", "SUPPORTED_MODEL_TYPES", "check_model_supported", "max_positions",
           "state_shapes"]


SUPPORTED_MODEL_TYPES = ("gpt2", "opt", "llama", "qwen2", "qwen3", "mistral")


#: Attention implementations that honour an explicit 4D additive float mask ("npu_graph": see npu_attention).
SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", NPU_GRAPH_ATTENTION)


def _attn_implementation(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    return impl if isinstance(impl, str) or impl is None else str(impl)


def max_positions(config: Any) -> int | None:
    """The model's position limit (``max_position_embeddings``/``n_positions``/``n_ctx``), or ``None``."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


#: Models found supported, with what the finding depends on (:func:`_support_key`); a finding is reused while
#: that is unchanged. Weak: a model's entry goes with it.
_SUPPORTED: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def _support_key(model: torch.nn.Module) -> Any:
    """What :func:`check_model_supported` reads: the model's class and forward, its config (a deep copy of its
    fields, compared by value, so a field changed in place is seen), attention implementation, dtype and device."""
    param = next(model.parameters(), None)
    forward = getattr(model.forward, "__func__", model.forward)
    return (type(model), forward, copy.deepcopy(vars(model.config)), _attn_implementation(model),
            None if param is None else (param.dtype, param.device))


def check_model_supported(model: torch.nn.Module) -> None:
    """Raise ``TypeError``/``ValueError`` with a clear message unless ``model`` can run on a PagedKVCache.

    A model found supported is not checked again while its class, forward, config, attention implementation,
    dtype and device stay as they were (the check allocates a probe cache, and for a model type outside the
    known ones runs a probe forward: once per model, not per call).

    Requirements: a decoder-only HF model whose forward takes an external ``Cache``
    (``cache=``/``past_key_values=``) and an attention implementation that honours
    a 4D additive float mask (``eager``, ``sdpa`` or ``npu_graph``; not ``flash_attention_*``,
    ``flex_attention`` or paged variants). Architectures outside
    ``SUPPORTED_MODEL_TYPES`` are probed with a one-token forward.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"check_model_supported: expected a transformers PreTrainedModel, got {type(model).__name__}")
    try:
        key = _support_key(model)
        if _SUPPORTED.get(model) == key:
            return
    except Exception:  # a config field that cannot be copied or compared: check every time
        key = None
    _check_model(model)
    if key is not None:
        _SUPPORTED[model] = key


def _check_model(model: PreTrainedModel) -> None:
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__}: encoder-decoder models are not supported (decoder-only LMs only)")
    # Layers the cache cannot hold come first: the most specific reason (a state model's forward may also take
    # no cache, as Mamba's does on transformers 4.57).
    reason = layout_refusal(config)
    if reason is not None:
        raise ValueError(f"{type(model).__name__}: {reason}")
    impl = _attn_implementation(model)
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"{type(model).__name__}: attn_implementation={impl!r} cannot take the explicit 4D additive attention "
            f"mask the paged KV cache needs (per-row lengths); load the model with attn_implementation in "
            f"{SUPPORTED_ATTN_IMPLEMENTATIONS}"
        )
    _forward_signature(model)  # TypeError when the forward takes no cache
    try:
        PagedKVCache(config, 1, 2, device=next(model.parameters()).device, dtype=model_dtype(model))
    except ValueError as exc:
        raise ValueError(f"{type(model).__name__}: {exc}") from exc
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    device = next(model.parameters()).device
    probe = PagedKVCache(config, 1, 2, device=device, dtype=model_dtype(model))
    ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
    try:
        prefill(model, probe, ids, torch.ones_like(ids))
        decode_one_token(model, probe, ids[:, 0])
    except Exception as exc:
        raise TypeError(
            f"{type(model).__name__} (model_type={model_type!r}) rejected past_key_values=PagedKVCache: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    expected = 2 * sum(spec.key_dim > 0 for spec in probe.pool.layers)  # a prefill and a step, each attention layer
    if probe.num_updates != expected:
        raise TypeError(
            f"{type(model).__name__} (model_type={model_type!r}) did not write its keys/values through the "
            f"external cache ({probe.num_updates} of {expected} layer updates); it cannot use PagedKVCache"
        )


_SHAPES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, Shapes]] = weakref.WeakKeyDictionary()


def state_shapes(model: torch.nn.Module) -> Shapes:
    """Each linear-attention state's shape per row for ``model``, from a one-token prefill through a probe cache
    (cached per model and dtype)."""
    if not any(linear_layers(model.config)):
        return {}
    dtype = model_dtype(model)
    device = next(model.parameters()).device
    found = _SHAPES.get(model)
    if found is not None and found[0] == (dtype, device):
        return found[1]
    probe = PagedKVCache(model.config, 1, 2, device=device, dtype=dtype, state_shapes=None)  # made as written
    ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
    prefill(model, probe, ids, torch.ones_like(ids), checked=True)
    shapes = probe.states.store.shapes()
    _SHAPES[model] = ((dtype, device), shapes)
    return shapes
