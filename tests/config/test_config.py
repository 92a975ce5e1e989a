"""Behaviour of ``hybrid_engine.config.schema``: validation, alias migration, graph gates."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
import sys
import warnings

import pytest

from hybrid_engine.accelerator import CPUAccelerator
from hybrid_engine.config.loading import load_config
from hybrid_engine.config.schema import EngineConfig, HybridEngineConfig
from hybrid_engine.decode import kv_storage
from hybrid_engine.graphs.policy import graph_capture_requested, validate_graph_capture_support


def _load_recording(source):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(source)
    # A FutureWarning (shown by Python's default filters), as the deprecated key is in the user's config.
    deprecations = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
                    and "deprecated" in str(w.message)]
    return cfg, deprecations


def _python_default_filters():
    """Python's default warning filters (no -W, not run as __main__)."""
    warnings.resetwarnings()
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


# ------------------------------------------------------------------ defaults


def test_defaults():
    cfg = load_config({})
    he = cfg.hybrid_engine
    assert isinstance(he, HybridEngineConfig)
    assert he.enabled is False
    assert he.max_out_tokens == 512
    assert he.inference_tp_size == 1
    assert he.release_inference_cache is False
    assert he.pin_parameters is True
    assert he.tp_gather_partition_size == 8
    assert he.enable_graph_capture is False
    assert cfg.train_batch_size is None
    assert cfg.train_micro_batch_size_per_gpu is None
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.zero_optimization.stage == 0
    assert cfg.fp16.enabled is False
    assert cfg.bf16.enabled is False
    assert cfg.optimizer is None
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None  # DeepSpeed's defaults


# -------------------------------------------------------------------- inputs

FULL = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2},
    "optimizer": {"type": "adamw", "params": {"lr": 1e-5, "betas": [0.9, 0.95]}},
    "gradient_clipping": 1.0,
    "steps_per_print": 5,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
    "activation_checkpointing": {"partition_activations": False},
    "hybrid_engine": {"enabled": True, "max_out_tokens": 64, "enable_graph_capture": True},
}


def _check_full(cfg: EngineConfig) -> None:
    assert cfg.train_batch_size == 8
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.model_dump()["overlap_comm"] is True
    assert cfg.fp16.enabled and cfg.fp16.initial_scale_power == 12
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["lr"] == 1e-5
    assert cfg.gradient_clipping == 1.0
    assert cfg.hybrid_engine.max_out_tokens == 64
    assert cfg.hybrid_engine.enable_graph_capture is True
    dumped = cfg.to_dict()
    assert dumped["wall_clock_breakdown"] is False
    assert dumped["activation_checkpointing"] == {"partition_activations": False}
    assert dumped["fp16"]["hysteresis"] == 2


def test_dict_input():
    _check_full(load_config(FULL))


def test_json_path_input_str_and_pathlike(tmp_path: pathlib.Path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(FULL))
    _check_full(load_config(path))
    _check_full(load_config(str(path)))


