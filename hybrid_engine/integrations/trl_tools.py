"""TRL's tool loop (``tools=``, ``environment_factory=``) run inside hybrid-engine rollouts.

Why here and not in TRL: ``GRPOTrainer(tools=...)`` next to a ``rollout_func`` runs TRL's tool loop on the
function's first turn and generates every later turn with TRL's own generation, which gives those turns no
logprobs. :func:`~hybrid_engine.integrations.trl.make_rollout_func` with ``tools=`` or ``environment_factory=``
runs the whole loop on one :class:`~hybrid_engine.rollout.episodes.Episodes` instead: every model turn is a
turn of the same episodes, so the rollout keeps the rows' K/V between turns where it can, and each row's
tool results are environment tokens (``env_mask`` 0, logprob 0, no loss in TRL).

It behaves as TRL 1.16's own loop for the same tokenizer: prompts rendered with the tools' schemas; each turn
parsed with TRL's ``parse_response`` (the tokenizer's response template, ``trl.chat_template_utils.
add_response_schema`` when it has none); tools called with the parsed arguments, a failure returned to the
model as ``{"error": ...}`` (a tool still running after ``tool_timeout`` seconds too: see
:class:`ToolLoop`); the results rendered as TRL renders them (the chat template's suffix after a
dummy assistant tool call, cut after its last EOS); a row's tool results dropped, and the row ended, once they
would take its completion past ``max_completion_length`` (or the model's position limit); at most
``max_tool_calling_iterations`` rounds; later turns cut to the completion budget. Environments follow TRL's
``environment_factory``: one instance per rollout from a pool that grows as needed, ``reset`` before the first
turn (its observation appended to the last user message), its public methods as tools.

What lives where: the model, the rollout's slots, K/V pages and graphs on the device (as for any call); the
rows' histories in the episodes, on the host; the conversations, parsed turns, tools, environments and
their state on the host. Each turn moves the chosen rows' new tokens to the device and its tokens and
logprobs back; tool results cross once, as the tokens :meth:`Episodes.append` adds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import numbers
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybrid_engine.decode.model_support import max_positions
from hybrid_engine.rollout import RolloutRequest, SamplingConfig
from hybrid_engine.rollout.types import is_int

__all__ = ["DEFAULT_TOOL_TIMEOUT", "ToolLoop", "environment_reward"]

#: Seconds a tool call may take before the model is told it failed (``make_rollout_func(tool_timeout=...)``).
DEFAULT_TOOL_TIMEOUT = 60.0
#: Seconds a timed-out (or interrupted) async tool gets to unwind after its cancellation before the loop stops
#: waiting for it.
_CANCEL_GRACE = 5.0

_NOT_TOOLS = ("reset", "get_reward")  # environment methods that are not tools (as TRL)


def environment_reward(prompts: Any = None, completions: Any = None, environments: Sequence[Any] | None = None,
                       **kwargs: Any) -> list[float | None]:
    """A TRL reward function: each rollout's ``environment.get_reward()``.

    TRL adds this reward itself for ``GRPOTrainer(environment_factory=...)``; with
    ``make_rollout_func(environment_factory=...)`` the trainer does not know the environments, so pass it in
    ``reward_funcs``. The rollout function hands each rollout's environment to reward functions as
    ``environments``, as TRL does.
    """
    if environments is None:
        raise TypeError("environment_reward: no environments were passed; it scores rollouts of "
                        "make_rollout_func(environment_factory=...), which hands them to reward functions")
    return [None if env is None else env.get_reward() for env in environments]


def _environment_methods(env: Any) -> list[Callable]:
    """The environment's tools: its public methods (listed on the class: reading an instance would run properties)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in _NOT_TOOLS and not name.startswith("_")]


