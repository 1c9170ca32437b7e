"""The proposers against plain references: prompt lookup against a scan of the whole sequence, the
suffix tree against counting substrings, as tokens arrive one at a time."""

from __future__ import annotations

import random
from collections import Counter

from tokenmill.engine.speculative import accepted_prefix
from tokenmill.engine.speculative.ngram import NgramIndex, prompt_lookup
from tokenmill.engine.speculative.suffix import SuffixTree


def _scan_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """The longest n (then the latest earlier occurrence) by brute force."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # occurrences ending before the newest token
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k], n
    return [], 0


def test_prompt_lookup_matches_a_scan_of_the_sequence_as_it_grows() -> None:
    rng = random.Random(0)
    for trial in range(20):
        tokens = [rng.randrange(6) for _ in range(30)]  # a small vocabulary: many repeats
        index = NgramIndex()
        for _ in range(40):
            found = prompt_lookup(tokens, index, 2, 4, 5)
            assert (found.draft, found.match_len) == _scan_lookup(tokens, 2, 4, 5), (trial, tokens)
            tokens.append(rng.randrange(6))


def test_prompt_lookup_proposes_what_followed_and_nothing_without_a_match() -> None:
    doc = [10, 11, 12, 13, 14, 15, 16]
    found = prompt_lookup([1, *doc, 2, 3, 10, 11, 12], NgramIndex(), 2, 5, 3)
    assert (found.draft, found.match_len) == ([13, 14, 15], 3)
    assert prompt_lookup([1, 2, 3, 4], NgramIndex(), 2, 5, 3).draft == []


def _substring_counts(sequences: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def _tree_counts(tree: SuffixTree) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            counts[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return counts


def test_suffix_tree_counts_every_substring_as_tokens_arrive_and_forgets_the_oldest() -> None:
    rng = random.Random(1)
    tree = SuffixTree(max_depth=5, max_cached_requests=3)
    sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 15))] for _ in range(6)]
    for seq in sequences:
        entry = tree.start(seq[:2])
        for token in seq[2:]:  # one token a step, as the engine adds them
            tree.extend(entry, [token])
        assert _tree_counts(tree) == _substring_counts(sequences[: sequences.index(seq) + 1][-4:], 5)
        tree.finish(entry)
    assert _tree_counts(tree) == _substring_counts(sequences[-3:], 5)  # the three newest stay


def test_suffix_tree_proposes_the_most_frequent_continuation_while_likely_enough() -> None:
    tree = SuffixTree(max_depth=8, max_cached_requests=10)
    for answer in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9, 9]):
        tree.finish(tree.start(answer))
    proposal = tree.propose([7, 1, 2], max_draft=8, max_spec_factor=2.0, min_prob=0.5)
    assert proposal.match_len == 2 and proposal.draft == [3, 4, 5]  # 3 always, then 4 and 5 two times in three
    assert tree.propose([7, 1, 2], max_draft=8, max_spec_factor=2.0, min_prob=0.7).draft == [3]
    assert tree.propose([1, 2], max_draft=8, max_spec_factor=0.5, min_prob=0.1).draft == [3]  # 0.5 x 2 tokens
    assert tree.propose([6], max_draft=8, max_spec_factor=2.0, min_prob=0.1).draft == []


def test_the_verified_prefix_keeps_drafts_up_to_the_first_difference() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all right: one more
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the sampled token replaces the wrong draft
    assert accepted_prefix([5, 6], [4, 6, 1]) == [4]
    assert accepted_prefix([], [3]) == [3]
