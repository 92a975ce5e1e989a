"""make_rollout_func(tools=..., environment_factory=...): TRL's tool loop run inside hybrid-engine rollouts, on CPU.

The toy task: an ``add(a, b)`` tool. The model is scripted (``scripted_model.scripted_gpt2``: a real one-layer
GPT-2 whose next token is a function of position and token, with logit margins of 40 and more), so that on
every CPU it calls the tool once on one question, twice on another, with a wrong name on a third and not at all
on the fourth, as SCRIPT says; its final answers are fair choices (right or wrong, with logprob log 1/2), so
rewards vary within a group. A model fitted inside the test and then sampled made its extra tool calls by
accident, and on AVX2 CPUs not at all (issue 38). The tokenizer is built locally (``build_tool_tokenizer``: the
tiny word-level vocabulary with a few words added, a chat template that renders tools, tool calls and tool
messages, and a response template, transformers' response parsing that TRL's ``parse_response`` uses, that
parses ``call add a = 3 b = 4 end`` into a tool call).

The reference is TRL's own loop: a real ``GRPOTrainer(tools=[add])`` runs its ``_generate`` (tool calls,
tool results, masks, budget) on the same prompts, its per-turn generation replaced by a replay of the
turns our rollout sampled, so everything else (parsing, calling, rendering, cutting) is TRL's code.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra")

from datasets import Dataset  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hybrid_engine import RolloutConfig, RolloutRequest  # noqa: E402
from hybrid_engine.integrations.trl import environment_reward, make_rollout_func  # noqa: E402
from hybrid_engine.integrations.trl_tools import ToolLoop  # noqa: E402
from hybrid_engine.tiny_models import EOS_ID, build_tokenizer, build_tool_tokenizer  # noqa: E402

from .scripted_model import script_table, scripted_gpt2  # noqa: E402

GROUP = 4
# (question, the conversation the model is scripted to make: model turns and, between them, the tool results they
# get). "a|b" is a fair choice between a and b. Prompts of different lengths (14, 16, 15 and 12 tokens) keep the
# four scripts apart: the model's next token depends on the position and the token there.
SCRIPT = [
    ("what is 3 and 4", ["call add a = 3 b = 4 end </s>", "tool : 7 . assistant :", "7|9 </s>"]),
    ("what is 5 and 3 and 6", ["call add a = 5 b = 3 end </s>", "tool : 8 . assistant :",
                               "call add a = 8 b = 6 end </s>", "tool : 14 . assistant :", "14|15 </s>"]),
    ("the cat is in the water", ["it|he is </s>"]),
    ("what is it", ["call find a = 1 end </s>", "tool : {'error': 'Tool find not found.'} . assistant :",
                    "no|not </s>"]),
]
QUESTIONS = [q for q, _ in SCRIPT]
ANSWERS = {"what is 3 and 4": "7", "what is 5 and 3 and 6": "14", "the cat is in the water": "it is",
           "what is it": "no"}
BUDGET = 40  # max_completion_length: the longest script (two tool rounds and an answer) takes 34 tokens


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def _conversation(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


_SCRIPTED: dict[str, dict] = {}


def _steps(question: str, parts: list[str], tok) -> list:
    """SCRIPT's conversation as the steps of ``script_table``: the rendered prompt and the tool results given,
    the model turns sampled."""
    text = tok.apply_chat_template(_conversation(question), tools=[add], add_generation_prompt=True, tokenize=False)
    steps = [((t,), False) for t in tok(text, add_special_tokens=False)["input_ids"]]
    for j, part in enumerate(parts):
        if j % 2:
            steps += [((t,), False) for t in tok(part, add_special_tokens=False)["input_ids"]]
            continue
        for word in part.split():
            ids = tuple(tok.convert_tokens_to_ids(w) for w in word.split("|"))
            assert tok.unk_token_id not in ids, word
            steps.append((ids, True))
    return steps


def scripted_model(positions: int | None = None):
    """The GPT-2 scripted to make SCRIPT's conversations; a fresh copy per call (the tests train some), with only
    the first ``positions`` position embeddings if given (a lower position limit)."""
    if "state" not in _SCRIPTED:
        tok = build_tool_tokenizer()
        model = scripted_gpt2(script_table(_steps(q, parts, tok) for q, parts in SCRIPT))
        _SCRIPTED["config"] = model.config
        _SCRIPTED["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state, config = dict(_SCRIPTED["state"]), copy.deepcopy(_SCRIPTED["config"])
    if positions is not None:
        config.n_positions = positions
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:positions]
    with torch.random.fork_rng(devices=[]):  # the initialisation, overwritten next, draws from the global RNG
        model = GPT2LMHeadModel(config)
    model.load_state_dict(state)
    return model.eval()


def stand_in_trainer(model, tokenizer=None, **args):
    """The attributes of GRPOTrainer the rollout function reads."""
    defaults = dict(max_completion_length=BUDGET, temperature=1.0, top_p=1.0, top_k=0, seed=0, min_p=None,
                    repetition_penalty=1.0, generation_kwargs=None, max_tool_calling_iterations=None)
    model.train()
    return SimpleNamespace(
        model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0),
        processing_class=tokenizer if tokenizer is not None else build_tool_tokenizer(),
        args=SimpleNamespace(**{**defaults, **args}), state=SimpleNamespace(global_step=0),
        eos_token_ids=[EOS_ID], chat_template_kwargs={},
    )


def _prompts():
    return [_conversation(q) for q in QUESTIONS for _ in range(GROUP)]


def _segments(env_mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of model tokens."""
    runs, start = [], None
    for i, m in enumerate([*env_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.fixture(scope="module")
def tool_call():
    """One call of make_rollout_func(tools=[add]) on the scripted model: (fn, trainer, prompts, output)."""
    model = scripted_model()
    trainer = stand_in_trainer(model)
    fn = make_rollout_func(RolloutConfig(use_graph_capture=False), tools=[add])
    prompts = _prompts()
    out = fn(copy.deepcopy(prompts), trainer)
    return fn, trainer, prompts, out


def test_the_loop_runs_several_turns_and_masks_the_tool_results(tool_call):
    fn, trainer, prompts, out = tool_call
    rows = len(prompts)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", "completion_messages"}
    assert all(len(out[k]) == rows for k in out)
    tok = trainer.processing_class
    stats = fn.tool_loop.last_stats
    assert stats["tool_calls"] >= GROUP and stats["tool_failures"] >= 1  # "what is it" calls a tool that is not there
    assert max(stats["turns"]) >= 3 and min(stats["turns"]) == 1  # two tool rounds on some rows, none on others
    assert stats["turns"] == [2] * GROUP + [3] * GROUP + [1] * GROUP + [2] * GROUP  # SCRIPT's, on every CPU
    for r in range(rows):
        ids, lp, env = out["completion_ids"][r], out["logprobs"][r], out["env_mask"][r]
        assert len(ids) == len(lp) == len(env) <= trainer.args.max_completion_length
        assert len(_segments(env)) == stats["turns"][r]
        assert all(x == 0.0 for x, m in zip(lp, env) if not m)  # environment tokens: no logprob
        assert all(x <= 0.0 for x, m in zip(lp, env) if m) and any(x < 0.0 for x in lp)
        # Every run of environment tokens is a rendered tool message, after a model turn that ended on EOS.
        for (_, end), (start, _) in zip(_segments(env), _segments(env)[1:]):
            assert ids[end - 1] == EOS_ID
            assert tok.decode(ids[end:start]).startswith("tool :")
        text = tok.apply_chat_template(prompts[r], tools=[add], add_generation_prompt=True, tokenize=False)
        assert out["prompt_ids"][r] == tok(text, add_special_tokens=False)["input_ids"]
    # 3 + 4 comes back as the tool result "7".
    results = [m["content"] for msgs in out["completion_messages"] for m in msgs if m["role"] == "tool"]
    assert "7" in results and "Tool find not found." in " ".join(results)


def test_model_tokens_are_those_of_a_single_turn_rollout_on_the_history(tool_call):
    """Turn t of row r samples as request t * rows + r on the history so far (prompt, turns, tool results)."""
    fn, _, prompts, out = tool_call
    rows, sampling = len(prompts), fn.last_sampling
    checked = 0
    for r in range(rows):
        full = out["prompt_ids"][r] + out["completion_ids"][r]
        offset = len(out["prompt_ids"][r])
        for t, (start, end) in enumerate(_segments(out["env_mask"][r])):
            history = torch.tensor([full[:offset + start]])
            single = dataclasses.replace(sampling, n_samples_per_prompt=1, max_new_tokens=end - start)
            batch = fn.rollout.generate(RolloutRequest(history, request_ids=[t * rows + r]), single)
            n = int(batch.response_lengths[0])
            assert batch.responses[0, :n].tolist() == out["completion_ids"][r][start:end]
            torch.testing.assert_close(batch.response_logprobs[0, :n],
                                       torch.tensor(out["logprobs"][r][start:end]), atol=1e-5, rtol=0)
            checked += 1
    assert checked > rows


def _trl_reference(model, tokenizer, prompts, out, **args):
    """TRL's own ``_generate`` with tools=[add] on ``prompts``, every model turn replayed from ``out``."""
    full = [p + c for p, c in zip(out["prompt_ids"], out["completion_ids"])]

    def replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions, logprobs, last = [], [], -1
        for history in prompt_ids:
            for r in range(last + 1, len(full)):
                pos = len(history) - len(out["prompt_ids"][r])
                if full[r][:len(history)] == list(history) and pos >= 0 and (
                        pos == len(out["env_mask"][r]) or out["env_mask"][r][pos] == 1):
                    break
            else:
                raise AssertionError(f"TRL asked for a turn our rollout did not sample: {history}")
            end = pos
            while end < len(out["env_mask"][r]) and out["env_mask"][r][end] == 1:
                end += 1
            completions.append(out["completion_ids"][r][pos:end])
            logprobs.append(out["logprobs"][r][pos:end])
            last = r
        return completions, logprobs

    config = GRPOConfig(output_dir="/tmp/trl_tools_reference", per_device_train_batch_size=len(prompts),
                        num_generations=GROUP, temperature=1.0, report_to="none", use_cpu=True, bf16=False,
                        save_strategy="no", **args)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                          tools=[add])
    trainer.model.train()  # TRL's mode while training: its metrics go under "train"
    trainer._generate_single_turn = replay  # the one thing replaced: TRL's generation, by our turns
    trainer._sync_tool_dicts = [{"add": add} for _ in prompts]  # as TRL builds them for a batch
    trainer._async_tool_dicts = [{} for _ in prompts]
    prompt_ids, completion_ids, tool_mask, completions, logprobs, *_ = trainer._generate(copy.deepcopy(prompts))
    calls = trainer._metrics["train"]["tools/call_frequency"][-1] * len(prompts)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": tool_mask, "logprobs": logprobs,
            "completion_messages": completions, "tool_calls": round(calls)}


