"""A gathered inference copy of a ZeRO-3 model, so that decode graphs can run under ZeRO-3 too.

Why: outside a gather a ZeRO-3 parameter is a 0-element shard, and every gather
allocates new memory, so a captured graph could only replay stale addresses.
With ``hybrid_engine.zero3_gathered_inference_copy`` the engine keeps a second,
unpartitioned instance of the model, without DeepSpeed's hooks, whose
parameters live at fixed addresses on the device. After every optimizer step
the trained parameters are gathered (a collective: every rank steps) and copied
into it **in place**, so graphs captured on the copy replay the new weights
with no recapture. Generation on the copy involves no collective at all.

PEFT: a model with LoRA (or other PEFT tuner) layers injected, as TRL's
``peft_config=`` trains it, gets the same adapters injected into the copy
(``peft.inject_adapter_in_model`` with the source's ``peft_config``), so the
copy runs the same unmerged forward as its source. The adapters' host-side
state (merged, active, disabled adapters and their scaling) is mirrored at
every refresh; it is part of the graph fingerprint, so a change recaptures.
PEFT's ``modules_to_save`` wrappers are injected the same way.

Layers injected by other means, which ``type(model)(config)`` does not build
(DeepSpeed-Chat's own ``LinearLayer_LoRA``, hand-written adapters), get a
structural copy instead: the module tree deep-copied with every parameter
replaced by an empty one of its gathered shape (so nothing of the source's
memory is copied twice) and every hook table emptied (DeepSpeed's fetch and
release hooks stay on the source). The twins' own plain attributes (a layer's
``fuse_lora`` flag, a scaling) are mirrored at every refresh; they are part of
the graph fingerprint, so a change recaptures. A model that cannot be deep-copied
either is refused by name when the copy is built.

Cost: one full copy of the model's (low-precision) parameters and buffers per
rank, held for good, which is what ZeRO-3 exists to avoid; use it when that
copy fits beside the training state.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.model_access import ADAPTER_STATE

__all__ = ["InferenceCopy"]


def _set_buffer(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    owner._buffers[leaf] = value


def _twin(source: nn.Module) -> nn.Module:
    """The same class and config as ``source``, its PEFT adapters injected, on the meta device."""
    with torch.device("meta"):
        module = type(source)(source.config)  # no memory yet
        adapters = getattr(source, "peft_config", None)
        if isinstance(adapters, dict) and adapters:
            from peft import inject_adapter_in_model

            for name, config in adapters.items():
                inject_adapter_in_model(config, module, adapter_name=name, low_cpu_mem_usage=True)
    return module


#: A module's hook tables (``_forward_pre_hooks``, ...): emptied in a structural copy.
_HOOK_TABLES = tuple(k for k in nn.Module().__dict__ if "hook" in k)
#: What every module keeps in its ``__dict__`` (tables, the training flag): never mirrored.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
#: What DeepSpeed's ZeRO-3 sets on each module (ids, registries, the original parameter table, its backward
#: counters and functions): left behind, and never mirrored (a counter changing every step would recapture).
_ZERO3_PREFIXES = ("ds_", "_original_parameters", "applied_pre_backward_ref_cnt", "pre_bwd_fn", "post_bwd_fn")


def _structural_twin(source: nn.Module) -> nn.Module:
    """``source``'s module tree deep-copied, on the meta device: each parameter (tied ones once) and buffer an
    empty tensor of its gathered shape, each hook table empty, DeepSpeed's per-module state dropped."""
    memo: dict[int, object] = {}

    def meta(t: torch.Tensor, shape: tuple) -> torch.Tensor:
        if id(t) not in memo:
            empty = torch.empty(shape, dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(empty, requires_grad=False) if isinstance(t, nn.Parameter) else empty
        return memo[id(t)]

    for m in source.modules():
        params = {n: None if p is None else meta(p, tuple(getattr(p, "ds_shape", p.shape)))
                  for n, p in m._parameters.items()}
        for table in (m._parameters, m.__dict__.get("_original_parameters")):  # ZeRO-3 wraps the first
            if table is not None:
                memo[id(table)] = params
        for b in m._buffers.values():
            if b is not None:
                meta(b, tuple(b.shape))
        for attr in _HOOK_TABLES:
            table = m.__dict__.get(attr)
            if table is not None:
                memo[id(table)] = type(table)()
    module = copy.deepcopy(source, memo)
    for m in module.modules():
        for key in [k for k in m.__dict__ if k.startswith(_ZERO3_PREFIXES)]:
            del m.__dict__[key]
    return module


_ABSENT = object()


def _plain_attrs(m: nn.Module) -> dict[str, object]:
    """``m``'s own plain scalar attributes (flags, scalings): what its forward may branch on."""
    return {k: v for k, v in m.__dict__.items() if k not in _MODULE_INTERNALS and not k.startswith(_ZERO3_PREFIXES)
            and (v is None or isinstance(v, (bool, int, float, str)))}


def _mirror_adapter_state(pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Copy each source adapter layer's host-side state (what its forward branches on) onto its twin."""
    for dst, src in pairs:
        for attr in ADAPTER_STATE:
            if hasattr(src, attr):
                value = getattr(src, attr)
                setattr(dst, attr, type(value)(value) if isinstance(value, (list, dict)) else value)


def _same_names(module: nn.Module, sources: dict[str, nn.Parameter]) -> bool:
    return set(dict(module.named_parameters(remove_duplicate=False))) == set(sources)


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


class InferenceCopy:
    """An unpartitioned twin of a ZeRO-3 partitioned transformers model, refreshed in place."""

    def __init__(self, source: nn.Module) -> None:
        sources = dict(source.named_parameters(remove_duplicate=False))
        module = _twin(source)
        #: Whether the copy is structural (layers no config builds), its plain attributes then mirrored.
        self.structural = not _same_names(module, sources)
        if self.structural:
            module = self._structural(source, sources, module)
        module = module.to_empty(device=next(source.parameters()).device)
        if callable(getattr(module, "tie_weights", None)):
            module.tie_weights()  # to_empty allocates tied parameters apart; tie them again
        # Every name, tied ones included: a parameter the source ties is filled whatever the copy ties.
        names = dict(module.named_parameters(remove_duplicate=False))
        for name, param in names.items():
            if param.dtype != sources[name].dtype:  # e.g. PEFT keeps adapters in fp32 beside a bf16 base
                param.data = param.data.to(sources[name].dtype)
        for name, buffer in source.named_buffers():  # buffers are never partitioned
            _set_buffer(module, name, buffer.detach().clone())
        if hasattr(source, "generation_config"):
            module.generation_config = source.generation_config
        module.requires_grad_(False)
        module.eval()
        self.source = source
        self.module = module
        self._pairs = [(names[name], src) for name, src in sources.items()]
        twins = dict(module.named_modules())
        self._adapter_layers = [(twins[name], m) for name, m in source.named_modules() if hasattr(m, "merged_adapters")]
        self._module_pairs = [(twins[name], m) for name, m in source.named_modules()] if self.structural else []
        self.refresh()

    @staticmethod
    def _structural(source: nn.Module, sources: dict[str, nn.Parameter], twin: nn.Module) -> nn.Module:
        """The structural copy of ``source`` (``twin``: what its config builds), or a ``ValueError`` naming what
        stops it."""
        built = dict(twin.named_parameters(remove_duplicate=False))
        extra, missing = [n for n in sources if n not in built], [n for n in built if n not in sources]
        why = (f"the model holds parameters that {type(source).__name__}(config) does not build ({_some(extra)}), "
               "layers injected by other means than its PEFT peft_config" if extra else
               f"the model lacks parameters that {type(source).__name__}(config) builds ({_some(missing)})")
        try:
            module = _structural_twin(source)
        except Exception as exc:  # noqa: BLE001 -- anything deepcopy meets (a lock, a handle) is named below
            raise ValueError(
                f"zero3_gathered_inference_copy: {why}, and its module tree cannot be copied either "
                f"({type(exc).__name__}: {exc}), so no copy can mirror it; turn the copy off (generation then "
                "gathers the ZeRO-3 parameters and decodes eagerly)") from exc
        if not _same_names(module, sources):
            raise ValueError(f"zero3_gathered_inference_copy: {why}, and a copy of its module tree holds other "
                             "parameters, so no copy can mirror it; turn the copy off (generation then gathers the "
                             "ZeRO-3 parameters and decodes eagerly)")
        return module

    @torch.no_grad()
    def refresh(self) -> None:
        """Gather the source's parameters (collective) and copy them into the copy, in place."""
        with gathered_for_inference(self.source):
            for dst, src in self._pairs:
                dst.copy_(src)
        _mirror_adapter_state(self._adapter_layers)
        for twin, src in self._module_pairs:
            for key, value in _plain_attrs(src).items():
                if twin.__dict__.get(key, _ABSENT) != value:
                    setattr(twin, key, value)
