"""The plain sampler (temperature or greedy rows) as one Triton kernel: one pass over the logits, no softmax.

Contract, the same draws in law as `Sampler.forward`'s torch path:
- logits: [rows, vocab], any float dtype and row stride, the last dimension contiguous;
- temperatures: float32 [rows]; 0 takes the argmax (the first one, as torch.argmax does);
- a row with temperature T > 0 draws argmax(logits / T - log E), E ~ Exp(1) for each token (the exponential
  race, a Gumbel-max draw): a draw from softmax(logits / T). The kernel ranks the same scores in base 2,
  logits * log2(e) / T - log2(-log2 U) (E = -ln U, U uniform; the two differ by a factor and a constant), with
  the GPU's approximate log2 on CUDA (two instructions a token, where the exact log is a polynomial of about
  twenty) and Triton's exact one under the CPU interpreter;
- rng_state: int64 [2] on the logits' device, [seed, step]. The noise of row i at step s comes from Philox with
  key `seed` and counter (lane, i, s as two words), whose four output words serve four tiles: every draw is
  fresh, and `sample_plain` adds 1 to the step on the device after the kernel, so a CUDA graph that captured it
  needs no host value at replay.

A program loops over its part of a row's vocabulary in tiles; each lane of a tile keeps its own winner, and the
lanes meet once, at the end of the part (a reduction after every tile took 2.6x as long). A few rows would leave
most of the GPU idle as one program each, so the vocabulary is cut into parts of whole groups of four tiles until
the rows' programs fill the SMs twice, and a second kernel picks each row's winner among its parts' (the first of
equal scores, so the draws are the same as one program's). The grid is fixed per row
count: a CUDA graph can capture it. (`read_pending`: a captured step's input ids, from the samples of the step before.)
"""
import torch

from nanovllm.layers.triton_guard import num_sms, require_triton, tl, triton

BLOCK = 1024  # tokens per tile; one Philox call serves four tiles
PROGRAMS_PER_SM = 2  # parts per row: until rows x parts reach this many programs per SM
MAX_PARTS = 64  # (one width for the pick kernel, so no row count compiles a variant of its own mid-serving)

