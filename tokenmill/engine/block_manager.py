"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, prefix caching.

A full block is keyed by a chained hash of (parent hash, its token ids). A hit is only taken
after checking the block really holds those tokens *and* hangs off the block we matched just
before it (parent id + generation), so neither a hash collision nor a reused parent block can
splice foreign KV into a sequence. Freed blocks keep their cached content and sit in an LRU
queue; their content is dropped only when the block is needed for something else.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.sequence import Sequence

BlockHashFn = Callable[[int | None, tuple[int, ...]], int]


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is deterministic across processes (no hash seed).
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # its content, checked on every hit
    parent: tuple[int, int] | None = None  # (block id, generation) of the block before it
    generation: int = 0  # bumped each time the block's cached content is dropped


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: BlockHashFn = default_block_hash,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("BlockManager needs a positive number of blocks and block size")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in least-recently-used order: allocation takes from the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------
    def block_hash(self, seq: Sequence, index: int) -> int:
        """Chained hash of the seq's full block `index`, memoised on the sequence."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(self.hash_fn(parent, self._block_tokens(seq, i)))
        return seq.block_hashes[index]

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start : start + self.block_size])

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest verified cached prefix of seq's known tokens.

        The last known token is never served from cache: its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: tuple[int, int] | None = None
        for index in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached_blocks.get(self.block_hash(seq, index))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != self._block_tokens(seq, index) or block.parent != parent:
                break  # hash collision or stale chain: compute it instead
            hits.append(block_id)
            parent = (block_id, block.generation)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter seq's newly computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # Computed and known: drafts a step accepted are computed before the engine appends them.
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_table))
        for index in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            block_hash = self.block_hash(seq, index)
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                block.token_ids = self._block_tokens(seq, index)
                if index:
                    prev = self.blocks[seq.block_table[index - 1]]
                    block.parent = (prev.block_id, prev.generation)
                self.cached_blocks[block_hash] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    # ---- allocation -----------------------------------------------------------------------
    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hits: int = 0) -> int:
        computed = seq.num_computed_tokens + num_hits * self.block_size
        total = self.blocks_for_tokens(computed + num_new_tokens)
        return max(0, total - len(seq.block_table) - num_hits)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        hits = hits or []
        # Hit blocks that are currently free stop being free once taken.
        hits_from_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.num_new_blocks_needed(seq, num_new_tokens, len(hits))
        return needed + hits_from_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Grow seq's block table to hold `num_new_tokens` more tokens, first taking `hits`
        (a cached prefix of a sequence with nothing computed). All or nothing."""
        hits = hits or []
        if hits and (seq.block_table or seq.num_computed_tokens):
            raise ValueError("prefix hits can only start a sequence with no computed tokens")
        if not self.can_allocate(seq, num_new_tokens, hits):
            return False
        for block_id in hits:
            self._take(block_id)
        seq.block_table.extend(hits)
        if hits:
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_registered_blocks = len(hits)
        for _ in range(self.num_new_blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_fresh())
        return True

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks; tail blocks go first in the eviction order."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table.clear()
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of seq's table past the first `num_tokens` tokens (rejected drafts')."""
        keep = self.blocks_for_tokens(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash, block.token_ids, block.parent = None, (), None
            block.generation += 1
        block.ref_count = 1
        return block_id
