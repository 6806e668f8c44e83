"""Which sequences run in the next step, and how many tokens each computes.

One model of work: a running sequence has `num_tokens - num_computed_tokens` tokens left to compute; a
decode has one left, a prefill more. Two policies share it:
- mixed (default, as vLLM): every step gives running sequences their tokens first (decodes, and the rest of a
  chunked prompt), then admits waiting prompts into what is left of the token budget, chunking the last one;
- prefill-first (nano-vllm's, `prefill_first=True`): a step prefills while prompts wait, else it decodes.
When KV blocks run out, the newest running sequence is preempted and recomputed later.
A sequence ends on EOS or one of its stop token ids (not before `min_tokens`), or at `max_tokens` or
`max_model_len`; stop strings are the engine's to find, since they need text.

A step's bookkeeping has two halves, so that the engine can schedule the next step before this one's
tokens are known (overlap scheduling): `launched` when its inputs are on their way (the KV it computes
counts as computed; each sampling sequence gets a PENDING last token), `complete` when its tokens arrive
(fill them in, finish sequences, hash the blocks it filled). A sequence with a pending token is scheduled as
a decode of that token, unless the token certainly ends it (max_tokens, max_model_len); if the token turns
out to end it otherwise (EOS, a stop), the next step's work for it is dropped. `postprocess` is both
halves at once.
"""
from collections import deque
from itertools import repeat
from typing import Callable

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:

    def __init__(self, config: Config, on_release: Callable[[Sequence], None] = lambda seq: None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.prefill_first = config.prefill_first
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.on_release = on_release  # told of each sequence that stops running: ended, aborted or preempted

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def abort(self, seq: Sequence):
        """Drop a sequence wherever it is and free its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.drop_pending()
        self.on_release(seq)

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set `num_scheduled_tokens` on each."""
        if self.prefill_first:
            scheduled = self._schedule_prefill()
            return scheduled if scheduled else self._schedule_decode()
        scheduled = self._schedule_running(self.max_num_batched_tokens)
        budget = self.max_num_batched_tokens - sum(seq.num_scheduled_tokens for seq in scheduled)
        return scheduled + self._admit_waiting(budget)

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled, budget = [], self.max_num_batched_tokens
        for seq in self.running:  # a prompt chunked in an earlier step goes on first
            if budget and seq.num_tokens - seq.num_computed_tokens > 1:
                budget -= self._take(seq, budget)
                scheduled.append(seq)
        return scheduled + self._admit_waiting(budget)

    def _admit_waiting(self, budget: int) -> list[Sequence]:
        scheduled = []
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.is_pending or not self.block_manager.allocate(seq):  # a preempted one waits for its token
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._take(seq, budget)
            scheduled.append(seq)
        return scheduled

    def _schedule_running(self, budget: int) -> list[Sequence]:
        """Running sequences in order, each with what it has left (capped by the budget)."""
        scheduled, i = [], 0
        while i < len(self.running) and budget:
            seq = self.running[i]
            i += 1
            if seq.is_pending and self._reaches_length(seq):  # its pending token ends it: nothing to compute
                continue
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    return scheduled
            self.block_manager.append_slots(seq, num_tokens)
            seq.num_scheduled_tokens = num_tokens
            budget -= num_tokens
            scheduled.append(seq)
        return scheduled

    def _reaches_length(self, seq: Sequence) -> bool:
        limit = seq.params.max_tokens
        return seq.num_tokens >= self.max_model_len or limit is not None and seq.num_completion_tokens >= limit

    @staticmethod
    def _take(seq: Sequence, budget: int) -> int:
        seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
        return seq.num_scheduled_tokens

    def _schedule_decode(self) -> list[Sequence]:
        # every running sequence has one token left; the token budget still bounds the step
        return self._schedule_running(min(len(self.running), self.max_num_batched_tokens))

    def _preempt(self, seq: Sequence):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.on_release(seq)

    def launched(self, seqs: list[Sequence]) -> list[tuple]:
        """A step computing `seqs` is on its way: their scheduled KV counts as computed. Returns what
        `complete` needs to hash the blocks it fills."""
        filled = []
        for seq in seqs:
            before = seq.num_computed_tokens
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            filled.append((seq, seq.block_table, before, seq.num_computed_tokens))
        return filled

    def complete(self, sampled: list[Sequence], filled: list[tuple], token_ids: list[int],
                 logprobs: list[dict[int, float] | None] | None = None) -> tuple[list[Sequence], list[Sequence]]:
        """A launched step's tokens arrived (one per sequence of `sampled`, in order): fill in the pending
        tokens, end sequences, hash the blocks the step filled. Returns the sequences that took a token and
        those that finished. A sequence that ended or was aborted meanwhile takes nothing."""
        for seq, block_table, num_computed_before, num_computed_after in filled:
            if seq.block_table is block_table and not seq.is_finished:  # not preempted or freed meanwhile
                self.block_manager.hash_computed_blocks(seq, num_computed_before, num_computed_after)
        took, finished = [], []
        for seq, token_id, token_logprobs in zip(sampled, token_ids, logprobs or repeat(None)):
            if seq.is_finished:
                continue
            seq.fill_pending(token_id, token_logprobs)
            took.append(seq)
            params = seq.params
            is_eos = not params.ignore_eos and token_id in self.eos_token_ids
            if self._reaches_length(seq):  # first, as vLLM v1: EOS as the last allowed token ends it "length"
                self.finish(seq, "length")
            elif (is_eos or token_id in params.stop_token_ids) and seq.num_completion_tokens >= params.min_tokens:
                seq.stop_reason = None if is_eos else token_id  # as vLLM: None for EOS
                self.finish(seq, "stop")
            else:
                continue
            finished.append(seq)
        return took, finished

    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list[dict[int, float] | None] | None = None) -> list[Sequence]:
        """Both halves of a step whose tokens are known at once; returns the sequences it finished."""
        sampled = [seq for seq in seqs if seq.samples_this_step]
        filled = self.launched(seqs)
        for row, seq in enumerate(sampled):
            seq.append_pending(row)
        return self.complete(sampled, filled, token_ids, logprobs)[1]

    def finish(self, seq: Sequence, reason: str):
        """End a sequence (also from outside, when a stop string matched) and free its blocks."""
        seq.finish_reason = reason
        self.abort(seq)