def test_config_object_input_round_trips():
    cfg = load_config(FULL)
    again = load_config(cfg)
    assert isinstance(again, EngineConfig)
    assert again.to_dict() == cfg.to_dict()
    # A dump is itself a valid config.
    assert load_config(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert load_config(json.loads(cfg.model_dump_json())).to_dict() == cfg.to_dict()


def test_mutated_object_is_revalidated():
    cfg = load_config({})
    cfg.hybrid_engine.max_out_tokens = -1
    with pytest.raises(ValueError, match=r"hybrid_engine\.max_out_tokens"):
        load_config(cfg)


@pytest.mark.parametrize("bad", [42, None, b"{}", ["hybrid_engine"], 1.5])
def test_bad_source_type(bad):
    with pytest.raises(TypeError, match="source"):
        load_config(bad)


def test_missing_file_names_path(tmp_path: pathlib.Path):
    path = tmp_path / "nope.json"
    with pytest.raises((FileNotFoundError, ValueError), match="nope.json"):
        load_config(path)


def test_invalid_json_names_file(tmp_path: pathlib.Path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        load_config(path)


HJSON_CONFIG = """
# DeepSpeed reads its config files with hjson: comments, unquoted keys, trailing commas
{
  train_micro_batch_size_per_gpu: 4,
  hybrid_engine: {max_out_tokens: 96, enable_graph_capture: false,},
}
"""


def test_hjson_file_is_read_as_deepspeed_reads_it(tmp_path: pathlib.Path):
    pytest.importorskip("hjson")
    path = tmp_path / "ds.hjson"
    path.write_text(HJSON_CONFIG)
    cfg = load_config(path)
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.hybrid_engine.max_out_tokens == 96 and cfg.hybrid_engine.enable_graph_capture is False
    path.write_text("{hybrid_engine: {max_out_tokens: 8}\n hybrid_engine: {max_out_tokens: 9}}")
    with pytest.raises(ValueError, match=r"Duplicate keys .*ds\.hjson: hybrid_engine"):
        load_config(path)


def test_hjson_file_without_the_hjson_package_says_what_to_install(tmp_path: pathlib.Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hjson", None)  # as on an install without DeepSpeed (which brings hjson)
    path = tmp_path / "ds.hjson"
    path.write_text(HJSON_CONFIG)
    with pytest.raises(ValueError, match=r"ds\.hjson is not valid JSON: .*install the hjson package"):
        load_config(path)


def test_base64_encoded_config_string_is_read_as_deepspeed_reads_it():
    text = json.dumps({"train_micro_batch_size_per_gpu": 2, "hybrid_engine": {"max_out_tokens": 48}})
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    cfg = load_config(encoded)
    assert cfg.train_micro_batch_size_per_gpu == 2 and cfg.hybrid_engine.max_out_tokens == 48
    bad = base64.urlsafe_b64encode(json.dumps({"hybrid_engine": {"max_out_tokens": 0}}).encode()).decode()
    with pytest.raises(ValueError, match=r"\(base64-encoded\).*hybrid_engine\.max_out_tokens"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="nor is it a base64-encoded config"):
        load_config("no_such_config.json")


def test_directory_path_is_value_error_naming_it(tmp_path: pathlib.Path):
    with pytest.raises(ValueError, match=rf"config path {re.escape(str(tmp_path))} is a directory"):
        load_config(tmp_path)


def test_duplicate_keys_in_a_file_are_refused_at_any_level(tmp_path: pathlib.Path):
    # json keeps the last of each silently (here dropping enable_graph_capture); DeepSpeed refuses the file.
    path = tmp_path / "dup.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "hybrid_engine": {"enable_graph_capture": true},'
                    ' "hybrid_engine": {"max_out_tokens": 64}}')
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config .*dup\.json: hybrid_engine \("):
        load_config(path)
    path.write_text('{"zero_optimization": {"stage": 2, "stage": 0}, "optimizer": {"type": "AdamW",'
                    ' "params": {"lr": 1e-3, "lr": 1e-4}}}')
    with pytest.raises(ValueError, match=r"zero_optimization\.stage, optimizer\.params\.lr"):
        load_config(path)
    path.write_text('{"scheduler": {"type": "WarmupLR", "params": [{"a": 1}, {"a": 1}]}}')  # distinct objects
    assert load_config(path).to_dict()["scheduler"]["params"] == [{"a": 1}, {"a": 1}]


@pytest.mark.parametrize(
    ("config", "paths"),
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-8}}},
         "optimizer.params.lr, optimizer.params.betas"),
        ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
         "train_micro_batch_size_per_gpu, gradient_accumulation_steps"),
        ({"gradient_clipping": "auto"}, "gradient_clipping"),
        ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
        ({"bfloat16": {"enabled": "auto"}}, "bfloat16.enabled"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}, "scheduler.params.warmup_max_lr"),
        ({"hybrid_engine": {"max_out_tokens": "auto"}}, "hybrid_engine.max_out_tokens"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": ["auto", 0.99]}}}, r"optimizer.params.betas[0]"),
    ],
)
def test_unresolved_auto_values_name_their_keys(config, paths):
    with pytest.raises(ValueError, match=r'"auto" must be resolved to a value') as info:
        load_config(config)
    msg = str(info.value)
    assert f"({paths})" in msg
    assert "does not resolve" in msg and "Trainer" in msg


def test_auto_in_deepspeeds_pass_through_sections_is_left_to_deepspeed():
    # DeepSpeed's section models read "auto" as "the default" there; only DeepSpeed reads them.
    cfg = load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                       "data_types": {"keep_in_fp32_modules": "auto"}})
    assert cfg.to_dict()["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_json_non_object_is_error(tmp_path: pathlib.Path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json"):
        load_config(path)


def test_validation_error_in_file_names_file_and_field(tmp_path: pathlib.Path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"hybrid_engine": {"max_out_tokens": 0}}))
    with pytest.raises(ValueError, match=r"bad\.json.*hybrid_engine\.max_out_tokens"):
        load_config(path)


# -------------------------------------------------------------- alias


@pytest.mark.parametrize("value", [True, False])
def test_alias_migrates_with_one_warning(value):
    cfg, deps = _load_recording({"hybrid_engine": {"enable_cuda_graph": value}})
    assert cfg.hybrid_engine.enable_graph_capture is value
    assert len(deps) == 1
    assert "hybrid_engine.enable_graph_capture" in str(deps[0].message)


