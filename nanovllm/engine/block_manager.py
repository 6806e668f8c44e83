"""Paged KV-cache blocks: allocation, reference counts and the prefix cache.

A full block is identified by a chained xxhash of its tokens and the hash of the block before it, so equal
hashes mean equal prefixes. A block is hashed only once its KV has been computed (never on allocation), so
a hit always finds finished KV, also across chunked prefills. A freed block keeps its hash until it is
reused: a later request with the same prefix can still claim it.

Every call costs in proportion to the blocks it hands out or hashes, never to the size of the cache or to
how often a request was tried: blocks are made when first handed out, the free list is an ordered set of the
freed ones (a hit takes its blocks out of the middle in O(1)), and a sequence keeps the hashes of its full
blocks (a waiting prompt is retried at every step).
"""
from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        # a block is made when it is first handed out, in id order: the ones past the end of this list are fresh
        # (nothing per block at start, where a small model's cache holds millions of blocks)
        self.blocks: list[Block] = []
        self.hash_to_block_id: dict[int, int] = {}
        # freed blocks in eviction order: freed ones join at the back; fresh ones are taken before any of them
        self.free_block_ids: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self.free_block_ids)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        block_ids = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(self._block_hash(seq, i), -1)
            token_ids = seq.block(i, self.block_size)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            block_ids.append(block_id)
        return block_ids

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """The chained hash of the sequence's block i (full), computed once per sequence: tokens are only
        ever appended, so a full block's tokens, and the hash of every full block before it, never change."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            hashes.append(compute_hash(seq.block(len(hashes), self.block_size), hashes[-1] if hashes else -1))
        return hashes[i]

    def _take_free_block(self) -> int:
        if len(self.blocks) < self.num_blocks:
            block = Block(len(self.blocks))
            self.blocks.append(block)
            block.ref_count = 1
            return block.block_id
        block = self.blocks[self.free_block_ids.popitem(last=False)[0]]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.ref_count = -1, [], 1
        return block.block_id

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached ones; False if they don't fit."""
        assert not seq.block_table
        cached = self._cached_prefix(seq)
        num_shared = sum(self.blocks[b].ref_count > 0 for b in cached)
        if seq.num_blocks(self.block_size) - num_shared > self.num_free_blocks:
            return False
        for block_id in cached:  # claim cached blocks before taking fresh ones, which could evict them
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        fresh = [self._take_free_block() for _ in range(seq.num_blocks(self.block_size) - len(cached))]
        seq.block_table = cached + fresh
        seq.num_computed_tokens = len(cached) * self.block_size
        if seq.num_cached_tokens == -1:
            seq.num_cached_tokens = seq.num_computed_tokens
        return True

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):  # the tail is freed first, so it is evicted first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        needed = (seq.num_computed_tokens + num_new_tokens + self.block_size - 1) // self.block_size
        return needed - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1):
        """Grow the block table to hold the KV of the next `num_new_tokens` tokens."""
        needed = (seq.num_computed_tokens + num_new_tokens + self.block_size - 1) // self.block_size
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def hash_computed_blocks(self, seq: Sequence, num_computed_before: int, num_computed_after: int | None = None):
        """Register the blocks that a step filled with computed KV (from num_computed_before tokens to
        num_computed_after, by default all that are computed) in the prefix cache."""
        end = seq.num_computed_tokens if num_computed_after is None else num_computed_after
        for i in range(num_computed_before // self.block_size, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1:
                continue
            block.token_ids = seq.block(i, self.block_size)
            block.hash = self._block_hash(seq, i)
            self.hash_to_block_id[block.hash] = block.block_id
