"""silu(gate) * up as one Triton kernel (CUDA), for steps of more rows than the skinny projection fuses it into.

x: [..., 2 * n], rows contiguous in their last dim ([gate | up], the merged projection's output); the result
[..., n] in x's dtype, computed in float32 and rounded once, as torch.compile's fused kernel does, which takes a
flat index an element and took 3x its bytes' time; this one (a tile of rows x columns a program) is near them.
Triton is imported under a guard, as in `triton_kvstore`.
"""
import torch

from nanovllm.layers.triton_guard import require_triton, tl, triton

BLOCK_ROWS, BLOCK_COLS = 4, 1024

if triton is not None:
    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, num_rows, n, x_stride, out_stride,
                             BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
        mask = (rows < num_rows) & (cols < n)
        gate = tl.load(x_ptr + rows * x_stride + cols, mask=mask).to(tl.float32)
        up = tl.load(x_ptr + rows * x_stride + n + cols, mask=mask).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + rows * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    require_triton("the Triton silu(gate) * up kernel")
    assert x.size(-1) % 2 == 0 and x.stride(-1) == 1
    n = x.size(-1) // 2
    rows = x.reshape(-1, 2 * n)
    out = torch.empty(rows.size(0), n, dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (triton.cdiv(rows.size(0), BLOCK_ROWS), triton.cdiv(n, BLOCK_COLS))
        _silu_and_mul_kernel[grid](rows, out, rows.size(0), n, rows.stride(0), out.stride(0),
                                   BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
    return out.view(*x.shape[:-1], n)
