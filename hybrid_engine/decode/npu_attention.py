"""``"npu_graph"``: an attention implementation whose Ascend NPU kernel can be captured into a graph.

Why it exists. On an Ascend NPU, transformers' ``sdpa`` path reaches
torch_npu's fused flash-attention kernels (``npu_fusion_attention`` v1/v2 in
torch_npu releases before SDPA moved to v3). Those launch part of their work on
an internal secondary stream, and NPU graph capture rejects that at
``capture_end`` (CANN error 107025), so a decode step that uses them can never
be captured. The graph-mode variant, ``torch_npu.npu_fusion_attention_v3``
(torch_npu 2.6 on), keeps its work on the capturing stream; its documentation
promises graph capture (aclgraph) for the ``"BNSD"`` layout, the one the
decode cache hands attention. This module registers it with transformers as
``"npu_graph"``; :class:`~hybrid_engine.graphs.runner.DecodeGraphRunner`
switches ``sdpa`` models to it for the steps it warms up and captures on an NPU
(see :func:`~hybrid_engine.graphs.policy.graph_attention`). ``eager`` attention
is plain matmul and softmax, which captures as it is, so it is never switched.

What a capture freezes here: the shapes (batch, heads, query and key lengths),
``head_num``, the scale and the layout string are host values baked into the
kernel launch. The mask and every tensor are device data, so one graph serves
every decode position: nothing in :func:`npu_graph_attention_forward` reads a
device value on the host, and it keeps no state between calls (no table keyed
by layer or call count), so two models, or two engines, can share it.

``torch_npu`` is imported only when the attention runs, so importing
``hybrid_engine`` never needs it; registration happens on import.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

__all__ = ["NPU_GRAPH_ATTENTION", "npu_graph_attention_forward", "npu_graph_available", "npu_graph_mask",
           "npu_masked_out", "register"]

#: The name ``"npu_graph"`` is registered under in transformers' attention and mask interfaces.
NPU_GRAPH_ATTENTION = "npu_graph"
#: The torch_npu kernel ``"npu_graph"`` calls.
V3_KERNEL = "npu_fusion_attention_v3"


def _torch_npu() -> Any:
    return importlib.import_module("torch_npu")


def npu_graph_available() -> bool:
    """Whether the installed torch_npu provides the graph-mode kernel (imports torch_npu if present)."""
    module = sys.modules.get("torch_npu")
    if module is None:
        try:
            module = _torch_npu()
        except Exception:  # not installed, or its import fails without an NPU
            return False
    return callable(getattr(module, V3_KERNEL, None))


def npu_masked_out(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, *, is_causal: bool,
                   device: torch.device) -> torch.Tensor | None:
    """The boolean ``atten_mask`` torch_npu takes (True = masked out), ``[B or 1, 1, q_len, kv_len]`` or ``None``.

    ``attention_mask``: transformers' boolean (True = attend) or additive float
    (negative = masked) 4D mask, or ``None`` (then ``is_causal`` decides). Pure
    device work: capture-safe.

    * transformers hands attention functions either a boolean mask with True
      meaning *attend* (built by :func:`npu_graph_mask`, registered for
      ``"npu_graph"``), or an additive float mask (0 = attend, very negative =
      masked), which is what :mod:`hybrid_engine.decode.step` passes in prefill
      and in every decode step over the paged cache. A float mask is read as
      binary: any negative value masks the key (torch_npu cannot express a
      soft bias).
    * Without a mask, ``is_causal`` (as ``sdpa`` reads it) masks keys after the
      query, aligned top-left as in ``scaled_dot_product_attention``.
    * Query rows with no key to attend (left-pad positions in a padded prefill)
      would be 0/0 inside a fused kernel, and a NaN there reaches real tokens in
      the next layer through ``0 * NaN``. Such rows are given every key instead;
      their output is discarded by construction (they are padding).
    """
    if attention_mask is None:
        if not (is_causal and q_len > 1):
            return None
        q = torch.arange(q_len, device=device)[:, None]
        k = torch.arange(kv_len, device=device)[None, :]
        return (k > q)[None, None]
    mask = attention_mask[..., :kv_len]
    masked = ~mask if mask.dtype == torch.bool else mask < 0
    # A query with nothing to attend (padding) attends everything instead of producing 0/0.
    return masked & ~masked.all(dim=-1, keepdim=True)


def npu_graph_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, H, Sq, D]``, ``key``/``value [B, Hkv, Skv, D]``.

    Returns ``(attn_output [B, Sq, H, Dv], None)``, as transformers' ``sdpa_attention_forward`` returns it,
    computed by ``torch_npu.npu_fusion_attention_v3`` in the ``"BNSD"`` layout (masks: :func:`npu_masked_out`).

    * Layout: the query as transformers hands it (made contiguous: one token per
      row in decode), K/V as the decode cache returns them, with no copy here.
      GQA (``num_key_value_heads < num_attention_heads``) is native: v3 takes
      fewer K/V heads than query heads when they divide them. (The reference
      change this project follows captured v3 in ``"BSH"``, which needs a
      transposed copy of the whole cache in every step of every layer; not
      verified on an NPU here.)
    * The softmax scale is always passed: torch_npu's default is 1.0, not
      ``1/sqrt(head_dim)``.
    """
    for unsupported in ("softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"attn_implementation='{NPU_GRAPH_ATTENTION}' does not support `{unsupported}`")
    heads, q_len, head_dim = query.shape[1:]
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{NPU_GRAPH_ATTENTION}: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    atten_mask = npu_masked_out(attention_mask, q_len, kv_len, is_causal=bool(causal), device=query.device)
    options: dict[str, Any] = {
        "atten_mask": atten_mask,
        "scale": float(scaling) if scaling is not None else head_dim ** -0.5,
    }
    if dropout:
        options["keep_prob"] = 1.0 - float(dropout)
    out = getattr(_torch_npu(), V3_KERNEL)(query.contiguous(), key, value, heads, "BNSD", **options)
    if isinstance(out, (tuple, list)):  # the fused kernels return (attention_out, softmax stats, ...)
        out = out[0]
    return out.transpose(1, 2).contiguous(), None


def npu_graph_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function for ``"npu_graph"``: transformers' boolean ``sdpa`` mask, never skipped.

    ``sdpa`` may return ``None`` for a plain causal mask and rely on its
    ``is_causal`` flag; we always materialise it, so padding and cache offsets
    never depend on how the kernel aligns an implicit causal mask. The
    arguments are passed through unchanged (they differ between transformers
    4.57 and 5.x).
    """
    from transformers.masking_utils import AttentionMaskInterface

    kwargs["allow_is_causal_skip"] = False
    return AttentionMaskInterface._global_mapping["sdpa"](*args, **kwargs)


def register() -> None:
    """Register ``"npu_graph"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NPU_GRAPH_ATTENTION, npu_graph_attention_forward)
    AttentionMaskInterface.register(NPU_GRAPH_ATTENTION, npu_graph_mask)


register()
