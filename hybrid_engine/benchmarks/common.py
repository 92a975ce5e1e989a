"""Shared pieces of the benchmarks: device/model setup, timing, tables, JSON, plots, environment header.

Every benchmark measures eager and graph side by side in one process: nothing
here stores or hard-codes a figure. Timers synchronise the accelerator before
reading the clock, so asynchronous device work is charged to the phase that
issued it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hybrid_engine.benchmarks.options import (
    DTYPES,
    UsageError,
    available_devices,
    check_common_args,
    load_pretrained_model,
    resolve_model_name,
)

PLOT_HINT = "--plot needs matplotlib: pip install 'hybrid-engine[plot]' (or pip install matplotlib)"

#: Calls before measuring a graph path: the runner warms a graph key up on its first use and captures
#: it on the next, and some keys (a rollout's admission round, a bucket a call visits once) are used
#: once per call, so the second call is the one that captures them.
WARMUP_CALLS = 2

# --------------------------------------------------------------------- device


def select_device(name: str | None) -> Any:
    """Make ``name`` (cuda, npu, xpu, mps, cpu, or None = auto-detect) the process accelerator; return it.

    ``--device`` is checked first: a name the engine does not know, or an accelerator this machine does not
    have, is a :class:`~hybrid_engine.benchmarks.options.UsageError` that names what is available.
    """
    from hybrid_engine.accelerator import KNOWN_BACKENDS, build_accelerator, get_accelerator, set_accelerator

    if not name:
        try:
            acc = get_accelerator()
            acc.device()
            return acc
        except Exception as exc:  # HYBRID_ENGINE_ACCELERATOR names one this machine cannot use
            raise UsageError(f"no usable accelerator ({type(exc).__name__}: {exc}); fix or unset "
                             f"HYBRID_ENGINE_ACCELERATOR, or pass --device") from None
    key = name.strip().lower()
    if key not in KNOWN_BACKENDS:
        raise UsageError(f"--device {name!r} is not a device this engine knows: choose one of "
                         f"{', '.join(KNOWN_BACKENDS)}, or leave --device out to auto-detect")
    if key != "cpu":
        available = available_devices()
        if key not in available:
            raise UsageError(f"--device {key} is not available on this machine (torch {torch.__version__} finds no "
                             f"{key} device); available: {', '.join(available)}. Use --device "
                             f"{available[0]}, or leave --device out to auto-detect")
    try:
        current = get_accelerator().device().type
    except Exception:  # HYBRID_ENGINE_ACCELERATOR names one this machine cannot use: --device decides
        current = None
    if key != current:
        set_accelerator(build_accelerator(key))
    return get_accelerator()


def apply_threads(args: argparse.Namespace, device: torch.device) -> None:
    """``--threads``, or 1 thread for a tiny model on CPU (intra-op threads only add overhead there)."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    elif device.type == "cpu" and not getattr(args, "model_path", None) and \
            resolve_model_name(getattr(args, "model", "")).startswith("tiny-"):
        torch.set_num_threads(1)


def synchronize() -> None:
    from hybrid_engine.accelerator import get_accelerator

    get_accelerator().synchronize()


def parse_dtype(name: str | None, device_type: str) -> torch.dtype:
    """``auto`` is fp16 on an accelerator and fp32 on CPU."""
    name = (name or "auto").lower()
    if name == "auto":
        return torch.float32 if device_type == "cpu" else torch.float16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose auto, fp32, fp16 or bf16")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def precision_config(dtype: torch.dtype) -> dict[str, Any]:
    """Engine precision keys for a model in ``dtype``: bf16/fp16 parameters with fp32 master weights.

    The module (and so generation, graphs included) runs in ``dtype``, which is
    what the reference measured; the optimizer steps fp32 masters, as DeepSpeed's
    bf16/fp16 engines do.
    """
    return {"fp16": {"enabled": dtype == torch.float16}, "bf16": {"enabled": dtype == torch.bfloat16}}


# ---------------------------------------------------------------------- model


_MODEL_CACHE: dict[tuple, Any] = {}


def build_bench_model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device, seed: int = 0,
                      **config_overrides: Any):
    """A fresh model (same weights for the same seed) from ``--model`` or ``--model-path``, on ``device``;
    ``config_overrides`` change a config-built model's config (``max_position_embeddings``, say).

    The weights are built (or loaded) once on the CPU, where the seeded init is
    reproducible, and each call returns an independent copy moved to ``device``:
    building a 1.3B model from its config takes far longer than copying it.
    """
    import copy

    key = (getattr(args, "model_path", None) or resolve_model_name(args.model), dtype, seed,
           tuple(sorted(config_overrides.items())))
    if key not in _MODEL_CACHE:
        _MODEL_CACHE.clear()  # one model at a time: a 1.3B master copy is big enough
        if getattr(args, "model_path", None):
            model = load_pretrained_model(args.model_path, dtype=dtype)
            model.eval()
        else:
            from hybrid_engine.tiny_models import build_model

            model = build_model(resolve_model_name(args.model), seed=seed, dtype=dtype, **config_overrides)
        _MODEL_CACHE[key] = model
    return copy.deepcopy(_MODEL_CACHE[key]).to(device)


