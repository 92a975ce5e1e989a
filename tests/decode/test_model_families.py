"""Families beyond the six tiny ones: windows and chunks masked, no silent drift, clear refusals (issue 28).

Each model is built from a tiny seeded config of transformers' own class (no network). Sliding-window and
chunked layers are masked per layer kind as transformers masks them, so sequences longer than the window
decode with graphs and equal transformers' ``generate``. Where a family's length limit cannot be masked
(GPT-Neo's local layers, longrope's switch of factors), a longer sequence is refused by the rollout and
handed to transformers by ``engine.generate``; within it the tokens equal transformers'.

On transformers 4.57 the same file asserts what a user gets there: a family 4.57 lacks is skipped naming the
version; where 4.57's own modeling code cannot be captured (MoE routing with nonzero()/torch.where, Gemma 2's
host-tensor normalizer), one GraphRefusedWarning names its file and line and the call runs eagerly with the same
tokens; state-layer families (4.57 has no linear-attention cache API) are refused by name, and ``engine.generate``
hands them to transformers. Each such branch is taken by detecting the capability (or by the version, where
detection is not cheap), so the newer versions' assertions stay as they were.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from sampled_close import assert_rollouts_sampled_close
from tiers import fast_first
from transformers import AutoConfig, AutoModelForCausalLM, cache_utils
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hybrid_engine import initialize
from hybrid_engine.decode.kv_pool import LayerSpec
from hybrid_engine.decode.layout import (
    attention_layers,
    exact_length,
    layer_specs,
    layout_refusal,
    linear_layers,
)
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.rollout import (
    HybridEngineRollout,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
    UnsupportedModelError,
)

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)

#: model_type -> (config fields, the limit's words, its tokens): what the cache's masks cannot carry. GPT-Neo's
#: local layers apply their window from the key count the cache returns, not from positions.
LIMITED = {
    "gpt_neo": (dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                     window_size=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2),
                "local attention layers (window_size 8)", 8),
    "phi3": (dict(SMALL, num_key_value_heads=2, original_max_position_embeddings=16,
                  rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}),
             "longrope RoPE scaling (its factors switch past original_max_position_embeddings 16)", 16),
}


#: transformers 5.25 rewrote LongCat's experts (transformers' experts implementations, no nonzero() loop) and
#: Falcon's attention (no host tensor in ``_split_heads``): both capture from then on.
TF_5_25 = Version(transformers.__version__) >= Version("5.25.0")
#: The 4.x line the project supports (transformers >= 4.57): its LongCat caches per-head K and V (no latent).
TF_4_57 = Version(transformers.__version__) < Version("5")
#: transformers' linear-attention cache API, through which the engine holds state layers (5.x); 4.57's state
#: models keep their states in cache classes of their own, so the engine refuses them there.
LINEAR_CACHE_API = hasattr(cache_utils, "LinearAttentionCacheLayerMixin")


def tiny(model_type: str, **fields) -> torch.nn.Module:
    if TF_4_57 and model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model_type {model_type!r} (added in 5.x)")
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **fields)
    return AutoModelForCausalLM.from_config(config).eval()


def prompts(batch: int = 2, width: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, 128, (batch, width), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones_like(ids)


def hf_greedy(model, ids, mask, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0, eos_token_id=-1)  # nothing suppressed


def rollout_tokens(model, ids, mask, new: int, graphs: bool, capacity: int | None = None) -> torch.Tensor:
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, cache_capacity=capacity,
                                                              pad_token_id=0, eos_token_id=10**6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)  # some families' own code cannot be captured
        batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=new, temperature=0.0))
    return batch.input_ids


def experts_implemented(model: torch.nn.Module) -> bool:
    """Whether the model's MoE experts dispatch through transformers' experts implementations (5.x's
    ``use_experts_implementation``: batched, captured); 4.57's loops pick each expert's tokens with
    nonzero()/torch.where, which no capture can record."""
    # the decorator's forward (functools.wraps keeps the class's names; its code stays in integrations/moe.py)
    return any(Path(type(m).forward.__code__.co_filename).parts[-2:] == ("integrations", "moe.py")
               for m in model.modules() if hasattr(type(m).forward, "__code__"))


#: model_type -> (whether the installed transformers' modeling code captures, where 4.57's refuses: its file,
#: function and line). Gemma 2 scales its embeddings by a buffer in 5.x; 4.57 builds a host tensor per forward.
OWN_CODE: dict[str, tuple[Callable[[torch.nn.Module], bool], str]] = {
    "deepseek_v2": (experts_implemented, r"models/deepseek_v2/modeling_deepseek_v2\.py:\d+ in moe: `if num_tokens == 0:`"),
    "deepseek_v3": (experts_implemented, r"models/deepseek_v3/modeling_deepseek_v3\.py:\d+ in moe: "
                                         r"`token_indices, weight_indices = torch\.where\(mask\)`"),
    "gpt_oss": (experts_implemented, r"models/gpt_oss/modeling_gpt_oss\.py:\d+ in forward: `expert_hit = .*\.nonzero\(\)`"),
    "gemma2": (lambda m: hasattr(m.get_input_embeddings(), "embed_scale"),
               r"models/gemma2/modeling_gemma2\.py:\d+ in forward: `normalizer = torch\.tensor\("),
}


def own_code_refusal(model: torch.nn.Module) -> str | None:
    """Where the installed transformers' code for ``model`` refuses capture (a regex), ``None`` where it captures."""
    captures, where = OWN_CODE.get(model.config.model_type, (lambda m: True, ""))
    return None if captures(model) else where