@pytest.mark.parametrize("budget,iterations,positions", [(BUDGET, None, None), (20, None, None), (BUDGET, 1, None),
                                                         (BUDGET, None, 34)])
def test_same_result_as_trls_own_tool_loop(tool_call, budget, iterations, positions, monkeypatch):
    """Tool results, their tokens, the masks, the budget cut, the iteration limit and the model's position limit: as
    TRL's own loop."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    fn, trainer, prompts, out = tool_call
    if (budget, iterations, positions) != (BUDGET, None, None):
        trainer = stand_in_trainer(scripted_model(positions), max_completion_length=budget,
                                   max_tool_calling_iterations=iterations)
        fn = make_rollout_func(RolloutConfig(use_graph_capture=False), tools=[add])
        out = fn(copy.deepcopy(prompts), trainer)
    lengths, turns = [len(ids) for ids in out["completion_ids"]], fn.tool_loop.last_stats["turns"]
    assert max(lengths) <= budget
    if budget == 20:  # the second turn of "5 and 3 and 6" is cut, and the results of its cut call dropped
        assert budget in lengths and max(turns) == 2
    if iterations == 1:  # tool calls after the first round are parsed but not made
        assert max(turns) == 2 and any(msgs[-1].get("tool_calls") for msgs in out["completion_messages"])
    if positions is not None:  # no row reaches the limit; the second turn of "5 and 3 and 6" is cut to fit
        full = [len(p) + n for p, n in zip(out["prompt_ids"], lengths)]
        assert max(full) == positions and max(turns) == 2
    ref = _trl_reference(scripted_model(positions), build_tool_tokenizer(), prompts, out, max_completion_length=budget,
                         max_tool_calling_iterations=iterations)
    for key in ("prompt_ids", "completion_ids", "env_mask", "logprobs", "completion_messages"):
        assert out[key] == ref[key], key
    assert fn.tool_loop.last_stats["tool_calls"] == ref["tool_calls"]


class CalcEnv:
    """A toy environment: its ``add`` tool counts the calls; the reward is 1 for at least one call."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.resets = 0

    def reset(self, **kwargs) -> str | None:
        self.calls = []
        self.resets += 1
        assert "prompt" in kwargs
        return None

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls.append((a, b))
        return a + b

    def get_reward(self) -> float:
        return float(bool(self.calls))