def test_alias_same_value_as_new_key_is_fine():
    cfg, deps = _load_recording({"hybrid_engine": {"enable_cuda_graph": True, "enable_graph_capture": True}})
    assert cfg.hybrid_engine.enable_graph_capture is True
    assert len(deps) == 1


def test_new_key_alone_gives_no_warning():
    cfg, deps = _load_recording({"hybrid_engine": {"enable_graph_capture": True}})
    assert cfg.hybrid_engine.enable_graph_capture is True
    assert deps == []


def test_alias_warning_is_shown_by_default_and_points_at_the_caller():
    # A DeprecationWarning raised inside a pydantic validator is attributed to pydantic and hidden by Python's
    # default filters: the user of the deprecated key must see it, once, at their own line.
    from hybrid_engine import initialize
    from hybrid_engine.tiny_models import build_model

    for load in (lambda cfg: load_config(cfg),
                 lambda cfg: initialize(model=build_model("tiny-gpt2"), config=cfg)[0].config):
        with warnings.catch_warnings(record=True) as caught:
            _python_default_filters()
            cfg = load({"hybrid_engine": {"enable_cuda_graph": True}})
        assert cfg.hybrid_engine.enable_graph_capture is True
        shown = [w for w in caught if "enable_cuda_graph" in str(w.message)]
        assert len(shown) == 1
        assert issubclass(shown[0].category, FutureWarning)
        assert shown[0].filename == __file__


def test_alias_conflict_is_value_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match="enable_cuda_graph") as info:
            load_config({"hybrid_engine": {"enable_cuda_graph": True, "enable_graph_capture": False}})
    assert "enable_graph_capture" in str(info.value)
    assert info.value.__cause__ is not None


def test_alias_absent_from_dumps(tmp_path: pathlib.Path):
    path = tmp_path / "alias.json"
    path.write_text(json.dumps({"hybrid_engine": {"enable_cuda_graph": True}}))
    cfg, _ = _load_recording(path)
    assert "enable_cuda_graph" not in cfg.model_dump()["hybrid_engine"]
    assert "enable_cuda_graph" not in cfg.model_dump_json()
    assert "enable_cuda_graph" not in json.dumps(cfg.to_dict())
    assert cfg.to_dict()["hybrid_engine"]["enable_graph_capture"] is True
    # Re-loading the dump emits no further deprecation.
    _, deps = _load_recording(cfg.to_dict())
    assert deps == []


