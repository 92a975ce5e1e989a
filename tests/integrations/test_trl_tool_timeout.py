"""make_rollout_func(tool_timeout=...) (issue 44): a tool that never returns is a tool failure the model sees after
the timeout, not a hang; an async one is cancelled on the tools' loop, and an interrupted call leaves nothing
pending there either.

Every wait here is bounded: the calls run with a timeout (the feature under test) or in a thread joined with
one, and the interrupt is sent once the tool has started (an Event), not after a sleep.
"""

from __future__ import annotations

import asyncio
import copy
import math
import signal
import threading

import pytest

pytest.importorskip("trl", reason="needs the trl extra")

from hybrid_engine import RolloutConfig  # noqa: E402
from hybrid_engine.integrations.trl import make_rollout_func  # noqa: E402
from hybrid_engine.integrations.trl_tools import DEFAULT_TOOL_TIMEOUT, ToolLoop  # noqa: E402

from .test_trl_tools import QUESTIONS, _conversation, add, scripted_model, stand_in_trainer  # noqa: E402

HARD = 60  # seconds: what a broken timeout would otherwise wait for ever


class Tools:
    """Tools that never return until released, recording what happened to them."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.release = threading.Event()

    def tools(self) -> list:
        async def hang(x: int) -> int:
            """Never return.

            Args:
                x: The number.
            """
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return x

        def stuck(x: int) -> int:
            """Block until released.

            Args:
                x: The number.
            """
            self.started.set()
            self.release.wait(HARD)
            return x

        async def double(x: int) -> int:
            """Double a number.

            Args:
                x: The number.
            """
            await asyncio.sleep(0)
            return 2 * x

        return [hang, stuck, double, add]


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def in_thread(fn, *args):
    """``fn(*args)`` in a thread joined within HARD seconds (a hang fails the test instead of the run)."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HARD)
    assert not thread.is_alive(), f"{fn.__name__} still running after {HARD} s"
    if "error" in box:
        raise box["error"]
    return box["out"]


def pending_tasks(loop: ToolLoop) -> set:
    async def others() -> set:
        return asyncio.all_tasks() - {asyncio.current_task()}

    return asyncio.run_coroutine_threadsafe(others(), loop._async.loop).result(HARD)


def test_an_async_tool_that_never_returns_is_a_failure_after_the_timeout_and_is_cancelled():
    t = Tools()
    loop = ToolLoop(tools=t.tools(), tool_timeout=0.2)
    messages, failures = in_thread(loop.call_tools, 0, [call("hang", x=1), call("add", a=1, b=2),
                                                         call("double", x=3)])
    # TRL's order (sync results, then async ones), the timeout reported as any failure is.
    assert [(m["name"], m["content"]) for m in messages] == [
        ("add", "3"), ("hang", "{'error': 'Tool hang timed out after 0.2 seconds.'}"), ("double", "6")]
    assert failures == 1
    assert t.cancelled.is_set()  # cancelled on the loop, not abandoned there
    assert pending_tasks(loop) == set()
    # The loop goes on working.
    assert in_thread(loop.call_tools, 0, [call("double", x=5)]) == ([{"role": "tool", "name": "double",
                                                                       "content": "10"}], 0)


def test_a_sync_tool_past_the_timeout_is_a_failure_and_the_loop_goes_on():
    t = Tools()
    loop = ToolLoop(tools=t.tools(), tool_timeout=0.2)
    try:
        messages, failures = in_thread(loop.call_tools, 0, [call("stuck", x=1), call("add", a=2, b=2)])
    finally:
        t.release.set()  # the worker thread Python cannot stop ends here
    assert [(m["name"], m["content"]) for m in messages] == [
        ("stuck", "{'error': 'Tool stuck timed out after 0.2 seconds.'}"), ("add", "4")]
    assert failures == 1


def test_an_interrupted_call_leaves_nothing_pending_on_the_tools_loop():
    """A KeyboardInterrupt (a real SIGINT to the main thread, sent once the tool runs) while an async tool runs:
    the tool is cancelled on the loop before the interrupt propagates."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    t = Tools()
    loop = ToolLoop(tools=t.tools(), tool_timeout=HARD)  # the interrupt, not the timeout, ends the call

    def interrupt() -> None:
        if t.started.wait(HARD):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python's own SIGINT handler: a process started in the background of a non-interactive shell (as CI may
    # be) begins with SIGINT ignored, and Python then installs none.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sender = threading.Thread(target=interrupt, daemon=True)
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            loop.call_tools(0, [call("hang", x=1)])
        sender.join(HARD)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert t.cancelled.is_set()
    assert pending_tasks(loop) == set()
    assert in_thread(loop.call_tools, 0, [call("double", x=1)])[0][0]["content"] == "2"


def test_the_timeout_is_sixty_seconds_unless_given():
    assert DEFAULT_TOOL_TIMEOUT == 60.0
    assert make_rollout_func(tools=[add]).tool_loop.tool_timeout == 60.0
    assert make_rollout_func(tools=[add], tool_timeout=None).tool_loop.tool_timeout is None
    assert make_rollout_func(tools=[add], tool_timeout=2).tool_loop.tool_timeout == 2.0


@pytest.mark.parametrize("value,exc", [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                                       (math.inf, ValueError), (1e300, ValueError), ("5", TypeError),
                                       (True, TypeError)])
def test_a_bad_timeout_is_refused_by_name(value, exc):
    with pytest.raises(exc, match="make_rollout_func: tool_timeout must be a number of seconds"):
        make_rollout_func(tools=[add], tool_timeout=value)


def test_a_timeout_without_tools_is_refused():
    with pytest.raises(TypeError, match="tool_timeout needs tools= or environment_factory="):
        make_rollout_func(tool_timeout=5)


def test_in_the_loop_the_model_sees_the_timeout_as_the_tool_result():
    """The scripted model calls ``add`` on its first question; here ``add`` never returns."""

    async def add(a: int, b: int) -> int:  # the same schema as the scripted prompts' add
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        await asyncio.Event().wait()
        return a + b

    fn = make_rollout_func(RolloutConfig(use_graph_capture=False), tools=[add], tool_timeout=0.2,
                           max_tool_calling_iterations=1)
    trainer = stand_in_trainer(scripted_model())
    out = in_thread(fn, copy.deepcopy([_conversation(QUESTIONS[0])] * 2), trainer)
    tools = [m for msgs in out["completion_messages"] for m in msgs if m["role"] == "tool"]
    assert [m["content"] for m in tools] == ["{'error': 'Tool add timed out after 0.2 seconds.'}"] * 2
    assert fn.tool_loop.last_stats["tool_failures"] == 2 and fn.tool_loop.last_stats["tool_calls"] == 2
    assert all(0 in env for env in out["env_mask"])  # the failure went back to the model as tool tokens
    assert pending_tasks(fn.tool_loop) == set()
