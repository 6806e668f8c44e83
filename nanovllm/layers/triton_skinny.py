"""A decode step's projections at small batches, each with what sits around it in a decoder layer, in one launch:
y = act(norm(x) @ w.T + bias) + residual for x [M, K] with M <= MAX_ROWS, w [N, K], every part but the product
optional:
- norm: RMSNorm of each row of x (its weight and eps), rounded to the model's dtype where `RMSNorm` rounds;
- gated: w holds gate rows then up rows ([2N, K], a merged gate/up projection) and y = silu(gate) * up, [M, N];
- residual: added to the product rounded to the model's dtype, as `residual + o_proj(x)` adds them.
So a dense layer's projections and what surrounds them are four launches (norm + qkv, o_proj + residual, norm +
gate/up + silu, down + residual) where they were seven (add + norm, qkv, o_proj, add + norm, gate/up, silu, down).

Each program reads one block of w, BLOCK_N rows by BLOCK_K columns (and the matching up rows), against the rows
of x padded to 16 for `tl.dot`. When K is longer than BLOCK_K, its parts write their float32 partial sums and
the program that finishes last for a block of columns (a counter per block, which it resets to 0) adds them up
and applies the rest; one launch either way. The grid depends on M, N and K only, so a CUDA graph of a batch
size captures it.

Programmatic dependent launch (sm90+, `pdl`): the GPU may start a kernel while the one before it still runs.
Each program loads its weights, which no kernel writes, and only then waits (`gdc_wait`) for the previous
kernel's results, so the weights stream in during the previous kernel's tail and between the two launches,
where a small step's GPU otherwise idles. Every program waits before it stores anything or finishes, so each
kernel still ends after the one before it (and all earlier ones) did. The attention kernels and the fused rope
and store take part in the same way.

On the H200, in Qwen3-0.6B's shapes (`benchmarks/skinny_gemm.py`), cuBLAS reads the weights of these small
products slowly (o_proj 5.8-6.1 us a layer at 8-32 rows for 4 MB that need 1 us at copy bandwidth).
NANOVLLM_SKINNY_GEMM=0 turns the kernel off, NANOVLLM_PDL=0 the dependent launches, for comparison.
"""
import os

import torch

from nanovllm.layers.triton_guard import pdl_args, pdl_launch, tl, triton

MAX_ROWS = 32
ENABLED = os.environ.get("NANOVLLM_SKINNY_GEMM", "1") == "1"
DEVICE_TYPE = "cuda"  # on CPU (tests under the interpreter call it directly) F.linear is the faster

