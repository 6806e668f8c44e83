"""The flash-attn backend: paged attention through the flash-attention kernels, the KV store through Triton.

Contract: `nanovllm.layers.attention`'s; block table rows are int32, padded with -1. Attention is causal, aligned
to the end of the context.

Two kernel families, picked once when the backend is built:
- "fa4": flash-attn-4, `flash_attn.cute.flash_attn_varlen_func`, on Hopper/Blackwell (sm 9x-11x). One call per
  batch, whatever mixes of prefill and decode it holds: `page_table` = block tables, `seqused_k` = context
  lengths (`cu_seqlens_k` cannot be combined with `page_table`). Any block size.
- "fa2": the flash-attn 2 API (`flash_attn_varlen_func` with `block_table`, `flash_attn_with_kvcache` for
  batches of single-token queries). Its paged KV needs a block size that is a multiple of 256.

With `triton_decode=True` (attention_backend="triton-decode"), decode-only steps go to the Triton split-KV kernel
(`nanovllm.layers.triton_attention`) instead, on the GPUs where it measured faster, and so do prefill and mixed
steps of at most `triton_varlen_tokens` tokens besides their leading decodes (the Triton varlen kernel, with
`split_decodes`): flash-attn-4 spends far more host time per call than its kernel takes on a small step, and a
piecewise-graph step calls attention once per layer. Larger steps keep flash-attn. Neither family reads an FP8
cache.

The kernels only read the block-table entries of blocks below `ceil(context_len / block_size)`, so the -1
padding is passed as it is. FA4 reads whole pages when a page is exactly one key tile (block size 128 on
sm90 with head_dim <= 128): the rows past a sequence's end in its last block must then hold finite values,
which a zero-initialised cache guarantees.
"""
import os
from functools import cache

import torch
import torch.nn.functional as F

from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers import triton_kvstore
from nanovllm.layers.triton_guard import num_sms

FA2_BLOCK_MULTIPLE = 256
MAX_HEAD_DIM = 256
# GPUs (compute capability) where benchmarks/decode_attention.py measured the Triton decode kernel faster than
# flash-attn-4's: H200 (sm90): faster at 61 of its 72 shapes, even at 5 long ones, 2-3 us slower at the 6
# launch-bound ones (1 or 8 sequences of 128 tokens). A captured graph is per batch size,
# and the contexts it will see are unknown, so the choice is per GPU: Triton for every decode step.
TRITON_DECODE_FASTER_ON = {(9, 0)}
# Prefill and mixed steps of at most this many tokens go to the Triton varlen kernel with triton_decode (0: none);
# NANOVLLM_TRITON_VARLEN_TOKENS overrides it, for comparison.
TRITON_VARLEN_TOKENS = 2048


def triton_decode_measured_faster() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() in TRITON_DECODE_FASTER_ON


@cache
def _import_family(family: str):
    """The family's kernels and None, or None and why they do not import (importing FA4 takes seconds: once)."""
    try:
        if family == "fa4":
            from flash_attn.cute import flash_attn_varlen_func
            return (flash_attn_varlen_func,), None
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        return (flash_attn_varlen_func, flash_attn_with_kvcache), None
    except Exception as e:  # not installed, or a build that cannot load here
        return None, f"{type(e).__name__}: {e}"


def _unusable_reason(family: str) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if family == "fa4" and major not in (9, 10, 11):
        return f"flash-attn-4's paged attention needs sm90-sm110 (Hopper/Blackwell); this GPU is sm{major}{minor}"
    if family == "fa2" and major < 8:
        return f"flash-attn 2 needs sm80 or newer; this GPU is sm{major}{minor}"
    return _import_family(family)[1]


