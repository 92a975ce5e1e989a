"""A real GPT-2 whose next token is scripted by construction: the same samples on every CPU.

Why: a model fitted inside a test and then sampled at temperature 1.0 follows what it was fitted to only as
far as the CPU's rounding lets it. The tool-loop tests used such a model, and whether a row got a third turn
came from an accidental extra tool call that AVX-512 sampled and AVX2 did not (issue 38). A test that asserts
on sampled tokens needs a model whose samples are certain, whatever the CPU.

What: :func:`scripted_gpt2` builds a one-layer ``GPT2LMHeadModel`` (a real transformers causal LM, so it runs
through the engine's paged cache, its captured graphs and TRL's training forward like any other) whose logits
at a position depend only on that position and the token there, as a table says:

* ``table[(position, token)]`` is the tuple of tokens that may come next. One token: its logit is 130, EOS's
  about 47 and every other token's 0 or less, so a sample at temperature 1 is it with probability 1 - 1e-36;
  its float32 logprob is exactly 0.0. Several tokens: a fair choice. Their rows of the head are
  identical, so they tie (each has logprob log(1/n)), and which one is sampled is decided by the sampler's
  uniform alone, an integer hash of the seed and counters, the same on every CPU. (A choice is only fair if
  its tokens are the successors of nothing else: :func:`script_table` checks it.)
* every other (position, token): EOS, about 55 above every other token.

How: attention contributes nothing (all its weights are zero, so kept or recomputed K/V change no bit of
the output); the embeddings are one-hot (one dimension per token the table reads, one shared by all other
tokens, one per position, one always on), so every input to the layer norms has the same three ones and
the norms are a fixed affine map; one MLP unit per table entry fires only where both its token and its
position are (it gives 10 there, and exactly 0 wherever either differs) and writes its successors'
dimension; the head reads that dimension. :func:`scripted_gpt2` then checks every (position,
token) pair of the model it built against the table: the margins are measured, not assumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.nn import functional as F
from transformers import PreTrainedModel

from hybrid_engine.tiny_models import EOS_ID, TINY_VOCAB_SIZE, build_model

__all__ = ["Step", "script_table", "scripted_gpt2"]

#: One step of a scripted sequence: the ids it may be (one: scripted; several: a fair choice), and whether the
#: model samples it. Given steps (a prompt's or a tool result's tokens) need the model to predict nothing,
#: except the last of them: the step after it is sampled.
Step = tuple[tuple[int, ...], bool]

#: The logit gaps the built model must show (checked on every (position, token) pair).
MIN_MARGIN = 40.0
_UNIT = 10.0  # an MLP unit's pre-activation: +_UNIT when it fires, at most -_UNIT when it does not
_SCRIPTED_LOGIT = 130.0  # a table entry's successor, before the small per-class offsets
_EOS_LOGIT = 60.0  # EOS where no entry fires


def script_table(sequences: Iterable[Sequence[Step]]) -> dict[tuple[int, int], tuple[int, ...]]:
    """The ``(position, token) -> next tokens`` table that makes a model follow ``sequences``.

    Position ``i`` of a sequence is the position its step ``i`` sits at (the sequences start at position 0).
    An entry is made for every step followed by a sampled step; a step with several ids (a choice) gives each
    of them an entry. Two sequences that need different successors at the same (position, token) conflict;
    a choice whose tokens also follow some other entry would not be fair. Both raise ``ValueError``.
    """
    table: dict[tuple[int, int], tuple[int, ...]] = {}
    for sequence in sequences:
        for i in range(len(sequence) - 1):
            options, sampled = sequence[i + 1]
            if not sampled:
                continue
            successors = tuple(sorted(set(options)))
            for token in sequence[i][0]:
                key = (i, token)
                if table.setdefault(key, successors) != successors:
                    raise ValueError(f"script_table: position {i}, token {token} is followed by {table[key]} in "
                                     f"one sequence and by {successors} in another")
    choices = {s for s in table.values() if len(s) > 1}
    for choice in choices:
        for other in set(table.values()) - {choice}:
            if set(choice) & set(other):
                raise ValueError(f"script_table: the choice {choice} shares a token with the successors {other}; "
                                 "its tokens would not tie")
    return table


def scripted_gpt2(table: dict[tuple[int, int], tuple[int, ...]], *, positions: int = 64,
                  vocab_size: int = TINY_VOCAB_SIZE, eos_id: int = EOS_ID) -> PreTrainedModel:
    """A one-layer GPT-2 (``n_positions=positions``) that follows ``table`` (see the module docstring)."""
    if any(not 0 <= p < positions or not 0 <= t < vocab_size for p, t in table):
        raise ValueError(f"scripted_gpt2: an entry lies outside {positions} positions or {vocab_size} tokens")
    read = sorted({t for _, t in table})  # the tokens the table reads; all others share one dimension
    classes = sorted(set(table.values()))  # one output dimension per successor set
    always, token_dim = 0, {t: 1 + i for i, t in enumerate(read)}
    other = 1 + len(read)
    pos0 = other + 1
    out0 = pos0 + positions
    width = out0 + len(classes)
    width += -width % 16  # 16-wide heads
    units = len(table) + (-len(table) % 16)
    model = build_model("tiny-gpt2", seed=0, n_embd=width, n_layer=1, n_head=width // 16, n_inner=units,
                        n_positions=positions, vocab_size=vocab_size, tie_word_embeddings=False, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    eps = model.config.layer_norm_epsilon

    def normed(ones: int) -> tuple[float, float]:
        """A layer norm's output at a 1 and at a 0 of an input with ``ones`` ones and zeros elsewhere."""
        x = torch.zeros(width)
        x[:ones] = 1.0
        z = F.layer_norm(x, (width,), eps=eps)
        return float(z[0]), float(z[-1])

    hot, cold = normed(3)  # every input to ln_1 and ln_2: always, its token, its position
    hot4, _ = normed(4)  # the input to ln_f where an entry fired: and its successors' dimension
    alpha = 2 * _UNIT / (hot - cold)
    fired = F.gelu(torch.tensor(_UNIT), approximate="tanh").item()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for ln in (model.transformer.h[0].ln_1, model.transformer.h[0].ln_2, model.transformer.ln_f):
            ln.weight.fill_(1.0)
        wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
        wte[:, always] = 1.0
        wte[:, other] = 1.0
        for t, d in token_dim.items():
            wte[t, other] = 0.0
            wte[t, d] = 1.0
        wpe[torch.arange(positions), pos0 + torch.arange(positions)] = 1.0
        mlp = model.transformer.h[0].mlp  # Conv1D: x @ weight + bias
        for k, ((pos, tok), successors) in enumerate(sorted(table.items())):
            mlp.c_fc.weight[token_dim[tok], k] = alpha
            mlp.c_fc.weight[pos0 + pos, k] = alpha
            mlp.c_fc.bias[k] = -alpha * (1.5 * hot + 0.5 * cold)  # both on: +_UNIT; one on: -_UNIT
            mlp.c_proj.weight[k, out0 + classes.index(successors)] = 1.0 / fired
        head = model.lm_head.weight
        for c, successors in enumerate(classes):
            head[list(successors), out0 + c] = _SCRIPTED_LOGIT / hot4
        head[eos_id, always] = _EOS_LOGIT / hot
    _check(model, table, positions, vocab_size, eos_id)
    model.eval()
    return model


