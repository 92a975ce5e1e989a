"""What a decoder config's layers cache and mask, and how long a sequence the paged cache reproduces exactly.

The paged cache holds each layer's K/V (or, for MLA, the latent transformers
caches) with positions applied once, when a token is written, and a key's
logical index in its row is its position. Read from the config, never by
running the model:

* what each layer caches per token (:func:`layer_specs`);
* how each kind of layer masks its keys (:func:`attention_kinds`): sliding
  windows and Llama 4's chunks become masks, one per layer kind, built on the
  device at every step, so they are captured like any other mask;
* what no mask can carry (:func:`exact_length`): GPT-Neo's local layers window
  from the key count the cache returns, and ``longrope`` switches factors past
  ``original_max_position_embeddings`` (transformers then recomputes the
  history). Up to that length the result is exact, so it bounds the sequence a
  row may reach instead of refusing the model;
* which layers are linear attention (:func:`linear_layers`: a per-row state,
  :mod:`hybrid_engine.decode.linear_states`, instead of K/V);
* layouts the cache cannot hold (state-space layers, ALiBi; the state families on
  a transformers without the linear-attention cache API, as 4.57), refused in
  one sentence that names what is missing (:func:`layout_refusal`).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, NamedTuple

import transformers
from transformers import PretrainedConfig

from hybrid_engine.decode.kv_pool import LayerSpec

__all__ = ["AttentionKind", "LengthLimit", "attention_kinds", "attention_layers", "cache_geometry", "exact_length",
           "layer_specs", "layout_refusal", "linear_layers"]

#: Layer kinds (``config.layer_types``) whose K/V the paged cache holds; windowed ones up to their window.
ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


#: Layer kinds that cache nothing (feed-forward blocks listed among the layers, as Nemotron-H does).
STATELESS_LAYER_KINDS = ("mlp", "moe")

#: Layer kinds that keep a per-row state through transformers' linear-attention cache API (5.x), which the
#: paged cache holds per row (:mod:`hybrid_engine.decode.linear_states`).
LINEAR_LAYER_KINDS = ("linear_attention", "conv")
#: Layer kinds with both: attention K/V and a linear-attention state (Falcon-H1's and Zamba2's parallel blocks).
HYBRID_LAYER_KINDS = ("hybrid",)
#: The families whose state layers (gated delta rule, Mamba/Mamba-2 mixers, short convolutions) are verified on it
#: against transformers. Others (Kimi-Linear, MiniMax, ...) stay refused until tested: each drives the cache its
#: own way.
LINEAR_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid",
                      "nemotron_h", "jamba", "bamba", "granitemoehybrid", "falcon_h1", "zamba", "zamba2", "lfm2", "lfm2_moe",
                      "mamba", "mamba2", "falcon_mamba")


class AttentionKind(NamedTuple):
    """How one kind of layer masks its keys: all earlier ones, the last ``window`` positions (sliding), or the
    query's ``chunk`` (chunked, as Llama 4)."""

    window: int | None = None
    chunk: int | None = None


FULL = AttentionKind()


class LengthLimit(NamedTuple):
    """The longest sequence (``tokens``) the paged cache reproduces exactly, and ``why``, naming the field."""

    tokens: int
    why: str


