"""Command-line options of ``demo`` and ``bench``, checked before any work.

A bad option (an accelerator this machine lacks, a model path that is no
checkpoint, more tokens than the model has positions) is a
:class:`UsageError`: one ``error:`` line naming the option
and the fix, exit status 2, instead of a traceback from deep inside a run.
Devices are probed, never assumed, and nothing is ever downloaded.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from hybrid_engine.decode.sampling import validate_sampling

#: ``--dtype`` names.
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

#: The longest prompt, in tokens, of the demo's prompts (``demo.make_prompts``), which bench soak uses too.
DEMO_PROMPT_LEN = 12


class UsageError(SystemExit):
    """A bad command-line option, found before any work starts.

    :func:`hybrid_engine.cli.main` prints it as one ``error: ...`` line on stderr, without a traceback, and
    returns 2, the exit status of argparse's own errors. It is a ``SystemExit``, so raised outside that
    ``main`` it still ends the process with its message rather than a traceback. The message says what is
    wrong, names the option and says the fix.
    """

    def __init__(self, message: str) -> None:
        self.message = " ".join(message.split())  # one line, whatever the wrapped exception's text held
        super().__init__(f"error: {self.message}")


def resolve_model_name(name: str) -> str:
    """``tiny`` means tiny-gpt2; other names go to :func:`hybrid_engine.tiny_models.build_model` unchanged."""
    return "tiny-gpt2" if name.strip().lower() == "tiny" else name


def available_devices() -> list[str]:
    """The ``--device`` values this machine can run: each accelerator torch reports as available, then ``cpu``.

    Probed, not assumed: ``torch.<backend>.is_available()`` for every backend the engine knows (``torch_npu``
    imported first for NPUs, ``torch.backends.mps`` for MPS on older torch), plus ``torch.accelerator`` where
    this torch has it.
    """
    import importlib
    import importlib.util

    from hybrid_engine.accelerator import KNOWN_BACKENDS

    found: list[str] = []
    for name in KNOWN_BACKENDS:
        if name == "cpu":
            continue
        if name == "npu":
            if importlib.util.find_spec("torch_npu") is None:
                continue
            try:
                importlib.import_module("torch_npu")
            except ImportError:
                continue
        module = getattr(torch, name, None)
        probe = getattr(module, "is_available", None)
        if probe is None and name == "mps":
            probe = getattr(getattr(torch.backends, "mps", None), "is_available", None)
        if callable(probe) and probe():
            found.append(name)
    acc = getattr(torch, "accelerator", None)
    if acc is not None and callable(getattr(acc, "is_available", None)) and acc.is_available():
        current = acc.current_accelerator()
        if current is not None and current.type in KNOWN_BACKENDS and current.type not in found:
            found.append(current.type)
    return [*found, "cpu"]


def check_model_path(path: str) -> None:
    """``--model-path`` must name a local Hugging Face checkpoint directory (nothing is ever downloaded)."""
    fix = "pass a local Hugging Face checkpoint directory (config.json and weights), or leave --model-path out"
    if not os.path.exists(path):
        raise UsageError(f"--model-path {path} does not exist; {fix}")
    if not os.path.isdir(path):
        raise UsageError(f"--model-path {path} is not a directory; {fix}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--model-path {path} has no config.json, so it is not a Hugging Face checkpoint "
                         f"directory; {fix}")


def _unloadable(path: str, exc: Exception) -> Exception:
    return UsageError(f"--model-path {path} is not a loadable causal LM checkpoint ({type(exc).__name__}: {exc}); "
                      "pass a local Hugging Face checkpoint directory saved with save_pretrained, or leave "
                      "--model-path out")


def load_pretrained_config(path: str) -> Any:
    """The config of the local checkpoint ``path`` (``--model-path``); a bad directory is a usage error."""
    from transformers import AutoConfig

    check_model_path(path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:  # transformers' errors for an unreadable or unknown config.json
        raise _unloadable(path, exc) from exc


def load_pretrained_model(path: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM`` from the local checkpoint ``path`` (``--model-path``), never downloading."""
    from transformers import AutoModelForCausalLM

    check_model_path(path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:  # missing/unreadable weights, a config no causal LM class takes
        raise _unloadable(path, exc) from exc


def model_config(name: str, *, option: str = "--model") -> Any:
    """The config :func:`build_bench_model` would build for the model name ``name`` (no weights are built)."""
    from hybrid_engine.tiny_models import build_config, model_names

    key = resolve_model_name(name).strip().lower()
    if key not in model_names():
        raise UsageError(f"{option} {name!r} is not a model name: choose tiny (=tiny-gpt2), "
                         f"{', '.join(model_names())}, or pass --model-path for a local checkpoint")
    return build_config(key)


def model_label_and_config(model_path: str | None, name: str | None, *, option: str = "--model") -> tuple[str, Any]:
    """``(label, config)`` of the model a command builds: the local checkpoint ``model_path`` when given,
    else the model name ``name`` (checked; ``option`` is the option that named it)."""
    if model_path:
        return model_path, load_pretrained_config(model_path)
    return resolve_model_name(name), model_config(name, option=option)


def check_generation_length(config: Any, label: str, *, prompt_tokens: int, new_tokens: int,
                            new_option: str = "--new-tokens", prompt_option: str | None = None) -> None:
    """Prompt plus new tokens must fit the model's position limit: say so, naming the options, before any work.

    ``prompt_option`` names the option that set ``prompt_tokens``; ``None`` means the prompts are the
    command's own (the demo's and soak's, up to ``prompt_tokens`` long), so only ``new_option`` can change.
    """
    from hybrid_engine.decode.model_support import max_positions

    limit = max_positions(config)
    if limit is None:
        return
    if prompt_option is not None and prompt_tokens >= limit:
        raise UsageError(f"{prompt_option} {prompt_tokens} leaves no room for new tokens: the position limit of "
                         f"{label} is {limit}; use {prompt_option} {limit - 1} or less")
    if prompt_tokens >= limit:
        raise UsageError(f"{label} has a position limit of {limit}, no room for {new_option} after prompts of up to "
                         f"{prompt_tokens} tokens; use a model with more positions")
    if prompt_tokens + new_tokens <= limit:
        return
    room = limit - prompt_tokens
    if prompt_option is not None:
        raise UsageError(f"{prompt_option} {prompt_tokens} plus {new_option} {new_tokens} is "
                         f"{prompt_tokens + new_tokens} tokens, more than the position limit {limit} of {label}; "
                         f"use {new_option} {room} or less (or a shorter {prompt_option})")
    raise UsageError(f"{new_option} {new_tokens} is more than {label} can hold: prompts of up to {prompt_tokens} "
                     f"tokens plus {new_tokens} new tokens exceed its position limit {limit}; "
                     f"use {new_option} {room} or less")


#: ``--seed`` values taken: seeds derived from it (``seed * 1000 + iteration``, ``seed + k``) must stay within
#: torch's and the sampler's 64-bit seeds (2**70 was an overflow traceback from torch.manual_seed).
MAX_SEED = 2**32 - 1


#: The most sequences one call of a command decodes or trains on at once (``--batch-size``, each
#: ``--batch-sizes`` entry, ``--batch-size`` x ``--samples``, the slot and request counts): every row gets a KV
#: cache row and logits, allocated up front, so a mistyped size (100000) was an allocator error or a long run.
MAX_ROWS = 4096


def check_seed(value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_SEED:
        raise UsageError(f"--seed must be an integer in [0, {MAX_SEED}] (2**32 - 1), got {value}")


def check_rows(value: int | None, option: str, samples: int | None = None) -> None:
    """``value`` rows (times ``samples`` per row, from ``--samples``) must be at most :data:`MAX_ROWS`."""
    if value is None or value < 1:
        return  # refused as a count elsewhere
    rows = value * (samples if samples and samples > 0 else 1)
    if rows <= MAX_ROWS:
        return
    if samples and samples > 1:
        raise UsageError(f"{option} {value} x --samples {samples} is {rows} sequences per call, more than the "
                         f"{MAX_ROWS} this command decodes and trains on at once (each gets a KV cache row and "
                         f"logits up front); lower {option} or --samples so that their product is at most {MAX_ROWS}")
    raise UsageError(f"{option} {value} is more than {MAX_ROWS}, the most sequences one call of this command takes "
                     f"(each gets a KV cache or output row up front); use {option} {MAX_ROWS} or less")


#: Options (``args`` attributes) that count sequences in one call, checked with :func:`check_rows`.
_ROWS = ("mixed_max_batch", "mixed_requests", "longtail_slots", "longtail_requests")


#: Count options (``args`` attributes) that must be at least 1 wherever a bench has them.
_COUNTS = ("batch_size", "repeats", "iterations", "samples", "checkpoints")
# Options that must be a finite number >= 0: --lr (demo, bench rlhf, bench soak), --max-rss-growth-mb (soak).
_AMOUNTS = ("lr", "max_rss_growth_mb")


def check_finite_nonnegative(option: str, value: float) -> None:
    if not 0 <= value < float("inf"):  # NaN fails this too
        raise UsageError(f"{option} must be a finite number >= 0, got {value}")


def check_common_args(args: argparse.Namespace) -> None:
    """Up-front checks of the options every bench shares (``--dtype``, ``--threads``, ``--model``/``--models``,
    ``--model-path``) and of ``--prompt-len``/``--new-tokens`` against each model's position limit.

    Run by :func:`prepare` before any model is built, so a bad option is one ``error:`` line, not a traceback
    from deep inside a run.
    """
    dtype = (getattr(args, "dtype", None) or "auto").lower()
    if dtype != "auto" and dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype!r} is not a dtype: choose auto, fp32, fp16 or bf16")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}; leave it out for the default")
    for dest in _AMOUNTS:
        if getattr(args, dest, None) is not None:
            check_finite_nonnegative(f"--{dest.replace('_', '-')}", getattr(args, dest))
    if not getattr(args, "model_path", None) and getattr(args, "models", None) is not None:  # bench parity
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        if not names:
            raise UsageError(f"--models {args.models!r} names no model; give comma-separated model names")
        models = [(name, model_config(name, option="--models")) for name in names]
    else:
        models = [model_label_and_config(getattr(args, "model_path", None), getattr(args, "model", None))]
    new_tokens, prompt_len = getattr(args, "new_tokens", None), getattr(args, "prompt_len", None)
    for dest in ("prompt_len", "new_tokens", *_COUNTS):
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            raise UsageError(f"--{dest.replace('_', '-')} must be >= 1, got {value}")
    check_seed(getattr(args, "seed", None))
    check_rows(getattr(args, "batch_size", None), "--batch-size", getattr(args, "samples", None))
    if getattr(args, "samples", None) is not None and getattr(args, "batch_size", None) is None:
        check_rows(args.samples, "--samples")
    sizes = getattr(args, "batch_sizes", None) or ()
    if any(size > MAX_ROWS for size in sizes):
        raise UsageError(f"--batch-sizes {','.join(map(str, sizes))} holds a batch size above {MAX_ROWS}, the most "
                         f"sequences one call of this command takes (each gets a KV cache row up front); give sizes "
                         f"of {MAX_ROWS} or less")
    for dest in _ROWS:
        check_rows(getattr(args, dest, None), f"--{dest.replace('_', '-')}")
    if getattr(args, "top_p", None) is not None:  # bench parity's sampled check
        if not args.temperature > 0:  # NaN and negatives too
            raise UsageError(f"--temperature must be > 0, got {args.temperature}: it sets the sampled check (the "
                             "greedy one always runs)")
        try:
            validate_sampling(args.temperature, args.top_p, -1)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--temperature/--top-p: {exc}") from None
    if new_tokens is None:
        return
    mixed = None  # bench continuous part 2 runs the main model too (part 3 picks its own, --longtail-model)
    if getattr(args, "mixed_requests", 0) > 0 and min(args.mixed_prompt_len, args.mixed_max_new) >= 1:
        mixed = (args.mixed_prompt_len, args.mixed_max_new)
    for label, config in models:
        if prompt_len is None:  # bench soak: the demo's prompts
            check_generation_length(config, label, prompt_tokens=DEMO_PROMPT_LEN, new_tokens=new_tokens)
        else:
            check_generation_length(config, label, prompt_tokens=prompt_len, new_tokens=new_tokens,
                                    prompt_option="--prompt-len")
        if mixed is not None:
            check_generation_length(config, label, prompt_tokens=mixed[0], new_tokens=mixed[1],
                                    new_option="--mixed-max-new", prompt_option="--mixed-prompt-len")
