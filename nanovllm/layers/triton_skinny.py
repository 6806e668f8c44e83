"""A decode step's projections at small batches, each with what sits around it in a decoder layer, in one launch:
y = act(norm(x) @ w.T + bias) + residual for x [M, K] with M <= MAX_ROWS, w [N, K], every part but the product
optional:
- norm: RMSNorm of each row of x (its weight and eps), rounded to the model's dtype where `RMSNorm` rounds; or,
  with K in parts at more than 16 rows (`norm_parts`), as rstd * ((weight * x) @ w.T), weight * x rounded to the
  model's dtype (a rounding apart): rstd is a factor of each row, so a part needs only its own columns' squares;
- gated: w holds gate rows then up rows ([2N, K], a merged gate/up projection) and y = silu(gate) * up, [M, N];
- residual: added to the product rounded to the model's dtype, as `residual + o_proj(x)` adds them;
- rope: w is a qkv projection, and what `triton_rope_store` does after it (q/k norms, rope, the KV store) is
  done here: a program takes the two halves of one head, and the last of its parts finishes the head.
So a dense layer's projections and what surrounds them are four launches (norm + qkv + rope + store, o_proj +
residual, norm + gate/up + silu, down + residual), not eight.

Each program reads one block of w, BLOCK_N rows by BLOCK_K columns (and the matching up rows, or the head's
other half), against the rows of x padded to 16 for `tl.dot`. When K is longer than BLOCK_K, its parts write
their float32 partial sums (and their rows' sums of squares) and the program that finishes last for a block of
columns (a counter per block, which it resets to 0) adds them up and applies the rest; one launch either way. The
grid depends on M, N and K only, so a CUDA graph of a batch size captures it.

Programmatic dependent launch (sm90+, `pdl`): the GPU may start a kernel while the one before it still runs.
Each program loads its weights, which no kernel writes, and only then waits (`gdc_wait`) for the previous
kernel's results, so the weights stream in during the previous kernel's tail and between the two launches,
where a small step's GPU otherwise idles. Every program waits before it stores anything or finishes, so each
kernel still ends after the one before it (and all earlier ones) did. The attention kernels and the fused rope
and store take part in the same way.

cuBLAS reads the weights of these small products slowly (`git show 34b7da6:benchmarks/skinny_gemm.py`).
NANOVLLM_SKINNY_GEMM=0 turns the kernel off, NANOVLLM_SKINNY_ROPE=0 its rope and store (then a kernel of its own),
NANOVLLM_PDL=0 the dependent launches, for comparison.
"""
import os

import torch

from nanovllm.layers.attention import FP8_DTYPE, value_chunk
from nanovllm.layers.triton_guard import pdl_args, pdl_launch, require_triton, tl, triton
from nanovllm.layers.triton_kvstore import cache_offsets, quantize_fp8
from nanovllm.layers.triton_rope_store import RopeStoreArgs, norm_and_rotate

MAX_ROWS = 32
ENABLED = os.environ.get("NANOVLLM_SKINNY_GEMM", "1") == "1"
ROPE = os.environ.get("NANOVLLM_SKINNY_ROPE", "1") == "1"
DEVICE_TYPE = "cuda"  # on CPU (tests under the interpreter call it directly) F.linear is the faster

