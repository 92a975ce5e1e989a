"""``hybrid_engine::advance_rows``: everything a decode step does after its sampler, for every row, in one op.

Why one custom op: after the sampler picks each row's token, the step records it (out_tokens, out_logprobs at the
row's token index, or the spare last column for rows that are not live), feeds it next (``tokens``; the pad id on
rows that are not live), advances the token index, and marks rows finished on an EOS, a spent budget or a matched
stop sequence (past ``min_tokens``). Written as aten ops that is 10 kernels a step, 28 with stop sequences; behind
one op it is one node in a captured graph and one kernel in ``hybrid-engine bench kernels``.

The invariants the op also keeps, on every row: ``live == ~finished``, ``advance == live`` as int64 and
``suppress_eos == (token_index < min_tokens)``, so the next step reads all three (the forward and the sampler
need them before this op runs) without computing them. Every other writer of ``finished``, ``token_index`` or
``min_tokens`` (``DecodeSlots.start``, ``resume``, ``release``, ``move``) writes them too.

Implementations, chosen per device by a capability probe (:func:`implementation`): a Triton kernel, one program
per row (:func:`_triton_advance`), where Triton is installed and the kernel runs on that device and leaves exactly
the reference's state on a probe input (under ``TRITON_INTERPRET=1`` that includes the CPU: how CPU CI tests it);
else the reference (:func:`reference_advance_rows`: the step's former aten code, op for op, so its state is the
same bit for bit). Everything the op does is integer and boolean work or a copy of a float (logprobs widened to
fp32, which is exact), so both implementations leave the same bits. The probe runs outside capture, once per
device; a graph captured with one implementation replays it.
"""

from __future__ import annotations

import functools

import torch

from hybrid_engine.decode.ops.define import define_op
from hybrid_engine.decode.ops.probe import failure, probe_device, refuse_while_capturing, warn_fallback

__all__ = ["advance_rows", "implementation", "reference_advance_rows", "stop_match"]

_INT_ROWS = ("tokens", "token_index", "advance", "new_tokens", "budget", "min_tokens")