def graph_refusals(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, GraphRefusedWarning)]


def assert_refused_where_own_code_is(model: torch.nn.Module, record: list[warnings.WarningMessage]) -> None:
    """Where the installed transformers' code for ``model`` cannot be captured, the graphed call that ``record``
    watched warned exactly once, naming that code, and went on eagerly (nothing checked where it captures)."""
    where = own_code_refusal(model)
    if where is not None:
        [warned] = graph_refusals(record)
        assert re.search(where, warned) and "continues eagerly" in warned


def assert_decodes_as_transformers(model, ids, mask, new: int, max_out_tokens: int) -> torch.Tensor:
    """Greedy rollouts (graphs off and on) and ``engine.generate`` with graphs replayed equal transformers'
    ``generate``; returns its tokens. Where transformers' own code cannot be captured (4.57), ``engine.generate``
    warns once naming it, runs eagerly and counts a fallback: the same tokens."""
    want = hf_greedy(model, ids, mask, new)
    for graphs in (False, True):
        assert torch.equal(rollout_tokens(model, ids, mask, new, graphs), want)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True,
                                                                   "max_out_tokens": max_out_tokens}})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = engine.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0, eos_token_id=-1)
    assert torch.equal(out, want)
    if own_code_refusal(model) is None:
        assert engine.graph_stats.last_refusal_reason is None and engine.graph_stats.replays > 0
    else:
        assert engine.graph_stats.fallbacks > 0 and engine.graph_stats.replays == 0
    assert_refused_where_own_code_is(model, record)
    return want


def assert_state_layers_refused(model, ids, mask, new: int) -> None:
    """Without transformers' linear-attention cache API (4.57) a state-layer family is refused by name, saying
    it needs transformers >= 5, and ``engine.generate`` hands it to transformers: one warning, the same tokens."""
    assert not LINEAR_CACHE_API and TF_4_57  # 5.x must decode them (the callers' other branch)
    model_type = model.config.model_type
    needs = rf"model_type '{model_type}' has state layers .*needs transformers >= 5; transformers " \
            rf"{re.escape(transformers.__version__)} has none"
    with pytest.raises(UnsupportedModelError, match=needs):
        rollout_tokens(model, ids, mask, new, graphs=True)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = engine.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0, eos_token_id=-1)
    [warned] = graph_refusals(record)
    assert re.search(needs, warned) and "delegated to transformers' generate" in warned
    assert torch.equal(out, hf_greedy(model, ids, mask, new))


@pytest.mark.parametrize("model_type", sorted(LIMITED))
def test_a_window_chunk_or_rope_switch_is_read_from_the_config_that_sets_it(model_type):
    fields, why, tokens = LIMITED[model_type]
    assert exact_length(tiny(model_type, **fields).config) == (tokens, why)


