"""The one graph policy: may a model's decode steps be captured now, and if not, why.

Both front ends (``engine.generate`` and ``HybridEngineRollout``) ask the
:class:`~hybrid_engine.graphs.runner.DecodeGraphRunner`, and the runner asks
:func:`refusal_reason` here, so a refusal reads the same on either path:

* the accelerator of the model's device cannot capture (found by probing, never
  by device name);
* the engine config makes captured graphs unsafe: ZeRO stage 3 (parameters are
  re-gathered at new addresses; also found by probing the parameters, unless
  generation runs on the gathered inference copy), ``release_inference_cache``
  (the buffers a graph replays into are freed), ``inference_tp_size > 1`` (see
  :func:`~hybrid_engine.graphs.policy.validate_graph_capture_support`); a rollout
  built on a ``HybridEngine`` honours its engine's config;
* the attention implementation is not one whose kernels capture;
* the rotary embedding is rescaled at run time (transformers' ``dynamic`` and
  ``longrope`` RoPE compare the largest position with a Python number at every
  forward, a host read that no capture can record).

Which attention kernels a graphed step runs is policy too (:func:`graph_attention`):
on an Ascend NPU the fused attention kernels that ``sdpa`` reaches launch work
on a secondary stream, which NPU capture rejects (error 107025), so the runner
runs the steps it warms up and captures with ``"npu_graph"``
(:mod:`hybrid_engine.decode.npu_attention`) instead; where torch_npu lacks that
kernel, ``sdpa`` models are refused up front. Eager steps keep the model's own
choice, and ``eager`` attention (matmul and softmax) captures as it is.

The runner adds what it learns at run time: repeated capture failures, and a
forward hook that cannot be captured (named in the reason). Every reason is a
sentence for the user; it is warned once, as a :class:`GraphRefusedWarning`,
and decoding runs eagerly with identical output.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_engine.config.loading import ConfigSource, load_config
from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode.npu_attention import NPU_GRAPH_ATTENTION, npu_graph_available
from hybrid_engine.exact.mode import EXACT_ATTENTION
from hybrid_engine.model_access import is_zero3_partitioned

__all__ = ["CAPTURABLE_ATTENTION", "GraphRefusedWarning", "NPU_SWITCHED_ATTENTION", "ZERO3_REFUSAL", "graph_attention", "graph_capture_requested", "refusal_reason", "validate_graph_capture_support"]

#: Attention implementations whose decode kernels capture and honour the decode cache's 4D mask.
CAPTURABLE_ATTENTION = ("eager", "sdpa", NPU_GRAPH_ATTENTION, EXACT_ATTENTION)

#: Model attention implementations whose graphed steps run with ``"npu_graph"`` on an NPU (transformers'
#: ``eager`` attention is matmul and softmax, which NPU capture records as it is).
NPU_SWITCHED_ATTENTION = ("sdpa",)


class GraphRefusedWarning(UserWarning):
    """Graphs were refused or a capture failed; decoding runs eagerly (same tokens)."""


def _capability(accelerator: Any) -> str | None:
    if accelerator.create_graph() is not None:
        return None
    detail = getattr(accelerator, "graph_unavailable_reason", None)
    return f"The accelerator cannot capture graphs{f' ({detail})' if detail else ''}, so decode must run eagerly."


def refusal_reason(model: torch.nn.Module, accelerator: Any, config: EngineConfig | None) -> str | None:
    """``None`` when ``model``'s decode steps may be captured on ``accelerator`` under ``config``, else why."""
    reason = validate_graph_capture_support(config, accelerator) if config is not None else _capability(accelerator)
    if reason is not None:
        return reason
    if is_zero3_partitioned(model):  # e.g. a rollout built on ``ds_engine.module`` directly
        return ZERO3_REFUSAL
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in CAPTURABLE_ATTENTION:
        return (
            f"attn_implementation={impl!r} is not capturable into a decode graph; load the model with "
            f"attn_implementation in {CAPTURABLE_ATTENTION} to use graphs."
        )
    if impl in NPU_SWITCHED_ATTENTION and _backend(accelerator) == "npu" and not npu_graph_available():
        return (f"attn_implementation={impl!r} runs torch_npu's fused attention, which launches work on a secondary "
                "stream that NPU graph capture rejects (error 107025), and this torch_npu has no graph-mode "
                "npu_fusion_attention_v3 (torch_npu 2.6 or later); upgrade torch_npu, or load the model with "
                "attn_implementation='eager' to use graphs.")
    rope = _runtime_rope_type(getattr(model, "config", None))
    if rope is not None:
        return (f"rope_type={rope!r} rescales the rotary embedding at run time, reading the largest position on "
                "the host at every step, which a graph cannot record; decode runs eagerly.")
    return None


