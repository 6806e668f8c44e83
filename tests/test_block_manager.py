"""Paged KV blocks: prefix hits, reference counts, reuse, eviction, and nothing leaked."""
from nanovllm.engine.block_manager import BlockManager, compute_hash
from nanovllm.engine.sequence import Sequence

BS = 4


def computed(bm: BlockManager, seq: Sequence):
    """Pretend every token but the last was computed, as after a prefill, and hash the full blocks."""
    seq.num_computed_tokens = seq.num_tokens - 1
    bm.hash_computed_blocks(seq, 0)


def test_hash_is_chained():
    assert compute_hash([1, 2, 3, 4]) == compute_hash([1, 2, 3, 4])
    assert compute_hash([1, 2, 3, 4], prefix=7) != compute_hash([1, 2, 3, 4], prefix=8)
    assert compute_hash([1, 2, 3, 4]) != compute_hash([1, 2, 3, 5])


def test_allocate_and_free_everything():
    bm = BlockManager(10, BS)
    seq = Sequence(list(range(10)))
    assert bm.allocate(seq)
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 7
    bm.deallocate(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(10, BS)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    b = Sequence(list(range(10)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0  # a's KV is not computed yet: no hit on allocation alone
    bm.deallocate(b)
    computed(bm, a)
    c = Sequence(list(range(8)) + [99, 98, 97])
    assert bm.allocate(c)
    assert c.block_table[:2] == a.block_table[:2] and c.block_table[2] != a.block_table[2]
    assert c.num_computed_tokens == c.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in c.block_table] == [1, 1, 1]
    bm.deallocate(c)
    assert bm.num_free_blocks == 10


def test_last_token_is_always_computed():
    bm = BlockManager(10, BS)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    a.num_computed_tokens = 8
    bm.hash_computed_blocks(a, 0)
    bm.deallocate(a)
    b = Sequence(list(range(8)))  # fully cached, but its last token must run to give logits
    bm.allocate(b)
    assert b.num_computed_tokens == 4


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = Sequence(list(range(9)))
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    b = Sequence(list(range(9)))
    assert bm.allocate(b) and b.num_cached_tokens == 8  # hit on freed blocks
    bm.deallocate(b)
    # a different request takes every block, which evicts the cached hashes
    c = Sequence(list(range(100, 116)))
    assert bm.allocate(c)
    bm.deallocate(c)
    assert bm.hash_to_block_id == {}
    d = Sequence(list(range(9)))
    assert bm.allocate(d) and d.num_cached_tokens == 0


def test_cached_blocks_are_claimed_before_fresh_ones_evict_them():
    bm = BlockManager(2, BS)
    x = Sequence([0, 1, 2, 3])
    bm.allocate(x)
    x.num_computed_tokens = 4
    bm.hash_computed_blocks(x, 0)
    bm.deallocate(x)
    y = Sequence([7, 7, 7, 7])
    bm.allocate(y)
    bm.deallocate(y)
    assert next(iter(bm.free_block_ids)) == 0  # the cached block is the next one a fresh allocation would take
    b = Sequence([0, 1, 2, 3, 50, 51, 52, 53])
    assert bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table == [0, 1]


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(3, BS)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    big = Sequence(list(range(100, 109)))
    assert not bm.allocate(big)
    assert bm.num_free_blocks == 1 and big.block_table == []


def test_append_slots_grows_block_table():
    bm = BlockManager(3, BS)
    seq = Sequence(list(range(4)))
    bm.allocate(seq)
    seq.num_computed_tokens = 4
    seq.append_token(4)
    assert bm.can_append(seq)
    bm.append_slots(seq)
    assert len(seq.block_table) == 2
    bm.append_slots(seq)  # idempotent while the block has room
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    assert bm.can_append(seq)
    bm.append_slots(seq)
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    assert not bm.can_append(seq)


def test_a_cached_block_is_reused_only_after_the_same_prefix():
    bm = BlockManager(16, BS)
    w, x, y, z = [1] * BS, [2] * BS, [3] * BS, [4] * BS
    for tokens in (w + y + [0], x + z + [0]):  # y's block is cached after w; x's block is cached too
        seq = Sequence(tokens)
        bm.allocate(seq)
        computed(bm, seq)
        bm.deallocate(seq)
    seq = Sequence(x + y + [0])
    assert bm.allocate(seq)
    assert seq.num_cached_tokens == BS  # x only: this y follows x, so its KV differs from the cached one


def test_each_block_of_a_sequence_is_hashed_once(monkeypatch):
    hashed = []
    monkeypatch.setattr("nanovllm.engine.block_manager.compute_hash",
                        lambda token_ids, prefix=-1: hashed.append(token_ids) or compute_hash(token_ids, prefix))
    bm = BlockManager(10, BS)
    holder = Sequence(list(range(17)))
    bm.allocate(holder)
    computed(bm, holder)
    assert len(hashed) == 4
    bm.allocate(Sequence([50, 51]))  # leaves 4 blocks free
    waiting = Sequence(list(range(16)) + list(range(100, 117)))  # the same 4 blocks, then 5 of its own
    for _ in range(10):  # a waiting prompt is retried at every step until it fits
        assert not bm.allocate(waiting)
    assert len(hashed) == 4 + 5  # its 4 hits and its first miss, once
    bm.deallocate(holder)
    assert bm.allocate(waiting) and waiting.num_cached_tokens == 16
    computed(bm, waiting)
    bm.deallocate(waiting)  # preempted: it comes back with the same history
    assert bm.allocate(waiting) and waiting.num_computed_tokens == 32
    assert len(hashed) == 4 + 8  # its other full blocks, once, when their KV was computed


def test_blocks_are_made_when_first_handed_out():
    """A cache of a million blocks costs nothing per block to manage until blocks are used (a small model's cache
    on an H200 holds 16M blocks of 16: making them all at start took 42 s and 5 GB of host memory); fresh blocks
    go out by id, before any freed one."""
    bm = BlockManager(1_000_000, BS)
    assert bm.blocks == [] and bm.num_free_blocks == 1_000_000
    a, b = Sequence(list(range(9))), Sequence(list(range(100, 105)))
    assert bm.allocate(a) and bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4] and len(bm.blocks) == 5
    bm.deallocate(a)
    assert bm.num_free_blocks == 1_000_000 - 2 and list(bm.free_block_ids) == [2, 1, 0]
    c = Sequence(list(range(200, 204)))
    assert bm.allocate(c) and c.block_table == [5]  # fresh before freed


def test_a_hash_collision_is_no_hit(monkeypatch):
    monkeypatch.setattr("nanovllm.engine.block_manager.compute_hash", lambda token_ids, prefix=-1: 1)
    bm = BlockManager(10, BS)
    a, b = Sequence(list(range(9))), Sequence(list(range(100, 109)))
    bm.allocate(a)
    computed(bm, a)
    assert bm.allocate(b) and b.num_cached_tokens == 0


def test_a_prefix_differing_in_a_blocks_last_token_is_no_hit():
    """A cached block is shared only by a prompt holding every one of its tokens: one that differs only in
    the block's last token gets a block of its own (its KV differs)."""
    bm = BlockManager(10, BS)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    b = Sequence([0, 1, 2, 99] + list(range(4, 10)))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]
    c = Sequence(list(range(7)) + [99, 8, 9])  # the same first block, the second differs in its last token
    assert bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0] != c.block_table[1]
