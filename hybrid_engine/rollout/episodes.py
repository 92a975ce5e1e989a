"""Multi-turn episodes: model turns and environment tokens (tool results, user turns) on the same rows.

Why: agentic RL trains on trajectories that interleave the model's tokens with
the environment's, and the loss must cover the model's only. An episode row
keeps its whole history on the host (ids, which ones the model sampled, their
logprobs); each turn decodes the chosen rows' continuations through
:meth:`HybridEngineRollout.generate`, with continuous batching and graphs as
any call, and :meth:`Episodes.close` returns the trajectories with an
``env_mask``.

What a turn computes: a row keeps its K/V between turns, on the pages of the
rollout's pool that its last turn filled (:class:`~hybrid_engine.decode.kv_pool.HeldPages`),
so a turn prefills only what came after them: the model's last token and the
environment's tokens, onto the same pages. A prompt's first-turn rows share
its prefill and its full pages. Held pages are evicted (oldest first) when a
call runs short, and dropped when the weights change or the rollout's pool is
released; such a row is prefilled whole at its next turn. Either way, tokens
and logprobs are those of a single-turn rollout on the concatenated history
with the same request id (row ``r``'s turn ``t`` samples as request
``t * rows + r``), up to the rounding of K/V computed by decode steps instead
of one prefill (none in the exact mode, :mod:`hybrid_engine.exact`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_engine.decode.kv_pool import HeldPages
from hybrid_engine.generation.call_context import exclusive_generation
from hybrid_engine.rollout.types import RolloutRequest, SamplingConfig

__all__ = ["EpisodeBatch", "Episodes", "STOP_REASONS", "TurnRows"]

#: Why a row's turn ended: an EOS id, ``max_new_tokens``, or a stop sequence or string.
STOP_REASONS = ("eos", "length", "stop")


@dataclass
class TurnRows:
    """One turn's output rows for the rollout's ``_generate``: the prompt row each continues, its sampler counter,
    the pages it continues on (``None``: none kept), its token budget; ``kept`` receives, by output row, the
    pages it keeps (``None``: none are kept)."""

    prompt_of: list[int]
    rng: list[int]
    held: list[HeldPages | None]
    kept: dict[int, HeldPages] | None = None
    budgets: list[int] | None = None  # None: the sampling's max_new_tokens for every row


def _release(held: list[HeldPages | None]) -> None:
    for i, h in enumerate(held):
        if h is not None:
            h.release()
            held[i] = None


def _weights_version(rollout: Any) -> tuple[Any, int]:
    """What changes when the weights do, as far as the rollout can see: its engine's optimizer steps (DeepSpeed
    writes updates through flat buffers, unseen by the parameters' version counters) and the parameters'
    in-place updates (a plain optimizer's). K/V held between turns were computed with their turn's weights."""
    steps = getattr(rollout.engine, "global_steps", None)
    return (steps if isinstance(steps, int) else None, sum(p._version for p in rollout.model.parameters()))


@dataclass
class EpisodeBatch:
    """Closed episodes, one row each: the prompt as given (left-padded), then everything after it.

    ``completion_ids``/``completion_mask`` ``[R, C]`` (right-padded) hold the model's and the
    environment's tokens in order; ``env_mask`` is 1 on the model's tokens and 0 on the environment's
    (and on padding); ``completion_logprobs`` holds the model tokens' logprobs, 0 elsewhere.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    env_mask: torch.Tensor
    completion_logprobs: torch.Tensor
    rows: list[int]
    turns: list[int]

    def training_inputs(self) -> dict[str, torch.Tensor]:
        """``engine(**batch.training_inputs())``'s inputs: ``labels`` on the model's tokens only (-100 on the prompt,
        the environment's tokens and padding), position ids from each row's first real token."""
        ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.completion_mask], dim=1)
        model = torch.cat([torch.zeros_like(self.prompt_mask, dtype=torch.bool), self.env_mask.bool()], dim=1)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0),
                "labels": ids.masked_fill(~model, -100)}


