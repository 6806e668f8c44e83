"""Attention of prefill and mixed steps in Qwen3-0.6B's heads, host time and device time per call: flash-attn-4,
the Triton varlen kernel, and a mixed step split in two (its leading decodes to the Triton decode kernel, its
prompts to the Triton varlen kernel). In a piecewise-graph step each layer's attention runs eagerly between the
graph replays, so a step's host work is about num_layers x this host time: when it exceeds the device time of
the step, the GPU waits for the host.

    python benchmarks/mixed_attention.py [--block-size 256] [--calls 50]
    python benchmarks/mixed_attention.py --sweep [--variants 64,64,4,2 64,64,4,3 ...]

`--sweep`: the varlen kernel as a varlen graph runs it (a tile map of the graph's size, the decodes split where
its graphs split them), over 28 layers' caches in turn (as a step reads them: not from L2), for tiles of query rows,
keys, warps and stages (`NANOVLLM_VARLEN_TILE`'s form): a prompt alone and beside 6 decodes of 600 keys, us a
layer; the last line names the variant of the least time over all cases.

A case is `decodes` sequences of one query token (context `decode_context`) plus `prompts` prompts of
`prompt_len` new tokens after `prefix` cached ones, in one varlen batch, paged, block tables shuffled. Each
kernel's calls are enqueued behind a long `torch.cuda._sleep`, so the host time is the enqueue time alone and
the device time (CUDA events around the calls, after the sleep) is the kernels' alone. Cells: host us / device us.
"""
import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.layers.attention import AttentionMetadata  # noqa: E402
from nanovllm.layers.triton_attention import varlen_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
# (decodes, decode_context, prompts, prompt_len, prefix)
CASES = [(8, 500, 1, 128, 0), (8, 500, 1, 512, 0), (8, 500, 1, 1024, 0), (8, 500, 4, 512, 0),
         (32, 1000, 1, 1024, 0), (64, 1000, 1, 1024, 0), (128, 1000, 1, 1024, 0), (512, 1000, 1, 1500, 0),
         (0, 0, 2, 1024, 0), (0, 0, 16, 1024, 0), (8, 500, 1, 512, 2048)]


def problem(decodes, decode_context, prompts, prompt_len, prefix, block_size):
    query_lens = [1] * decodes + [prompt_len] * prompts
    context_lens = [decode_context] * decodes + [prefix + prompt_len] * prompts
    blocks = [math.ceil(c / block_size) for c in context_lens]
    width = max(blocks)
    table = torch.full((len(blocks), width), -1, dtype=torch.int32)
    ids = torch.randperm(sum(blocks), dtype=torch.int32)
    start = 0
    for row, n in enumerate(blocks):
        table[row, :n] = ids[start:start + n]
        start += n
    shape = (sum(blocks), block_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(slot_mapping=torch.full((tokens,), -1, device="cuda"), block_tables=table.cuda(),
                             context_lens=torch.tensor(context_lens, dtype=torch.int32, device="cuda"),
                             cu_seqlens_q=cu, max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens),
                             query_lens_host=query_lens, context_lens_host=context_lens, num_decodes=decodes)
    return q, k, k_cache, v_cache, meta


def timed(fn, calls: int) -> tuple[float, float]:
    """(host us, device us) per call."""
    fn()
    torch.cuda.synchronize()
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s: every call below is enqueued before the device reaches it
    before.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    after.record()
    torch.cuda.synchronize()
    return 1e6 * host / calls, 1e3 * before.elapsed_time(after) / calls


SWEEP_CASES = [(d, 600, 1, n, 0) for d in (0, 6) for n in (100, 300, 500, 900)]
VARIANTS = ["64,64,4,2", "64,64,4,3", "64,64,8,2", "64,32,4,3", "64,32,4,4", "64,128,8,2", "64,128,4,2",
            "128,64,8,2", "128,64,8,3", "32,64,4,2", "32,32,4,3"]
LAYERS = 28


