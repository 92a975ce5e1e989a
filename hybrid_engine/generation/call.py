"""One executor for every generation call: prepare the runner, schedule, gather, count, release.

Both front ends hand a checked :class:`~hybrid_engine.generation.plan.CallPlan` to :func:`run_call` and get back
the response rows and the call's :class:`~hybrid_engine.graphs.stats.CallStats`. Why one executor: the order of
the work (buffers sized before the special ids are written, the knob table before the first capture, the
device synchronised before the call's time is read, the buffers released after the call when the config asks)
and the stats schema were kept by hand in two places, and drifted. ``last_stats`` now has one schema for every
call, an empty one included (:func:`empty_call_stats`).

The caller holds the model's generation turn and sets the modes (eval, no autograd, exact kernels) around it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from hybrid_engine.generation.plan import CallPlan
from hybrid_engine.generation.scheduler import Counters, Results, gather_responses, run_schedule
from hybrid_engine.generation.timing import PhaseTimer
from hybrid_engine.graphs.runner import DecodeGraphRunner
from hybrid_engine.graphs.stats import CallStats, GraphStats

__all__ = ["CallOutput", "empty_call_stats", "run_call"]


@dataclasses.dataclass
class CallOutput:
    """A call's responses on the device: ``responses [R, W]`` (``pad_id`` past each length), their ``logprobs``
    (``None`` when the plan asked for none), ``lengths [R]``, the raw result rows (ranked alternatives), what
    the rows keep for a later call, and the call's stats (the ``last_stats`` dict)."""

    responses: torch.Tensor
    logprobs: torch.Tensor | None
    lengths: torch.Tensor
    results: Results
    kept: Any
    stats: dict[str, Any]


def run_call(runner: DecodeGraphRunner, plan: CallPlan, *, t_start: float, profiling: bool = False,
             release: bool = False) -> CallOutput:
    """Run ``plan`` on ``runner``; ``t_start`` (``time.perf_counter``) is when the call began (its validation
    counts in ``total_ms``); ``profiling`` fills ``profile``; ``release`` puts the runner's page pool to sleep
    after the call, graphs kept (``hybrid_engine.release_inference_cache``), and drops its buffers when it
    fails."""
    ok = False
    try:
        before = runner.stats
        runner.wake(auto=True)  # asleep (sleep()): the pages come back at the same addresses, graphs kept
        state = runner.prepare(rows=plan.max_active, capacity=plan.capacity, num_eos=len(plan.eos_ids),
                               graphs=plan.graphs, budget=plan.budget, prompt_width=plan.prompt_width,
                               top_logprobs=plan.top_logprobs)
        counters = Counters(timer=PhaseTimer(runner.accelerator, state.device))
        requests, kept = plan.requests, plan.kept
        if kept is not None and state.cache.states is not None:
            # Rows with state layers or windowed rings keep no states between calls: whole histories
            requests, kept = [dataclasses.replace(r, held=None) for r in requests], None
        state.set_special_ids(plan.pad_id, plan.eos_ids)
        state.set_stop_sequences(plan.stop_sets)
        state.begin_call(runner.model, logprobs=plan.logprobs is not None, fused=runner.fused_decode)
        results = run_schedule(
            runner, requests, plan.prompt_ids, plan.prompt_mask, plan.sampling_key, plan.seed,
            width=plan.max_new, max_active=plan.max_active, continuous=plan.continuous,
            shared_prefill=plan.shared_prefill, staged=plan.staged, sync_interval=plan.sync_interval,
            counters=counters, logprobs=plan.logprobs or "sampling", top_logprobs=plan.top_logprobs,
            settings=plan.settings, stop_strings=plan.stop_strings, kept=kept,
        )
        responses, logprobs, lengths = gather_responses(
            results.tokens, counters.lengths, plan.pad_id, results.logprobs if plan.logprobs else None)
        with runner.accelerator.on_device(state.device):  # the model's device, not the current one
            runner.accelerator.synchronize()
        total_s = time.perf_counter() - t_start
        runner.note_preemptions(counters.preemptions)
        stats = _call_stats(runner, counters, total_s, before, runner.stats, len(requests),
                            runner.bucket_for(plan.max_active), profiling)
        ok = True
        return CallOutput(responses, logprobs, lengths, results, kept, stats)
    finally:
        if release:
            _release_after_call(runner, ok)