def model_label(args: argparse.Namespace) -> str:
    return f"local checkpoint {args.model_path}" if getattr(args, "model_path", None) else resolve_model_name(args.model)


def special_ids(model: Any) -> tuple[int, int]:
    """(pad_token_id, eos_token_id) of ``model``, with sane fallbacks."""
    cfg = model.config
    eos = cfg.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    pad = cfg.pad_token_id
    if pad is None:
        pad = eos if eos is not None else 0
    if eos is None:
        eos = pad
    return int(pad), int(eos)


def random_prompts(
    batch: int, length: int, vocab_size: int, *, seed: int, device: torch.device,
    avoid: Iterable[int] = (), min_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts ``[batch, length]`` and their mask; ids avoid special tokens.

    With ``min_length`` the real lengths are drawn in ``[min_length, length]``;
    otherwise every prompt is full-length (the reference benchmarks' shape).
    """
    gen = torch.Generator().manual_seed(seed)
    low = 4 if vocab_size > 8 else 0
    ids = torch.randint(low, vocab_size, (batch, length), generator=gen)
    for a in avoid:
        ids[ids == a] = low if a != low else low + 1
    mask = torch.ones(batch, length, dtype=torch.long)
    if min_length is not None and min_length < length:
        lengths = torch.randint(min_length, length + 1, (batch,), generator=gen)
        for row, n in enumerate(lengths.tolist()):
            mask[row, : length - n] = 0
    pad = next(iter(avoid), 0)
    ids = ids.masked_fill(mask == 0, pad)
    return ids.to(device), mask.to(device)


# --------------------------------------------------------------------- timing


@contextmanager
def timer(out: list[float]):
    """Append the block's wall time in ms to ``out``, synchronising the accelerator at both ends."""
    synchronize()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        synchronize()
        out.append((time.perf_counter() - t0) * 1e3)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), ms)`` with the accelerator synchronised around the call."""
    box: list[float] = []
    with timer(box):
        result = fn()
    return result, box[0]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else float("nan")


def speedup(eager: float, graph: float) -> float:
    return eager / graph if graph > 0 else float("nan")


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(identical, total) over two token tensors of the same shape."""
    if a.shape != b.shape:
        n = max(a.numel(), b.numel())
        return 0, n
    return int((a.cpu() == b.cpu()).sum()), int(a.numel())


# ---------------------------------------------------------------- environment


def hardware_name(device_type: str) -> str:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    if device_type not in ("cpu", "mps"):
        return device_type
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = os.cpu_count() or 0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    return f"{cpu}, {cores} cores, {torch.get_num_threads()} torch threads"


