"""Paged attention: the layer, the metadata it reads, and the backend interface with its registry.

The KV cache of one layer is a pair of `[num_blocks, block_size, num_kv_heads, head_dim]` tensors. A step's
batch is a set of query ranges over that cache (varlen): sequence i computes the tokens
`cu_seqlens_q[i]:cu_seqlens_q[i+1]`, which are the last ones of its `context_lens[i]` tokens. Prefill, prefill
after a cached prefix, and decode (one query token) are all this one case.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token (-1: write nothing)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    query_lens_host: list[int] | None = None  # host copies for backends that loop over sequences
    context_lens_host: list[int] | None = None


class AttentionBackend(ABC):
    """A kernel family for the KV-cache store and paged attention."""
    name: str
    supports_cuda_graphs = False  # True when forward reads only tensors (no host lists) and can be captured

    def check(self, block_size: int, head_dim: int):
        """Raise ValueError when this backend cannot run with these settings."""

    @abstractmethod
    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor): ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: this step's keys and values (already stored)."""


class TorchBackend(AttentionBackend):
    """Pure PyTorch, any device: the reference every other backend is tested against."""
    name = "torch"

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        query_lens = meta.query_lens_host
        context_lens = meta.context_lens_host
        num_heads, num_kv_heads = q.size(1), k.size(1)
        out = torch.empty_like(q)
        start = 0
        for i, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
            end = start + query_len
            if k_cache.numel():
                block_size = k_cache.size(1)
                blocks = meta.block_tables[i, :(context_len + block_size - 1) // block_size]
                keys = k_cache[blocks].flatten(0, 1)[:context_len]
                values = v_cache[blocks].flatten(0, 1)[:context_len]
            else:  # no cache yet (a warm-up run): the context is this step's tokens
                keys, values = k[start:end], v[start:end]
            if num_heads != num_kv_heads:
                keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
                values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
            # query j sits at position context_len - query_len + j and sees every key up to it
            positions = torch.arange(context_len - query_len, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= positions[:, None]
            o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), keys.transpose(0, 1),
                                               values.transpose(0, 1), attn_mask=mask, scale=scale)
            out[start:end] = o.transpose(0, 1)
            start = end
        return out


BACKEND_NAMES = ("torch", "flash-attn")


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchBackend()
    if name == "flash-attn":
        from nanovllm.layers.flash_attention import FlashAttnBackend  # imports flash-attn only when asked for
        return FlashAttnBackend()
    raise ValueError(f"attention_backend={name!r} is unknown; valid ones are {['auto', *BACKEND_NAMES]}")


class Attention(nn.Module):
    """Stores this step's keys and values in the layer's cache, then attends over the cache."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])  # set by the model runner
        self.backend: AttentionBackend = TorchBackend()  # set by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel():
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return o.flatten(1, 2)