def stop_match(out_tokens: torch.Tensor, last: torch.Tensor, stop_ids: torch.Tensor,
               knob: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: whether row ``b`` of ``out_tokens`` ends, at column ``last[b]``, in one of the sequences
    ``stop_ids[knob[b]]`` (``[settings, sequences, L]``, right-aligned; ``-1`` matches anything; a sequence of
    all ``-1`` is unused). Device ops only."""
    length = stop_ids.shape[-1]
    offsets = torch.arange(1 - length, 1, device=out_tokens.device)
    columns = last[:, None] + offsets[None, :]  # [B, L], the row's last L columns
    tail = out_tokens.gather(1, columns.clamp(min=0)).masked_fill(columns < 0, -2)  # -2 matches no id
    stops = stop_ids[knob]  # [B, S, L]
    wild = stops < 0
    hit = wild | (tail[:, None, :] == stops)
    return (hit.all(dim=-1) & ~wild.all(dim=-1)).any(dim=-1)


def reference_advance_rows(tokens: torch.Tensor, token_index: torch.Tensor, finished: torch.Tensor,
                           live: torch.Tensor, advance: torch.Tensor, suppress_eos: torch.Tensor,
                           out_tokens: torch.Tensor,
                           out_logprobs: torch.Tensor, new_tokens: torch.Tensor, logprobs: torch.Tensor | None,
                           budget: torch.Tensor, min_tokens: torch.Tensor, eos_mask: torch.Tensor,
                           pad_id: torch.Tensor, stop_ids: torch.Tensor | None, knob: torch.Tensor | None) -> None:
    """The step's bookkeeping as aten ops (what ``DecodeSlots.step`` ran before this op, in the same order)."""
    capacity = out_tokens.shape[1] - 1
    # Live rows write at their token index; the others into the spare last column, which nothing reads.
    column = torch.where(live, token_index.clamp(max=capacity - 1), capacity)[:, None]
    out_tokens.scatter_(1, column, new_tokens[:, None])
    if logprobs is not None:
        out_logprobs.scatter_(1, column, logprobs[:, None].float())
    torch.where(live, new_tokens, pad_id, out=tokens)
    token_index.add_(advance)
    # No ``& live``: a row that is not live is finished already, and or-ing into it changes nothing.
    done = eos_mask[new_tokens] | (token_index >= budget)
    if stop_ids is not None:  # a stop sequence ends a row only past min_tokens, as an EOS can
        done |= stop_match(out_tokens, column[:, 0], stop_ids, knob) & (token_index > min_tokens)
    finished.logical_or_(done)
    torch.logical_not(finished, out=live)
    advance.copy_(live)
    torch.lt(token_index, min_tokens, out=suppress_eos)


def _check(tokens, token_index, finished, live, advance, suppress_eos, out_tokens, out_logprobs, new_tokens, logprobs, budget,
           min_tokens, eos_mask, pad_id, stop_ids, knob) -> None:
    """Shapes and dtypes only (no host read of a value)."""
    b = tokens.shape[0]
    named = dict(tokens=tokens, token_index=token_index, advance=advance, new_tokens=new_tokens, budget=budget,
                 min_tokens=min_tokens)
    for name in _INT_ROWS:
        t = named[name]
        if t.shape != (b,) or t.dtype != torch.int64:
            raise ValueError(f"advance_rows: {name} must be int64 [B={b}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("finished", finished), ("live", live), ("suppress_eos", suppress_eos)):
        if t.shape != (b,) or t.dtype != torch.bool:
            raise ValueError(f"advance_rows: {name} must be bool [B={b}], got {t.dtype} {tuple(t.shape)}")
    if out_tokens.dim() != 2 or out_tokens.shape[0] != b or out_tokens.shape[1] < 2 or out_tokens.dtype != torch.int64:
        raise ValueError(f"advance_rows: out_tokens must be int64 [B={b}, capacity + 1], got "
                         f"{out_tokens.dtype} {tuple(out_tokens.shape)}")
    if out_logprobs.shape != out_tokens.shape or out_logprobs.dtype != torch.float32:
        raise ValueError("advance_rows: out_logprobs must be float32 shaped as out_tokens, got "
                         f"{out_logprobs.dtype} {tuple(out_logprobs.shape)}")
    if logprobs is not None and logprobs.shape != (b,):
        raise ValueError(f"advance_rows: logprobs must be [B={b}] or None, got {tuple(logprobs.shape)}")
    if eos_mask.dim() != 1 or eos_mask.dtype != torch.bool or pad_id.dim() != 0:
        raise ValueError("advance_rows: eos_mask must be a bool [V] mask and pad_id a 0-dim tensor")
    if (stop_ids is None) != (knob is None):
        raise ValueError("advance_rows: stop_ids and knob come together (both None when the call has no stops)")
    if stop_ids is not None and (stop_ids.dim() != 3 or stop_ids.dtype != torch.int64 or knob.shape != (b,)):
        raise ValueError("advance_rows: stop_ids must be int64 [settings, sequences, length] and knob [B]")


def _advance_rows(tokens: torch.Tensor, token_index: torch.Tensor, finished: torch.Tensor, live: torch.Tensor,
                  advance: torch.Tensor, suppress_eos: torch.Tensor, out_tokens: torch.Tensor,
                  out_logprobs: torch.Tensor,
                  new_tokens: torch.Tensor, logprobs: torch.Tensor | None, budget: torch.Tensor,
                  min_tokens: torch.Tensor, eos_mask: torch.Tensor, pad_id: torch.Tensor,
                  stop_ids: torch.Tensor | None, knob: torch.Tensor | None) -> None:
    """One decode step's bookkeeping for every row, in place (see the module docstring): record ``new_tokens``
    (and ``logprobs``, unless None) in ``out_tokens``/``out_logprobs`` ``[B, capacity + 1]``, feed them next,
    advance ``token_index`` by ``advance``, set ``finished`` on EOS / budget / a stop sequence of ``stop_ids``
    (``None``: the call has none), then ``live = ~finished``, ``advance = live`` and ``suppress_eos =
    token_index < min_tokens``, what the next step reads."""
    args = (tokens, token_index, finished, live, advance, suppress_eos, out_tokens, out_logprobs, new_tokens, logprobs, budget,
            min_tokens, eos_mask, pad_id, stop_ids, knob)
    _check(*args)  # shapes only: no host read
    if implementation(tokens.device) == "triton" and _kernel_layout(*args):
        _triton_advance(*args)
    else:
        reference_advance_rows(*args)


def _advance_rows_fake(tokens, token_index, finished, live, advance, suppress_eos, out_tokens, out_logprobs,
                       new_tokens, logprobs, budget, min_tokens, eos_mask, pad_id, stop_ids, knob):
    return None


advance_rows = define_op(_advance_rows, _advance_rows_fake,
                         mutates_args=("tokens", "token_index", "finished", "live", "advance", "suppress_eos",
                                       "out_tokens", "out_logprobs"))


# ------------------------------------------------------------------ choice
def _probe_state(device: torch.device, stops: bool, logprobs: bool) -> list:
    """A small random step state (the op's arguments): EOS, budgets, min_tokens, rows at capacity, finished
    rows, stop sequences with wildcards."""
    g = torch.Generator().manual_seed(7)
    b, capacity, vocab = 6, 5, 9
    i64 = dict(dtype=torch.int64)
    finished = torch.tensor([False, False, True, False, False, True])
    stop_ids = torch.full((2, 3, 4), -1, **i64)
    stop_ids[0, 0, 2:] = torch.tensor([3, 4])
    stop_ids[1, 1, 3] = 5
    stop_ids[1, 2, 1:] = torch.tensor([2, -1, 6])
    index, min_tokens = torch.tensor([0, 2, 3, 5, 6, 1]), torch.tensor([0, 3, 0, 9, 0, 0])
    state = [torch.randint(0, vocab, (b,), generator=g), index, finished, ~finished, (~finished).long(),
             index < min_tokens, torch.randint(0, vocab, (b, capacity + 1), generator=g),
             torch.randn(b, capacity + 1, generator=g), torch.randint(0, vocab, (b,), generator=g),
             torch.randn(b, generator=g) if logprobs else None, torch.tensor([4, 3, 9, 9, 9, 2]),
             min_tokens, torch.tensor([False] * 4 + [True] + [False] * 4),
             torch.tensor(1), stop_ids if stops else None, torch.tensor([0, 1, 1, 0, 1, 0]) if stops else None]
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in state]


@functools.lru_cache(maxsize=16)
def _probe(device: torch.device) -> str:
    """``"triton"`` where the kernel runs on ``device`` and leaves exactly the reference's state on small
    inputs (with and without stop sequences and logprobs)."""
    refuse_while_capturing("bookkeeping", device)
    if _kernel() is None:
        return "reference"
    try:
        for stops, logprobs in ((True, True), (False, False)):
            got, want = _probe_state(device, stops, logprobs), _probe_state(device, stops, logprobs)
            _triton_advance(*got)
            reference_advance_rows(*want)
            if not all(torch.equal(a, b) for a, b in zip(got[:8], want[:8])):
                warn_fallback("bookkeeping", device, "triton", "its state differs from the reference's")
                return "reference"
        return "triton"
    except Exception as exc:  # noqa: BLE001 -- any failure to compile or run means: not on this device
        warn_fallback("bookkeeping", device, "triton", failure(exc))
        return "reference"


def implementation(device: torch.device | str) -> str:
    """The implementation :func:`advance_rows` runs on ``device``: ``"triton"`` or ``"reference"``."""
    return _probe(probe_device(device))


# ------------------------------------------------------------------ kernel
@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted Triton kernel (built on first use, so ``TRITON_INTERPRET`` is read then); ``None`` without
    Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(tok_ptr, index_ptr, fin_ptr, live_ptr, adv_ptr, sup_ptr, out_tok_ptr, out_lp_ptr, new_ptr, lp_ptr,
               budget_ptr, min_ptr, eos_ptr, pad_ptr, stop_ptr, knob_ptr, out_stride, capacity,
               HAS_LP: tl.constexpr, STOPS: tl.constexpr, NSEQ: tl.constexpr, NSEQ_PAD: tl.constexpr,
               LENGTH: tl.constexpr, LENGTH_PAD: tl.constexpr):
        row = tl.program_id(0)
        live = tl.load(live_ptr + row) != 0
        index = tl.load(index_ptr + row)
        new = tl.load(new_ptr + row)
        column = tl.where(live, tl.minimum(index, capacity - 1), capacity)  # not live: the spare column
        base = row.to(tl.int64) * out_stride
        tl.store(out_tok_ptr + base + column, new)
        if HAS_LP:
            tl.store(out_lp_ptr + base + column, tl.load(lp_ptr + row).to(tl.float32))
        tl.store(tok_ptr + row, tl.where(live, new, tl.load(pad_ptr)))
        index = index + tl.load(adv_ptr + row)
        tl.store(index_ptr + row, index)
        done = (tl.load(eos_ptr + new) != 0) | (index >= tl.load(budget_ptr + row))
        floor = tl.load(min_ptr + row)
        if STOPS:
            k = tl.load(knob_ptr + row)
            t = tl.arange(0, LENGTH_PAD)
            s = tl.arange(0, NSEQ_PAD)
            columns = column + t - (LENGTH - 1)  # the row's last LENGTH columns, this step's token last
            tail = tl.load(out_tok_ptr + base + columns, mask=(columns >= 0) & (t < LENGTH), other=-2)
            tail = tl.where(t == LENGTH - 1, new, tail)
            inside = (s[:, None] < NSEQ) & (t[None, :] < LENGTH)
            stops = tl.load(stop_ptr + (k * NSEQ + s[:, None]) * LENGTH + t[None, :], mask=inside, other=-1)
            hit = ((stops < 0) | (tail[None, :] == stops)).to(tl.int32)
            used = tl.max((stops >= 0).to(tl.int32), axis=1)  # a sequence of all wildcards is unused
            matched = tl.max(tl.min(hit, axis=1) * used, axis=0) > 0
            done = done | (matched & (index > floor))
        finished = (tl.load(fin_ptr + row) != 0) | done
        tl.store(fin_ptr + row, finished)
        tl.store(live_ptr + row, finished == 0)
        tl.store(adv_ptr + row, (finished == 0).to(tl.int64))
        tl.store(sup_ptr + row, index < floor)

    return kernel


def _kernel_layout(tokens, token_index, finished, live, advance, suppress_eos, out_tokens, out_logprobs,
                   *rest) -> bool:
    """Whether the tensors the kernel writes have the layout it addresses (rows of unit stride, output rows of
    one stride): it writes them in place, so it cannot work on contiguous copies."""
    rows = (tokens, token_index, finished, live, advance, suppress_eos)
    return (all(t.stride(0) == 1 for t in rows) and out_tokens.stride(1) == 1 and out_logprobs.stride(1) == 1
            and out_tokens.stride(0) == out_logprobs.stride(0))


def _triton_advance(tokens, token_index, finished, live, advance, suppress_eos, out_tokens, out_logprobs,
                    new_tokens, logprobs, budget, min_tokens, eos_mask, pad_id, stop_ids, knob) -> None:
    """The Triton kernel: one program per row, the stop table's ``[sequences, length]`` tile of the row's
    setting compared with the row's last ``length`` tokens at once."""
    stops = stop_ids is not None
    nseq, length = (stop_ids.shape[1], stop_ids.shape[2]) if stops else (1, 1)
    _kernel()[(tokens.shape[0],)](
        tokens, token_index, finished, live, advance, suppress_eos, out_tokens, out_logprobs, new_tokens.contiguous(),
        logprobs.contiguous() if logprobs is not None else out_logprobs, budget.contiguous(),
        min_tokens.contiguous(), eos_mask.contiguous(), pad_id,
        stop_ids.contiguous() if stops else tokens, knob.contiguous() if stops else tokens,
        out_tokens.stride(0), out_tokens.shape[1] - 1, HAS_LP=logprobs is not None, STOPS=stops, NSEQ=nseq,
        NSEQ_PAD=_pad(nseq), LENGTH=length, LENGTH_PAD=_pad(length))


def _pad(n: int) -> int:
    """The power of two a Triton ``arange`` needs to cover ``n``."""
    return 1 << max(0, (n - 1).bit_length())
