"""DecodeGraphRunner: capture one decode step per (batch bucket, page span, sampling mode), replay it at every position.

Both generation paths run on this runner: ``engine.generate``
(:mod:`hybrid_engine.generation.generate`) and each ``HybridEngineRollout``
(:mod:`hybrid_engine.rollout.rollout`) build an instance of their own and drive
it through the slot scheduler (:mod:`hybrid_engine.generation.scheduler`). The
runner only captures and replays; it holds three parts:

* :class:`~hybrid_engine.graphs.buffers.DecodeBuffers`: the device storage the
  graphs read and write (page pool and ledger, decode slots, prompt stage), its
  sizing and growth, and the bucket and span ladders;
* :class:`~hybrid_engine.graphs.policy.GraphPolicy`: may graphs run now (static
  reasons and what was learnt: capture failures, uncapturable hooks);
* the graphs, their one memory pool and one :class:`GraphStats`.

Graph-safety invariants kept here:

* What a capture froze is checked before a call replays anything: the
  buffers' epoch (any storage moved), the accelerator, the weights'
  addresses, the registered hooks and the attention implementation
  (:func:`~hybrid_engine.graphs.fingerprint.graph_fingerprint`). A change drops
  every graph, and the call recaptures.
* One capture at a time per process, on a stream of the runner's own, into a
  graph memory pool the runner holds (:meth:`DecodeGraphRunner._capture`).
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
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from hybrid_engine.accelerator import accelerator_for
from hybrid_engine.accelerator.base import graph_capture_lock
from hybrid_engine.accelerator.host_copy import CountsHostSyncs
from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.decode.kv_pool import KVBudget, KVPool, PageLedger
from hybrid_engine.decode.layout import attention_layers
from hybrid_engine.decode.sampling import sampling_mode
from hybrid_engine.decode.slots import DecodeSlots
from hybrid_engine.decode.staging import PromptStage, admission_round, prefill_staged
from hybrid_engine.decode.step import extend, prefill
from hybrid_engine.graphs import handoff
from hybrid_engine.graphs.buffers import EXACT_PROMPT_ROWS, PREFILL_TOKEN_BUDGET, DecodeBuffers
from hybrid_engine.graphs.fingerprint import graph_fingerprint
from hybrid_engine.graphs.hooks import HookCaptureError, attributed_hooks
from hybrid_engine.graphs.keys import AdmissionKey, GraphKey, PrefillKey, RunKey
from hybrid_engine.graphs.policy import MAX_CAPTURE_FAILURES, GraphPolicy
from hybrid_engine.graphs.stats import GraphStats
from hybrid_engine.model_access import attention_implementation, model_device

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


logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    """Runs decode steps for one model: eagerly, or by replaying the step captured for the bucket.

    ``config`` (an engine's) adds its gates to the policy. ``buckets`` fixes the
    batch buckets (``None``: :func:`~hybrid_engine.graphs.keys.default_graph_buckets`, unbounded).

    * The buffers (:attr:`buffers`, a :class:`~hybrid_engine.graphs.buffers.DecodeBuffers`);
      ``slots``, ``stage``, ``kv_pool`` and ``ledger`` read through to them.
    * The policy (:attr:`policy`, a :class:`~hybrid_engine.graphs.policy.GraphPolicy`).
    * The graphs, keyed by :class:`GraphKey` for decode steps,
      :class:`PrefillKey` for prompts prefilled ahead into the admission stage
      and :class:`AdmissionKey` for admission rounds from it
      (:mod:`hybrid_engine.decode.staging`: continuous batching admits often,
      and an eager forward costs several replayed steps), all captured into
      one shared graph memory pool on the runner's graph stream
      (:attr:`graph_keys`, :meth:`graph`).
    * One warm-up per key (its first run is eager, on the graph stream; the
      next one captures).
    """

    def __init__(self, model: PreTrainedModel, *, config: EngineConfig | None = None,
                 buckets: tuple[int, ...] | None = None) -> None:
        self.model = model
        #: The device storage the graphs read and write; a reallocation drops the graphs first (memory) and
        #: changes its epoch (what :meth:`prepare` checks).
        self.buffers = DecodeBuffers(model, buckets, on_move=_weak_call(self.invalidate))
        #: May graphs run now (static reasons and learnt ones).
        self.policy = GraphPolicy(model, accelerator_for(model_device(model)), config)
        #: Whether the current call may use graphs (set by :meth:`prepare`).
        self.use_graphs = False
        self._graphs: dict[RunKey, Any] = {}
        self._warm: set[RunKey] = set()
        self._graph_memory: Any = None  # the accelerator's handle on the graphs' shared memory pool
        self._fingerprint: tuple | None = None
        self._call_eager = False
        self._stats = GraphStats()
        self._graph_streams: dict[tuple[Any, torch.device], Any] = {}  # (accelerator, device) -> its stream
        #: Attention implementation the graphed steps of this call run with (``None``: the model's own).
        self._graph_attn: str | None = None
        self._switch_logged = False
        #: A sleep dropped the buffers (no storage kept its addresses) and no wake came since.
        self._dropped = False
        #: Graphs a dropping sleep let go of and no call has captured again (each recapture is counted).
        self._dropped_keys: set[RunKey] = set()
        handoff.register(model, self)  # engine.sleep reaches every runner of its model

    # ------------------------------------------------ the buffers, read through
    @property
    def slots(self) -> DecodeSlots | None:
        return self.buffers.slots

    @property
    def stage(self) -> PromptStage | None:
        return self.buffers.stage

    @property
    def kv_pool(self) -> KVPool | None:
        return self.buffers.kv_pool

    @property
    def ledger(self) -> PageLedger | None:
        return self.buffers.ledger

    @property
    def buckets(self) -> tuple[int, ...] | None:
        return self.buffers.buckets

    @property
    def prompt_width(self) -> int:
        """The width this call's prompts are staged at (0 before any staged call)."""
        return self.buffers.prompt_width

    def bucket_for(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows."""
        return self.buffers.bucket_for(n)

    def prompt_rows_for(self, n: int) -> int:
        """The prompt rows a prefill batch of ``n`` prompts runs (:meth:`DecodeBuffers.prompt_rows_for`)."""
        return self.buffers.prompt_rows_for(n)

    def span_for(self, tokens: int) -> int:
        """The span bucket for rows of up to ``tokens`` tokens (:meth:`DecodeBuffers.span_for`)."""
        return self.buffers.span_for(tokens)

    def prefill_rows(self, rows: torch.Tensor, tables: torch.Tensor, ids: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """Prefill left-padded prompts ``ids [n, T]`` into slots ``rows`` on the pages of ``tables`` (their block
        table rows), eagerly at the batch's exact width (never captured: as transformers prefills); the logits of
        each prompt's last token."""
        self._check_awake()
        cache = self.slots.cache
        cache.block_table.index_copy_(0, rows, tables)
        return prefill(self.model, cache, ids, mask, rows=rows, checked=True)

    def extend_rows(self, rows: torch.Tensor, tables: torch.Tensor, start: torch.Tensor, ids: torch.Tensor,
                    mask: torch.Tensor, span: int) -> torch.Tensor:
        """Continue slots ``rows`` whose first ``start`` tokens are on the pages of ``tables`` already (kept by an
        earlier call): prefill the tokens after them (``ids``, left-padded), eagerly, reading ``span`` pages a
        row; the logits of each row's last token."""
        self._check_awake()
        cache = self.slots.cache
        cache.block_table.index_copy_(0, rows, tables)
        cache.write_pos.index_copy_(0, rows, start)
        cache.position.index_copy_(0, rows, start)
        return extend(self.model, cache, ids, mask, rows, span)

    def spans_between(self, shortest: int, longest: int) -> list[int]:
        """The span buckets rows of ``shortest`` to ``longest`` tokens read."""
        return self.buffers.spans_between(shortest, longest)

    # ---------------------------------------------------------------- policy
    @property
    def accelerator(self) -> Any:
        """The accelerator of the model's device (followed by :meth:`prepare`)."""
        return self.policy.accelerator

    @property
    def config(self) -> EngineConfig | None:
        """The engine config whose gates the policy applies (``None``: none)."""
        return self.policy.config

    @config.setter
    def config(self, config: EngineConfig | None) -> None:
        self.policy.config = config

    @property
    def fused_decode(self) -> bool | str:
        """``hybrid_engine.fused_decode`` of :attr:`config` (``"auto"`` without one): what each call's steps
        resolve to run the fused decode forward or transformers' (:meth:`DecodeSlots.begin_call`)."""
        config = self.config
        return config.hybrid_engine.fused_decode if config is not None else "auto"

    def refusal(self) -> str | None:
        """Why graphs may not run now (``None``: they may): :meth:`GraphPolicy.refusal`."""
        return self.policy.refusal()

    def note_refusal(self, reason: str | None, *, warn: bool = True) -> None:
        """Record why this call runs without graphs (``None``: it does not); warn once per reason."""
        self._stats.last_refusal_reason = reason
        if reason is not None and warn:
            self.policy.warn(reason)

    # ---------------------------------------------------------------- graphs
    @property
    def graph_keys(self) -> tuple[RunKey, ...]:
        """The keys of the graphs held now, in capture order (decode, prefill and admission keys)."""
        return tuple(self._graphs)

    def graph(self, key: RunKey) -> Any | None:
        """The graph captured for ``key`` (``None``: none held)."""
        return self._graphs.get(key)

    @property
    def graph_memory(self) -> Any:
        """The accelerator's handle on the graphs' shared memory pool (``None``: none yet)."""
        return self._graph_memory

    # ------------------------------------------------------------- lifecycle
    def prepare(self, *, rows: int, capacity: int, num_eos: int, graphs: bool, budget: KVBudget | None = None,
                prompt_width: int | None = None, top_logprobs: int = 0) -> DecodeSlots:
        """Start a call: buffers for it (:meth:`DecodeBuffers.allocate`), graphs checked against what they froze.

        Buffers that fit are kept with their graphs; a call with a few more new
        tokens than any before it keeps them whenever it fits. ``graphs`` says
        whether the caller wants graphs; the policy may still refuse (warned
        once, recorded in ``last_refusal_reason``). ``prompt_width`` (the width
        prompts are staged at) sets up :meth:`prefill_prompts` and
        :meth:`admission_round`.
        """
        self.policy.accelerator = acc = accelerator_for(model_device(self.model))
        slots = self.buffers.allocate(rows=rows, capacity=capacity, num_eos=num_eos, budget=budget,
                                      prompt_width=prompt_width, top_logprobs=top_logprobs)
        if graphs:
            # What the graphs froze: the storage they read (its epoch), the accelerator, the model. Checked by
            # the calls that may replay them only (an eager call replays nothing: the next graph call checks).
            fingerprint = (self.buffers.epoch, acc, graph_fingerprint(self.model))
            if fingerprint != self._fingerprint:
                self.invalidate()
                self._fingerprint = fingerprint
        self._start_call(graphs)
        return slots

    def _start_call(self, graphs: bool) -> None:
        """Whether this call replays graphs (the caller asks, the policy answers), and with which attention."""
        self._call_eager = False
        self.use_graphs = False
        self._graph_attn = None
        if not graphs:
            return
        reason = self.refusal()
        self.note_refusal(reason)
        self.use_graphs = reason is None
        if reason is not None:
            self._stats.fallbacks += 1  # the whole call runs eagerly
            return
        self._graph_attn = self.policy.graph_attention()
        if self._graph_attn is not None and not self._switch_logged:
            self._switch_logged = True
            impl = self.model.config._attn_implementation
            logger.info("Graphed decode steps on %s run attention with %r instead of the model's %r (its kernels "
                        "cannot be captured there); eager steps keep %r.", self.accelerator.device_name(),
                        self._graph_attn, impl, impl)

    def invalidate(self) -> None:
        """Drop every graph and the graph memory pool (the buffers stay); the next steps warm up and capture
        again."""
        if self._graphs:
            self._stats.invalidations += 1
        self._graphs.clear()
        self._warm.clear()
        self._graph_memory = None
        self._stats.graph_memory_bytes = 0

    def release(self) -> None:
        """Drop the graphs and the buffers, the page pool included (the next call allocates and captures
        again)."""
        self.buffers.release()  # a new epoch; its on_move drops the graphs

    # ------------------------------------------------------------ sleep/wake
    @property
    def sleeping(self) -> bool:
        """Whether the ``"kv_cache"`` memory is given back (:meth:`sleep`): released at fixed addresses (no step
        may run until :meth:`wake`), or dropped where the backend cannot keep addresses (the next call allocates
        and captures again)."""
        return self._dropped or self.buffers.asleep

    @property
    def dropped(self) -> bool:
        """Whether the last sleep dropped the buffers and graphs (no storage kept its addresses) and no wake came
        since."""
        return self._dropped

    def sleep(self) -> bool:
        """Release the page pool's, rings' and linear states' memory between calls, graphs kept
        (:meth:`DecodeBuffers.sleep`); returns whether anything was released. A backend without storage released
        at fixed addresses (no VMM: NPU, XPU, CUDA without ``cuda-bindings``) drops the buffers and the graphs
        instead: counted in ``sleep_drops``, and the graphs the next calls capture again in ``recaptures``.
        Refused inside a capture; the device is synchronised first (no queued step still writes the pages). The
        caller holds the model's call lock."""
        if self.buffers.kv_pool is None or self.sleeping:
            return False
        acc = self.accelerator
        with graph_capture_lock():  # no capture of this process runs meanwhile
            if acc.is_current_stream_capturing():
                raise RuntimeError("DecodeGraphRunner.sleep: a graph capture is running on this stream; sleep "
                                   "between calls only")
            with acc.on_device(self.buffers.kv_pool.device):
                acc.synchronize()
            held = set(self._graphs)
            released = self.buffers.sleep()
            if released and self.buffers.kv_pool is None:  # dropped: no storage kept its addresses
                self._dropped = True
                self._dropped_keys |= held
                self._stats.sleep_drops += 1
            return released

    def wake(self, *, auto: bool = False) -> bool:
        """Take the memory back at the same addresses (graphs stay valid; after a drop, the next call allocates
        and captures); ``auto``: a call woke it, counted in ``wakes``. Returns whether it was asleep."""
        if not self.sleeping:
            return False
        self._dropped = False
        held = set(self._graphs)
        if self.buffers.wake():  # the backend handed the memory back elsewhere: its graphs are recaptured too
            self._dropped_keys |= held
        if auto:
            self._stats.wakes += 1
        return True

    def _check_awake(self) -> None:
        if self.buffers.asleep:
            raise RuntimeError(
                "DecodeGraphRunner: the page pool is asleep (its memory, rings and linear states included, was "
                "released by sleep()); a step or replay now would read released memory. Call wake() first "
                "(generation calls wake it themselves)")

    # ------------------------------------------------------------------ runs
    def step(self, bucket: int, span: int, sampling_key: tuple[float, float, int]) -> None:
        """One decode step on slots ``[:bucket]`` reading ``span`` pages a row: replay its graph, or warm up /
        capture it, or run eagerly."""
        view = self.slots.head(bucket)
        self._run(GraphKey(bucket, span, sampling_mode(*sampling_key), self.slots.has_stop_sequences,
                          self.slots.logprobs_wanted, self.slots.fused_decode),
                  lambda: view.step(self.model, sampling_key, span))

    def prefill_prompts(self, ids: torch.Tensor, mask: torch.Tensor, tables: list[list[int]],
                        counters: CountsHostSyncs | None = None) -> None:
        """Prefill prompts ``[p, w]`` (left-padded, ``p`` <= the stage's rows) into the pages ``tables`` name.

        Staged at the call's prompt width and run like a decode step (graph
        replay where allowed); :meth:`admission_round` reads them until the next batch.
        """
        # Every batch of a call is staged at the call's prompt width, so the graphs depend on the call's
        # shape only and stay few over a long run.
        width = self.prompt_width
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
        sizes = self.buffers.buckets_up_to(top)
        for bucket in sorted((b for b in sizes if b == top or (shrink and b < top)), reverse=True):
            for span in sorted(spans, reverse=True):
                key = GraphKey(bucket, span, sampling_mode(*sampling_key), self.slots.has_stop_sequences,
                               self.slots.logprobs_wanted, self.slots.fused_decode)
                if key in self._graphs or self._call_eager:
                    continue
                view = self.slots.head(bucket)

                def step(view: DecodeSlots = view, span: int = span) -> None:
                    view.step(self.model, sampling_key, span)

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
        sizes = self.buffers.buckets_up_to(top)
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

        ``False`` when the attention graphed steps switch to (:meth:`GraphPolicy.graph_attention`) failed here,
        its first run: graphs are then off for this runner and nothing of the run is left to undo, so the
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
            reason = (f"Graphs refused: the graph-mode attention {self._graph_attn!r} failed in its first "
                      f"run ({type(exc).__name__}: {exc}); decode runs eagerly with the model's own "
                      "attention.")
            self.policy.disable(reason)
            self.invalidate()
            self._capture_failed(reason)
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
        self._check_awake()
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
        graph memory pool the runner holds (:meth:`~hybrid_engine.accelerator.base.Accelerator.graph_pool_handle`):
        a capture that fails has its pool ended and released by the accelerator (on CUDA a failed capture
        otherwise leaves the caching allocator "recording" for the rest of the process), and the next capture
        starts a fresh handle. A refusal known in advance (a hook set that any runner of the same model could not
        capture: :meth:`GraphPolicy.known_hook_refusal`) keeps the step off the capture altogether."""
        with graph_capture_lock(), self.accelerator.on_device(self.slots.device):
            return self._capture_on_device(key, run)

    def _capture_on_device(self, key: RunKey, run: Callable[[], None]) -> Any | None:
        acc = self.accelerator
        known = self.policy.known_hook_refusal()
        if known is not None:  # another runner of this model could not capture this hook set: don't try again
            self._capture_failed(known)
            return None
        t0 = time.perf_counter()
        # Where the backend cannot size a pool, the memory it reserves while capturing: the pool keeps its
        # segments, while the capture's allocations are all freed again by its end.
        mem0 = acc.memory_reserved()
        graph = acc.create_graph()
        if self._graph_memory is None:  # a handle held here: after a failed capture, graph.pool() cannot name it
            self._graph_memory = acc.graph_pool_handle()
        saved = self._host_state()
        try:
            try:
                with self._graph_attention(), _uncached_autocast(self.slots.device), attributed_hooks(self.model), \
                        acc.capture_to_graph(graph, pool=self._graph_memory, stream=self._graph_stream()):
                    run()
            except BaseException:
                self._restore_host_state(saved)  # the eager fallback starts where the step started
                self._graph_memory = None  # a fresh handle next time, also after an interrupt (_capture_failed)
                raise
        except HookCaptureError as exc:
            reason = (f"Graphs refused: {exc}. Decoding runs eagerly while this hook is registered; keep the "
                      "hook's work on the device (no .item(), .tolist() or printing of values) to use graphs.")
            self.policy.refuse_hooks(exc.handle_id, reason)
            logger.debug("Capture of %s refused a hook", key, exc_info=True)
            self._capture_failed(reason)
            return None
        except Exception as exc:  # any backend's capture error: fall back, never crash the call
            logger.debug("Capture of %s failed", key, exc_info=True)  # the whole traceback, for a diagnosis
            reason = (f"Graph capture failed ({type(exc).__name__}: {exc}){failing_line(exc)}; this call "
                      "continues eagerly with the same tokens. Counted in fallbacks.")
            disabled = self.policy.capture_failed()
            if disabled is not None:
                reason += " " + disabled
                self.invalidate()
            self._capture_failed(reason)
            return None
        self._graphs[key] = graph
        if self._graph_memory is None:  # a backend without pool handles: the first graph's pool, shared from now on
            self._graph_memory = acc.graph_pool(graph)
        self._count_capture(key, time.perf_counter() - t0, mem0)
        return graph

    def _count_capture(self, key: RunKey, seconds: float, mem0: int) -> None:
        s = self._stats
        if key in self._dropped_keys:  # held before a sleep dropped it: the cost of a backend without VMM
            self._dropped_keys.discard(key)
            s.recaptures += 1
        if isinstance(key, GraphKey):
            s.captures += 1
        else:
            s.admission_captures += 1
        s.capture_seconds += seconds
        acc = self.accelerator
        pool_bytes = acc.graph_memory_bytes(self._graph_memory)
        s.graph_memory_bytes = pool_bytes if pool_bytes is not None else (
            s.graph_memory_bytes + max(0, acc.memory_reserved() - mem0))

    @contextlib.contextmanager
    def _graph_attention(self) -> Iterator[None]:
        """Run the block with the attention implementation graphed steps need (the model's own is put back).

        Where the backend needs other attention kernels to capture (:meth:`GraphPolicy.graph_attention`:
        ``"npu_graph"`` on an Ascend NPU), the warm-up and the capture run with them, and the model's
        ``_attn_implementation`` is put back right after, so eager steps keep the model's choice and the
        fingerprint, taken outside the switch, stays stable."""
        with attention_implementation(getattr(self.model, "config", None), self._graph_attn):
            yield

    def _host_state(self) -> list[tuple[Any, Any]]:
        """Host-side counters a captured step or admission advances: those of the slots' and stage's caches
        (:meth:`~hybrid_engine.decode.kv_cache.PagedKVCache.host_state`)."""
        return [(c, c.host_state()) for c in self.buffers.caches()]

    @staticmethod
    def _restore_host_state(saved: list[tuple[Any, Any]]) -> None:
        for cache, state in saved:
            cache.restore_host_state(state)

    def _capture_failed(self, reason: str) -> None:
        # The accelerator ended and released the failed capture's reference on the pool. The next capture takes
        # a fresh handle all the same: where no graph holds the old pool its use count fell to zero, and CUDA's
        # allocator asserts on a capture into it (the graphs captured keep theirs).
        self._graph_memory = None
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
        s.cache_memory_bytes = self.buffers.memory_bytes()
        pool = self.kv_pool
        if self.ledger is not None:
            s.kv_pages_peak = self.ledger.peak  # the ledger's own, reset when a call plans its pages
        if pool is not None:
            s.kv_page_size = pool.page_size
            s.kv_pages_total = pool.num_pages - 1
            s.kv_bytes_peak = s.kv_pages_peak * pool.page_bytes
        if self.slots is not None:
            s.graph_key_bound = self.buffers.key_bound()
        return s

    def note_preemptions(self, preemptions: int) -> None:
        """Count a call's preemptions (cumulative in the stats; the scheduler decides them, the runner never
        sees one)."""
        self._stats.preemptions += preemptions


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference to its object: the buffers call back into the runner without
    a reference cycle, which would keep the page pool alive after the runner is gone until Python's cyclic
    collector happened to run."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


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

