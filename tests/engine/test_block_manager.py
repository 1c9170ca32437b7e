"""Block manager invariants: reference counts, ownership, freeing, eviction order, collisions."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.sequence import Sequence

BS = 4


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'compute' all of seq's known tokens, as a prefill step would."""
    hits = bm.find_cached_prefix(seq)
    n = seq.num_tokens - len(hits) * BS
    assert bm.allocate(seq, n, hits)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def _check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    owners = Counter(b for s in live for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
    for block_hash, block_id in bm.cached_blocks.items():
        assert bm.blocks[block_id].block_hash == block_hash
    for s in live:  # no block appears twice in one table
        assert len(set(s.block_table)) == len(s.block_table)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(8, BS)
    a, b = _seq(range(10), "a"), _seq(range(100, 107), "b")
    _compute(bm, a)
    _compute(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert not set(a.block_table) & set(b.block_table)
    _check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    _check_invariants(bm, [])
    assert bm.num_free_blocks == 8 and not a.block_table


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(3, BS)
    a = _seq(range(8), "a")
    _compute(bm, a)
    b = _seq(range(50, 60), "b")  # needs 3 blocks, only 1 free
    assert not bm.allocate(b, 10)
    assert b.block_table == [] and bm.num_free_blocks == 1
    _check_invariants(bm, [a])


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = BlockManager(16, BS)
    a = _seq(list(range(13)), "a")
    _compute(bm, a)
    b = _seq(list(range(12)) + [99, 98], "b")  # shares 3 full blocks with a
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:3]
    _compute(bm, b)
    assert b.block_table[:3] == a.block_table[:3]
    _check_invariants(bm, [a, b])
    bm.free(a)
    _check_invariants(bm, [b])  # shared blocks survive while b holds them
    bm.free(b)
    _check_invariants(bm, [])


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(16, BS)
    a = _seq(range(8), "a")
    _compute(bm, a)
    same = _seq(range(8), "same")  # fully cached, but its last token must still be computed
    hits = bm.find_cached_prefix(same)
    assert len(hits) == 1  # block 2 holds the last token, so only block 1 is a hit


def test_freed_cached_blocks_are_reused_then_evicted_lru_tail_first() -> None:
    bm = BlockManager(4, BS)
    a = _seq(range(8), "a")  # blocks [x, y] cached
    _compute(bm, a)
    old = list(a.block_table)
    bm.free(a)
    # The free queue evicts a's tail block before its head block, after never-used blocks.
    order = list(bm.free_queue)
    assert order.index(old[1]) < order.index(old[0])
    assert order[-2:] == [old[1], old[0]]
    hit = _seq(list(range(8)) + [7], "hit")
    assert bm.find_cached_prefix(hit) == old  # still cached while free
    big = _seq(range(200, 212), "big")  # needs 3 blocks: the 2 unused + a's tail
    _compute(bm, big)
    assert old[1] in big.block_table and old[0] not in big.block_table
    assert bm.find_cached_prefix(hit) == [old[0]]  # head survived, tail was evicted
    _check_invariants(bm, [big])


def test_hash_collisions_are_detected() -> None:
    bm = BlockManager(8, BS, hash_fn=lambda parent, tokens: 42)  # every block collides
    a = _seq(range(8), "a")
    _compute(bm, a)
    other = _seq([9, 9, 9, 9, 1, 2, 3], "other")  # same hash, different tokens
    assert bm.find_cached_prefix(other) == []
    _compute(bm, other)
    _check_invariants(bm, [a, other])
    again = _seq(list(range(8)) + [5], "again")
    assert bm.find_cached_prefix(again) == [a.block_table[0]]  # verification stops at block 1


def test_child_of_a_reused_parent_block_is_not_a_hit() -> None:
    bm = BlockManager(3, BS)
    a = _seq(range(9), "a")
    _compute(bm, a)
    head, tail = a.block_table[0], a.block_table[1]
    bm.free(a)
    # Evict exactly a's head block: it is reused for other content under the same hash.
    bm.free_queue.move_to_end(tail)
    filler = _seq(range(300, 308), "f")
    assert bm.allocate(filler, 8)
    assert head in filler.block_table and tail not in filler.block_table
    probe = _seq(list(range(9)) + [1], "probe")
    assert bm.find_cached_prefix(probe) == []  # head gone: the orphaned tail is not used


def test_free_twice_is_an_error() -> None:
    bm = BlockManager(4, BS)
    a = _seq(range(4), "a")
    _compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(a)