@pytest.mark.parametrize("model_type", sorted(LIMITED))
def test_within_the_limit_tokens_equal_transformers_and_past_it_the_rollout_refuses_by_name(model_type):
    """Before, gpt_neo's local layers were ignored: tokens differed from transformers' past the window."""
    fields, why, limit = LIMITED[model_type]
    model = tiny(model_type, **fields)
    ids, mask = prompts()
    within = limit - ids.shape[1]
    want = hf_greedy(model, ids, mask, within)
    for graphs in (False, True):
        assert torch.equal(rollout_tokens(model, ids, mask, within, graphs), want)
    with pytest.raises(ValueError, match=rf"{why.split(' (')[0]} .*exact only up to {limit} tokens.*lower "
                                         "max_new_tokens"):
        rollout_tokens(model, ids, mask, within + 4, graphs=True)
    with pytest.raises(ValueError, match=rf"cache_capacity=64 is more than the {limit} tokens"):
        rollout_tokens(model, ids, mask, within, graphs=True, capacity=64)
    assert torch.equal(rollout_tokens(model, ids, mask, within, graphs=True), want)  # still usable


@pytest.mark.parametrize("model_type", sorted(LIMITED))
def test_engine_generate_past_the_limit_is_handed_to_transformers_with_the_reason(model_type):
    fields, why, limit = LIMITED[model_type]
    model = tiny(model_type, **fields)
    ids, mask = prompts()
    new = limit + 6  # past the window / chunk / switch
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True,
                                                                   "max_out_tokens": 64}})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = engine.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0, eos_token_id=-1)
    assert torch.equal(out, hf_greedy(model, ids, mask, new))
    assert why in engine.graph_stats.last_refusal_reason
    assert f"max_out_tokens to at most {limit}" in engine.graph_stats.last_refusal_reason
    assert sum(issubclass(w.category, GraphRefusedWarning) for w in rec) == 1


def test_unsupported_state_models_are_refused_by_name_and_generate_hands_them_to_transformers():
    """Mamba raised AttributeError ('MambaConfig' object has no attribute 'num_attention_heads'); it runs now
    (below). xLSTM, which lists no layer kinds, and MiniMax, whose lightning attention keeps a cache of its own,
    are refused in one sentence; engine.generate hands MiniMax to transformers."""
    xlstm = tiny("xlstm", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    ids, mask = prompts()
    with pytest.raises(UnsupportedModelError, match="model_type 'xlstm' .*state.* the paged K/V cache does not hold"):
        rollout_tokens(xlstm, ids, mask, 4, graphs=True)
    model = tiny("minimax", **LINEAR_FIELDS, num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(UnsupportedModelError, match="model_type 'minimax' has layers of kind 'linear_attention'"):
        rollout_tokens(model, ids, mask, 4, graphs=True)
    engine, *_ = initialize(model=model, config={"hybrid_engine": {"enable_graph_capture": True}})
    with pytest.warns(GraphRefusedWarning, match="model_type 'minimax'"):
        out = engine.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                              min_new_tokens=4, pad_token_id=0, eos_token_id=-1)
    assert torch.equal(out, hf_greedy(model, ids, mask, 4))


def test_falcon_7b_multi_query_layout_caches_one_kv_head_and_matches_transformers():
    """It was refused: '(1, 1, 1, 8) do not match the cache layout' (the cache had one K/V head per query head)."""
    model = tiny("falcon", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 multi_query=True, new_decoder_architecture=False, alibi=False, max_position_embeddings=128,
                 bos_token_id=1, eos_token_id=2)
    ids, mask = prompts()
    want = hf_greedy(model, ids, mask, 12)
    for graphs in (False, True):
        assert torch.equal(rollout_tokens(model, ids, mask, 12, graphs), want)


@pytest.mark.parametrize("model_type,fields", [
    ("falcon", dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True)),
    ("bloom", dict(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)),
])
def test_alibi_models_are_refused_in_one_sentence_naming_alibi(model_type, fields):
    model = tiny(model_type, **fields)
    ids, mask = prompts()
    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}' uses ALiBi position biases"):
        rollout_tokens(model, ids, mask, 4, graphs=False)


MLA = dict(SMALL, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
           moe_intermediate_size=16)


@pytest.mark.parametrize("model_type,extra", [
    ("deepseek_v3", MOE), ("deepseek_v2", MOE), ("minicpm3", {}), ("glm4_moe_lite", MOE)])
def test_multi_head_latent_attention_runs_on_the_pool_with_graphs_and_matches_transformers(model_type, extra):
    """It was refused: K and V of different shapes did not fit one per-layer layout. transformers 5.x caches the
    compressed latent (kv_lora_rank) and the rotated key part (qk_rope_head_dim), one head each."""
    model = tiny(model_type, **{**MLA, **extra})
    specs = set(layer_specs(model.config))
    assert specs in ({LayerSpec(1, 16, 4)}, {LayerSpec(4, 12, 6)})  # latent, or per-head K and V
    ids, mask = prompts()
    assert_decodes_as_transformers(model, ids, mask, 12, max_out_tokens=32)


