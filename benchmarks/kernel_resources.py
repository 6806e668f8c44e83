"""Registers, spilled bytes a thread (STACK) and SASS instructions of the skinny kernel's projections in Qwen3-0.6B's
shapes, compiled for sm90 on any machine (no GPU: the CPU's Triton and its cuobjdump and nvdisasm), for the plan's
tiles and any others. A tile whose registers spill reads and writes local memory at every use: the first thing to
look at before a device call that times tiles.

    python benchmarks/kernel_resources.py [--rows 16 32] [--shapes qkv ...] [--tile gate_up=64,256,8 ...]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.layers import triton_skinny  # noqa: E402

# name: (N, K, norm, gated, residual, rope), a dense layer's projections as a decode step runs them
SHAPES = {"qkv": (4096, 1024, True, False, False, True), "o_proj": (1024, 2048, False, False, True, False),
          "gate_up": (3072, 1024, True, True, False, False), "down": (1024, 3072, False, False, True, False)}
HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 128, 16, 8
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def resources(name: str, block_m: int, tile: tuple[int, int, int]) -> str:
    n, k, norm, gated, residual, rope = SHAPES[name]
    block_n, block_k, warps = tile
    parts = -(-k // block_k)
    pointers = ("x_ptr", "w_ptr", "bias_ptr", "norm_ptr", "res_ptr", "out_ptr", "q_weight_ptr", "k_weight_ptr",
                "k_cache_ptr", "v_cache_ptr")
    signature = {**dict.fromkeys(pointers, "*bf16"), "partial_ptr": "*fp32", "counter_ptr": "*i32",
                 **dict.fromkeys(("M", "N", "K", "x_stride", "w_stride", "res_stride", "parts"), "i32"),
                 **dict.fromkeys(("eps", "qk_eps", "k_scale", "v_scale"), "fp32"),
                 "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64"}
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, NORM=norm, GATED=gated,
                      RESIDUAL=residual, SPLIT=parts > 1,
                      NORM_PARTS=triton_skinny.norm_parts(parts, block_m, norm), PDL=True,
                      DOT_PRECISION="tf32", ROPE=rope, NUM_HEADS=NUM_HEADS if rope else 0,
                      NUM_KV_HEADS=NUM_KV_HEADS if rope else 0, QK_NORM=rope, QUANTIZE=False, BLOCK_SIZE=256, V_CHUNK=0)
    source = ASTSource(triton_skinny._skinny_kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")},
                       constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([BIN / "nvdisasm", cubin], capture_output=True, text=True).stdout
    regs, stack = (re.search(rf"{field}:(\d+)", usage).group(1) for field in ("REG", "STACK"))
    instructions = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))
    return f"| {name} | {block_m} | {tile} | {regs} | {stack} | {instructions} |"


def parse_tiles(items: list[str]) -> dict:
    """["down=32,512,4", "qkv@32=64,128,8"] -> {"down": (32, 512, 4), "qkv@32": (64, 128, 8)}; a ValueError names
    what is wrong."""
    tiles = {}
    for item in items:
        key, _, value = item.partition("=")
        name, _, rows = key.partition("@")
        numbers = tuple(int(v) for v in value.split(",")) if value else ()
        if name not in SHAPES or rows not in ("", "16", "32") or len(numbers) != 3:
            raise ValueError(f"{item!r}: NAME[@16 or @32]=block_n,block_k,warps, NAME one of {', '.join(SHAPES)}")
        tiles[key] = numbers
    return tiles


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32], help="block_m: 16 or 32")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tile", action="append", default=[],
                        help="NAME[@ROWS]=block_n,block_k,warps: a tile beside the plan's (ROWS: 16 or 32)")
    args = parser.parse_args()
    extra = parse_tiles(args.tile)
    print("| projection | rows | tile | registers | stack bytes | SASS instructions |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name in args.shapes:
        n, k, norm, gated, residual, rope = SHAPES[name]
        for block_m in args.rows:
            tiles = [triton_skinny.plan(block_m, k, gated, HEAD_DIM if rope else 0),
                     extra.get(f"{name}@{block_m}") or extra.get(name)]
            for tile in filter(None, tiles):
                print(resources(name, block_m, tile), flush=True)


if __name__ == "__main__":
    main()
