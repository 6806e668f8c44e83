"""The KV-cache store as one Triton kernel (CUDA): write this step's keys and values into their cache slots.

Contract, the same as `TorchBackend.store_kvcache`:
- k, v: [num_tokens, num_kv_heads, head_dim], any token and head strides (they are often slices of the fused
  qkv projection), the last dimension contiguous;
- k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
- slot_mapping: int32 or int64 [num_tokens], the flat slot `block * block_size + offset` of each token; -1 writes
  nothing (the padding of a captured CUDA graph).

One program per token copies all of its heads, so a launch is a fixed grid that a CUDA graph can capture.
Triton is imported under a guard: on a machine without a working Triton the module still imports, and only
calling `store_kvcache` fails.
"""
import torch

try:
    import triton
    import triton.language as tl
except Exception as e:  # no Triton, or one that cannot initialise here (a CPU-only machine)
    triton = tl = None
    _TRITON_ERROR: Exception | None = e
else:
    _TRITON_ERROR = None

if triton is not None:
    @triton.jit
    def _store_kvcache_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        k_token_stride, k_head_stride, v_token_stride, v_head_stride,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEADS_BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
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
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
        tl.store(k_cache_ptr + dst, key, mask=mask)
        tl.store(v_cache_ptr + dst, value, mask=mask)


def triton_available() -> bool:
    return triton is not None and torch.cuda.is_available()


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor):
    if triton is None:
        raise RuntimeError(f"the Triton KV-cache store needs a working Triton: {_TRITON_ERROR!r}")
    num_tokens, num_kv_heads, head_dim = k.shape
    # internal invariants: the layers and the model runner produce these layouts
    assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_BLOCK=triton.next_power_of_2(num_kv_heads), DIM_BLOCK=triton.next_power_of_2(head_dim),
    )