def test_longcat_runs_its_latent_on_the_pool_and_its_expert_routing_is_named_where_it_cannot_be_captured():
    """LongCat's MoE picks experts with nonzero() (a data-dependent shape): eager, same tokens, one warning.
    transformers 4.57's LongCat caches per-head K and V (its routing: torch.where in ``moe``)."""
    model = tiny("longcat_flash", **{**MLA, "q_lora_rank": 16, "n_routed_experts": 4, "moe_topk": 2,
                                     "expert_ffn_hidden_size": 16, "ffn_hidden_size": 64, "zero_expert_num": 1,
                                     "num_layers": 2, "head_dim": 4})
    assert set(layer_specs(model.config)) == ({LayerSpec(4, 12, 6)} if TF_4_57 else {LayerSpec(1, 16, 4)})
    ids, mask = prompts()
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10**6))
    if TF_5_25:  # its experts go through transformers' experts implementation: captured like any MoE
        with warnings.catch_warnings():
            warnings.simplefilter("error", GraphRefusedWarning)
            batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=12, temperature=0.0))
        assert rollout.last_stats["graph_replays"] > 0 and rollout.last_stats["fallbacks"] == 0
    else:
        where = (r"in moe: `token_indices, weight_indices = torch\.where\(mask\)`" if TF_4_57 else
                 r"in forward: `expert_hit = .*nonzero")
        with pytest.warns(GraphRefusedWarning, match=rf"models/longcat_flash/modeling_longcat_flash\.py:\d+ {where}"):
            batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=12, temperature=0.0))
        assert rollout.last_stats["fallbacks"] > 0
    assert torch.equal(batch.input_ids, hf_greedy(model, ids, mask, 12))


WIN = dict(SMALL, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=256)
#: model_type -> config fields with a window or chunk of 8 tokens, on some layers or on all
WINDOWED = {
    "mistral": dict(WIN, sliding_window=8),
    "starcoder2": dict(WIN, sliding_window=8),
    "phi3": dict(WIN, sliding_window=8),
    "qwen2": dict(WIN, use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "gemma2": dict(WIN, sliding_window=8, head_dim=8),
    "gemma3_text": dict(WIN, sliding_window=8, head_dim=8, sliding_window_pattern=2),
    "cohere2": dict(WIN, sliding_window=8),
    "gpt_oss": dict(WIN, sliding_window=8, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(WIN, attention_chunk_size=8, head_dim=8, intermediate_size_mlp=64, num_local_experts=2),
}


@pytest.mark.parametrize("model_type", fast_first(sorted(WINDOWED), keep=2))
def test_sliding_and_chunked_layers_are_masked_as_transformers_masks_them_with_graphs(model_type):
    """Before, llama4's chunks were ignored (tokens differed from transformers') and any sliding window
    shorter than the cache was refused. 12-token prompts (one left-padded) plus 30 tokens, windows of 8."""
    fields = WINDOWED[model_type]
    model = tiny(model_type, **fields)
    assert exact_length(model.config) is None
    ids, mask = prompts(3, 12)
    ids[1, :3], mask[1, :3] = 0, 0
    want = assert_decodes_as_transformers(model, ids, mask, 30, max_out_tokens=64)
    wide = {k: 256 for k in ("sliding_window", "attention_chunk_size") if k in fields}  # the same weights
    with torch.no_grad():  # the window changes the logits over these sequences
        drift = model(want).logits - tiny(model_type, **{**fields, **wide})(want).logits
    assert float(drift.abs().max()) > 1e-3


def test_windowed_layers_keep_a_ring_of_their_window_per_row_once_rows_reach_past_twice_it():
    """Before, a windowed layer held every page of its row, as a full layer does. gpt-oss: a window of 8 on
    half its layers; tokens past the window equal transformers' (above, with rings); here, what they hold."""
    model = tiny("gpt_oss", **WINDOWED["gpt_oss"])
    assert [s.ring for s in layer_specs(model.config, capacity=64)] == [8, None, 8, None]
    assert [s.ring for s in layer_specs(model.config, capacity=15)] == [None] * 4  # rows shorter than 2 windows
    ids, mask = prompts(3, 12)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10**6))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=40, temperature=0.0))
    assert torch.equal(batch.input_ids, hf_greedy(model, ids, mask, 40))
    assert_refused_where_own_code_is(model, record)
    pool, slots = rollout.runner.kv_pool, rollout.runner.slots
    full = [s for s in pool.layers if not s.ring]
    assert pool.page_bytes == sum(s.heads * (s.key_dim + s.value_dim) for s in full) * 4 * pool.page_size
    assert [t.shape[0] for t in pool.keys] == [0, pool.num_pages * pool.page_size] * 2  # no pages for rings
    ring = pool.layers[0]
    assert slots.cache.states.store.nbytes() == 2 * (slots.rows + 1) * 8 * ring.heads * (ring.key_dim + ring.value_dim) * 4


