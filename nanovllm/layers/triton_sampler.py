"""The plain sampler (temperature or greedy rows) as one Triton kernel: one pass over the logits, no softmax.

Contract, the same draws in law as `Sampler.forward`'s torch path:
- logits: [rows, vocab], any float dtype and row stride, the last dimension contiguous;
- temperatures: float32 [rows]; 0 takes the argmax (the first one, as torch.argmax does);
- a row with temperature T > 0 draws argmax(logits / T - log E), E ~ Exp(1) for each token (the exponential
  race, a Gumbel-max draw): a draw from softmax(logits / T);
- rng_state: int64 [2] on the logits' device, [seed, step]. The noise of row i at step s comes from Philox with
  key `seed` and counter (lane, i, s as two words), whose four output words serve four tiles: every draw is
  fresh, and `sample_plain` adds 1 to the step on the device after the kernel, so a CUDA graph that captured it
  needs no host value at replay.

One program per row loops over the vocabulary in tiles; a launch is a fixed grid that a CUDA graph can capture.
"""
import torch

from nanovllm.layers.triton_guard import TRITON_ERROR as _TRITON_ERROR, tl, triton

BLOCK = 1024  # tokens per tile; one Philox call serves four tiles

if triton is not None:

    @triton.jit
    def _race_tile(row_ptr, tile_start, cols, vocab_size, temperature, bits, best_score, best_index,
                   NOISE: tl.constexpr):
        """Fold one tile of the row into the running (score, index) of its winner."""
        tile = tile_start + cols
        x = tl.load(row_ptr + tile, mask=tile < vocab_size, other=float("-inf")).to(tl.float32)
        if NOISE:
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # uniform in (0, 1), never 0 or 1
            x = x / temperature - tl.log(-tl.log(u))
        score, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        better = score > best_score  # strictly: of equal scores the first stays, as in torch.argmax
        return tl.where(better, score, best_score), tl.where(better, tile_start + index, best_index)

    @triton.jit
    def _best_of_vocab(row_ptr, vocab_size, temperature, seed, row, step, BLOCK: tl.constexpr,
                       NOISE: tl.constexpr):
        """The index of the row's winner, scanning the vocabulary in groups of four tiles."""
        cols = tl.arange(0, BLOCK)
        zero = cols * 0
        best_score = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        best_index = tl.sum(zero, 0)
        for start in range(0, vocab_size, 4 * BLOCK):
            if NOISE:  # one Philox call: four words of random bits, one for each tile of the group
                b0, b1, b2, b3 = tl.philox(seed, start // 4 + cols, zero + row, (zero + step).to(tl.uint32),
                                           (zero + (step >> 32)).to(tl.uint32))
            else:  # greedy: no random bits
                b0, b1, b2, b3 = zero, zero, zero, zero
            best_score, best_index = _race_tile(row_ptr, start, cols, vocab_size, temperature, b0,
                                                best_score, best_index, NOISE)
            best_score, best_index = _race_tile(row_ptr, start + BLOCK, cols, vocab_size, temperature, b1,
                                                best_score, best_index, NOISE)
            best_score, best_index = _race_tile(row_ptr, start + 2 * BLOCK, cols, vocab_size, temperature, b2,
                                                best_score, best_index, NOISE)
            best_score, best_index = _race_tile(row_ptr, start + 3 * BLOCK, cols, vocab_size, temperature, b3,
                                                best_score, best_index, NOISE)
        return best_index

    @triton.jit
    def _sample_plain_kernel(logits_ptr, row_stride, temperatures_ptr, rng_state_ptr, out_ptr, vocab_size,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        temperature = tl.load(temperatures_ptr + row)
        seed = tl.load(rng_state_ptr)
        step = tl.load(rng_state_ptr + 1)
        if temperature > 0:
            index = _best_of_vocab(row_ptr, vocab_size, temperature, seed, row, step, BLOCK, True)
        else:
            index = _best_of_vocab(row_ptr, vocab_size, temperature, seed, row, step, BLOCK, False)
        tl.store(out_ptr + row, index.to(tl.int64))


def make_rng_state(seed: int, device: torch.device) -> torch.Tensor:
    """[seed, step = 0] for `sample_plain`."""
    return torch.tensor([seed, 0], dtype=torch.int64, device=device)


def sample_plain(logits: torch.Tensor, temperatures: torch.Tensor, rng_state: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: one token per row (into `out` when given); advances `rng_state`'s step on its device."""
    if triton is None:
        raise RuntimeError(f"the Triton sampler needs a working Triton: {_TRITON_ERROR!r}")
    rows, vocab_size = logits.shape
    # internal invariants: the model runner and the CUDA graphs hand these layouts
    assert logits.stride(1) == 1 and temperatures.shape == (rows,) and temperatures.dtype == torch.float32
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous()
    if rows:
        _sample_plain_kernel[(rows,)](logits, logits.stride(0), temperatures, rng_state, out, vocab_size,
                                      BLOCK=BLOCK, num_warps=8)
    rng_state[1:].add_(1)
    return out
