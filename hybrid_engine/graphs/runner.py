"""DecodeGraphRunner: capture one decode step per (batch bucket, page span, sampling mode), replay it at every position.

Both generation paths run on this runner: ``engine.generate``
(:mod:`hybrid_engine.generation.generate`) and each ``HybridEngineRollout``
(:mod:`hybrid_engine.rollout.rollout`) build an instance of their own, with
its own buffers, pool and graphs, and drive it through the slot scheduler
(:mod:`hybrid_engine.generation.scheduler`). It owns the device state the
graphs read and write (the decode slots, the admission stage, the K/V page
pool), the graphs, the policy (:meth:`DecodeGraphRunner.refusal` is the whole
answer to "may graphs run now") and one :class:`GraphStats`.

Graph-safety invariants kept here:

* What a capture froze is checked before a call replays anything: the
  weights' addresses, the registered hooks and the attention implementation
  (:func:`~hybrid_engine.graphs.fingerprint.graph_fingerprint`). A change drops
  every graph, and the call recaptures.
* One capture at a time per process, on a stream of the runner's own, into a
  pool handle the runner holds (:meth:`DecodeGraphRunner._capture`).
* Capture applies none of its work (CUDA semantics), so a capture that fails
  leaves the device state as it was, and the runner puts back the host state
  the captured Python advanced before it failed
  (:meth:`DecodeGraphRunner._host_state`): the step then runs eagerly from
  where it started, as does the rest of the call, and the output is the same.
  After :data:`MAX_CAPTURE_FAILURES` failures graphs are off for this runner.
* Replay runs no Python, so the kernels a graph replays are those its capture
  ran (:meth:`DecodeGraphRunner._graph_attention` where the backend needs
  other attention kernels to capture).
* Hooks are captured, never dropped. A hook that cannot be captured makes the
  runner refuse graphs while that hook set is registered, naming the module.
* The buffers and graphs outlive the call that made them, so calls run under
  :func:`decode_grad_mode`: no autograd, and never ``torch.inference_mode``,
  whose tensors a later call made outside it could not write in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sysconfig
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.accelerator import accelerator_for
from hybrid_engine.accelerator.base import graph_capture_lock
from hybrid_engine.accelerator.host_copy import CountsHostSyncs
from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode.kv_pool import (
    DEFAULT_PAGE_SIZE,
    KVBudget,
    KVPool,
    LayerSpec,
    PageLedger,
    pages_for,
    pool_pages,
)
from hybrid_engine.decode.layout import attention_layers, exact_length, layer_specs
from hybrid_engine.decode.sampling import sampling_mode
from hybrid_engine.decode.slots import DecodeSlots, vocab_sizes
from hybrid_engine.decode.staging import PromptStage, admission_round, prefill_staged
from hybrid_engine.exact.mode import uses_exact_attention
from hybrid_engine.graphs.fingerprint import graph_fingerprint
from hybrid_engine.graphs.hooks import HookCaptureError, attributed_hooks, hook_fingerprint, hook_registered
from hybrid_engine.graphs.keys import AdmissionKey, GraphKey, PrefillKey, RunKey, default_graph_buckets
from hybrid_engine.graphs.policy import GraphRefusedWarning, graph_attention, refusal_reason
from hybrid_engine.graphs.stats import GraphStats
from hybrid_engine.model_access import attention_implementation, model_device
from hybrid_engine.user_warnings import user_stacklevel

__all__ = ["DecodeGraphRunner", "EXACT_PROMPT_ROWS", "MAX_CAPTURE_FAILURES", "PREFILL_TOKEN_BUDGET"]


def failing_line(exc: BaseException) -> str:
    """`` at <file>:<line> in <function>: <code>``: the innermost frame of ``exc`` in the model's own code (not
    torch's, not ours, not the standard library's), so that a capture refused for a host read names the line
    of modeling code that read the host; ``""`` when there is none."""
    paths = sysconfig.get_paths()
    packages = sorted({paths["purelib"], paths["platlib"]}, key=len, reverse=True)
    ours = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(torch.__file__)))

    def installed(path: str) -> str | None:  # the site-packages folder ``path`` lies in
        return next((root for root in packages if path.startswith(root + os.sep)), None)

    def the_models(path: str) -> bool:
        return not path.startswith(ours) and (installed(path) is not None or not path.startswith(paths["stdlib"]))

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if the_models(os.path.abspath(f.filename))]
    if not frames:
        return ""
    f = frames[-1]
    path = os.path.abspath(f.filename)
    root = installed(path)
    path = os.path.relpath(path, root) if root else path
    code = f" `{f.line.strip()}`" if f.line else ""
    return f" at {path}:{f.lineno} in {f.name}:{code}"


#: Capture failures after which a runner stops trying graphs.
MAX_CAPTURE_FAILURES = 3


#: Prefill batches of up to this many prompts run at their exact count (above it, in the decode buckets):
#: a padding row costs a whole prefill of the staged width, where a decode step's padding row costs one token.
EXACT_PROMPT_ROWS = 8


#: Prompt tokens (rows x staged width) one staged prefill batch holds at most, as vLLM's
#: ``max_num_batched_tokens`` bounds a step's prefill: the admission stage has
#: ``min(slots, max(EXACT_PROMPT_ROWS, PREFILL_TOKEN_BUDGET // staged width))`` prompt rows (rounded down to a
#: prompt-row bucket). A captured prefill keeps its activations in the graph pool for good, so with one prompt row
#: per slot the pool would grow with slots x width (3x the slots' own K/V at 256 slots of 256-token prompts on a
#: tiny model); bounded, more prompts than fit are prefilled in more batches, each prompt still once per call.
#: At least :data:`EXACT_PROMPT_ROWS` prompts a batch, however wide they are.
PREFILL_TOKEN_BUDGET = 8192


logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    """Runs decode steps for one model: eagerly, or by replaying the step captured for the bucket.

    ``config`` (an engine's) adds its gates to the policy. ``buckets`` fixes the
    batch buckets (``None``: :func:`default_graph_buckets`, unbounded).

    * The buffers: one :class:`~hybrid_engine.decode.slots.DecodeSlots`
      allocated at the largest bucket a call needs (it only grows, as
      gpt-fast's caches do); bucket ``n`` runs on its ``[:n]`` head, at the
      same addresses.
    * The graphs, keyed by :class:`GraphKey` for decode steps,
      :class:`PrefillKey` for prompts prefilled ahead into the admission stage
      and :class:`AdmissionKey` for admission rounds from it
      (:mod:`hybrid_engine.decode.staging`: continuous batching admits often,
      and an eager forward costs several replayed steps), all captured into
      one shared memory pool on the runner's graph stream.
    * One warm-up per key (its first run is eager, on the graph stream; the
      next one captures), one capture-failure policy.
    """

    def __init__(self, model: PreTrainedModel, *, config: EngineConfig | None = None,
                 buckets: tuple[int, ...] | None = None) -> None:
        self.model = model
        self.config = config
        self.buckets = tuple(sorted(set(buckets))) if buckets else None
        self.accelerator = accelerator_for(model_device(model))
        self.slots: DecodeSlots | None = None
        self.stage: PromptStage | None = None
        #: Whether the current call may use graphs (set by :meth:`prepare`).
        self.use_graphs = False
        self._graphs: dict[RunKey, Any] = {}
        self._warm: set[RunKey] = set()
        self._prompt_width = 0
        #: The K/V page pool the slots and the stage point into, and its host ledger (built by :meth:`prepare`).
        self.kv_pool: KVPool | None = None
        self.ledger: PageLedger | None = None
        self._spans_used: set[int] = set()
        self._pool: Any = None
        self._fingerprint: tuple | None = None
        self._failures = 0
        self._disabled: str | None = None
        # (hook fingerprint, handle id of the hook that could not be captured, reason): graphs stay refused
        # while both hold (the hook may be one the fingerprint leaves out, so its handle is checked too).
        self._bad_hooks: tuple[tuple, int | None, str] | None = None
        self._call_eager = False
        self._warned: set[str] = set()
        self._stats = GraphStats()
        self._graph_streams: dict[tuple[Any, torch.device], Any] = {}  # (accelerator, device) -> its stream
        #: Attention implementation the graphed steps of this call run with (``None``: the model's own).
        self._graph_attn: str | None = None
        self._switch_logged = False

    # ---------------------------------------------------------------- policy
    def refusal(self) -> str | None:
        """Why graphs may not run now (``None``: they may). The whole policy, static and learnt."""
        reason = refusal_reason(self.model, self.accelerator, self.config)
        if reason is not None:
            return reason
        if self._disabled is not None:
            return self._disabled
        if self._bad_hooks is not None:
            hooks, handle_id, reason = self._bad_hooks
            if hooks == hook_fingerprint(self.model) and hook_registered(self.model, handle_id):
                return reason
        return None

    def note_refusal(self, reason: str | None, *, warn: bool = True) -> None:
        """Record why this call runs without graphs (``None``: it does not); warn once per reason."""
        self._stats.last_refusal_reason = reason
        if reason is not None and warn and reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(reason, GraphRefusedWarning, stacklevel=user_stacklevel())

    def bucket_for(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows."""
        sizes = self.buckets or default_graph_buckets(n)
        return next((s for s in sizes if s >= n), n)

    def prompt_rows_for(self, n: int) -> int:
        """The prompt rows a prefill batch of ``n`` prompts runs: ``n`` up to :data:`EXACT_PROMPT_ROWS`,
        else the smallest decode bucket holding them."""
        return n if n <= EXACT_PROMPT_ROWS else self.bucket_for(n)

    def _stage_rows(self, slots: int, width: int) -> int:
        """The admission stage's prompt rows for ``slots`` slots at staged ``width``: as many as the slots, at most
        :data:`PREFILL_TOKEN_BUDGET` tokens (at least :data:`EXACT_PROMPT_ROWS` rows), and a count that
        :meth:`prompt_rows_for` keeps (rounded down to a bucket), so any batch of up to that many prompts fits."""
        limit = min(slots, max(EXACT_PROMPT_ROWS, PREFILL_TOKEN_BUDGET // width))
        if self.prompt_rows_for(limit) > limit:  # between two buckets: the largest bucket below it
            sizes = self.buckets or default_graph_buckets(limit)
            limit = max([EXACT_PROMPT_ROWS] + [b for b in sizes if b <= limit])
        return limit

    # ------------------------------------------------------------- lifecycle
    def prepare(self, *, rows: int, capacity: int, num_eos: int, graphs: bool, budget: KVBudget | None = None,
                prompt_width: int | None = None, top_logprobs: int = 0) -> DecodeSlots:
        """Start a call: a page pool, slots for ``rows`` concurrent rows, graphs checked against what they froze.

        The pool holds what ``budget`` says (:func:`~hybrid_engine.decode.kv_pool.pool_pages`;
        the null page comes on top; ``None``: unconfigured, pages of
        :data:`~hybrid_engine.decode.kv_pool.DEFAULT_PAGE_SIZE`). Unconfigured, it only grows, by half at
        least, so calls a little larger each time rebuild it (and recapture)
        rarely; a configured budget makes it exactly that size. The
        slots' rows reach ``capacity`` tokens, and their output rows span it too:
        a call with a few more new tokens than any before it keeps the buffers
        and the graphs whenever it fits. ``graphs`` says whether the caller wants
        graphs; the policy may still refuse (warned once, recorded in
        ``last_refusal_reason``). ``prompt_width`` (the width prompts are staged
        at) sets up :meth:`prefill_prompts` and :meth:`admission_round`: request
        rows for a round on every slot, prompt rows within
        :data:`PREFILL_TOKEN_BUDGET` (:meth:`_stage_rows`).
        """
        device = model_device(self.model)
        acc = accelerator_for(device)
        if acc is not self.accelerator:
            self.invalidate()
            self.accelerator = acc
        model = self.model
        dtype = next(model.parameters()).dtype
        if budget is None:
            budget = KVBudget(DEFAULT_PAGE_SIZE, None, None, "kv_cache", 1, 1)
        need = self.bucket_for(rows)
        slots = self.slots
        vocab = vocab_sizes(model)
        limit = exact_length(model.config)
        window = None if limit is None else limit.tokens
        same_kind = slots is not None and slots.device == device and slots.dtype == dtype
        if same_kind and capacity > slots.capacity:  # grow by half at least: calls a little longer each time (a
            # response-length schedule) then rebuild the buffers and recapture a few times, not every call
            grown = max(capacity, slots.capacity + slots.capacity // 2)
            # never past a sliding window the call itself fits in
            capacity = grown if window is None else max(capacity, min(grown, window))
        if same_kind:
            need, capacity = max(need, slots.rows), max(capacity, slots.capacity)
            num_eos = max(num_eos, slots.num_eos_slots)
            top_logprobs = max(top_logprobs, slots.top_logprobs)
        stage_width = max(prompt_width or 0, self.stage.width if self.stage is not None else 0)
        # Windowed layers keep rings of their window per row where the rows reach past twice it (not in the exact
        # mode, whose attention sums key blocks in position order).
        specs = layer_specs(model.config, capacity=None if uses_exact_attention(model) else capacity)
        page_bytes = sum(s.paged_elements for s in specs) * dtype.itemsize * budget.page_size
        pages, fixed = pool_pages(budget, page_bytes=page_bytes, slots=need, capacity=capacity,
                                  stage_rows=self._stage_rows(need, stage_width) if prompt_width else 0,
                                  stage_width=stage_width)
        if not fixed and self.ledger is not None:  # rows kept for later calls hold pages on top of this call's
            pages += self.ledger.held_pages
        self._prepare_pool(specs, pages + 1, budget.page_size, fixed, device, dtype)
        pool = self.kv_pool
        slots = self.slots
        if slots is None or not slots.fits(need, capacity, capacity, num_eos, pool, vocab, top_logprobs):
            self.invalidate()
            self.slots = slots = None  # free the old buffers before allocating the new ones
            self.slots = slots = DecodeSlots(model, need, capacity, capacity, num_eos=num_eos, pool=pool,
                                             top_logprobs=top_logprobs)
        # Checked on allocation too: the config may have changed since.
        if limit is not None and limit.tokens < slots.capacity:
            raise ValueError(
                f"the model's config now has {limit.why}, which makes the paged cache exact only up to "
                f"{limit.tokens} tokens, less than the decode cache's capacity {slots.capacity}; use a capacity of at most "
                f"{limit.tokens}"
            )
        if prompt_width is not None:
            self._prompt_width = prompt_width
            stage = self.stage
            # Prompt rows within the token budget at the stage's width (it only grows), request rows for a
            # round as many as the slots: a batch of this call's narrower prompts stays within the budget too.
            reusable = stage is not None and stage.pool is pool
            stage_width = max(prompt_width, stage.width) if reusable else prompt_width
            max_pages = slots.cache.max_pages
            if stage is None or not stage.fits(self._stage_rows(need, stage_width), prompt_width, pool, vocab[0],
                                               need, max_pages):
                requests = max(need, slots.rows)
                self.invalidate()
                self.stage = None
                self.stage = PromptStage(model, self._stage_rows(requests, stage_width), stage_width, pool=pool,
                                         requests=requests, max_pages=max_pages)
        fingerprint = graph_fingerprint(model)
        if fingerprint != self._fingerprint:
            self.invalidate()
            self._fingerprint = fingerprint
        self._call_eager = False
        self.use_graphs = False
        self._graph_attn = None
        if graphs:
            reason = self.refusal()
            self.note_refusal(reason)
            self.use_graphs = reason is None
            if reason is not None:
                self._stats.fallbacks += 1  # the whole call runs eagerly
            else:
                self._graph_attn = graph_attention(model, self.accelerator)
                if self._graph_attn is not None and not self._switch_logged:
                    self._switch_logged = True
                    logger.info(
                        "Graphed decode steps on %s run attention with %r instead of the model's %r (its kernels "
                        "cannot be captured there); eager steps keep %r.", self.accelerator.device_name(),
                        self._graph_attn, model.config._attn_implementation, model.config._attn_implementation)
        return slots

    def _prepare_pool(self, specs: list[LayerSpec], num_pages: int, page_size: int, fixed: bool,
                      device: torch.device, dtype: torch.dtype) -> None:
        """Keep the page pool when the call fits it (exactly its size when ``fixed``), else build a new one."""
        pool = self.kv_pool
        same_kind = (pool is not None and pool.device == device and pool.dtype == dtype
                     and pool.page_size == page_size and pool.layers == tuple(specs))
        if same_kind and (pool.num_pages == num_pages if fixed else pool.num_pages >= num_pages):
            return
        if same_kind and not fixed:
            num_pages = max(num_pages, pool.num_pages + pool.num_pages // 2)
        ledger = self.ledger
        # Rows kept for later calls (episodes between turns) move into a larger pool of the same layout.
        carry = same_kind and ledger is not None and ledger.held_rows and num_pages >= pool.num_pages
        self.release()  # the slots and the stage point into the old pool: free them before allocating
        self.kv_pool = KVPool(specs, num_pages, page_size, device=device, dtype=dtype)
        if carry:
            self.kv_pool.copy_from(pool)
            ledger.grow(num_pages)
            self.ledger = ledger
        else:
            self.ledger = PageLedger(num_pages)

    def invalidate(self) -> None:
        """Drop every graph and the graph memory pool (the buffers stay); the next steps warm up and capture
        again."""
        if self._graphs:
            self._stats.invalidations += 1
        self._graphs.clear()
        self._warm.clear()
        self._pool = None
        self._stats.graph_memory_bytes = 0

    def release(self) -> None:
        """Drop the graphs and the buffers, the page pool included (the next call allocates and captures
        again)."""
        self.invalidate()
        self.slots = None
        self.stage = None
        self.kv_pool = None
        self.ledger = None

    # ------------------------------------------------------------------ runs
    def span_for(self, tokens: int) -> int:
        """The span bucket (pages each row's attention reads) for rows of up to ``tokens`` tokens: the next
        power of two pages, within the slots' pages."""
        pages = max(1, pages_for(tokens, self.kv_pool.page_size))
        return min(1 << (pages - 1).bit_length(), self.slots.cache.max_pages)

    def step(self, bucket: int, span: int, sampling_key: tuple[float, float, int]) -> None:
        """One decode step on slots ``[:bucket]`` reading ``span`` pages a row: replay its graph, or warm up /
        capture it, or run eagerly."""
        view = self.slots.head(bucket)
        self._spans_used.add(span)

        def run() -> None:
            view.cache.span_pages = span
            view.step(self.model, sampling_key)

        self._run(GraphKey(bucket, span, sampling_mode(*sampling_key)), run)

    def prefill_prompts(self, ids: torch.Tensor, mask: torch.Tensor, tables: list[list[int]],
                        counters: CountsHostSyncs | None = None) -> None:
        """Prefill prompts ``[p, w]`` (left-padded, ``p`` <= the stage's rows) into the pages ``tables`` name.

        Staged at the call's prompt width and run like a decode step (graph
        replay where allowed); :meth:`admission_round` reads them until the next batch.
        """
        # Every batch of a call is staged at the call's prompt width, so the graphs depend on the call's
        # shape only and stay few over a long run.
        width = self._prompt_width
        ids, mask = ids[:, -width:], mask[:, -width:]  # only left padding is cut: width >= every real prompt
        prompts = self.prompt_rows_for(ids.shape[0])
        staged = self.stage.stage_prompts(ids, mask, tables, prompts, width, counters)
        if not any(attention_layers(self.model.config)):
            # State-space models take a 2-D mask their own code checks on the host (transformers'
            # create_recurrent_attention_mask skips the check only under a CUDA/XPU capture): eager prefill.
            prefill_staged(self.model, staged)
            return
        self._run(PrefillKey(prompts, width), lambda: prefill_staged(self.model, staged))

    def admission_round(self, meta: list[list[int]], sampling_key: tuple[float, float, int],
                        counters: CountsHostSyncs | None = None) -> None:
        """One admission round of requests whose prompts :meth:`prefill_prompts` staged.

        ``meta`` holds one row per request: the columns of
        :data:`~hybrid_engine.decode.staging.META`, then its slot's block table
        row. Run like a decode step (graph replay where allowed).
        """
        requests = self.bucket_for(len(meta))
        staged = self.stage.stage_requests(meta, requests, counters)
        self._run(AdmissionKey(requests, sampling_mode(*sampling_key)),
                  lambda: admission_round(self.slots, staged, sampling_key))

    def spans_between(self, shortest: int, longest: int) -> list[int]:
        """The span buckets rows of ``shortest`` to ``longest`` tokens read."""
        spans, span = [], self.span_for(shortest)
        while True:
            spans.append(span)
            if span >= self.span_for(longest):
                return spans
            span = self.span_for(span * self.kv_pool.page_size + 1)

    def capture_buckets(self, top: int, spans: list[int], sampling_key: tuple[float, float, int],
                        shrink: bool) -> None:
        """Warm up and capture, up front and largest first, every decode graph a call may replay.

        That is bucket ``top``, and every smaller one when rows may finish at
        different times (``shrink``) and the call compacts into them, each at
        every span in ``spans`` (the pages its rows reach, from the shortest
        prompt to the longest prompt and budget). Capturing them now, on slots
        that are all free (a warm-up step touches no request: free rows write
        the null page), rather than when a run first reaches them, keeps every
        step of the call a replay and captures flat over a long run, as vLLM
        and SGLang capture at start-up; largest first, so the smaller graphs
        reuse the pool's blocks.
        """
        if not self.use_graphs:
            return
        sizes = self.buckets or default_graph_buckets(top)
        for bucket in sorted((b for b in sizes if b == top or (shrink and b < top)), reverse=True):
            for span in sorted(spans, reverse=True):
                key = GraphKey(bucket, span, sampling_mode(*sampling_key))
                if key in self._graphs or self._call_eager:
                    continue
                view = self.slots.head(bucket)

                def step(view: DecodeSlots = view, span: int = span) -> None:
                    view.cache.span_pages = span
                    view.step(self.model, sampling_key)

                if key not in self._warm and not self._warm_up(key, step):
                    return
                self._capture(key, step)

    def capture_rounds(self, top: int, sampling_key: tuple[float, float, int]) -> None:
        """Warm up and capture, up front, the admission round of every request bucket up to ``top``.

        How many requests a round admits depends on when rows finish, hence on
        the tokens; its graph does not, so capturing every size now keeps
        captures flat over a long run whatever the tokens. The warm-ups run on
        the stage's stale rows into free slots (a round of budget-0 requests:
        finished at once, on the null page); the caller frees every slot after.
        """
        if not self.use_graphs or self.stage is None:
            return
        sizes = self.buckets or default_graph_buckets(top)
        for requests in sorted((b for b in sizes if b <= top), reverse=True):
            key = AdmissionKey(requests, sampling_mode(*sampling_key))
            if key in self._graphs or self._call_eager:
                continue
            staged = self.stage.requests_view(requests)
            staged.meta.zero_()

            def run(staged=staged) -> None:
                admission_round(self.slots, staged, sampling_key)

            if key not in self._warm and not self._warm_up(key, run):
                return
            self._capture(key, run)

    def _warm_up(self, key: RunKey, run: Callable[[], None]) -> bool:
        """The one warm-up: a real run on the graph stream, so lazy kernels and workspaces exist before capture.

        ``False`` when the attention graphed steps switch to (:func:`graph_attention`) failed here, its
        first run: graphs are then off for this runner and nothing of the run is left to undo, so the
        caller runs the step eagerly with the model's own attention. Any other error is the step's own.
        Holds the capture lock: another thread's capture must not see this work on the device meanwhile.
        """
        acc, device = self.accelerator, self.slots.device
        saved = self._host_state()
        try:
            with graph_capture_lock(), acc.on_device(device), acc.on_graph_stream(self._graph_stream()), \
                    self._graph_attention(), _uncached_autocast(device):
                run()
        except Exception as exc:
            if self._graph_attn is None:
                raise
            self._restore_host_state(saved)
            self._disabled = (f"Graphs refused: the graph-mode attention {self._graph_attn!r} failed in its first "
                              f"run ({type(exc).__name__}: {exc}); decode runs eagerly with the model's own "
                              "attention.")
            self.invalidate()
            self._capture_failed(self._disabled)
            return False
        self._warm.add(key)
        self._stats.warmups += isinstance(key, GraphKey)
        return True

    def _graph_stream(self) -> Any:
        """This runner's stream for warm-ups and captures on the model's device (made there, on first use)."""
        acc, device = self.accelerator, self.slots.device
        stream = self._graph_streams.get((acc, device))
        if stream is None:
            with acc.on_device(device):
                stream = self._graph_streams[(acc, device)] = acc.Stream()
        return stream

    def _run(self, key: RunKey, run: Callable[[], None]) -> None:
        """``run()`` for ``key``: its graph replayed, or its warm-up or capture, or eagerly."""
        decode = isinstance(key, GraphKey)
        s = self._stats
        if self.use_graphs and not self._call_eager:
            graph = self._graphs.get(key)
            if graph is None and key in self._warm:
                graph = self._capture(key, run)
            if graph is not None:
                with self.accelerator.on_device(self.slots.device):
                    self.accelerator.replay_graph(graph)
                if decode:
                    s.replays += 1
                else:
                    s.admission_replays += 1
                return
            if key not in self._warm and self._warm_up(key, run):  # the warm-up is this call's own step
                s.eager_steps += decode
                return
        run()
        s.eager_steps += decode

    def _capture(self, key: RunKey, run: Callable[[], None]) -> Any | None:
        """Capture ``run`` for ``key`` (its work is not applied: the caller replays); ``None`` if it failed.

        Holds :func:`~hybrid_engine.accelerator.base.graph_capture_lock`, as each warm-up does: CUDA capture
        belongs to a stream, not a thread, so another thread's work on a shared stream would be recorded into the
        graph, or break it; and it runs on the runner's graph stream for the model's device. Captures go into a
        pool handle the runner holds (:meth:`~hybrid_engine.accelerator.base.Accelerator.graph_pool_handle`): a
        capture that fails has its pool ended and released by the accelerator (on CUDA a failed capture otherwise
        leaves the caching allocator "recording" for the rest of the process), and the next capture starts a
        fresh handle. A refusal known in advance (a hook set that any runner of the same model could not capture)
        keeps the step off the capture altogether."""
        with graph_capture_lock(), self.accelerator.on_device(self.slots.device):
            return self._capture_on_device(key, run)

    def _capture_on_device(self, key: RunKey, run: Callable[[], None]) -> Any | None:
        acc = self.accelerator
        known = _refused_hook_set(self.model)
        if known is not None:  # another runner of this model could not capture this hook set: don't try again
            self._bad_hooks = known
            self._capture_failed(known[2])
            return None
        t0 = time.perf_counter()
        # Where the backend cannot size a pool, the memory it reserves while capturing: the pool keeps its
        # segments, while the capture's allocations are all freed again by its end.
        mem0 = acc.memory_reserved()
        graph = acc.create_graph()
        if self._pool is None:  # a handle held here: after a failed capture, graph.pool() cannot name the pool
            self._pool = acc.graph_pool_handle()
        saved = self._host_state()
        try:
            try:
                with self._graph_attention(), _uncached_autocast(self.slots.device), attributed_hooks(self.model), \
                        acc.capture_to_graph(graph, pool=self._pool, stream=self._graph_stream()):
                    run()
            except BaseException:
                self._restore_host_state(saved)  # the eager fallback starts where the step started
                self._pool = None  # a fresh handle next time, also after an interrupt (see _capture_failed)
                raise
        except HookCaptureError as exc:
            reason = (f"Graphs refused: {exc}. Decoding runs eagerly while this hook is registered; keep the "
                      "hook's work on the device (no .item(), .tolist() or printing of values) to use graphs.")
            self._bad_hooks = (hook_fingerprint(self.model), exc.handle_id, reason)
            _REFUSED_HOOK_SETS[self.model] = self._bad_hooks
            logger.debug("Capture of %s refused a hook", key, exc_info=True)
            self._capture_failed(reason)
            return None
        except Exception as exc:  # any backend's capture error: fall back, never crash the call
            logger.debug("Capture of %s failed", key, exc_info=True)  # the whole traceback, for a diagnosis
            self._failures += 1
            reason = (f"Graph capture failed ({type(exc).__name__}: {exc}){failing_line(exc)}; this call "
                      "continues eagerly with the same tokens. Counted in fallbacks.")
            if self._failures >= MAX_CAPTURE_FAILURES:
                self._disabled = (f"Graphs were disabled for this engine after {self._failures} capture "
                                  "failures; decode runs eagerly.")
                reason += " " + self._disabled
                self.invalidate()
            self._capture_failed(reason)
            return None
        self._graphs[key] = graph
        if self._pool is None:  # a backend without pool handles: the first graph's pool, shared from now on
            self._pool = acc.graph_pool(graph)
        s = self._stats
        if isinstance(key, GraphKey):
            s.captures += 1
        else:
            s.admission_captures += 1
        s.capture_seconds += time.perf_counter() - t0
        pool_bytes = acc.graph_memory_bytes(self._pool)
        s.graph_memory_bytes = pool_bytes if pool_bytes is not None else (
            s.graph_memory_bytes + max(0, acc.memory_reserved() - mem0))
        return graph

    @contextlib.contextmanager
    def _graph_attention(self) -> Iterator[None]:
        """Run the block with the attention implementation graphed steps need (the model's own is put back).

        Where the backend needs other attention kernels to capture (:func:`graph_attention`: ``"npu_graph"`` on an
        Ascend NPU), the warm-up and the capture run with them, and the model's ``_attn_implementation`` is put
        back right after, so eager steps keep the model's choice and the fingerprint, taken outside the switch,
        stays stable."""
        with attention_implementation(getattr(self.model, "config", None), self._graph_attn):
            yield

    def _host_state(self) -> list[tuple[Any, Any]]:
        """Host-side counters a captured step or admission advances: those of the slots' and stage's caches
        (:meth:`~hybrid_engine.decode.kv_cache.PagedKVCache.host_state`)."""
        caches = [b.cache for b in (self.slots, self.stage) if b is not None]
        return [(c, c.host_state()) for c in caches]

    @staticmethod
    def _restore_host_state(saved: list[tuple[Any, Any]]) -> None:
        for cache, state in saved:
            cache.restore_host_state(state)

    def _capture_failed(self, reason: str) -> None:
        # The accelerator ended and released the failed capture's reference on the pool. The next capture takes
        # a fresh handle all the same: where no graph holds the old pool its use count fell to zero, and CUDA's
        # allocator asserts on a capture into it (the graphs captured keep theirs).
        self._pool = None
        self._stats.fallbacks += 1
        self._call_eager = True
        self.note_refusal(reason)

    # ----------------------------------------------------------------- stats
    @property
    def stats(self) -> GraphStats:
        """A snapshot of the counters (a copy: later steps do not change it)."""
        s = dataclasses.replace(self._stats)
        decode = [k for k in self._graphs if isinstance(k, GraphKey)]
        s.graph_keys = len(decode)
        s.admission_graph_keys = len(self._graphs) - len(decode)
        s.buckets = tuple(sorted({k.bucket for k in decode}))
        s.span_buckets = tuple(sorted({k.span for k in decode}))
        s.cache_memory_bytes = sum(b.memory_bytes() for b in (self.slots, self.stage) if b is not None)
        pool = self.kv_pool
        if pool is not None:
            s.cache_memory_bytes += pool.memory_bytes()
            s.kv_page_size = pool.page_size
            s.kv_pages_total = pool.num_pages - 1
            s.kv_bytes_peak = s.kv_pages_peak * pool.page_bytes
        if self.slots is not None:
            sizes = self.buckets or default_graph_buckets(self.slots.rows)
            spans = self.slots.cache.max_pages.bit_length() + 1  # 1, 2, 4, ... pages, and the whole row
            s.graph_key_bound = len([b for b in sizes if b <= self.slots.rows]) * spans
        return s

    def note_call_pages(self, peak: int, preemptions: int) -> None:
        """Record a call's page peak (the stats report the last call's) and its preemptions (cumulative)."""
        self._stats.kv_pages_peak = peak
        self._stats.preemptions += preemptions


#: Per model, the hook set a capture refused (hook fingerprint, handle id of the hook, reason), shared by every
#: runner of that model (an engine's and a rollout's): a refusal known in advance never goes through a capture
#: again, each of which on CUDA invalidates a stream capture.
_REFUSED_HOOK_SETS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, int | None, str]] = \
    weakref.WeakKeyDictionary()


def _refused_hook_set(model: torch.nn.Module) -> tuple[tuple, int | None, str] | None:
    """The refused hook set of ``model`` while it is still what is registered, else ``None``."""
    known = _REFUSED_HOOK_SETS.get(model)
    if known is not None and known[0] == hook_fingerprint(model) and hook_registered(model, known[1]):
        return known
    return None


@contextlib.contextmanager
def _uncached_autocast(device: torch.device) -> Iterator[None]:
    """Under autocast, warm-ups and captures cast the weights afresh, so a graph records the casts.

    Autocast caches its casts of the weights until the outermost autocast block
    exits; a capture served from that cache would replay copies made before it
    (stale after an in-place optimizer step, and freed memory on a GPU once the
    block exits), which is why torch's ``make_graphed_callables`` wants
    ``cache_enabled=False``.
    """
    kind = device.type
    if not (torch.is_autocast_enabled(kind) and torch.is_autocast_cache_enabled()):
        yield
        return
    with torch.autocast(kind, dtype=torch.get_autocast_dtype(kind), cache_enabled=False):
        yield