def test_alias_property_is_deprecated_and_read_only():
    cfg = load_config({"hybrid_engine": {"enable_graph_capture": True}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cfg.hybrid_engine.enable_cuda_graph is True
    assert [w.category for w in caught] == [DeprecationWarning]
    with pytest.raises((AttributeError, ValueError, TypeError)):
        cfg.hybrid_engine.enable_cuda_graph = False


# ------------------------------------------------------------ unknown keys


def test_unknown_hybrid_engine_key_suggests():
    with pytest.raises(ValueError) as info:
        load_config({"hybrid_engine": {"enable_graph_captur": True}})
    msg = str(info.value)
    assert "'enable_graph_captur'" in msg
    assert "hybrid_engine" in msg
    assert "did you mean 'enable_graph_capture'?" in msg


def test_unknown_hybrid_engine_key_without_close_match_lists_valid_keys():
    with pytest.raises(ValueError, match="'frobnicate'") as info:
        load_config({"hybrid_engine": {"frobnicate": 1}})
    assert "max_out_tokens" in str(info.value)


@pytest.mark.parametrize(
    ("typo", "right"),
    [
        ("hybrid_engin", "hybrid_engine"),
        ("zero_optimisation", "zero_optimization"),
        ("gradient_cliping", "gradient_clipping"),
        ("train_micro_batch_size_per_gp", "train_micro_batch_size_per_gpu"),
    ],
)
def test_top_level_typo_suggests(typo, right):
    with pytest.raises(ValueError, match=f"'{typo}'.*did you mean '{right}'"):
        load_config({typo: {}})


def test_unrelated_top_level_keys_are_kept():
    cfg = load_config(
        {"wall_clock_breakdown": True, "my_project_note": "x", "scheduler": {"type": "WarmupLR"}}
    )
    dumped = cfg.to_dict()
    assert dumped["wall_clock_breakdown"] is True
    assert dumped["my_project_note"] == "x"
    assert dumped["scheduler"] == {"type": "WarmupLR"}


def test_zero_extra_keys_pass_through():
    cfg = load_config({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.to_dict()["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


# -------------------------------------------------------- types and ranges


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"hybrid_engine": {"max_out_tokens": 0}}, "hybrid_engine.max_out_tokens"),
        ({"hybrid_engine": {"max_out_tokens": "lots"}}, "hybrid_engine.max_out_tokens"),
        ({"hybrid_engine": {"inference_tp_size": 0}}, "hybrid_engine.inference_tp_size"),
        ({"hybrid_engine": {"tp_gather_partition_size": -3}}, "hybrid_engine.tp_gather_partition_size"),
        ({"hybrid_engine": {"enable_graph_capture": "yes"}}, "hybrid_engine.enable_graph_capture"),
        ({"hybrid_engine": {"enabled": 1}}, "hybrid_engine.enabled"),
        ({"hybrid_engine": True}, "hybrid_engine"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping"),
        ({"steps_per_print": 0}, "steps_per_print"),
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"fp16": {"enabled": True, "initial_scale_power": -1}}, "fp16.initial_scale_power"),
        ({"optimizer": {"params": {}}}, "optimizer.type"),
    ],
)
def test_bad_values_name_the_field(config, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as info:
        load_config(config)
    assert info.value.__cause__ is not None


def test_optimizer_type_is_case_insensitive():
    for spelling, canonical in [("ADAM", "Adam"), ("AdamW", "AdamW"), ("sgd", "SGD")]:
        assert load_config({"optimizer": {"type": spelling}}).optimizer.type == canonical


def test_unknown_optimizer_lists_valid_types():
    with pytest.raises(ValueError, match="Adamm") as info:
        load_config({"optimizer": {"type": "Adamm"}})
    for name in ("AdamW", "Adam", "SGD", "lion", "lamb"):
        assert name in str(info.value)


def test_deepspeed_optimizers_are_accepted_for_deepspeed_to_build_and_refused_at_stage_0():
    # At ZeRO 1-3 DeepSpeed builds the optimizer (Lion, Lamb, Adagrad...); stage 0 builds torch's only.
    assert load_config({"optimizer": {"type": "Lion"}}).optimizer.type == "Lion"
    from hybrid_engine import initialize
    from hybrid_engine.tiny_models import build_model

    with pytest.raises(ValueError, match=r"'Adagrad' is built by DeepSpeed, at zero_optimization.stage 1-3"):
        initialize(model=build_model("tiny-gpt2"), config={"optimizer": {"type": "Adagrad"}})


@pytest.mark.parametrize("config,match", [
    ({"bf16": {"enable": True}}, r"unknown bf16 key 'enable'; did you mean 'enabled'"),
    ({"fp16": {"enabled": True, "loss_scal": 128}}, r"unknown fp16 key 'loss_scal'; did you mean 'loss_scale'"),
    ({"zero_optimization": {"stgae": 2}}, r"unknown zero_optimization key 'stgae'; did you mean 'stage'"),
])
def test_typos_inside_the_precision_and_zero_sections_are_refused(config, match):
    # Each would otherwise train silently in fp32 or at stage 0.
    with pytest.raises(ValueError, match=match):
        load_config(config)
    # DeepSpeed's own keys of those sections are accepted.
    load_config({"fp16": {"enabled": True, "loss_scale_window": 100, "hysteresis": 2, "min_loss_scale": 1},
                 "bf16": {"immediate_grad_update": False},
                 "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8}})


def test_bf16_accepts_every_key_of_deepspeeds_bf16_and_fp16_models():
    precision_config = pytest.importorskip("deepspeed.runtime.precision_config")
    for section, model in (("bf16", precision_config.DeepSpeedBF16Config),
                           ("fp16", precision_config.DeepSpeedFP16Config)):
        for key, field in model.model_fields.items():
            # Its default is accepted at any stage (stage 0 included: a default changes nothing there).
            for stage in (0, 2):
                cfg = load_config({"zero_optimization": {"stage": stage}, section: {key: field.default}})
                assert cfg.to_dict()[section][key] == field.default


def test_bf16_zero_only_keys_pass_through_at_zero_and_are_refused_at_stage_0():
    section = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    cfg = load_config({"zero_optimization": {"stage": 2}, "bf16": section})
    assert cfg.bf16.enabled is True
    assert {k: cfg.to_dict()["bf16"][k] for k in section} == section  # handed on to DeepSpeed
    for key in ("bf16_master_weights_and_grads", "immediate_grad_update"):
        with pytest.raises(ValueError, match=rf"bf16\.{key}=True needs zero_optimization\.stage >= 1"):
            load_config({"bf16": {"enabled": True, key: True}})
    with pytest.raises(ValueError, match=r"fp16\.auto_cast=True needs zero_optimization\.stage >= 1"):
        load_config({"fp16": {"enabled": True, "auto_cast": True}})
    with pytest.raises(ValueError, match=r"bf16_optimizer_states needs bf16\.bf16_master_weights_and_grads"):
        load_config({"zero_optimization": {"stage": 1}, "bf16": {"bf16_optimizer_states": True}})
    with pytest.raises(ValueError, match=r"bf16\.bf16_master_weights_and_grads must be true or false"):
        load_config({"zero_optimization": {"stage": 1}, "bf16": {"bf16_master_weights_and_grads": "yes"}})


def test_legacy_bfloat16_section_is_bf16():
    cfg = load_config({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled is True
    assert "bfloat16" not in cfg.to_dict() and cfg.to_dict()["bf16"]["enabled"] is True
    with pytest.raises(ValueError, match="unknown bf16 key 'enable'"):
        load_config({"bfloat16": {"enable": True}})
    with pytest.raises(ValueError, match=r"both bf16 and bfloat16 .* remove bfloat16"):
        load_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    with pytest.raises(ValueError, match="fp16.enabled and bf16.enabled"):
        load_config({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_fp16_and_bf16_conflict():
    with pytest.raises(ValueError, match="fp16.*bf16"):
        load_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert load_config({"bf16": {"enabled": True}}).bf16.enabled


# ------------------------------------------------------------ batch sizes


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 8)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, (32, 8, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (12, 4, 3)),
        ({"train_batch_size": 16}, (16, 16, 1)),
        ({"train_micro_batch_size_per_gpu": 2}, (2, 2, 1)),
        (
            {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 8},
            (24, 3, 8),
        ),
    ],
)
def test_batch_size_derivation(given, expected):
    cfg = load_config(given)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected


@pytest.mark.parametrize(
    "given",
    [
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        {"train_batch_size": 30, "gradient_accumulation_steps": 4},
    ],
)
def test_batch_size_inconsistency(given):
    with pytest.raises(ValueError, match="train_batch_size") as info:
        load_config(given)
    msg = str(info.value)
    assert "train_micro_batch_size_per_gpu" in msg or "gradient_accumulation_steps" in msg


@pytest.mark.parametrize(
    ("given", "match"),
    [
        # DeepSpeed: micro = 3 // 2 = 1, then "3 != 1 * 1 * 2"; and micro 1 // 2 = 0, "has to be greater than 0".
        ({"train_batch_size": 3}, r"train_batch_size \(3\) is not divisible by world_size \(2\).* = 1\b"),
        ({"train_batch_size": 1}, r"train_batch_size \(1\) is not divisible by world_size \(2\).* = 0\b"),
        ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2},
         r"train_micro_batch_size_per_gpu \(2\) \* world_size \(2\)"),
        ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2},
         r"train_micro_batch_size_per_gpu \(2\) \* world_size \(2\)"),
        ({"train_batch_size": 6, "gradient_accumulation_steps": 2},
         r"gradient_accumulation_steps \(2\) \* world_size \(2\)"),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
         r"world_size \(2\) = 16"),
    ],
)
def test_batch_sizes_follow_deepspeeds_rules_on_every_branch(given, match):
    with pytest.raises(ValueError, match=match):
        load_config(given, world_size=2)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"train_batch_size": 4}, (4, 2, 1)),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, (8, 2, 2)),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, (8, 2, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, (12, 3, 2)),
        ({"train_micro_batch_size_per_gpu": 3}, (6, 3, 1)),
        ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, (12, 3, 2)),
    ],
)
def test_batch_size_derivation_on_two_ranks(given, expected):
    cfg = load_config(given, world_size=2)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected
    assert got[0] == got[1] * got[2] * 2


