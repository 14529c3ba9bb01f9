"""Stop strings for min_tokens' rule, picked from a generation's per-token text deltas (the text
each token completes, as the engine streams it): ``inside``, whose first occurrence ends in the
first min_tokens tokens' text and which occurs again later, and ``later``, which first occurs
after that text, before ``inside`` occurs again. With ``min_tokens``, ``inside`` alone stops the
request at its next occurrence, and with ``later`` beside it ``later`` does; in the whole text
``inside`` is the first stop string."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class MinTokensStops:
    inside: str  # one character
    later: str  # one character, absent from the first min_tokens tokens' text
    min_tokens: int  # the token whose text completes inside's first occurrence
    again: int  # the text before inside's next occurrence: what a request stopped there shows
    again_tokens: int  # tokens generated up to the one completing it
    cut: int  # the text before later's first occurrence
    cut_tokens: int  # tokens generated up to the one completing it


def min_tokens_stops(deltas: list[str]) -> MinTokensStops:
    """AssertionError when the text has no such pair of characters."""
    full = "".join(deltas)
    ends = list(itertools.accumulate(map(len, deltas)))  # text after each token

    def token_at(end: int) -> int:  # 1-based: the token whose text completes text[:end]
        return next(n for n, e in enumerate(ends, 1) if e >= end)

    chars = [c for c in dict.fromkeys(full) if c != "\ufffd"]  # (not a split character's)
    for a in chars:
        m = token_at(full.find(a) + 1)
        head = ends[m - 1]  # characters in the first m tokens' text
        for b in chars:
            q, again = full.find(b, head), full.find(a, head)
            if b not in full[:head] and -1 < q < again:
                return MinTokensStops(a, b, m, again, token_at(again + 1), q, token_at(q + 1))
    raise AssertionError(f"no two characters of {full!r} fit min_tokens' case")
