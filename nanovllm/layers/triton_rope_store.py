"""A decoder layer's attention inputs in one Triton kernel (CUDA): the optional RMSNorm of each query and key head
(Qwen3's q/k norm), rope on both, the queries written out and this step's keys and values stored in the paged
cache. Unfused, these are four to five launches per layer (q norm, k norm, rope, the store), which at small
batches cost more than their bytes.

Contract, the same results as the unfused layers (`RMSNorm`, `RotaryEmbedding`, the KV store):
- q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim]: any token stride (they
  are slices of the fused qkv projection), heads `head_dim` apart, the last dimension contiguous;
- cos_sin: `RotaryEmbedding.cos_sin_cache`, float32 [max_position, head_dim], cos of each frequency then sin;
- q_weight, k_weight: the norms' weights [head_dim], or None for a model without q/k norm;
- k_cache, v_cache and slot_mapping as for the KV store (`triton_kvstore`): a slot of -1 stores nothing, an FP8
  cache stores `clamp(x / scale, -448, 448)`.
Each step rounds to the model's dtype where the unfused layers do (after the norm, after its weight, after
rope), so the results differ from theirs only by the order of float32 sums: at most one unit in the last
place of the model's dtype, now and then.
One program per token handles every head, so a launch is a fixed grid that a CUDA graph can capture.
"""
from typing import NamedTuple

import torch

from nanovllm.layers.attention import FP8_DTYPE, value_chunk
from nanovllm.layers.triton_guard import dependent_start, pdl_args, require_triton, tl, triton
from nanovllm.layers.triton_kvstore import cache_offsets, quantize_fp8