def _check_tools(tools: Any) -> list[Callable]:
    if tools is None:
        return []
    if callable(tools) or not isinstance(tools, (list, tuple)):
        raise TypeError(f"make_rollout_func: tools must be a list of functions, got {type(tools).__name__}")
    from transformers.utils import get_json_schema

    for i, tool in enumerate(tools):
        if not callable(tool) or not isinstance(getattr(tool, "__name__", None), str):
            raise TypeError(f"make_rollout_func: tools[{i}] is {type(tool).__name__}, not a function; pass functions "
                            "(with type hints and a docstring) that the model may call")
        try:
            get_json_schema(tool)
        except Exception as exc:  # transformers raises its own exception types here
            raise TypeError(f"make_rollout_func: tools[{i}] ({tool.__name__}) has no JSON schema for the chat "
                            f"template ({exc}); give it type hints and a docstring with an Args section") from None
    return list(tools)


def _check_iterations(value: Any) -> int | None:
    if value is not None and (not is_int(value) or value < 0):
        raise TypeError(f"make_rollout_func: max_tool_calling_iterations must be an int >= 0 or None, got {value!r}")
    return value


def _check_timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"make_rollout_func: tool_timeout must be a number of seconds or None, got "
                        f"{type(value).__name__} ({value!r})")
    if math.isnan(value) or not 0 < value <= threading.TIMEOUT_MAX:
        raise ValueError(f"make_rollout_func: tool_timeout must be a number of seconds > 0 (at most "
                         f"{threading.TIMEOUT_MAX:g}), got {value!r}; pass None to wait for every tool as long as it "
                         f"takes (default {DEFAULT_TOOL_TIMEOUT:g})")
    return float(value)


class ToolTimeout(Exception):
    """A tool call still running after the loop's ``tool_timeout``: returned to the model as its failure."""

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(f"Tool {name} timed out after {timeout:g} seconds.")


class _AsyncRunner:
    """One event loop on a daemon thread for async tools (as TRL keeps one), started on first use.

    Each coroutine runs as a task with its own deadline; a task past it is cancelled, and given
    :data:`_CANCEL_GRACE` seconds to unwind, and its result is a :class:`ToolTimeout`. A wait interrupted in the
    caller's thread (``KeyboardInterrupt``) cancels every task on the loop and waits for them to end (within
    the grace) before it propagates, so no tool is left running on the loop. A tool that catches its
    cancellation and runs on cannot be stopped: it stays on the loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The tools' event loop (``None`` before the first async tool)."""
        return self._loop

    def gather(self, named: list[tuple[str, Any]], timeout: float | None) -> list[Any]:
        """The results of the ``(name, coroutine)`` pairs, in order; a failure is its exception (not raised)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="hybrid-engine-tools", daemon=True).start()

        async def one(name: str, coro: Any) -> Any:
            task = asyncio.ensure_future(coro)
            try:
                done, _ = await asyncio.wait({task}, timeout=timeout)
            finally:
                if not task.done():  # past its deadline, or the whole wait was cancelled
                    task.cancel()
                    await asyncio.wait({task}, timeout=_CANCEL_GRACE)
            return task.result() if task in done else ToolTimeout(name, timeout or 0.0)

        async def _all() -> list[Any]:
            return await asyncio.gather(*(one(name, coro) for name, coro in named), return_exceptions=True)

        try:
            return asyncio.run_coroutine_threadsafe(_all(), self._loop).result()
        except BaseException:  # interrupted while waiting: end the tools on the loop before giving up
            cleanup = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop)
            with contextlib.suppress(Exception):  # the interrupt is what the caller hears of, not the cleanup
                cleanup.result(timeout=2 * _CANCEL_GRACE)
            raise

    @staticmethod
    async def _cancel_all() -> None:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CANCEL_GRACE)


def _call_sync(name: str, tool: Callable, arguments: dict[str, Any], timeout: float | None) -> Any:
    """``tool(**arguments)``, in a worker thread when there is a ``timeout``: past it the call is a
    :class:`ToolTimeout`, and the thread (which Python cannot stop) runs on as a daemon, its result dropped."""
    if timeout is None:
        return tool(**arguments)
    done, box = threading.Event(), {}

    def work() -> None:
        try:
            box["result"] = tool(**arguments)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name=f"hybrid-engine-tool-{name}", daemon=True).start()
    if not done.wait(timeout):
        raise ToolTimeout(name, timeout)
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclasses.dataclass
class _Tokenizing:
    """What the tool loop needs of the trainer's processing class (checked once per processing class)."""

    processing_class: Any
    tokenizer: Any
    chat_template: str | None  # None: the processing class's own
    template_kwargs: dict[str, Any]


