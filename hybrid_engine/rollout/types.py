"""Public value types of the rollout engine, validated on construction.

Every check that can fail runs here, before the engine touches the model or
its cache: a bad call raises a ``ValueError``/``TypeError`` naming the argument
and the fix, and leaves captured graphs and device state exactly as they were,
so the next valid call just works.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from hybrid_engine.config.schema import MAX_CACHE_TOKENS
from hybrid_engine.decode.kv_pool import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from hybrid_engine.decode.sampling import LOGPROB_MODES, validate_sampling
from hybrid_engine.decode.slots import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES
from hybrid_engine.generation.token_ids import MAX_TOKEN_ID

#: The most ranked alternatives a rollout reports per position.
MAX_TOP_LOGPROBS = 64

__all__ = ["DEFAULT_MAX_BATCH_SIZE", "MAX_CACHE_TOKENS", "MAX_SLOTS", "RolloutBatch", "RolloutConfig", "RolloutRequest",
           "SamplingConfig"]


def is_int(value: object) -> bool:
    """An int (or other integral number), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(owner: str, name: str, value: object, *, minimum: int, maximum: int | None = None,
               allow_none: bool = False, hint: str = "") -> None:
    if value is None and allow_none:
        return
    if not is_int(value):
        none = " or None" if allow_none else ""
        raise TypeError(f"{owner}: {name} must be an int{none}, got {type(value).__name__} ({value!r})")
    if value < minimum:  # type: ignore[operator]
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:  # type: ignore[operator]
        raise ValueError(f"{owner}: {name} must be <= {maximum}, got {value!r}{hint}")


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {type(value).__name__} ({value!r})")


#: Concurrently decoding slots when ``RolloutConfig.max_batch_size`` is ``None`` (and no ``graph_batch_sizes``):
#: a GRPO step's thousands of requests would otherwise each get a slot, a KV row and, every 8, a captured bucket.
DEFAULT_MAX_BATCH_SIZE = 256


#: The most concurrently decoding slots (``max_batch_size``) and the largest graph bucket (``graph_batch_sizes``)
#: a ``RolloutConfig`` takes: the decode buffers hold a KV row of ``cache_capacity`` tokens for every slot of the
#: largest bucket a call uses, allocated up front, so a mistyped size would be an allocator error.
MAX_SLOTS = 2**16


