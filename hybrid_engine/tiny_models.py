"""Locally built causal LMs and a tokenizer, for tests and benchmarks.

Nothing here downloads anything: every model is constructed from a config with
seeded random weights, and the tokenizer is assembled from an in-memory
vocabulary with the ``tokenizers`` library.

Names accepted by :func:`build_model`:

* tiny models (2 layers, hidden 64, 4 heads, vocab 384, 512 positions; they run
  in milliseconds): ``tiny-gpt2``, ``tiny-opt``, ``tiny-llama``, ``tiny-qwen2``,
  ``tiny-qwen3``, ``tiny-mistral``. Llama/Qwen/Mistral use 2 KV heads (GQA);
  tiny-qwen3 has an explicit ``head_dim`` of 32 (not hidden/heads = 16), so the
  cache code cannot get away with deriving head_dim from the hidden size.
* :func:`build_tool_tokenizer` is the same tokenizer with a tool-calling chat
  template and a response template that parses its tool calls, for the TRL
  tool loop (:mod:`hybrid_engine.integrations.trl_tools`).
* the short arch names of :data:`ARCHITECTURES` are aliases of the tiny models,
  **except** ``"gpt2"``, which (as on the Hub) is the 124M shape. Use
  ``"tiny-gpt2"`` for the tiny GPT-2.
* benchmark shapes with real hyperparameters and random weights: ``gpt2``
  (124M), ``opt-125m``, ``opt-1.3b``, ``qwen2.5-0.5b`` (Qwen2.5-0.5B's config.json widths, depth, rope and
  vocabulary: 24 layers, 14 query / 2 KV heads of 64, tied embeddings).

Every model uses the same special-token ids as :func:`build_tokenizer`
(pad 0, bos 1, eos 2, unk 3) for the tiny models; the benchmark shapes keep the
ids of their real checkpoints (which lie inside their real vocabularies).
"""

from __future__ import annotations

import string
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

__all__ = [
    "ARCHITECTURES",
    "BENCHMARK_MODELS",
    "TINY_MODELS",
    "TINY_VOCAB_SIZE",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "build_config",
    "TOOL_CHAT_TEMPLATE",
    "TOOL_RESPONSE_TEMPLATE",
    "build_model",
    "build_tokenizer",
    "build_tool_tokenizer",
    "model_names",
]

ARCHITECTURES = ("gpt2", "opt", "llama", "qwen2", "qwen3", "mistral")
TINY_MODELS = tuple(f"tiny-{a}" for a in ARCHITECTURES)
BENCHMARK_MODELS = ("gpt2", "opt-125m", "opt-1.3b", "qwen2.5-0.5b")

TINY_VOCAB_SIZE = 384
TINY_MAX_POSITIONS = 512
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
_TINY_IDS = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}


def _tiny_config(arch: str) -> PretrainedConfig:
    common: dict[str, Any] = dict(vocab_size=TINY_VOCAB_SIZE, **_TINY_IDS)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=TINY_MAX_POSITIONS, n_inner=128, **common)
    if arch == "opt":
        return OPTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            max_position_embeddings=TINY_MAX_POSITIONS,
            word_embed_proj_dim=64,
            **common,
        )
    llama_like: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_POSITIONS,
        **common,
    )
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, **llama_like)
    if arch == "mistral":
        # No sliding window: the paged cache masks full causal attention only.
        return MistralConfig(sliding_window=None, **llama_like)
    raise AssertionError(arch)


def _benchmark_config(name: str) -> PretrainedConfig:
    if name == "gpt2":
        return GPT2Config(
            vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
            bos_token_id=50256, eos_token_id=50256, pad_token_id=50256,
        )
    opt_ids = dict(pad_token_id=1, bos_token_id=2, eos_token_id=2, vocab_size=50272, max_position_embeddings=2048)
    if name == "opt-125m":
        return OPTConfig(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072,
            word_embed_proj_dim=768, **opt_ids,
        )
    if name == "opt-1.3b":
        return OPTConfig(
            hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
            word_embed_proj_dim=2048, **opt_ids,
        )
    if name == "qwen2.5-0.5b":
        return Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
            pad_token_id=151643,
        )
    raise AssertionError(name)


def model_names() -> tuple[str, ...]:
    """Every name :func:`build_model` accepts."""
    return TINY_MODELS + BENCHMARK_MODELS + tuple(a for a in ARCHITECTURES if a != "gpt2")


