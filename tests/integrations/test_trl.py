"""make_rollout_func: TRL's GRPOTrainer generating through hybrid-engine rollouts, graphs on, on CPU.

The end-to-end tests train a tiny model with a real ``GRPOTrainer`` (no network:
a seeded tiny model and a locally built tokenizer). At every step the graphed
rollout's completions and logprobs must equal what an eager rollout returns for
the same request and seed on the same (just updated) weights, the graphs must
be captured once and replayed at every later step, and a whole run with graphs
must train to the same weights as one without. The unit tests drive the
rollout func with a stand-in trainer (the attributes TRL's trainer has) for
folding, tokenization, seeding, overrides and errors.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hybrid_engine import HybridEngineRollout, RolloutConfig  # noqa: E402
from hybrid_engine.integrations.trl import HybridEngineRolloutFunc, make_rollout_func, rollout_seed  # noqa: E402
from hybrid_engine.tiny_models import EOS_ID, build_model, build_tokenizer  # noqa: E402

# Different lengths, so prompts are left-padded; every word is in the tiny tokenizer's vocabulary.
PROMPTS = ["the cat is in the water", "you can find the day", "he was", "make some time for it now so"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
                 "{% if add_generation_prompt %}he said :{% endif %}")
# Distinct, so every step's two prompts differ; all at most 8 tokens (one admission width bucket).
TRAIN_PROMPTS = PROMPTS + ["we can see the oil", "what is it", "how long is one day", "all of them were out"]
GROUP = 4  # num_generations


def _tokenizer():
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _reward(completions, **kwargs):
    return [len(c) / 40.0 for c in completions]


# ----------------------------------------------------------- GRPOTrainer, end to end


def _train(tmp_path, fn, *, steps=3, check_eager=False, bf16=False):
    """Train a fresh tiny GPT-2 ``steps`` GRPO steps through ``fn``; returns (trainer, model, per-call records)."""
    model = build_model("tiny-gpt2", seed=0)
    records = []
    eager: list[HybridEngineRollout] = []

    def rollout_func(prompts, trainer):
        out = fn(prompts, trainer)
        record = {"prompts": list(prompts), "out": out, "stats": dict(fn.rollout.last_stats),
                  "sampling": fn.last_sampling, "rows": fn.last_request.prompt_ids.shape[0]}
        if check_eager:  # the same request and seed, eagerly, on the same weights (before this step's update)
            if not eager:
                eager.append(HybridEngineRollout(
                    fn.rollout.model, config=dataclasses.replace(fn.rollout.config, use_graph_capture=False)))
            record["eager"] = eager[0].generate(fn.last_request, fn.last_sampling)
        records.append(record)
        return out

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * GROUP, num_generations=GROUP,
        max_completion_length=8, max_steps=steps, learning_rate=1e-2, logging_steps=1, report_to="none",
        use_cpu=True, bf16=bf16, save_strategy="no", disable_dropout=True,  # TRL's default gradient checkpointing
        seed=0, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": TRAIN_PROMPTS}),
                          processing_class=_tokenizer(), rollout_func=rollout_func)
    trainer.train()
    return trainer, model, records


def test_grpo_trains_three_steps_through_graphed_rollouts(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    fn = make_rollout_func()
    tok = _tokenizer()
    model_ref = build_model("tiny-gpt2", seed=0)
    trainer, model, records = _train(tmp_path, fn, check_eager=True)

    assert trainer.state.global_step == 3 and len(records) == 3
    # The rollout drives the trainer's own module: trained in place, nothing copied or re-allocated.
    assert fn.rollout.model is model
    changed = [n for (n, p), (_, p0) in zip(model.named_parameters(), model_ref.named_parameters())
               if not torch.equal(p, p0)]
    assert len(changed) == len(list(model.parameters()))

    stats = fn.rollout.graph_stats
    assert stats.captures == stats.graph_keys >= 1  # one capture per bucket and span, all in the first call
    assert stats.invalidations == 0 and stats.fallbacks == 0 and stats.eager_steps == 0
    assert [r["stats"]["graph_captures"] for r in records][1:] == [0, 0]
    # Admission: a round of every size the call may admit, captured up front in the first call; its prefill batch
    # (one width bucket) warmed up in the first call, captured in the second.
    rounds = len([b for b in stats.buckets if b <= max(stats.buckets)])
    assert [r["stats"]["admission_graph_captures"] for r in records] == [rounds, 1, 0]
    assert stats.admission_captures == rounds + 1
    assert all(r["stats"]["graph_replays"] > 0 and r["stats"]["use_graph_capture"] for r in records)

    seen_samples = set()
    for step, r in enumerate(records):
        prompts, out, eager = r["prompts"], r["out"], r["eager"]
        # TRL repeats each prompt GROUP times; each group is folded into one prompt sampled GROUP times.
        assert len(prompts) == 2 * GROUP and r["rows"] == 2 and r["sampling"].n_samples_per_prompt == GROUP
        assert r["sampling"].seed == rollout_seed(0, step, 0, "train")
        assert r["sampling"].max_new_tokens == 8 and r["sampling"].temperature == 1.0
        assert [len(v) for v in out.values()] == [len(prompts)] * 3
        for p, ids in zip(prompts, out["prompt_ids"]):
            assert ids == tok(p, add_special_tokens=False)["input_ids"]
        # Graph replay == eager for the same seed, on the weights of this step.
        lengths = eager.response_lengths.tolist()
        assert out["completion_ids"] == [row[:n] for row, n in zip(eager.responses.tolist(), lengths)]
        for lp, row, n in zip(out["logprobs"], eager.response_logprobs, lengths):
            assert torch.equal(torch.tensor(lp, dtype=torch.float32), row[:n])
        # The samples of one group differ (one shared prefill, GROUP random streams).
        groups = [out["completion_ids"][i:i + GROUP] for i in range(0, len(prompts), GROUP)]
        assert all(len({tuple(c) for c in g}) > 1 for g in groups)
        seen_samples.update(tuple(c) for c in out["completion_ids"])
    assert len(seen_samples) == 3 * 2 * GROUP  # every step samples anew


def test_trl_default_bf16_autocast_rolls_out_with_graphs_equal_to_eager(tmp_path, monkeypatch):
    # GRPOConfig's default bf16=True: accelerate wraps the model's forward in autocast, so the projections give
    # bf16 K/V (and RoPE-less GPT-2 bf16 keys) against the model's fp32 cache; that used to fail on the first step.
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    fn = make_rollout_func()
    trainer, model, records = _train(tmp_path, fn, steps=2, check_eager=True, bf16=True)
    assert trainer.state.global_step == 2 and "forward" in vars(model)  # the instance forward enters autocast
    stats = fn.rollout.graph_stats
    assert stats.captures == len(stats.buckets) >= 1 and stats.invalidations == 0 and stats.eager_steps == 0
    for r in records:
        eager, lengths = r["eager"], r["eager"].response_lengths.tolist()
        assert r["out"]["completion_ids"] == [row[:n] for row, n in zip(eager.responses.tolist(), lengths)]
        for lp, row, n in zip(r["out"]["logprobs"], eager.response_logprobs, lengths):
            assert torch.equal(torch.tensor(lp, dtype=torch.float32), row[:n])


def test_graphs_on_and_off_train_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    _, graphed, rec_g = _train(tmp_path / "g", make_rollout_func(), steps=2)
    fn_eager = make_rollout_func(RolloutConfig(use_graph_capture=False))
    _, eager, rec_e = _train(tmp_path / "e", fn_eager, steps=2)
    assert fn_eager.rollout.graph_stats.captures == 0 and rec_g[0]["stats"]["graph_captures"] > 0
    assert [r["out"] for r in rec_g] == [r["out"] for r in rec_e]
    for (n, p), (_, q) in zip(graphed.named_parameters(), eager.named_parameters()):
        assert torch.equal(p, q), n


# ------------------------------------------------------------- stand-in trainer


_MODEL = {}


def _model():
    if "m" not in _MODEL:
        _MODEL["m"] = build_model("tiny-gpt2", seed=0)
    return _MODEL["m"]


def _trainer(model=None, tokenizer=None, step=0, **args):
    defaults = dict(max_completion_length=6, temperature=1.0, top_p=1.0, top_k=0, seed=0, min_p=None,
                    repetition_penalty=1.0, generation_kwargs=None)
    model = model if model is not None else _model()
    model.train()  # as GRPOTrainer's model is while training (the rollout decodes in eval mode and restores it)
    return SimpleNamespace(
        model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0),
        processing_class=tokenizer if tokenizer is not None else _tokenizer(),
        args=SimpleNamespace(**{**defaults, **args}), state=SimpleNamespace(global_step=step),
        eos_token_ids=[EOS_ID], chat_template_kwargs={},
    )


def test_fold_tokenize_and_order():
    fn = make_rollout_func(config=RolloutConfig(use_graph_capture=True, eos_token_id=10_000))
    tok = _tokenizer()
    a, b = PROMPTS[0], PROMPTS[2]
    prompts = [a, a, b, b, b, b]  # runs of 2 and 4: folded into a, b, b with 2 samples each
    out = fn(prompts, _trainer(tokenizer=tok))
    assert isinstance(fn, HybridEngineRolloutFunc) and fn.rollout.model is _model()
    req = fn.last_request
    assert req.prompt_ids.shape[0] == 3 and fn.last_sampling.n_samples_per_prompt == 2
    a_ids, b_ids = (tok(p, add_special_tokens=False)["input_ids"] for p in (a, b))
    width = req.prompt_ids.shape[1]
    assert width == len(a_ids) > len(b_ids)
    assert req.prompt_ids[1].tolist() == [0] * (width - len(b_ids)) + b_ids  # left-padded with the pad id
    assert req.prompt_attention_mask[1].tolist() == [0] * (width - len(b_ids)) + [1] * len(b_ids)
    assert out["prompt_ids"] == [a_ids] * 2 + [b_ids] * 4
    assert all(len(c) == 6 and len(lp) == 6 for c, lp in zip(out["completion_ids"], out["logprobs"]))
    # The two folded copies of b have their own request ids, hence their own samples.
    assert out["completion_ids"][2:4] != out["completion_ids"][4:6]
    assert all(lp <= 0 for row in out["logprobs"] for lp in row)


def test_seed_from_trainer_seed_step_and_process():
    fn = make_rollout_func()
    prompts = [PROMPTS[1]] * GROUP
    trainer = _trainer(step=5)
    first = fn(prompts, trainer)
    assert fn.last_sampling.seed == rollout_seed(0, 5, 0, "train")
    # A second call at the same step (gradient accumulation, steps_per_generation below it) samples anew ...
    assert fn(prompts, trainer)["completion_ids"] != first["completion_ids"]
    assert fn.last_sampling.seed == rollout_seed(0, 5, 0, "train", call_index=1) != rollout_seed(0, 5, 0, "train")
    # ... and a rerun of the step (a fresh function, as after a resume) samples what its first call did, as does
    # this function handed to a new trainer (a second run), whose calls count from its own start.
    assert make_rollout_func()(prompts, _trainer(step=5)) == first
    second_run = _trainer(step=5)
    assert fn(prompts, second_run) == first and fn.last_sampling.seed == rollout_seed(0, 5, 0, "train")
    del trainer
    assert fn(prompts, _trainer(step=6))["completion_ids"] != first["completion_ids"]
    assert fn(prompts, _trainer(step=5, seed=1))["completion_ids"] != first["completion_ids"]
    assert fn.last_sampling.seed == rollout_seed(1, 5, 0, "train")
    other_rank = _trainer(step=5)
    other_rank.accelerator.process_index = 1
    assert fn(prompts, other_rank)["completion_ids"] != first["completion_ids"]
    evaluating = _trainer(step=5)
    evaluating.model.eval()  # TRL's evaluation calls the rollout func with the model in eval mode
    assert fn(prompts, evaluating)["completion_ids"] != first["completion_ids"]
    assert fn.last_sampling.seed == rollout_seed(0, 5, 0, "eval") != rollout_seed(0, 5, 0, "train")


def test_sampling_from_args_and_overrides():
    fn = make_rollout_func()
    fn([PROMPTS[0]] * 2, _trainer(temperature=0.7, top_p=0.9, top_k=5, max_completion_length=3))
    s = fn.last_sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k) == (3, 0.7, 0.9, 5)
    tuned = make_rollout_func(temperature=0.7, max_new_tokens=4, top_k=1, top_p=0.5, seed=7)
    out = tuned([PROMPTS[0]] * 3, _trainer(temperature=0.7, max_completion_length=4))
    s = tuned.last_sampling
    assert (s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.seed) == (4, 0.7, 1, 0.5, rollout_seed(7, 0, 0, "train"))
    assert out["completion_ids"][0] == out["completion_ids"][1] == out["completion_ids"][2]  # top_k=1
    assert len(out["completion_ids"][0]) == 4
    assert s.logprobs == "sampling"
    full = make_rollout_func(top_k=3, logprobs="full")
    out_full = full([PROMPTS[0]] * 2, _trainer(max_completion_length=4))
    plain = make_rollout_func(top_k=3)
    out_plain = plain([PROMPTS[0]] * 2, _trainer(max_completion_length=4))
    assert full.last_sampling.logprobs == "full" and out_full["completion_ids"] == out_plain["completion_ids"]
    # under top-k the default renormalises over the kept tokens: higher than the full softmax's
    assert all(a > b for a, b in zip(out_plain["logprobs"][0], out_full["logprobs"][0]))
    with pytest.raises(ValueError, match="invalid sampling override .*logprobs"):
        make_rollout_func(logprobs="raw")


@pytest.mark.parametrize("override,args,match", [
    # TRL's loss scores the completions at args.temperature: sampling at another one trains off-policy.
    ({"temperature": 0.7}, {"temperature": 1.0}, r"make_rollout_func\(temperature=0.7\) differs from "
                                                 r"trainer.args.temperature=1.0.*off-policy.*GRPOConfig\(temperature=0.7\)"),
    ({"max_new_tokens": 4}, {"max_completion_length": 6}, r"max_completion_length=4\) differs.*dr_grpo"),
    ({}, {"temperature": 0.0}, r"temperature=0.0 \(greedy, or near it\) cannot train a GRPO policy.*at least 1e-05"),
    ({}, {"temperature": 1e-6}, r"temperature=1e-06 \(greedy, or near it\) cannot train"),
    ({}, {"top_p": 0.0}, r"invalid sampling setting \(.*top_p.*\); fix it in GRPOConfig$"),
    ({}, {"min_p": 0.1}, "min_p"),
])
def test_sampling_that_trl_would_score_differently_is_refused(override, args, match):
    with pytest.raises(ValueError, match=match):
        make_rollout_func(**override)([PROMPTS[0]], _trainer(**args))
    make_rollout_func()([PROMPTS[0]], _trainer(min_p=0.0))  # min_p 0 is no filter, as in transformers


def test_generation_config_fields_trl_would_apply_are_refused():
    # TRL's own generation merges the model's generation_config into what it sets; these would be dropped here.
    model = build_model("tiny-gpt2", seed=0)
    model.generation_config.suppress_tokens = list(range(4, 200))
    with pytest.raises(ValueError, match="generation_config sets suppress_tokens.*reset them"):
        make_rollout_func()([PROMPTS[0]], _trainer(model=model))
    model.generation_config.suppress_tokens = None
    model.generation_config.no_repeat_ngram_size = 2
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        make_rollout_func()([PROMPTS[0]], _trainer(model=model))
    model.generation_config.no_repeat_ngram_size = 0
    model.generation_config.temperature = 0.3  # TRL sets temperature itself, so the model's is not applied there
    assert make_rollout_func()([PROMPTS[0]], _trainer(model=model))["completion_ids"]


def test_a_later_trainer_s_eos_ids_are_used():
    fn = make_rollout_func()
    first = _trainer()
    fn([PROMPTS[0]], first)
    rollout = fn.rollout
    fn([PROMPTS[0]], first)
    assert fn.rollout is rollout  # same model and ids: the same rollout, graphs kept
    second = _trainer()
    second.eos_token_ids = [EOS_ID, 179]
    fn([PROMPTS[0]], second)
    assert fn.rollout.config.eos_token_id == (EOS_ID, 179)


def test_ds3_gather_for_generation_false_is_refused_under_zero3():
    model = build_model("tiny-gpt2", seed=0)
    next(model.parameters()).ds_id = 0  # how DeepSpeed marks a ZeRO-3 partitioned parameter
    with pytest.raises(ValueError, match="ds3_gather_for_generation=False.*set it to True"):
        make_rollout_func()([PROMPTS[0]], _trainer(model=model, ds3_gather_for_generation=False))


def test_a_failed_call_does_not_count_as_a_call_at_its_step():
    fn = make_rollout_func()
    prompts = [PROMPTS[1]] * GROUP
    with pytest.raises(ValueError, match="position limit"):  # refused by the rollout itself
        fn(prompts, _trainer(step=3, max_completion_length=600))
    first = fn(prompts, _trainer(step=3))
    assert fn.last_sampling.seed == rollout_seed(0, 3, 0, "train")
    assert first == make_rollout_func()(prompts, _trainer(step=3))


def test_plain_text_prompts_get_the_tokenizers_special_tokens_as_in_trl():
    from tokenizers.processors import TemplateProcessing

    tok = _tokenizer()  # with a BOS, as Llama's tokenizer adds one; TRL tokenizes plain text with processing_class(text=)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    fn = make_rollout_func()
    out = fn([PROMPTS[0]] * 2, _trainer(tokenizer=tok))
    assert out["prompt_ids"] == [tok(text=[PROMPTS[0]])["input_ids"][0]] * 2
    assert out["prompt_ids"][0][0] == tok.bos_token_id
    conv = [{"role": "user", "content": PROMPTS[0]}]  # the chat template writes its own; nothing is added
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert fn([conv], _trainer(tokenizer=tok))["prompt_ids"] == [tok(text, add_special_tokens=False)["input_ids"]]


def test_conversational_prompts_use_the_chat_template():
    tok = _tokenizer()
    conv = [{"role": "user", "content": "the cat is in the water"}]
    fn = make_rollout_func()
    out = fn([conv, conv], _trainer(tokenizer=tok))
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text.endswith("he said :")
    assert out["prompt_ids"] == [tok(text, add_special_tokens=False)["input_ids"]] * 2
    assert fn.last_sampling.n_samples_per_prompt == 2


def test_eos_ids_come_from_the_trainer():
    fn = make_rollout_func()
    trainer = _trainer()
    trainer.eos_token_ids = [EOS_ID, 5]
    fn([PROMPTS[0]], trainer)
    assert fn.rollout.config.eos_token_id == (EOS_ID, 5) and fn.rollout.config.pad_token_id == 0


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"foo": 1}, TypeError, "unknown sampling override.*foo"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 4, "max_completion_length": 4}, TypeError, "not both"),
    ({"seed": "0"}, TypeError, "seed must be an int"),
    ({"config": {"use_graph_capture": True}}, TypeError, "RolloutConfig"),
    ({"zero3_gathered_inference_copy": 1}, TypeError, "zero3_gathered_inference_copy must be True or False"),
])
def test_bad_arguments_fail_at_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_rollout_func(**kwargs)


def _no_template():
    return build_tokenizer()


@pytest.mark.parametrize("prompts,trainer_kw,exc,match", [
    ([], {}, TypeError, "non-empty list"),
    ("the cat", {}, TypeError, "non-empty list"),
    (["the cat", [{"role": "user", "content": "x"}]], {}, TypeError, r"prompts\[1\]"),
    ([[{"role": "user", "content": [{"type": "image"}]}]], {}, ValueError, "text-only"),
    ([""], {}, ValueError, "tokenizes to no tokens"),
    (["the cat"], {"min_p": 0.1}, ValueError, "min_p"),
    (["the cat"], {"repetition_penalty": 1.2}, ValueError, "repetition_penalty"),
    (["the cat"], {"generation_kwargs": {"num_beams": 2}}, ValueError, "generation_kwargs"),
    (["the cat"], {"max_completion_length": None}, ValueError, "max_completion_length"),
    (["the cat"], {"top_k": 1.5}, ValueError, "top_k"),
    ([[{"role": "user", "content": "the cat"}]], {"tokenizer": _no_template()}, ValueError, "chat template"),
])
def test_bad_calls_name_the_problem(prompts, trainer_kw, exc, match):
    fn = make_rollout_func()
    with pytest.raises(exc, match=match):
        fn(prompts, _trainer(**trainer_kw))


@pytest.mark.parametrize("setting,match", [
    (dict(args_kw={"use_vllm": True}), r"use_vllm=True\) .* set use_vllm=False"),
    (dict(tools=[len]), r"GRPOTrainer\(tools=\.\.\.\) .* no logprobs; pass them to make_rollout_func\(tools=\.\.\.\)"),
    (dict(environment_factories={None: object}),
     r"GRPOTrainer\(environment_factory=\.\.\.\) .* pass them to make_rollout_func\(environment_factory=\.\.\.\)"),
])
def test_settings_under_which_trl_would_generate_itself_are_refused_at_the_first_call(setting, match):
    """With tools, TRL ran its own tool loop on our output and failed on `[0.0] * n + None` (its own generation
    returns no logprobs); use_vllm started a second engine. A stand-in trainer with the attributes GRPOTrainer
    sets (the real one refuses tools without a tool-calling chat template, and use_vllm without vLLM)."""
    trainer = _trainer(**setting.get("args_kw", {}))
    for name in ("tools", "environment_factories"):
        if name in setting:
            setattr(trainer, name, setting[name])
    fn = make_rollout_func()
    with pytest.raises(ValueError, match=match):
        fn(["the cat"], trainer)
    assert fn.rollout is None  # refused before any work
    assert len(fn(["the cat"], _trainer())["completion_ids"]) == 1  # and usable afterwards


def test_not_a_trainer_or_not_a_transformers_model():
    fn = make_rollout_func()
    with pytest.raises(TypeError, match="GRPOTrainer"):
        fn(["the cat"], object())
    with pytest.raises(TypeError, match="PreTrainedModel"):
        fn(["the cat"], _trainer(model=torch.nn.Linear(2, 2)))


def test_fsdp_is_refused_and_the_zero3_copy_flag_warns_when_nothing_is_partitioned():
    fsdp = _trainer()
    fsdp.is_fsdp_enabled = True
    with pytest.raises(ValueError, match="FSDP.*DeepSpeed ZeRO"):
        make_rollout_func()(["the cat"], fsdp)
    # Under ZeRO-3 the copy is used (tests/distributed/test_trl_zero3.py); on a whole model the flag does nothing.
    fn = make_rollout_func(zero3_gathered_inference_copy=True)
    with pytest.warns(UserWarning, match="zero3_gathered_inference_copy has no effect"):
        fn(["the cat"], _trainer(max_completion_length=3))
    assert fn.inference_copy is None and fn.rollout.model is _model()


def _example_script():
    path = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


@pytest.mark.parametrize("lora", [[], ["--lora", "4"]], ids=["full", "lora"])
def test_example_script_runs_and_graphs_match_eager(monkeypatch, capsys, lora):
    if lora:
        pytest.importorskip("peft")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    example = _example_script()
    assert example.main(["--compare", "--steps", "2", "--max-completion-length", "4", *lora]) == 0
    out = capsys.readouterr().out
    assert "completions identical at every step: yes" in out
    # 5 admission graphs: a prefill batch, and a round of each size up to the 8 slots (captured up front)
    assert "| on | 2 | 4 | 5 |" in out and "| off | 2 | 0 | 0 |" in out
    assert ("LoRA r=4" in out) == bool(lora)


@pytest.mark.parametrize("flags", [["--steps", "-3"], ["--steps", "0"], ["--prompts-per-step", "0"],
                                   ["--num-generations", "1"], ["--max-completion-length", "0"],
                                   ["--threads", "0"]])
def test_example_script_refuses_bad_counts_by_flag(capsys, flags):
    """Before: --steps -3 trained 18 steps and exited 0; the others ended in tracebacks deep in TRL or torch."""
    example = _example_script()
    with pytest.raises(SystemExit) as exit_info:
        example.main(flags)
    assert exit_info.value.code == 2 and f"{flags[0]} must be >=" in capsys.readouterr().err
