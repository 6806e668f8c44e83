"""The KV-cache store as one Triton kernel (CUDA): write this step's keys and values into their cache slots.

Contract, the same as `TorchBackend.store_kvcache`:
- k, v: [num_tokens, num_kv_heads, head_dim], any token and head strides (they are often slices of the fused
  qkv projection), the last dimension contiguous;
- k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
- slot_mapping: int32 or int64 [num_tokens], the flat slot `block * block_size + offset` of each token; -1 writes
  nothing (the padding of a captured CUDA graph);
- an FP8 cache (`float8_e4m3fn`) stores `clamp(x / scale, -448, 448)` rounded to nearest, bit for bit what
  `nanovllm.layers.attention.quantize_kv` computes; other caches take the values as they are (scales of 1);
- values go where `nanovllm.layers.attention.value_chunk` says (`cache_offsets`).

One program per token copies all of its heads, so a launch is a fixed grid that a CUDA graph can capture.
Triton is imported under a guard: on a machine without a working Triton the module still imports, and only
calling `store_kvcache` fails.
"""
import torch

from nanovllm.layers.attention import FP8_DTYPE, FP8_MAX, value_chunk

from nanovllm.layers.triton_guard import require_triton, tl, triton

if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)

    @triton.jit
    def quantize_fp8(x, scale):
        """x as an FP8 cache stores it, before the cast: clamp(x / scale, -448, 448) in float32 (div_rn, not the
        approximate division, so the bits match torch's)."""
        return tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -_FP8_MAX), _FP8_MAX)

    @triton.jit
    def cache_offsets(slot, head, dims, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
        """Where (slot, kv head, dim) lies in a cache (broadcast together): [block, key, kv head, dim], or with CHUNK
        (`value_chunk`) [block, kv head, chunk, dim, key of the chunk]."""
        if CHUNK:
            block, key = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            return ((block * NUM_KV_HEADS + head) * BLOCK_SIZE + key // CHUNK * CHUNK) * HEAD_DIM + dims * CHUNK + \
                key % CHUNK
        return (slot * NUM_KV_HEADS + head) * HEAD_DIM + dims

    @triton.jit
    def _store_kvcache_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        k_token_stride, k_head_stride, v_token_stride, v_head_stride, k_scale, v_scale,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, V_CHUNK: tl.constexpr,
        HEADS_BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, QUANTIZE: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a cache can exceed 2**31 elements
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        # tl.arange needs power-of-two lengths; the mask trims the tile to the real heads and dims
        heads = tl.arange(0, HEADS_BLOCK)[:, None]
        dims = tl.arange(0, DIM_BLOCK)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        key = tl.load(k_ptr + token * k_token_stride + heads * k_head_stride + dims, mask=mask)
        value = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + dims, mask=mask)
        if QUANTIZE:
            key = quantize_fp8(key, k_scale)
            value = quantize_fp8(value, v_scale)
        tl.store(k_cache_ptr + cache_offsets(slot, heads, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, 0),
                 key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offsets(slot, heads, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, V_CHUNK),
                 value.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_values_by_chunk_kernel(
        v_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
        v_token_stride, v_head_stride, block_table_stride, v_scale,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Program (c, seq, kv head): the step's values of one sequence's c-th chunk of keys from its first new one,
        stored a dim's keys at a time (one row of CHUNK bytes)."""
        chunk, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = tl.load(cu_seqlens_q_ptr + seq), tl.load(cu_seqlens_q_ptr + seq + 1)
        context = tl.load(context_lens_ptr + seq)
        first = context - (end - start)  # the key of the sequence's first token in this step
        chunk_start = (first // CHUNK + chunk) * CHUNK
        if chunk_start < context:
            keys = chunk_start + tl.arange(0, CHUNK)
            valid = (keys >= first) & (keys < context)
            tokens = (start + keys - first).to(tl.int64)
            dims = tl.arange(0, DIM_BLOCK)
            value = tl.load(v_ptr + tokens[:, None] * v_token_stride + head * v_head_stride + dims[None, :],
                            mask=valid[:, None] & (dims < HEAD_DIM)[None, :])
            value = quantize_fp8(value, v_scale).to(v_cache_ptr.dtype.element_ty)
            block = tl.load(block_tables_ptr + seq * block_table_stride + chunk_start // BLOCK_SIZE).to(tl.int64)
            # `cache_offsets` of these keys: the chunk lies in one block, its keys contiguous along each dim
            base = ((block * NUM_KV_HEADS + head) * BLOCK_SIZE + chunk_start % BLOCK_SIZE) * HEAD_DIM
            rows = v_cache_ptr + base + dims[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
            tl.store(rows, tl.trans(value), mask=(dims < HEAD_DIM)[:, None] & valid[None, :])
else:
    quantize_fp8 = cache_offsets = None


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0):
    require_triton("the Triton KV-cache store")
    num_tokens, num_kv_heads, head_dim = k.shape
    # internal invariants: the layers and the model runner produce these layouts
    assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    quantize = k_cache.dtype == FP8_DTYPE
    assert quantize or k_scale == v_scale == 1.0, "scales apply to an FP8 cache only"
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_scale, v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=v_cache.size(1), V_CHUNK=value_chunk(v_cache),
        HEADS_BLOCK=triton.next_power_of_2(num_kv_heads), DIM_BLOCK=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
    )


def store_values_by_chunk(v: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          context_lens: torch.Tensor, block_tables: torch.Tensor, max_seqlen_q: int,
                          v_scale: float = 1.0):
    """A varlen step's values into a chunked FP8 cache (`value_chunk`), as `store_kvcache` stores them, but a
    program per chunk of a sequence's keys: where a token's values go a byte to each of head_dim rows, a chunk's go
    a row to each, whole. Sequence i's new tokens are v[cu_seqlens_q[i]:cu_seqlens_q[i + 1]], the last of its
    context_lens[i] keys, in the blocks of block_tables[i]; max_seqlen_q bounds their counts."""
    require_triton("the Triton KV-cache store")
    num_tokens, num_kv_heads, head_dim = v.shape
    chunk = value_chunk(v_cache)
    # internal invariants: the attention layer calls it for chunked caches only (`attention.values_by_chunk`)
    assert chunk and v_cache.is_contiguous() and v_cache.shape[2:] == (num_kv_heads, head_dim) and v.stride(-1) == 1
    num_seqs = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return
    # a sequence's first new key may lie anywhere in a chunk: one chunk more than its tokens fill
    grid = (triton.cdiv(max_seqlen_q, chunk) + 1, num_seqs, num_kv_heads)
    _store_values_by_chunk_kernel[grid](
        v, v_cache, cu_seqlens_q, context_lens, block_tables, v.stride(0), v.stride(1), block_tables.stride(0),
        v_scale, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=v_cache.size(1), CHUNK=chunk,
    )