def _release_after_call(runner: DecodeGraphRunner, ok: bool) -> None:
    """``release_inference_cache``: after a call the page pool sleeps, graphs kept (the memory hand-off,
    where the pool's storage is released at fixed addresses; elsewhere the sleep drops the buffers). After a
    failed call the buffers are dropped outright: the call's bookkeeping may be half done."""
    if ok:
        runner.sleep()
    else:
        runner.release()


def _call_stats(runner: DecodeGraphRunner, c: Counters, total_s: float, before: GraphStats, after: GraphStats,
                rows: int, bucket: int, profiling: bool) -> dict[str, Any]:
    tokens = int(sum(c.lengths.values()))
    phases = c.timer.totals_ms()
    prefill_ms, decode_ms = phases.get("prefill", 0.0), phases.get("decode", 0.0)
    capture_ms = (after.capture_seconds - before.capture_seconds) * 1e3
    stats = CallStats(
        prefill_ms=prefill_ms,
        decode_ms=decode_ms,
        overhead_ms=max(0.0, total_s * 1e3 - prefill_ms - decode_ms),
        total_ms=total_s * 1e3,
        decode_steps=c.decode_steps,
        prefill_forwards=c.prefill_forwards,
        tokens_generated=tokens,
        tokens_per_second=tokens / total_s if total_s > 0 else 0.0,
        graph_replays=after.replays - before.replays,
        graph_captures=after.captures - before.captures,
        admission_graph_replays=after.admission_replays - before.admission_replays,
        admission_graph_captures=after.admission_captures - before.admission_captures,
        fallbacks=after.fallbacks - before.fallbacks,
        peak_active_batch=c.peak_active_batch,
        cache_capacity=runner.slots.capacity,
        cache_memory_bytes=after.cache_memory_bytes,
        kv_page_size=after.kv_page_size,
        kv_pages_total=after.kv_pages_total,
        kv_pages_peak=c.kv_pages_peak,
        kv_pages_held_peak=c.kv_pages_held_peak,
        kv_bytes_peak=after.kv_bytes_peak,
        preemptions=c.preemptions,
        span_buckets=tuple(sorted(c.span_steps)),
        span_steps=dict(c.span_steps),
        host_syncs=c.host_syncs,
        host_ms_overlapped=c.host.overlapped_ms,
        host_ms_after_sync=c.host.after_sync_ms,
        eager_steps=after.eager_steps - before.eager_steps,
        capture_ms=capture_ms,
        graph_batch_size=bucket,
        use_graph_capture=runner.use_graphs,
        last_refusal_reason=after.last_refusal_reason,
        prefill_rows=c.prefill_rows,
        prefill_tokens=c.prefill_tokens,
        kv_reused_tokens=c.kv_reused_tokens,
        kv_row_copies=c.kv_row_copies,
        admission_rounds=c.admission_rounds,
        harvests=c.harvests,
        compactions=c.compactions,
        rows_moved=c.rows_moved,
        bucket_steps=dict(c.bucket_steps),
        num_sequences=rows,
        wakes=after.wakes - before.wakes,
        recaptures=after.recaptures - before.recaptures,
        profile=_profile(runner, prefill_ms, c.prefill_forwards, decode_ms, c.decode_steps, capture_ms, after)
        if profiling else None,
    )
    return stats.to_dict()


def empty_call_stats(runner: DecodeGraphRunner, t_start: float, profiling: bool = False) -> dict[str, Any]:
    """The ``last_stats`` of a call with no rows: the schema's defaults (nothing happened), the buffers as they
    stand, and the call's time."""
    held = runner.stats
    total_ms = (time.perf_counter() - t_start) * 1e3
    return CallStats(total_ms=total_ms, overhead_ms=total_ms, use_graph_capture=runner.use_graphs,
                     cache_memory_bytes=held.cache_memory_bytes, kv_page_size=held.kv_page_size,
                     kv_pages_total=held.kv_pages_total,
                     profile=_profile(runner, 0.0, 0, 0.0, 0, 0.0, held) if profiling else None).to_dict()


def _profile(runner: DecodeGraphRunner, prefill_ms: float, prefill_forwards: int, decode_ms: float,
             decode_steps: int, capture_ms: float, after: GraphStats) -> dict[str, Any]:
    """``last_stats["profile"]``: per-forward and per-step times and memory (with ``enable_profiling``)."""
    slots = runner.slots
    return {
        "prefill_ms_per_forward": prefill_ms / max(1, prefill_forwards),
        "decode_ms_per_step": decode_ms / max(1, decode_steps),
        "capture_ms": capture_ms,
        "state_memory_bytes": slots.memory_bytes() if slots is not None else 0,
        "graph_memory_bytes": after.graph_memory_bytes,
    }
