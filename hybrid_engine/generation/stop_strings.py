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
"""

from __future__ import annotations

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

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

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
