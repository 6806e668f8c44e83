"""Paged attention: the layer, the metadata it reads, and the backend interface with its registry.

The KV cache of one layer is a pair of `[num_blocks, block_size, num_kv_heads, head_dim]` tensors. A step's
batch is a set of query ranges over that cache (varlen): sequence i computes the tokens
`cu_seqlens_q[i]:cu_seqlens_q[i+1]`, which are the last ones of its `context_lens[i]` tokens. Prefill, prefill
after a cached prefix, and decode (one query token) are all this one case.

The cache holds the model's dtype, or FP8 (`float8_e4m3fn`, vLLM's `kv_cache_dtype="fp8"`) with one scale for
keys and one for values per layer: the store writes `clamp(x / scale, -448, 448)` rounded to FP8, readers use
`fp8 * scale`. The scales are 1.0, vLLM's default for checkpoints without calibrated ones (why not per head:
benchmarks/decode_attention_notes.md). An FP8 cache whose blocks hold a multiple of VALUE_CHUNK tokens keeps its
values key-major in chunks (`value_chunk`): the Triton kernels' products take values along the keys, and 8-bit
values laid out along the dims had to be gathered a byte at a time.
"""
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn; the store saturates there (a cast would give NaN)
# keys a chunk of an FP8 cache's values (`value_chunk`): the Triton decode kernel 11-23% faster than over values laid
# out as the keys (decode notes, run 11). NANOVLLM_VALUE_CHUNK overrides it (0: never chunked)
VALUE_CHUNK = int(os.environ.get("NANOVLLM_VALUE_CHUNK", 64))


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
    num_decodes: int = 0  # leading sequences of one query token (the scheduler puts decodes first)
    # [programs, 2] int32 (sequence, query tile) of each program of a varlen step captured in a CUDA graph, whose
    # grid cannot follow the step's shape (`triton_attention.varlen_tile_map`); None: the grid follows the step
    tile_map: torch.Tensor | None = None
    tile_map_splits: int = 1  # the programs that the tile map gives each decode (one a split of its keys)
    # [num_seqs] int32, a decode-only step's rows longest context first: the order in which the Triton decode
    # kernel's programs go out (`triton_attention.decode_attention`); None: batch order
    decode_order: torch.Tensor | None = None
    _decodes_and_rest: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def decodes_and_rest(self) -> tuple[torch.Tensor, torch.Tensor, "AttentionMetadata"]:
        """The leading decodes' block tables and context lengths, and the metadata of the other sequences (whose
        cu_seqlens_q still index the step's rows). Built by the first layer that asks and kept for the others: every
        layer of a step reads this one object, which nothing changes once it is built (a `replace` starts afresh)."""
        if self._decodes_and_rest is None:
            n = self.num_decodes
            rest = replace(self, block_tables=self.block_tables[n:], context_lens=self.context_lens[n:],
                           cu_seqlens_q=self.cu_seqlens_q[n:], num_decodes=0,
                           query_lens_host=self.query_lens_host and self.query_lens_host[n:],
                           context_lens_host=self.context_lens_host and self.context_lens_host[n:])
            self._decodes_and_rest = self.block_tables[:n], self.context_lens[:n], rest
        return self._decodes_and_rest


class AttentionBackend(ABC):
    """A kernel family for the KV-cache store and paged attention."""
    name: str
    supports_cuda_graphs = False  # True when forward reads only tensors (no host lists) and can be captured
    supports_fp8_kv = False  # True when it can store into and read from an FP8 cache
    fuses_rope_store = False  # True when its store is Triton's, which the decoder can fuse with the norms and rope
    # the steps of up to this many tokens (0: none) whose attention runs on the Triton varlen kernel, which reads
    # only tensors given a tile map: a CUDA graph can capture such a whole step (`varlen_graphs.py`)
    varlen_graph_tokens = 0

    def check(self, block_size: int, head_dim: int, kv_cache_dtype: torch.dtype):
        """Raise ValueError when this backend cannot run with these settings."""
        if kv_cache_dtype == FP8_DTYPE and not self.supports_fp8_kv:
            raise ValueError(f"attention_backend={self.name!r} cannot read an FP8 KV cache "
                             "(kv_cache_dtype='fp8'); use 'auto', 'triton' or 'torch'")

    def decode_context_bounds(self, batch: int, num_kv_heads: int, kv_itemsize: int, device: torch.device
                              ) -> list[int]:
        """Bounds on the longest context, shortest first, under which a decode step of `batch` sequences runs a
        cheaper plan (told by `AttentionMetadata.max_seqlen_k`): the decode graphs capture one at each."""
        return []

    @abstractmethod
    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0): ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: this step's keys and values (already stored)."""


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """What the store writes: FP8 saturates at +-448 after dividing by the scale; other dtypes are a cast."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) * scale if x.dtype == FP8_DTYPE else x.to(dtype)


def value_chunk(v_cache: torch.Tensor) -> int:
    """Keys a chunk of this value cache, 0 where it is laid out as the keys ([block, key, kv head, dim]). An FP8 cache
    of blocks of a multiple of VALUE_CHUNK tokens holds them [block, kv head, chunk, dim, key of the chunk]: a dim of
    a chunk's keys is one row of 64 bytes, which the Triton kernels load as they load a key."""
    return VALUE_CHUNK if VALUE_CHUNK and v_cache.dtype == FP8_DTYPE and v_cache.size(1) % VALUE_CHUNK == 0 else 0