# ------------------------------------------------------- graph capture gate


def test_graph_capture_requested():
    assert graph_capture_requested({}) is False
    assert graph_capture_requested({"hybrid_engine": {"enable_graph_capture": True}}) is True


def test_hybrid_engine_enabled_false_turns_graph_capture_off():
    # As in DeepSpeed, hybrid_engine.enabled: false switches the hybrid engine (here: its graphs) off.
    config = {"hybrid_engine": {"enabled": False, "enable_graph_capture": True}}
    with pytest.warns(UserWarning, match=r"hybrid_engine\.enabled is false.*enable_graph_capture=true is ignored"):
        cfg = load_config(config)
    assert cfg.hybrid_engine.enable_graph_capture is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert graph_capture_requested(config) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config({"hybrid_engine": {"enabled": False}}).hybrid_engine.enable_graph_capture is False
        # The settled config loads back the same, with no further warning.
        assert load_config(cfg).hybrid_engine.enable_graph_capture is False
        assert load_config(cfg.to_dict()).hybrid_engine.enable_graph_capture is False
        # enabled left out: enable_graph_capture alone still captures, and its dump loads back the same.
        on = load_config({"hybrid_engine": {"enable_graph_capture": True}})
        assert on.hybrid_engine.enable_graph_capture is True and on.hybrid_engine.enabled is True
        assert load_config(on).hybrid_engine.enable_graph_capture is True
        assert load_config(json.loads(on.model_dump_json())).hybrid_engine.enable_graph_capture is True
        assert load_config({}).hybrid_engine.enabled is False


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_graph_capture_allowed(stage):
    cfg = {"zero_optimization": {"stage": stage}, "hybrid_engine": {"enable_graph_capture": True}}
    assert validate_graph_capture_support(cfg, CPUAccelerator()) is None
    assert validate_graph_capture_support(load_config(cfg), CPUAccelerator()) is None


