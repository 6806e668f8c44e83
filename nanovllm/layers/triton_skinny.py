"""A matmul for few rows and fewer output columns than inputs (a decode step's o_proj and down projection at small
batches): y = x @ w.T (+ bias) for x [M, K] with M <= MAX_ROWS, w [N, K], N < K.

There cuBLAS's kernels for the H200 read the weights slowly: Qwen3-0.6B's o_proj (N 1024, K 2048) takes 12.4 us a
layer at one row and 5.8-6.1 at 8-32 rows, where its 4 MB need 1 us at copy bandwidth; this kernel takes 5.0-5.9
us, and 6.1-6.7 for down (N 1024, K 3072) against cuBLAS's 7.7-8.0 (`benchmarks/skinny_gemm.py`: 28 layers'
weights in one CUDA graph). Where N >= K (qkv, gate/up) cuBLAS was as fast or faster, and F.linear stays.

Each program streams BLOCK_N weight rows over one part of K (the rows of x padded to 16 for `tl.dot`). When N /
BLOCK_N programs would not fill the GPU, K is cut into parts: each part writes its float32 partial sums, and the
program that finishes last for a block of columns (a counter per block, which it resets to 0) adds them up; one
launch either way. The grid depends on M, N and K only, so a CUDA graph of a batch size captures it.
NANOVLLM_SKINNY_GEMM=0 turns it off, for comparison.
"""
import os

import torch

from nanovllm.layers.triton_guard import num_sms, tl, triton

MAX_ROWS = 32
ENABLED = os.environ.get("NANOVLLM_SKINNY_GEMM", "1") == "1"
DEVICE_TYPE = "cuda"  # on CPU (tests under the interpreter call it directly) F.linear is the faster

if triton is not None:
    @triton.jit
    def _store(acc, bias_ptr, out_ptr, rows, cols, N, mask, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, x_stride, w_stride,
                       part_k, parts, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
        pid_n, part = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        k_begin = part * part_k
        k_end = tl.minimum(K, k_begin + part_k)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :],
                        mask=(rows < M)[:, None] & (k < k_end)[None, :], other=0.0)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * w_stride + k[None, :],
                        mask=(cols < N)[:, None] & (k < k_end)[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        if SPLIT:
            partials = partial_ptr + rows[:, None] * N + cols[None, :]  # [parts, BLOCK_M, N] float32
            tl.store(partials + part * BLOCK_M * N, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial sums are written before the counter says so
            if tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == parts - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for p in range(parts):  # ".cg": from L2, where the other programs' stores are
                    acc += tl.load(partials + p * BLOCK_M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(counter_ptr + pid_n, 0)  # ready for the next launch
                _store(acc, bias_ptr, out_ptr, rows, cols, N, mask, HAS_BIAS)
        else:
            _store(acc, bias_ptr, out_ptr, rows, cols, N, mask, HAS_BIAS)


# (block_n, block_k, num_warps, num_stages); chosen with benchmarks/skinny_gemm.py
CONFIG = (32, 256, 4, 4)
_counters: dict[torch.device, torch.Tensor] = {}


def skinny_parts(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """Parts of K: enough for (N / block_n) x parts programs to fill every SM, each part at least block_k long."""
    blocks = -(-n // block_n)
    return max(1, min(-(-sms // blocks), k // block_k))


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether skinny_linear takes this product (else F.linear): few rows, fewer outputs than inputs."""
    return (ENABLED and triton is not None and x.dim() == 2 and 0 < x.size(0) <= MAX_ROWS and w.size(0) < w.size(1)
            and x.stride(1) == 1 and w.stride(1) == 1 and x.device.type == DEVICE_TYPE)


def _counter(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeros, one per block of columns, that every launch leaves at zero (first allocated by the warm-up's eager
    steps, before any CUDA graph is captured)."""
    counter = _counters.get(device)
    if counter is None or counter.numel() < blocks:
        counter = _counters[device] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return counter


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, parts: int | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias): [M, N] in x's dtype. `parts` and `config` override the tuned choices (tests,
    benchmarks)."""
    m, k = x.shape
    n = w.size(0)
    assert w.size(1) == k and m <= MAX_ROWS
    block_n, block_k, warps, stages = config or CONFIG
    block_m = max(16, triton.next_power_of_2(m))
    blocks = -(-n // block_n)
    parts = parts or skinny_parts(n, k, block_n, block_k, num_sms(x.device))
    part_k = -(-k // parts // block_k) * block_k
    parts = -(-k // part_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = parts > 1
    partial = torch.empty(parts, block_m, n, dtype=torch.float32, device=x.device) if split else out
    _skinny_kernel[(blocks, parts)](
        x, w, bias if bias is not None else out, out, partial, _counter(x.device, blocks) if split else out,
        m, n, k, x.stride(0), w.stride(0), part_k, parts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, SPLIT=split, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return out
