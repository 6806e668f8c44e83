"""Scheduler, block manager and penalty slots under random operations, steps completing at once or a step later."""
from collections import Counter
from types import SimpleNamespace

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import compute_hash
from nanovllm.engine.penalty_slots import PenaltySlots
from nanovllm.engine.sampling_batch import build_sampling_batch
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING, Sequence, SequenceStatus
from nanovllm.layers.sampler import apply_penalties
from tests.conftest import free_order, full_rebuild_penalties

EOS, STOP = 1, 2
VOCAB = 64
PENALTIES = st.sampled_from([{}, dict(repetition_penalty=1.5), dict(frequency_penalty=0.5, presence_penalty=-0.25),
                             dict(repetition_penalty=0.7, frequency_penalty=-1.0, presence_penalty=2.0)])
# 4-token pieces: prompts share prefixes, the prefix cache gets hits
PROMPTS = st.builds(lambda pieces, tail: sum(pieces, []) + tail,
                    st.lists(st.sampled_from([[0, 3, 4, 5], [3, 3, 3, 3], [5, 4, 3, 0]]), max_size=4),
                    st.lists(st.integers(0, 5), min_size=1, max_size=5))


class SchedulerMachine(RuleBasedStateMachine):

    @initialize(block_size=st.sampled_from([4, 8]), num_blocks=st.integers(4, 16),
                budget=st.integers(4, 64), max_num_seqs=st.integers(2, 8), prefill_first=st.booleans(),
                overlap=st.booleans())
    def build(self, block_size, num_blocks, budget, max_num_seqs, prefill_first, overlap):
        config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, prefill_first=prefill_first,
                                 max_model_len=num_blocks * block_size, eos_token_ids=(EOS,),
                                 num_kvcache_blocks=num_blocks, kvcache_block_size=block_size)
        self.penalty_slots = PenaltySlots(VOCAB, config.max_model_len, max_num_seqs, torch.device("cpu"))
        self.scheduler = Scheduler(config, on_release=self.penalty_slots.release)
        self.block_size, self.num_blocks, self.overlap = block_size, num_blocks, overlap
        self.in_flight = None  # (sampled, filled, tokens) of a step pending
        self.live, self.ended = [], []  # live: added, not yet finished
        self.finished = Counter()

    @rule(prompt=PROMPTS, max_tokens=st.integers(1, 24), min_tokens=st.integers(0, 3), ignore_eos=st.booleans(),
          penalties=PENALTIES)
    def add(self, prompt, max_tokens, min_tokens, ignore_eos, penalties):
        prompt = prompt[:self.scheduler.max_model_len]  # the engine refuses longer prompts up front
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                ignore_eos=ignore_eos, stop_token_ids=[STOP], **penalties)
        seq = Sequence(prompt, params)
        self.scheduler.add(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        running_before = {seq.seq_id for seq in self.scheduler.running}
        seqs = self.scheduler.schedule()
        if self.scheduler.prefill_first:  # all prefill or all decode
            decodes = [seq.seq_id in running_before and seq.num_tokens - seq.num_computed_tokens == 1 for seq in seqs]
            assert all(decodes) or not any(decodes), "a prefill-first step mixes prompts and decodes"
        assert seqs or not self.scheduler.running or self.in_flight, "running sequences but nothing scheduled"
        assert sum(seq.num_scheduled_tokens for seq in seqs) <= self.scheduler.max_num_batched_tokens
        for seq in seqs:
            assert 0 < seq.num_scheduled_tokens <= seq.num_tokens - seq.num_computed_tokens
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens + seq.num_scheduled_tokens
            assert not seq.is_pending or seq.num_scheduled_tokens == 1  # a pending token is only decoded
            # not for a request its pending token surely ends
            assert not seq.is_pending or (seq.num_completion_tokens < seq.params.max_tokens
                                          and seq.num_tokens < self.scheduler.max_model_len)
        sampled = [seq for seq in seqs if seq.samples_this_step]
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(sampled), max_size=len(sampled)))
        if sampled:
            self._sample(data, sampled, tokens)
        launched = (sampled, self.scheduler.launched(seqs), tokens) if seqs else None
        if self.in_flight:
            self._complete(data, *self.in_flight)
        self.in_flight = launched
        if launched:
            for row, seq in enumerate(sampled):
                if not seq.is_finished:
                    seq.append_pending(row)
            if not self.overlap:
                self._complete(data, *launched)
                self.in_flight = None

    def _sample(self, data, sampled, tokens):
        """As rank 0's model runner samples: penalties from the slots (checked), then the step's tokens into them."""
        batch = build_sampling_batch(sampled, frozenset([EOS]), VOCAB, torch.from_numpy, self.penalty_slots)
        if batch.penalties is None:
            return
        histories = []
        for seq in sampled:  # the pending token's value from the step in flight
            token_ids = seq.token_ids[:-1] + [self.in_flight[2][seq.pending_row]] if seq.is_pending else seq.token_ids
            histories.append((token_ids[:seq.num_prompt_tokens], token_ids[seq.num_prompt_tokens:]))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
        logits = torch.tensor([-2.5, -1.0, 0.0, 0.5, 3.0])[torch.randint(5, (len(sampled), VOCAB), generator=gen)]
        if batch.banned is not None:  # min_tokens: the ban comes first
            logits = logits.masked_fill(batch.banned, float("-inf"))
            batch.banned = None
        expected = full_rebuild_penalties(logits, histories, [seq.params for seq in sampled])
        assert torch.equal(apply_penalties(logits, batch), expected)
        self.penalty_slots.append(batch.penalties, torch.tensor(tokens))

    def _complete(self, data, sampled, filled, tokens):
        took, done = self.scheduler.complete(sampled, filled, tokens)
        for seq in took:  # the length ends it first (as vLLM v1), then a stop token, unless before min_tokens
            params = seq.params
            stops = (seq.last_token == EOS and not params.ignore_eos) or seq.last_token in params.stop_token_ids
            if self.scheduler._reaches_length(seq):
                assert seq.is_finished and seq.finish_reason == "length"
            elif stops and seq.num_completion_tokens >= params.min_tokens:
                assert seq.is_finished and seq.finish_reason == "stop"
            elif stops:
                assert seq.finish_reason != "stop"
        # a stop string (not before min_tokens)
        for seq in took:
            if (not seq.is_finished and seq.num_completion_tokens >= seq.params.min_tokens
                    and data.draw(st.integers(0, 19)) == 0):
                seq.stop_reason = "a stop string"
                self.scheduler.finish(seq, "stop")
                done.append(seq)
        self._finish(done)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), now=st.integers(0, 3))
    def abort(self, data, now):
        if now:  # aborts rarer than steps
            return
        seq = data.draw(st.sampled_from(self.live))
        self.scheduler.abort(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self._finish([seq])

    def _finish(self, seqs):
        self.ended.extend(seqs)
        for seq in seqs:
            self.finished[seq.seq_id] += 1
            assert self.finished[seq.seq_id] == 1, f"sequence {seq.seq_id} finished twice"
            self.live.remove(seq)
            assert seq.is_finished and seq.block_table == []
            params, n = seq.params, seq.num_completion_tokens
            max_model_len = self.scheduler.max_model_len  # a prompt of that length still gets one token
            assert n <= params.max_tokens and seq.num_tokens <= max(max_model_len, seq.num_prompt_tokens + 1)
            if seq.finish_reason == "length":
                assert n == params.max_tokens or seq.num_tokens >= max_model_len
            elif seq.finish_reason == "stop":
                assert n >= params.min_tokens
                if seq.stop_reason is None:  # EOS
                    assert seq.last_token == EOS and not params.ignore_eos
                elif seq.stop_reason == STOP:
                    assert seq.last_token == STOP

    @invariant()
    def blocks_add_up(self):
        bm, s = self.scheduler.block_manager, self.scheduler
        free = free_order(bm)
        assert len(free) == len(set(free)), "a block is free twice"
        references = Counter(block_id for seq in s.running for block_id in seq.block_table)
        used = [block.block_id for block in bm.blocks if block.ref_count > 0]
        assert len(free) + len(used) == self.num_blocks
        assert set(free).isdisjoint(used)
        for block in bm.blocks:
            assert block.ref_count == references[block.block_id], f"block {block.block_id} ref count"

    @invariant()
    def prefix_cache_is_truthful(self):
        bm = self.scheduler.block_manager
        for h, block_id in bm.hash_to_block_id.items():
            block = bm.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == self.block_size
        for seq in self.scheduler.running:  # hashes chained over the blocks
            prefix = -1
            for i, block_id in enumerate(seq.block_table):
                block = bm.blocks[block_id]
                if block.hash == -1:
                    break
                assert (i + 1) * self.block_size <= seq.num_computed_tokens, "hashed before it was computed"
                assert block.token_ids == seq.block(i, self.block_size) and PENDING not in block.token_ids
                assert block.hash == compute_hash(block.token_ids, prefix)
                prefix = block.hash

    @invariant()
    def ended_requests_stay_ended(self):
        for seq in self.ended:  # no token is added to them, pending or not
            assert seq.is_finished and not seq.is_pending and seq.block_table == []
            assert seq.num_tokens == len(seq.token_ids) and PENDING not in seq.token_ids

    @invariant()
    def penalty_slots_belong_to_running_sequences(self):
        slot_of, free = self.penalty_slots.slot_of, self.penalty_slots.free
        assert len(set(slot_of.values())) == len(slot_of), "two sequences share a slot"
        assert set(slot_of.values()).isdisjoint(free) and len(free) == len(set(free))
        assert len(slot_of) + len(free) == self.penalty_slots.counts.size(0) <= self.scheduler.max_num_seqs
        # released on finish, abort, preemption
        assert set(slot_of) <= {seq.seq_id for seq in self.scheduler.running}

    @invariant()
    def queues_are_consistent(self):
        s = self.scheduler
        waiting, running = {seq.seq_id for seq in s.waiting}, {seq.seq_id for seq in s.running}
        assert not waiting & running and len(waiting) == len(s.waiting) and len(running) == len(s.running)
        assert waiting | running == {seq.seq_id for seq in self.live}
        assert len(s.running) <= s.max_num_seqs
        for seq in s.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in s.running:
            assert seq.status == SequenceStatus.RUNNING and seq.num_scheduled_tokens == 0
            assert seq.num_computed_tokens < seq.num_tokens <= len(seq.block_table) * self.block_size + 1


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)
test_scheduler_under_random_operations = SchedulerMachine.TestCase
