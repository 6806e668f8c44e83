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
