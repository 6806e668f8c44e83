"""Which sequences run in the next step, and how many tokens each computes.

One model of work: a running sequence has `num_tokens - num_computed_tokens` tokens left to compute; a
decode has one left, a prefill more. Two policies share it:
- mixed (default, as vLLM): every step gives running sequences their tokens first (decodes, and the rest of a
  chunked prompt), then admits waiting prompts into what is left of the token budget, chunking the last one;
- prefill-first (nano-vllm's, `prefill_first=True`): a step prefills while prompts wait, else it decodes.
When KV blocks run out, the newest running sequence is preempted and recomputed later.
A sequence ends on EOS or one of its stop token ids (not before `min_tokens`), or at `max_tokens` or
`max_model_len`; stop strings are the engine's to find, since they need text.
"""
from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:

    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.prefill_first = config.prefill_first
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

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
            if not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._take(seq, budget)
            scheduled.append(seq)
        return scheduled

    def _schedule_running(self, budget: int) -> list[Sequence]:
        """Running sequences in order, each with what it has left (capped by the budget)."""
        scheduled = []
        while len(scheduled) < len(self.running) and budget:
            seq = self.running[len(scheduled)]
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

    @staticmethod
    def _take(seq: Sequence, budget: int) -> int:
        seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
        return seq.num_scheduled_tokens

    def _schedule_decode(self) -> list[Sequence]:
        return self._schedule_running(len(self.running))  # every running sequence has one token left

    def _preempt(self, seq: Sequence):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list[dict[int, float] | None] | None = None) -> list[Sequence]:
        """Account for a finished step: advance, hash full blocks, append samples; returns finished ones."""
        sampled = zip(token_ids, logprobs or [None] * len(token_ids))
        finished = []
        for seq in seqs:
            samples = seq.samples_this_step
            num_computed_before = seq.num_computed_tokens
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_computed_blocks(seq, num_computed_before)
            if not samples:
                continue
            token_id, token_logprobs = next(sampled)
            seq.append_token(token_id, token_logprobs)
            params = seq.params
            is_eos = not params.ignore_eos and token_id in self.eos_token_ids
            if (is_eos or token_id in params.stop_token_ids) and seq.num_completion_tokens >= params.min_tokens:
                seq.stop_reason = None if is_eos else token_id  # as vLLM: None for EOS
                self.finish(seq, "stop")
            elif seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
            else:
                continue
            finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str):
        """End a running sequence (also from outside, when a stop string matched) and free its blocks."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