def test_environment_factory_one_environment_per_rollout():
    model = scripted_model()
    fn = make_rollout_func(RolloutConfig(use_graph_capture=False), environment_factory=CalcEnv)
    prompts = _prompts()
    out = fn(copy.deepcopy(prompts), stand_in_trainer(model))
    envs = out["environments"]
    assert len(envs) == len(prompts) and len({id(e) for e in envs}) == len(prompts)
    for env, msgs in zip(envs, out["completion_messages"]):  # each row's calls went to its own environment
        # (a call whose result would not fit in the budget was made, but its result dropped)
        assert len(env.calls) >= sum(1 for m in msgs if m["role"] == "tool" and m["content"].isdigit())
    assert sum(len(e.calls) for e in envs) > 0
    rewards = environment_reward(prompts=prompts, completions=None, environments=envs)
    assert rewards == [float(bool(e.calls)) for e in envs] and 0.0 < sum(rewards) < len(prompts)
    out2 = fn(copy.deepcopy(prompts), stand_in_trainer(model))
    assert [id(e) for e in out2["environments"]] == [id(e) for e in envs]  # constructed once, reset per call
    assert all(e.resets == 2 for e in envs)


class ObservingEnv(CalcEnv):
    def reset(self, **kwargs) -> str:
        super().reset(**kwargs)
        return " now"