@dataclass(frozen=True)
class RolloutConfig:
    """How the rollout engine runs (not what it samples; see :class:`SamplingConfig`).

    ``max_batch_size`` is the number of concurrently decoding slots (``None``: the
    largest ``graph_batch_sizes`` entry, else :data:`DEFAULT_MAX_BATCH_SIZE`; a request
    with fewer rows uses fewer). ``cache_capacity`` is the per-row KV length (``None``: the
    longest prompt plus ``max_new_tokens``). ``graph_batch_sizes`` are the captured
    bucket sizes (``None``: 1, 2, 4, 8, then multiples of 8). ``sync_interval`` is
    the number of decode steps between two reads of the finished flags on the
    host (the only per-step-loop host synchronisation).

    K/V live in pages of ``kv_page_size`` tokens in one pool per rollout. The
    pool holds ``kv_cache_tokens`` tokens, or ``kv_cache_bytes`` bytes; unset,
    as many as every slot and staged prompt of the call could hold at once
    (never more than contiguous rows of ``cache_capacity`` would take). When a
    configured pool runs dry, running requests are preempted and resumed later
    with the same tokens. ``cache_capacity`` stays the longest sequence a row may
    reach; it no longer sizes the memory.

    ``exact_logprobs=True`` runs batch-invariant kernels (:mod:`hybrid_engine.exact`): a
    response token's logprob is then bit-for-bit what the engine's training forward in
    that mode (``hybrid_engine.exact_logprobs``, or :func:`hybrid_engine.exact_forward`)
    computes, whatever the batch, slot, bucket or admission round; ``None`` follows the
    engine's ``hybrid_engine.exact_logprobs`` (off for a bare model). The mode is fixed when the
    rollout is built (the model is checked for it then): a config assigned to ``rollout.config``
    later may leave it ``None`` or repeat it; for the other mode, build a new rollout.
    """

    use_graph_capture: bool = False
    continuous_batching: bool = True
    max_batch_size: int | None = None
    cache_capacity: int | None = None
    use_shared_prefill: bool = True
    graph_batch_sizes: tuple[int, ...] | None = None
    enable_profiling: bool = False
    pad_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    sync_interval: int = 4
    kv_page_size: int = DEFAULT_PAGE_SIZE
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    exact_logprobs: bool | None = None

    def __post_init__(self) -> None:
        owner = "RolloutConfig"
        if self.exact_logprobs is not None:
            _check_bool(owner, "exact_logprobs", self.exact_logprobs)
        for name in ("use_graph_capture", "continuous_batching", "use_shared_prefill", "enable_profiling"):
            _check_bool(owner, name, getattr(self, name))
        slots_hint = (f" (2**16): every slot of the largest bucket a call uses gets a KV row of cache_capacity "
                      f"tokens, allocated up front; use at most {MAX_SLOTS}, or None for the default")
        _check_int(owner, "max_batch_size", self.max_batch_size, minimum=1, maximum=MAX_SLOTS, allow_none=True,
                   hint=slots_hint)
        # Also checked against the model's position limit where it is used (HybridEngineRollout.generate).
        _check_int(owner, "cache_capacity", self.cache_capacity, minimum=2, maximum=MAX_CACHE_TOKENS, allow_none=True,
                   hint=" (2**24): it is the KV length of every slot, allocated up front; use the longest prompt plus "
                        "max_new_tokens, within the model's position limit, or None to size it per call")
        _check_int(owner, "pad_token_id", self.pad_token_id, minimum=0, maximum=MAX_TOKEN_ID, allow_none=True)
        _check_int(owner, "sync_interval", self.sync_interval, minimum=1)
        _check_int(owner, "kv_page_size", self.kv_page_size, minimum=1, maximum=MAX_PAGE_SIZE)
        _check_int(owner, "kv_cache_tokens", self.kv_cache_tokens, minimum=1, allow_none=True)
        _check_int(owner, "kv_cache_bytes", self.kv_cache_bytes, minimum=1, allow_none=True)
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise ValueError(f"{owner}: set kv_cache_tokens or kv_cache_bytes, not both (they size the same pool)")
        eos = self.eos_token_id
        if eos is not None and not is_int(eos):
            if not isinstance(eos, (list, tuple)) or not eos:
                raise TypeError(f"{owner}: eos_token_id must be an int, a non-empty list of ints or None, got {eos!r}")
            for e in eos:
                _check_int(owner, "eos_token_id", e, minimum=0, maximum=MAX_TOKEN_ID)
            object.__setattr__(self, "eos_token_id", tuple(int(e) for e in eos))
        elif eos is not None:
            _check_int(owner, "eos_token_id", eos, minimum=0, maximum=MAX_TOKEN_ID)
        sizes = self.graph_batch_sizes
        if sizes is not None:
            if not isinstance(sizes, (list, tuple)) or not sizes:
                raise TypeError(f"{owner}: graph_batch_sizes must be a non-empty list of ints or None, got {sizes!r}")
            for s in sizes:
                _check_int(owner, "graph_batch_sizes", s, minimum=1, maximum=MAX_SLOTS, hint=slots_hint)
            object.__setattr__(self, "graph_batch_sizes", tuple(sorted({int(s) for s in sizes})))
            if self.max_batch_size is not None and max(sizes) < self.max_batch_size:
                raise ValueError(
                    f"{owner}: the largest graph_batch_sizes entry ({max(sizes)}) is below max_batch_size "
                    f"({self.max_batch_size}); add a bucket >= max_batch_size or lower max_batch_size"
                )


def _stop_sequences(owner: str, value: object) -> tuple[tuple[int, ...], ...]:
    fix = (f"pass a list of token-id lists, e.g. stop_token_ids=[[13, 198]], at most {MAX_STOP_SEQUENCES} of 1 to "
           f"{MAX_STOP_LENGTH} ids each")
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{owner}: stop_token_ids must be a list of token-id lists, got {value!r}; {fix}")
    out = []
    for seq in value:
        if isinstance(seq, (str, bytes)) or not isinstance(seq, (list, tuple)) or not seq \
                or not all(is_int(i) and i >= 0 for i in seq):
            raise TypeError(f"{owner}: each stop_token_ids entry must be a non-empty list of token ids >= 0, got "
                            f"{seq!r}; {fix}")
        out.append(tuple(int(i) for i in seq))
    if len(out) > MAX_STOP_SEQUENCES or any(len(q) > MAX_STOP_LENGTH for q in out):
        raise ValueError(f"{owner}: stop_token_ids has {len(out)} sequences of up to "
                         f"{max(map(len, out), default=0)} ids; {fix}")
    return tuple(out)


