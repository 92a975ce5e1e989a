"""The one graph policy: may a model's decode steps be captured now, and if not, why.

Both front ends (``engine.generate`` and ``HybridEngineRollout``) ask the
:class:`~hybrid_engine.graphs.runner.DecodeGraphRunner`, whose
:class:`GraphPolicy` asks :func:`refusal_reason` here, so a refusal reads the
same on either path:

* the accelerator of the model's device cannot capture (found by probing, never
  by device name);
* the engine config makes captured graphs unsafe: ZeRO stage 3 (parameters are
  re-gathered at new addresses; also found by probing the parameters, unless
  generation runs on the gathered inference copy), ``release_inference_cache``
  where the device has no page storage released at fixed addresses (elsewhere, on the CPU, it is the
  memory hand-off of :mod:`hybrid_engine.graphs.handoff`, graphs kept), ``inference_tp_size > 1`` (see
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

What is learnt at run time is policy too, kept by one :class:`GraphPolicy`
per runner: repeated capture failures (:data:`MAX_CAPTURE_FAILURES`), a graph
attention that failed its first run, and a forward hook that cannot be captured
(named in the reason; shared by every runner of the same model, so no other
runner tries that hook set again). :meth:`GraphPolicy.refusal` is the whole
answer to "may graphs run now", static and learnt. Every reason is a sentence
for the user; it is warned once per policy, as a :class:`GraphRefusedWarning`,
and decoding runs eagerly with identical output.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from hybrid_engine.config.loading import ConfigSource, load_config
from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode import kv_storage
from hybrid_engine.decode.npu_attention import NPU_GRAPH_ATTENTION, npu_graph_available
from hybrid_engine.exact.mode import EXACT_ATTENTION
from hybrid_engine.graphs.hooks import hook_fingerprint, hook_registered
from hybrid_engine.model_access import is_zero3_partitioned
from hybrid_engine.user_warnings import user_stacklevel

__all__ = ["CAPTURABLE_ATTENTION", "GraphPolicy", "GraphRefusedWarning", "MAX_CAPTURE_FAILURES", "NPU_SWITCHED_ATTENTION", "ZERO3_REFUSAL", "graph_attention", "graph_capture_requested", "refusal_reason", "validate_graph_capture_support"]

#: Attention implementations whose decode kernels capture and honour the decode cache's 4D mask.
CAPTURABLE_ATTENTION = ("eager", "sdpa", NPU_GRAPH_ATTENTION, EXACT_ATTENTION)

#: Model attention implementations whose graphed steps run with ``"npu_graph"`` on an NPU (transformers'
#: ``eager`` attention is matmul and softmax, which NPU capture records as it is).
NPU_SWITCHED_ATTENTION = ("sdpa",)


#: Capture failures after which a runner stops trying graphs.
MAX_CAPTURE_FAILURES = 3


class GraphRefusedWarning(UserWarning):
    """Graphs were refused or a capture failed; decoding runs eagerly (same tokens)."""


def _capability(accelerator: Any, can_capture: bool | None = None) -> str | None:
    """Why ``accelerator`` cannot capture (``None``: it can); ``can_capture`` as it says, else probed."""
    if can_capture is None:
        can_capture = accelerator.create_graph() is not None
    if can_capture:
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
    reason = _capability(accelerator, getattr(accelerator, "supports_graph_capture", None))
    if reason is not None:
        return reason
    if cfg.zero_optimization.stage == 3 and not cfg.hybrid_engine.zero3_gathered_inference_copy:
        return ZERO3_REFUSAL
    if cfg.hybrid_engine.release_inference_cache and not kv_storage.supports_release(accelerator.device()):
        # Where the pool can sleep at fixed addresses (the CPU), the setting is the memory hand-off with graphs
        # kept (issue 41); elsewhere it still frees the buffers a graph replays into.
        return (
            "Setting hybrid_engine.release_inference_cache frees the inference buffers after each generation, "
            f"which a captured graph replays into ({accelerator.device().type} has no storage released at fixed "
            "addresses yet); set it to false to use graph capture."
        )
    if cfg.hybrid_engine.inference_tp_size > 1:
        return (
            f"Tensor-parallel inference (hybrid_engine.inference_tp_size={cfg.hybrid_engine.inference_tp_size}) "
            "is not graph-captured; set hybrid_engine.inference_tp_size to 1 to use graph capture."
        )
    return None


#: A hook set a capture refused: (hook fingerprint, handle id of the hook that could not be captured, reason).
HookRefusal = tuple[tuple, int | None, str]


#: Per model, the hook set a capture refused, shared by every runner of that model (an engine's and a
#: rollout's): a refusal known in advance never goes through a capture again, each of which on CUDA invalidates
#: a stream capture.
_REFUSED_HOOK_SETS: weakref.WeakKeyDictionary[torch.nn.Module, HookRefusal] = weakref.WeakKeyDictionary()


def _still_registered(model: torch.nn.Module, refusal: HookRefusal | None) -> bool:
    """Whether the refused hook set is still what ``model`` has registered (the hook may be one the
    fingerprint leaves out, so its handle is checked too)."""
    return (refusal is not None and refusal[0] == hook_fingerprint(model)
            and hook_registered(model, refusal[1]))


class GraphPolicy:
    """May ``model``'s decode steps run as graphs now: the static reasons (:func:`refusal_reason`) and what
    this policy learnt at run time, in one :meth:`refusal`.

    ``accelerator`` and ``config`` may be re-assigned (the runner follows the model's device). Learnt refusals
    last for the policy's life (capture failures, a failed graph attention) or while a refused hook set stays
    registered.
    """

    def __init__(self, model: torch.nn.Module, accelerator: Any, config: EngineConfig | None = None) -> None:
        self.model = model
        self.accelerator = accelerator
        self.config = config
        self._failures = 0
        self._disabled: str | None = None
        self._bad_hooks: HookRefusal | None = None
        self._warned: set[str] = set()

    def refusal(self) -> str | None:
        """Why graphs may not run now (``None``: they may). The whole policy, static and learnt."""
        reason = refusal_reason(self.model, self.accelerator, self.config)
        if reason is not None:
            return reason
        if self._disabled is not None:
            return self._disabled
        if _still_registered(self.model, self._bad_hooks):
            return self._bad_hooks[2]
        return None

    def graph_attention(self) -> str | None:
        """The attention implementation graphed steps run with (:func:`graph_attention`; ``None``: the model's)."""
        return graph_attention(self.model, self.accelerator)

    def disable(self, reason: str) -> None:
        """Graphs are off for good (for this policy), for ``reason``."""
        self._disabled = reason

    def capture_failed(self) -> str | None:
        """Count a capture failure; after :data:`MAX_CAPTURE_FAILURES` graphs are disabled, and the reason is
        returned (else ``None``)."""
        self._failures += 1
        if self._failures < MAX_CAPTURE_FAILURES:
            return None
        self._disabled = (f"Graphs were disabled for this engine after {self._failures} capture "
                          "failures; decode runs eagerly.")
        return self._disabled

    def refuse_hooks(self, handle_id: int | None, reason: str) -> None:
        """The hook registered under ``handle_id`` could not be captured: refuse graphs while this hook set is
        registered, for every runner of the model."""
        self._bad_hooks = (hook_fingerprint(self.model), handle_id, reason)
        _REFUSED_HOOK_SETS[self.model] = self._bad_hooks

    def known_hook_refusal(self) -> str | None:
        """The reason another runner of this model could not capture the hook set registered now (adopted by
        this policy), else ``None``."""
        known = _REFUSED_HOOK_SETS.get(self.model)
        if not _still_registered(self.model, known):
            return None
        self._bad_hooks = known
        return known[2]

    def warn(self, reason: str) -> None:
        """Warn ``reason`` as a :class:`GraphRefusedWarning`, once per policy."""
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(reason, GraphRefusedWarning, stacklevel=user_stacklevel())