if triton is not None:

    @triton.jit
    def _log2(x, FAST_LOG: tl.constexpr):
        """log2(x): the GPU's approximate instruction (FAST_LOG), or Triton's exact log2 (the interpreter cannot
        run inline assembly)."""
        if FAST_LOG:
            return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return tl.log2(x)

    @triton.jit
    def _race_tile(row_ptr, tile_start, cols, end, scale, bits, best_score, best_index,
                   NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
        """Fold one tile of the row into each lane's running (score, index): no reduction across lanes here.
        scale: log2(e) / temperature."""
        tile = tile_start + cols
        x = tl.load(row_ptr + tile, mask=tile < end, other=float("-inf")).to(tl.float32)
        if NOISE:
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # uniform in (0, 1), never 0 or 1
            x = x * scale - _log2(-_log2(u, FAST_LOG), FAST_LOG)
        better = x > best_score  # strictly: of equal scores a lane keeps its first, as torch.argmax does
        return tl.where(better, x, best_score), tl.where(better, tile, best_index)

    @triton.jit
    def _best_of_part(row_ptr, begin, end, scale, seed, row, step, BLOCK: tl.constexpr,
                      NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
        """The (score, index) of the winner of tokens begin..end of the row, scanned in groups of four tiles
        (`begin` starts a group: a token's random bits do not depend on the parts)."""
        cols = tl.arange(0, BLOCK)
        zero = cols * 0
        best_score = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's winner so far
        best_index = begin + cols  # (a row of -inf keeps these, and the first, begin, wins below)
        for start in range(begin, end, 4 * BLOCK):
            if NOISE:  # one Philox call: four words of random bits, one for each tile of the group
                b0, b1, b2, b3 = tl.philox(seed, start // 4 + cols, zero + row, (zero + step).to(tl.uint32),
                                           (zero + (step >> 32)).to(tl.uint32))
            else:  # greedy: no random bits
                b0, b1, b2, b3 = zero, zero, zero, zero
            best_score, best_index = _race_tile(row_ptr, start, cols, end, scale, b0,
                                                best_score, best_index, NOISE, FAST_LOG)
            best_score, best_index = _race_tile(row_ptr, start + BLOCK, cols, end, scale, b1,
                                                best_score, best_index, NOISE, FAST_LOG)
            best_score, best_index = _race_tile(row_ptr, start + 2 * BLOCK, cols, end, scale, b2,
                                                best_score, best_index, NOISE, FAST_LOG)
            best_score, best_index = _race_tile(row_ptr, start + 3 * BLOCK, cols, end, scale, b3,
                                                best_score, best_index, NOISE, FAST_LOG)
        # the lanes' winners to one: the best score, the first token of equal ones (each lane holds its first)
        score = tl.max(best_score, 0)
        return score, tl.min(tl.where(best_score == score, best_index, end), 0)

    @triton.jit
    def _sample_plain_kernel(logits_ptr, row_stride, temperatures_ptr, rng_state_ptr, out_ptr, score_ptr,
                             vocab_size, part_size, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                             FAST_LOG: tl.constexpr):
        """Program (row, part): the winner of the part's tokens, into out (SPLIT: with its score, one slot per
        part, for `_pick_kernel`)."""
        row, part = tl.program_id(0), tl.program_id(1)
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        begin = part * part_size
        end = tl.minimum(vocab_size, begin + part_size)
        temperature = tl.load(temperatures_ptr + row)
        seed = tl.load(rng_state_ptr)
        step = tl.load(rng_state_ptr + 1)
        if temperature > 0:
            score, index = _best_of_part(row_ptr, begin, end, 1.4426950408889634 / temperature, seed, row, step,
                                         BLOCK, True, FAST_LOG)  # log2(e) / T
        else:
            score, index = _best_of_part(row_ptr, begin, end, 1.0, seed, row, step, BLOCK, False, FAST_LOG)
        slot = row * tl.num_programs(1) + part
        tl.store(out_ptr + slot, index.to(tl.int64))
        if SPLIT:
            tl.store(score_ptr + slot, score)

    @triton.jit(do_not_specialize=["parts"])
    def _pick_kernel(score_ptr, index_ptr, out_ptr, parts, PARTS_PAD: tl.constexpr):
        """A row's winner among its parts' winners: the best score, the first part of equal ones."""
        row = tl.program_id(0)
        offsets = row * parts + tl.arange(0, PARTS_PAD)
        valid = tl.arange(0, PARTS_PAD) < parts
        scores = tl.load(score_ptr + offsets, mask=valid, other=float("-inf"))
        _, best = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(index_ptr + row * parts + best))

    @triton.jit
    def _pending_ids_kernel(tokens_ptr, pending_rows_ptr, input_ids_ptr, out_ptr, rows, BLOCK: tl.constexpr):
        """`read_pending`'s ids: each row's sample of the last step where its pending row is >= 0, else its id."""
        row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = row < rows
        pending = tl.load(pending_rows_ptr + row, mask=valid, other=-1)
        sampled = tl.load(tokens_ptr + pending, mask=valid & (pending >= 0), other=0)
        given = tl.load(input_ids_ptr + row, mask=valid & (pending < 0), other=0)
        tl.store(out_ptr + row, tl.where(pending >= 0, sampled, given), mask=valid)


def read_pending(tokens: torch.Tensor, pending_rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """A captured step's input ids: where a row's pending row is >= 0, the token that the last step sampled there
    (`tokens[pending_row]`, still on the device), else the row's id: one launch where torch's ops took four."""
    if triton is None:
        return torch.where(pending_rows >= 0, tokens[pending_rows.clamp(min=0)], input_ids)
    out = torch.empty_like(input_ids)
    rows, block = input_ids.numel(), 1024
    _pending_ids_kernel[(triton.cdiv(rows, block),)](tokens, pending_rows, input_ids, out, rows, BLOCK=block)
    return out


def sampler_parts(rows: int, sms: int) -> int:
    """Parts to cut each row's vocabulary into (at most one per group of four tiles; see the module docstring)."""
    return max(1, min(MAX_PARTS, PROGRAMS_PER_SM * sms // max(rows, 1)))


def make_rng_state(seed: int, device: torch.device) -> torch.Tensor:
    """[seed, step = 0] for `sample_plain`."""
    return torch.tensor([seed, 0], dtype=torch.int64, device=device)


def sample_plain(logits: torch.Tensor, temperatures: torch.Tensor, rng_state: torch.Tensor,
                 out: torch.Tensor | None = None, parts: int | None = None) -> torch.Tensor:
    """int64 [rows]: one token per row (into `out` when given); advances `rng_state`'s step on its device.
    `parts` overrides `sampler_parts` (tests)."""
    require_triton("the Triton sampler")
    rows, vocab_size = logits.shape
    # internal invariants: the model runner and the CUDA graphs hand these layouts
    assert logits.stride(1) == 1 and temperatures.shape == (rows,) and temperatures.dtype == torch.float32
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous()
    if rows:
        groups = -(-vocab_size // (4 * BLOCK))
        parts = min(groups, MAX_PARTS, parts or sampler_parts(rows, num_sms(logits.device)))
        part_size = -(-groups // parts) * 4 * BLOCK
        parts = -(-vocab_size // part_size)  # (fewer when the groups do not divide evenly)
        split = parts > 1  # (one part writes its winner straight to out, and has no score to store)
        indices = torch.empty(rows, parts, dtype=torch.int64, device=logits.device) if split else out
        scores = torch.empty(rows, parts, dtype=torch.float32, device=logits.device) if split else out
        _sample_plain_kernel[(rows, parts)](logits, logits.stride(0), temperatures, rng_state, indices, scores,
                                            vocab_size, part_size, BLOCK=BLOCK, SPLIT=split,
                                            FAST_LOG=logits.is_cuda, num_warps=8)
        if split:
            _pick_kernel[(rows,)](scores, indices, out, parts, PARTS_PAD=MAX_PARTS, num_warps=1)
    rng_state[1:].add_(1)
    return out
