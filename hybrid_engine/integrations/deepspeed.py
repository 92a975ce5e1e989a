"""DeepSpeed's rollout interface (``deepspeed.runtime.rollout``) served by this library's graphed rollout.

Why: DeepSpeed's RL and on-policy distillation (OPSD) code talks to its rollout
engine through one ABC, ``RolloutEngine.generate(RolloutRequest, SamplingConfig)
-> RolloutBatch`` plus ``sync_weights(step)``, and DeepSpeed's own engine
(``HybridEngineRollout``) only graphs greedy decoding. :class:`DeepSpeedRolloutEngine`
is that ABC implemented on :class:`hybrid_engine.rollout.HybridEngineRollout`, so a
DeepSpeed training loop that builds this engine instead of DeepSpeed's gets captured
decode graphs (greedy and sampled), continuous batching and shared prefill, and
nothing else in the loop changes: it takes and returns DeepSpeed's own dataclasses,
and :class:`ResponseTokenBatch.from_rollout <deepspeed.runtime.rollout.opsd.ResponseTokenBatch>`
consumes its batches. Every mapping of DeepSpeed's types onto ours keeps DeepSpeed's
meaning (:func:`to_hybrid_request`, :func:`to_hybrid_sampling`,
:func:`to_deepspeed_batch`, :meth:`DeepSpeedRolloutEngine._call_seed`).

Graph safety: the rollout reads the training weights in place, so
``sync_weights`` copies nothing; the captured graphs replay an in-place
optimizer step's new values, and weights that were re-allocated drop them
(:meth:`DeepSpeedRolloutEngine.sync_weights`).

Importing this module imports DeepSpeed (``hybrid_engine`` itself never does);
without it the import fails with an ``ImportError`` naming the extra to install,
``pip install hybrid-engine[deepspeed]``.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import threading
from typing import Any

import torch

try:
    from deepspeed.runtime.rollout.base import RolloutBatch as DSRolloutBatch
    from deepspeed.runtime.rollout.base import RolloutConfig as DSRolloutConfig
    from deepspeed.runtime.rollout.base import RolloutEngine as DSRolloutEngine
    from deepspeed.runtime.rollout.base import RolloutRequest as DSRolloutRequest
    from deepspeed.runtime.rollout.base import SamplingConfig as DSSamplingConfig
except ImportError as exc:  # tested by hiding deepspeed from the import system
    raise ImportError(
        "hybrid_engine.integrations.deepspeed needs DeepSpeed (its deepspeed.runtime.rollout interface, "
        "deepspeed>=0.19); install it with: pip install hybrid-engine[deepspeed]"
    ) from exc

from hybrid_engine.graphs.fingerprint import weight_fingerprint
from hybrid_engine.rollout import (
    HybridEngineRollout,
    RolloutBatch,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
)
from hybrid_engine.rollout.types import is_int

__all__ = [
    "DeepSpeedRolloutEngine",
    "to_deepspeed_batch",
    "to_hybrid_request",
    "to_hybrid_sampling",
]

logger = logging.getLogger(__name__)

_SEED_RANGE = 1 << 62  # seeds drawn from torch's generator lie in [0, 2**62)


def _check_seed(seed: object) -> None:
    """A seed is ``None`` or an int64 (what the sampler's counters hold)."""
    if seed is not None and not is_int(seed):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must fit in int64, got {seed}")


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------ conversions
def to_hybrid_request(request: DSRolloutRequest) -> RolloutRequest:
    """DeepSpeed's ``RolloutRequest`` as ours: the same left-padded ``prompt_ids``/``prompt_attention_mask``.

    Ours validates them (left padding, 0/1 mask, int ids, a real token per row) before any work."""
    if not isinstance(request, DSRolloutRequest):
        hint = (
            "; this is hybrid_engine's own RolloutRequest: pass it to HybridEngineRollout.generate, or build "
            "deepspeed.runtime.rollout.RolloutRequest(prompt_ids, prompt_attention_mask)"
            if isinstance(request, RolloutRequest) else ""
        )
        raise TypeError(
            f"request must be a deepspeed.runtime.rollout.RolloutRequest, got {_type_name(request)}{hint}"
        )
    return RolloutRequest(request.prompt_ids, request.prompt_attention_mask)


def to_hybrid_sampling(sampling: DSSamplingConfig, seed: int = 0) -> tuple[SamplingConfig, int | None]:
    """DeepSpeed's ``SamplingConfig`` as ``(ours, continuous_batch_size)``.

    ``temperature <= 0`` becomes greedy (``top_p=1``, ``top_k=-1``: the knobs DeepSpeed
    ignores then, normalised so every greedy call shares one graph), ``top_k <= 0``
    becomes ``-1`` (disabled). Sample ``j`` of prompt ``i`` is row ``i * n + j``
    (DeepSpeed's ``repeat_interleave`` order). ``continuous_batch_size`` bounds the
    concurrently decoding rows of that call (``None``: the rollout's own
    ``RolloutConfig.max_batch_size``). Unlike DeepSpeed's engine, continuous batching
    here also samples and takes ``n_samples_per_prompt > 1``; it never changes the
    tokens. Values ours rejects (``top_p`` outside ``(0, 1]``, a non-integer ``top_k``,
    ``max_new_tokens < 1``...) raise its ``ValueError``/``TypeError``, naming the field.
    """
    if not isinstance(sampling, DSSamplingConfig):
        hint = (
            "; this is hybrid_engine's own SamplingConfig: build deepspeed.runtime.rollout.SamplingConfig instead"
            if isinstance(sampling, SamplingConfig) else ""
        )
        raise TypeError(
            f"sampling must be a deepspeed.runtime.rollout.SamplingConfig, got {_type_name(sampling)}{hint}"
        )
    temperature, top_p, top_k = sampling.temperature, sampling.top_p, sampling.top_k
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"SamplingConfig.{name} must be a number, got {type(value).__name__} ({value!r})")
    if temperature <= 0:
        temperature, top_p, top_k = 0.0, 1.0, -1
    elif is_int(top_k) and top_k <= 0:
        top_k = -1
    ours = SamplingConfig(
        max_new_tokens=sampling.max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        n_samples_per_prompt=sampling.n_samples_per_prompt,
        seed=seed,
    )
    slots = sampling.continuous_batch_size
    if slots is not None and (not is_int(slots) or slots < 1):
        raise ValueError(
            f"SamplingConfig.continuous_batch_size must be None or a positive int (the rows decoding at once), "
            f"got {slots!r}"
        )
    return ours, None if slots is None else int(slots)