def value_slots(v_cache: torch.Tensor) -> torch.Tensor:
    """v_cache as [num_blocks, chunks a block, keys a chunk, kv heads, head_dim] whatever its layout: a view, so
    writes reach the cache; a block's tokens in order are `[block].flatten(0, 1)`."""
    num_blocks, block_size, num_kv_heads, head_dim = v_cache.shape
    chunk = value_chunk(v_cache)
    if not chunk:
        return v_cache.unsqueeze(1)
    return v_cache.as_strided((num_blocks, block_size // chunk, chunk, num_kv_heads, head_dim),
                              (block_size * num_kv_heads * head_dim, chunk * head_dim, 1, block_size * head_dim, chunk))


def values_as_cache(values: torch.Tensor) -> torch.Tensor:
    """A value cache holding `values` ([num_blocks, block_size, kv heads, head_dim] in token order, the cache's
    dtype), laid out as `value_chunk` says (tests and benchmarks build caches with it)."""
    cache = torch.empty_like(values)
    slots = value_slots(cache)
    slots.copy_(values.reshape(slots.shape))
    return cache


class TorchBackend(AttentionBackend):
    """Pure PyTorch, any device: the reference every other backend is tested against."""
    name = "torch"
    supports_fp8_kv = True

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = quantize_kv(k[valid], k_scale, k_cache.dtype)
        chunk = value_chunk(v_cache) or v_cache.size(1)
        block, key = slots // v_cache.size(1), slots % v_cache.size(1)
        value_slots(v_cache)[block, key // chunk, key % chunk] = quantize_kv(v[valid], v_scale, v_cache.dtype)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0):
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
                keys = dequantize_kv(k_cache[blocks].flatten(0, 1)[:context_len], k_scale, q.dtype)
                values = dequantize_kv(value_slots(v_cache)[blocks].flatten(0, 2)[:context_len], v_scale, q.dtype)
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


# what each name means; "auto" picks one of them (resolve_backend_name)
BACKEND_NAMES = ("torch", "flash-attn", "triton", "triton-decode")


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchBackend()
    if name in ("flash-attn", "triton-decode"):  # imports flash-attn only when asked for
        from nanovllm.layers.flash_attention import FlashAttnBackend
        return FlashAttnBackend(triton_decode=name == "triton-decode")
    if name == "triton":
        from nanovllm.layers.triton_attention import TritonBackend
        return TritonBackend()
    raise ValueError(f"attention_backend={name!r} is unknown; valid ones are {['auto', *BACKEND_NAMES]}")


def resolve_backend_name(name: str, device: str, dtype: torch.dtype, block_size: int,
                         kv_cache_dtype: torch.dtype) -> tuple[str, str | None]:
    """The backend to build for `attention_backend=name`, and why "auto" fell back to a slow one (or None).

    "auto" on CUDA: "triton-decode" (flash-attn-4 and the Triton decode kernel: `nanovllm.layers.flash_attention`)
    where that kernel measured faster, flash-attn alone elsewhere; "triton" when the cache is FP8 (flash-attn
    cannot read it), the dtype is float32, or flash-attn does not import; torch when Triton does not work either.
    Any other device: torch."""
    if name not in ("auto", *BACKEND_NAMES):
        raise ValueError(f"attention_backend={name!r} is unknown; valid ones are {['auto', *BACKEND_NAMES]}")
    if name not in ("auto", "torch") and device != "cuda":
        raise ValueError(f"attention_backend={name!r} needs CUDA; device is {device!r}")
    if name != "auto":
        return name, None
    if device != "cuda":
        return "torch", None
    from nanovllm.layers.flash_attention import flash_attn_available, triton_decode_measured_faster
    from nanovllm.layers.triton_guard import triton_available
    family = flash_attn_available() if kv_cache_dtype != FP8_DTYPE and dtype != torch.float32 else None
    if family == "fa4":
        return ("triton-decode" if triton_available() and triton_decode_measured_faster() else "flash-attn"), None
    if family == "fa2" and block_size % 256 == 0:  # FA2's paged kernels need blocks of a multiple of 256
        return "flash-attn", None
    if triton_available():
        return "triton", None
    return "torch", "neither flash-attn nor Triton can run here: the torch attention backend is slow on CUDA"


class Attention(nn.Module):
    """Stores this step's keys and values in the layer's cache, then attends over the cache."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])  # set by the model runner
        self.backend: AttentionBackend = TorchBackend()  # set by the model runner
        self.k_scale = self.v_scale = 1.0  # of an FP8 cache: stored = clamp(x / scale), read = stored * scale
        self.fuse_rope_store = False  # set by the model runner where the backend can and it is asked to

    @property
    def fused_store(self) -> bool:
        """The decoder stores this step's keys and values, in one kernel with the q/k norms and rope
        (`triton_rope_store`); then `forward` does not."""
        return self.fuse_rope_store and self.k_cache.numel() > 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() and not self.fused_store:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                       self.k_scale, self.v_scale)
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale)
        return o.flatten(1, 2)
