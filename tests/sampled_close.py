"""Comparing what two numerically different paths sampled, without asking their rounding to agree.

Two paths that compute the same distribution in different ways (K/V kept from earlier turns or prefilled
again, one prompt prefilled once for its samples or once per sample, other batch shapes, another CPU's
kernels) give logprobs that differ in the last float bits. With the same seed and counters both draw the same
uniform ``u``, and the sampler picks the token whose interval of the inverse CDF (the distribution sorted in
descending order) holds ``u``. So the tokens agree unless ``u`` lies within that float noise of a boundary
between two intervals: unlikely at any one token (about 1e-7 here), but a test that demands equal tokens
passes only as long as that never happens, on every CPU (issue 38).

:func:`assert_sampled_close` is vLLM's ``check_logprobs_close`` made for sampling: position by position, the
tokens are equal and so are their logprobs (to ``atol``); where they first differ, the two tokens must be
neighbours in the inverse CDF (their intervals touch, to ``cdf_atol``) of the teacher-forced distribution on
the shared history, which is the only way float noise can change a sample, and each token's logprob must be
its teacher-forced one; the row is not compared past that point (the histories differ from there on).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["assert_sampled_close", "assert_rollouts_sampled_close"]


def _teacher_forced_logprobs(model, history: Sequence[int], temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` of the next token after ``history``, from a plain forward of ``model``."""
    ids = torch.tensor([list(history)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def assert_sampled_close(model, context: Sequence[int], tokens_a: Sequence[int], logprobs_a: Sequence[float],
                         tokens_b: Sequence[int], logprobs_b: Sequence[float], *, temperature: float = 1.0,
                         atol: float = 1e-5, cdf_atol: float = 1e-4, lp_atol: float = 1e-4, name: str = "") -> int:
    """Check two continuations of ``context`` sampled at ``temperature`` (no top-k or top-p) by two paths with the
    same seed and counters (see the module docstring). Positions whose tokens were given rather than sampled
    (a tool's tokens: logprob 0 in both) compare as equal tokens. Returns the first position where the tokens
    differ (``len(tokens_a)`` if none); raises ``AssertionError`` naming ``name`` otherwise."""
    tokens_a, tokens_b = [int(t) for t in tokens_a], [int(t) for t in tokens_b]
    logprobs_a, logprobs_b = [float(x) for x in logprobs_a], [float(x) for x in logprobs_b]
    assert len(tokens_a) == len(logprobs_a) and len(tokens_b) == len(logprobs_b), name
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        if a == b:
            assert abs(logprobs_a[i] - logprobs_b[i]) <= atol, (
                f"{name}: position {i}, token {a}: logprobs {logprobs_a[i]} and {logprobs_b[i]}")
            continue
        full = _teacher_forced_logprobs(model, [*context, *tokens_a[:i]], temperature)
        probs = full.exp()
        order = torch.sort(probs, descending=True, stable=True).indices
        end = torch.empty_like(probs)
        end[order] = torch.cumsum(probs[order], 0)
        start = end - probs
        gap = min(abs(float(end[a] - start[b])), abs(float(end[b] - start[a])))
        assert gap <= cdf_atol, (
            f"{name}: position {i}: tokens {a} and {b} are not neighbours in the inverse CDF (their intervals "
            f"[{float(start[a]):.6f}, {float(end[a]):.6f}] and [{float(start[b]):.6f}, {float(end[b]):.6f}] are "
            f"{gap:.2g} apart): not a flip float noise can make")
        for token, lp in ((a, logprobs_a[i]), (b, logprobs_b[i])):
            assert abs(lp - float(full[token])) <= lp_atol, (
                f"{name}: position {i}, token {token}: logprob {lp}, teacher-forced {float(full[token])}")
        return i
    assert len(tokens_a) == len(tokens_b), f"{name}: {len(tokens_a)} and {len(tokens_b)} tokens, all equal"
    return len(tokens_a)


def assert_rollouts_sampled_close(model, a, b, *, temperature: float = 1.0, atol: float = 1e-5) -> list[int]:
    """:func:`assert_sampled_close` on every row of two ``RolloutBatch`` es of the same request (same prompts, same
    seed, no EOS): the prompts and lengths equal, then each row's response. Returns each row's first difference."""
    assert torch.equal(a.input_ids[:, :a.response_start_idx], b.input_ids[:, :b.response_start_idx])
    assert torch.equal(a.attention_mask[:, :a.response_start_idx], b.attention_mask[:, :b.response_start_idx])
    assert torch.equal(a.response_lengths, b.response_lengths)
    firsts = []
    for row, n in enumerate(a.response_lengths.tolist()):
        prompt = a.input_ids[row, :a.response_start_idx][a.attention_mask[row, :a.response_start_idx].bool()]
        firsts.append(assert_sampled_close(
            model, prompt.tolist(), a.responses[row, :n].tolist(), a.response_logprobs[row, :n].tolist(),
            b.responses[row, :n].tolist(), b.response_logprobs[row, :n].tolist(), temperature=temperature,
            atol=atol, name=f"row {row}"))
    return firsts