def _check(model: PreTrainedModel, table: dict[tuple[int, int], tuple[int, ...]], positions: int, vocab_size: int,
           eos_id: int) -> None:
    """Every (position, token): its successors (EOS where the table has none) tie exactly and lead the rest by
    :data:`MIN_MARGIN` or more. Attention contributes nothing, so row ``t`` of all-``t`` inputs covers token
    ``t`` at every position."""
    ids = torch.arange(vocab_size)[:, None].expand(vocab_size, positions)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()  # [token, position, vocab]
    expected = torch.zeros(vocab_size, positions, vocab_size, dtype=torch.bool)
    expected[:, :, eos_id] = True
    for (pos, tok), successors in table.items():
        expected[tok, pos, :] = False
        expected[tok, pos, list(successors)] = True
    best_other = logits.masked_fill(expected, float("-inf")).amax(-1)
    low = logits.masked_fill(~expected, float("inf")).amin(-1)
    high = logits.masked_fill(~expected, float("-inf")).amax(-1)
    margin = float((low - best_other).min())
    spread = float((high - low).max())
    # Tied tokens must tie exactly: were one ahead by an ulp on one path and behind on another, the sorted order,
    # and with it the token a uniform picks, would differ between them.
    if margin < MIN_MARGIN or spread != 0.0:
        raise AssertionError(f"scripted_gpt2: the built model's smallest margin is {margin:.1f} (needs "
                             f"{MIN_MARGIN}), its largest spread among tied tokens {spread:.2g} (needs 0)")
