"""The block manager against a plain reference under random admissions, steps, preemptions (re-admitted with a
longer history) and finishes: the same block tables, prefix hits, free list in eviction order and cached blocks.
The reference's free list is a plain list; a cached block is known by the whole prefix it ends, no hashing."""
from hypothesis import given, settings, strategies as st

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from tests.conftest import every_block, free_order


class ReferenceBlocks:

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.prefix_of: list[tuple | None] = [None] * num_blocks  # the tokens up to a cached block's end
        self.cached: dict[tuple, int] = {}

    def _take(self):
        block_id = self.free.pop(0)
        prefix = self.prefix_of[block_id]
        if prefix is not None and self.cached.get(prefix) == block_id:
            del self.cached[prefix]
        self.prefix_of[block_id], self.ref_counts[block_id] = None, 1
        return block_id

    def allocate(self, token_ids):
        """The block table and how many of its blocks were hits, or None (changing nothing) if it does not fit."""
        hit = []
        for i in range((len(token_ids) - 1) // self.block_size):  # the last token is always computed
            block_id = self.cached.get(tuple(token_ids[:(i + 1) * self.block_size]))
            if block_id is None:
                break
            hit.append(block_id)
        num_blocks = -(-len(token_ids) // self.block_size)
        if num_blocks - sum(self.ref_counts[b] > 0 for b in hit) > len(self.free):
            return None
        for block_id in hit:
            if self.ref_counts[block_id] == 0:
                self.free.remove(block_id)
            self.ref_counts[block_id] += 1
        return hit + [self._take() for _ in range(num_blocks - len(hit))], len(hit)

    def deallocate(self, block_table):
        for block_id in reversed(block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free.append(block_id)

    def grow(self, block_table, num_tokens):
        while len(block_table) * self.block_size < num_tokens:
            block_table.append(self._take())

    def cache_computed(self, block_table, token_ids, num_computed):
        for i in range(num_computed // self.block_size):
            if self.prefix_of[block_table[i]] is None:
                prefix = tuple(token_ids[:(i + 1) * self.block_size])
                self.prefix_of[block_table[i]] = prefix
                self.cached[prefix] = block_table[i]


PIECES = st.sampled_from([[1, 2], [1, 2, 3], [3], [2, 2, 2, 2], [4, 1]])  # shared prefixes, hits and misses


@settings(max_examples=300, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(2, 12), data=st.data())
def test_block_manager_matches_the_reference(block_size, num_blocks, data):
    bm, reference = BlockManager(num_blocks, block_size), ReferenceBlocks(num_blocks, block_size)
    waiting, first_hits, running = [], {}, []  # running: (seq, the reference's block table)
    for _ in range(data.draw(st.integers(1, 60))):
        action = data.draw(st.sampled_from(["new", "admit", "step", "free"]))
        if action == "new":
            waiting.append(Sequence(sum(data.draw(st.lists(PIECES, min_size=1, max_size=6)), [])))
        elif action == "admit" and waiting:
            seq = waiting.pop(data.draw(st.integers(0, len(waiting) - 1)))
            expected = reference.allocate(seq.token_ids)
            assert bm.allocate(seq) == (expected is not None)
            if expected is None:
                waiting.append(seq)
                continue
            table, num_hits = expected
            assert seq.block_table == table and seq.num_computed_tokens == num_hits * block_size
            first_hits.setdefault(seq, num_hits)  # the hits reported are those of its first admission
            assert seq.num_cached_tokens == first_hits[seq] * block_size
            running.append((seq, table))
        elif action == "step" and running:  # compute some tokens; at the end, sample one
            seq, table = running[data.draw(st.integers(0, len(running) - 1))]
            num_new = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens))
            if not bm.can_append(seq, num_new):
                continue
            bm.append_slots(seq, num_new)
            reference.grow(table, seq.num_computed_tokens + num_new)
            before, seq.num_computed_tokens = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            bm.hash_computed_blocks(seq, before)
            reference.cache_computed(table, seq.token_ids, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(data.draw(st.integers(1, 4)))
        elif action == "free" and running:  # a finish, or a preemption that comes back with its history
            seq, table = running.pop(data.draw(st.integers(0, len(running) - 1)))
            bm.deallocate(seq)
            reference.deallocate(table)
            if data.draw(st.booleans()):
                waiting.append(seq)
        for seq, table in running:
            assert seq.block_table == table
        assert free_order(bm) == reference.free
        assert [block.ref_count for block in every_block(bm)] == reference.ref_counts
        assert sorted(bm.hash_to_block_id.values()) == sorted(reference.cached.values())
        assert [block.hash != -1 for block in every_block(bm)] == [p is not None for p in reference.prefix_of]