def _text_config(config: PretrainedConfig) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layout_refusal(config: PretrainedConfig) -> str | None:
    """Why the paged K/V cache cannot hold ``config``'s layers at all, in one sentence; ``None`` when it can."""
    config = _text_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type in LINEAR_MODEL_TYPES and not _linear_cache_api():
        # 4.57's state models keep their states in cache classes of their own and list their layers otherwise
        # (or not at all), so this comes before the layer kinds, which would misread them.
        return (f"model_type {model_type!r} has state layers (linear attention, Mamba mixers or short "
                "convolutions), whose per-row state the paged cache holds through transformers' linear-attention "
                f"cache API, which needs transformers >= 5; transformers {transformers.__version__} has none")
    layer_types = getattr(config, "layer_types", None) or ()
    kinds = sorted({k for k in layer_types
                    if k not in ATTENTION_LAYER_KINDS + STATELESS_LAYER_KINDS + LINEAR_LAYER_KINDS + HYBRID_LAYER_KINDS})
    if kinds:
        return (f"model_type {model_type!r} has layers of kind {', '.join(map(repr, kinds))} (config.layer_types), "
                "which keep a recurrent or convolution state per sequence that the paged K/V cache does not hold")
    linear = sorted({k for k in layer_types if k in LINEAR_LAYER_KINDS + HYBRID_LAYER_KINDS})
    if linear and model_type not in LINEAR_MODEL_TYPES:
        return (f"model_type {model_type!r} has layers of kind {', '.join(map(repr, linear))} (config.layer_types), whose "
                "per-sequence state the paged K/V cache does not hold: it holds linear-attention states only for "
                f"the families verified against transformers ({', '.join(LINEAR_MODEL_TYPES)})")
    if not isinstance(getattr(config, "num_attention_heads", None), int) and not (
            layer_types and all(linear_layers(config)) and model_type in LINEAR_MODEL_TYPES):
        return (f"model_type {model_type!r} has no attention heads (no config.num_attention_heads): its layers keep "
                "a state-space or recurrent state that the paged K/V cache does not hold")
    if getattr(config, "alibi", False) or model_type == "bloom":
        return (f"model_type {model_type!r} uses ALiBi position biases, which transformers builds from a 2-D "
                "attention mask; the paged cache passes a 4-D mask, so ALiBi models are not supported")
    return None


def _linear_cache_api() -> bool:
    from transformers import cache_utils

    return hasattr(cache_utils, "LinearAttentionCacheLayerMixin")


def attention_layers(config: PretrainedConfig) -> list[bool]:
    """Per layer, whether it caches K/V (not a linear-attention or a feed-forward layer listed among the layers)."""
    config = _text_config(config)
    layer_types = list(getattr(config, "layer_types", None) or ())
    return [i >= len(layer_types) or layer_types[i] not in LINEAR_LAYER_KINDS + STATELESS_LAYER_KINDS
            for i in range(int(config.num_hidden_layers))]


def linear_layers(config: PretrainedConfig) -> list[bool]:
    """Per layer, whether it keeps a linear-attention state per row (a linear layer, or a hybrid one beside its
    K/V)."""
    config = _text_config(config)
    layer_types = list(getattr(config, "layer_types", None) or ())
    stateful = LINEAR_LAYER_KINDS + HYBRID_LAYER_KINDS
    # num_hidden_layers decides: a config edited after construction may carry a longer layer_types
    return [i < len(layer_types) and layer_types[i] in stateful for i in range(int(config.num_hidden_layers))]


def cache_geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder config; ``ValueError`` for a layout with no K/V."""
    reason = layout_refusal(config)
    if reason is not None:
        raise ValueError(reason)
    config = _text_config(config)
    num_layers = int(config.num_hidden_layers)
    if not any(attention_layers(config)):
        return num_layers, 1, 0  # state-space layers only (Mamba): no K/V at all
    num_heads = int(config.num_attention_heads)
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        num_kv_heads = 1  # Falcon-7B's and GPTBigCode's multi-query layout: one K/V head for all queries
    else:
        num_kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) \
            or num_heads
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // num_heads
    return num_layers, int(num_kv_heads), int(head_dim)


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Per layer, the keys a query sees at most (its sliding window or chunk), ``None`` for full attention."""
    config = _text_config(config)
    kinds = attention_kinds(config)
    layer_types = list(getattr(config, "layer_types", None) or ())
    out: list[int | None] = []
    for i in range(int(config.num_hidden_layers)):
        kind = kinds.get(None) if None in kinds else kinds.get(layer_types[i] if i < len(layer_types) else None)
        out.append(None if kind is None else (kind.window or kind.chunk))
    return out


def layer_specs(config: PretrainedConfig, capacity: int | None = None) -> list[LayerSpec]:
    """What each layer of ``config``'s decoder caches per token, as transformers' modeling code writes it.
    Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...: ``kv_lora_rank``) writes its compressed latent
    and rotated key part, one head each, where the modeling code expands K/V after the cache; otherwise keys of
    ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim`` per head.

    With ``capacity`` (the rows' longest sequence), windowed layers keep a ring of their window per row instead
    of pages where every window is at most half of it (``LayerSpec.ring``); else every layer is paged."""
    specs = _paged_specs(config)
    windows = layer_windows(config)
    if capacity is None or not any(windows) or any(w and 2 * w > capacity for w in windows):
        return specs
    return [spec._replace(ring=w) if w else spec for spec, w in zip(specs, windows)]


