"""The state of repetition, frequency and presence penalties on rank 0's device: one slot per penalized sequence.

A slot holds a sequence's token ids (prompt, then output) and how often each token of the vocabulary was
generated. It is built once from the host's tokens, when the sequence first samples after its admission; from
then on each step writes its sampled tokens into the slots on the device (`append`), so a token whose value the
host does not know yet (pending, with overlap scheduling) is already counted, and no step waits for it. A step
reads only its rows' histories ([rows, longest history]), never rebuilds a [rows, vocabulary] mask.

A slot belongs to a running sequence: the scheduler releases it when the sequence finishes, is aborted or is
preempted (a preempted sequence keeps its tokens; it gets a slot rebuilt from them when it samples again, once
its pending token is known), so there are at most max_num_seqs slots. The tensors are allocated on first use
and grow by doubling; a slot takes 4 bytes per vocabulary token and 4 per position: 610 KiB for Qwen3's
151,936 tokens and max_model_len 4,096, so 305 MiB at the default max_num_seqs of 512.
"""
from itertools import chain
from typing import Callable

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Penalties

ToDevice = Callable[[np.ndarray], torch.Tensor]


class PenaltySlots:

    def __init__(self, vocab_size: int, max_model_len: int, max_slots: int, device: torch.device):
        self.max_slots = max_slots
        self.slot_of: dict[int, int] = {}  # seq_id -> its slot
        self.free: list[int] = []
        # one more position than max_model_len: a prompt of max_model_len tokens still samples one
        self.token_ids = torch.zeros(0, max_model_len + 1, dtype=torch.int32, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)

    def gather(self, seqs: list[Sequence], rows: torch.Tensor, to_device: ToDevice) -> Penalties:
        """The penalties of `seqs`, rows `rows` of this step's batch. A sequence without a slot gets one now."""
        new = [seq for seq in seqs if seq.seq_id not in self.slot_of]
        if new:
            self._build(new, to_device)
        lengths = np.array([seq.num_tokens for seq in seqs], dtype=np.int64)  # a pending token is in its slot
        slots, positions = to_device(np.array([self.slot_of[seq.seq_id] for seq in seqs])), to_device(lengths)
        token_ids = self.token_ids[slots, :int(lengths.max())].long()
        past_end = torch.arange(token_ids.size(1), device=token_ids.device) >= positions.unsqueeze(1)
        token_ids = torch.where(past_end, token_ids[:, :1], token_ids)  # a repeat of a token of its own

        def column(name: str) -> torch.Tensor:
            return to_device(np.array([getattr(seq.params, name) for seq in seqs], dtype=np.float32))

        return Penalties(rows, token_ids, self.counts[slots.unsqueeze(1), token_ids], column("repetition_penalty"),
                         column("frequency_penalty"), column("presence_penalty"), slots, positions)

    def append(self, penalties: Penalties, sampled: torch.Tensor):
        """Write a step's sampled tokens (all its rows', on the device) into its penalized rows' slots."""
        tokens = sampled[penalties.rows]
        self.token_ids[penalties.slots, penalties.positions] = tokens.int()
        self.counts.index_put_((penalties.slots, tokens), torch.ones_like(tokens, dtype=torch.float32),
                               accumulate=True)

    def release(self, seq: Sequence):
        """The sequence stopped running (finished, aborted or preempted): its slot, if any, is free."""
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def _build(self, seqs: list[Sequence], to_device: ToDevice):
        """Fill new slots from the sequences' tokens, which the host knows: no pending one."""
        assert not any(seq.is_pending for seq in seqs)
        if len(self.free) < len(seqs):
            self._grow(len(self.slot_of) + len(seqs))
        slots = np.array([self.free.pop() for _ in seqs], dtype=np.int64)
        self.slot_of.update((seq.seq_id, int(slot)) for seq, slot in zip(seqs, slots))
        lengths = np.array([seq.num_tokens for seq in seqs], dtype=np.int64)
        rows = np.repeat(slots, lengths)
        positions = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        token_ids = np.fromiter(chain.from_iterable(seq.token_ids for seq in seqs), np.int64, lengths.sum())
        output = positions >= np.repeat([seq.num_prompt_tokens for seq in seqs], lengths)
        self.token_ids[to_device(rows), to_device(positions)] = to_device(token_ids.astype(np.int32))
        self.counts[to_device(slots)] = 0
        self.counts.index_put_((to_device(rows[output]), to_device(token_ids[output])),
                               torch.ones(int(output.sum()), device=self.counts.device), accumulate=True)

    def _grow(self, num_slots: int):
        old = self.counts.size(0)
        new = min(max(num_slots, 2 * old), self.max_slots)
        assert num_slots <= new, f"{num_slots} penalized sequences run, more than max_num_seqs={self.max_slots}"
        self.token_ids = torch.cat([self.token_ids, self.token_ids.new_zeros(new - old, self.token_ids.size(1))])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.counts.size(1))])
        self.free.extend(range(new - 1, old - 1, -1))  # the lowest first
