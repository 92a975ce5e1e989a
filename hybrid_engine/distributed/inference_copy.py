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
PEFT's ``modules_to_save`` wrappers are injected the same way. Parameters the
copy cannot build (layers injected by other means) are refused by name when
the copy is built.

Cost: one full copy of the model's (low-precision) parameters and buffers per
rank, held for good, which is what ZeRO-3 exists to avoid; use it when that
copy fits beside the training state.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.model_access import ADAPTER_STATE

__all__ = ["InferenceCopy"]


def _set_buffer(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    owner._buffers[leaf] = value


def _twin(source: nn.Module, device: torch.device) -> nn.Module:
    """The same class and config as ``source``, its PEFT adapters injected, in uninitialised memory."""
    with torch.device("meta"):
        module = type(source)(source.config)  # no memory yet
        adapters = getattr(source, "peft_config", None)
        if isinstance(adapters, dict) and adapters:
            from peft import inject_adapter_in_model

            for name, config in adapters.items():
                inject_adapter_in_model(config, module, adapter_name=name, low_cpu_mem_usage=True)
    return module.to_empty(device=device)


def _mirror_adapter_state(pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Copy each source adapter layer's host-side state (what its forward branches on) onto its twin."""
    for dst, src in pairs:
        for attr in ADAPTER_STATE:
            if hasattr(src, attr):
                value = getattr(src, attr)
                setattr(dst, attr, type(value)(value) if isinstance(value, (list, dict)) else value)


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


class InferenceCopy:
    """An unpartitioned twin of a ZeRO-3 partitioned transformers model, refreshed in place."""

    def __init__(self, source: nn.Module) -> None:
        module = _twin(source, next(source.parameters()).device)
        if callable(getattr(module, "tie_weights", None)):
            module.tie_weights()  # to_empty allocates tied parameters apart; tie them again
        # Every name, tied ones included: a parameter the source ties is filled whatever the copy ties.
        names = dict(module.named_parameters(remove_duplicate=False))
        sources = dict(source.named_parameters(remove_duplicate=False))
        extra, missing = [n for n in sources if n not in names], [n for n in names if n not in sources]
        if extra or missing:
            what = (f"holds parameters that {type(source).__name__}(config) does not build ({_some(extra)})"
                    if extra else f"lacks parameters that its copy builds ({_some(missing)})")
            raise ValueError(
                f"zero3_gathered_inference_copy: the model {what}, e.g. layers injected by other means than "
                "its PEFT peft_config, so no copy can mirror it; turn the copy off (generation "
                "then gathers the ZeRO-3 parameters and decodes eagerly)"
            )
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
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Gather the source's parameters (collective) and copy them into the copy, in place."""
        with gathered_for_inference(self.source):
            for dst, src in self._pairs:
                dst.copy_(src)
        _mirror_adapter_state(self._adapter_layers)