def _paged_specs(config: PretrainedConfig) -> list[LayerSpec]:
    num_layers, heads, head_dim = cache_geometry(config)
    text = _text_config(config)
    if getattr(text, "kv_lora_rank", None) and getattr(text, "qk_nope_head_dim", None) is not None:
        if _caches_latent(str(getattr(text, "model_type", ""))):
            return [LayerSpec(1, int(text.kv_lora_rank), int(text.qk_rope_head_dim))] * num_layers
        key_dim = int(text.qk_nope_head_dim) + int(text.qk_rope_head_dim)
        return [LayerSpec(heads, key_dim, int(text.v_head_dim))] * num_layers
    return [LayerSpec(heads, head_dim, head_dim) if attends else LayerSpec(heads, 0, 0)
            for attends in attention_layers(config)]


@functools.cache
def _caches_latent(model_type: str) -> bool:
    """Whether the installed transformers' modeling code for ``model_type`` caches MLA's compressed latent (its
    attention expands K/V after the cache, ``expand_kv``) rather than per-head K and V. A layout guessed wrong
    is refused by the cache's shape check at the first write, never run."""
    model_type = model_type.replace("-", "_")
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return False
    return any(isinstance(c, type) and callable(getattr(c, "expand_kv", None)) for c in vars(module).values())


def _rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE scaling dict: ``rope_parameters`` (transformers 5.x) or ``rope_scaling`` (4.57)."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            return value
    return {}


def attention_kinds(config: PretrainedConfig) -> dict[str | None, AttentionKind | None]:
    """The masks a forward of ``config``'s model takes: ``{None: kind}`` for one mask for every layer, else one
    per ``config.layer_types`` entry, as transformers' models with mixed layers take a dict of masks. A linear
    layer's kind is ``None``: it takes the 2-D padding mask (or none), not a 4-D one."""
    config = _text_config(config)
    window = getattr(config, "sliding_window", None) or None
    chunk = getattr(config, "attention_chunk_size", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds: dict[str | None, AttentionKind | None] = {
            t: AttentionKind(int(window) if window and "sliding" in t else None,
                             int(chunk) if chunk and "chunked" in t else None)
            for t in dict.fromkeys(layer_types) if t in ATTENTION_LAYER_KINDS}
        kinds.update({t: None for t in dict.fromkeys(layer_types) if t in LINEAR_LAYER_KINDS})
        if any(t in HYBRID_LAYER_KINDS for t in layer_types):  # such a block takes both masks, by these names
            kinds = {"full_attention": FULL, **kinds, "linear_attention": None}
        return kinds if any(k != FULL for k in kinds.values()) else {None: FULL}
    if window and getattr(config, "use_sliding_window", True) is not False:
        return {None: AttentionKind(window=int(window))}  # every layer slides (Mistral, Starcoder2, Phi-3)
    return {None: FULL}


def exact_length(config: PretrainedConfig) -> LengthLimit | None:
    """The longest sequence full attention over the paged cache reproduces exactly for ``config``, or ``None``
    when there is no such limit (the model's position limit still applies)."""
    config = _text_config(config)
    limits: list[LengthLimit] = []
    layer_types = getattr(config, "layer_types", None)
    local = getattr(config, "window_size", None)
    if local and "local" in (getattr(config, "attention_layers", None) or ()):
        limits.append(LengthLimit(int(local), f"local attention layers (window_size {int(local)})"))
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and not (layer_types and any("chunked" in t for t in layer_types)):  # no layer to mask it on
        limits.append(LengthLimit(int(chunk), f"chunked attention (attention_chunk_size {int(chunk)})"))
    rope = _rope_parameters(config)
    if (rope.get("rope_type") or rope.get("type")) == "longrope":
        switch = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                          None)
        if switch:
            limits.append(LengthLimit(int(switch), f"longrope RoPE scaling (its factors switch past "
                                                   f"original_max_position_embeddings {int(switch)})"))
    return min(limits, default=None)
