"""Attention of prefill and mixed steps in Qwen3-0.6B's heads, host time and device time per call: flash-attn-4,
the Triton varlen kernel, and a mixed step split in two (its leading decodes to the Triton decode kernel, its
prompts to the Triton varlen kernel). In a piecewise-graph step each layer's attention runs eagerly between the
graph replays, so a step's host work is about num_layers x this host time: when it exceeds the device time of
the step, the GPU waits for the host.

    python benchmarks/mixed_attention.py [--block-size 256] [--calls 50]

A case is `decodes` sequences of one query token (context `decode_context`) plus `prompts` prompts of
`prompt_len` new tokens after `prefix` cached ones, in one varlen batch, paged, block tables shuffled. Each
kernel's calls are enqueued behind a long `torch.cuda._sleep`, so the host time is the enqueue time alone and
the device time (CUDA events around the calls, after the sleep) is the kernels' alone. Cells: host us / device us.
"""
import argparse
import math
import sys
import time
from pathlib import Path

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
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
