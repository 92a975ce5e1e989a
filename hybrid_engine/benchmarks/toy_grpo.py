"""The toy GRPO task the demo and ``bench soak`` share: prompts, reward, group advantages, clipped loss.

The reward of a response is the fraction of its tokens that are English words;
the loss is the clipped PPO/GRPO objective with the rollout's log-probabilities
as the old ones.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from hybrid_engine.benchmarks.options import DEMO_PROMPT_LEN

__all__ = ["CLIP", "build_model_and_tokenizer", "group_advantages", "make_prompts", "policy_loss", "rewards_of", "without_dropout", "word_token_ids"]


CLIP = 0.2  # PPO/GRPO ratio clip


def build_model_and_tokenizer(args: argparse.Namespace, device: torch.device):
    """The policy and its tokenizer: built from a tiny config with seeded weights, or loaded from a local path."""
    if args.model_path:
        from transformers import AutoTokenizer

        from hybrid_engine.benchmarks.options import load_pretrained_model

        model = load_pretrained_model(args.model_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
        except (OSError, ValueError):
            from hybrid_engine.tiny_models import build_tokenizer

            tokenizer = build_tokenizer(int(model.config.vocab_size))
    else:
        from hybrid_engine.tiny_models import build_model, build_tokenizer

        model = build_model(f"tiny-{args.model}", seed=args.seed)
        tokenizer = build_tokenizer(int(model.config.vocab_size))
    without_dropout(model)
    return model.to(device), tokenizer


def _is_dropout_rate(name: str, value: Any) -> bool:
    return isinstance(value, float) and ("dropout" in name or name.endswith("pdrop") or name == "layerdrop")


def without_dropout(model: torch.nn.Module) -> None:
    """RL fine-tuning runs without dropout: the training forward must score the very policy that sampled.
    Dropout modules, and the float rates some models apply with ``F.dropout`` (OPT's ``self.dropout``) or
    read from the config, are all set to 0."""
    configs = [getattr(model, "config", None)]
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_rate(name, value):
                setattr(module, name, 0.0)
        configs.append(getattr(module, "config", None))
    for config in {id(c): c for c in configs if c is not None}.values():
        for name, value in list(vars(config).items()):
            if _is_dropout_rate(name, value):
                setattr(config, name, 0.0)


def word_token_ids(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """A bool mask over the vocabulary: tokens that are alphabetic words of two letters or more."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid in range(min(vocab_size, len(tokenizer))):
        if tid in special:
            continue
        text = tokenizer.decode([tid]).strip()
        mask[tid] = len(text) >= 2 and text.isascii() and text.isalpha()
    return mask


def make_prompts(n: int, vocab_size: int, *, pad_id: int, special: set[int], seed: int, device: torch.device,
                 min_len: int = 4, max_len: int = DEMO_PROMPT_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random prompts of ``min_len..max_len`` tokens, left-padded, with their mask."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in special])
    ids = torch.full((n, max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((n, max_len), dtype=torch.long)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    for row, length in enumerate(lengths):
        pick = allowed[torch.randint(len(allowed), (length,), generator=gen)]
        ids[row, max_len - length:] = pick
        mask[row, max_len - length:] = 1
    return ids.to(device), mask.to(device)


def rewards_of(batch: Any, target: torch.Tensor) -> torch.Tensor:
    """Fraction of each response's real tokens (up to and including its EOS) that are in ``target``."""
    resp = batch.input_ids[:, batch.response_start_idx:].cpu()
    real = batch.attention_mask[:, batch.response_start_idx:].cpu().bool()
    hits = target[resp.clamp(min=0, max=len(target) - 1)] & real
    return hits.sum(dim=1).float() / real.sum(dim=1).clamp(min=1).float()


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: each reward minus its prompt group's mean, over the group's standard deviation."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, unbiased=False) + 1e-4)
    return adv.view(-1)


def policy_loss(engine: Any, batch: Any, advantages: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Clipped PPO/GRPO objective over response tokens; also returns max |new - old| log-prob (should be ~0)."""
    from hybrid_engine.decode.sampling import logprobs_of

    ids, mask, start = batch.input_ids, batch.attention_mask, batch.response_start_idx
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = engine(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    new_lp = logprobs_of(logits[:, start - 1:-1], ids[:, start:], temperature=1.0)
    old_lp = batch.response_logprobs.to(new_lp.device)
    real = mask[:, start:].to(new_lp.dtype)
    ratio = torch.exp(new_lp - old_lp)
    adv = advantages.to(new_lp.device).unsqueeze(1)
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    loss = -(objective * real).sum() / real.sum().clamp(min=1)
    gap = float(((new_lp.detach() - old_lp).abs() * real).max()) if real.any() else 0.0
    return loss, gap
