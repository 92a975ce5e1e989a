"""Stop strings: a response ends at the token whose text completes one of them, checked on the host.

Why on the host: a string is text, and which token ids spell it depends on
the tokenizer and on the tokens around it (a string may be split across
tokens, or be part of one). So it is checked where the scheduler already
reads the device (each ``sync_interval`` steps), never inside a captured
step, by decoding the response's ids together.

The rule: the response ends at the first length past the row's
``min_tokens`` at which its decoded text contains a stop string; the token
that completes the string is kept (its text may run past the string) and
every later one is dropped, as an EOS ends a response.

The text is decoded with special tokens kept and no clean-up of spaces
(a transformers tokenizer's keywords), where the tokenizer's ``decode``
takes those keywords; a ``decode`` that takes only the ids is called with
the ids alone (its signature is read once).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["StopStrings"]


class StopStrings:
    """Finds where a response should end for a set of stop strings, decoding with ``tokenizer``."""

    def __init__(self, tokenizer: Any, strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.strings = strings
        # A string of c characters is spelt by at most c tokens that each add text; byte-level tokens may add
        # none, hence the margin. The check decodes this many tokens back from the newest.
        self.window = 4 * max(len(s) for s in strings) + 8
        self._keywords = _decode_keywords(tokenizer.decode)
        try:  # before any work: a decode that cannot take a list of ids fails here, by name
            empty = self._text([])
        except Exception as exc:
            raise TypeError(f"generate: SamplingConfig.stop_strings are matched on the text the tokenizer's "
                            f"decode(ids) returns, and {type(tokenizer).__name__}.decode([]) raised "
                            f"{type(exc).__name__}: {exc}; pass a tokenizer whose decode takes a list of token ids, "
                            "or stop_token_ids instead") from exc
        if not isinstance(empty, str):
            raise TypeError(f"generate: SamplingConfig.stop_strings are matched on the text the tokenizer's "
                            f"decode(ids) returns, and {type(tokenizer).__name__}.decode returned "
                            f"{type(empty).__name__}, not str; pass a tokenizer whose decode returns text, or "
                            "stop_token_ids instead")

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._keywords)

    def _has(self, ids: list[int]) -> bool:
        text = self._text(ids)
        return any(s in text for s in self.strings)

    def cut(self, tokens: list[int], checked: int, floor: int) -> int | None:
        """The response length at which ``tokens`` end for a stop string, or ``None`` (none yet, or not past
        ``floor`` tokens: the ``min_tokens``).

        ``checked``: a prefix already found to hold no stop string (only later matches are looked for)."""
        if len(tokens) <= floor:
            return None
        start = max(0, min(checked, len(tokens)) - self.window)
        if not self._has(tokens[start:]):
            return None
        lo, hi = max(floor + 1, checked + 1, start + 1), len(tokens)  # the shortest prefix holding a string
        while lo < hi:
            mid = (lo + hi) // 2
            if self._has(tokens[start:mid]):
                hi = mid
            else:
                lo = mid + 1
        return hi


#: What the text is decoded with, where ``decode`` takes it: special tokens kept, spaces as the tokens spell them.
_KEYWORDS = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}


def _decode_keywords(decode: Callable[..., Any]) -> dict[str, Any]:
    """The keywords of :data:`_KEYWORDS` that ``decode`` accepts (all with ``**kwargs``; none when its signature
    cannot be read, as the ids alone are what every ``decode`` takes)."""
    try:
        params = inspect.signature(decode).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(_KEYWORDS)
    named = {name for name, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in _KEYWORDS.items() if k in named}