def test_the_exact_mode_keeps_windowed_layers_on_pages():
    """Its attention sums key blocks in position order, which a ring's slots are not in."""
    from conftest import exact_mode_unavailable

    if exact_mode_unavailable() is not None:
        pytest.skip(str(exact_mode_unavailable()))
    model = tiny("mistral", **WINDOWED["mistral"])
    ids, mask = prompts(2, 12)
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10**6, exact_logprobs=True))
    batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=30, temperature=0.0))
    assert [s.ring for s in rollout.runner.kv_pool.layers] == [None] * 4
    assert torch.equal(batch.input_ids, hf_greedy(model, ids, mask, 30))


FALCON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
              new_decoder_architecture=False, alibi=False, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("model_type,fields,where", [
    pytest.param("falcon", FALCON, r"transformers/models/falcon/modeling_falcon\.py:\d+ in _split_heads: "
                 r"`return fused_qkv", marks=pytest.mark.skipif(TF_5_25, reason="5.25's Falcon captures (tested "
                                                                "below)")),
    ("gpt_neo", dict(LIMITED["gpt_neo"][0], window_size=64),
     r"transformers/models/gpt_neo/modeling_gpt_neo\.py:\d+ in _attn: `mask_value = torch\.tensor\(mask_value"),
])
def test_a_capture_the_models_own_code_refuses_names_its_file_and_line(model_type, fields, where):
    """The warning said only 'creating a tensor from host data ...', with no hint of which code did it."""
    model = tiny(model_type, **fields)
    ids, mask = prompts()
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10**6))
    with pytest.warns(GraphRefusedWarning, match=where):
        batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert torch.equal(batch.input_ids, hf_greedy(model, ids, mask, 4))
    assert "host data" in rollout.graph_stats.last_refusal_reason


@pytest.mark.skipif(not TF_5_25, reason="before 5.25 Falcon's _split_heads makes a tensor from host data (above)")
def test_falcon_captures_since_transformers_5_25():
    model = tiny("falcon", **FALCON)
    ids, mask = prompts()
    rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=True, pad_token_id=0,
                                                              eos_token_id=10**6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphRefusedWarning)
        batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert rollout.last_stats["graph_replays"] > 0 and rollout.last_stats["fallbacks"] == 0
    assert torch.equal(batch.input_ids, hf_greedy(model, ids, mask, 4))


LINEAR_FIELDS = dict(WIN, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4)
MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16)
PURE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: Families with state layers (linear attention, Mamba/Mamba-2 mixers, short convolutions), beside attention
#: (hybrid) or alone, each from a tiny config of its own class.
LINEAR = {
    "qwen3_5_text": LINEAR_FIELDS, "qwen3_next": dict(LINEAR_FIELDS, **MOE_FIELDS),
    "qwen3_5_moe_text": dict(LINEAR_FIELDS, **MOE_FIELDS), "olmo_hybrid": LINEAR_FIELDS,
    "nemotron_h": dict(WIN, head_dim=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8,
                       conv_kernel=4, expand=2, chunk_size=16, hybrid_override_pattern="M*-E"),
    "jamba": dict(WIN, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=4),
    "bamba": dict(WIN, attn_layer_indices=[1], **MAMBA2),
    "granitemoehybrid": dict(WIN, layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=2,
                             num_experts_per_tok=1, shared_intermediate_size=32, **MAMBA2),
    "falcon_h1": dict(WIN, head_dim=8, mamba_d_ssm=64, **MAMBA2),
    "zamba": dict(WIN, num_hidden_layers=6, num_key_value_heads=4, attn_layer_period=2, attn_layer_offset=1,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, n_mamba_heads=2),
    "zamba2": dict(WIN, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, mamba_d_conv=4,
                   mamba_expand=2, mamba_ngroups=1, mamba_headdim=16, n_mamba_heads=4, attention_head_dim=8,
                   num_mem_blocks=1),
    "lfm2": dict(WIN, layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                 block_ff_dim=64),
    "lfm2_moe": dict(WIN, layer_types=["conv", "full_attention", "conv", "full_attention"], moe_intermediate_size=16,
                     num_experts=4, num_experts_per_tok=2, num_dense_layers=1),
    "mamba": dict(PURE, state_size=4),
    "falcon_mamba": dict(PURE, state_size=4),
    "mamba2": dict(PURE, num_heads=4, head_dim=16, n_groups=1, state_size=8, conv_kernel=4, expand=2, chunk_size=16),
}
#: One of each kind for the slower tests: gated delta rule (dense, MoE), Mamba-2 hybrid, parallel hybrid, pure.
LINEAR_SOME = ("qwen3_5_text", "qwen3_next", "nemotron_h", "falcon_h1", "mamba2")


