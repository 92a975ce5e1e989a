"""TRL's ``GRPOTrainer(..., rollout_func=fn)`` with hybrid-engine rollouts on the trainer's own model.

:func:`make_rollout_func` returns a callable that TRL (1.16) calls as
``fn(prompts, trainer)`` in place of its own generation. It drives one
:class:`~hybrid_engine.rollout.HybridEngineRollout` built, on first use, around
``trainer.accelerator.unwrap_model(trainer.model)`` (for a PEFT model, the base
transformers model with its LoRA layers injected).

Why nothing is copied or synced: the rollout holds the very module the trainer
optimises. Its decode graphs read every weight by address, and the optimizer
updates weights in place, so the graphs are captured once (one per batch
bucket, page span and sampling mode, plus the admission rounds) and replayed at
every later training step, and each replay sees the weights of that step.
Whatever would make a replay disagree with an eager forward (a re-allocated
weight, an added hook, a merged or switched LoRA adapter) changes the graph
fingerprint (:mod:`hybrid_engine.graphs.fingerprint`) and the runner recaptures
before replaying.

What lives on the device: the model, and the rollout's decode slots and K/V
page pool with its graphs and their pool; they stay allocated across calls.
Prompts cross host to device once per call, and tokens and log-probabilities
come back once per call, as the lists TRL wants. Under DeepSpeed ZeRO-3 there
is nothing fixed to capture unless the function keeps a gathered copy
(:meth:`HybridEngineRolloutFunc._generation_model`). What one call does:
:meth:`HybridEngineRolloutFunc.__call__`. With ``tools`` or ``environment_factory`` the
call runs TRL's tool loop on multi-turn episodes: :mod:`hybrid_engine.integrations.trl_tools`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.decode.sampling import MIN_TEMPERATURE
from hybrid_engine.distributed.inference_copy import InferenceCopy
from hybrid_engine.generation.generate import unimplemented_generation_fields
from hybrid_engine.integrations.trl_tools import DEFAULT_TOOL_TIMEOUT, ToolLoop, environment_reward
from hybrid_engine.model_access import is_zero3_partitioned
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.rollout.types import is_int
from hybrid_engine.training.deepspeed import destroy_deepspeed_engine

__all__ = ["HybridEngineRolloutFunc", "destroy_trainer_deepspeed", "environment_reward", "make_rollout_func",
           "rollout_seed"]

#: Keyword overrides :func:`make_rollout_func` accepts (``max_new_tokens`` is an alias of ``max_completion_length``).
SAMPLING_KEYS = ("max_completion_length", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")
#: Overrides that must equal the trainer's own value, and why: TRL's loss reads them too.
_TRAINER_READS = {
    "temperature": "TRL's loss divides the logits by it to score the completions, so sampling at another "
                   "temperature trains off-policy",
    "max_completion_length": "TRL's loss normalisation (loss_type='dr_grpo') and its truncation checks use it",
}
#: Fields of the model's generation_config that TRL's own generation applies (it sets only temperature, top_p,
#: top_k, min_p, repetition_penalty and the lengths itself) and hybrid-engine rollouts do not implement.
_TRL_MERGED_FIELDS = (
    "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "typical_p",
    "epsilon_cutoff", "eta_cutoff", "min_length", "min_new_tokens", "encoder_repetition_penalty", "sequence_bias",
    "renormalize_logits", "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id",
    "stop_strings", "num_beams", "num_return_sequences", "penalty_alpha", "guidance_scale", "force_words_ids",
    "constraints", "diversity_penalty", "length_penalty",
)


def rollout_seed(base_seed: int, global_step: int, process_index: int = 0, mode: str = "train",
                 call_index: int = 0) -> int:
    """The sampling seed of one call: a 64-bit hash of the trainer's seed, step, process and mode, and of
    ``call_index``, the number of earlier calls at that step in that mode (several under gradient accumulation
    with ``steps_per_generation`` below it, or one per evaluation batch)."""
    key = f"{int(base_seed)}:{int(global_step)}:{int(process_index)}:{mode}"
    if call_index:
        key += f":{int(call_index)}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def _check_overrides(sampling: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
    if unknown:
        raise TypeError(
            f"make_rollout_func: unknown sampling override(s) {', '.join(unknown)}; accepted: {', '.join(SAMPLING_KEYS)}"
        )
    out = dict(sampling)
    if "max_new_tokens" in out:
        if "max_completion_length" in out:
            raise TypeError("make_rollout_func: pass max_completion_length or its alias max_new_tokens, not both")
        out["max_completion_length"] = out.pop("max_new_tokens")
    seed = out.get("seed")
    if seed is not None and not is_int(seed):
        raise TypeError(f"make_rollout_func: seed must be an int, got {type(seed).__name__} ({seed!r})")
    probe = {k: out[k] for k in ("temperature", "top_p", "top_k", "logprobs") if k in out}
    if "max_completion_length" in out:
        probe["max_new_tokens"] = out["max_completion_length"]
    try:
        SamplingConfig(**probe)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"make_rollout_func: invalid sampling override ({exc})") from None
    return out


def _policy_model(trainer: Any) -> PreTrainedModel:
    """The transformers model the trainer optimises (a PEFT model's base model, LoRA layers included)."""
    accelerator = getattr(trainer, "accelerator", None)
    model = getattr(trainer, "model", None)
    if accelerator is None or model is None:
        raise TypeError(
            "rollout_func: trainer must be a TRL GRPOTrainer (with .accelerator and .model), "
            f"got {type(trainer).__name__}"
        )
    model = accelerator.unwrap_model(model)
    if not isinstance(model, PreTrainedModel) and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()  # peft.PeftModel: LoRA layers live inside the base model
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            "rollout_func: trainer.model must unwrap to a transformers PreTrainedModel (or a PEFT model around "
            f"one), got {type(model).__name__}"
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError(
            "rollout_func: the trainer shards the model's parameters with FSDP, which hybrid-engine rollouts do not "
            "gather; train with DeepSpeed ZeRO (stage 0-3) or plain DDP to use hybrid-engine rollouts"
        )
    return model


def _tokenizer_of(processing_class: Any) -> Any:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor wraps its tokenizer
    if not callable(tokenizer) or not hasattr(tokenizer, "pad_token_id"):
        raise TypeError(
            "rollout_func: trainer.processing_class must be a transformers tokenizer or processor, "
            f"got {type(processing_class).__name__}"
        )
    return tokenizer


def _is_conversation(prompt: Any) -> bool:
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))