def _runtime_rope_type(config: Any) -> str | None:
    """The RoPE type when it is one transformers updates at run time (``dynamic``, ``longrope``), else ``None``."""
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for attr in ("rope_parameters", "rope_scaling"):  # transformers 5, 4.x
        params = getattr(config, attr, None)
        if not isinstance(params, dict):
            continue
        per_layer_type = [v for v in params.values() if isinstance(v, dict)]
        for p in per_layer_type or [params]:
            kind = str(p.get("rope_type", p.get("type", "")) or "")
            if "dynamic" in kind or kind == "longrope":
                return kind
    return None


def _backend(accelerator: Any) -> str:
    # The backend's name, not ``device().type``: "npu" is a torch device type only once torch_npu registers
    # it, and this asks which kernels the backend has, not whether it can capture.
    name = accelerator.device_name() if callable(getattr(accelerator, "device_name", None)) else ""
    return str(name).split(":")[0]


def graph_attention(model: torch.nn.Module, accelerator: Any) -> str | None:
    """The attention implementation ``model``'s graphed steps must run with on ``accelerator``.

    ``None``: the model's own. On an NPU whose torch_npu has the graph-mode kernel,
    ``sdpa`` models get ``"npu_graph"``; elsewhere, and for other
    implementations, nothing changes (an uncapturable one is refused by :func:`refusal_reason`).
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in NPU_SWITCHED_ATTENTION and _backend(accelerator) == "npu" and npu_graph_available():
        return NPU_GRAPH_ATTENTION
    return None


#: Why graphs are refused under ZeRO-3 (from the config, or found on the parameters).
ZERO3_REFUSAL = (
    "ZeRO stage 3 partitions parameters and re-gathers them every step, so a captured graph "
    "would replay stale parameter addresses; use zero_optimization.stage 0, 1 or 2 (or, under ZeRO-3, "
    "hybrid_engine.zero3_gathered_inference_copy, which keeps a full copy of the weights for generation)."
)


def graph_capture_requested(config: ConfigSource) -> bool:
    """Whether the config asks for graph-captured decode."""
    return load_config(config).hybrid_engine.enable_graph_capture


def validate_graph_capture_support(config: ConfigSource, accelerator: Any = None) -> str | None:
    """``None`` when captured graphs may be used, else the reason as a sentence.

    Does not look at ``enable_graph_capture`` (see ``graph_capture_requested``).
    Never compares device names: the accelerator is asked whether it can capture.
    """
    cfg = load_config(config)
    if accelerator is None:
        from hybrid_engine.accelerator import get_accelerator

        accelerator = get_accelerator()
    can_capture = getattr(accelerator, "supports_graph_capture", None)
    if can_capture is None:
        can_capture = accelerator.create_graph() is not None
    if not can_capture:
        reason = getattr(accelerator, "graph_unavailable_reason", None)
        detail = f" ({reason})" if reason else ""
        return f"The accelerator cannot capture graphs{detail}, so decode must run eagerly."
    if cfg.zero_optimization.stage == 3 and not cfg.hybrid_engine.zero3_gathered_inference_copy:
        return ZERO3_REFUSAL
    if cfg.hybrid_engine.release_inference_cache:
        return (
            "Setting hybrid_engine.release_inference_cache frees the inference buffers after each generation, "
            "which a captured graph replays into; set it to false to use graph capture."
        )
    if cfg.hybrid_engine.inference_tp_size > 1:
        return (
            f"Tensor-parallel inference (hybrid_engine.inference_tp_size={cfg.hybrid_engine.inference_tp_size}) "
            "is not graph-captured; set hybrid_engine.inference_tp_size to 1 to use graph capture."
        )
    return None