def flash_attn_available() -> str | None:
    """The flash-attn family this machine can use, "fa4" before "fa2", or None."""
    for family in ("fa4", "fa2"):
        if _unusable_reason(family) is None:
            return family
    return None


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"
    supports_cuda_graphs = True  # forward reads only device tensors and fixed host integers
    fuses_rope_store = True  # its store is Triton's

    def __init__(self, family: str | None = None, triton_decode: bool = False,
                 triton_varlen_tokens: int | None = None):
        if family not in (None, "fa4", "fa2"):
            raise ValueError(f"flash-attn family={family!r} must be 'fa4', 'fa2' or None (the best available)")
        if family is None:
            family = flash_attn_available()
            if family is None:
                reasons = "; ".join(f"{f}: {_unusable_reason(f)}" for f in ("fa4", "fa2"))
                raise ValueError("attention_backend='flash-attn' needs CUDA and flash-attn-4 "
                                 f"(flash_attn.cute) or flash-attn 2 (flash_attn); {reasons}")
        elif (reason := _unusable_reason(family)) is not None:
            raise ValueError(f"flash-attn family {family!r} is unusable here: {reason}")
        self.family = family
        self._kernels = _import_family(family)[0]
        self._triton = None
        self.triton_varlen_tokens = 0
        if triton_decode:
            from nanovllm.layers import triton_attention
            from nanovllm.layers.triton_guard import triton_available
            if not triton_available():
                raise ValueError("attention_backend='triton-decode' needs a working Triton")
            self.name, self._triton = "triton-decode", triton_attention
            if triton_varlen_tokens is None:
                triton_varlen_tokens = int(os.environ.get("NANOVLLM_TRITON_VARLEN_TOKENS", TRITON_VARLEN_TOKENS))
            self.triton_varlen_tokens = self.varlen_graph_tokens = triton_varlen_tokens

    def check(self, block_size: int, head_dim: int, kv_cache_dtype: torch.dtype):
        super().check(block_size, head_dim, kv_cache_dtype)
        if head_dim % 8 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"the flash-attn backend needs head_dim to be a multiple of 8 and at most "
                             f"{MAX_HEAD_DIM}; the model has head_dim={head_dim}")
        if self.family == "fa2" and block_size % FA2_BLOCK_MULTIPLE:
            raise ValueError(f"kvcache_block_size={block_size}: flash-attn 2 (FA2) paged attention needs a "
                             f"block size that is a multiple of {FA2_BLOCK_MULTIPLE}")

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        triton_kvstore.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def decode_context_bounds(self, batch, num_kv_heads, kv_itemsize, device):
        if self._triton is None:  # (flash-attn's own decode takes no bound)
            return []
        return self._triton.decode_context_bounds(batch, num_kv_heads, num_sms(device), kv_itemsize)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        if not k_cache.numel():
            return self._forward_without_cache(q, k, v, meta, scale)
        # triton-decode: decode steps, and steps of at most triton_varlen_tokens tokens besides their leading
        # decodes, on the Triton kernels; larger ones on flash-attn
        if self._triton is not None and (meta.max_seqlen_q == 1
                                         or q.size(0) - meta.num_decodes <= self.triton_varlen_tokens):
            return self._triton.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
        if meta.max_seqlen_q == 1 and self.family == "fa2":  # decode: one query per sequence, FA2's split-KV kernel
            out = self._kernels[1](q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                   block_table=meta.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        return self._varlen(q, k_cache, v_cache, meta, scale)

    def _varlen(self, q, k_cache, v_cache, meta, scale):
        """Any step through the family's varlen kernel."""
        varlen = self._kernels[0]
        if self.family == "fa4":
            # No max_seqlen_k: FA4 then bounds it by the block-table width, which still holds when a captured
            # CUDA graph is replayed with longer contexts (a host integer would be frozen at capture).
            out, _ = varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                            seqused_k=meta.context_lens, page_table=meta.block_tables,
                            softmax_scale=scale, causal=True)
            return out
        # FA2's varlen kernel takes key lengths as cumulative offsets, even with a block table
        cu_seqlens_k = F.pad(meta.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                      softmax_scale=scale, causal=True, block_table=meta.block_tables)

    def _forward_without_cache(self, q, k, v, meta, scale):
        """A warm-up run before the cache exists: each sequence attends over this step's own tokens."""
        cu_seqlens = meta.cu_seqlens_q
        if self.family == "fa4":
            out, _ = self._kernels[0](q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                      max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_q,
                                      softmax_scale=scale, causal=True)
            return out
        return self._kernels[0](q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_q,
                                softmax_scale=scale, causal=True)