def test_environment_observation_is_appended_to_the_prompt():
    tok = build_tool_tokenizer()
    fn = make_rollout_func(RolloutConfig(use_graph_capture=False), environment_factory=ObservingEnv,
                           max_completion_length=4)
    out = fn([_conversation("what is it")] * 2, stand_in_trainer(scripted_model(), tok, max_completion_length=4))
    probe = fn.tool_loop.pool[0]
    text = tok.apply_chat_template(_conversation("what is it now"), tools=[probe.add], add_generation_prompt=True,
                                   tokenize=False)
    assert out["prompt_ids"] == [tok(text, add_special_tokens=False)["input_ids"]] * 2


async def double(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    await asyncio.sleep(0)
    return 2 * x


async def sour(x: int) -> int:
    """Fail, later.

    Args:
        x: The number.
    """
    raise RuntimeError("sour")


def boom(x: int) -> int:
    """Fail.

    Args:
        x: The number.
    """
    raise RuntimeError("no luck")


def test_tool_calls_and_failures_as_trl_makes_them():
    """Sync tools run in order, async ones together after them (TRL's order); every failure is a result."""
    loop = ToolLoop(tools=[add, double, sour, boom])

    def call(name, **arguments):
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    messages, failures = loop.call_tools(0, [call("double", x=2), call("add", a=1, b=2), call("boom", x=1),
                                             call("missing"), {"type": "web", "name": "search"},
                                             call("sour", x=1), call("add", a=1)])
    assert [(m["name"], m["content"]) for m in messages] == [
        ("add", "3"), ("boom", "{'error': 'no luck'}"), ("missing", "{'error': 'Tool missing not found.'}"),
        ("search", "{'error': 'Unsupported tool call type: web'}"),
        ("add", "{'error': \"add() missing 1 required positional argument: 'b'\"}"),
        ("double", "4"), ("sour", "{'error': 'sour'}")]
    assert failures == 5 and all(m["role"] == "tool" for m in messages)


def _no_docstring(a: int) -> int:
    return a


class _NoReset:
    def add(self, a: int) -> int:
        return a


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(tools=add), TypeError, "tools must be a list of functions"),
    (dict(tools=[add, 3]), TypeError, r"tools\[1\] is int, not a function"),
    (dict(tools=[_no_docstring]), TypeError, r"tools\[0\] \(_no_docstring\) has no JSON schema .* docstring"),
    (dict(tools=[]), ValueError, "gives the model nothing to call"),
    (dict(environment_factory={"calc": CalcEnv}), TypeError, "environment_factory must be one callable"),
    (dict(environment_factory=CalcEnv()), TypeError, "environment_factory must be a callable"),
    (dict(environment_factory=_NoReset), TypeError, "without a reset method"),
    (dict(tools=[add], max_tool_calling_iterations=-1), TypeError, "max_tool_calling_iterations must be an int"),
    (dict(max_tool_calling_iterations=2), TypeError, "needs tools= or environment_factory="),
])
def test_bad_arguments_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_rollout_func(**kwargs)


def test_a_tokenizer_that_cannot_do_tools_is_refused_at_the_first_call():
    model = scripted_model()
    plain = build_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    fn = make_rollout_func(tools=[add])
    with pytest.raises(ValueError, match=r"cannot render a tool-calling conversation .* processing_class.chat_template"):
        fn([_conversation("what is it")], stand_in_trainer(model, plain))
    unparsed = build_tool_tokenizer()
    unparsed.response_template = None
    with pytest.raises(ValueError, match=r"no response template.* set processing_class\.response_template"):
        fn([_conversation("what is it")], stand_in_trainer(model, unparsed))
    with pytest.raises(ValueError, match="needs conversational prompts"):
        fn(["what is it"], stand_in_trainer(model))
    assert fn.rollout is None


