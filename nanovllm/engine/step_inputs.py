"""A step's inputs on the host, as numpy arrays: what the model runner sends to the device in one copy (or a
CUDA graph replay copies into its static buffers)."""
from dataclasses import dataclass

import numpy as np

from nanovllm.engine.sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    input_ids: np.ndarray  # [num_tokens] int64; PENDING (-1) where the token is the last step's, still on the device
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64: cache slot of each token (-1: write nothing)
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, zero-padded
    context_lens: np.ndarray  # [num_seqs] int32: tokens in the cache after this step
    query_lens: np.ndarray  # [num_seqs] int64: tokens this step computes
    cu_seqlens_q: np.ndarray  # [num_seqs + 1] int32
    logits_indices: np.ndarray  # [num_samples] int64: the token whose logits each sampling sequence samples from
    pending_rows: np.ndarray  # [num_seqs] int64: the row of the last step's samples that holds the sequence's
    # pending token (its one scheduled token), -1 where none

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token (a CUDA graph can run the step)."""
        return len(self.input_ids) == self.num_seqs

    @property
    def num_leading_decodes(self) -> int:
        """How many sequences from the first compute one token each (the scheduler puts decodes first)."""
        longer = np.flatnonzero(self.query_lens != 1)
        return int(longer[0]) if len(longer) else self.num_seqs


def step_inputs(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Inputs of a varlen batch: each sequence computes its scheduled tokens."""
    query_lens = np.array([seq.num_scheduled_tokens for seq in seqs], dtype=np.int64)
    starts = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
    context_lens = starts + query_lens
    cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    seq_index = np.repeat(np.arange(len(seqs)), query_lens)
    positions = np.arange(num_tokens) - cu_seqlens_q[seq_index] + starts[seq_index]
    input_ids = np.fromiter((t for seq in seqs for t in seq.scheduled_token_ids), np.int64, num_tokens)
    max_blocks = max(len(seq.block_table) for seq in seqs)
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)  # padding is never read
    for i, seq in enumerate(seqs):
        block_tables[i, :len(seq.block_table)] = seq.block_table
    if max_blocks:
        blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size
    else:  # warm-up: no cache yet
        slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
    samples = np.array([seq.samples_this_step for seq in seqs], dtype=bool)
    return StepInputs(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
        context_lens=context_lens.astype(np.int32), query_lens=query_lens,
        cu_seqlens_q=cu_seqlens_q.astype(np.int32), logits_indices=cu_seqlens_q[1:][samples] - 1,
        pending_rows=np.fromiter((seq.pending_row for seq in seqs), np.int64, len(seqs)))
