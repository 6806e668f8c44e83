"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

A vocabulary that does not divide by the tensor-parallel size is padded up to one that does; the padding
rows are zero, never looked up, and cut off the logits, so they are never sampled.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import copy_weight
from nanovllm.utils.parallel import tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        rows = max(min(self.vocab_end_idx, self.num_embeddings) - self.vocab_start_idx, 0)
        if loaded_weight.size(0) != self.num_embeddings:
            raise ValueError(f"{loaded_weight.size(0)} rows, but vocab_size={self.num_embeddings}")
        copy_weight(param.data[:rows], loaded_weight.narrow(0, self.vocab_start_idx, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(x)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = self._rows(mask * (x - self.vocab_start_idx)) * mask.unsqueeze(1)
        dist.all_reduce(y)
        return y

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """The weight's rows at x: on CUDA by indexing (`F.embedding`'s kernel walks up to 16 ids one after another,
        2-4x slower at 4-16 rows), on CPU by F.embedding (3x faster there at 512 ids)."""
        return self.weight[x] if x.is_cuda else F.embedding(x, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of the given hidden states; the full vocabulary ends up on rank 0 only (None elsewhere)."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """`out`: where rank 0 writes its logits (a decode graph's buffer: no copy after the product)."""
        if self.tp_size == 1:
            return F.linear(x, self.weight) if out is None else torch.mm(x, self.weight.t(), out=out)
        logits = F.linear(x, self.weight)
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, 0)
        if self.tp_rank != 0:
            return None
        logits = torch.cat(parts, -1)[:, :self.num_embeddings]
        return logits if out is None else out.copy_(logits)