def _check_prompts(prompts: Any) -> bool:
    """Validate TRL's prompt list; True when the prompts are conversations (lists of message dicts)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(
            f"rollout_func: prompts must be a non-empty list of strings or of conversations, got {prompts!r:.80}"
        )
    chat = _is_conversation(prompts[0])
    for i, p in enumerate(prompts):
        if (chat and not _is_conversation(p)) or (not chat and not isinstance(p, str)):
            kind = "conversations (lists of {'role', 'content'} dicts)" if chat else "strings"
            raise TypeError(
                f"rollout_func: prompts[{i}] is {type(p).__name__} but prompts[0] makes this a batch of {kind}; "
                "pass one kind of prompt per batch"
            )
        if chat and any(not isinstance(m["content"], str) for m in p):
            raise ValueError(
                f"rollout_func: prompts[{i}] has non-text message content (images or content blocks); "
                "hybrid-engine rollouts are text-only"
            )
    return chat


def _refuse_trainer_generation(trainer: Any) -> None:
    """Settings under which TRL would generate beside this rollout function, refused at the first call.

    With ``tools`` or ``environment_factory``, TRL runs its tool loop on our output and generates the later
    turns with its own generation, which returns no logprobs (TRL then fails adding ``[0.0] * n + None``);
    ``make_rollout_func(tools=...)`` runs that loop inside the engine instead.
    ``use_vllm=True`` would start a second engine and sync its weights every step, for nothing."""
    args = getattr(trainer, "args", None)
    if getattr(args, "use_vllm", False):
        raise ValueError("rollout_func: GRPOConfig(use_vllm=True) next to hybrid-engine's rollout function would "
                         "start a vLLM engine that generates nothing and syncs weights every step; set "
                         "use_vllm=False")
    # An environment's methods are in trainer.tools too: name the environment first.
    for name, given in (("environment_factory", getattr(trainer, "environment_factories", None)),
                        ("tools", getattr(trainer, "_standalone_tools", None) or getattr(trainer, "tools", None))):
        if given:
            raise ValueError(
                f"rollout_func: GRPOTrainer({name}=...) next to hybrid-engine's rollout function makes TRL run its "
                "tool loop with its own generation, which gives the later turns no logprobs; pass them to "
                f"make_rollout_func({name}=...) instead, which runs the tool loop inside the engine"
            )


def _fold(prompts: Sequence[Any]) -> tuple[list[Any], int]:
    """Fold runs of identical consecutive prompts: (distinct prompts, samples per prompt).

    ``n`` is the greatest common divisor of the run lengths, so a run of length
    ``k * n`` becomes ``k`` prompts of ``n`` samples and row ``i`` of the output
    is still prompt ``i``.
    """
    runs: list[tuple[Any, int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    n = 0
    for _, length in runs:
        n = math.gcd(n, length)
    unique = [p for p, length in runs for _ in range(length // n)]
    return unique, n


class HybridEngineRolloutFunc:
    """TRL's ``rollout_func``: ``fn(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}``.

    Built by :func:`make_rollout_func`. :attr:`rollout` is the
    :class:`~hybrid_engine.rollout.HybridEngineRollout` it drives (``None``
    before the first call; a call whose trainer holds another model builds a
    new one); :attr:`last_request` and :attr:`last_sampling` are the request
    and sampling of the last call, so it can be replayed, e.g. eagerly for a
    check.
    """

    def __init__(self, config: RolloutConfig | None = None, *, tools: list[Any] | None = None,
                 environment_factory: Any = None, max_tool_calling_iterations: int | None = None,
                 tool_timeout: float | None = DEFAULT_TOOL_TIMEOUT, zero3_gathered_inference_copy: bool = False,
                 sleep_between_phases: bool = False, **sampling: Any) -> None:
        if config is None:
            config = RolloutConfig(use_graph_capture=True)
        if not isinstance(config, RolloutConfig):
            raise TypeError(
                f"make_rollout_func: config must be a hybrid_engine.RolloutConfig or None, got {type(config).__name__}"
            )
        if not isinstance(zero3_gathered_inference_copy, bool):
            raise TypeError("make_rollout_func: zero3_gathered_inference_copy must be True or False, got "
                            f"{zero3_gathered_inference_copy!r}")
        self.config = config
        self.overrides = _check_overrides(sampling)
        #: The tool loop (``tools`` / ``environment_factory``; see :mod:`hybrid_engine.integrations.trl_tools`), or None.
        self.tool_loop: ToolLoop | None = None
        if tools is not None or environment_factory is not None:
            self.tool_loop = ToolLoop(tools, environment_factory, max_tool_calling_iterations, tool_timeout)
        elif max_tool_calling_iterations is not None:
            raise TypeError("make_rollout_func: max_tool_calling_iterations needs tools= or environment_factory=")
        elif tool_timeout != DEFAULT_TOOL_TIMEOUT:
            raise TypeError("make_rollout_func: tool_timeout needs tools= or environment_factory=")
        self.zero3_gathered_inference_copy = zero3_gathered_inference_copy
        if not isinstance(sleep_between_phases, bool):
            raise TypeError(f"make_rollout_func: sleep_between_phases must be True or False, got {sleep_between_phases!r}")
        #: The memory hand-off (issue 41): the rollout's page pool sleeps after each call, graphs kept.
        self.sleep_between_phases = sleep_between_phases
        #: The unpartitioned copy generated on under ZeRO-3 with ``zero3_gathered_inference_copy`` (else ``None``).
        self.inference_copy: InferenceCopy | None = None
        self._warned_no_zero3 = False
        self.rollout: HybridEngineRollout | None = None
        self.last_request: RolloutRequest | None = None
        self.last_sampling: SamplingConfig | None = None
        self._calls: dict[tuple[int, str], tuple[int, int]] = {}  # (process, mode) -> (step, calls at it so far)
        self._trainer: int | None = None  # id() of the trainer whose calls _calls counts

    # ---------------------------------------------------------------- setup
    def _generation_model(self, model: PreTrainedModel, trainer: Any) -> PreTrainedModel:
        """What to generate with: the trainer's model, or under ZeRO-3 with the copy on, the refreshed copy.

        Under DeepSpeed ZeRO-3 (accelerate's DeepSpeed plugin, or ``GRPOConfig(deepspeed=...)``)
        each parameter is a shard outside a gather, so there is nothing fixed to
        capture. By default each call gathers the parameters once (a collective: every
        process generates at the same point of a TRL step), decodes eagerly on them and
        warns once that graphs are refused. With ``zero3_gathered_inference_copy=True``
        the function keeps an unpartitioned copy of the model
        (:class:`~hybrid_engine.distributed.inference_copy.InferenceCopy`, no DeepSpeed hooks),
        refreshed in place at each call by one gather, and decodes on the copy with
        graphs captured once (see the module docstring); the cost is one full copy of the weights per
        process. A PEFT model's copy carries the same adapters.
        """
        if not is_zero3_partitioned(model):
            if self.zero3_gathered_inference_copy and not self._warned_no_zero3:
                self._warned_no_zero3 = True
                warnings.warn("make_rollout_func: zero3_gathered_inference_copy has no effect: the trainer's model "
                              "is not ZeRO-3 partitioned, so rollouts run on it directly", UserWarning, stacklevel=3)
            return model
        if getattr(getattr(trainer, "args", None), "ds3_gather_for_generation", True) is False:
            raise ValueError(
                "rollout_func: trainer.args.ds3_gather_for_generation=False, but hybrid-engine rollouts gather the "
                "ZeRO-3 parameters for generation (once per call, or into make_rollout_func("
                "zero3_gathered_inference_copy=True)'s copy); set it to True, or use TRL's own generation"
            )
        if not self.zero3_gathered_inference_copy:
            return model  # the rollout gathers it per call and decodes eagerly (graphs refused, warned once)
        copy = self.inference_copy
        if copy is None or copy.source is not model:
            self.inference_copy = copy = InferenceCopy(model)  # collective, like every refresh
        else:
            copy.refresh()  # in place: the graphs captured on the copy replay this step's weights
        return copy.module

    def _rollout_for(self, model: PreTrainedModel, trainer: Any, tokenizer: Any) -> HybridEngineRollout:
        """The rollout for this model and this trainer's EOS and pad ids (read at every call: a later trainer on the
        same model may have others); a new one when either changed."""
        config = self.config
        eos = getattr(trainer, "eos_token_ids", None)  # TRL: the tokenizer's EOS plus the model's generation EOS ids
        if config.eos_token_id is None and eos:
            config = dataclasses.replace(config, eos_token_id=tuple(int(e) for e in eos))
        if config.pad_token_id is None:  # the prompts are padded with it here, so it must be known now
            pad = tokenizer.pad_token_id
            if not isinstance(pad, int) and config.eos_token_id is not None:
                pad = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
            if isinstance(pad, int):
                config = dataclasses.replace(config, pad_token_id=pad)
        if self.rollout is None or self.rollout.model is not model or self.rollout.config != config:
            self.rollout = HybridEngineRollout(model, tokenizer=tokenizer, config=config)
        return self.rollout

    def _position(self, trainer: Any) -> tuple[tuple[int, int, str], int]:
        """Where in training a call is made, (global step, process index, "train" or "eval"), and how many
        calls were made there before it."""
        if self._trainer != id(trainer):  # another trainer (a new run): its steps count from its own start
            self._trainer = id(trainer)
            self._calls.clear()
        state = getattr(trainer, "state", None)
        step, process = getattr(state, "global_step", 0), getattr(trainer.accelerator, "process_index", 0)
        mode = "train" if getattr(trainer.model, "training", True) else "eval"
        last_step, calls = self._calls.get((process, mode), (None, 0))
        return (step, process, mode), calls if last_step == step else 0

    def _sampling(self, trainer: Any, n: int, position: tuple[int, int, str], call_index: int,
                  generation_config: Any) -> SamplingConfig:
        args = getattr(trainer, "args", None)
        if args is None:
            raise TypeError("rollout_func: trainer has no .args (expected a TRL GRPOTrainer with its GRPOConfig)")
        for name, default in (("min_p", None), ("repetition_penalty", 1.0)):
            value = getattr(args, name, default)
            if value is not None and value != default and not (name == "min_p" and value == 0):
                raise ValueError(
                    f"rollout_func: trainer.args.{name}={value!r} is not supported by hybrid-engine rollouts "
                    f"(they sample with temperature, top_p and top_k); set {name}={default!r}"
                )
        if getattr(args, "generation_kwargs", None):
            raise ValueError(
                f"rollout_func: trainer.args.generation_kwargs={args.generation_kwargs!r} is not applied by "
                "hybrid-engine rollouts; set temperature, top_p, top_k and max_completion_length in GRPOConfig"
            )
        o = self.overrides
        for name, why in _TRAINER_READS.items():
            own = getattr(args, name, None)
            if name in o and own is not None and o[name] != own:
                raise ValueError(
                    f"rollout_func: make_rollout_func({name}={o[name]!r}) differs from trainer.args.{name}={own!r}; "
                    f"{why}. Set GRPOConfig({name}={o[name]!r}) and drop the override"
                )
        temperature = o.get("temperature", getattr(args, "temperature", 1.0))
        if isinstance(temperature, (int, float)) and 0 <= temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"rollout_func: temperature={temperature!r} (greedy, or near it) cannot train a GRPO policy: TRL's "
                "loss divides the logits by trainer.args.temperature, and TRL refuses 0 too; set "
                f"GRPOConfig(temperature=...) to at least {MIN_TEMPERATURE:g}"
            )
        fields = unimplemented_generation_fields(generation_config, _TRL_MERGED_FIELDS)
        if fields:
            raise ValueError(
                f"rollout_func: the model's generation_config sets {', '.join(fields)}, which TRL's own generation "
                "would apply and hybrid-engine rollouts do not; reset them on model.generation_config (or use "
                "TRL's own generation)"
            )
        max_new = o.get("max_completion_length", getattr(args, "max_completion_length", None))
        if max_new is None:
            raise ValueError("rollout_func: trainer.args.max_completion_length is None; set it, or pass "
                             "make_rollout_func(max_completion_length=...)")
        top_k = o.get("top_k", getattr(args, "top_k", 0))
        seed = rollout_seed(o.get("seed", getattr(args, "seed", 0)), *position, call_index=call_index)
        try:
            return SamplingConfig(
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=o.get("top_p", getattr(args, "top_p", 1.0)),
                top_k=-1 if top_k is None else top_k,
                n_samples_per_prompt=n,
                seed=seed,
                logprobs=o.get("logprobs", "sampling"),
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"rollout_func: trainer.args gives an invalid sampling setting ({exc}); fix it in GRPOConfig"
            ) from None

    def _tokenize(self, trainer: Any, prompts: list[Any], chat: bool, tokenizer: Any,
                  device: torch.device) -> tuple[list[list[int]], RolloutRequest]:
        if chat:
            processing_class = trainer.processing_class
            kwargs = dict(getattr(trainer, "chat_template_kwargs", None) or {})
            template = getattr(trainer, "chat_template", None)
            tools = None
            if self.tool_loop is not None:  # rendered with the tools' schemas, as TRL renders them
                tools = self.tool_loop.schema_tools
                template = self.tool_loop.tokenizing(trainer, processing_class, tokenizer).chat_template
            if template is not None:
                kwargs["chat_template"] = template
            try:
                texts = [processing_class.apply_chat_template(p, tools=tools or None, add_generation_prompt=True,
                                                              tokenize=False, **kwargs) for p in prompts]
            except ValueError as exc:
                raise ValueError(
                    f"rollout_func: conversational prompts need a chat template ({exc}); set "
                    "processing_class.chat_template or pass plain-text prompts"
                ) from exc
        else:
            texts = list(prompts)
        # As TRL tokenizes them: plain text with the tokenizer's special tokens (a BOS), chat text without (the
        # template writes its own).
        ids = tokenizer(texts, add_special_tokens=not chat)["input_ids"]
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"rollout_func: prompt {prompts[i]!r:.60} tokenizes to no tokens; drop empty prompts")
        pad = self.rollout.config.pad_token_id if self.rollout is not None else None
        pad = 0 if pad is None else pad  # no pad and no EOS: the rollout refuses the call with its own message
        width = max(len(r) for r in ids)
        tokens = torch.full((len(ids), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(ids), width), dtype=torch.int64)
        for i, row in enumerate(ids):
            tokens[i, width - len(row):] = torch.tensor(row, dtype=torch.int64)
            mask[i, width - len(row):] = 1
        return [list(r) for r in ids], RolloutRequest(tokens.to(device), mask.to(device))

    # ----------------------------------------------------------------- call
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """One TRL generation call.

        TRL passes this process's prompts, each repeated ``num_generations``
        times in a row (its ``RepeatSampler``). Each run of identical prompts is folded
        into one prompt sampled ``n`` times (``n`` = ``num_generations`` on one process;
        in general the greatest common divisor of the run lengths), so every group
        shares one prefill. Prompts are tokenized with ``trainer.processing_class`` as
        TRL tokenizes them (plain text with the tokenizer's special tokens, e.g. a BOS;
        conversational prompts through its chat template, which writes its own) and
        left-padded. The seed mixes the trainer's seed, its global step, the process
        index, the train/eval mode and the number of earlier calls at that step (TRL
        generates several times per step under gradient accumulation, and once per
        evaluation batch), so every call and every process samples anew and a rerun of
        the same steps samples the same tokens. The result is TRL's dict:
        ``prompt_ids``, ``completion_ids`` (EOS included) and ``logprobs`` (of each
        sampled token under the sampling distribution), one unpadded list per
        completion, in TRL's order. With tools, the prompts are rendered with their
        schemas and the tool loop runs on episodes (:meth:`ToolLoop.run`).
        """
        chat = _check_prompts(prompts)
        _refuse_trainer_generation(trainer)
        loop = self.tool_loop
        if loop is not None and not chat:
            raise ValueError("rollout_func: make_rollout_func(tools=... / environment_factory=...) needs "
                             "conversational prompts (lists of {'role', 'content'} dicts): tool calls and results "
                             "are messages of the conversation")
        policy = _policy_model(trainer)
        model = self._generation_model(policy, trainer)
        processing_class = getattr(trainer, "processing_class", None)
        if processing_class is None:
            raise TypeError("rollout_func: trainer.processing_class is None; GRPOTrainer needs a tokenizer")
        tokenizer = _tokenizer_of(processing_class)
        if loop is not None:
            if is_zero3_partitioned(model):
                raise ValueError(
                    "rollout_func: make_rollout_func(tools=... / environment_factory=...) on a ZeRO-3 partitioned "
                    "model would gather the parameters (a collective) at every turn, and processes take different "
                    "numbers of turns; pass make_rollout_func(zero3_gathered_inference_copy=True), which gathers "
                    "once per call")
            loop.tokenizing(trainer, processing_class, tokenizer)  # refuses a template that cannot do tools
            prompts = loop.prepare(list(prompts))  # environments reset, their observations in the prompts
        unique, n = _fold(prompts)
        position, calls = self._position(trainer)
        sampling = self._sampling(trainer, n, position, calls, policy.generation_config)
        rollout = self._rollout_for(model, trainer, tokenizer)
        prompt_ids, request = self._tokenize(trainer, unique, chat, tokenizer, next(rollout.model.parameters()).device)
        self.last_request, self.last_sampling = request, sampling
        step, process, mode = position
        if loop is not None:
            out = loop.run(rollout, request, prompt_ids, n, sampling, loop.iterations(trainer))
            self._between_phases(rollout)
            self._calls[(process, mode)] = (step, calls + 1)
            loop.log_metrics(trainer, mode)
            return out
        batch = rollout.generate(request, sampling)
        self._between_phases(rollout)
        self._calls[(process, mode)] = (step, calls + 1)  # the next call at this step samples anew
        lengths = batch.response_lengths.tolist()
        responses = batch.responses.tolist()
        logprobs = batch.response_logprobs.tolist()
        return {
            "prompt_ids": [prompt_ids[row // n] for row in range(len(lengths))],
            "completion_ids": [r[:k] for r, k in zip(responses, lengths)],
            "logprobs": [lp[:k] for lp, k in zip(logprobs, lengths)],
        }

    def _between_phases(self, rollout: HybridEngineRollout) -> None:
        """``sleep_between_phases``: the page pool sleeps while TRL trains (graphs kept; the next call wakes it).
        TRL owns the optimizer, so its memory stays where it is."""
        if self.sleep_between_phases:
            rollout.sleep()

    def __repr__(self) -> str:
        tools = "" if self.tool_loop is None else f", tools={[t.__name__ for t in self.tool_loop.schema_tools]!r}"
        return (f"HybridEngineRolloutFunc(config={self.config!r}, overrides={self.overrides!r}{tools}, "
                f"zero3_gathered_inference_copy={self.zero3_gathered_inference_copy})")


def destroy_trainer_deepspeed(trainer: Any) -> None:
    """Tear down the DeepSpeed engine a transformers/TRL trainer built, now (call it on every rank, after
    training, before :func:`hybrid_engine.distributed.world.destroy_process_group`).

    Left to interpreter shutdown, a ZeRO-3 engine on gloo can abort the process after
    its last line (see :func:`hybrid_engine.training.deepspeed.destroy_deepspeed_engine`); the
    trainer and accelerate hold it in several places, all dropped here first.
    """
    trainer.accelerator.free_memory()  # accelerate's references to the engine and its optimizer
    trainer.deepspeed = trainer.optimizer = trainer.lr_scheduler = None
    destroy_deepspeed_engine(trainer, "model_wrapped")


def make_rollout_func(config: RolloutConfig | None = None, *, tools: list[Any] | None = None,
                      environment_factory: Any = None, max_tool_calling_iterations: int | None = None,
                      tool_timeout: float | None = DEFAULT_TOOL_TIMEOUT, zero3_gathered_inference_copy: bool = False,
                      sleep_between_phases: bool = False, **sampling: Any) -> HybridEngineRolloutFunc:
    """A TRL ``rollout_func`` that generates with hybrid-engine on the trainer's model (graphs captured once).

    ``config`` is the rollout's :class:`~hybrid_engine.RolloutConfig` (``None``:
    graph capture on, everything else default; its pad/EOS ids default to the
    tokenizer's and TRL's). ``sampling`` overrides what ``trainer.args`` says:
    ``top_p``, ``top_k``, ``seed`` (the base seed, mixed with the global
    step as the trainer's seed would be) and ``logprobs`` (``"full"``: under
    the full softmax at the temperature, as TRL's own loss scores tokens, instead
    of renormalised over top-k / top-p); ``max_completion_length`` (alias
    ``max_new_tokens``) and ``temperature`` are accepted only equal to the
    trainer's, because TRL's loss reads them too.

    ``sleep_between_phases=True``: the rollout's K/V page pool sleeps after each call, every graph kept, and
    the next call wakes it (``docs/memory-handoff.md``; TRL owns the optimizer, which stays where it is).

    Under DeepSpeed ZeRO-3, rollouts gather the parameters at each call and
    decode eagerly; ``zero3_gathered_inference_copy=True`` decodes with graphs on
    an unpartitioned copy refreshed at each call (one full copy of the weights
    per process, PEFT adapters included). See :meth:`HybridEngineRolloutFunc._generation_model`.

    ``tools`` (functions) and ``environment_factory`` (a callable returning an environment with ``reset`` and
    tool methods, as TRL defines them; both may be given, as in TRL) run TRL's tool loop inside the engine,
    every turn on the same episodes, for conversational prompts; the result adds ``env_mask`` (0 on tool
    results, which get logprob 0 and no loss), ``completion_messages`` (the turns and tool messages, as TRL's
    own loop gives reward functions ``completions``) and, with environments, ``environments``.
    ``max_tool_calling_iterations`` overrides ``trainer.args.max_tool_calling_iterations``. ``tool_timeout``
    (seconds, default 60; ``None``: none) bounds each tool call: one still running then is a tool failure the
    model sees, as an exception is (:class:`~hybrid_engine.integrations.trl_tools.ToolLoop`). Pass them here, not
    to ``GRPOTrainer``. See :mod:`hybrid_engine.integrations.trl_tools`.

    Use: ``GRPOTrainer(model, reward_funcs, args=..., train_dataset=...,
    processing_class=tokenizer, rollout_func=make_rollout_func())``.
    """
    return HybridEngineRolloutFunc(config, tools=tools, environment_factory=environment_factory,
                                   max_tool_calling_iterations=max_tool_calling_iterations, tool_timeout=tool_timeout,
                                   zero3_gathered_inference_copy=zero3_gathered_inference_copy,
                                   sleep_between_phases=sleep_between_phases, **sampling)
