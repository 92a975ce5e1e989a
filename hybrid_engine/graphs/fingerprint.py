"""What a captured decode graph silently depends on, and how the runner notices a change.

A graph reads every weight by address and replays exactly the kernels it
recorded. These things a user can change between calls would make a replay
disagree with eager decoding without any error:

* a parameter or buffer re-allocated or re-laid-out (``load_state_dict(assign=True)``,
  ``.to(dtype)``, ``param.data = ...``, a LoRA merge): the graph keeps reading
  the old storage, with the old strides;
* a forward hook or pre-hook added or removed: the graph keeps running the
  hooks it recorded, and no others;
* the precision a forward runs in: ``torch.autocast`` around the call, a
  forward replaced on the instance (accelerate's mixed-precision wrapper), or
  the kernel switches (``sdpa_kernel``'s backends, TF32): a capture bakes the
  dtypes and kernels of that run into the graph;
* the config's plain fields (Llama's layer loop reads ``num_hidden_layers``
  at every forward) and the attention function registered for the model's
  implementation;
* the module tree and each module's plain attributes: a submodule swapped or
  its ``forward`` patched on the instance or its class, a norm's ``eps``, a tensor
  attribute that is neither a parameter nor a buffer re-assigned, and
  the state of an adapter layer (:func:`adapter_fingerprint`). A plain attribute
  *added* after the module was first seen (a trainer's ``module._num_params``) is
  no part of it: no captured code read it (one that shadows a class attribute is).

:func:`graph_fingerprint` covers them all; the runner compares it before each
call's replays and recaptures when it changed. A module-level function patched
after a capture (``modeling_llama.apply_rotary_pos_emb = ...``) is out of its
sight: call ``invalidate_graphs()`` on the engine or rollout after such a patch.

Hooks are captured like any other device work, never suspended, so graph
output always equals eager output with the same hooks; one that cannot be
captured is named (:mod:`hybrid_engine.graphs.hooks`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hybrid_engine.graphs.hooks import hook_fingerprint
from hybrid_engine.model_access import ADAPTER_STATE

__all__ = ["ADAPTER_STATE", "adapter_fingerprint", "config_fingerprint", "forward_fingerprint", "graph_fingerprint", "kernel_choices", "module_fingerprint", "precision_fingerprint", "weight_fingerprint"]


def _tensor_key(t: torch.Tensor) -> tuple:
    """How a kernel sees a tensor: address, dtype, shape, strides (``w.data = w.data.t()`` keeps the rest of a
    square weight) and device."""
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), str(t.device)


def weight_fingerprint(model: torch.nn.Module, *, requires_grad: bool = True) -> tuple:
    """(name, address, dtype, shape, strides, device[, requires_grad]) of every parameter and buffer: changes when any
    is re-allocated (or, as eager kernels may differ then, starts or stops requiring grad)."""
    return tuple(
        (name, *_tensor_key(t)) + ((t.requires_grad,) if requires_grad else ())
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
    )




def _host_value(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _host_value(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_host_value(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__, id(value)


def adapter_fingerprint(model: torch.nn.Module) -> tuple:
    """Merged/active/disabled adapters and scaling of every adapter layer: changes on an in-place merge or switch.

    PEFT's LoRA layers branch on whether the adapter is merged, active or disabled and bake its scaling in as a
    constant, so an in-place ``merge_adapter()``, with no re-allocation, would otherwise replay the unmerged branch
    on merged weights and count the adapter twice."""
    return tuple(
        (name, *(_host_value(getattr(m, attr, None)) for attr in ADAPTER_STATE))
        for name, m in model.named_modules()
        if hasattr(m, "merged_adapters")
    )


# What every nn.Module keeps in its __dict__ (parameter, buffer, child and hook tables; the training flag,
# which generation sets itself): the rest is the module's own state.
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


# Module attributes and config fields no decode step reads: gradient checkpointing acts only in training mode
# (generation runs in eval mode), transformers' list of its input-grad hooks (the hooks themselves are left out
# of the hook fingerprint, see _inert_for_generation), and use_cache, which the decode forward passes itself. A
# training loop that toggles them around each rollout must not recapture every graph.
_UNREAD_MODULE_ATTRS = frozenset({"gradient_checkpointing", "_require_grads_hooks"})


_UNREAD_CONFIG_FIELDS = frozenset({"use_cache"})


_SKIP = object()


def _plain(value: Any) -> Any:
    """``value`` as a comparable host value when it is plain data (numbers, strings, dtypes and containers
    of them) or a tensor (by address, dtype, shape and device: a graph reads a plain tensor attribute, one
    that is neither a parameter nor a buffer, by address too, so re-assigning it must recapture), else
    ``_SKIP``: other objects are left to the other fingerprints."""
    if isinstance(value, torch.Tensor):
        return ("tensor", *_tensor_key(value))
    if value is None or isinstance(value, (bool, int, str, torch.dtype)):
        return value
    if isinstance(value, float):
        return "nan" if value != value else value
    if isinstance(value, dict):
        items = tuple((str(k), v) for k, v in ((k, _plain(v)) for k, v in value.items()) if v is not _SKIP)
        return tuple(sorted(items, key=lambda kv: kv[0]))
    if isinstance(value, (list, tuple)):
        return tuple(v for v in map(_plain, value) if v is not _SKIP)
    return _SKIP


#: Per module, the plain attributes it had when first fingerprinted (before any capture of it): the state its
#: code was written to read. An attribute set later is no part of what a graph froze (DeepSpeed-Chat's
#: throughput printer sets ``module._num_params``), unless it shadows one the class defines (``is_causal``).
_KNOWN_ATTRS: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()
_KNOWN_LOCK = threading.Lock()
_MISSING = ("missing",)


def _read_attrs(m: torch.nn.Module) -> list[str]:
    """The names of ``m``'s plain attributes a forward can read: those it had at first sight, and any that
    shadows a class attribute; in a fixed order."""
    own = [k for k in m.__dict__ if k not in _MODULE_INTERNALS and k not in _UNREAD_MODULE_ATTRS]
    with _KNOWN_LOCK:
        known = _KNOWN_ATTRS.get(m)
        if known is None:
            known = _KNOWN_ATTRS[m] = frozenset(own)
    cls = type(m)
    return sorted(known | {k for k in own if k not in known and hasattr(cls, k)})


def module_fingerprint(model: torch.nn.Module) -> tuple:
    """Per module: where it is (name, identity, class), its ``forward`` (set on the instance or patched on the
    class: a kernel patch), and its plain host attributes (``eps``, flags): what a captured step freezes from
    the module tree, so a submodule swapped or patched, or an attribute changed or deleted, after a capture
    drops the graphs. A plain attribute added after the module was first fingerprinted is left out (no
    captured code read it), unless it shadows a class attribute (:func:`_read_attrs`)."""
    out = []
    for name, m in model.named_modules():
        state = m.__dict__
        forward = state.get("forward", type(m).forward)
        attrs = tuple((k, v) for k, v in ((k, _plain(state[k]) if k in state else _MISSING)
                                          for k in _read_attrs(m))
                      if v is not _SKIP)
        out.append((name, id(m), type(m).__qualname__, id(forward), attrs))
    return tuple(out)


def config_fingerprint(config: Any) -> tuple:
    """The plain fields of the model's config and of its sub-configs: a forward reads some of them at every
    call (Llama's ``num_hidden_layers`` bounds its layer loop, and transformers' early-exit assistant lowers
    it), so a capture freezes them."""
    fields = []
    for key, value in vars(config).items() if config is not None else ():
        if key in _UNREAD_CONFIG_FIELDS:
            continue
        part = config_fingerprint(value) if isinstance(value, PretrainedConfig) else _plain(value)
        if part is not _SKIP:
            fields.append((key, part))
    return tuple(fields)


def precision_fingerprint(model: torch.nn.Module) -> tuple:
    """Autocast on the model's device at call time, a forward set on the instance (which may enter
    autocast itself, as accelerate's wrapper does) and the :func:`kernel_choices`: changes when any does."""
    param = next(model.parameters(), None)
    device_type = param.device.type if param is not None else "cpu"
    enabled = torch.is_autocast_enabled(device_type)
    forward = model.__dict__.get("forward")
    return (enabled, torch.get_autocast_dtype(device_type) if enabled else None,
            None if forward is None else id(forward), kernel_choices())


