"""Comparing what two numerically different paths sampled, without asking their rounding to agree.

Two paths that compute the same distribution in different ways (K/V kept from earlier turns or prefilled
again, one prompt prefilled once for its samples or once per sample, other batch shapes, preemption and a
prefill again, another attention kernel, another CPU's kernels) give logprobs that differ in the last float
bits. With the same seed and counters both draw the same uniform ``u``, and the sampler picks the token whose
interval of the inverse CDF (the filtered, renormalised distribution sorted in descending order) holds ``u``.
So the tokens agree unless ``u`` lies within that float noise of a boundary between two intervals: unlikely
at any one token (about 1e-7 here), but a test that demands equal tokens passes only as long as that never
happens, on every CPU (issue 38).

:func:`assert_sampled_close` is vLLM's ``check_logprobs_close`` made for sampling: position by position, the
tokens are equal and so are their logprobs (to ``atol``); where they first differ, the two tokens must be
neighbours in the inverse CDF (their intervals touch, to ``cdf_atol``) of the teacher-forced distribution on
the shared history, which is the only way float noise can change a sample, and each token's logprob must be
its teacher-forced one; the row is not compared past that point (the histories differ from there on).

With top-k or top-p the noise can also move which tokens are kept, where two logits tie within it at the
top-k cut or the top-p mass reaches ``top_p`` within it: the sampled distribution is then one of the few that
the teacher-forced logits give with such a tie swapped or the top-p cut moved by one token. Each path's token
and logprob must be explained by one of those, and the two tokens' intervals in theirs must touch or overlap
(the same ``u`` picked both); an equal token with logprobs that differ by more than ``atol`` must be explained
by two of them with other kept sets (then the rows go on being compared). Greedy (``temperature=0``): where
the tokens differ, both must be the argmax of the teacher-forced logits within ``logit_atol`` (a tie that the
noise broke one way or the other), with their teacher-forced logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["assert_greedy_close", "assert_sampled_close", "assert_rollouts_sampled_close"]


def _teacher_forced_logits(model, history: Sequence[int]) -> torch.Tensor:
    """The next-token logits after ``history`` from a plain forward of ``model``, in float64 (an arbiter that
    rounds neither path's way)."""
    ids = torch.tensor([list(history)], dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].double()


def _filtered(top_p: float, top_k: int, vocab: int) -> bool:
    return 0 < top_k < vocab or top_p < 1


def _distributions(z: torch.Tensor, top_p: float, top_k: int, cdf_atol: float, logit_atol: float):
    """The distributions a sampler may have drawn from, given the scaled logits ``z`` up to float noise: the
    teacher-forced one (stable descending order, top-k, then top-p on the top-k-renormalised distribution, the
    top token always kept, renormalised: the sampler's rules), and with a filter, those with the top-p cut one
    token earlier or later where the mass reaches ``top_p`` within ``cdf_atol``, and with the last kept token
    and the first one cut swapped where their logits tie within ``logit_atol``. (Swaps within the kept set move
    no cut: they are the neighbours whose intervals touch.) Each is ``(kept ids in order,
    probabilities, interval starts, interval ends)``."""
    vocab = z.numel()
    order = torch.sort(z, descending=True, stable=True).indices

    def cuts(o):
        p = torch.softmax(z[o], 0)
        if 0 < top_k < vocab:
            p = p[:top_k] / p[:top_k].sum()
        if top_p >= 1:
            return p, [len(p)]
        before = torch.cumsum(p, 0) - p
        m = max(1, int((before < top_p).sum()))
        ms = [m]
        if m < len(p) and float(before[m]) - top_p <= cdf_atol:
            ms.append(m + 1)
        if m > 1 and top_p - float(before[m - 1]) <= cdf_atol:
            ms.append(m - 1)
        return p, ms

    orders = [order]
    if _filtered(top_p, top_k, vocab):
        sorted_z = z[order]
        for m in cuts(order)[1]:  # the last kept token and the first one cut, where they tie
            if m < vocab and float(sorted_z[m - 1] - sorted_z[m]) <= logit_atol:
                swapped = order.clone()
                swapped[m - 1], swapped[m] = order[m], order[m - 1]
                orders.append(swapped)
    out = []
    for o in orders:
        p, ms = cuts(o)
        for m in ms:
            q = p[:m] / p[:m].sum()
            end = torch.cumsum(q, 0)
            out.append((o[:m], q, end - q, end))
    return out


def _fits(distributions, token: int, logprob: float, lp_atol: float):
    """The distributions that keep ``token`` at ``logprob`` (to ``lp_atol``): (index, interval start, end)."""
    out = []
    for d, (ids, q, start, end) in enumerate(distributions):
        where = (ids == token).nonzero()
        if len(where):
            j = int(where[0, 0])
            if abs(logprob - float(q[j].log())) <= lp_atol:
                out.append((d, float(start[j]), float(end[j])))
    return out


def assert_sampled_close(model, context: Sequence[int], tokens_a: Sequence[int], logprobs_a: Sequence[float],
                         tokens_b: Sequence[int], logprobs_b: Sequence[float], *, temperature: float = 1.0,
                         top_p: float = 1.0, top_k: int = -1, atol: float = 1e-5, cdf_atol: float = 1e-4,
                         lp_atol: float = 1e-4, logit_atol: float = 1e-4, name: str = "") -> int:
    """Check two continuations of ``context`` sampled with ``temperature``, ``top_p`` and ``top_k`` (the
    sampling logprobs: under the filtered distribution; greedy: under ``softmax(logits)``) by two paths with
    the same seed and counters (see the module docstring). Positions whose tokens were given rather than
    sampled (a tool's tokens: logprob 0 in both) compare as equal tokens. Returns the first position where the
    tokens differ (``len(tokens_a)`` if none); raises ``AssertionError`` naming ``name`` otherwise."""
    tokens_a, tokens_b = [int(t) for t in tokens_a], [int(t) for t in tokens_b]
    logprobs_a, logprobs_b = [float(x) for x in logprobs_a], [float(x) for x in logprobs_b]
    assert len(tokens_a) == len(logprobs_a) and len(tokens_b) == len(logprobs_b), name
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        la, lb = logprobs_a[i], logprobs_b[i]
        if a == b and abs(la - lb) <= atol:
            continue
        logits = _teacher_forced_logits(model, [*context, *tokens_a[:i]])
        sampled = temperature > 0
        if a == b and not (sampled and _filtered(top_p, top_k, logits.numel())):
            raise AssertionError(f"{name}: position {i}, token {a}: logprobs {la} and {lb}")
        if not sampled:
            full = torch.log_softmax(logits, 0)
            for token, lp in ((a, la), (b, lb)):
                assert abs(lp - float(full[token])) <= lp_atol, (
                    f"{name}: position {i}, token {token}: logprob {lp}, teacher-forced {float(full[token])}")
                assert float(logits.max() - logits[token]) <= logit_atol, (
                    f"{name}: position {i}: greedy tokens {a} and {b}: {token}'s logit is "
                    f"{float(logits.max() - logits[token]):.2g} below the teacher-forced argmax's, not a tie that "
                    "float noise can break either way")
            return i
        distributions = _distributions(logits / temperature, top_p, top_k, cdf_atol, logit_atol)
        fits = []
        for token, lp in ((a, la), (b, lb)):
            fits.append(_fits(distributions, token, lp, lp_atol))
            if not fits[-1]:
                ids, q = distributions[0][:2]
                where = (ids == token).nonzero()
                expected = float(q[int(where[0, 0])].log()) if len(where) else float("-inf")
                raise AssertionError(f"{name}: position {i}, token {token}: logprob {lp}, teacher-forced {expected} "
                                     "(nor that of a kept set float noise can make)")
        gap = min((max(sa, sb) - min(ea, eb) for da, sa, ea in fits[0] for db, sb, eb in fits[1]
                   if a != b or not torch.equal(distributions[da][0].sort().values,
                                                distributions[db][0].sort().values)), default=float("inf"))
        if a == b:
            assert gap <= cdf_atol, (f"{name}: position {i}, token {a}: logprobs {la} and {lb}, not a move of the "
                                     "top-k or top-p cut that float noise can make")
            continue  # the same token: the histories still agree
        (_, sa, ea), (_, sb, eb) = fits[0][0], fits[1][0]
        assert gap <= cdf_atol, (
            f"{name}: position {i}: tokens {a} and {b} are not neighbours in the inverse CDF (their intervals "
            f"[{sa:.6f}, {ea:.6f}] and [{sb:.6f}, {eb:.6f}] are {gap:.2g} apart): not a flip float noise can make")
        return i
    assert len(tokens_a) == len(tokens_b), f"{name}: {len(tokens_a)} and {len(tokens_b)} tokens, all equal"
    return len(tokens_a)


def assert_greedy_close(model, context: Sequence[int], tokens_a: Sequence[int], tokens_b: Sequence[int], *,
                        logit_atol: float = 1e-4, name: str = "") -> int:
    """Two greedy continuations of ``context`` without logprobs (``generate``'s): equal tokens, or at the first
    difference two tokens that tie for the teacher-forced argmax within ``logit_atol``. Returns that position
    (``len(tokens_a)`` if none); not compared past it."""
    tokens_a, tokens_b = [int(t) for t in tokens_a], [int(t) for t in tokens_b]
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        if a != b:
            logits = _teacher_forced_logits(model, [*context, *tokens_a[:i]])
            for token in (a, b):
                below = float(logits.max() - logits[token])
                assert below <= logit_atol, (
                    f"{name}: position {i}: greedy tokens {a} and {b}: {token}'s logit is {below:.2g} below the "
                    "teacher-forced argmax's, not a tie that float noise can break either way")
            return i
    assert len(tokens_a) == len(tokens_b), f"{name}: {len(tokens_a)} and {len(tokens_b)} tokens, all equal"
    return len(tokens_a)


def assert_rollouts_sampled_close(model, a, b, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                                  settings: Sequence[tuple] | None = None, atol: float = 1e-5) -> list[int]:
    """:func:`assert_sampled_close` on every row of two ``RolloutBatch`` es of the same request (same prompts and
    seeds): the prompts equal, then each row's response to its own length (EOS or a stop may end one row
    earlier than the other, past a flip). ``settings``: each prompt's ``(temperature, top_p, top_k, ...)``
    (``RolloutRequest.settings``) where they differ; row ``r`` uses its ``prompt_index``'s. Where no row
    differs, the batches are equal as a whole (padding included). Returns each row's first difference."""
    start = a.response_start_idx
    assert start == b.response_start_idx
    assert torch.equal(a.input_ids[:, :start], b.input_ids[:, :start])
    assert torch.equal(a.attention_mask[:, :start], b.attention_mask[:, :start])
    assert a.input_ids.shape[0] == b.input_ids.shape[0]
    firsts = []
    for row, (na, nb) in enumerate(zip(a.response_lengths.tolist(), b.response_lengths.tolist())):
        t, p, k = ((temperature, top_p, top_k) if settings is None
                   else settings[int(a.prompt_index[row])][:3])
        prompt = a.input_ids[row, :start][a.attention_mask[row, :start].bool()]
        firsts.append(assert_sampled_close(
            model, prompt.tolist(), a.responses[row, :na].tolist(), a.response_logprobs[row, :na].tolist(),
            b.responses[row, :nb].tolist(), b.response_logprobs[row, :nb].tolist(), temperature=t, top_p=p,
            top_k=k, atol=atol, name=f"row {row}"))
    if firsts == a.response_lengths.tolist():
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
        assert torch.equal(a.response_lengths, b.response_lengths)  # (logprobs: compared row by row)
    return firsts