def build_config(name: str, **config_overrides: Any) -> PretrainedConfig:
    """The config :func:`build_model` would use for ``name`` (see the module docstring for names)."""
    key = name.strip().lower()
    if key in BENCHMARK_MODELS:
        config = _benchmark_config(key)
    else:
        arch = key[len("tiny-"):] if key.startswith("tiny-") else key
        if arch not in ARCHITECTURES:
            raise ValueError(f"build_model: unknown model name {name!r}; choose one of {', '.join(model_names())}")
        config = _tiny_config(arch)
    for k, v in config_overrides.items():
        setattr(config, k, v)
    return config


def build_model(
    name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A causal LM of shape ``name`` with weights drawn from ``seed`` (same seed -> same weights), in eval mode.

    ``config_overrides`` are set on the config before the model is built. The global
    RNG state is left untouched.
    """
    config = build_config(name, **config_overrides)
    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model = model.to(dtype)
    model.eval()
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            setattr(gen, k, getattr(config, k, None))
    return model


_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part"
).split()


def build_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with exactly ``vocab_size`` ids, built in memory.

    Ids 0..3 are ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` (matching the tiny models'
    config ids); then printable ASCII characters, common English words and filler
    tokens ``tok<i>``. Text is split on whitespace and punctuation; unknown words map
    to ``<unk>``. ``padding_side`` is ``"left"`` (decoder-only generation).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < len(_SPECIAL_TOKENS) + 1:
        raise ValueError(f"build_tokenizer: vocab_size must be at least {len(_SPECIAL_TOKENS) + 1}, got {vocab_size}")
    tokens: list[str] = list(_SPECIAL_TOKENS)
    seen = set(tokens)
    candidates = list(string.ascii_letters + string.digits + string.punctuation) + _WORDS
    for tok in candidates:
        if len(tokens) >= vocab_size:
            break
        if tok not in seen:
            tokens.append(tok)
            seen.add(tok)
    i = 0
    while len(tokens) < vocab_size:
        tokens.append(f"tok{i}")
        i += 1
    vocab = {tok: idx for idx, tok in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )
    return tok


#: Words :func:`build_tool_tokenizer` adds (in place of the first filler tokens, so the ids stay below the vocab size).
_TOOL_WORDS = ("user", "assistant", "tool", "tools", "add", "end", *(str(i) for i in range(10, 19)))
#: A chat template that renders tool names, assistant tool calls (``call add a = 3 b = 4 end``) and tool messages;
#: an assistant turn ends with ``</s>``, the EOS, and the template is prefix-preserving (as TRL's tool loop needs).
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}tools :{% for t in tools %} {{ t.function.name }}{% endfor %} . {% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}assistant : {{ m.content }}"
    "{%- for tc in m.tool_calls or [] %} call {{ tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() %} {{ k }} = {{ v }}{% endfor %} end{% endfor %} </s> "
    "{%- elif m.role == 'tool' -%}tool : {{ m.content }} . "
    "{%- else -%}{{ m.role }} : {{ m.content }} . {% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant :{% endif -%}"
)
#: transformers' response template (``tokenizer.response_template``) that parses TOOL_CHAT_TEMPLATE's assistant turns.
TOOL_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "assistant :",
    "fields": {
        "tool_calls": {"open_pattern": r"call\s+(?P<name>\w+)", "close_pattern": r"\s*end\s*", "repeats": True,
                       "content": "xml-inline",
                       "content_args": {"tag_pattern": r"(?P<key>\w+)\s*=\s*(?P<value>\S+)"},
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
        "content": {"close_pattern": r"\s*</s>\s*", "content": "text"},
    },
}


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """:func:`build_tokenizer` (384 ids) with a few more words, :data:`TOOL_CHAT_TEMPLATE` and
    :data:`TOOL_RESPONSE_TEMPLATE`: a tool-calling tokenizer built in memory, for TRL's tool loop."""
    import copy

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = dict(build_tokenizer().get_vocab())
    fillers = sorted((t for t in vocab if t.startswith("tok") and t[3:].isdigit()), key=lambda t: int(t[3:]))
    for word, filler in zip(_TOOL_WORDS, fillers):
        vocab[word] = vocab.pop(filler)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", padding_side="left",
                                  model_input_names=["input_ids", "attention_mask"])
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.response_template = copy.deepcopy(TOOL_RESPONSE_TEMPLATE)
    return tok
