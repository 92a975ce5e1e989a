"""A LoRA layer injected by hand, after DeepSpeed-Chat's ``LinearLayer_LoRA`` pattern (written for these tests, not
DeepSpeed-Chat's code): the layers a model's config does not build, which the ZeRO-3 inference copy copies
structurally (``hybrid_engine/distributed/inference_copy.py``)."""

from __future__ import annotations

import torch

__all__ = ["HandLoRA", "inject_hand_lora"]


class HandLoRA(torch.nn.Module):
    """Takes the base layer's own weight, adds a low-rank branch, and can fuse the branch into the weight in place."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2, scaling: float = 0.5) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        g = torch.Generator().manual_seed(7)
        self.lora_right_weight = torch.nn.Parameter(torch.randn(base.in_features, rank, generator=g) * 0.2)
        self.lora_left_weight = torch.nn.Parameter(torch.randn(rank, base.out_features, generator=g) * 0.2)
        self.lora_scaling = scaling
        self.fuse_lora = False

    def fuse_lora_weight(self) -> None:
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * (self.lora_right_weight @ self.lora_left_weight).t()
        self.fuse_lora = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, self.weight, self.bias)
        return out if self.fuse_lora else out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def inject_hand_lora(llama: torch.nn.Module) -> torch.nn.Module:
    """``HandLoRA`` on the q and v projections of every layer of a transformers Llama model."""
    for layer in llama.model.layers:
        layer.self_attn.q_proj = HandLoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = HandLoRA(layer.self_attn.v_proj)
    return llama