def environment(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Date, hardware, versions and the exact command, for every table and JSON file."""
    import transformers

    from hybrid_engine.accelerator import get_accelerator

    acc = get_accelerator()
    device_type = acc.device().type
    argv = list(sys.argv[1:] if argv is None else argv)
    return {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "hardware": hardware_name(device_type),
        "device": acc.device_name(),
        "graph_api": acc.graph_api if acc.supports_graph_capture else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": "hybrid-engine " + " ".join(shlex.quote(a) for a in argv),
    }


def environment_lines(env: dict[str, Any]) -> str:
    return (
        f"date: {env['date']}\n"
        f"hardware: {env['hardware']} (device {env['device']}, graphs via {env['graph_api'] or 'none'})\n"
        f"python {env['python']}, torch {env['torch']}, transformers {env['transformers']}\n"
        f"command: {env['command']}"
    )


# --------------------------------------------------------------------- output


def fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A Markdown table (readable as plain text too)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
            for r in cells]
    out = [line, sep, *body]
    if title:
        out.insert(0, f"{title}\n")
    return "\n".join(out)


def gib(n_bytes: int | float | None) -> str:
    if not n_bytes:
        return "n/a"
    return f"{n_bytes / 2**30:.2f} GiB"


def check_output_path(option: str, path: str | None) -> None:
    """Fail fast, before any measuring, when ``path`` (``--json``, ``--plot``) cannot be written."""
    if not path:
        return
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise UsageError(f"{option} {path!r} is a directory; give a file path")
    parent = os.path.dirname(full)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {path!r}: cannot create its directory {parent} ({exc.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path!r}: the directory {parent} is not writable")


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Strict JSON: a figure that does not exist (NaN, infinity) is written as ``null``."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(_finite(payload), fh, indent=2, default=_json_default, allow_nan=False)
        fh.write("\n")
    print(f"wrote {path}")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, torch.dtype):
        return dtype_name(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)


def check_plot_available(path: str | None) -> None:
    """Fail fast, before any measuring, when ``--plot`` is asked for without matplotlib."""
    if not path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"error: {PLOT_HINT}") from exc


def write_plot(path: str, draw: Callable[[Any], None], title: str) -> None:
    """Render one figure with ``draw(pyplot)`` to ``path`` (PNG), headless."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - checked up front by check_plot_available
        raise SystemExit(f"error: {PLOT_HINT}") from exc
    plt.figure(figsize=(7, 4.5))
    draw(plt)
    plt.suptitle(title)
    plt.tight_layout()
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    plt.savefig(path, dpi=120)
    plt.close()
    print(f"wrote {path}")


def bar_pairs(plt: Any, labels: Sequence[str], eager: Sequence[float], graph: Sequence[float], ylabel: str) -> None:
    """Grouped eager/graph bars, the common plot of every sub-benchmark."""
    xs = range(len(labels))
    w = 0.38
    plt.bar([x - w / 2 for x in xs], eager, w, label="eager")
    plt.bar([x + w / 2 for x in xs], graph, w, label="graph")
    plt.xticks(list(xs), labels)
    plt.ylabel(ylabel)
    plt.legend()


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_common_args(p: argparse.ArgumentParser, *, default_model: str, plot: bool = True) -> None:
    p.add_argument("--model", default=default_model,
                   help=f"config-built random-weight model: tiny (=tiny-gpt2), tiny-opt, tiny-llama, tiny-qwen2, "
                        f"tiny-qwen3, tiny-mistral, gpt2 (124M shape), opt-125m, opt-1.3b, qwen2.5-0.5b (default {default_model})")
    p.add_argument("--model-path", default=None, help="load a local Hugging Face checkpoint directory instead")
    p.add_argument("--device", default=None, help="accelerator: cuda, npu, xpu, mps or cpu (default: auto-detect)")
    p.add_argument("--dtype", default="auto", help="auto (fp16 on an accelerator, fp32 on CPU), fp32, fp16, bf16")
    p.add_argument("--seed", type=int, default=0, help="weight and prompt seed (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 for tiny models on CPU, torch's default otherwise)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    if plot:
        p.add_argument("--plot", default=None, metavar="PATH", help="also write a PNG plot to PATH (needs matplotlib)")


def graph_side_problem(label: str, counts: dict[str, Any]) -> str | None:
    """Why the graph side of an eager-vs-graph comparison did not measure graphs (``None``: it replayed graphs
    and never fell back to eager). ``counts``: :func:`~hybrid_engine.benchmarks.paths.graph_counts`."""
    if counts.get("replays") and not counts.get("fallbacks"):
        return None
    why = counts.get("refusal") or ("a capture failed" if counts.get("fallbacks") else "no graph was replayed")
    return f"{label}: the graph side ran eagerly, at least in part ({why})"


def finish(args: argparse.Namespace, payload: dict[str, Any], text: str, draw: Callable[[Any], None] | None,
           title: str) -> None:
    """Print the report; write JSON and plot when asked. Then, when ``payload["graph_side_problems"]`` names
    any, exit with status 1: a silent fallback to eager would otherwise read as a ~1.0x speedup."""
    problems = payload.get("graph_side_problems") or []
    if problems:
        text += "\n\nNOT VALID: " + "; ".join(problems) + ". The graph figures above measure eager decoding."
    print(text)
    if args.json:
        write_json(args.json, payload)
    plot = getattr(args, "plot", None)  # bench parity has no --plot
    if plot and draw is not None:
        write_plot(plot, draw, title)
    if problems:
        raise SystemExit("error: " + "; ".join(problems))


def prepare(args: argparse.Namespace) -> tuple[Any, torch.device, torch.dtype, dict[str, Any]]:
    """The common start of every bench: option checks, accelerator, threads, dtype and environment header."""
    check_plot_available(getattr(args, "plot", None))
    check_output_path("--json", getattr(args, "json", None))
    check_output_path("--plot", getattr(args, "plot", None))
    check_common_args(args)
    acc = select_device(args.device)
    device = acc.device()
    apply_threads(args, device)
    dtype = parse_dtype(args.dtype, device.type)
    return acc, device, dtype, environment(getattr(args, "argv", None))