@pytest.mark.parametrize("model_type", fast_first(sorted(LINEAR), keep=2))
def test_state_layers_keep_a_state_per_row_with_graphs_and_match_transformers(model_type):
    """They were refused ('layers of kind ... the paged K/V cache does not hold'; Mamba: an AttributeError). Each
    row keeps its conv and recurrent states in slot-indexed buffers; 12-token prompts (one left-padded) plus 30
    tokens. transformers 4.57 has no linear-attention cache API: there they are refused by name."""
    ids, mask = prompts(3, 12)
    ids[1, :3], mask[1, :3] = 0, 0
    if not LINEAR_CACHE_API:  # 4.57's Jamba and Zamba run on CPU only without their CUDA kernels
        kernels = {"use_mamba_kernels": False} if model_type in ("jamba", "zamba") else {}
        assert_state_layers_refused(tiny(model_type, **LINEAR[model_type], **kernels), ids, mask, 30)
        return
    model = tiny(model_type, **LINEAR[model_type])
    assert layout_refusal(model.config) is None and any(linear_layers(model.config))
    # Layers with a state and no attention cache no K/V (Falcon-H1's parallel blocks have both).
    assert [s.key_dim == 0 for s in layer_specs(model.config)] == [not a for a in attention_layers(model.config)]
    assert_decodes_as_transformers(model, ids, mask, 30, max_out_tokens=64)