if triton is not None:
    @triton.jit
    def _epilogue(acc, acc_up, bias, bias_up, residual, out_ptr, rows, cols, N, mask,
                  HAS_BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
        """bias (float32 [BLOCK_N], up's too), act and residual (as loaded) on the product, stored to out."""
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += bias[None, :]
            if GATED:
                acc_up += bias_up[None, :]
        if GATED:  # gate and up rounded as the projection's output, silu(gate) * up rounded once
            gate = acc.to(dtype).to(tl.float32)
            acc = gate * tl.sigmoid(gate) * acc_up.to(dtype).to(tl.float32)
        if RESIDUAL:
            acc = acc.to(dtype).to(tl.float32) + residual.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(dtype), mask=mask)

    @triton.jit
    def _rope_epilogue(x1, x2, bias1, bias2, out_ptr, rows, cols, head, N, row_mask, cos, sin, slot, w1, w2,
                       k_cache_ptr, v_cache_ptr, eps, k_scale, v_scale,
                       HAS_BIAS: tl.constexpr, HALF: tl.constexpr, NUM_HEADS: tl.constexpr,
                       NUM_KV_HEADS: tl.constexpr, QK_NORM: tl.constexpr, QUANTIZE: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, V_CHUNK: tl.constexpr):
        """One head of one token per row, x1 and x2 its two halves (float32 sums): q and k normed (QK_NORM) and
        rotated (by each row's cos and sin; w1 and w2 the halves of the head's norm weight), q written to out, k and
        v stored in the cache at the row's slot as `triton_rope_store` does (and to out as projected)."""
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            x1 += bias1[None, :]
            x2 += bias2[None, :]
        x1 = x1.to(dtype).to(tl.float32)  # the projection's output
        x2 = x2.to(dtype).to(tl.float32)
        out = out_ptr + rows[:, None] * N + cols[None, :]
        if head >= NUM_HEADS:  # k and v also as projected (the q/k/v split's k and v; the cache holds their own)
            tl.store(out, x1.to(dtype), mask=row_mask[:, None])
            tl.store(out + HALF, x2.to(dtype), mask=row_mask[:, None])
        if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: norm and rope
            x1, x2 = norm_and_rotate(x1, x2, w1, w2, cos, sin, eps, 2 * HALF, dtype, QK_NORM)
        if head < NUM_HEADS:
            tl.store(out, x1.to(dtype), mask=row_mask[:, None])
            tl.store(out + HALF, x2.to(dtype), mask=row_mask[:, None])
        else:
            is_k = head < NUM_HEADS + NUM_KV_HEADS
            cache_ptr = k_cache_ptr if is_k else v_cache_ptr
            scale = k_scale if is_k else v_scale
            kv_head = head - NUM_HEADS if is_k else head - NUM_HEADS - NUM_KV_HEADS
            y1 = x1.to(dtype)  # the key rounded after rope, as the unfused rope returns it
            y2 = x2.to(dtype)
            if QUANTIZE:
                y1, y2 = quantize_fp8(y1, scale), quantize_fp8(y2, scale)
            dims, key = tl.arange(0, HALF)[None, :], slot[:, None]  # (values: where `value_chunk` says)
            first = cache_offsets(key, kv_head, dims, NUM_KV_HEADS, 2 * HALF, BLOCK_SIZE, 0)
            second = first + HALF
            if V_CHUNK:
                if not is_k:
                    first = cache_offsets(key, kv_head, dims, NUM_KV_HEADS, 2 * HALF, BLOCK_SIZE, V_CHUNK)
                    second = cache_offsets(key, kv_head, dims + HALF, NUM_KV_HEADS, 2 * HALF, BLOCK_SIZE, V_CHUNK)
            store = (row_mask & (slot >= 0))[:, None]
            tl.store(cache_ptr + first, y1.to(cache_ptr.dtype.element_ty), mask=store)
            tl.store(cache_ptr + second, y2.to(cache_ptr.dtype.element_ty), mask=store)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, out_ptr, partial_ptr, counter_ptr,
                       M, N, K, x_stride, w_stride, res_stride, eps, parts,
                       positions_ptr, cos_sin_ptr, slot_ptr, q_weight_ptr, k_weight_ptr, k_cache_ptr, v_cache_ptr,
                       qk_eps, k_scale, v_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                       SPLIT: tl.constexpr, NORM_PARTS: tl.constexpr, PDL: tl.constexpr,
                       DOT_PRECISION: tl.constexpr,
                       ROPE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       QK_NORM: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       V_CHUNK: tl.constexpr):
        pid_n, part = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        # a second block of w beside the first: up's rows (GATED), or the second half of the head (ROPE: a
        # program takes one head, BLOCK_N its half)
        if ROPE:
            cols = pid_n * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
            pair = BLOCK_N
        else:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            pair = N
        ks = part * BLOCK_K + tl.arange(0, BLOCK_K)
        row_mask, col_mask, k_mask = rows < M, cols < N, ks < K
        w_block = w_ptr + cols.to(tl.int64)[:, None] * w_stride + ks[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(w_block, mask=w_mask, other=0.0)
        if GATED or ROPE:
            w_up = tl.load(w_block + pair * w_stride, mask=w_mask, other=0.0)
        # what no kernel writes (weights, biases; the host's positions and slots) before the wait too
        bias = tl.zeros([BLOCK_N], tl.float32)
        bias_up = bias
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            if GATED or ROPE:
                bias_up = tl.load(bias_ptr + cols + pair, mask=col_mask, other=0.0).to(tl.float32)
        if NORM:
            weight = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        if ROPE:
            position = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            angles = cos_sin_ptr + position[:, None] * (2 * BLOCK_N) + tl.arange(0, BLOCK_N)[None, :]
            cos, sin = tl.load(angles), tl.load(angles + BLOCK_N)
            slot = tl.load(slot_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
            w1 = cos  # (unread without QK_NORM)
            w2 = cos
            if QK_NORM:  # the head's norm: q's, or k's (v's heads leave it unread)
                head_weight = q_weight_ptr if pid_n < NUM_HEADS else k_weight_ptr
                w1 = tl.load(head_weight + tl.arange(0, BLOCK_N)).to(tl.float32)[None, :]
                w2 = tl.load(head_weight + BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.float32)[None, :]
        if PDL:  # x and the residual are the previous kernel's: wait for it to finish
            tl.extra.cuda.gdc_wait()
        mask = row_mask[:, None] & col_mask[None, :]
        residual = bias[None, :]
        if RESIDUAL:  # for the epilogue, loaded now: one round trip less after the last part's sum
            residual = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        squares = tl.zeros([BLOCK_M], tl.float32)
        if NORM:  # the sums of squares of NORM_PARTS parts of K, 0: of this part's, rstd applied to the sums below
            if NORM_PARTS > 1:  # the whole row's, its parts' loads unrolled, so issued at once
                for chunk in tl.static_range(NORM_PARTS):
                    k = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
                    xk = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :],
                                 mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
                    squares += tl.sum(xk.to(tl.float32) * xk.to(tl.float32), 1)
            else:
                squares = tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
            if NORM_PARTS:  # rounded as RMSNorm rounds
                rstd = tl.math.rsqrt(squares / K + eps)
                x = (weight[None, :] * (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
            else:
                x = (weight[None, :] * x.to(tl.float32)).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        acc_up = acc
        if GATED or ROPE:
            acc_up = tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
        last = True  # whether this program applies the rest: each one, or the last part of a block of columns
        if SPLIT:
            width = 2 * N if GATED else N
            partials = partial_ptr + rows[:, None] * width + cols[None, :]  # [parts, BLOCK_M, width] float32
            tl.store(partials + part * BLOCK_M * width, acc, mask=mask)
            if GATED or ROPE:
                tl.store(partials + part * BLOCK_M * width + pair, acc_up, mask=mask)
            # then [parts, blocks, BLOCK_M]: the rows' squares of each part, a copy for each block of columns
            part_squares = partial_ptr + parts * BLOCK_M * width + pid_n * BLOCK_M + rows
            if NORM and not NORM_PARTS:
                tl.store(part_squares + part * tl.num_programs(0) * BLOCK_M, squares)
            tl.debug_barrier()  # every thread's partial sums are written before the counter says so
            last = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == parts - 1
            if last:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                squares = tl.zeros([BLOCK_M], tl.float32)
                for p in range(parts):  # ".cg": from L2, where the other programs' stores are
                    acc += tl.load(partials + p * BLOCK_M * width, mask=mask, other=0.0, cache_modifier=".cg")
                    if GATED or ROPE:
                        acc_up += tl.load(partials + p * BLOCK_M * width + pair, mask=mask, other=0.0,
                                          cache_modifier=".cg")
                    if NORM and not NORM_PARTS:
                        squares += tl.load(part_squares + p * tl.num_programs(0) * BLOCK_M, cache_modifier=".cg")
                tl.store(counter_ptr + pid_n, 0)  # ready for the next launch
        if last:
            if NORM and not NORM_PARTS:
                rstd = tl.math.rsqrt(squares / K + eps)[:, None]
                acc *= rstd
                acc_up *= rstd
            if ROPE:
                _rope_epilogue(acc, acc_up, bias, bias_up, out_ptr, rows, cols, pid_n, N, row_mask, cos, sin, slot,
                               w1, w2, k_cache_ptr, v_cache_ptr, qk_eps, k_scale, v_scale, HAS_BIAS, BLOCK_N,
                               NUM_HEADS, NUM_KV_HEADS, QK_NORM, QUANTIZE, BLOCK_SIZE, V_CHUNK)
            else:
                _epilogue(acc, acc_up, bias, bias_up, residual, out_ptr, rows, cols, N, mask, HAS_BIAS, GATED,
                          RESIDUAL)


_counters: dict[torch.device, torch.Tensor] = {}
# up to this many rows a program of a normed product in parts loads its rows whole for their sums of squares; past
# them each part sums its own columns' squares and the last part applies rstd (faster at 32 rows, slower at 4)
WHOLE_ROWS_NORM_UP_TO = 16


def norm_parts(parts: int, block_m: int, normed: bool = True) -> int:
    """The kernel's NORM_PARTS: the parts of K whose squares a program loads (1: K in one part, its own, or no
    norm), or 0: its own part's, the last part applying rstd to the sums."""
    return 1 if parts == 1 or not normed else parts if block_m <= WHOLE_ROWS_NORM_UP_TO else 0


def plan(block_m: int, k: int, gated: bool, head_dim: int = 0) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps), the fastest tiles of `skinny_gemm.py --sweep` (in git at 34b7da6) on an H200
    in Qwen3-0.6B's shapes at 16 and 32 rows; down (K above 2048) at up to 16 rows: twice the programs of half the
    weights (a faster batch-1 decode step). With rope (head_dim), a program takes one head and 32K weights."""
    if head_dim:
        return head_dim // 2, min(32768 // head_dim, triton.next_power_of_2(k)), 8
    if gated:
        return (32, 512, 4) if block_m <= 16 else (64, 256, 4)
    if k <= 1024:
        return (32, 1024, 8) if block_m <= 16 else (64, 256, 8)
    return (32, 512, 4) if k > 2048 and block_m <= 16 else (64, 512, 8)


def takes(x: torch.Tensor) -> bool:
    """Whether a step of x's rows (tokens) is one for this kernel: few of them, on the device it serves."""
    return ENABLED and triton is not None and 0 < x.size(0) <= MAX_ROWS and x.device.type == DEVICE_TYPE


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether skinny_linear takes this product (else F.linear): `takes(x)`, both read along contiguous columns,
    and fewer outputs than inputs (o_proj, down) unless launches are dependent (then qkv and gate/up too: without
    PDL, cuBLAS and a norm kernel beat it there)."""
    return (takes(x) and x.dim() == 2 and x.stride(1) == 1 and w.stride(1) == 1
            and (w.size(0) < w.size(1) or pdl_launch(x.device)))


def fuses_rope(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """Whether skinny_linear takes this qkv projection with its rope and KV store: it `fits`, and half a head is
    a power of two that `tl.dot` takes (16 or more)."""
    return ROPE and fits(x, w) and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def _counter(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeros, one per block of columns, that every launch leaves at zero (first allocated by the warm-up's eager
    steps, before any CUDA graph is captured)."""
    counter = _counters.get(device)
    if counter is None or counter.numel() < blocks:
        counter = _counters[device] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return counter


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
                  residual: torch.Tensor | None = None, rope: RopeStoreArgs | None = None,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """act(norm(x) @ w.T + bias) + residual as the module docstring says: [M, N] in x's dtype, N = w's rows (half
    of them when gated). norm: (weight [K], eps). rope: w is a qkv projection (q heads, then k, then v, of the
    cache's head_dim); its q columns come out normed and rotated, and k and v also go to the cache, as
    `triton_rope_store.rope_store(q, k, v, *rope)` does. `config` (block_n, block_k, num_warps) overrides
    `plan` (tests, benchmarks)."""
    require_triton("the skinny projection")
    m, k = x.shape
    n = w.size(0) // 2 if gated else w.size(0)
    assert w.size(1) == k and m <= MAX_ROWS and (not gated or w.size(0) == 2 * n)
    assert residual is None or (residual.shape == (m, n) and residual.stride(1) == 1)
    block_m = max(16, triton.next_power_of_2(m))
    if rope is None:
        rope_args, num_kv_heads, head_dim, quantize, block_size, v_chunk = (x,) * 7 + (0.0, 1.0, 1.0), 0, 0, False, 0, 0
    else:  # internal invariants: the decoder's layers and the model runner's cache
        assert not gated and residual is None and rope.k_cache.is_contiguous() and rope.v_cache.is_contiguous()
        num_kv_heads, head_dim = rope.k_cache.shape[2:]
        assert n % head_dim == 0 and rope.cos_sin.dtype == torch.float32 and rope.cos_sin.is_contiguous()
        assert rope.slot_mapping.shape == rope.positions.shape == (m,)
        assert (rope.q_weight is None) == (rope.k_weight is None)
        quantize = rope.k_cache.dtype == FP8_DTYPE
        block_size, v_chunk = rope.v_cache.size(1), value_chunk(rope.v_cache)
        weights = (rope.q_weight, rope.k_weight) if rope.q_weight is not None else (rope.cos_sin,) * 2  # (unread)
        rope_args = (rope.positions, rope.cos_sin, rope.slot_mapping, *weights, rope.k_cache, rope.v_cache, rope.eps,
                     rope.k_scale, rope.v_scale)
    block_n, block_k, warps = config or plan(block_m, k, gated, head_dim)
    assert rope is None or block_n == head_dim // 2
    blocks, parts = (n // head_dim if rope is not None else -(-n // block_n)), -(-k // block_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = parts > 1
    # the parts' sums [parts, block_m, width], then their rows' sums of squares [parts, blocks, block_m]
    partial = torch.empty(parts * block_m * ((2 * n if gated else n) + blocks), dtype=torch.float32,
                          device=x.device) if split else out
    norm_weight, eps = norm if norm is not None else (out, 0.0)
    _skinny_kernel[(blocks, parts)](
        x, w, bias if bias is not None else out, norm_weight, residual if residual is not None else out, out,
        partial, _counter(x.device, blocks) if split else out, m, n, k, x.stride(0), w.stride(0),
        residual.stride(0) if residual is not None else 0, eps, parts, *rope_args, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, NORM=norm is not None, GATED=gated,
        RESIDUAL=residual is not None, SPLIT=split,
        NORM_PARTS=norm_parts(parts, block_m, norm is not None),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ROPE=rope is not None,
        NUM_HEADS=n // head_dim - 2 * num_kv_heads if rope is not None else 0, NUM_KV_HEADS=num_kv_heads,
        QK_NORM=rope is not None and rope.q_weight is not None, QUANTIZE=quantize,
        BLOCK_SIZE=block_size, V_CHUNK=v_chunk,
        num_warps=warps, num_stages=1, **pdl_args(x.device))
    return out