def to_deepspeed_batch(batch: RolloutBatch) -> DSRolloutBatch:
    """Our ``RolloutBatch`` as DeepSpeed's: the same ``input_ids``/``attention_mask``, ``response_start_idx`` a tensor.

    ``input_ids`` is the prompt exactly as given (left padding kept) followed by the responses, right-padded with
    the pad id to the longest response; ``attention_mask`` is the prompt mask then 1 on every generated token (the
    first EOS included) and 0 after; ``response_start_idx`` is the padded prompt width ``T_p`` for every row, an
    int64 ``[B']`` tensor on the batch's device. The log-probabilities DeepSpeed's batch has no field for stay on
    :attr:`DeepSpeedRolloutEngine.last_rollout` (our :class:`~hybrid_engine.rollout.RolloutBatch`)."""
    if not isinstance(batch, RolloutBatch):
        raise TypeError(f"batch must be a hybrid_engine.rollout.RolloutBatch, got {_type_name(batch)}")
    ids = batch.input_ids
    start = torch.full((ids.shape[0],), batch.response_start_idx, dtype=torch.int64, device=ids.device)
    return DSRolloutBatch(input_ids=ids, attention_mask=batch.attention_mask, response_start_idx=start)


def _rollout_config(config: Any) -> RolloutConfig | None:
    """Ours as given; DeepSpeed's ``RolloutConfig``/``HybridEngineRolloutConfig`` translated (see the class doc)."""
    if config is None or isinstance(config, RolloutConfig):
        return config
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

    if isinstance(config, DSRolloutConfig):
        if config.engine != "hybrid_engine":
            raise ValueError(f"config.engine={config.engine!r}: DeepSpeedRolloutEngine serves 'hybrid_engine' only")
        return RolloutConfig(use_graph_capture=bool(config.use_graph_capture))
    if isinstance(config, HybridEngineRolloutConfig):
        return RolloutConfig(
            use_graph_capture=bool(config.use_graph_capture),
            enable_profiling=bool(config.enable_profiling),
            use_shared_prefill=bool(config.use_shared_prefill),
        )
    raise TypeError(
        "config must be a hybrid_engine RolloutConfig, a deepspeed.runtime.rollout.RolloutConfig, a "
        f"HybridEngineRolloutConfig or None, got {_type_name(config)}"
    )


