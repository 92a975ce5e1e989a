"""The fused decode forward: one token per row through a llama / mistral / qwen2 / qwen3 model in 14 device ops a
layer (16 with qwen3's q/k norms), not transformers' 42.

Why: a captured step still launches every kernel transformers' modules launch (16 for two RMSNorms, 10 for rotary,
a [B, span] mask, the span gathered out of the pool). This forward walks the same modules' parameters with the
layer ops of :mod:`hybrid_engine.decode.ops.layer_ops` (``add_rms_norm``, ``rms_norm``, ``rotary_qk``,
``silu_mul``) and the paged attention op (:mod:`hybrid_engine.decode.ops.paged_attention`), one custom op each,
and writes K/V through the cache's own ``update``. A layer is then: q/k/v projections (qwen3: two per-head
RMSNorms), rotary, two K/V writes, attention over the row's pages, o projection, add+RMSNorm, gate and up
projections, SiLU·mul, down projection, and the next norm fused with the residual add (the first layer's input
norm runs before the layers, the final norm ends the last one).

What it keeps from the model:

* every projection, the embedding and the LM head are *called as modules* (``q_proj(x)``, not ``x @ weight``), so
  PEFT/LoRA layers, their hooks and any quantized linear run as the user set them up; norms' weights and epsilons
  are read off the norm modules;
* rotary cos/sin come from the model's own rotary module, computed once per cache for positions ``0..capacity``
  into one table (:meth:`~hybrid_engine.decode.kv_cache.PagedKVCache.step_table`: kept with the cache, never
  when made during a capture) and looked up per step with one index op, so every static rope scaling type is
  right; the dynamic types, which change frequencies with the batch's longest position, are refused.

What it bypasses, and so refuses to run over (:func:`fused_decode_refusal`): hooks or replaced ``forward`` on the
norms, rotary, attention, MLP, decoder layers and model, subclasses of transformers' modules, windowed or
chunked layers, windowed rings and state layers, activations other than SiLU, the exact mode (its own kernels),
Llama's ``pretraining_tp > 1``, ZeRO-3 partitioned parameters and autocast. Prefill, extend and training
forwards keep transformers' modules.

Numerics: the layer ops' reference implementations are transformers' math, op for op; attention's reference is
a gather + SDPA with a length mask. On the CPU the fused path therefore agrees with transformers' forward within
rounding (teacher-forced logprobs within 1e-5, fp32), not bit for bit: it is off there unless asked for
(``hybrid_engine.fused_decode``, :func:`resolve_fused_decode`). Graph and eager steps run the same ops, so their
tokens are equal bit for bit.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any

import torch
from torch.nn.modules import module as _module_mod

from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.layout import FULL, AttentionKind, attention_kinds
from hybrid_engine.decode.ops import layer_ops, paged_attention
from hybrid_engine.decode.ops.layer_ops import add_rms_norm, rms_norm, rotary_qk, silu_mul
from hybrid_engine.decode.ops.paged_attention import PagedRead, paged_decode_attention
from hybrid_engine.exact.mode import uses_exact_attention
from hybrid_engine.model_access import decode_model, is_zero3_partitioned
from hybrid_engine.user_warnings import user_stacklevel

__all__ = ["FUSED_MODEL_TYPES", "FusedDecoderLayer", "fused_decode_forward", "fused_decode_refusal",
           "fused_decode_supported", "fused_kernels_available", "resolve_fused_decode"]

#: Model families whose decoder layers the fused forward reproduces.
FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: Rope types whose frequencies depend on the batch's longest position (transformers' ``dynamic_rope_update``).
_DYNAMIC_ROPE = ("dynamic", "longrope")
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------ support
def _bypassed(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module whose own forward the fused path does not run."""
    base = model.model
    out = [("<model>", model), ("model", base), ("model.norm", base.norm), ("model.rotary_emb", base.rotary_emb)]
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn
        out += [(f"model.layers.{i}", layer), (f"model.layers.{i}.self_attn", attn),
                (f"model.layers.{i}.mlp", layer.mlp), (f"model.layers.{i}.mlp.act_fn", layer.mlp.act_fn)]
        out += [(f"model.layers.{i}.{n}", getattr(layer, n)) for n in _LAYER_NORMS]
        out += [(f"model.layers.{i}.self_attn.{n}", getattr(attn, n)) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    return out


def _layers(model: torch.nn.Module) -> Any:
    return itertools.islice(model.model.layers, model.config.num_hidden_layers)


def _structure_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` lacks the modules the fused forward reads, or ``None``."""
    base = getattr(model, "model", None)
    if base is None or any(not hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        return "it lacks model.model.{embed_tokens, layers, norm, rotary_emb} or lm_head"
    if len(base.layers) < model.config.num_hidden_layers:
        return "it has fewer decoder layers than config.num_hidden_layers"
    for i, layer in enumerate(_layers(model)):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        missing = [n for n in _ATTENTION_PROJECTIONS if not hasattr(attn, n)]
        missing += [n for n in (*_MLP_PROJECTIONS, "act_fn") if not hasattr(mlp, n)]
        missing += [n for n in _LAYER_NORMS if not hasattr(layer, n)]
        if missing or not hasattr(attn, "scaling") or not hasattr(attn, "head_dim"):
            return f"decoder layer {i} lacks {', '.join(missing) or 'self_attn.scaling/head_dim'}"
    return None


def _module_refusal(model: torch.nn.Module) -> str | None:
    """Why a module the fused path bypasses would not behave as transformers' own (hooks, a replaced forward,
    a subclass, an activation other than SiLU, a rope whose frequencies follow the batch), or ``None``."""
    if _module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks:
        return "a global forward hook is registered (register_module_forward_hook), which the fused path would skip"
    for name, m in _bypassed(model):
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{name} has a forward hook, which the fused path would skip"
        if "forward" in m.__dict__:
            return f"{name}'s forward was replaced (an accelerate offload hook?), which the fused path would skip"
        if not type(m).__module__.startswith(("transformers.models.", "transformers.activations")) \
                and not isinstance(m, torch.nn.SiLU):
            return f"{name} is a {type(m).__name__}, not transformers' own module, so its math may differ"
    for layer in _layers(model):
        if type(layer.mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            return f"the MLP's activation is {type(layer.mlp.act_fn).__name__}, not SiLU"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if not isinstance(rope_type, str) or any(t in rope_type for t in _DYNAMIC_ROPE):
        return f"its rope type {rope_type!r} changes frequencies with the batch's longest position"
    return None


def fused_decode_refusal(model: torch.nn.Module, cache: PagedKVCache,
                         kinds: dict[str | None, AttentionKind | None] | None = None) -> str | None:
    """Why the fused decode forward cannot run ``model`` (a transformers model or its PEFT wrapper) over
    ``cache``, in one clause; ``None`` when it can. Host checks only (no device read). ``kinds``:
    :func:`~hybrid_engine.decode.layout.attention_kinds` of the config, when the caller has them."""
    model = decode_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return f"its model type {model_type!r} is not one of {', '.join(FUSED_MODEL_TYPES)}"
    kinds = attention_kinds(config) if kinds is None else kinds
    if kinds != {None: FULL} or cache.states is not None or any(cache.rings):
        return "it has windowed, chunked or state layers (the fused path runs full attention only)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"its activation is {getattr(config, 'hidden_act', None)!r}, not 'silu'"
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        return "its pretraining_tp > 1 splits the projections (transformers' slow path)"
    if uses_exact_attention(model):
        return "the exact mode runs its own batch-invariant kernels"
    if is_zero3_partitioned(model) or any(hasattr(p, "ds_status") for p in model.parameters()):
        return "its parameters are partitioned by DeepSpeed ZeRO-3"
    if torch.is_autocast_enabled(cache.device.type):
        return "autocast is on (the fused ops take no autocast rules)"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "it is in training mode with attention dropout"
    return _structure_refusal(model) or _module_refusal(model)


def fused_decode_supported(model: torch.nn.Module, cache: PagedKVCache,
                           kinds: dict[str | None, AttentionKind | None] | None = None) -> bool:
    """Whether the fused decode forward can run ``model`` over ``cache`` (:func:`fused_decode_refusal`)."""
    return fused_decode_refusal(model, cache, kinds) is None


def fused_kernels_available(device: torch.device | str) -> bool:
    """Whether every layer op and the paged attention have a kernel on ``device`` (their capability probes;
    outside capture): where ``"auto"`` turns the fused path on."""
    return layer_ops.implementation(device) != "reference" and paged_attention.implementation(device) != "reference"


# Models warned about, with the reasons (``True`` asked for an unsupported model: one warning per model and reason).
_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_fused_decode(setting: bool | str, model: torch.nn.Module, cache: PagedKVCache,
                         kinds: dict[str | None, AttentionKind | None] | None = None) -> bool:
    """Whether a call's decode steps run the fused forward, for ``hybrid_engine.fused_decode`` = ``setting``:
    ``"auto"``: where supported and every op has a kernel on the cache's device (off on a plain CPU);
    ``True``: wherever supported (the ops' reference implementations where no kernel), else transformers'
    forward with one warning per model and reason; ``False``: never. Outside capture."""
    if setting is False:
        return False
    if setting not in ("auto", True):
        raise ValueError(f"fused_decode must be 'auto', True or False, got {setting!r}")
    if setting == "auto" and not fused_kernels_available(cache.device):
        return False
    reason = fused_decode_refusal(model, cache, kinds)
    if reason is not None and setting is True:
        warned = _WARNED.setdefault(decode_model(model), set())
        if reason not in warned:
            warned.add(reason)
            warnings.warn(f"hybrid_engine.fused_decode is true, but the fused decode forward cannot run this model: "
                          f"{reason}; decode steps run transformers' forward instead", UserWarning,
                          stacklevel=user_stacklevel())
    return reason is None


# ------------------------------------------------------------------ forward
def _rope_table(rotary: torch.nn.Module, cache: PagedKVCache, dtype: torch.dtype) -> torch.Tensor:
    """``[capacity + 1, 2, head_dim]``: the rotary module's (cos, sin) at positions ``0..capacity`` (a row's
    position never passes its write position, at most the capacity), in ``dtype``, kept on the cache."""
    inv_freq = rotary.inv_freq
    key = ("rope", dtype, inv_freq.device, inv_freq.data_ptr(), inv_freq._version,
           float(getattr(rotary, "attention_scaling", 1.0)))

    def make() -> torch.Tensor:
        positions = torch.arange(cache.capacity + 1, device=cache.device)[None, :]
        cos, sin = rotary(torch.empty((), dtype=dtype, device=cache.device), positions)
        return torch.stack((cos[0], sin[0]), dim=1)

    return cache.step_table(rotary, key, make)


class FusedDecoderLayer:
    """One transformers decoder layer run by the fused ops (a view of it for one step: ``self_attn`` is the
    layer's attention module, as in transformers' layers, so per-layer op counts attribute here). It ends with
    the next norm (the next layer's input norm, or the final one) fused with its residual add, so every layer
    launches the same ops."""

    __slots__ = ("layer", "self_attn")

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.self_attn = layer.self_attn

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: PagedKVCache, pages: PagedRead, next_norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next_norm(residual'), residual')`` for ``x [B, 1, H]``, the layer's normed input, and
        ``residual``, its input: ``residual'`` is the layer's output (input + attention + MLP)."""
        layer, attn = self.layer, self.self_attn
        b, d = x.shape[0], attn.head_dim
        q = attn.q_proj(x).view(b, 1, -1, d)
        k = attn.k_proj(x).view(b, 1, -1, d)
        v = attn.v_proj(x).view(b, 1, -1, d)
        if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before rotary
            q = rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
            k = rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
        q, k = rotary_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        keys, values = cache.update(k, v.transpose(1, 2), attn.layer_idx)  # the pool, the token written
        out = paged_decode_attention(q, keys, values, pages.block_table, pages.lengths, float(attn.scaling),
                                     pages.page_size)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, 1, -1))
        norm = layer.post_attention_layernorm
        x, residual = add_rms_norm(out, residual, norm.weight, norm.variance_epsilon)
        mlp = layer.mlp
        out = mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        return add_rms_norm(out, residual, next_norm.weight, next_norm.variance_epsilon)


def fused_decode_forward(model: torch.nn.Module, cache: PagedKVCache, tokens: torch.Tensor,
                         position_ids: torch.Tensor, pages: PagedRead) -> torch.Tensor:
    """Logits ``[B, V]`` of one decode token per row: ``tokens [B, 1]`` at ``position_ids [B, 1]``, attending
    over each row's ``pages`` (its block table and length, the token written included).

    The caller (:func:`~hybrid_engine.decode.step.decode_one_token`) has checked support
    (:func:`fused_decode_supported`) and set the cache's forward indices with ``paged=True``: each layer's
    K/V goes to their ``write_slots`` through ``cache.update``, which returns the pool ungathered.
    Capture-safe: no host reads, no data-dependent shapes."""
    model = decode_model(model)
    base = model.model
    hidden = base.embed_tokens(tokens)
    table = _rope_table(base.rotary_emb, cache, hidden.dtype)
    cos_sin = table.index_select(0, position_ids.flatten())  # [B, 2, head_dim]: one lookup for both
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
    layers = list(_layers(model))
    norm = layers[0].input_layernorm
    x, residual = rms_norm(hidden, norm.weight, norm.variance_epsilon), hidden
    for i, layer in enumerate(layers):
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else base.norm
        x, residual = FusedDecoderLayer(layer)(x, residual, cos, sin, cache, pages, next_norm)
    return model.lm_head(x)[:, -1]