MAX_STOP_STRING_CHARS = 256


def _stop_strings(owner: str, value: object) -> tuple[str, ...]:
    fix = f'pass a list of strings, e.g. stop_strings=["</tool>"], at most {MAX_STOP_SEQUENCES}'
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{owner}: stop_strings must be a list of strings, got {value!r}; {fix}")
    if len(value) > MAX_STOP_SEQUENCES or any(not 1 <= len(v) <= MAX_STOP_STRING_CHARS for v in value):
        raise ValueError(f"{owner}: stop_strings must hold at most {MAX_STOP_SEQUENCES} strings of 1 to "
                         f"{MAX_STOP_STRING_CHARS} characters, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class SamplingConfig:
    """What to sample. ``temperature=0`` is greedy; ``top_k`` -1 or 0 and ``top_p=1`` disable those filters.

    Sample ``j`` of prompt ``i`` is request ``i * n_samples_per_prompt + j``; its
    tokens depend only on ``(seed, request, token index, logits)``.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    seed: int = 0
    #: ``"sampling"``: each logprob under the distribution sampled from (after top-k / top-p, renormalised);
    #: ``"full"``: under the full softmax at the temperature, as a training forward's ``log_softmax(logits / T)``.
    logprobs: str = "sampling"
    #: The k most likely ids and their logprobs at every response position, for distillation
    #: (``RolloutBatch.top_logprob_ids`` / ``top_logprobs``); 0: none. At most 64.
    top_logprobs: int = 0
    #: Token sequences that end a response once it ends in one of them (kept in it, as an EOS is), matched on
    #: the device at every step; at most 16 sequences of 1 to 16 tokens.
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    #: Strings that end a response once its decoded text holds one (the completing token is kept, later ones
    #: dropped), checked on the host every ``sync_interval`` steps with the rollout's tokenizer; a string
    #: split across tokens counts. At most 16 strings of 1 to 256 characters.
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        owner = "SamplingConfig"
        object.__setattr__(self, "stop_strings", _stop_strings(owner, self.stop_strings))
        if self.logprobs not in LOGPROB_MODES:
            raise ValueError(f'{owner}: logprobs must be "sampling" (under the distribution sampled from) or "full" '
                             f"(under the full softmax at the temperature), got {self.logprobs!r}")
        _check_int(owner, "max_new_tokens", self.max_new_tokens, minimum=1)
        _check_int(owner, "n_samples_per_prompt", self.n_samples_per_prompt, minimum=1)
        _check_int(owner, "seed", self.seed, minimum=-(1 << 63))
        if not -(1 << 63) <= self.seed < (1 << 63):
            raise ValueError(f"{owner}: seed must fit in int64, got {self.seed!r}")
        try:
            validate_sampling(self.temperature, self.top_p, self.top_k)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{owner}: {exc}") from None
        _check_int(owner, "top_logprobs", self.top_logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS)
        object.__setattr__(self, "stop_token_ids", _stop_sequences(owner, self.stop_token_ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "top_k", int(self.top_k))


@dataclass
class RolloutRequest:
    """Left-padded prompts ``prompt_ids`` ``[B, T]`` with their 0/1 ``prompt_attention_mask``.

    ``max_new_tokens`` optionally gives each prompt its own response budget (a
    list of ``B`` ints), capped by :attr:`SamplingConfig.max_new_tokens`.
    ``request_ids`` optionally gives each prompt a stable id (distinct ints >= 0,
    e.g. dataset indices; default ``0..B-1``): sample ``j`` of the prompt with id
    ``u`` draws its randomness from request index ``u * n_samples_per_prompt + j``,
    so the same prompt with the same id samples the same tokens in any order.

    A request may hold no prompts (``[0, T]``): a data-parallel rank whose shard
    is empty (:func:`hybrid_engine.distributed.ranks.shard` with fewer prompts than ranks)
    still makes the call, as it must under ZeRO-3, where the call gathers the
    parameters collectively, and gets an empty batch.
    """

    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor | None = None
    max_new_tokens: list[int] | None = field(default=None)
    request_ids: list[int] | None = field(default=None)
    #: Per-prompt sampling (lists of ``B``; ``None`` entries or lists take the SamplingConfig's value): knobs,
    #: stop sequences and seed. A call mixing settings replays one graph, of the filters any of them needs; at
    #: most 64 distinct (temperature, top_p, top_k, stops) settings.
    temperature: list[float | None] | None = field(default=None)
    top_p: list[float | None] | None = field(default=None)
    top_k: list[int | None] | None = field(default=None)
    stop_token_ids: list[list[list[int]] | None] | None = field(default=None)
    seed: list[int | None] | None = field(default=None)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise) the fields; :meth:`HybridEngineRollout.generate` calls it again, so a request
        changed after construction is refused as a bad one would have been."""
        owner = "RolloutRequest"
        ids = self.prompt_ids
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{owner}: prompt_ids must be a torch.Tensor of token ids [batch, seq], got {type(ids).__name__}")
        if ids.dim() != 2:
            raise ValueError(
                f"{owner}: prompt_ids must be 2-D [batch, seq], got shape {tuple(ids.shape)}; "
                "for one prompt use prompt_ids.unsqueeze(0)"
            )
        if ids.shape[1] == 0:
            raise ValueError(f"{owner}: prompt_ids must have at least one token per prompt, got {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{owner}: prompt_ids must hold integer token ids, got dtype {ids.dtype}")
        mask = self.prompt_attention_mask
        if mask is None:
            mask = torch.ones_like(ids)
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{owner}: prompt_attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
        for name, t in (("prompt_ids", ids), ("prompt_attention_mask", mask)):
            if t.is_meta:
                raise ValueError(f"{owner}: {name} is a meta tensor (a shape without data); pass real token ids")
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"{owner}: prompt_attention_mask shape {tuple(mask.shape)} does not match prompt_ids shape "
                f"{tuple(ids.shape)}; pass the mask the tokenizer returned with the ids"
            )
        host = mask.detach().cpu()  # compared before the cast, which would turn 0.5 into 0
        if bool(((host != 0) & (host != 1)).any()):
            raise ValueError(f"{owner}: prompt_attention_mask must hold only 0 and 1")
        m = host.to(torch.int64)
        lengths = m.sum(dim=1)
        if bool((lengths == 0).any()):
            rows = (lengths == 0).nonzero().flatten().tolist()
            raise ValueError(f"{owner}: prompt_attention_mask rows {rows} are all zero; every prompt needs a real token")
        if bool((m[:, 1:] < m[:, :-1]).any()):
            raise ValueError(
                f"{owner}: prompts must be left-padded (each mask row 0...0 1...1); "
                "tokenize with padding_side='left'"
            )
        if (ids.detach().cpu() < 0).any():
            raise ValueError(f"{owner}: prompt_ids must be non-negative token ids")
        self.prompt_attention_mask = mask.to(torch.int64)
        self.prompt_ids = ids.to(torch.int64)
        budgets = self.max_new_tokens
        if budgets is not None:
            if isinstance(budgets, torch.Tensor):
                budgets = budgets.tolist()
            if not isinstance(budgets, (list, tuple)) or len(budgets) != ids.shape[0]:
                raise ValueError(f"{owner}: max_new_tokens must be a list of {ids.shape[0]} ints (one per prompt) or None")
            for b in budgets:
                _check_int(owner, "max_new_tokens", b, minimum=1)
            self.max_new_tokens = [int(b) for b in budgets]
        uids = self.request_ids
        if uids is not None:
            if isinstance(uids, torch.Tensor):
                uids = uids.tolist()
            if not isinstance(uids, (list, tuple)) or len(uids) != ids.shape[0]:
                raise ValueError(f"{owner}: request_ids must be a list of {ids.shape[0]} ints (one per prompt) or None")
            for u in uids:
                _check_int(owner, "request_ids", u, minimum=0)
                if u >= 2**63:
                    raise ValueError(f"{owner}: request_ids must be below 2**63 (int64), got {u!r}")
            if len(set(uids)) != len(uids):
                raise ValueError(f"{owner}: request_ids must be distinct (each prompt needs its own random stream)")
            self.request_ids = [int(u) for u in uids]
        for name in ("temperature", "top_p", "top_k", "stop_token_ids", "seed"):
            values = getattr(self, name)
            if values is None:
                continue
            if isinstance(values, torch.Tensor):
                values = values.tolist()
            if not isinstance(values, (list, tuple)) or len(values) != ids.shape[0]:
                raise ValueError(f"{owner}: {name} must be a list of {ids.shape[0]} values (one per prompt, None for "
                                 "the SamplingConfig's) or None")
            setattr(self, name, list(values))
        for s in self.seed or ():
            if s is not None:
                _check_int(owner, "seed", s, minimum=-(1 << 63))
                if s >= 1 << 63:
                    raise ValueError(f"{owner}: seed must fit in int64, got {s!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = [None if v is None else _stop_sequences(f"{owner}: prompt {i}'s", v)
                                   for i, v in enumerate(self.stop_token_ids)]

    def settings(self, sampling: SamplingConfig) -> list[tuple[float, float, int, tuple[tuple[int, ...], ...]]]:
        """Each prompt's (temperature, top-p, top-k, stop sequences): its own values where given, else
        ``sampling``'s; checked."""
        out = []
        for i in range(self.prompt_ids.shape[0]):
            t, p, k = (sampling.temperature if self.temperature is None or self.temperature[i] is None
                       else self.temperature[i],
                       sampling.top_p if self.top_p is None or self.top_p[i] is None else self.top_p[i],
                       sampling.top_k if self.top_k is None or self.top_k[i] is None else self.top_k[i])
            try:
                validate_sampling(t, p, k)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"RolloutRequest: prompt {i}'s sampling: {exc}") from None
            stops = (sampling.stop_token_ids if self.stop_token_ids is None or self.stop_token_ids[i] is None
                     else self.stop_token_ids[i])
            out.append((float(t), float(p), int(k), stops))
        return out

    @property
    def prompt_lengths(self) -> list[int]:
        """Real (unpadded) length of each prompt."""
        return self.prompt_attention_mask.sum(dim=1).tolist()


