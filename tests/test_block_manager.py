"""Paged KV blocks: prefix hits, reference counts, reuse, eviction, and nothing leaked."""
from nanovllm.engine.block_manager import BlockManager, compute_hash
from nanovllm.engine.sequence import Sequence

BS = 4


def seq(*args):
    return Sequence(list(range(*args)))


def computed(bm, s, n=None):
    """n tokens computed (by default all but the last, as after a prefill); the full blocks hashed."""
    s.num_computed_tokens = s.num_tokens - 1 if n is None else n
    bm.hash_computed_blocks(s, 0)


def cached(bm, s, n=None, free=True):
    """s allocated and computed, then freed unless free=False: its blocks stay cached."""
    bm.allocate(s)
    computed(bm, s, n)
    if free:
        bm.deallocate(s)
    return s


def test_hash_is_chained():
    h, block = compute_hash, [1, 2, 3, 4]
    assert h(block) == h([1, 2, 3, 4]) and h(block, prefix=7) != h(block, prefix=8) and h(block) != h([1, 2, 3, 5])


def test_allocate_and_free_everything():
    bm, s, big = BlockManager(10, BS), seq(10), seq(100, 133)
    assert bm.allocate(s)
    assert len(s.block_table) == 3 and s.num_computed_tokens == 0 and s.num_cached_tokens == 0
    assert bm.num_free_blocks == 7
    assert not bm.allocate(big)  # 9 blocks: an allocation that does not fit changes nothing
    assert bm.num_free_blocks == 7 and big.block_table == []
    bm.deallocate(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm, a, b = BlockManager(10, BS), seq(10), seq(10)
    bm.allocate(a)
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
    cached(bm, seq(8), 8)
    b = seq(8)  # fully cached, but its last token must run to give logits
    bm.allocate(b)
    assert b.num_computed_tokens == 4


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    cached(bm, seq(9))
    b = seq(9)
    assert bm.allocate(b) and b.num_cached_tokens == 8  # hit on freed blocks
    bm.deallocate(b)
    c = seq(100, 116)  # takes every block: the cached hashes evicted
    assert bm.allocate(c)
    bm.deallocate(c)
    assert bm.hash_to_block_id == {}
    d = seq(9)
    assert bm.allocate(d) and d.num_cached_tokens == 0


def test_cached_blocks_are_claimed_before_fresh_ones_evict_them():
    bm = BlockManager(2, BS)
    cached(bm, seq(4), 4)
    y = Sequence([7, 7, 7, 7])
    bm.allocate(y)
    bm.deallocate(y)
    assert next(iter(bm.free_block_ids)) == 0  # the cached block: next to be taken
    b = Sequence([0, 1, 2, 3, 50, 51, 52, 53])
    assert bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table == [0, 1]


def test_append_slots_grows_block_table():
    bm, s = BlockManager(3, BS), seq(4)
    bm.allocate(s)
    s.num_computed_tokens = 4
    s.append_token(4)
    for computed_tokens, blocks in ((4, 2), (4, 2), (8, 3)):  # the second append is idempotent: the block has room
        s.num_computed_tokens = computed_tokens
        assert bm.can_append(s)
        bm.append_slots(s)
        assert len(s.block_table) == blocks
    s.num_computed_tokens = 12
    assert not bm.can_append(s)


def test_a_cached_block_is_reused_only_after_the_same_prefix():
    bm = BlockManager(16, BS)
    w, x, y, z = [1] * BS, [2] * BS, [3] * BS, [4] * BS
    for tokens in (w + y + [0], x + z + [0]):  # y's block cached after w; x's too
        cached(bm, Sequence(tokens))
    s = Sequence(x + y + [0])
    assert bm.allocate(s)
    assert s.num_cached_tokens == BS  # x only: this y follows x, its KV differs


def test_each_block_of_a_sequence_is_hashed_once(monkeypatch):
    hashed = []
    monkeypatch.setattr("nanovllm.engine.block_manager.compute_hash",
                        lambda token_ids, prefix=-1: hashed.append(token_ids) or compute_hash(token_ids, prefix))
    bm = BlockManager(10, BS)
    holder = cached(bm, seq(17), free=False)
    assert len(hashed) == 4
    bm.allocate(Sequence([50, 51]))  # leaves 4 blocks free
    waiting = Sequence(list(range(16)) + list(range(100, 117)))  # the same 4 blocks, then 5 of its own
    for _ in range(10):  # retried at every step until it fits
        assert not bm.allocate(waiting)
    assert len(hashed) == 4 + 5  # its 4 hits and its first miss, once
    bm.deallocate(holder)
    assert bm.allocate(waiting) and waiting.num_cached_tokens == 16
    computed(bm, waiting)
    bm.deallocate(waiting)  # preempted: it comes back with the same history
    assert bm.allocate(waiting) and waiting.num_computed_tokens == 32 and waiting.num_cached_tokens == 16
    assert len(hashed) == 4 + 8  # its other full blocks, once, when computed


def test_blocks_are_made_when_first_handed_out():
    """16M blocks made at start took 42 s and 5 GB; fresh ids go out before freed ones."""
    bm = BlockManager(1_000_000, BS)
    assert bm.blocks == [] and bm.num_free_blocks == 1_000_000
    a, b = seq(9), seq(100, 105)
    assert bm.allocate(a) and bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4] and len(bm.blocks) == 5
    bm.deallocate(a)
    assert bm.num_free_blocks == 1_000_000 - 2 and list(bm.free_block_ids) == [2, 1, 0]
    c = seq(200, 204)
    assert bm.allocate(c) and c.block_table == [5]  # fresh before freed


def test_a_hash_collision_is_no_hit(monkeypatch):
    monkeypatch.setattr("nanovllm.engine.block_manager.compute_hash", lambda token_ids, prefix=-1: 1)
    bm, b = BlockManager(10, BS), seq(100, 109)
    cached(bm, seq(9), free=False)
    assert bm.allocate(b) and b.num_cached_tokens == 0


def test_a_prefix_differing_in_a_blocks_last_token_is_no_hit():
    bm = BlockManager(10, BS)
    a = cached(bm, seq(10), free=False)
    b = Sequence([0, 1, 2, 99] + list(range(4, 10)))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]
    c = Sequence(list(range(7)) + [99, 8, 9])  # the same first block, the second differs in its last token
    assert bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0] != c.block_table[1]


class CountingList(list):
    reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def test_hashing_a_step_looks_only_at_the_blocks_it_filled():
    """Filling the last block of a long sequence, a step looks at that block, not again at every one before it."""
    bm, s = BlockManager(100, BS), seq(51 * BS)
    bm.allocate(s)
    computed(bm, s, 50 * BS)
    s.block_table = CountingList(s.block_table)
    s.num_computed_tokens = 51 * BS
    bm.hash_computed_blocks(s, 50 * BS)
    assert s.block_table.reads == 1 and bm.blocks[s.block_table[50]].hash != -1