if triton is not None:
    @triton.jit
    def _epilogue(acc, acc_up, bias_ptr, res_ptr, out_ptr, rows, cols, N, res_stride, mask,
                  HAS_BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if GATED:  # gate and up rounded as the projection's output, silu(gate) * up rounded once
            gate = acc.to(dtype).to(tl.float32)
            acc = gate * tl.sigmoid(gate) * acc_up.to(dtype).to(tl.float32)
        if RESIDUAL:
            residual = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
            acc = acc.to(dtype).to(tl.float32) + residual.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(dtype), mask=mask)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, out_ptr, partial_ptr, counter_ptr,
                       M, N, K, x_stride, w_stride, res_stride, eps, parts,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                       SPLIT: tl.constexpr, PDL: tl.constexpr, DOT_PRECISION: tl.constexpr):
        pid_n, part = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = part * BLOCK_K + tl.arange(0, BLOCK_K)
        row_mask, col_mask, k_mask = rows < M, cols < N, ks < K
        w_block = w_ptr + cols.to(tl.int64)[:, None] * w_stride + ks[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(w_block, mask=w_mask, other=0.0)
        if GATED:
            w_up = tl.load(w_block + N * w_stride, mask=w_mask, other=0.0)
        if PDL:  # x and the residual are the previous kernel's: wait for it to finish
            tl.extra.cuda.gdc_wait()
        x_rows = x_ptr + rows[:, None] * x_stride
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            if SPLIT:  # the sum of squares needs the whole row
                squares = tl.zeros([BLOCK_M], tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    xk = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
                    squares += tl.sum(xk.to(tl.float32) * xk.to(tl.float32), 1)
            else:
                squares = tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
            rstd = tl.math.rsqrt(squares / K + eps)
            weight = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x = (weight[None, :] * (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        acc_up = acc
        if GATED:
            acc_up = tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
        mask = row_mask[:, None] & col_mask[None, :]
        if SPLIT:
            width = 2 * N if GATED else N
            partials = partial_ptr + rows[:, None] * width + cols[None, :]  # [parts, BLOCK_M, width] float32
            tl.store(partials + part * BLOCK_M * width, acc, mask=mask)
            if GATED:
                tl.store(partials + part * BLOCK_M * width + N, acc_up, mask=mask)
            tl.debug_barrier()  # every thread's partial sums are written before the counter says so
            if tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == parts - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for p in range(parts):  # ".cg": from L2, where the other programs' stores are
                    acc += tl.load(partials + p * BLOCK_M * width, mask=mask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(partials + p * BLOCK_M * width + N, mask=mask, other=0.0,
                                          cache_modifier=".cg")
                tl.store(counter_ptr + pid_n, 0)  # ready for the next launch
                _epilogue(acc, acc_up, bias_ptr, res_ptr, out_ptr, rows, cols, N, res_stride, mask,
                          HAS_BIAS, GATED, RESIDUAL)
        else:
            _epilogue(acc, acc_up, bias_ptr, res_ptr, out_ptr, rows, cols, N, res_stride, mask,
                      HAS_BIAS, GATED, RESIDUAL)


_counters: dict[torch.device, torch.Tensor] = {}


def plan(block_m: int, k: int, gated: bool) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps), the fastest tiles of `benchmarks/skinny_gemm.py --sweep` on an H200 in
    Qwen3-0.6B's shapes (K 1024 for qkv and gate/up, 2048 for o_proj, 3072 for down) at 16 and 32 rows."""
    if gated:
        return (32, 512, 4) if block_m <= 16 else (64, 256, 4)
    if k <= 1024:
        return (32, 1024, 8) if block_m <= 16 else (64, 256, 8)
    return 64, 512, 8


def takes(x: torch.Tensor) -> bool:
    """Whether a step of x's rows (tokens) is one for this kernel: few of them, on the device it serves."""
    return ENABLED and triton is not None and 0 < x.size(0) <= MAX_ROWS and x.device.type == DEVICE_TYPE


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether skinny_linear takes this product (else F.linear): `takes(x)`, both read along contiguous columns,
    and fewer outputs than inputs (o_proj, down) unless launches are dependent (then qkv and gate/up too: without
    PDL, cuBLAS and a norm kernel beat it there)."""
    return (takes(x) and x.dim() == 2 and x.stride(1) == 1 and w.stride(1) == 1
            and (w.size(0) < w.size(1) or pdl_launch(x.device)))


def _counter(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeros, one per block of columns, that every launch leaves at zero (first allocated by the warm-up's eager
    steps, before any CUDA graph is captured)."""
    counter = _counters.get(device)
    if counter is None or counter.numel() < blocks:
        counter = _counters[device] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return counter


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
                  residual: torch.Tensor | None = None,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """act(norm(x) @ w.T + bias) + residual as the module docstring says: [M, N] in x's dtype, N = w's rows (half
    of them when gated). norm: (weight [K], eps). `config` (block_n, block_k, num_warps) overrides `plan`
    (tests, benchmarks)."""
    m, k = x.shape
    n = w.size(0) // 2 if gated else w.size(0)
    assert w.size(1) == k and m <= MAX_ROWS and (not gated or w.size(0) == 2 * n)
    assert residual is None or (residual.shape == (m, n) and residual.stride(1) == 1)
    block_m = max(16, triton.next_power_of_2(m))
    block_n, block_k, warps = config or plan(block_m, k, gated)
    blocks, parts = -(-n // block_n), -(-k // block_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = parts > 1
    partial = torch.empty(parts, block_m, 2 * n if gated else n, dtype=torch.float32, device=x.device) \
        if split else out
    norm_weight, eps = norm if norm is not None else (out, 0.0)
    _skinny_kernel[(blocks, parts)](
        x, w, bias if bias is not None else out, norm_weight, residual if residual is not None else out, out,
        partial, _counter(x.device, blocks) if split else out, m, n, k, x.stride(0), w.stride(0),
        residual.stride(0) if residual is not None else 0, eps, parts, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, NORM=norm is not None, GATED=gated,
        RESIDUAL=residual is not None, SPLIT=split, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=1, **pdl_args(x.device))
    return out