@dataclass
class RolloutBatch:
    """The rollouts, one row per (prompt, sample), in order ``prompt * n + sample``.

    ``input_ids``/``attention_mask`` ``[R, T + L]``: the left-padded prompt as
    given, then the right-padded response (``pad`` with mask 0 after its end).
    ``response_start_idx`` is ``T``; ``response_logprobs`` ``[R, L]`` float32
    holds the log-probability of each generated token under the sampling
    distribution used (0 on padding); ``response_lengths`` ``[R]`` counts real
    response tokens, EOS included.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: int
    response_logprobs: torch.Tensor
    response_lengths: torch.Tensor
    prompt_index: torch.Tensor
    #: With ``SamplingConfig(top_logprobs=k)``: ``[R, L, k]`` the k most likely ids at each response position,
    #: best first, and their logprobs, under the distribution ``response_logprobs`` is under (-1 / 0 on padding).
    top_logprob_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    @property
    def responses(self) -> torch.Tensor:
        """The response tokens ``[B, L]``: ``input_ids`` from ``response_start_idx`` on (pad past each length)."""
        return self.input_ids[:, self.response_start_idx :]

    @property
    def response_mask(self) -> torch.Tensor:
        """``[R, T + L]`` bool: True on each row's real response tokens (EOS included), False on prompt and pad."""
        cols = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        start = self.response_start_idx
        return (cols[None, :] >= start) & (cols[None, :] < start + self.response_lengths.to(cols.device)[:, None])

    def training_inputs(self) -> dict[str, torch.Tensor]:
        """The training forward's inputs for these rollouts, ready for ``engine(**batch.training_inputs())``.

        ``position_ids`` count from each row's first real token, as the rollout's did: models with absolute
        position embeddings (GPT-2, GPT-Neo, OPT, BioGPT, ...) otherwise give left-padded rows other logprobs
        than the rollout's. ``labels`` hold the response tokens and -100 elsewhere, so transformers' loss (and a
        per-token loss over ``logits[:, :-1]`` against ``labels[:, 1:]``) covers the responses only.
        """
        mask = self.attention_mask
        return {"input_ids": self.input_ids, "attention_mask": mask,
                "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0),
                "labels": self.input_ids.masked_fill(~self.response_mask, -100)}