if triton is not None:
    @triton.jit
    def norm_and_rotate(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr,
                        QK_NORM: tl.constexpr):
        """Heads of q or k by rows, as their halves x1 and x2 in float32: RMSNorm over each head with the weight's
        halves w1 and w2 (QK_NORM), rounded to DTYPE where `RMSNorm` rounds, then rotated by cos and sin."""
        if QK_NORM:
            rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
            x1 = (w1 * (x1 * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    @triton.jit
    def _normed_rope(ptr, token_stride, weight_ptr, cos, sin, token, eps,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_BLOCK: tl.constexpr,
                     HALF_BLOCK: tl.constexpr, QK_NORM: tl.constexpr):
        """The heads of one token, normed (QK_NORM) and rotated, in float32 (rounded as the unfused layers do):
        the two halves of each head, and their mask."""
        half = HEAD_DIM // 2
        heads = tl.arange(0, HEADS_BLOCK)[:, None]
        cols = tl.arange(0, HALF_BLOCK)[None, :]
        mask = (heads < NUM_HEADS) & (cols < half)
        src = ptr + token * token_stride + heads * HEAD_DIM + cols
        x1 = tl.load(src, mask=mask, other=0.0)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        w1 = cos  # (unread without QK_NORM)
        w2 = cos
        if QK_NORM:
            w1 = tl.load(weight_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
            w2 = tl.load(weight_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
        x1, x2 = norm_and_rotate(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, dtype, QK_NORM)
        return x1, x2, mask

    @triton.jit
    def _rope_store_kernel(
        q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, slot_mapping_ptr, cos_sin_ptr,
        q_weight_ptr, k_weight_ptr, q_token_stride, k_token_stride, v_token_stride, eps, k_scale, v_scale,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEADS_BLOCK: tl.constexpr, KV_HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
        QK_NORM: tl.constexpr, QUANTIZE: tl.constexpr, PDL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        V_CHUNK: tl.constexpr,
    ):
        dependent_start(PDL)  # (`triton_skinny`): q, k and v are the previous kernel's
        token = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a cache can exceed 2**31 elements
        half = HEAD_DIM // 2
        position = tl.load(positions_ptr + token).to(tl.int64)
        cols = tl.arange(0, HALF_BLOCK)[None, :]
        cos = tl.load(cos_sin_ptr + position * HEAD_DIM + cols, mask=cols < half, other=0.0)
        sin = tl.load(cos_sin_ptr + position * HEAD_DIM + half + cols, mask=cols < half, other=0.0)

        q1, q2, mask = _normed_rope(q_ptr, q_token_stride, q_weight_ptr, cos, sin, token, eps, NUM_HEADS,
                                    HEAD_DIM, HEADS_BLOCK, HALF_BLOCK, QK_NORM)
        heads = tl.arange(0, HEADS_BLOCK)[:, None]
        dst = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + cols
        tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, q2.to(q_out_ptr.dtype.element_ty), mask=mask)

        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            k1, k2, kv_mask = _normed_rope(k_ptr, k_token_stride, k_weight_ptr, cos, sin, token, eps,
                                           NUM_KV_HEADS, HEAD_DIM, KV_HEADS_BLOCK, HALF_BLOCK, QK_NORM)
            kv_heads = tl.arange(0, KV_HEADS_BLOCK)[:, None]
            v_src = v_ptr + token * v_token_stride + kv_heads * HEAD_DIM + cols
            v1 = tl.load(v_src, mask=kv_mask, other=0.0)
            v2 = tl.load(v_src + half, mask=kv_mask, other=0.0)
            # the key is rounded to the model's dtype first, as the unfused rope returns it
            k1 = k1.to(v1.dtype)
            k2 = k2.to(v1.dtype)
            if QUANTIZE:
                k1, k2 = quantize_fp8(k1, k_scale), quantize_fp8(k2, k_scale)
                v1, v2 = quantize_fp8(v1, v_scale), quantize_fp8(v2, v_scale)
            k_dst = k_cache_ptr + cache_offsets(slot, kv_heads, cols, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, 0)
            tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(k_dst + half, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_cache_ptr + cache_offsets(slot, kv_heads, cols, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, V_CHUNK),
                     v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_cache_ptr + cache_offsets(slot, kv_heads, cols + half, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                                 V_CHUNK), v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
else:
    norm_and_rotate = None


class RopeStoreArgs(NamedTuple):
    """`rope_store`'s arguments after q, k and v, as a layer passes them on (`rope_store(q, k, v, *args)`, or to
    the qkv projection that does the same in its epilogue: `triton_skinny`)."""
    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float
    v_scale: float


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
    """The normed, rotated queries [num_tokens, num_heads, head_dim]; the keys and values go to the cache."""
    require_triton("the fused rope and KV store")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.size(1)
    # internal invariants: the decoder's qkv split and the model runner produce these layouts
    assert v.shape == k.shape and k.shape[0] == num_tokens and head_dim % 2 == 0
    assert all(x.stride(1) == head_dim and x.stride(2) == 1 for x in (q, k, v))
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos_sin.is_contiguous()
    assert cos_sin.dtype == torch.float32 and cos_sin.size(1) == head_dim
    assert slot_mapping.shape == (num_tokens,) and positions.shape == (num_tokens,)
    assert (q_weight is None) == (k_weight is None)
    quantize = k_cache.dtype == FP8_DTYPE
    assert quantize or k_scale == v_scale == 1.0, "scales apply to an FP8 cache only"
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    qk_norm = q_weight is not None
    _rope_store_kernel[(num_tokens,)](
        q, k, v, out, k_cache, v_cache, positions, slot_mapping, cos_sin,
        q_weight if qk_norm else cos_sin, k_weight if qk_norm else cos_sin,  # (not read without QK_NORM)
        q.stride(0), k.stride(0), v.stride(0), eps, k_scale, v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_BLOCK=triton.next_power_of_2(num_heads), KV_HEADS_BLOCK=triton.next_power_of_2(num_kv_heads),
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2), QK_NORM=qk_norm, QUANTIZE=quantize, **pdl_args(q.device),
        BLOCK_SIZE=v_cache.size(1), V_CHUNK=value_chunk(v_cache),
    )
    return out
