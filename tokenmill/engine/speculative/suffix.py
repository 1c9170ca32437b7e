"""SuffixDecoding's job-wide tree: every suffix of the outputs this engine has produced, cut at a
depth, with how often each continuation followed; a draft is the likeliest path below the longest
suffix of the sequence that the tree holds.

A depth-bounded suffix trie (a node per distinct substring of up to `max_depth` tokens, counting the
occurrences that pass through it) rather than a compressed suffix tree: an output joins it token by
token as it is generated (each new token extends the `max_depth` newest suffixes by one node), so
the rows still running teach each other too; a finished output stays until `max_cached_requests`
newer ones have finished, and then leaves it again. Each output enters with the end of its prompt
before it, so that the first tokens of an answer (`{"label": "`) are found from the prompt's end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass
class TreeEntry:
    """One sequence's tokens in the tree, and the nodes of its newest suffixes (shortest first)."""

    tokens: list[int] = field(default_factory=list)
    open_suffixes: list[_Node] = field(default_factory=list)


@dataclass(frozen=True)
class Proposal:
    draft: list[int]
    match_len: int  # tokens of the sequence's end that the tree matched



class SuffixTree:
    def __init__(self, max_depth: int, max_cached_requests: int) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.root = _Node()
        self._finished: deque[list[int]] = deque()

    def start(self, prompt_tail: list[int]) -> TreeEntry:
        entry = TreeEntry()
        self.extend(entry, prompt_tail)
        return entry

    def extend(self, entry: TreeEntry, tokens: list[int]) -> None:
        for token in tokens:
            entry.tokens.append(token)
            grown = []
            for node in [self.root, *entry.open_suffixes[: self.max_depth - 1]]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            entry.open_suffixes = grown

    def finish(self, entry: TreeEntry) -> None:
        """The sequence is done: it stays in the tree among the newest `max_cached_requests`."""
        entry.open_suffixes = []
        self._finished.append(entry.tokens)
        while len(self._finished) > self.max_cached_requests:
            self._remove(self._finished.popleft())

    def _remove(self, tokens: list[int]) -> None:
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:  # no other occurrence passes here: nor below it
                    del node.children[token]
                    break
                node = child

    def propose(self, context: list[int], max_draft: int, max_spec_factor: float, min_prob: float,
                longest: int | None = None) -> Proposal:
        """The likeliest continuation of the longest suffix of `context` the tree holds (`longest`: a
        bound on its length known from the last match): each next token the most frequent child,
        while the path's estimated probability stays >= `min_prob`, up to `max_draft` tokens and
        `max_spec_factor` times the match's length."""
        bound = self.max_depth - 1 if longest is None else min(longest, self.max_depth - 1)
        node, match_len = self._longest_match(context, bound)
        if node is None or max_draft <= 0:
            return Proposal([], match_len)
        limit = min(max_draft, self.max_depth - match_len, max(1, int(max_spec_factor * match_len)))
        draft: list[int] = []
        prob = 1.0
        while len(draft) < limit and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.count
            if prob < min_prob:
                break
            draft.append(token)
            node = child
        return Proposal(draft, match_len)

    def _longest_match(self, context: list[int], longest: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most `longest` tokens) that is a path from
        the root. Every suffix of a path is a path too, so the first length found, trying from the
        longest down, is the answer. A sequence's match grows by the tokens it gained since its last
        one (more only where new outputs entered the tree, and then a step at a time): with that
        bound the first try is the usual answer."""
        for length in range(min(longest, len(context)), 0, -1):
            node: _Node | None = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is not None:
                return node, length
        return None, 0