class ToolLoop:
    """The tools, the environments and the loop of one :class:`~hybrid_engine.integrations.trl.HybridEngineRolloutFunc`.

    Built by :func:`~hybrid_engine.integrations.trl.make_rollout_func` from ``tools`` and ``environment_factory``;
    :meth:`prepare` resets the environments for a call, :meth:`run` runs the loop on the rollout.

    ``tool_timeout`` (seconds, ``None``: none) bounds each tool call; a call past it is a failure the model
    sees as ``{"error": "Tool <name> timed out after <t> seconds."}``, as any other. An async tool is
    cancelled on the tools' loop (nothing of it stays pending, unless it catches its cancellation). A sync tool
    runs in a worker thread: past the timeout the loop stops waiting for it and goes on, but Python cannot stop
    a thread, so the call runs on in the background (a daemon thread) and its result is dropped; a sync tool
    that may hang, or that changes an environment, is best written async or given a deadline of its own.
    """

    def __init__(self, tools: Any = None, environment_factory: Any = None,
                 max_tool_calling_iterations: int | None = None,
                 tool_timeout: float | None = DEFAULT_TOOL_TIMEOUT) -> None:
        self.tools = _check_tools(tools)
        self.max_tool_calling_iterations = _check_iterations(max_tool_calling_iterations)
        self.tool_timeout = _check_timeout(tool_timeout)
        self.environment_factory = environment_factory
        #: Environment instances, reused across calls (row ``i`` of a call gets ``pool[i]``); grows as needed.
        self.pool: list[Any] = []
        self.schema_tools = list(self.tools)  # what the prompts' tool schemas are rendered from
        if environment_factory is not None:
            if isinstance(environment_factory, dict):
                raise TypeError(
                    "make_rollout_func: environment_factory must be one callable; a dict of environments routes "
                    "each example by its 'environment' column, which TRL does not pass to a rollout_func")
            if not callable(environment_factory):
                raise TypeError("make_rollout_func: environment_factory must be a callable that returns an "
                                f"environment, got {type(environment_factory).__name__}")
            probe = environment_factory()
            if not callable(getattr(probe, "reset", None)):
                raise TypeError(f"make_rollout_func: environment_factory() returned a {type(probe).__name__} without "
                                "a reset method; an environment needs reset(**kwargs) and its tool methods")
            self.pool.append(probe)
            methods = _environment_methods(probe)
            self.schema_tools += methods  # as TRL: the standalone tools, then the environment's methods
        if not self.schema_tools:
            raise ValueError("make_rollout_func: tools=[] (and no environment methods) gives the model nothing to "
                             "call; pass at least one tool, or drop tools for single-turn rollouts")
        self._tokenizing: _Tokenizing | None = None
        self._async = _AsyncRunner()
        #: Per call: the environments of its rows (None without environment_factory).
        self.environments: list[Any] | None = None
        #: Per call: tool calls made, of them failed, and each row's model turns.
        self.last_stats: dict[str, Any] = {}

    # ------------------------------------------------------------ per call setup
    def tokenizing(self, trainer: Any, processing_class: Any, tokenizer: Any) -> _Tokenizing:
        """Check (once per processing class) that it can render and parse tool calls, as TRL's trainer does."""
        t = self._tokenizing
        if t is not None and t.processing_class is processing_class:
            return t
        from trl.chat_template_utils import (
            add_response_schema,
            get_training_chat_template,
            is_chat_template_prefix_preserving,
            supports_tool_calling,
        )

        what = "make_rollout_func(tools=...)" if self.tools else "make_rollout_func(environment_factory=...)"
        if getattr(processing_class, "chat_template", None) is None or not supports_tool_calling(processing_class):
            raise ValueError(
                f"{what}: trainer.processing_class's chat template cannot render a tool-calling conversation (user, "
                "assistant with tool_calls, tool); set processing_class.chat_template to one that renders tools, "
                "tool_calls and tool messages")
        if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
            try:
                add_response_schema(processing_class)  # as TRL's trainer: known templates get TRL's parser
            except ValueError:
                raise ValueError(
                    f"{what}: trainer.processing_class has no response template, so the model's tool calls cannot "
                    "be parsed, and TRL knows none for its chat template; set processing_class.response_template "
                    "(transformers' response parsing) to one that parses its tool calls") from None
        chat_template = getattr(trainer, "chat_template", None)
        if not is_chat_template_prefix_preserving(processing_class):
            chat_template = get_training_chat_template(processing_class)  # TRL's prefix-preserving variant
            if chat_template is None:
                raise ValueError(f"{what}: trainer.processing_class's chat template renders earlier messages "
                                 "differently once a tool message follows, and TRL has no training variant of it; "
                                 "set a prefix-preserving processing_class.chat_template")
        kwargs = dict(getattr(trainer, "chat_template_kwargs", None) or {})
        self._tokenizing = t = _Tokenizing(processing_class, tokenizer, chat_template, kwargs)
        return t

    def prepare(self, prompts: list[Any]) -> list[Any]:
        """Give each row an environment and reset it (TRL's order: before the prompts are rendered); returns the
        prompts with each reset's observation appended to the last message."""
        if self.environment_factory is None:
            self.environments = None
            return prompts
        while len(self.pool) < len(prompts):
            self.pool.append(self.environment_factory())
        self.environments = self.pool[:len(prompts)]
        out = []
        for i, (prompt, env) in enumerate(zip(prompts, self.environments)):
            # TRL resets with the example's columns; a rollout_func is only given the prompt.
            observation = env.reset(prompt=prompt)
            if observation is None:
                out.append(prompt)
                continue
            if not isinstance(observation, str):
                raise TypeError(f"make_rollout_func: environment.reset() for prompt {i} returned "
                                f"{type(observation).__name__}; hybrid-engine rollouts take text observations (a str) "
                                "or None")
            out.append(prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}])
        return out

    def iterations(self, trainer: Any) -> int:
        if self.max_tool_calling_iterations is not None:
            return self.max_tool_calling_iterations
        own = getattr(getattr(trainer, "args", None), "max_tool_calling_iterations", None)
        return sys.maxsize if own is None else int(own)

    # ---------------------------------------------------------------- tools
    def _tool_dicts(self, row: int) -> tuple[dict[str, Callable], dict[str, Callable]]:
        tools = list(self.tools)
        if self.environments is not None:
            tools += _environment_methods(self.environments[row])
        sync, asynchronous = {}, {}
        for tool in tools:
            (asynchronous if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
        return sync, asynchronous

    def call_tools(self, row: int, tool_calls: list[dict]) -> tuple[list[dict], int]:
        """Run one turn's tool calls; returns the tool messages (TRL's order: sync results, then async ones)
        and the number of failures."""
        sync, asynchronous = self._tool_dicts(row)
        results, pending, failures = [], [], 0
        for call in tool_calls:
            if call.get("type") != "function":
                failures += 1
                results.append((call.get("name", "unknown"),
                                {"error": f"Unsupported tool call type: {call.get('type')}"}))
                continue
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            try:
                if name in sync:
                    results.append((name, _call_sync(name, sync[name], arguments, self.tool_timeout)))
                elif name in asynchronous:
                    pending.append((name, asynchronous[name](**arguments)))
                else:
                    raise ValueError(f"Tool {name} not found.")
            except Exception as exc:  # a failing tool is the model's problem: it sees the error
                failures += 1
                results.append((name, {"error": str(exc)}))
        if pending:
            for (name, _), result in zip(pending, self._async.gather(pending, self.tool_timeout)):
                if isinstance(result, BaseException):
                    failures += 1
                    result = {"error": str(result)}
                results.append((name, result))
        messages = []
        for name, result in results:
            if isinstance(result, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in result):
                raise ValueError(f"make_rollout_func: tool {name} returned an image; hybrid-engine rollouts are "
                                 "text-only")
            messages.append({"role": "tool", "name": name, "content": result if isinstance(result, list)
                             else str(result)})
        return messages, failures

    def _suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens the chat template writes for ``tool_messages`` after an assistant tool call, up to the next
        generation prompt: rendered after a dummy exchange, with the dummy cut after its last EOS (as TRL)."""
        t = self._tokenizing
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]
        render = t.processing_class.apply_chat_template
        head = render(dummy, add_generation_prompt=False, tokenize=True, chat_template=t.chat_template,
                      return_dict=False, **t.template_kwargs)
        full = render(dummy + tool_messages, add_generation_prompt=True, tokenize=True, chat_template=t.chat_template,
                      return_dict=False, **t.template_kwargs)
        eos = t.tokenizer.eos_token_id
        ends = [i for i, tok in enumerate(head) if tok == eos]
        if ends:
            head = head[:ends[-1] + 1]
        if list(full[:len(head)]) != list(head):
            raise ValueError("make_rollout_func: the chat template renders the conversation before a tool message "
                             "differently once it follows; set a prefix-preserving processing_class.chat_template")
        return list(full[len(head):])

    def _parse(self, ids: list[int], prefix: list[int]) -> dict:
        from trl.chat_template_utils import parse_response

        return parse_response(self._tokenizing.tokenizer, ids, prefix=prefix, tools=self.schema_tools)

    # ----------------------------------------------------------------- loop
    def run(self, rollout: Any, request: RolloutRequest, prompt_ids: list[list[int]], n: int,
            sampling: SamplingConfig, max_iterations: int) -> dict[str, list]:
        """The tool loop on ``rollout``: ``n`` rows per prompt of ``request`` (``prompt_ids`` unpadded); returns
        TRL's dict plus ``env_mask``, ``completion_messages`` and, with environments, ``environments``."""
        episodes = rollout.open_episodes(request, n_samples_per_prompt=n)
        rows = episodes.num_rows
        prompts = [prompt_ids[r // n] for r in range(rows)]
        budget = sampling.max_new_tokens  # max_completion_length, over the whole completion (as TRL)
        config = rollout.model.config
        limit = getattr(config, "max_position_embeddings", None) or max_positions(config)  # TRL reads the former
        longest_prompt = max(len(p) for p in prompts)
        if limit is not None and longest_prompt >= limit:
            raise ValueError(f"rollout_func: a prompt has {longest_prompt} tokens, and the model's position limit is "
                             f"{limit}; truncate the prompts")
        lengths = [0] * rows  # each row's completion so far (model and environment tokens), within budget
        messages: list[list[dict]] = [[] for _ in range(rows)]
        calls = failures = 0
        one = dataclasses.replace(sampling, n_samples_per_prompt=1)

        def decode(chosen: list[int]) -> dict[int, list[int]]:
            """One model turn for ``chosen``, each row's tokens cut to its budget (and the position limit)."""
            caps = {r: budget - lengths[r] for r in chosen}
            if limit is not None:
                caps = {r: min(c, limit - len(prompts[r]) - lengths[r]) for r, c in caps.items()}
            live = [r for r in chosen if caps[r] > 0]
            starts = {r: len(episodes.history(r)) for r in live}
            longest = max((starts[r] for r in live), default=0)
            if live and (limit is None or longest + max(caps[r] for r in live) <= limit):
                groups = [live]  # one turn, each row within its own budget
            else:  # near the position limit: one turn per budget, each within the limit
                groups = [[r for r in live if caps[r] == c] for c in sorted({caps[r] for r in live})]
            for group in groups:
                episodes.turn(dataclasses.replace(one, max_new_tokens=max(caps[r] for r in group)), rows=group,
                              max_new_tokens=[caps[r] for r in group])
            out = {r: [] for r in chosen}
            for r in live:
                out[r] = episodes.history(r)[starts[r]:starts[r] + caps[r]]
            return out

        pending: dict[int, list[dict]] = {}  # row -> the tool calls of its last turn
        for r, ids in decode(list(range(rows))).items():
            parsed = self._parse(ids, prompts[r])
            lengths[r] += len(ids)
            messages[r].append(parsed)
            if parsed.get("tool_calls"):
                pending[r] = parsed["tool_calls"]
        iteration = 0
        while pending and iteration < max_iterations:
            go_on = []
            for r, tool_calls in pending.items():
                results, failed = self.call_tools(r, tool_calls)
                calls += len(tool_calls)
                failures += failed
                suffix = self._suffix_ids(results)
                total = len(prompts[r]) + lengths[r] + len(suffix)
                if lengths[r] + len(suffix) > budget or (limit is not None and total >= limit):
                    continue  # the results would not fit: dropped, and the row ends here (as TRL)
                messages[r] += results
                episodes.append(r, suffix)
                lengths[r] += len(suffix)
                go_on.append(r)
            if not go_on:
                break
            prefixes = {r: episodes.history(r) for r in go_on}  # the prompt, the completion, the tool results
            pending = {}
            for r, ids in decode(go_on).items():
                lengths[r] += len(ids)
                if not ids:  # no budget left for a turn
                    continue
                parsed = self._parse(ids, prefixes[r])
                messages[r].append(parsed)
                if parsed.get("tool_calls"):
                    pending[r] = parsed["tool_calls"]
            iteration += 1

        batch = episodes.close()
        ids = batch.completion_ids.tolist()
        env = batch.env_mask.tolist()
        logprobs = batch.completion_logprobs.tolist()
        self.last_stats = {"tool_calls": calls, "tool_failures": failures, "rows": rows,
                           "turns": list(batch.turns), "iterations": iteration}
        out = {
            "prompt_ids": prompts,
            "completion_ids": [ids[i][:lengths[r]] for i, r in enumerate(batch.rows)],
            "logprobs": [logprobs[i][:lengths[r]] for i, r in enumerate(batch.rows)],
            "env_mask": [env[i][:lengths[r]] for i, r in enumerate(batch.rows)],
            "completion_messages": [messages[r] for r in batch.rows],
        }
        if self.environments is not None:
            out["environments"] = list(self.environments)
        return out

    def log_metrics(self, trainer: Any, mode: str) -> None:
        """TRL's tool metrics (``tools/call_frequency``, ``tools/failure_frequency``), summed over processes."""
        metrics = getattr(trainer, "_metrics", None)
        accelerator = getattr(trainer, "accelerator", None)
        if metrics is None or accelerator is None or not self.last_stats:
            return
        s = self.last_stats
        counts = torch.tensor([s["tool_calls"], s["tool_failures"], s["rows"]], dtype=torch.float64,
                              device=accelerator.device)
        counts = accelerator.gather(counts.unsqueeze(0)).reshape(-1, 3).sum(0).tolist()
        metrics[mode]["tools/call_frequency"].append(counts[0] / counts[2])
        metrics[mode]["tools/failure_frequency"].append(counts[1] / counts[0] if counts[0] else 0.0)
