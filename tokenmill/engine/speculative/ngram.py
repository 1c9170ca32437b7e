"""Prompt lookup (vLLM's `ngram`): the sequence's last n tokens, found earlier in its own tokens
(prompt and output), propose the tokens that followed them there; the longest n wins, then the
latest occurrence.

Each sequence keeps an index from every n-gram it has seen to where its latest occurrence ended,
extended by the tokens added since the last lookup: a step costs a few dictionary operations per
new token, not a scan of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """n-gram → the position just after its latest occurrence, over the tokens before the newest."""

    after: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `after`


@dataclass(frozen=True)
class Lookup:
    draft: list[int]
    match_len: int  # the n of the n-gram that matched (0: none did)


NO_MATCH = Lookup([], 0)


def prompt_lookup(tokens: list[int], index: NgramIndex, min_n: int, max_n: int, max_draft: int) -> Lookup:
    """Up to `max_draft` tokens that followed the longest of the last `max_n` .. `min_n` tokens where
    they occurred last before; `index` (the sequence's own) is brought up to date first."""
    newest = len(tokens) - 1
    after = index.after
    for end in range(index.indexed, newest):  # the n-grams ending at `end`, inclusive
        for n in range(min_n, min(max_n, end + 1) + 1):
            after[tuple(tokens[end - n + 1 : end + 1])] = end + 1
    index.indexed = max(index.indexed, newest)
    if max_draft <= 0:
        return NO_MATCH
    for n in range(min(max_n, newest), min_n - 1, -1):
        start = after.get(tuple(tokens[-n:]))
        if start is not None:
            return Lookup(tokens[start : start + max_draft], n)
    return NO_MATCH
