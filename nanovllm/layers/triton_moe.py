"""The experts of a MoE layer as three Triton launches, none of which needs a value from the host.

A (token, expert) choice is a *pair*; pair p is token p // top_k's choice p % top_k.
1. `_align_kernel`, one program per expert: counts every expert's pairs, then writes its own pairs, in pair
   order, into `sorted_pairs` at the expert's offset, each expert's run padded to a multiple of BLOCK_M with the
   sentinel `num_pairs`; and marks each BLOCK_M-row block with its expert (`num_experts` past the last one).
2. `_grouped_gemm_kernel` with GATED: one program per (block, column tile): rows of x gathered by token, times
   that expert's gate and up tiles, silu(gate) * up written at each pair's row of `act` [pairs, intermediate].
3. `_grouped_gemm_kernel` with ROUTE_WEIGHTED: act rows times the expert's down tile, scaled by the pair's
   routing weight, written at the pair's row of `out` [pairs, hidden]; a sum over top_k gives each token's output.
Grids depend only on the number of tokens (the worst case of padding), never on how tokens are routed, so a
CUDA graph captures the whole layer; blocks past the last expert's rows return at once. Every row of `act` and
`out` is written (each pair is in exactly one expert's run), so neither needs zeroing.

Triton is imported under a guard, as in `triton_kvstore`. On CPU the kernels run under TRITON_INTERPRET=1 (the
tests do this in float32: the interpreter's bfloat16 dot is not exact).
"""
import torch

from nanovllm.layers.triton_guard import require_triton, tl, triton

if triton is not None:
    @triton.jit
    def _align_kernel(expert_ids_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_blocks,
                      NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr):
        expert = tl.program_id(0)
        experts = tl.arange(0, EXPERTS_POW2)
        counts = tl.zeros([EXPERTS_POW2], dtype=tl.int32)
        for start in range(0, num_pairs, CHUNK):  # every program counts all experts: it needs its own offset
            offsets = start + tl.arange(0, CHUNK)
            ids = tl.load(expert_ids_ptr + offsets, mask=offsets < num_pairs, other=-1)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        run_start = tl.sum(tl.where(experts < expert, padded, 0))
        run_count = tl.sum(tl.where(experts == expert, counts, 0))
        run_end = run_start + tl.sum(tl.where(experts == expert, padded, 0))
        placed = run_count * 0
        for start in range(0, num_pairs, CHUNK):  # a stable counting sort: this expert's pairs in pair order
            offsets = start + tl.arange(0, CHUNK)
            match = tl.load(expert_ids_ptr + offsets, mask=offsets < num_pairs, other=-1) == expert
            ranks = placed + tl.cumsum(match.to(tl.int32), axis=0) - 1
            tl.store(sorted_pairs_ptr + run_start + ranks, offsets, mask=match)
            placed += tl.sum(match.to(tl.int32))
        padding = run_start + run_count + tl.arange(0, BLOCK_M)
        tl.store(sorted_pairs_ptr + padding, padding * 0 + num_pairs, mask=padding < run_end)
        for block in range(run_start // BLOCK_M, run_end // BLOCK_M, CHUNK):
            blocks = block + tl.arange(0, CHUNK)
            tl.store(block_experts_ptr + blocks, blocks * 0 + expert, mask=blocks < run_end // BLOCK_M)
        if expert == 0:  # the blocks no expert fills
            for block in range(tl.sum(padded) // BLOCK_M, num_blocks, CHUNK):
                blocks = block + tl.arange(0, CHUNK)
                tl.store(block_experts_ptr + blocks, blocks * 0 + NUM_EXPERTS, mask=blocks < num_blocks)

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, route_weights_ptr,
                             num_pairs, N, K, stride_a, stride_we, stride_wn, stride_out,
                             PAIRS_PER_A_ROW: tl.constexpr,  # top_k when `a` holds tokens, 1 when it holds pairs
                             GATED: tl.constexpr,  # w rows are [gate (N); up (N)]: out = silu(a gate^T) * a up^T
                             ROUTE_WEIGHTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                             DOT_PRECISION: tl.constexpr,  # "ieee" for float32 weights: no silent tf32
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block)
        if expert >= NUM_EXPERTS:
            return
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        real_rows = pairs < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        real_cols = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (pairs // PAIRS_PER_A_ROW).to(tl.int64)[:, None] * stride_a + ks[None, :]
        # the [BLOCK_K, BLOCK_N] tile of w^T: w is [N, K] per expert, K contiguous
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            real_ks = ks < K - k
            a = tl.load(a_ptrs, mask=real_rows[:, None] & real_ks[None, :], other=0.0)
            w_mask = real_ks[:, None] & real_cols[None, :]
            acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=DOT_PRECISION)
            if GATED:
                up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
                acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        if ROUTE_WEIGHTED:
            acc = acc * tl.load(route_weights_ptr + pairs, mask=real_rows, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=real_rows[:, None] & real_cols[None, :])


def block_config(num_pairs: int, num_experts: int) -> dict:
    """Tile sizes by the mean number of pairs an expert gets: 16-row blocks and narrow tiles for decode, where
    the weights' bytes dominate and many programs keep the memory busy; 64 x 128 tiles for prefill's GEMMs."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [num_blocks * block_m] int32, block_experts [num_blocks] int32) for `expert_ids`."""
    num_pairs = expert_ids.numel()
    # worst case: every expert that gets a pair wastes block_m - 1 rows of padding
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=expert_ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=expert_ids.device)
    experts_pow2 = triton.next_power_of_2(num_experts)
    _align_kernel[(num_experts,)](
        expert_ids, sorted_pairs, block_experts, num_pairs, num_blocks,
        NUM_EXPERTS=num_experts, EXPERTS_POW2=experts_pow2, BLOCK_M=block_m,
        CHUNK=max(16, 8192 // experts_pow2),  # a [CHUNK, experts] compare tile stays in registers
    )
    return sorted_pairs, block_experts


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """What `moe.experts_torch` computes: x [T, H], gate_up [E, 2N, H], down [E, H, N], weights and
    expert_ids [T, top_k]."""
    require_triton("the fused MoE kernels")
    num_tokens, hidden = x.shape
    num_experts, intermediate = gate_up.size(0), gate_up.size(1) // 2
    top_k = expert_ids.size(1)
    num_pairs = num_tokens * top_k
    # internal invariants: the MoE layer hands over these layouts
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    assert down.shape == (num_experts, hidden, intermediate) and weights.shape == expert_ids.shape
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out.view(num_tokens, hidden)
    config = dict(config or block_config(num_pairs, num_experts))
    config["DOT_PRECISION"] = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only matters for float32
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    sorted_pairs, block_experts = align(expert_ids.contiguous(), num_experts, block_m)
    num_blocks = block_experts.numel()
    act = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(intermediate, block_n))](
        x, gate_up, act, sorted_pairs, block_experts, weights,
        num_pairs, intermediate, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        PAIRS_PER_A_ROW=top_k, GATED=True, ROUTE_WEIGHTED=False, NUM_EXPERTS=num_experts, **config)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, down, out, sorted_pairs, block_experts, weights.contiguous(),
        num_pairs, hidden, intermediate, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        PAIRS_PER_A_ROW=1, GATED=False, ROUTE_WEIGHTED=True, NUM_EXPERTS=num_experts, **config)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
