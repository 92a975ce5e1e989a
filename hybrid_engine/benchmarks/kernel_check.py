"""``hybrid-engine bench kernels --check``: every decode custom op against its reference, on the device.

Why: an op picks its implementation by a probe on a tiny input; this runs each op through the dispatcher (the
implementation the probe chose on ``--device``) at a decode step's real widths (Qwen2.5-0.5B: 14 query and 2 KV
heads of 64, hidden 896, intermediate 4,864, vocabulary 151,936, 64 rows, rows up to 2k tokens on 16-token
pages) and compares it with the op's reference implementation on the same inputs. A mismatch beyond the op's tolerance fails the command
(exit 1), so ``bench/gpu_check.sh`` reports it. On a machine where every op runs its reference, the comparison is
trivially exact, and the table says so (``implementation: reference``). On a CUDA device with Triton that would
hide a kernel the probe refused (it swallows the kernel's error and falls back), so there an op running its
reference fails, and its kernel is run forced next to it: the rows show the error that stopped it or how far it
is from the reference. A device run spends no second run finding out why.

The op calls alone, one per kernel variant, are :data:`LAUNCHES`: what ``bench kernels --compile-for``
(:mod:`~hybrid_engine.benchmarks.triton_aot`) compiles for a GPU on a machine without one.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: Tolerances (max |got - want|) per dtype: fp32 kernels agree to rounding; half types to their precision.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
ROWS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE, SPAN = 64, 896, 4864, 14, 2, 64, 16, 2048


def _paged_args(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    """``paged_decode_attention``'s arguments: 64 rows of up to 2k tokens, pages shuffled across the pool."""
    pages = SPAN // PAGE
    q = torch.randn(ROWS, HEADS, 1, HEAD_DIM, generator=g).to(device, dtype)
    pools = [torch.randn((1 + ROWS * pages) * PAGE, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
             for _ in range(2)]
    table = (1 + torch.randperm(ROWS * pages, generator=g)).view(ROWS, pages).to(device)
    lengths = torch.randint(1, SPAN + 1, (ROWS,), generator=g).to(device)
    return (q, *pools, table, lengths, HEAD_DIM ** -0.5, PAGE)


def _paged_attention(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[str, list]:
    from hybrid_engine.decode.ops import paged_attention as P

    args = _paged_args(device, dtype, g)
    got = torch.ops.hybrid_engine.paged_decode_attention(*args)
    return P.implementation(device), [("paged_decode_attention", got, P.reference_attention(*args))]


def _layer_args(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> dict[str, tuple]:
    """Each layer op's arguments, by op name."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    x, res, w = rand(ROWS, 1, HIDDEN), rand(ROWS, 1, HIDDEN), rand(HIDDEN)
    q, k = rand(ROWS, HEADS, 1, HEAD_DIM), rand(ROWS, KV_HEADS, 1, HEAD_DIM)
    angle = torch.rand(ROWS, 1, HEAD_DIM // 2, generator=g).to(device) * 100
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(dtype) for f in (torch.cos, torch.sin))
    gate, up = rand(ROWS, 1, INTER), rand(ROWS, 1, INTER)
    return {"rms_norm": (x, w, 1e-6), "add_rms_norm": (x, res, w, 1e-6), "rotary_qk": (q, k, cos, sin),
            "silu_mul": (gate, up)}


def _layer_ops(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[str, list]:
    from hybrid_engine.decode.ops import layer_ops as L

    args = _layer_args(device, dtype, g)
    ops = torch.ops.hybrid_engine
    pairs = [("rms_norm", ops.rms_norm(*args["rms_norm"]), L.reference_rms_norm(*args["rms_norm"]))]
    for name, got, want in zip(("add_rms_norm (normed)", "add_rms_norm (sum)"), ops.add_rms_norm(*args["add_rms_norm"]),
                               L.reference_add_rms_norm(*args["add_rms_norm"])):
        pairs.append((name, got, want))
    for name, got, want in zip(("rotary_qk (q)", "rotary_qk (k)"), ops.rotary_qk(*args["rotary_qk"]),
                               L.reference_rotary_qk(*args["rotary_qk"])):
        pairs.append((name, got, want))
    pairs.append(("silu_mul", ops.silu_mul(*args["silu_mul"]), L.reference_silu_mul(*args["silu_mul"])))
    return L.implementation(device), pairs


def _bookkeeping_state(device: torch.device, dtype: torch.dtype, g: torch.Generator, stops: bool = True) -> list:
    """``advance_rows``' arguments: a 64-row state (EOS, budgets, min_tokens, finished rows, rows at capacity,
    stop sequences with wildcards, or none); the sampler's logprobs in ``dtype``, the recorded ones in fp32 (what
    the op takes)."""
    b, capacity, vocab = ROWS, SPAN, 151936
    finished = torch.rand(b, generator=g) < 0.2
    index = torch.randint(0, capacity + 2, (b,), generator=g)
    min_tokens = torch.randint(0, 8, (b,), generator=g)
    stop_ids = torch.randint(0, 50, (4, 3, 4), generator=g).masked_fill(torch.rand(4, 3, 4, generator=g) < 0.4, -1)
    out = torch.randint(0, 50, (b, capacity + 1), generator=g)
    state = [torch.randint(0, vocab, (b,), generator=g), index, finished, ~finished, (~finished).long(),
             index < min_tokens, out, torch.randn(b, capacity + 1, generator=g),
             torch.randint(0, 50, (b,), generator=g), torch.randn(b, generator=g).to(dtype),
             torch.randint(1, capacity + 2, (b,), generator=g), min_tokens,
             torch.rand(vocab, generator=g) < 1e-3, torch.tensor(0), stop_ids, torch.randint(0, 4, (b,), generator=g)]
    if not stops:
        state[-2:] = [None, None]
    return [None if t is None else t.to(device) for t in state]


def _bookkeeping(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[str, list]:
    """``advance_rows`` on :func:`_bookkeeping_state`: the kernel must leave exactly the reference's state
    (integers, flags, copies)."""
    from hybrid_engine.decode.ops import bookkeeping as K

    state = _bookkeeping_state(device, dtype, g)
    ours, want = ([t.clone() for t in state] for _ in range(2))
    torch.ops.hybrid_engine.advance_rows(*ours)
    K.reference_advance_rows(*want)
    names = ("tokens", "token_index", "finished", "live", "advance", "suppress_eos", "out_tokens", "out_logprobs")
    return K.implementation(device), [(f"advance_rows ({n})", o, w) for n, o, w in zip(names, ours, want)]


#: The sampler settings checked: (name, (temperature, top_p, top_k)).
SAMPLER_SETTINGS = (("temperature 1", (1.0, 1.0, -1)), ("top-p 0.9", (1.0, 0.9, -1)),
                    ("top-k 50 + top-p 0.9", (0.7, 0.9, 50)))


def _sampler_args(device: torch.device, logits: torch.Tensor, setting: tuple[float, float, int]) -> tuple:
    """``sample_rows``' arguments for ``logits`` under one setting (its knob tables built on ``device``)."""
    from hybrid_engine.decode.sampling import SamplingKnobs

    knobs = SamplingKnobs(device)
    knobs.set(*setting)
    return (logits, None, None, torch.zeros(ROWS, dtype=torch.long, device=device), knobs.inv_temperature,
            knobs.top_p, knobs.top_k, knobs.full, torch.tensor(7, device=device), torch.tensor(1, device=device),
            torch.arange(ROWS, device=device), setting[2] > 0, setting[1] < 1)


def _sampler_logits(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(ROWS, 151936, generator=g) * 3).to(device, dtype)


def _sampler(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[str, list]:
    """``sample_rows``' kernel on Qwen-wide rows: the logprob it reports for the token it drew equals the
    reference's filtered logprob of that token (the draws themselves follow the same distribution, not the same
    token per seed: bench/sampler_check.py tests that)."""
    from hybrid_engine.decode.ops import sampler as S

    logits = _sampler_logits(device, dtype, g)
    pairs = []
    for name, setting in SAMPLER_SETTINGS:
        args = _sampler_args(device, logits, setting)
        tokens, lp = torch.ops.hybrid_engine.sample_rows(*args)
        inv_t, p, k = (t[:1, None] for t in args[4:7])
        ref_lp, _, _ = S.filtered_logprobs(logits, inv_t, p, k, setting[2] > 0, setting[1] < 1, per_row=True)
        pairs.append((f"sample_rows {name} (logprob of the drawn token)", lp,
                      ref_lp.gather(1, tokens[:, None]).squeeze(1)))
    return S.implementation(device), pairs


def _launch(op: str, args: Callable[..., Any]) -> Callable[..., Any]:
    """A launch of ``torch.ops.hybrid_engine.<op>`` on ``args(device, dtype, g)``, its outputs unused."""
    return lambda device, dtype, g: getattr(torch.ops.hybrid_engine, op)(*args(device, dtype, g))


#: Every op call of the checks, one per kernel variant, that only launches (no reference, no comparison): what
#: :mod:`~hybrid_engine.benchmarks.triton_aot` compiles ahead of time. ``(label, launch(device, dtype, g))``.
LAUNCHES: list[tuple[str, Callable[..., Any]]] = [
    ("paged_decode_attention", _launch("paged_decode_attention", _paged_args)),
    *[(op, _launch(op, lambda d, t, g, op=op: _layer_args(d, t, g)[op]))
      for op in ("rms_norm", "add_rms_norm", "rotary_qk", "silu_mul")],
    ("advance_rows (stop sequences, logprobs)", _launch("advance_rows", _bookkeeping_state)),
    ("advance_rows (no stop sequences)", _launch("advance_rows", lambda d, t, g: _bookkeeping_state(d, t, g, False))),
    *[(f"sample_rows {name}", _launch("sample_rows", lambda d, t, g, s=setting: _sampler_args(
        d, _sampler_logits(d, t, g), s))) for name, setting in SAMPLER_SETTINGS],
]


#: One entry per ops module: (name, check(device, dtype, generator) -> (implementation, [(op, got, want)])).
CHECKS: list[tuple[str, Callable[..., tuple[str, list]]]] = [
    ("paged attention", _paged_attention),
    ("layer ops", _layer_ops),
    ("bookkeeping", _bookkeeping),
    ("sampler", _sampler),
]


#: The ops modules whose implementation :func:`forced_triton` forces (each chooses by its probe otherwise).
_OP_MODULES = ("paged_attention", "layer_ops", "bookkeeping", "sampler")


@contextlib.contextmanager
def forced_triton() -> Iterator[None]:
    """Every decode op's ``implementation`` answers ``"triton"`` (as on a GPU where its probe passed). A probe
    that runs meanwhile (one a helper calls directly) may see odd results, so the probes' cached answers are
    dropped on the way out."""
    modules = [importlib.import_module(f"hybrid_engine.decode.ops.{name}") for name in _OP_MODULES]
    saved = [m.implementation for m in modules]
    try:
        for m in modules:
            m.implementation = lambda device: "triton"
        yield
    finally:
        for m, impl in zip(modules, saved):
            m.implementation = impl
            m._probe.cache_clear()


def _rows(group: str, impl: str, pairs: list, tol: float, suffix: str = "") -> list[dict[str, Any]]:
    rows = []
    for op, got, want in pairs:
        if op.startswith("advance_rows"):  # state: exactly the reference's
            err = float((got != want).sum())
            ok = err == 0
        elif got.dtype.is_floating_point:
            err = float((got.float() - want.float()).abs().max())
            ok = err <= tol and bool(torch.isfinite(got).all())
        else:
            err = float((got != want).sum())
            ok = err == 0
        rows.append({"group": group, "op": op + suffix, "implementation": impl, "max_abs_err": err, "tolerance": tol,
                     "ok": ok, "error": None})
    return rows


def _run_check(group: str, check: Callable[..., tuple[str, list]], device: torch.device, dtype: torch.dtype,
               suffix: str = "") -> list[dict[str, Any]]:
    """The group's rows; a check that raises is one failed row (its exception), not a crash."""
    tol = TOLERANCE[dtype]
    try:
        impl, pairs = check(device, dtype, torch.Generator().manual_seed(0))
    except Exception as exc:  # noqa: BLE001 -- reported as a failed row
        return [{"group": group, "op": group + suffix, "implementation": "triton" if suffix else "?",
                 "max_abs_err": None, "tolerance": tol, "ok": False, "error": f"{type(exc).__name__}: {exc}"}]
    return _rows(group, impl, pairs, tol, suffix)


def check_kernels(device: torch.device, dtype: torch.dtype, expect_kernels: bool = False) -> list[dict[str, Any]]:
    """One row per op output: the implementation chosen on ``device``, the max abs error against the reference,
    the tolerance, and whether it holds. A check that raises is a failed row, not a crash.

    ``expect_kernels`` (a CUDA device with Triton: ``bench kernels --check`` sets it there): an op whose probe fell
    back to its reference fails (it would compare the reference with itself), and its kernel is then run forced,
    in rows marked ``(kernel forced)``: the exception that stopped it, or how far it is from the reference, which
    says why the probe refused it."""
    rows: list[dict[str, Any]] = []
    for group, check in CHECKS:
        got = _run_check(group, check, device, dtype)
        if expect_kernels and any(r["implementation"] == "reference" for r in got):
            for r in got:
                r["ok"], r["error"] = False, "the probe fell back to the reference here: see the forced rows"
            with forced_triton():
                got += _run_check(group, check, device, dtype, suffix=" (kernel forced)")
        rows += got
    return rows