# ----------------------------------------------------------------------- engine
class DeepSpeedRolloutEngine(DSRolloutEngine):
    """DeepSpeed's ``RolloutEngine`` on a :class:`~hybrid_engine.rollout.HybridEngineRollout`.

    ``source`` is a ``HybridEngineRollout`` to wrap (its tokenizer and config are
    kept: pass neither), or what one is built from: a ``HybridEngine``, a DeepSpeed
    engine or anything whose ``.module`` is a transformers ``PreTrainedModel``, or
    the model itself. ``tokenizer`` supplies the pad/EOS ids (pass the one that
    padded the prompts). ``config`` is our ``RolloutConfig`` or DeepSpeed's
    ``RolloutConfig``/``HybridEngineRolloutConfig``, of which ``use_graph_capture``,
    ``enable_profiling`` and ``use_shared_prefill`` carry over; DeepSpeed's cache
    layout knobs (``align_decode_fronts``, ``enable_cache_trimming``,
    ``continuous_cache_capacity``) have no counterpart here (the cache is sized
    per call) and are ignored. ``seed``: see :meth:`_call_seed`.

    A ``continuous_batch_size`` is applied by giving the wrapped rollout a copy of
    its config for that call (same runner, same graphs); the adapter serialises its
    own calls, but do not call the wrapped rollout directly from another thread
    while the adapter is generating.
    """

    name = "hybrid_engine.graphed"

    def __init__(self, source: Any, tokenizer: Any = None, config: Any = None, *, seed: int | None = None) -> None:
        try:
            _check_seed(seed)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"DeepSpeedRolloutEngine: {exc}") from None
        if isinstance(source, HybridEngineRollout):
            if tokenizer is not None or config is not None:
                raise ValueError(
                    "DeepSpeedRolloutEngine: source is already a HybridEngineRollout with its own tokenizer and "
                    "config; pass tokenizer/config only when the adapter builds the rollout from a model or engine"
                )
            rollout = source
        else:
            rollout = HybridEngineRollout(source, tokenizer=tokenizer, config=_rollout_config(config))
        self.rollout: HybridEngineRollout = rollout
        self.seed = seed
        #: Our batch of the last call (with ``response_logprobs`` and ``response_lengths``).
        self.last_rollout: RolloutBatch | None = None
        self.last_seed: int | None = None
        self.calls = 0
        self.last_synced_step: int | None = None
        #: Whether the last :meth:`sync_weights` found re-allocated weights (and dropped the graphs).
        self.last_sync_reallocated = False
        self.weight_reallocations = 0
        self._fingerprint = weight_fingerprint(rollout.model, requires_grad=False)
        # Serialises this adapter's calls, so a per-call continuous_batch_size never leaks into another call.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ views
    @property
    def model(self) -> torch.nn.Module:
        """The (shared) model the rollout decodes with."""
        return self.rollout.model

    @property
    def last_stats(self) -> dict[str, Any]:
        """The wrapped rollout's statistics of the last call (captures, replays, timings...)."""
        return self.rollout.last_stats

    # ---------------------------------------------------------------- generate
    def _call_seed(self, seed: int | None, sampling: SamplingConfig) -> int:
        """This call's seed (``sampling`` already validated); DeepSpeed's ``SamplingConfig`` has none.

        In order: ``generate(..., seed=...)``, else the adapter's ``seed`` plus the number of calls made before
        (a reproducible run, fresh samples each step), else a seed drawn from torch's default generator (so
        ``torch.manual_seed`` makes a run reproducible, as it does for DeepSpeed's ``model.generate`` path). The
        seed used is ``last_seed``."""
        if seed is not None:
            return int(seed)
        if self.seed is not None:  # wraps around within int64, so every later call has a valid seed too
            return (int(self.seed) + self.calls + 2**63) % 2**64 - 2**63
        if sampling.temperature == 0:  # nothing is sampled: leave torch's generator alone, as DeepSpeed's greedy does
            return 0
        return int(torch.randint(0, _SEED_RANGE, (1,)).item())

    def generate(self, request: DSRolloutRequest, sampling: DSSamplingConfig, *,
                 seed: int | None = None) -> DSRolloutBatch:
        """Generate ``sampling.n_samples_per_prompt`` responses per prompt; DeepSpeed's types in and out.

        Everything is validated before any work, with the field named; the batch
        layout is :func:`to_deepspeed_batch`'s. ``seed`` (optional) fixes this
        call's samples (:meth:`_call_seed`).
        """
        where = "DeepSpeedRolloutEngine.generate"
        with self._lock:  # the seed counter and the per-call config belong to one call at a time
            try:
                _check_seed(seed)
                ours_request = to_hybrid_request(request)
                ours_sampling, slots = to_hybrid_sampling(sampling)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: {exc}") from exc
            rollout, config = self.rollout, self.rollout.config
            call_config = config
            if slots is not None and not (slots == config.max_batch_size and config.continuous_batching):
                try:
                    call_config = dataclasses.replace(config, max_batch_size=slots, continuous_batching=True)
                except ValueError as exc:
                    raise ValueError(f"{where}: SamplingConfig.continuous_batch_size={slots}: {exc}") from exc
            # Drawn only now, and given back if the rollout refuses the call: a rejected call leaves torch's
            # generator, hence the next call's samples, as they were.
            rng = torch.get_rng_state()
            ours_sampling = dataclasses.replace(ours_sampling, seed=self._call_seed(seed, ours_sampling))
            rollout.config = call_config  # for this call only (the runner and its graphs are shared)
            try:
                batch = rollout.generate(ours_request, ours_sampling)
            except BaseException:
                torch.set_rng_state(rng)
                raise
            finally:
                rollout.config = config
            self.calls += 1
            self.last_seed = ours_sampling.seed
            self.last_rollout = batch
            self._fingerprint = weight_fingerprint(rollout.model, requires_grad=False)
        return to_deepspeed_batch(batch)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, step: int) -> None:
        """No copy (the weights are shared); drop the graphs if the weights were re-allocated since the last call.

        It compares :func:`~hybrid_engine.graphs.fingerprint.weight_fingerprint`
        (each parameter's and buffer's address, dtype, shape, device) with the one
        taken at the previous sync or generate. Unchanged (an optimizer step updates
        in place): a no-op, and the captured graphs replay with the new values.
        Changed (a ``load_state_dict(assign=True)``, ``.to(dtype)``, ``param.data =
        ...``, a LoRA merge): the weights were re-allocated and every captured graph
        still reads the old storage, so it drops them at once
        (``runner.invalidate()``, which also frees their memory pool before the next
        training step) and the next ``generate`` captures afresh. That is not an
        error: the runner makes the same check before every replay, so a rollout
        that is never synced is still correct; ``sync_weights`` makes the change
        visible (``weight_reallocations``, ``last_sync_reallocated``, an INFO log).
        """
        if not is_int(step):
            raise TypeError(f"DeepSpeedRolloutEngine.sync_weights: step must be an int, got {step!r}")
        with self._lock:
            fingerprint = weight_fingerprint(self.rollout.model, requires_grad=False)
            reallocated = fingerprint != self._fingerprint
            if reallocated:
                self.rollout.runner.invalidate()
                self.weight_reallocations += 1
                logger.info(
                    "sync_weights(step=%d): the model's weights were re-allocated since the last rollout; dropped the "
                    "captured decode graphs (the next generate captures again)", step,
                )
            self._fingerprint = fingerprint
            self.last_sync_reallocated = reallocated
            self.last_synced_step = int(step)

    def shutdown(self) -> None:
        """Free the decode slots and every captured graph (a later ``generate`` allocates and captures again)."""
        self.rollout.release()