class Episodes:
    """Open episodes on ``rollout`` (a :class:`~hybrid_engine.rollout.HybridEngineRollout`; made by its
    ``open_episodes``): ``n_samples_per_prompt`` rows per prompt of ``request``, in order ``prompt * n +
    sample``. :meth:`turn` decodes, :meth:`append` adds environment tokens, :meth:`close` ends.
    ``reuse_kv=False``: every turn prefills its rows' whole histories (what reuse saves, measured)."""

    def __init__(self, rollout: Any, request: RolloutRequest, n_samples_per_prompt: int = 1, *,
                 reuse_kv: bool = True) -> None:
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"Episodes: request must be a RolloutRequest, got {type(request).__name__}")
        if not isinstance(n_samples_per_prompt, int) or isinstance(n_samples_per_prompt, bool) \
                or n_samples_per_prompt < 1:
            raise ValueError(f"Episodes: n_samples_per_prompt must be a positive int, got {n_samples_per_prompt!r}")
        if not isinstance(reuse_kv, bool):
            raise TypeError(f"Episodes: reuse_kv must be a bool, got {reuse_kv!r}")
        request.validate()
        self.rollout = rollout
        self.reuse_kv = reuse_kv
        ids, mask = request.prompt_ids.cpu(), request.prompt_attention_mask.cpu()
        prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
        self._prompt_ids = ids.repeat_interleave(n_samples_per_prompt, 0)
        self._prompt_mask = mask.repeat_interleave(n_samples_per_prompt, 0)
        n = len(prompts) * n_samples_per_prompt
        self._n = n_samples_per_prompt
        self._prompts = [prompts[r // n_samples_per_prompt] for r in range(n)]
        self._after: list[list[int]] = [[] for _ in range(n)]  # every token after the prompt
        self._model: list[list[bool]] = [[] for _ in range(n)]
        self._logprobs: list[list[float]] = [[] for _ in range(n)]
        self._last: list[list[int]] = [[] for _ in range(n)]  # each row's last model turn
        self.turns = [0] * n
        self.open = [True] * n
        self._held: list[HeldPages | None] = [None] * n  # each row's K/V pages from its last turn
        self._version: tuple[Any, int] | None = None  # the weights' version when they were computed
        self._finalizer = weakref.finalize(self, _release, self._held)

    @property
    def num_rows(self) -> int:
        return len(self.open)

    def _rows(self, rows: list[int] | None, what: str) -> list[int]:
        if rows is None:
            return [r for r in range(self.num_rows) if self.open[r]]
        if not isinstance(rows, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                          for r in rows):
            raise TypeError(f"Episodes.{what}: rows must be a list of row indices, got {rows!r}")
        for r in rows:
            if not 0 <= r < self.num_rows:
                raise ValueError(f"Episodes.{what}: row {r} is not in 0..{self.num_rows - 1}")
            if not self.open[r]:
                raise ValueError(f"Episodes.{what}: row {r} is closed; open a new episode to go on")
        if len(set(rows)) != len(rows):
            raise ValueError(f"Episodes.{what}: rows {rows!r} name a row twice")
        return list(rows)

    def history(self, row: int) -> list[int]:
        """Row ``row``'s token ids so far: its prompt, then the model's and the environment's tokens."""
        return self._prompts[row] + self._after[row]

    def drop_kv(self) -> None:
        """Forget the K/V every row kept (each one's next turn prefills its whole history): for weights changed
        where the rollout cannot see it (a trainer of its own stepping the model)."""
        with exclusive_generation(self.rollout.model, "Episodes.drop_kv"):
            _release(self._held)

    def last_turn(self, row: int) -> list[int]:
        """The token ids row ``row``'s last model turn sampled (empty before its first)."""
        return list(self._last[row])

    def turn(self, sampling: SamplingConfig, rows: list[int] | None = None,
             max_new_tokens: list[int] | None = None) -> list[str]:
        """Decode one model turn for ``rows`` (default: every open row); the others wait, untouched. Returns each
        row's :data:`STOP_REASONS` entry. ``sampling.n_samples_per_prompt`` must be 1 (samples are rows).
        ``max_new_tokens``: each row's budget for this turn (at most ``sampling.max_new_tokens``)."""
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"Episodes.turn: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if sampling.n_samples_per_prompt != 1:
            raise ValueError("Episodes.turn: sampling.n_samples_per_prompt must be 1; an episode's samples are its "
                             "rows (Episodes(..., n_samples_per_prompt=n))")
        rows = asked = self._rows(rows, "turn")
        if not rows:
            return []
        budget = self._budgets(max_new_tokens, rows, sampling.max_new_tokens)
        version = _weights_version(self.rollout)
        if version != self._version:  # K/V of other weights: the rows are prefilled whole
            _release(self._held)
            self._version = version
        # One prompt row per first-turn prompt (its rows share its prefill and pages), one per later row.
        rows = sorted(rows, key=lambda r: (self._after[r] != [], r // self._n if not self._after[r] else r))
        key_of = {r: ("prompt", r // self._n) if not self._after[r] else ("row", r) for r in rows}
        prompts = list(dict.fromkeys(key_of.values()))
        histories = [self.history(next(r for r in rows if key_of[r] == k)) for k in prompts]
        width = max(len(h) for h in histories)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, h in enumerate(histories):
            ids[i, width - len(h):] = torch.tensor(h)
            mask[i, width - len(h):] = 1
        device = self.rollout.model.device
        held = [self._held[r] if self._held[r] is not None and self._held[r].tokens < len(self.history(r)) else None
                for r in rows]
        turn = TurnRows([prompts.index(key_of[r]) for r in rows], [self.turns[r] * self.num_rows + r for r in rows],
                        held, {} if self.reuse_kv else None, [budget[r] for r in rows])
        request = RolloutRequest(ids.to(device), mask.to(device))
        try:
            batch = self.rollout.generate_turn(request, sampling, turn)
        finally:
            for r in rows:  # what the turn did not take over goes back; each row keeps what its turn left
                if self._held[r] is not None:
                    self._held[r].release()
                self._held[r] = None
        for i, r in enumerate(rows):
            self._held[r] = None if turn.kept is None else turn.kept.pop(i, None)
        eos_ids = self.rollout.eos_token_ids
        lengths = batch.response_lengths.tolist()
        tokens = batch.responses.cpu().tolist()
        logprobs = batch.response_logprobs.cpu().tolist()
        reasons = {}
        for i, r in enumerate(rows):
            n = lengths[i]
            self._after[r] += tokens[i][:n]
            self._last[r] = tokens[i][:n]
            self._model[r] += [True] * n
            self._logprobs[r] += logprobs[i][:n]
            self.turns[r] += 1
            reasons[r] = ("eos" if n and tokens[i][n - 1] in eos_ids else
                          "length" if n >= budget[r] else "stop")
        return [reasons[r] for r in asked]

    @staticmethod
    def _budgets(given: Any, rows: list[int], most: int) -> dict[int, int]:
        if given is None:
            return dict.fromkeys(rows, most)
        if not isinstance(given, (list, tuple)) or len(given) != len(rows) or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in given):
            raise TypeError(f"Episodes.turn: max_new_tokens must be a list of ints, one per row ({len(rows)}), got "
                            f"{given!r}")
        if any(not 1 <= b <= most for b in given):
            raise ValueError(f"Episodes.turn: max_new_tokens must lie in 1..sampling.max_new_tokens ({most}), got "
                             f"{list(given)!r}")
        return dict(zip(rows, given))

    def append(self, row: int, token_ids: Any) -> None:
        """Add environment tokens (a tool result, a user turn) to ``row``: in its history for the next turn, with
        ``env_mask`` 0 and no logprob."""
        (row,) = self._rows([row], "append")
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.flatten().tolist()
        if not isinstance(token_ids, (list, tuple)) or not token_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
            raise TypeError(f"Episodes.append: token_ids must be a non-empty list of token ids >= 0, got "
                            f"{token_ids!r}")
        vocab = getattr(self.rollout.model.config, "vocab_size", None)
        if vocab is not None and max(token_ids) >= vocab:
            raise ValueError(f"Episodes.append: token id {max(token_ids)} is outside the model's vocabulary "
                             f"({vocab} ids)")
        self._after[row] += list(token_ids)
        self._model[row] += [False] * len(token_ids)
        self._logprobs[row] += [0.0] * len(token_ids)

    def close(self, rows: list[int] | None = None) -> EpisodeBatch:
        """End ``rows`` (default: every open row) and return their trajectories; the others stay open."""
        rows = self._rows(rows, "close")
        with exclusive_generation(self.rollout.model, "Episodes.close"):
            _release([self._held[r] for r in rows])
            for r in rows:
                self._held[r] = None
        width = max((len(self._after[r]) for r in rows), default=0)
        shape = (len(rows), width)
        ids = torch.zeros(shape, dtype=torch.int64)
        mask = torch.zeros(shape, dtype=torch.int64)
        env = torch.zeros(shape, dtype=torch.int64)
        lp = torch.zeros(shape, dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(self._after[r])
            ids[i, :n] = torch.tensor(self._after[r], dtype=torch.int64)
            mask[i, :n] = 1
            env[i, :n] = torch.tensor(self._model[r], dtype=torch.int64)
            lp[i, :n] = torch.tensor(self._logprobs[r], dtype=torch.float32)
            self.open[r] = False
        index = torch.tensor(rows, dtype=torch.int64)
        return EpisodeBatch(self._prompt_ids.index_select(0, index), self._prompt_mask.index_select(0, index),
                            ids, mask, env, lp, rows, [self.turns[r] for r in rows])