#: Where torch (2.9 and later) keeps its per-backend float32 precision (``fp32_precision``), under torch.backends.
_FP32_PRECISION_SWITCHES = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
                            "mkldnn.conv", "mkldnn.rnn")


def _fp32_precisions() -> tuple:
    """The float32 matmul precision, from both of torch's APIs: the legacy one, which raises once the
    per-backend one has been used (then ``None``: the per-backend fields hold the choice), and each backend's
    ``fp32_precision`` (``None`` where this torch has none)."""
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # "checking the matmul precision without a specific backend name": mixed APIs
        legacy = None
    fields = []
    for path in _FP32_PRECISION_SWITCHES:
        node: Any = torch.backends
        for part in filter(None, path.split(".")):
            node = getattr(node, part, None)
        fields.append(getattr(node, "fp32_precision", None))
    return (legacy, *fields)


def kernel_choices() -> tuple:
    """The process-wide switches that pick kernels at capture: the attention backends ``sdpa_kernel`` allows
    (it sets them on every device) and the matmul precision (TF32, reduced-precision reductions)."""
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled(), _fp32_precisions(), torch.backends.cudnn.allow_tf32,
            cuda.matmul.allow_fp16_reduced_precision_reduction, cuda.matmul.allow_bf16_reduced_precision_reduction)


def forward_fingerprint(model: torch.nn.Module) -> tuple:
    """What a forward computes with besides the weights' values and addresses: hooks, precision, the module tree
    and its host attributes (adapter state among them: :data:`ADAPTER_STATE` are plain attributes), the config,
    and the attention implementation with the function registered for it. An episode's kept K/V are reused only
    while it is unchanged (:mod:`hybrid_engine.rollout.episodes`)."""
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    attn_function = ALL_ATTENTION_FUNCTIONS.get(attn) if isinstance(attn, str) else None
    return (hook_fingerprint(model), precision_fingerprint(model), module_fingerprint(model),
            config_fingerprint(config), str(attn), id(attn_function))


def graph_fingerprint(model: torch.nn.Module) -> tuple:
    """Everything a captured decode step bakes in from the model: the weights' addresses and layouts
    (:func:`weight_fingerprint`) and the :func:`forward_fingerprint`."""
    return (weight_fingerprint(model), *forward_fingerprint(model))