def _assert_sentence(reason):
    assert isinstance(reason, str)
    assert reason[0].isupper() and reason.rstrip().endswith(".")
    return reason


def test_refuses_when_accelerator_cannot_capture():
    acc = CPUAccelerator(emulate_graphs=False)
    reason = _assert_sentence(validate_graph_capture_support({}, acc))
    assert acc.graph_unavailable_reason in reason


def test_refuses_zero_stage_3():
    reason = _assert_sentence(
        validate_graph_capture_support({"zero_optimization": {"stage": 3}}, CPUAccelerator())
    )
    assert "ZeRO" in reason and "3" in reason


def test_graphs_at_zero_3_imply_the_gathered_inference_copy_unless_it_is_given():
    def copy(stage: int, **he) -> bool:
        return load_config({"zero_optimization": {"stage": stage}, "hybrid_engine": he}).hybrid_engine \
            .zero3_gathered_inference_copy

    assert copy(3, enable_graph_capture=True)  # DeepSpeed-Chat's config: the graph flag alone
    assert validate_graph_capture_support(
        {"zero_optimization": {"stage": 3}, "hybrid_engine": {"enable_graph_capture": True}}, CPUAccelerator()) is None
    assert not copy(3, enable_graph_capture=True, zero3_gathered_inference_copy=False)  # given: kept
    assert not copy(3)  # no graphs asked for: no copy
    with pytest.warns(UserWarning, match="enabled is false"):  # DeepSpeed's switch off: no graphs, no copy
        assert not copy(3, enabled=False, enable_graph_capture=True)
    assert not copy(2, enable_graph_capture=True)  # whole parameters below ZeRO-3
    # Implied, not given: a reload (load_config of the object, the engine's own path) implies it again, and
    # neither it nor the implied ``enabled`` (which would route the model's generate) becomes "given".
    cfg = load_config({"zero_optimization": {"stage": 3}, "hybrid_engine": {"enable_graph_capture": True}})
    again = load_config(cfg)
    assert again.hybrid_engine.zero3_gathered_inference_copy and again.hybrid_engine.enabled
    assert {"zero3_gathered_inference_copy", "enabled"}.isdisjoint(again.hybrid_engine.model_fields_set)
    cfg.zero_optimization.stage = 2  # mutated after loading: checked again, nothing implied below ZeRO-3
    assert not load_config(cfg).hybrid_engine.zero3_gathered_inference_copy


def test_refuses_release_inference_cache_only_where_the_pool_cannot_sleep_at_fixed_addresses(monkeypatch):
    cfg = {"hybrid_engine": {"release_inference_cache": True}}
    assert validate_graph_capture_support(cfg, CPUAccelerator()) is None  # the CPU: the hand-off, graphs kept
    monkeypatch.setattr(kv_storage, "supports_release", lambda device: False)  # stand-in: a device without releasable storage
    reason = _assert_sentence(validate_graph_capture_support(cfg, CPUAccelerator()))
    assert "release_inference_cache" in reason


