"""The projections of a small decode step: cuBLAS (F.linear) against the skinny Triton matmul (`triton_skinny`) in
Qwen3-0.6B's shapes. As in a decode step, one CUDA graph runs a projection for each of 28 layers, each with its
own weights (more bytes than L2 holds), so launch gaps and ramp-up count as they do in the engine; the table
gives microseconds per layer and TB/s of weights read, against the copy floor of the same run. The engine takes
the skinny kernel only where N < K (o_proj, down); the others are here to show why.

    python benchmarks/skinny_gemm.py [--rows 1 8 16 32] [--sweep]
"""
import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.layers import triton_skinny  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # (N, K)
LAYERS = 28
SWEEP = [(bn, bk, 4, st) for bn in (16, 32, 64) for bk, st in ((128, 4), (256, 3), (512, 3)) if bn * bk <= 8192] + [
    (16, 256, 2, 4), (32, 256, 4, 4)]


def chain_us(fn) -> float:
    """Microseconds per layer of fn(0) ... fn(LAYERS - 1) replayed in one CUDA graph."""
    for i in range(LAYERS):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    return do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3 / LAYERS


def copy_bandwidth() -> float:
    """TB/s of a 1 GiB device copy, bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / do_bench(lambda: dst.copy_(src), warmup=5, rep=30) / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="every tile in SWEEP, K in 1, 2, 4 parts or auto")
    args = parser.parse_args()
    triton_skinny.MAX_ROWS = max(triton_skinny.MAX_ROWS, *args.rows)
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy:.2f} TB/s; us per layer (TB/s of weights)")
    configs = [(None, None)] + ([(c, p) for c in SWEEP for p in (None, 1, 2, 4)] if args.sweep else [])
    print("| layer | rows | floor | cuBLAS | skinny (tuned) | best of sweep |" if args.sweep else
          "| layer | rows | floor | cuBLAS | skinny |")
    for name, m in itertools.product(args.shapes, args.rows):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5 for _ in range(LAYERS)]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        bytes_ = n * k * 2
        expected = x.float() @ ws[0].float().T
        cells = [bytes_ / copy / 1e6, chain_us(lambda i: F.linear(x, ws[i]))]
        results, seen = [], set()
        for config, parts in configs:
            tile = config or triton_skinny.CONFIG
            effective = parts or triton_skinny.skinny_parts(n, k, tile[0], tile[1], 132)
            if (config, effective) in seen:
                continue
            seen.add((config, effective))
            err = (triton_skinny.skinny_linear(x, ws[0], parts=parts, config=config).float()
                   - expected).abs().max().item()
            assert err < 0.05 * expected.abs().max().item(), f"{name} {m} rows {config} {parts}: max error {err}"
            results.append((chain_us(lambda i: triton_skinny.skinny_linear(x, ws[i], parts=parts, config=config)),
                            config, parts))
        cells.append(results[0][0])
        line = f"| {name} | {m} | " + " | ".join(f"{us:.2f} ({bytes_ / us / 1e6:.2f})" for us in cells)
        if args.sweep:
            best = sorted(results, key=lambda r: r[0])[:3]
            line += " | " + "; ".join(f"{us:.2f} {c} p={p}" for us, c, p in best)
        print(line + " |", flush=True)
        del ws


if __name__ == "__main__":
    main()
