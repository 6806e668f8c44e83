"""The sampler's per-row inputs, built on rank 0 from the sequences that sample this step.

A batch in which every row is plain temperature (or greedy) sampling carries temperatures only, so the
sampler takes its fast path; anything else adds only the tensors that some row of the batch needs.
"""
from itertools import chain

import numpy as np
import torch

from nanovllm.engine.penalty_slots import PenaltySlots, ToDevice
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingBatch

GOLDEN = 0x9E3779B97F4A7C15  # spreads seeds apart before the position is added


def build_sampling_batch(seqs: list[Sequence], eos_token_ids: frozenset[int], vocab_size: int,
                         to_device: ToDevice, penalty_slots: PenaltySlots | None = None) -> SamplingBatch:
    """`penalty_slots` (the model runner's) hold the histories of penalized sequences."""
    params = [seq.params for seq in seqs]

    def column(values, dtype=np.float32) -> torch.Tensor:
        return to_device(np.array(values, dtype=dtype))

    batch = SamplingBatch(column([p.temperature for p in params]))
    if is_plain(seqs):
        return batch
    if any(p.top_k > 0 for p in params):
        batch.top_k = column([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], np.int64)
    if any(p.top_p < 1 for p in params):
        batch.top_p = column([p.top_p if p.top_p < 1 else 2.0 for p in params])  # > 1: keeps every token
    if any(p.min_p > 0 for p in params):
        batch.min_p = column([p.min_p for p in params])
    short = [seq.num_completion_tokens < seq.params.min_tokens for seq in seqs]
    if any(short):  # a request short of min_tokens cannot draw EOS or its stop tokens
        batch.banned = token_mask([
            [t for t in chain(p.stop_token_ids, () if p.ignore_eos else eos_token_ids) if t < vocab_size]
            if is_short else [] for p, is_short in zip(params, short)], vocab_size, to_device)
    penalized = [row for row, p in enumerate(params)
                 if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty]
    if penalized:
        batch.penalties = penalty_slots.gather([seqs[row] for row in penalized], column(penalized, np.int64),
                                               to_device)
    if any(p.seed is not None for p in params):
        batch.seeds = [(row, draw_seed(p.seed, seq.num_tokens))
                       for row, (seq, p) in enumerate(zip(seqs, params)) if p.seed is not None]
    if any(p.logprobs is not None for p in params):
        batch.num_logprobs = [p.logprobs for p in params]
    return batch


def draw_seed(seed: int, num_tokens: int) -> int:
    """The generator's seed for a seeded request's token after its first num_tokens: its seed and position only,
    so the draw is the same in any batch."""
    return (seed * GOLDEN + num_tokens) % (1 << 64)


def is_plain(seqs: list[Sequence]) -> bool:
    """Every row asks for temperature (or greedy) sampling only: the sampler's fast path."""
    return all(seq.plain_sampling for seq in seqs)


def token_mask(token_lists: list[list[int]], vocab_size: int, to_device: ToDevice) -> torch.Tensor:
    """[rows, vocab] bool, True at each row's tokens."""
    lengths = [len(tokens) for tokens in token_lists]
    rows = to_device(np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths))
    cols = to_device(np.fromiter(chain.from_iterable(token_lists), np.int64, sum(lengths)))
    mask = torch.zeros(len(token_lists), vocab_size, dtype=torch.bool, device=rows.device)
    mask[rows, cols] = True
    return mask
