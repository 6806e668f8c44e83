"""The experts of one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of 768, top 8, bf16) on one GPU: the
fused Triton kernels (as the engine runs them: replayed from a CUDA graph) against the per-expert torch loop,
for decode batches of 1..512 tokens and one prefill; random routing (router logits ~ N(0, 1)).

    python benchmarks/moe.py [--tokens 1 2 4 8 16 32 64 128 256 512] [--prefill 4096] [--iters 30]

Each row's floor is the larger of: its bytes (every expert that gets a token reads its 3 x 2048 x 768 weights;
x, the [pairs, 768] intermediate and the [pairs, 2048] per-pair outputs are written and read once) at the copy
bandwidth measured in the same run, and its 6 x pairs x 2048 x 768 FLOPs at the bf16 matmul rate measured in the
same run. A pair is one (token, chosen expert): pairs = tokens x 8.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_attention import copy_bandwidth  # noqa: E402  (this folder, as python runs a script)
from nanovllm.layers import triton_moe  # noqa: E402
from nanovllm.layers.triton_guard import triton_available  # noqa: E402
from nanovllm.layers.moe import experts_torch, route  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8


def time_us(fn, iters: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    us = time_us(lambda: a @ b, 10)
    return 2 * 8192 ** 3 / (us * 1e-6)


def graphed(fn):
    """fn captured once in a CUDA graph; returns its replay (the engine's decode steps run the layer this way)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    if not triton_available():
        raise SystemExit("benchmarks/moe.py needs CUDA and Triton")
    torch.manual_seed(0)
    dev = dict(dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, **dev) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, **dev) * INTERMEDIATE ** -0.5
    bandwidth, flops_rate = copy_bandwidth() * 1e12, matmul_flops()  # bytes/s, FLOP/s
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton_moe.triton.__version__}: "
          f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s")
    print("| tokens | experts hit | floor us | fused us | fused TB/s | fused % of floor | torch loop us | speedup "
          "| max abs diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for num_tokens in [*args.tokens, *args.prefill]:
        x = torch.randn(num_tokens, HIDDEN, **dev)
        weights, ids = route(torch.randn(num_tokens, EXPERTS, **dev), TOP_K, renormalize=True)
        pairs, hit = num_tokens * TOP_K, ids.unique().numel()
        weight_bytes = hit * 3 * HIDDEN * INTERMEDIATE * 2
        activation_bytes = 2 * (2 * num_tokens * HIDDEN + 2 * pairs * INTERMEDIATE + 2 * pairs * HIDDEN)
        floor_us = max((weight_bytes + activation_bytes) / bandwidth, 6 * pairs * HIDDEN * INTERMEDIATE / flops_rate)
        floor_us *= 1e6

        def fused():
            return triton_moe.fused_experts(x, gate_up, down, weights, ids)
        fused_us = time_us(graphed(fused) if num_tokens <= 512 else fused, args.iters)
        loop_us = time_us(lambda: experts_torch(x, gate_up, down, weights, ids), max(args.iters // 5, 3))
        diff = (fused().float() - experts_torch(x, gate_up, down, weights, ids).float()).abs().max().item()
        tb_s = (weight_bytes + activation_bytes) / (fused_us * 1e-6) / 1e12
        print(f"| {num_tokens} | {hit} | {floor_us:.1f} | {fused_us:.1f} | {tb_s:.2f} | {100 * floor_us / fused_us:.0f}% "
              f"| {loop_us:.1f} | {loop_us / fused_us:.1f}x | {diff:.3f} |")


if __name__ == "__main__":
    main()
