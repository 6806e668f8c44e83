"""flash-attn-4 paged decode in Qwen3-0.6B's shape: time per call for pack_gqa / num_splits choices.

    python benchmarks/fa4_decode.py [--batch 256] [--context 1000] [--block-size 256]
"""
import argparse

import torch
from flash_attn.cute import flash_attn_varlen_func
from triton.testing import do_bench


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=256)
    args = parser.parse_args()
    heads, kv_heads, dim, bs = 16, 8, 128, args.block_size
    blocks_per_seq = -(-args.context // bs)
    num_blocks = args.batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(args.batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    page_table = torch.randperm(num_blocks, dtype=torch.int32, device="cuda").view(args.batch, blocks_per_seq)
    seqused_k = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    cu_seqlens_q = torch.arange(args.batch + 1, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * args.batch * args.context * kv_heads * dim * 2
    for pack_gqa in (None, True, False):
        for num_splits in (1, 0, 4):
            def call():
                return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1,
                                              seqused_k=seqused_k, page_table=page_table, causal=True,
                                              pack_gqa=pack_gqa, num_splits=num_splits)
            try:
                call()
                ms = do_bench(call, warmup=20, rep=100)
                print(f"pack_gqa={pack_gqa!s:5} num_splits={num_splits}: {ms * 1e3:7.1f} us, "
                      f"{kv_bytes / ms / 1e9:.2f} TB/s")
            except Exception as e:
                print(f"pack_gqa={pack_gqa!s:5} num_splits={num_splits}: failed: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
