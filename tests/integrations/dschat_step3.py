"""A PPO step-3 trainer with DeepSpeed-Chat's call pattern, written for these tests (none of its code).

What DeepSpeed-Chat's ``DeepSpeedPPOTrainer`` asks of the actor engine, in its order: ``eval()``, then
``actor.module.generate(prompts, attention_mask=..., max_length=..., pad_token_id=..., synced_gpus=<ZeRO-3>)``
under ``no_grad``, ``train()``, teacher-forced forwards of actor and reference, rewards from a reward model and
values from a critic, a clipped policy loss through ``actor.backward``/``actor.step``, a clipped value loss
through the critic, optional ``--align_overflow`` (``optimizer.check_overflow(external=True)`` on both, then
``skip_step`` on the one that did not overflow), and ``optimizer.overflow`` read after each iteration (not
under bf16). Its throughput printer sets ``actor.module._num_params``. The actor and reference are engines
from ``hybrid_engine.initialize``; the critic and reward are plain PyTorch models (:class:`ValueModel`), the
critic trained by :class:`PlainTrainer`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid_engine.tiny_models import PAD_ID, build_model

__all__ = ["PlainTrainer", "Step3Trainer", "ValueModel", "actor_config", "actor_model", "prompts"]


def actor_model(seed: int = 1, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny OPT whose logits are spread out (final norm scaled by 20): a freshly drawn tiny model's logits
    lie within a few tenths of each other, where any two roundings disagree on the greedy token."""
    model = build_model("tiny-opt", seed=seed)
    with torch.no_grad():
        model.model.decoder.final_layer_norm.weight.mul_(20)
    return model.to(dtype)


def actor_config(precision: str, stage: int = 0, **hybrid: Any) -> dict[str, Any]:
    """DeepSpeed-Chat's actor config, shrunk: hybrid engine enabled (its switch) with graph capture on."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            precision: {"enabled": True}, "zero_optimization": {"stage": stage},
            "hybrid_engine": {"enabled": True, "enable_graph_capture": True, "max_out_tokens": 32,
                              "inference_tp_size": 1, "release_inference_cache": False,
                              "pin_parameters": True, "tp_gather_partition_size": 8, **hybrid}}


def prompts(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (DeepSpeed-Chat pads prompts on the left) and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 300, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        pad = r % 2  # every other row one pad token shorter
        ids[r, :pad], mask[r, :pad] = PAD_ID, 0
    return ids, mask


class ValueModel(nn.Module):
    """Critic / reward: a tiny OPT decoder and a value head (DeepSpeed-Chat's RewardModel shape), plain PyTorch."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rwtransformer = build_model("tiny-opt", seed=seed).model
        self.v_head = nn.Linear(self.rwtransformer.config.word_embed_proj_dim, 1, bias=False)

    def forward_value(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      return_value_only: bool = False, prompt_length: int = 0, use_cache: bool = False) -> Any:
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        values = self.v_head(hidden).squeeze(-1)
        if return_value_only:
            return values
        # The value at each row's last real token after the prompt.
        real = (input_ids[:, prompt_length:] != PAD_ID).long()
        last = prompt_length + (real * torch.arange(real.shape[1])).argmax(-1)
        return {"values": values, "chosen_end_scores": values.gather(1, last[:, None]).squeeze(1)}


class PlainTrainer:
    """A plain model with a torch optimizer, answering the engine calls the trainer makes on the critic."""

    def __init__(self, module: ValueModel, lr: float = 1e-3) -> None:
        self.module = module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr)
        self.optimizer.overflow = False  # fp32: nothing overflows, as DeepSpeed reports for its fp32 optimizer
        self.optimizer.skip_step = False
        self.optimizer.check_overflow = lambda external=False: False
        self.steps = self.skipped = 0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        if self.optimizer.skip_step:
            self.optimizer.skip_step, self.skipped = False, self.skipped + 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


