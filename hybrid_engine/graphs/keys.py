"""What a captured graph is keyed by, and the batch-bucket ladder.

A key holds every host value a capture freezes besides the buffers' shapes:
the bucket (rows), the span (pages a row's attention reads, a power of two),
the staged width, the sampling mode (which filters run; the knobs' values
are device data), and which forward the step runs (fused or transformers'). Keys stay bounded: per sampling mode, at most one decode
graph per (bucket, span bucket).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["AdmissionKey", "GraphKey", "PrefillKey", "RunKey", "default_graph_buckets"]


def default_graph_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 8, up to the first bucket that holds ``max_batch_size``.

    Each list is a prefix of every longer one, so a batch maps to the same bucket
    whatever the largest batch seen so far.
    """
    buckets = []
    for b in (1, 2, 4, 8):
        buckets.append(b)
        if b >= max_batch_size:
            return tuple(buckets)
    b = 16
    while True:
        buckets.append(b)
        if b >= max_batch_size:
            return tuple(buckets)
        b += 8


class GraphKey(NamedTuple):
    """Everything a captured decode step bakes in besides the buffers' shapes."""

    bucket: int
    span: int  # pages of each row attention reads (a power of two, or the row's whole table)
    sampling: tuple[bool, bool, bool]  # :func:`~hybrid_engine.decode.sampling.sampling_mode`; the values are device data
    stops: bool = False  # whether the step matches stop sequences (a call with any; the sequences are device data)
    logprobs: bool = True  # whether the step reports its tokens' logprobs (engine.generate returns none)
    fused: bool = False  # whether the step runs the fused decode forward (hybrid_engine.fused_decode)


class PrefillKey(NamedTuple):
    """A staged prefill batch: ``prompts`` prompt rows of ``width`` tokens."""

    prompts: int
    width: int


class AdmissionKey(NamedTuple):
    """A staged admission round: ``requests`` request rows (it copies table rows and one page each, whatever
    the prompts' width)."""

    requests: int
    sampling: tuple[bool, bool, bool]


#: What the runner keys its graphs by: a decode step, a staged prefill batch or a staged admission round.
RunKey = GraphKey | PrefillKey | AdmissionKey
