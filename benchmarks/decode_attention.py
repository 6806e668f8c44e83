"""Paged decode attention in Qwen3-0.6B's heads (16 query, 8 KV, head_dim 128): flash-attn-4 against the Triton
split-KV kernel in bf16 and with an FP8 cache, against the device-copy bandwidth measured in the same run.

    python benchmarks/decode_attention.py                  # the table: batch x context x block size
    python benchmarks/decode_attention.py --batch 256 --context 1024 --block-size 256   # one row

Each kernel is captured in a CUDA graph, as the engine runs it, and its replays are timed with CUDA events, each
after a 256 MB read clears L2 (`--flush zero`: do_bench's way, a write): median microseconds, and TB/s of KV
actually read (an FP8 cache is half the bytes). Contexts are all equal, block tables shuffled, caches random
(never zeros). Both kernels are told the longest context (flash-attn-4's max_seqlen_k, the Triton kernel's
max_context, as the engine's decode graphs tell it a bound: fewer splits where contexts are short).
Sweeps of the kernel's tiles and splits (`--sweep`, retired): `git show 8737174:benchmarks/decode_attention.py`.
"""
import argparse
import functools
import itertools
import math
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.layers.attention import FP8_DTYPE, AttentionMetadata, values_as_cache  # noqa: E402
from nanovllm.layers import triton_attention  # noqa: E402
from nanovllm.layers.triton_attention import decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
BATCHES, CONTEXTS, BLOCK_SIZES = (1, 8, 32, 128, 256, 512), (128, 1024, 4096, 16384), (16, 128, 256)
MEMORY_SHARE = 0.4  # skip a row whose bf16 cache would take more than this share of the GPU's memory


FLUSH = "read"  # how time_us clears L2 before each replay (--flush)


@functools.cache
def flush_buffer() -> torch.Tensor:
    return torch.ones(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB, over 4x an H200's L2 (60 MB)


def time_us(fn) -> float:
    """Median of graph replays, in microseconds, each after L2 is cleared. "read": by summing 256 MB, which leaves
    L2 clean, as a decode step's earlier kernels (small outputs) leave it. "zero": do_bench's, by writing 256 MB,
    which leaves it dirty, so the timed kernel writes those lines back as it reads (H200, session 46: 3-9 us more
    at 256 x 128, 256 x 1k and 8 x 1k)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    if FLUSH == "zero":
        return do_bench(graph.replay, warmup=5, rep=25, return_mode="median") * 1e3
    events = []
    for _ in range(60):
        flush_buffer().sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events[10:]) * 1e3


def copy_bandwidth() -> float:
    """TB/s of a 2 GiB device-to-device copy, counting the bytes read and the bytes written. Eager, not in a graph:
    a captured copy becomes a memcpy node that the copy engines run, at about 2.7 TB/s on an H200."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(100):  # ~0.1 s of work first, so the clocks have left idle
        dst.copy_(src)
    us = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") * 1e3
    return 2 * src.numel() * src.element_size() / us / 1e6


class Problem:
    """One decode batch: queries, a shuffled paged cache (bf16 and an FP8 copy) and the metadata."""

    def __init__(self, batch: int, context: int, block_size: int, fp8: bool = True):
        blocks_per_seq = math.ceil(context / block_size)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        self.v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        self.k8 = self.k.to(FP8_DTYPE) if fp8 else None
        self.v8 = values_as_cache(self.v.to(FP8_DTYPE)) if fp8 else None  # (chunked where `value_chunk` says)
        self.q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        tables = torch.randperm(num_blocks, dtype=torch.int32, device="cuda").view(batch, blocks_per_seq)
        lens = torch.full((batch,), context, dtype=torch.int32)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((batch,), -1, device="cuda"), block_tables=tables,
            context_lens=lens.cuda(), cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            max_seqlen_q=1, max_seqlen_k=context)
        self.bytes_bf16 = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
        self.scale = HEAD_DIM ** -0.5

    def triton(self, fp8: bool = False, **overrides):
        k, v = (self.k8, self.v8) if fp8 else (self.k, self.v)
        return lambda: decode_attention(self.q, k, v, self.meta.block_tables, self.meta.context_lens, self.scale,
                                        max_context=self.meta.max_seqlen_k, **overrides)

    def fa4(self, backend):
        return lambda: backend.forward(self.q, None, None, self.k, self.v, self.meta, self.scale)


def fa4_backend():
    try:
        from nanovllm.layers.flash_attention import FlashAttnBackend
        return FlashAttnBackend("fa4")
    except ValueError as e:
        print(f"flash-attn-4: not timed ({e})")
        return None


def fits(batch: int, context: int) -> bool:
    bf16 = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    return 1.5 * bf16 < MEMORY_SHARE * torch.cuda.get_device_properties(0).total_memory


def table(args):
    fa4 = fa4_backend()
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {copy:.2f} TB/s")
    print("| batch | context | block | KV MB (bf16) | copy floor us | flash-attn-4 us (TB/s) | triton bf16 us "
          "(TB/s) | triton fp8 us (TB/s) | splits | triton / fa4 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for block_size, batch, context in itertools.product(args.block_size, args.batch, args.context):
        if not fits(batch, context):
            print(f"| {batch} | {context} | {block_size} | skipped: the cache would not fit |")
            continue
        p = Problem(batch, context, block_size)
        gb, floor = p.bytes_bf16 / 1e9, p.bytes_bf16 / copy / 1e6
        bf16 = time_us(p.triton())
        fp8 = time_us(p.triton(fp8=True))
        ref = time_us(p.fa4(fa4)) if fa4 is not None else float("nan")
        splits = triton_attention.decode_splits(batch, KV_HEADS, torch.cuda.get_device_properties(0)
                                                .multi_processor_count, max_context=context)
        print(f"| {batch} | {context} | {block_size} | {gb * 1e3:.1f} | {floor:.1f} | {ref:.1f} "
              f"({gb / ref * 1e3:.2f}) | {bf16:.1f} ({gb / bf16 * 1e3:.2f}) | {fp8:.1f} ({gb / 2 / fp8 * 1e3:.2f}) "
              f"| {splits} | {ref / bf16:.2f}x |", flush=True)
        del p
        torch.cuda.empty_cache()


def main():
    global FLUSH
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--context", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--block-size", type=int, nargs="+", default=BLOCK_SIZES)
    parser.add_argument("--flush", choices=["read", "zero"], default=FLUSH,
                        help="clear L2 before each replay by reading 256 MB, or by writing them (do_bench)")
    args = parser.parse_args()
    FLUSH = args.flush
    torch.manual_seed(0)
    table(args)


if __name__ == "__main__":
    main()
