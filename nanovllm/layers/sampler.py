"""Sampling on the whole batch with tensor ops, one row per sampled sequence.

`forward` is the fast path (plain temperature or greedy rows): one pass over the logits, argmax(logits / T -
log E), on CUDA the Triton kernel of `triton_sampler.py` (which a decode CUDA graph captures). `sample` adds,
per row: penalties, a `min_tokens` ban, min-p, top-k, top-p, per-request seeds and logprobs, in vLLM's order.
Draws use the exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, with no host sync.
"""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.triton_sampler import sample_plain


@dataclass
class Penalties:
    """Repetition, frequency and presence penalties of some rows of a batch (vLLM's definitions), read from
    each row's history: only the tokens of its prompt and output change."""
    rows: torch.Tensor  # [m] int64: rows of the batch
    token_ids: torch.Tensor  # [m, length] int64: each row's prompt and output tokens (repeats are harmless)
    output_counts: torch.Tensor  # [m, length] float32: times token_ids[i, j] was generated
    repetition_penalty: torch.Tensor  # [m] float32, 1 where off
    frequency_penalty: torch.Tensor  # [m] float32
    presence_penalty: torch.Tensor  # [m] float32
    # where the engine keeps each row's history, and where this step's token goes in it (not the sampler's)
    slots: torch.Tensor  # [m] int64
    positions: torch.Tensor  # [m] int64


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the logits' device. A field is None when no row of the batch uses it."""
    temperatures: torch.Tensor  # [n] float32, 0 = greedy
    top_k: torch.Tensor | None = None  # [n] int64, vocab size where off
    top_p: torch.Tensor | None = None  # [n] float32, > 1 where off
    min_p: torch.Tensor | None = None  # [n] float32, 0 where off
    banned: torch.Tensor | None = None  # [n, vocab] bool: EOS and stop tokens of rows short of min_tokens
    penalties: Penalties | None = None
    seeds: list[tuple[int, int]] | None = None  # (row, seed of this row's draw at this step)
    num_logprobs: list[int | None] | None = None  # per row: how many top logprobs, None = none

    @property
    def is_plain(self) -> bool:
        return all(getattr(self, name) is None for name in self.__dataclass_fields__ if name != "temperatures")


class Sampler(nn.Module):

    def __init__(self, rng_state: torch.Tensor | None = None):
        """rng_state: [seed, step] int64 on a CUDA device (`triton_sampler.make_rng_state`): plain rows are then
        drawn by the Triton kernel from that device counter. None: from the generator `forward` is given."""
        super().__init__()
        self.rng_state = rng_state
        self.seeded_generator: torch.Generator | None = None

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-row temperature sampling; a temperature of 0 picks the argmax (greedy)."""
        if self.rng_state is not None:
            return sample_plain(logits, temperatures, self.rng_state)
        logits = logits.float()
        greedy = temperatures == 0
        noise = torch.empty_like(logits).exponential_(1, generator=generator)
        scores = logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1) - noise.log_()
        return torch.where(greedy, logits.argmax(dim=-1), scores.argmax(dim=-1))

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Token ids, and the tensors of the logprobs asked for (None when no row asked; see
        `gather_logprobs`), on the logits' device: nothing here waits for the device."""
        if batch.is_plain:
            return self(logits, batch.temperatures, generator), None
        raw = logits.float()
        logits = apply_penalties(raw, batch)
        greedy = batch.temperatures == 0
        scaled = logits / torch.where(greedy, 1.0, batch.temperatures).unsqueeze(1)
        scaled = apply_min_p_top_k_top_p(scaled, batch.min_p, batch.top_k, batch.top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
        for row, seed in batch.seeds or ():
            if self.seeded_generator is None:
                self.seeded_generator = torch.Generator(probs.device)
            noise[row].exponential_(1, generator=self.seeded_generator.manual_seed(seed))
        sampled = torch.where(greedy, logits.argmax(dim=-1), probs.div_(noise).argmax(dim=-1))
        if batch.num_logprobs is None:
            return sampled, None
        return sampled, gather_logprobs(raw, sampled, batch.num_logprobs)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The `min_tokens` ban, then repetition, frequency and presence penalties (vLLM's definitions)."""
    if batch.banned is not None:
        logits = logits.masked_fill(batch.banned, float("-inf"))
    p = batch.penalties
    if p is not None:  # each (row, token) of a history takes one value, wherever the token repeats
        index = (p.rows.unsqueeze(1).expand_as(p.token_ids), p.token_ids)
        values, repetition = logits[index], p.repetition_penalty.unsqueeze(1)
        values = torch.where(values > 0, values / repetition, values * repetition)
        values = (values - p.frequency_penalty.unsqueeze(1) * p.output_counts
                  - p.presence_penalty.unsqueeze(1) * (p.output_counts > 0))
        logits = logits.index_put(index, values)
    return logits


def apply_min_p_top_k_top_p(logits: torch.Tensor, min_p: torch.Tensor | None, top_k: torch.Tensor | None,
                            top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what min-p, then top-k, then top-p drop from temperature-scaled logits."""
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.size(1), device=logits.device)
        sorted_logits.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # a token stays while the more likely ones hold < top_p
        sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the raw logits: the sampled tokens' logprobs [n], and the ids and logprobs of the k likeliest
    tokens [n, k], k the largest number any row asked for."""
    logprobs = torch.log_softmax(logits, dim=-1)
    k = max(n for n in num_logprobs if n is not None)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1), top_ids, top_values


def logprob_dicts(token_ids: list[int], sampled_values: list[float], top_ids: list[list[int]],
                  top_values: list[list[float]], num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
    """Per row that asked: {sampled id: its logprob, then the top-k ids by logprob}."""
    out = []
    for n, token_id, value, ids, values in zip(num_logprobs, token_ids, sampled_values, top_ids, top_values):
        if n is None:
            out.append(None)
            continue
        entry = {token_id: value}
        for i, v in zip(ids[:n], values[:n]):
            entry.setdefault(i, v)
        out.append(entry)
    return out
