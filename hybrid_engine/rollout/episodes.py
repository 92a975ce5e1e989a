"""Multi-turn episodes: model turns and environment tokens (tool results, user turns) on the same rows.

Why: agentic RL trains on trajectories that interleave the model's tokens with
the environment's, and the loss must cover the model's only. An episode row
keeps its whole history on the host (ids, which ones the model sampled, their
logprobs); each turn decodes the chosen rows' continuations through
:meth:`HybridEngineRollout.generate_turn`, with continuous batching and graphs
as any call, and :meth:`Episodes.close` returns the trajectories with an
``env_mask``.

What a turn computes: a row keeps its K/V between turns, on the pages of the
rollout's pool that its last turn filled (:class:`~hybrid_engine.decode.kv_pool.HeldPages`),
so a turn prefills only what came after them: the model's last token and the
environment's tokens, onto the same pages. A prompt's first-turn rows share
its prefill and its full pages. Held pages are evicted (oldest first) when a
call runs short, and released when the rollout's pool is; such a row is
prefilled whole at its next turn. Either way, tokens and logprobs are those of
a single-turn rollout on the concatenated history with the same request id
(row ``r``'s turn ``t`` samples as request ``t * rows + r``; with
``RolloutRequest.request_ids`` ``u``, sample ``j`` of prompt ``p`` as
``(t * U + u[p]) * n + j``, ``U = max(u) + 1``), up to the rounding of K/V
computed by decode steps instead of one prefill (none in the exact mode,
:mod:`hybrid_engine.exact`). The request's per-prompt settings (budgets, which
cap every turn, sampling knobs, stop ids, seeds) apply to every turn of that
prompt's rows.

When kept K/V are reused: only with exactly the forward that computed them.
Each turn, once it holds the model's lock (after any training call it waited
for), takes a fingerprint of what K/V depend on, and each row's kept pages
carry the fingerprint of the turn that computed them; a row whose fingerprint
differs is prefilled whole. The fingerprint is

* the engine's optimizer steps and the parameters' version counters (what the
  engine and in-place optimizers change);
* a checksum of the raw bits of every parameter, buffer and tensor attribute:
  writes through ``.data`` (weight loaders, EMA, syncs) bypass the version
  counters. Per tensor, on its device: the bits viewed as ints of their width,
  ``sum(bits[i] * m[i]) mod 2**64`` with odd multipliers ``m`` that depend on
  the position. A change of one element always changes it (``m[i]`` is odd);
  several cancel only when ``sum(delta[i] * m[i])`` is 0 mod 2**64. A float sum
  would not do: changes cancel or round away in it. It costs one read of the
  weights and one host read per turn, never per step. Where a tensor's bits
  cannot be read (a meta, sparse or quantized tensor), K/V are never reused;
* the tensors' names, dtypes, shapes and devices, and
  :func:`~hybrid_engine.graphs.fingerprint.forward_fingerprint`: hooks, autocast
  and kernel switches, the module tree and its attributes (a PEFT adapter
  enabled, disabled or merged among them), the config and the attention
  implementation;
* the exact mode (``exact_logprobs``), whose kernels compute other K/V.

:meth:`Episodes.drop_kv` remains for a change none of these shows (a
module-level function patched).

Failures: a turn that raises (an exception or ``KeyboardInterrupt``, anywhere in
its call: a model forward, scheduling, sampling, page bookkeeping, or reading the
results back) leaves its rows' histories as they were, and every page the
failed call kept goes back at once, under the model's lock (pages a call
interrupted in its own bookkeeping left referenced by nobody are reclaimed too:
:meth:`~hybrid_engine.decode.kv_pool.PageLedger.reclaim`); the rows' earlier
pages stay kept while they still hold valid K/V, so the turn can be retried.
:meth:`Episodes.close`, or the object's collection, releases the rest. (The
commit itself is a few lines of host list updates; a signal landing between
them is the one moment left.)

Threads: calls on one :class:`Episodes` may come from several threads. Rows are
the unit: a row in a turn (or a ``close``) running in another call is refused,
with a ``ValueError`` naming it, by ``turn``, ``append`` and ``close``; calls on
other rows go ahead (turns on disjoint rows run one after the other, as any
generations on one model do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_engine.decode.kv_pool import HeldPages
from hybrid_engine.generation.call_context import exclusive_model_call
from hybrid_engine.graphs.fingerprint import forward_fingerprint
from hybrid_engine.rollout.types import RolloutRequest, SamplingConfig, is_int

__all__ = ["EpisodeBatch", "Episodes", "STOP_REASONS", "TurnRows"]

#: Why a row's turn ended: an EOS id, ``max_new_tokens``, or a stop sequence or string.
STOP_REASONS = ("eos", "length", "stop")

#: A request's per-prompt settings an episode applies to every turn of that prompt's rows.
_PER_PROMPT = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed")


@dataclass
class TurnRows:
    """One turn's output rows for the rollout's ``_generate``: the prompt row each continues, its sampler counter,
    the pages it continues on (``None``: none kept), its token budget; ``kept`` receives, by output row, the
    pages it keeps (``None``: none are kept). ``guard`` (a context manager factory) runs around the work, under
    the model's lock (:meth:`HybridEngineRollout.generate_turn`)."""

    prompt_of: list[int]
    rng: list[int]
    held: list[HeldPages | None]
    kept: dict[int, HeldPages] | None = None
    budgets: list[int] | None = None  # None: the sampling's max_new_tokens for every row
    guard: Callable[[], contextlib.AbstractContextManager[None]] | None = None