def test_refuses_tensor_parallel_inference(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = {"hybrid_engine": {"inference_tp_size": 2}}
    reason = _assert_sentence(validate_graph_capture_support(cfg, CPUAccelerator()))
    assert "inference_tp_size" in reason


def test_refusals_checked_in_order(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    everything = {
        "zero_optimization": {"stage": 3},
        "hybrid_engine": {"release_inference_cache": True, "inference_tp_size": 4},
    }
    assert "cannot capture" in validate_graph_capture_support(
        everything, CPUAccelerator(emulate_graphs=False)
    )
    assert "ZeRO" in validate_graph_capture_support(everything, CPUAccelerator())
    everything["zero_optimization"]["stage"] = 2
    monkeypatch.setattr(kv_storage, "supports_release", lambda device: False)  # stand-in: a device without releasable storage
    assert "release_inference_cache" in validate_graph_capture_support(everything, CPUAccelerator())


def test_gate_ignores_enable_flag_and_uses_process_accelerator():
    from hybrid_engine.accelerator import get_accelerator, set_accelerator

    previous = get_accelerator()
    try:
        set_accelerator(CPUAccelerator(emulate_graphs=False))
        assert validate_graph_capture_support({"hybrid_engine": {"enable_graph_capture": False}}) is not None
        set_accelerator(CPUAccelerator())
        assert validate_graph_capture_support({"hybrid_engine": {"enable_graph_capture": False}}) is None
    finally:
        set_accelerator(previous)


def test_gate_does_not_compare_device_names():
    class Renamed(CPUAccelerator):
        _name = "cuda"  # a name alone must not change the verdict

    assert validate_graph_capture_support({}, Renamed(emulate_graphs=True)) is None
    assert validate_graph_capture_support({}, Renamed(emulate_graphs=False)) is not None


def test_gate_rejects_bad_config():
    with pytest.raises(ValueError, match="hybrid_engine"):
        validate_graph_capture_support({"hybrid_engin": {}}, CPUAccelerator())


def test_inference_tp_size_beyond_the_world_size_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_config({"hybrid_engine": {"inference_tp_size": 2}}).hybrid_engine.inference_tp_size == 2
    with pytest.raises(ValueError, match=r"inference_tp_size \(4\) is larger than the world size \(2\)"):
        load_config({"hybrid_engine": {"inference_tp_size": 4}})
    with pytest.raises(ValueError, match=r"world size \(1\)"):
        load_config({"hybrid_engine": {"inference_tp_size": 2}}, world_size=1)


def test_batch_sizes_are_checked_against_the_launched_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    assert cfg.train_batch_size == 12
    assert load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}).gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match=r"must equal .* world_size \(2\) = 8"):
        load_config({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE environment variable must be an integer"):
        load_config({})


def test_zero_stage_beyond_three_names_the_stages():
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3 \(got 4\)"):
        load_config({"zero_optimization": {"stage": 4}})


# ------------------------------------------------- what a config path may be


@pytest.fixture
def hang_guard():
    """Fail, instead of hanging the suite, if a read blocks (a FIFO opened for reading waits for a writer)."""
    import signal

    def timed_out(signum, frame):
        raise TimeoutError("load_config blocked")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_as_the_config_path_is_refused_without_blocking(tmp_path, hang_guard):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifo = tmp_path / "ds_config.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=rf"config path {re.escape(str(fifo))} is a FIFO \(named pipe\)"):
        load_config(fifo)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_devices_as_the_config_path_are_refused_by_name(device, hang_guard):
    """/dev/zero and /dev/urandom ran to MemoryError; /dev/null loaded as the default config."""
    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    with pytest.raises(ValueError, match=rf"config path {device} is a character device"):
        load_config(device)


@pytest.mark.parametrize("text", ["", "  \n\t\n"])
def test_an_empty_config_file_is_an_error_not_the_default_config(tmp_path, text):
    path = tmp_path / "empty.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"config file {re.escape(str(path))} is empty.*not the default config"):
        load_config(path)
    path.write_text("{}")  # the defaults, asked for
    assert load_config(path) == load_config({})


def test_a_config_file_past_the_size_cap_is_refused_before_it_is_parsed(tmp_path):
    from hybrid_engine.config.loading import MAX_CONFIG_BYTES

    path = tmp_path / "huge.json"
    path.write_text('{"my_note": "' + "x" * (MAX_CONFIG_BYTES - 16) + '"}')
    assert load_config(path).to_dict()["my_note"].startswith("x")  # within the cap: read
    path.write_text('{"my_note": "' + "x" * MAX_CONFIG_BYTES + '"}')
    with pytest.raises(ValueError, match=r"huge\.json is larger than 4 MiB"):
        load_config(path)


@pytest.mark.parametrize("depth", [40, 500, 100_000])
def test_a_deeply_nested_config_is_refused_cleanly(tmp_path, depth):
    """100,000 levels were a RecursionError in the JSON parser; 500 one in validation."""
    path = tmp_path / "deep.json"
    path.write_text('{"scheduler": {"params": ' + '{"a": ' * depth + "1" + "}" * depth + "}}")
    with pytest.raises(ValueError, match=r"deep\.json nests objects or lists (more than 32|deeper than can be parsed)"):
        load_config(path)
    nested: dict = {}
    inner = nested
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ValueError, match="the config nests objects or lists more than 32 deep"):
        load_config({"scheduler": nested})


def test_nesting_within_the_limit_loads(tmp_path):
    path = tmp_path / "nested.json"
    path.write_text('{"my_note": ' + "[" * 31 + "]" * 31 + "}")  # 32 levels: the object and 31 lists
    note = load_config(path).to_dict()["my_note"]
    for _ in range(30):
        (note,) = note
    assert note == []


# ------------------------------------------- absurd and non-finite values


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("config,match", [
    ({"fp16": {"loss_scale": INF}}, r"fp16\.loss_scale must be between 2\*\*-24 and 2\*\*32 \(0 means dynamic\), got inf"),
    ({"fp16": {"loss_scale": 1e-45}}, r"fp16\.loss_scale must be between .* got 1e-45"),
    ({"fp16": {"min_loss_scale": INF}}, r"fp16\.min_loss_scale must be between 2\*\*-24 and 2\*\*32, got inf"),
    ({"fp16": {"min_loss_scale": 1e-45}}, r"fp16\.min_loss_scale must be between"),
    ({"fp16": {"initial_scale_power": 10000}}, r"fp16\.initial_scale_power must be at most 32, got 10000"),
    ({"fp16": {"initial_scale_power": 200}}, r"fp16\.initial_scale_power must be at most 32, got 200"),
    ({"fp16": {"initial_scale_power": 4, "min_loss_scale": 32}}, r"fp16\.min_loss_scale \(32\) is above the dynamic "
                                                                r"scale's start, 2\*\*fp16\.initial_scale_power = 16"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": INF}}}, r"optimizer\.params\.lr=inf: every number in "
                                                              r"optimizer\.params must be finite"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": NAN}}}, r"optimizer\.params\.lr=nan"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 1e308}}}, r"optimizer\.params\.lr must be between 0 and 10, "
                                                              r"got 1e\+308"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, r"optimizer\.params\.lr must be between 0 and 10"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": INF}}}, r"optimizer\.params\.weight_decay=inf"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}}, r"optimizer\.params\.weight_decay must be "
                                                                         r"a number >= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 10}}}, r"lr \(0\.1\) \* weight_decay "
                                                                                  r"\(10\) = 1 is >= 1"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, INF]}}}, r"optimizer\.params\.betas\[1\]=inf"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, r"optimizer\.params\.betas\[1\] must be a "
                                                                        r"number in \[0, 1\)"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}}, r"optimizer\.params\.eps must be a number >= 0"),
    ({"optimizer": {"type": "Lion", "params": {"lr": INF}}}, r"optimizer\.params\.lr=inf"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": NAN}}}, r"scheduler\.params\.warmup_max_lr=nan"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e308}}}, r"scheduler\.params\.warmup_max_lr "
                                                                              r"must be between 0 and 10"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": INF}}},
     r"scheduler\.params\.cycle_max_lr=inf"),
    ({"scheduler": {"type": "StepLR", "params": {"step_size": 0}}}, r"scheduler\.params\.step_size must be an int "
                                                                    r">= 1 for StepLR, got 0"),
    ({"scheduler": {"type": "CosineAnnealingLR", "params": {"T_max": 0}}}, r"scheduler\.params\.T_max must be an int "
                                                                           r">= 1 for CosineAnnealingLR"),
    ({"scheduler": {"type": "LRScheduler"}}, r"scheduler\.type 'LRScheduler' is torch's abstract base class"),
    ({"scheduler": {"type": "_LRScheduler", "params": {}}}, r"scheduler\.type '_LRScheduler' is torch's abstract"),
    ({"gradient_clipping": INF}, r"gradient_clipping: Input should be a finite number"),
    ({"gradient_clipping": NAN}, r"gradient_clipping: Input should be a finite number"),
    ({"hybrid_engine": {"max_out_tokens": 10**30}}, r"hybrid_engine\.max_out_tokens must be at most 16777216"),
])
@pytest.mark.parametrize("stage", [0, 2])
def test_non_finite_and_absurd_values_are_refused_by_name_at_every_stage(config, match, stage):
    """Each was accepted without a word: NaN weights (lr inf or 1e308, weight_decay inf, warmup_max_lr NaN),
    every step skipped (loss_scale inf or 1e-45, min_loss_scale inf), or an error at the first step. At ZeRO 1-3
    DeepSpeed builds and steps the optimizer and scheduler, so the config is all there is to check."""
    with pytest.raises(ValueError, match=match):
        load_config({**config, "zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("config", [
    {"fp16": {"enabled": True, "loss_scale": 2.0**32}},
    {"fp16": {"enabled": True, "loss_scale": 2.0**-24}},
    {"fp16": {"enabled": True, "initial_scale_power": 32, "min_loss_scale": 2.0**32}},
    {"fp16": {"enabled": True, "initial_scale_power": 0}},
    {"optimizer": {"type": "SGD", "params": {"lr": 10, "weight_decay": 0.099}}},
    {"optimizer": {"type": "AdamW", "params": {"lr": 0, "betas": [0, 0.999], "eps": 0, "weight_decay": 0.1}}},
    {"scheduler": {"type": "StepLR", "params": {"step_size": 1}}},
    {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 10, "warmup_num_steps": 1}}},
    {"gradient_clipping": 0.0},
    {"hybrid_engine": {"max_out_tokens": 2**24}},
])
def test_values_at_the_bounds_are_accepted(config):
    load_config(config)