class Step3Trainer:
    """PPO experience generation and training with DeepSpeed-Chat's calls on the actor engine."""

    def __init__(self, actor: Any, ref: Any, critic: PlainTrainer, reward: ValueModel, *, max_answer: int,
                 zero3: bool = False, align_overflow: bool = False, precision: str = "fp16") -> None:
        self.actor, self.ref, self.critic, self.reward = actor, ref, critic, reward
        self.max_answer, self.zero3 = max_answer, zero3
        self.align_overflow, self.precision = align_overflow, precision
        self.kl_ctl, self.clip_reward, self.cliprange, self.cliprange_value, self.gamma, self.lam = \
            0.1, 5.0, 0.2, 0.2, 1.0, 0.95
        self.overflow_log: list[tuple[bool, bool]] = []

    def eval(self) -> None:
        self.actor.eval()
        self.critic.eval()
        self.reward.eval()
        self.ref.eval()

    def train(self) -> None:
        self.actor.train()
        self.critic.train()

    def generate_experience(self, prompts: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        self.eval()
        with torch.no_grad():
            seq = self.actor.module.generate(prompts, attention_mask=mask,
                                             max_length=prompts.shape[1] + self.max_answer,
                                             pad_token_id=PAD_ID, synced_gpus=self.zero3)
        self.train()
        attention = seq.ne(PAD_ID).long()
        with torch.no_grad():
            logits = self.actor(seq, attention_mask=attention).logits
            ref_logits = self.ref(seq, attention_mask=attention).logits
            reward = self.reward.forward_value(seq, attention, prompt_length=prompts.shape[1])["chosen_end_scores"]
            values = self.critic.module.forward_value(seq, attention, return_value_only=True)[:, :-1]
        return {"prompts": prompts, "logprobs": gather_log_probs(logits[:, :-1], seq[:, 1:]),
                "ref_logprobs": gather_log_probs(ref_logits[:, :-1], seq[:, 1:]), "value": values.float(),
                "rewards": reward.float(), "input_ids": seq, "attention_mask": attention}

    def _advantages(self, values: torch.Tensor, rewards: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        last, advantages = 0.0, []
        for t in reversed(range(start, rewards.shape[1])):
            nxt = values[:, t + 1] if t < rewards.shape[1] - 1 else 0.0
            delta = rewards[:, t] + self.gamma * nxt - values[:, t]
            last = delta + self.gamma * self.lam * last
            advantages.append(last)
        adv = torch.stack(advantages[::-1], dim=1)
        return adv.detach(), (adv + values[:, start:]).detach()

    def train_rlhf(self, exp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        seq, attention, start = exp["input_ids"], exp["attention_mask"], exp["prompts"].shape[1] - 1
        action_mask = attention[:, 1:].float()
        with torch.no_grad():
            rewards = -self.kl_ctl * (exp["logprobs"] - exp["ref_logprobs"])
            rewards[:, -1] += exp["rewards"].clamp(-self.clip_reward, self.clip_reward)
            advantages, returns = self._advantages(exp["value"] * action_mask, rewards * action_mask, start)
        logits = self.actor(input_ids=seq, attention_mask=attention, use_cache=False).logits
        logprobs = gather_log_probs(logits[:, :-1], seq[:, 1:])[:, start:]
        ratio = torch.exp((logprobs - exp["logprobs"][:, start:]) * action_mask[:, start:])
        pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - self.cliprange, 1 + self.cliprange))
        actor_loss = (pg * action_mask[:, start:]).sum() / action_mask[:, start:].sum()
        self.actor.backward(actor_loss)
        if not self.align_overflow:
            self.actor.step()
        value = self.critic.module.forward_value(seq, attention, return_value_only=True, use_cache=False)[:, :-1]
        old = exp["value"][:, start:]
        clipped = value[:, start:].clamp(old - self.cliprange_value, old + self.cliprange_value)
        vf = torch.max((value[:, start:] - returns) ** 2, (clipped - returns) ** 2)
        critic_loss = 0.5 * (vf * action_mask[:, start:]).sum() / action_mask[:, start:].sum()
        self.critic.backward(critic_loss)
        if self.align_overflow:
            actor_overflow = self.actor.optimizer.check_overflow(external=True)
            critic_overflow = self.critic.optimizer.check_overflow(external=True)
            if actor_overflow and not critic_overflow:
                self.critic.optimizer.skip_step = True
            elif critic_overflow and not actor_overflow:
                self.actor.optimizer.skip_step = True
            self.actor.step()
        self.critic.step()
        return actor_loss, critic_loss

    def get_overflow(self) -> tuple[bool, bool]:
        if self.precision == "bf16":  # DeepSpeed-Chat: its bf16 optimizer keeps no overflow flag
            return False, False
        return self.actor.optimizer.overflow, self.critic.optimizer.overflow

    def iteration(self, prompts: torch.Tensor, mask: torch.Tensor) -> None:
        """One PPO iteration as DeepSpeed-Chat's main loop runs it, throughput printer included."""
        exp = self.generate_experience(prompts, mask)
        self.train_rlhf(exp)
        self.overflow_log.append(self.get_overflow())
        if not hasattr(self.actor.module, "_num_params"):  # what its print_throughput_step3 sets
            self.actor.module._num_params = sum(p.numel() for p in self.actor.module.parameters())