def test_zero3_without_the_gathered_copy_is_refused():
    model = scripted_model()
    next(model.parameters()).ds_id = 0  # how DeepSpeed marks a ZeRO-3 partitioned parameter
    fn = make_rollout_func(tools=[add])
    with pytest.raises(ValueError, match=r"ZeRO-3 .* different numbers of turns; pass "
                                         r"make_rollout_func\(zero3_gathered_inference_copy=True\)"):
        fn([_conversation("what is it")], stand_in_trainer(model))
    assert fn.rollout is None


def test_a_prompt_at_the_position_limit_is_refused():
    fn = make_rollout_func(RolloutConfig(use_graph_capture=False), tools=[add])
    with pytest.raises(ValueError, match="a prompt has 14 tokens, and the model's position limit is 12; truncate"):
        fn([_conversation("what is 3 and 4")], stand_in_trainer(scripted_model(12)))


@pytest.mark.parametrize("where", ["tools", "environment_factory"])
def test_grpo_trainer_tools_next_to_our_rollout_func_are_refused(tmp_path, monkeypatch, where):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    kwargs = {"tools": [add]} if where == "tools" else {"environment_factory": CalcEnv}
    trainer = GRPOTrainer(
        model=scripted_model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=GROUP, num_generations=GROUP,
                        max_completion_length=8, max_steps=1, report_to="none", use_cpu=True, bf16=False,
                        save_strategy="no"),
        train_dataset=Dataset.from_dict({"prompt": [_conversation("what is it")] * GROUP}),
        processing_class=build_tool_tokenizer(), rollout_func=make_rollout_func(), **kwargs)
    with pytest.raises(ValueError, match=rf"GRPOTrainer\({where}=\.\.\.\) .* pass them to "
                                         rf"make_rollout_func\({where}=\.\.\.\) instead"):
        trainer.train()


def _final_answer(completions, completion_messages, question, **kwargs):
    """1 when the last assistant turn (after any tool rounds) says the right answer."""
    return [float(msgs[-1].get("content", "") == ANSWERS[q]) for msgs, q in zip(completion_messages, question)]


class _RecordingTrainer(GRPOTrainer):
    """GRPOTrainer that keeps what each generation step fed the loss (tool_mask included)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.recorded = [*getattr(self, "recorded", []), {k: v for k, v in out.items() if torch.is_tensor(v)}]
        return out


def test_grpo_trainer_trains_three_steps_on_the_tool_task(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model = scripted_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fn = make_rollout_func(tools=[add])  # graphs on
    outputs = []

    def rollout_func(prompts, trainer):
        out = fn(prompts, trainer)
        outputs.append(out)
        return out

    questions = [q for q in QUESTIONS if q != "the cat is in the water"]
    dataset = Dataset.from_dict({"prompt": [_conversation(q) for q in questions], "question": questions})
    trainer = _RecordingTrainer(
        model=model, reward_funcs=_final_answer, train_dataset=dataset, processing_class=build_tool_tokenizer(),
        args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2 * GROUP, num_generations=GROUP,
                        max_completion_length=BUDGET, max_steps=3, learning_rate=1e-3, logging_steps=1, report_to="none",
                        use_cpu=True, bf16=False, save_strategy="no", disable_dropout=True, seed=0,
                        dataloader_num_workers=0),
        rollout_func=rollout_func)
    trainer.train()
    assert trainer.state.global_step == 3 and len(outputs) == len(trainer.recorded) == 3
    assert any(not torch.equal(p, before[k]) for k, p in model.state_dict().items())
    # The tool was called at every step, and TRL logged it as it logs its own tool loop.
    logged = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logged) == 3 and all(f > 0 for f in logged)
    for out, fed in zip(outputs, trainer.recorded):
        # TRL's loss mask: completion_mask * tool_mask, and tool_mask is our env_mask (0 on tool results).
        mask = fed["tool_mask"]
        for r, env in enumerate(out["env_mask"]):
            assert mask[r, :len(env)].tolist() == env
        assert (mask == 0).any()
        assert ((fed["completion_mask"] * mask).sum(1) == torch.tensor([sum(e) for e in out["env_mask"]])).all()
    assert fn.rollout.graph_stats.captures >= 1