def sweep(variants: list[str], block_size: int, calls: int):
    from nanovllm.engine.varlen_graphs import MAX_SEQS, VarlenGraphs, graph_sizes
    from nanovllm.layers import triton_attention as ta
    scale = HEAD_DIM ** -0.5
    problems = []
    for case in SWEEP_CASES:
        q, k, k_cache, v_cache, meta = problem(*case, block_size)
        caches = [(k_cache, v_cache)] + [(torch.randn_like(k_cache), torch.randn_like(v_cache))
                                         for _ in range(LAYERS - 1)]
        size = next(size for size in graph_sizes(2048) if size >= q.size(0))
        problems.append((q, k, caches, meta, size, min(MAX_SEQS, size)))
    print(f"{torch.cuda.get_device_name()}, block size {block_size}; us a layer (device, {LAYERS} layers' caches in "
          "turn); prompt alone, then beside 6 decodes of 600 keys")
    print("| rows,keys,warps,stages | " + " | ".join(f"{'+6 ' if d else ''}{n}" for d, _, _, n, _ in SWEEP_CASES)
          + " | sum | max diff |")
    print("| --- | " + " | ".join("---:" for _ in SWEEP_CASES) + " | ---: | ---: |")
    reference, totals = None, {}
    for variant in variants:
        ta.QUERY_ROWS, ta.VARLEN_KV_TILE, ta.VARLEN_WARPS, ta.VARLEN_STAGES = map(int, variant.split(","))
        cells, outs = [], []
        for q, k, caches, meta, size, seqs in problems:
            splits = VarlenGraphs.splits(size)
            query_tile = ta.varlen_query_tile(HEADS // KV_HEADS)
            rows = ta.max_varlen_tiles(size, seqs, query_tile, splits)
            tile_map = ta.varlen_tile_map(np.array(meta.query_lens_host), query_tile, rows, splits,
                                          np.array(meta.context_lens_host))
            graph_meta = dataclasses.replace(meta, tile_map=torch.from_numpy(tile_map).cuda(), tile_map_splits=splits)
            out = torch.empty_like(q)

            def step():
                for k_cache, v_cache in caches:
                    varlen_attention(q, k, k, k_cache, v_cache, graph_meta, scale, out=out)
            step()
            outs.append(out.float().clone())
            cells.append(timed(step, calls)[1] / LAYERS)
        reference = reference or outs
        diff = max((a - b).abs().max().item() for a, b in zip(outs, reference))
        totals[variant] = sum(cells)
        print(f"| {variant} | " + " | ".join(f"{us:.1f}" for us in cells) + f" | {sum(cells):.1f} | {diff:.3f} |",
              flush=True)
    print("best:", min(totals, key=totals.get))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    args = parser.parse_args()
    if args.sweep:
        return sweep(args.variants, args.block_size, max(1, args.calls // 5))
    from nanovllm.layers import triton_attention
    from nanovllm.layers.flash_attention import FlashAttnBackend
    triton_attention.SPLIT_DECODES = 1  # the split ones split whenever a decode leads
    kernels = {"flash-attn-4": FlashAttnBackend("fa4").forward,
               "Triton varlen": lambda q, k, v, kc, vc, meta, scale: varlen_attention(q, k, v, kc, vc, meta, scale),
               "split": FlashAttnBackend("fa4", triton_decode=True, triton_varlen_tokens=10 ** 9).forward}
    scale = HEAD_DIM ** -0.5
    print(f"{torch.cuda.get_device_name()}, block size {args.block_size}, {args.calls} calls each; host us / device us")
    print("| decodes x context | prompts x (prefix + new) | tokens | " + " | ".join(kernels) + " | max diff |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in kernels) + " | ---: |")
    for case in CASES:
        decodes, decode_context, prompts, prompt_len, prefix = case
        q, k, k_cache, v_cache, meta = problem(*case, args.block_size)
        runs = {name: (lambda fn=fn: fn(q, k, k, k_cache, v_cache, meta, scale)) for name, fn in kernels.items()}
        outs = [run().float() for run in runs.values()]
        diff = max((out - outs[0]).abs().max().item() for out in outs[1:])
        cells = [timed(run, args.calls) for run in runs.values()]
        print(f"| {decodes} x {decode_context} | {prompts} x ({prefix} + {prompt_len}) | {q.size(0)} | "
              + " | ".join(f"{host:.0f} / {device:.0f}" for host, device in cells) + f" | {diff:.3f} |", flush=True)


if __name__ == "__main__":
    main()