def _release(held: list[HeldPages | None], *, finalizing: bool = False) -> None:
    for i, h in enumerate(held):
        if h is not None:
            held[i] = None
            h.release(wait=not finalizing)


def _finalize(held: list[HeldPages | None]) -> None:
    _release(held, finalizing=True)


def _weights_version(rollout: Any) -> tuple[Any, int]:
    """What changes when the weights do, as far as counters show: its engine's optimizer steps (DeepSpeed writes
    updates through flat buffers, unseen by the parameters' version counters) and the parameters' in-place
    updates (a plain optimizer's). Writes through ``.data`` change neither: :func:`_checksums` sees those."""
    steps = getattr(rollout.engine, "global_steps", None)
    return (steps if isinstance(steps, int) else None, sum(p._version for p in rollout.model.parameters()))


# ------------------------------------------------------------------ weights checksum
_CHUNK = 1 << 22  # elements per reduction: bounds the int64 temporaries (32 MiB each)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: spreads positions over the odd multipliers
_CHUNK_KEY = 0x2545F4914F6CDD1D  # odd: weighs each chunk's sum by its place in the tensor
_MULTIPLIERS: dict[torch.device, torch.Tensor] = {}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int64(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _multipliers(n: int, device: torch.device) -> torch.Tensor:
    """``n`` odd position multipliers on ``device`` (made once per device, grown as needed)."""
    m = _MULTIPLIERS.get(device)
    if m is None or m.numel() < n:
        m = torch.arange(1, n + 1, dtype=torch.int64, device=device).mul_(_GOLDEN).bitwise_or_(1)
        _MULTIPLIERS[device] = m
    return m[:n]


def _checksum(t: torch.Tensor) -> torch.Tensor | int | object:
    """A device int64 scalar over ``t``'s raw bits (see the module docstring), 0 for an empty tensor, or a fresh
    object (equal to nothing: K/V are never reused) where the bits cannot be read."""
    try:
        t = t.detach()
        if t.is_meta or t.layout != torch.strided or t.is_quantized:
            return object()
        if t.numel() == 0:
            return 0
        if t.is_complex():
            t = torch.view_as_real(t)
        flat = t.reshape(-1)
        kind = _INT_OF_SIZE[flat.element_size()]
        bits = flat if flat.dtype == kind else flat.view(kind)
        total = None
        for c, start in enumerate(range(0, bits.numel(), _CHUNK)):
            part = bits[start:start + _CHUNK]
            s = (part * _multipliers(part.numel(), part.device)).sum()
            if c:
                s = s * _int64(c * _CHUNK_KEY | 1)
            total = s if total is None else total + s
        return total
    except Exception:  # a dtype or tensor kind with no int view: never reuse rather than guess
        return object()


def _state_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a forward may read: parameters, buffers and plain tensor attributes (once each)."""
    out, seen = [], set()
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, module in model.named_modules():
        named += [(f"{name}.{k}" if name else k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
    for name, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _checksums(tensors: list[torch.Tensor]) -> tuple[Any, ...]:
    """Each tensor's :func:`_checksum`, read to the host once per device."""
    sums = [_checksum(t) for t in tensors]
    on_device = [i for i, s in enumerate(sums) if isinstance(s, torch.Tensor)]
    by_device: dict[torch.device, list[int]] = {}
    for i in on_device:
        by_device.setdefault(sums[i].device, []).append(i)
    out: list[Any] = list(sums)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            out[i] = value
    return tuple(out)


def _exact_mode(rollout: Any) -> tuple[Any, ...]:
    config = getattr(rollout, "config", None)
    return (getattr(rollout, "exact_logprobs", None), getattr(config, "exact_logprobs", None))


def _kv_fingerprint(rollout: Any) -> tuple[Any, ...]:
    """What a turn's K/V depend on (see the module docstring): equal fingerprints, equal K/V."""
    model = rollout.model
    named = _state_tensors(model)
    meta = tuple((name, t.dtype, tuple(t.shape), str(t.device)) for name, t in named)
    return (_weights_version(rollout), _exact_mode(rollout), meta, forward_fingerprint(model),
            _checksums([t for _, t in named]))


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
    ``reuse_kv=False``: every turn prefills its rows' whole histories (what reuse saves, measured).
    The request's per-prompt settings apply to every turn of the prompt's rows (see the module docstring)."""

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
        known = {"prompt_ids", "prompt_attention_mask", "request_ids", *_PER_PROMPT}
        for f in dataclasses.fields(request):
            if f.name not in known and getattr(request, f.name) is not None:
                raise ValueError(f"Episodes: RolloutRequest.{f.name} is not supported by episodes; leave it None")
        self.rollout = rollout
        self.reuse_kv = reuse_kv
        ids, mask = request.prompt_ids.cpu(), request.prompt_attention_mask.cpu()
        prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
        self._prompt_ids = ids.repeat_interleave(n_samples_per_prompt, 0)
        self._prompt_mask = mask.repeat_interleave(n_samples_per_prompt, 0)
        n = len(prompts) * n_samples_per_prompt
        self._n = n_samples_per_prompt
        self._prompts = [prompts[r // n_samples_per_prompt] for r in range(n)]
        # The request's per-prompt settings (copied: the caller may change the request), and request ids.
        self._per_prompt = {name: list(getattr(request, name)) for name in _PER_PROMPT
                            if getattr(request, name) is not None}
        self._uids = list(request.request_ids) if request.request_ids is not None else list(range(len(prompts)))
        self._after: list[list[int]] = [[] for _ in range(n)]  # every token after the prompt
        self._model: list[list[bool]] = [[] for _ in range(n)]
        self._logprobs: list[list[float]] = [[] for _ in range(n)]
        self._last: list[list[int]] = [[] for _ in range(n)]  # each row's last model turn
        self.turns = [0] * n
        self.open = [True] * n
        self._held: list[HeldPages | None] = [None] * n  # each row's K/V pages from its last turn
        self._stamp: list[Any] = [None] * n  # the kv_fingerprint they were computed under
        self._lock = threading.Lock()  # guards the rows' state; never held while waiting for the model
        self._busy: dict[int, str] = {}  # row -> the call (turn, close) working on it now
        self._drops = 0  # drop_kv calls so far: a turn's call that overlapped one keeps nothing
        self._finalizer = weakref.finalize(self, _finalize, self._held)

    @property
    def num_rows(self) -> int:
        return len(self.open)

    # ------------------------------------------------------------------ arguments
    def _row(self, row: Any, what: str) -> int:
        if not is_int(row):
            raise TypeError(f"Episodes.{what}: row must be an int row index, got {type(row).__name__} ({row!r})")
        if not 0 <= row < self.num_rows:
            raise ValueError(f"Episodes.{what}: row must be in 0..{self.num_rows - 1}, got {row!r} (no negative "
                             "indices)")
        return int(row)

    def _rows(self, rows: list[int] | None, what: str, arg: str = "rows") -> list[int]:
        """``rows`` checked: open, in range, each once (``None``: every open row), none in another call.
        Under ``self._lock``."""
        if rows is None:
            rows = [r for r in range(self.num_rows) if self.open[r]]
        elif not isinstance(rows, (list, tuple)) or not all(is_int(r) for r in rows):
            raise TypeError(f"Episodes.{what}: rows must be a list of int row indices, got {rows!r}")
        rows = [int(r) for r in rows]
        for r in rows:
            if not 0 <= r < self.num_rows:
                raise ValueError(f"Episodes.{what}: {arg}: row {r} is not in 0..{self.num_rows - 1} (no negative "
                                 "indices)")
            if not self.open[r]:
                raise ValueError(f"Episodes.{what}: {arg}: row {r} is closed; open a new episode to go on")
        if len(set(rows)) != len(rows):
            raise ValueError(f"Episodes.{what}: rows {rows!r} name a row twice")
        busy = [r for r in rows if r in self._busy]
        if busy:
            raise ValueError(f"Episodes.{what}: {arg}: rows {busy} are in an Episodes.{self._busy[busy[0]]} that "
                             f"has not returned (another thread's, or a hook's inside it); call {what} on them after "
                             "it does")
        return rows

    # ------------------------------------------------------------------ reads
    def history(self, row: int) -> list[int]:
        """Row ``row``'s token ids so far: its prompt, then the model's and the environment's tokens."""
        with self._lock:
            row = self._row(row, "history")
            return self._prompts[row] + self._after[row]

    def last_turn(self, row: int) -> list[int]:
        """The token ids row ``row``'s last model turn sampled (empty before its first)."""
        with self._lock:
            return list(self._last[self._row(row, "last_turn")])

    # ------------------------------------------------------------------ K/V
    def drop_kv(self) -> None:
        """Forget the K/V every row kept (each one's next turn prefills its whole history). Changed weights,
        hooks, adapters and modes are detected (see the module docstring); this is for anything else."""
        with exclusive_model_call(self.rollout.model, "Episodes.drop_kv"), self._lock:
            self._drops += 1
            for r in range(self.num_rows):
                self._stamp[r] = None  # a turn in flight on the row drops what it took too
                held = self._held[r]
                if held is not None and r not in self._busy:
                    self._held[r] = None
                    held.release()

    def _drop_stale(self, stamp: Any, rows: list[int], turn: TurnRows) -> None:
        """Under the model's lock: release the kept pages of every row (but those another call works on) whose
        K/V were computed under another fingerprint, and take them out of ``turn``."""
        same: dict[int, bool] = {}  # by id of a row's fingerprint: rows of one turn share one
        mine = set(rows)
        with self._lock:
            for r in range(self.num_rows):
                held, old = self._held[r], self._stamp[r]
                if held is None or (r in self._busy and r not in mine):
                    continue
                if id(old) not in same:
                    same[id(old)] = stamp is not None and old is not None and (old is stamp or old == stamp)
                if not same[id(old)]:
                    self._held[r] = None
                    held.release()
            turn.held = [h if h is not None and self._held[r] is h else None for r, h in zip(rows, turn.held)]

    @contextlib.contextmanager
    def _guard(self, rows: list[int], turn: TurnRows, stamped: list[Any]) -> Iterator[None]:
        """Around the turn's call, under the model's lock: check the fingerprint, and on failure give back every
        page the call kept (see the module docstring). ``stamped`` receives the fingerprint."""
        stamp = _kv_fingerprint(self.rollout) if self.reuse_kv else None
        stamped.append((stamp, self._drops))
        self._drop_stale(stamp, rows, turn)
        runner = self.rollout.runner
        ledger = runner.ledger
        before = set(ledger.held_list()) if ledger is not None else set()
        try:
            yield
        except BaseException:
            kept = list(turn.kept.values()) if turn.kept is not None else []
            if turn.kept is not None:
                turn.kept.clear()
            for held in kept:
                held.release()
            now = runner.ledger
            if now is not None:
                if now.busy:  # the call's plan did not close: no call runs now (we hold the model's lock)
                    now.end_call()
                for held in now.held_list():
                    if held not in before:  # kept by the failed call (a row it harvested) but not handed over
                        held.release()
                now.reclaim()
            raise

    # ------------------------------------------------------------------ turns
    def turn(self, sampling: SamplingConfig, rows: list[int] | None = None,
             max_new_tokens: list[int] | None = None) -> list[str]:
        """Decode one model turn for ``rows`` (default: every open row); the others wait, untouched. Returns each
        row's :data:`STOP_REASONS` entry. ``sampling.n_samples_per_prompt`` must be 1 (samples are rows).
        ``max_new_tokens``: each row's budget for this turn (at most ``sampling.max_new_tokens``). A turn that
        raises leaves the rows as they were (see the module docstring)."""
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"Episodes.turn: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if sampling.n_samples_per_prompt != 1:
            raise ValueError("Episodes.turn: sampling.n_samples_per_prompt must be 1; an episode's samples are its "
                             "rows (Episodes(..., n_samples_per_prompt=n))")
        with self._lock:
            rows = self._rows(rows, "turn")
            if not rows:
                return []
            budget = self._budgets(max_new_tokens, rows, sampling.max_new_tokens)
            rng = self._rng(rows)
            for r in rows:
                self._busy[r] = "turn"
        try:
            return self._turn(sampling, rows, budget, rng)
        finally:
            with self._lock:
                for r in rows:
                    del self._busy[r]

    def _rng(self, rows: list[int]) -> dict[int, int]:
        """Each row's sampler counter this turn (see the module docstring)."""
        span = max(self._uids) + 1
        rng = {r: (self.turns[r] * span + self._uids[r // self._n]) * self._n + r % self._n for r in rows}
        if max(rng.values()) >= 1 << 63:
            raise ValueError(f"Episodes.turn: RolloutRequest.request_ids up to {span - 1} over {max(self.turns)} "
                             "turns overflow the int64 sampler counters; use smaller request_ids")
        return rng

    def _turn(self, sampling: SamplingConfig, asked: list[int], budget: dict[int, int],
              rng: dict[int, int]) -> list[str]:
        # The rows are this call's (busy): nobody else changes their state until it returns.
        # One prompt row per first-turn prompt (its rows share its prefill and pages), one per later row.
        rows = sorted(asked, key=lambda r: (self._after[r] != [], r // self._n if not self._after[r] else r))
        key_of = {r: ("prompt", r // self._n) if not self._after[r] else ("row", r) for r in rows}
        prompts = list(dict.fromkeys(key_of.values()))
        first = {k: next(r for r in rows if key_of[r] == k) for k in prompts}
        histories = [self._prompts[first[k]] + self._after[first[k]] for k in prompts]
        width = max(len(h) for h in histories)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, h in enumerate(histories):
            ids[i, width - len(h):] = torch.tensor(h)
            mask[i, width - len(h):] = 1
        source = [first[k] // self._n for k in prompts]  # each prompt row's prompt in the request
        settings = {name: [values[p] for p in source] for name, values in self._per_prompt.items()}
        caps = self._per_prompt.get("max_new_tokens")
        if caps is not None:
            budget = {r: min(b, caps[r // self._n]) for r, b in budget.items()}
        device = self.rollout.model.device
        request = RolloutRequest(ids.to(device), mask.to(device), **settings)
        lengths = {r: len(self._prompts[r]) + len(self._after[r]) for r in rows}
        held = [h if h is not None and h.tokens < lengths[r] else None for r, h in ((r, self._held[r]) for r in rows)]
        turn = TurnRows([prompts.index(key_of[r]) for r in rows], [rng[r] for r in rows], held,
                        {} if self.reuse_kv else None, [budget[r] for r in rows])
        stamped: list[Any] = []
        turn.guard = functools.partial(self._guard, rows, turn, stamped)
        handed = False  # the kept pages went to their rows
        try:
            batch = self.rollout.generate_turn(request, sampling, turn)
            eos_ids = self.rollout.eos_token_ids
            n_new = batch.response_lengths.tolist()
            tokens = batch.responses.cpu().tolist()
            logprobs = batch.response_logprobs.cpu().tolist()
            reasons = {}
            with self._lock:  # the commit: plain host work, every row or none
                stamp, drops = stamped[0] if stamped else (None, -1)
                keep = turn.kept is not None and drops == self._drops  # no drop_kv since the fingerprint
                kept = [turn.kept.get(i) if keep else None for i in range(len(rows))]
                for i, r in enumerate(rows):
                    n = n_new[i]
                    self._after[r] += tokens[i][:n]
                    self._last[r] = tokens[i][:n]
                    self._model[r] += [True] * n
                    self._logprobs[r] += logprobs[i][:n]
                    self.turns[r] += 1
                    reasons[r] = ("eos" if n and tokens[i][n - 1] in eos_ids else
                                  "length" if n >= budget[r] else "stop")
                    old, self._held[r], self._stamp[r] = self._held[r], kept[i], stamp
                    if old is not None and old is not kept[i]:
                        old.release()  # taken over by the call (a no-op) or not reused
                handed = keep
        finally:
            turn.guard = None  # no cycle through the turn: the episode is freed (and its pages) when dropped
            if not handed and turn.kept is not None:
                for h in turn.kept.values():  # a failure after the call, or a drop_kv during it: pages go back
                    h.release()
        return [reasons[r] for r in asked]

    @staticmethod
    def _budgets(given: Any, rows: list[int], most: int) -> dict[int, int]:
        if given is None:
            return dict.fromkeys(rows, most)
        if not isinstance(given, (list, tuple)) or len(given) != len(rows) or not all(is_int(b) for b in given):
            raise TypeError(f"Episodes.turn: max_new_tokens must be a list of ints, one per row ({len(rows)}), got "
                            f"{given!r}")
        if any(not 1 <= b <= most for b in given):
            raise ValueError(f"Episodes.turn: max_new_tokens must lie in 1..sampling.max_new_tokens ({most}), got "
                             f"{list(given)!r}")
        return {r: int(b) for r, b in zip(rows, given)}

    def append(self, row: int, token_ids: Any) -> None:
        """Add environment tokens (a tool result, a user turn) to ``row``: in its history for the next turn, with
        ``env_mask`` 0 and no logprob."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.is_meta:
                raise ValueError("Episodes.append: token_ids is a meta tensor (a shape without data); pass real "
                                 "token ids")
            if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
                raise TypeError(f"Episodes.append: token_ids must hold integer token ids, got dtype {token_ids.dtype}")
            token_ids = token_ids.detach().flatten().tolist()
        if not isinstance(token_ids, (list, tuple)) or not token_ids or not all(
                is_int(t) and t >= 0 for t in token_ids):
            raise TypeError(f"Episodes.append: token_ids must be a non-empty list of token ids >= 0, got "
                            f"{token_ids!r}")
        token_ids = [int(t) for t in token_ids]
        vocab = getattr(self.rollout.model.config, "vocab_size", None)
        if vocab is not None and max(token_ids) >= vocab:
            raise ValueError(f"Episodes.append: token id {max(token_ids)} is outside the model's vocabulary "
                             f"({vocab} ids)")
        with self._lock:
            (row,) = self._rows([self._row(row, "append")], "append", "row")
            self._after[row] += token_ids
            self._model[row] += [False] * len(token_ids)
            self._logprobs[row] += [0.0] * len(token_ids)

    def close(self, rows: list[int] | None = None) -> EpisodeBatch:
        """End ``rows`` (default: every open row) and return their trajectories; the others stay open."""
        with self._lock:
            rows = self._rows(rows, "close")
            for r in rows:
                self._busy[r] = "close"
        try:
            with exclusive_model_call(self.rollout.model, "Episodes.close"), self._lock:
                for r in rows:
                    _release(self._held[r:r + 1])
                    self._held[r] = None
                    self._stamp[r] = None
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
            index = torch.tensor(rows, dtype=torch.int64)
            batch = EpisodeBatch(self._prompt_ids.index_select(0, index), self._prompt_mask.index_select(0, index),
                                 ids, mask, env, lp, rows, [self.turns[r] for r in rows])
            with self._lock:
                for r in rows:
                    self.open[r] = False
            return batch
        finally:
            with self._lock:
                for r in rows:
                    del self._busy[r]
