"""The projections of a small decode step, each with what the engine fuses into it (`triton_skinny`), in
Qwen3-0.6B's shapes: cuBLAS plus the torch layers (compiled, as the engine compiles them) against the skinny
kernel, with dependent launches (PDL) and without. As in a decode step, one CUDA graph runs a projection for each
of 28 layers, each with its own weights (more bytes than L2 holds), so launch gaps and ramp-up count as they do
in the engine; the table gives microseconds per layer and TB/s of weights read, against the copy floor of the
same run. `--sweep` times every tile of SWEEP too and lists the best three.

    python benchmarks/skinny_gemm.py [--rows 1 8 16 32] [--sweep]
"""
import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode_attention  # noqa: E402  (this folder, as python runs a script)
from nanovllm.layers import triton_skinny  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.triton_guard import pdl_args  # noqa: E402

# name: (N, K, what is fused): the output columns N (of each of gate and up when gated)
SHAPES = {"qkv": (4096, 1024, "norm"), "o_proj": (1024, 2048, "residual"), "gate_up": (3072, 1024, "norm+gated"),
          "down": (1024, 3072, "residual")}
LAYERS = 28
SWEEP = [(16, 256, 4), (16, 512, 4), (16, 1024, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 4), (32, 512, 8),
         (32, 1024, 8), (64, 256, 4), (64, 256, 8), (64, 512, 8)]


def chain_us(fn) -> float:
    """Microseconds per layer of fn(0) ... fn(LAYERS - 1) replayed in one CUDA graph, timed as
    `decode_attention.time_us` times a graph (L2 cleared before each replay, as --flush says)."""
    return decode_attention.time_us(lambda: [fn(i) for i in range(LAYERS)]) / LAYERS


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="every tile of SWEEP, with PDL")
    parser.add_argument("--compile-only", action="store_true", help="with --sweep: compile every tile, time none")
    parser.add_argument("--flush", choices=["read", "zero"], default=decode_attention.FLUSH,
                        help="how L2 is cleared before each replay (decode_attention.time_us)")
    args = parser.parse_args()
    decode_attention.FLUSH = args.flush
    copy = decode_attention.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy:.2f} TB/s; us per layer (TB/s of weights)")
    print("| layer | fused | rows | floor | cuBLAS + torch | skinny, PDL | skinny, no PDL |"
          + (" best of sweep |" if args.sweep else ""))
    silu = torch.compile(SiluAndMul().forward, dynamic=True)
    for name, m in itertools.product(args.shapes, args.rows):
        n, k, fused = SHAPES[name]
        gated, normed, residual = "gated" in fused, "norm" in fused, fused == "residual"
        rows = 2 * n if gated else n
        ws = [torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5 for _ in range(LAYERS)]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        res = torch.randn(m, n, dtype=torch.bfloat16, device="cuda") if residual else None
        norm_module = RMSNorm(k).to("cuda", torch.bfloat16)
        norm_module.weight.data.copy_(torch.rand(k, device="cuda") + 0.5)
        norm_module.forward = torch.compile(norm_module.forward, dynamic=True)
        bytes_ = rows * k * 2

        def torch_layers(i):
            if residual:  # as `linear` adds it beyond the skinny kernel's rows
                return torch.addmm(res, x, ws[i].t())
            y = F.linear(norm_module(x) if normed else x, ws[i])
            return silu(y) if gated else y

        def skinny(i, config=None):
            return triton_skinny.skinny_linear(x, ws[i], norm=(norm_module.weight, 1e-6) if normed else None,
                                               gated=gated, residual=res, config=config)
        if args.compile_only:
            for config in SWEEP:
                try:
                    skinny(0, config)
                except Exception as e:
                    print(f"  {name} {m} {config}: {type(e).__name__}", file=sys.stderr)
            continue
        expected = torch_layers(0).float()
        err = (skinny(0).float() - expected).abs().max().item()
        assert err < 0.05 * expected.abs().max().item(), f"{name} {m} rows: max error {err}"
        cells = [bytes_ / copy / 1e6, chain_us(torch_layers), chain_us(skinny)]
        triton_skinny.pdl_args = lambda device: dict(PDL=False)
        cells.append(chain_us(skinny))
        triton_skinny.pdl_args = pdl_args
        line = f"| {name} | {fused} | {m} | " + " | ".join(f"{us:.2f} ({bytes_ / us / 1e6:.2f})" for us in cells)
        if args.sweep:
            results = []
            for config in SWEEP:
                try:
                    results.append((chain_us(functools.partial(skinny, config=config)), config))
                except Exception as e:  # a tile that does not fit (shared memory, registers)
                    print(f"  {name} {m} {config}: {type(e).__name__}", file=sys.stderr)
            best = sorted(results)[:3]
            line += " " + "; ".join(f"{us:.2f} {c}" for us, c in best) + " |"
        print(line + " |" if not args.sweep else line, flush=True)


if __name__ == "__main__":
    main()
