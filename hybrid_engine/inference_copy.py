"""A gathered inference copy of a ZeRO-3 model, so that decode graphs can run under ZeRO-3 too.

Why: outside a gather a ZeRO-3 parameter is a 0-element shard, and every gather
allocates new memory, so a captured graph could only replay stale addresses.
With ``hybrid_engine.zero3_gathered_inference_copy`` the engine keeps a second,
unpartitioned instance of the model, without DeepSpeed's hooks, whose
parameters live at fixed addresses on the device. After every optimizer step
the trained parameters are gathered (a collective: every rank steps) and copied
into it **in place**, so graphs captured on the copy replay the new weights
with no recapture. Generation on the copy involves no collective at all.

Cost: one full copy of the model's (low-precision) parameters and buffers per
rank, held for good, which is what ZeRO-3 exists to avoid; use it when that
copy fits beside the training state.
"""

from __future__ import annotations

import torch
from torch import nn

from .zero import gathered_for_inference

__all__ = ["InferenceCopy"]


def _set_buffer(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    owner._buffers[leaf] = value


class InferenceCopy:
    """An unpartitioned twin of a ZeRO-3 partitioned transformers model, refreshed in place."""

    def __init__(self, source: nn.Module) -> None:
        first = next(source.parameters())
        device, dtype = first.device, first.dtype
        with torch.device("meta"):
            module = type(source)(source.config)  # the same class and config, no memory yet
        module = module.to_empty(device=device).to(dtype)
        if callable(getattr(module, "tie_weights", None)):
            module.tie_weights()  # to_empty allocates tied parameters apart; tie them again
        for name, buffer in source.named_buffers():  # buffers are never partitioned
            _set_buffer(module, name, buffer.detach().clone())
        if hasattr(source, "generation_config"):
            module.generation_config = source.generation_config
        module.requires_grad_(False)
        module.eval()
        self.source = source
        self.module = module
        # Every name, tied ones included: a parameter the source ties is filled whatever the copy ties.
        names = dict(module.named_parameters(remove_duplicate=False))
        extra = [name for name, _ in source.named_parameters(remove_duplicate=False) if name not in names]
        if extra:
            raise ValueError(
                f"zero3_gathered_inference_copy: the model holds parameters that {type(source).__name__}(config) "
                f"does not build ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}), e.g. injected LoRA "
                "layers, so no copy can mirror it; turn the copy off (generation then gathers the ZeRO-3 "
                "parameters and decodes eagerly)"
            )
        self._pairs = [(names[name], src) for name, src in source.named_parameters(remove_duplicate=False)]
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Gather the source's parameters (collective) and copy them into the copy, in place."""
        with gathered_for_inference(self.source):
            for dst, src in self._pairs:
                dst.copy_(src)