@pytest.mark.parametrize("model_type", fast_first(LINEAR_SOME + ("gpt_oss", "llama4_text")))
def test_linear_attention_states_follow_rows_through_admission_compaction_and_preemption(model_type):
    """More requests than slots, samples sharing a prompt, unequal budgets (compaction), and a pool so small that
    requests are preempted and resumed: the states (and windowed layers' rings) move with their rows, so graphs
    equal eager, and the short pool equals an ample one."""
    model = tiny(model_type, **{**WINDOWED, **LINEAR}[model_type])
    ids, mask = prompts(5, 9)
    ids[2, :4], mask[2, :4] = 0, 0
    if model_type in LINEAR and not LINEAR_CACHE_API:
        assert_state_layers_refused(model, ids, mask, 6)
        return
    request = RolloutRequest(ids, mask, max_new_tokens=[20, 6, 14, 9, 3])
    sampling = SamplingConfig(max_new_tokens=20, temperature=1.0, seed=5, n_samples_per_prompt=2)

    def run(graphs: bool, **config):
        rollout = HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, pad_token_id=0,
                                                                  eos_token_id=10**6, max_batch_size=8, **config))
        return rollout.generate(request, sampling), rollout.last_stats

    eager, _ = run(False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graphed, stats = run(True)
    if own_code_refusal(model) is None:
        assert stats["graph_replays"] > 0 and stats["fallbacks"] == 0 and stats["compactions"] > 0
    else:  # 4.57's gpt-oss routing: eager steps, named once, counted
        assert stats["graph_replays"] == 0 and stats["fallbacks"] > 0 and stats["compactions"] > 0
    assert_refused_where_own_code_is(model, record)
    assert torch.equal(graphed.input_ids, eager.input_ids)
    assert torch.equal(graphed.response_logprobs, eager.response_logprobs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        short, stats = run(True, kv_page_size=4, kv_cache_tokens=64)
    assert stats["preemptions"] > 0
    assert_refused_where_own_code_is(model, record)
    # A resumed row's states and K/V were prefilled again, in other batch shapes: logprobs that may differ in
    # the last float bits, so the samples are compared as sampled_close compares numerically different paths
    # (equal tokens with logprobs to 1e-5, or a flip float noise can make, teacher-forced), not by asking both
    # to round alike (issue 38). Graphs against eager (above) are the same numerics: equal bit for bit.
    assert_rollouts_sampled_close(model, short, eager)


def test_families_whose_linear_attention_layers_are_not_verified_are_refused_by_name():
    """Kimi-Linear names its layers 'linear_attention' too; it drives the cache its own way, untested here."""
    model = tiny("kimi_linear", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, intermediate_size=64, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
    ids, mask = prompts()
    with pytest.raises(UnsupportedModelError, match="model_type 'kimi_linear' has layers of kind 'linear_attention' "
                                                    ".* states only for the families verified against transformers"):
        rollout_tokens(model, ids, mask, 4, graphs=True)


def test_linear_attention_episodes_prefill_each_turn_and_the_exact_mode_refuses_them():
    model = tiny("qwen3_5_text", **LINEAR["qwen3_5_text"])
    rollout = HybridEngineRollout(model, config=RolloutConfig(pad_token_id=0, eos_token_id=10**6))
    ids, mask = prompts(2, 6)
    episodes = rollout.open_episodes(RolloutRequest(ids, mask), n_samples_per_prompt=2)
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, seed=3)
    episodes.turn(sampling)
    for row in range(4):
        episodes.append(row, [7, 8, 9])
    history = episodes.history(1)
    episodes.turn(sampling, rows=[1])
    assert rollout.last_stats["kv_reused_tokens"] == 0  # a row's state is not kept between turns (yet)
    single = rollout.generate(RolloutRequest(torch.tensor([history]), request_ids=[4 + 1]), sampling)
    # Both prefill the same one-row history whole (no state kept) and decode it alone: the same numerics, so the
    # same tokens exactly.
    assert episodes.last_turn(1) == single.responses[0].tolist()
    with pytest.raises(ValueError, match="qwen3_5_text's layers of kind 'linear_attention' have no batch-invariant"):
        HybridEngineRollout(model, config=RolloutConfig(exact_logprobs=True))


MATRIX = {**{k: WINDOWED[k] for k in ("mistral", "gemma2", "gpt_oss", "llama4_text")},
          **{k: LINEAR[k] for k in LINEAR_SOME},
          "deepseek_v3": dict(MLA, **MOE), "minicpm3": MLA,
          "falcon": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                         new_decoder_architecture=False, alibi=False, bos_token_id=1, eos_token_id=2)}


@pytest.mark.parametrize("model_type", fast_first(sorted(MATRIX)))
def test_sampled_logprobs_match_the_training_forward_and_a_trained_model_decodes_graph_equal_to_eager(model_type):
    """Rollout logprobs against a teacher-forced training forward past the window (a 1e-3 drift fails), then
    one optimizer step and a rollout again: graph tokens equal eager tokens on the new weights."""
    model = tiny(model_type, **MATRIX[model_type])
    ids, mask = prompts(2, 10)
    ids[1, :2], mask[1, :2] = 0, 0
    if model_type in LINEAR and not LINEAR_CACHE_API:
        assert_state_layers_refused(model, ids, mask, 16)
        return
    request = RolloutRequest(ids, mask)
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, seed=4, n_samples_per_prompt=2)
    engine, *_ = initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.5}}})
    config = RolloutConfig(use_graph_capture=True, pad_token_id=0, eos_token_id=10**6)
    rollout = HybridEngineRollout(engine, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)
        batch = rollout.generate(request, sampling)
    inputs = batch.training_inputs()
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits.float()
    forward = torch.log_softmax(logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    drift = forward[batch.response_mask[:, 1:]] - batch.response_logprobs[batch.response_logprobs != 0]
    assert float(drift.abs().max()) < 1e-4
    engine.train()
    engine.backward(engine(**inputs).loss)
    engine.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)
        graphed = rollout.generate(request, sampling)
        eager = HybridEngineRollout(engine, config=dataclasses.replace(config, use_graph_capture=False)).generate(
            request, sampling)
    assert torch.equal(graphed.input_ids, eager.input_ids)
    assert not torch.equal(graphed.response_logprobs, batch.response_logprobs)  # the step changed the model
