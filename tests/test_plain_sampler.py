"""The plain sampler (temperature or greedy rows) in one pass: argmax(logits / T - log E), E ~ Exp(1).

The torch path (CPU) and the Triton kernel (CUDA; on CPU through Triton's interpreter, float32 and few draws,
since it is slow) each draw from softmax(logits / T) (a chi-square test with fixed seeds: deterministic, and a
wrong temperature, a wrong sign of the noise or reused random bits fail it by far), and take the exact argmax,
the first of equal ones, for greedy rows. The torch path keeps the CPU's random stream: the same generator
gives the tokens that the softmax sampler it replaces gave.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanovllm.layers import triton_sampler
from nanovllm.layers.sampler import Sampler
from tests.conftest import compile_for_sm90

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_DRAWS = 20000 if DEVICE.type == "cuda" else 500  # the interpreter runs ~100 programs a second
CHI2_LIMIT = {4: 25.0, 7: 30.0}  # by degrees of freedom: P(chi2 > limit) < 1e-4 for a right sampler

needs_triton = pytest.mark.skipif(triton_sampler.triton is None, reason="Triton does not import here")


def chi_square(draws: torch.Tensor, logits: torch.Tensor, temperature: float) -> float:
    expected = torch.softmax(logits.double() / temperature, dim=0) * len(draws)
    observed = torch.bincount(draws.cpu(), minlength=len(logits)).double()
    return ((observed - expected) ** 2 / expected).sum().item()


def tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid, so rows hold ties, some of them between tiles of the kernel."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (rows, vocab), generator=gen).float()
    logits[0, [3, vocab - 2]] = 9.0  # a tie between the first and the last tile: the first wins
    return logits


# ---- the torch path ---------------------------------------------------------------------------------
def test_torch_path_draws_follow_softmax():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -0.8, -1.5])
    temperature = 0.7
    gen = torch.Generator().manual_seed(0)
    draws = Sampler()(logits.expand(40000, -1), torch.full((40000,), temperature), gen)
    assert chi_square(draws, logits, temperature) < CHI2_LIMIT[7]


def test_torch_path_greedy_rows_are_exact_argmax():
    logits = tied_logits(6, 50, seed=1)
    temperatures = torch.tensor([0.0, 0.9, 0.0, 1.3, 0.0, 0.0])
    draws = Sampler()(logits, temperatures, torch.Generator().manual_seed(1))
    greedy = temperatures == 0
    assert torch.equal(draws[greedy], logits[greedy].argmax(dim=1))
    assert draws[0].item() == 3


def test_torch_path_keeps_the_random_stream():
    # the softmax sampler this one replaced: argmax(softmax(logits / T) / E), from the same generator's noise
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(500, 1000, generator=gen) * 3
    temperatures = torch.rand(500, generator=gen) + 0.2
    temperatures[::7] = 0
    greedy = temperatures == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=torch.Generator().manual_seed(3))
    before = torch.where(greedy, logits.argmax(dim=-1), probs.div_(noise).argmax(dim=-1))
    now = Sampler()(logits, temperatures, torch.Generator().manual_seed(3))
    assert torch.equal(now, before)


# ---- the Triton kernel ------------------------------------------------------------------------------
@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 tokens: a small vocabulary spans several groups of four tiles and a ragged last one."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(triton_sampler, "BLOCK", 16)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
def test_kernel_greedy_rows_are_exact_argmax(small_tiles, dtype):
    vocab = 150 if DEVICE.type == "cpu" else 151936
    wide = tied_logits(6, vocab + 8, seed=4).to(DEVICE, dtype)
    wide[2, [7, 7 + 2 * triton_sampler.BLOCK]] = 9.0  # a tie two tiles apart: in one lane of the kernel's tiles
    logits = wide[:, :vocab]  # a row stride wider than the vocabulary, as a tensor-parallel LM head gives
    temperatures = torch.tensor([0.0, 0.8, 0.0, 1.5, 0.0, 0.0], device=DEVICE)
    rng_state = triton_sampler.make_rng_state(5, DEVICE)
    draws = triton_sampler.sample_plain(logits, temperatures, rng_state)
    greedy = temperatures == 0
    assert torch.equal(draws[greedy], logits[greedy].float().argmax(dim=1))
    assert draws[0].item() == 3 and draws[2].item() == 7
    assert ((draws >= 0) & (draws < vocab)).all()
    assert rng_state.tolist() == [5, 1]  # the step advanced on the device


@needs_triton
def test_kernel_draws_follow_softmax(small_tiles):
    logits = torch.tensor([1.2, 0.9, 0.4, 0.0, -0.6])
    temperature = 0.5  # far enough from 1 that 500 draws tell them apart
    rng_state = triton_sampler.make_rng_state(6, DEVICE)
    rows = KERNEL_DRAWS // 2
    # two steps of the same rows: the second must draw afresh, not repeat the first
    first, second = (triton_sampler.sample_plain(logits.to(DEVICE).expand(rows, -1),
                                                 torch.full((rows,), temperature, device=DEVICE), rng_state)
                     for _ in range(2))
    assert chi_square(torch.cat([first, second]), logits, temperature) < CHI2_LIMIT[4]
    assert (first != second).float().mean() > 0.4  # independent draws agree with p = sum(p_i^2) ~ 0.4


@needs_triton
def test_kernel_groups_of_tiles_draw_fresh_bits(small_tiles):
    vocab, rows = 8 * triton_sampler.BLOCK, 100  # two groups of four tiles, one Philox call each
    draws = triton_sampler.sample_plain(torch.zeros(rows, vocab, device=DEVICE), torch.ones(rows, device=DEVICE),
                                        triton_sampler.make_rng_state(11, DEVICE))
    halves = torch.bincount(draws, minlength=vocab).view(2, -1).sum(1)
    # uniform logits: each group wins ~50 times (sd 5); bits reused across groups tie them, and the first wins
    assert halves.min().item() > 35, halves.tolist()


@needs_triton
def test_kernel_draws_come_from_seed_and_step(small_tiles):
    logits = torch.zeros(8, 64, device=DEVICE)  # uniform: each draw is the noise alone
    temperatures = torch.ones(8, device=DEVICE)
    state = triton_sampler.make_rng_state(7, DEVICE)
    first = triton_sampler.sample_plain(logits, temperatures, state)
    second = triton_sampler.sample_plain(logits, temperatures, state)
    assert not torch.equal(first, second)
    state[1] = 0  # the same seed and step draw the same tokens
    assert torch.equal(triton_sampler.sample_plain(logits, temperatures, state), first)
    other_seed = triton_sampler.make_rng_state(8, DEVICE)
    assert not torch.equal(triton_sampler.sample_plain(logits, temperatures, other_seed), first)
    assert len(set(first.tolist())) > 4  # rows draw independently of each other


@needs_triton
def test_sampler_uses_the_kernel_when_given_a_device_counter(small_tiles):
    logits = tied_logits(4, 40, seed=9).to(DEVICE)
    temperatures = torch.tensor([0.0, 1.0, 0.0, 0.5], device=DEVICE)
    expected = triton_sampler.sample_plain(logits, temperatures, triton_sampler.make_rng_state(3, DEVICE))
    sampler = Sampler(triton_sampler.make_rng_state(3, DEVICE))
    assert torch.equal(sampler(logits, temperatures), expected)


@needs_triton
def test_parts_of_the_vocabulary_draw_what_one_program_draws(small_tiles):
    """Cut into 2-5 parts (the last one short), a row draws the very token it draws in one piece: the same bits
    for each token, and of equal scores the first part's (row 0 ties its first and last token, greedy)."""
    vocab = 300 if DEVICE.type == "cpu" else 151936
    logits = tied_logits(6, vocab, seed=12).to(DEVICE)
    temperatures = torch.tensor([0.0, 0.7, 1.0, 0.0, 2.0, 0.3], device=DEVICE)
    whole = triton_sampler.sample_plain(logits, temperatures, triton_sampler.make_rng_state(4, DEVICE), parts=1)
    assert whole[0].item() == 3
    for parts in (2, 3, 5):
        cut = triton_sampler.sample_plain(logits, temperatures, triton_sampler.make_rng_state(4, DEVICE),
                                          parts=parts)
        assert torch.equal(cut, whole), parts
    # a few rows are cut into parts by default, many are not
    assert triton_sampler.sampler_parts(1, 132) == 64 and triton_sampler.sampler_parts(256, 132) == 1


@needs_triton
def test_parts_pick_right_when_every_score_is_below_zero(small_tiles):
    """A row's winning score may be below zero (logits all negative, greedy or sampled) or -inf (every token
    masked): cut into parts it draws what it draws in one piece, and a greedy row, like a row of -inf, takes
    torch.argmax's token (the first: 0 for a row of -inf), never a part's padding nor one past the vocabulary."""
    vocab = 300 if DEVICE.type == "cpu" else 151936
    logits = tied_logits(6, vocab, seed=13).to(DEVICE) - 16.0  # -20..-12, row 0's tie at -7
    logits[2:4] = float("-inf")
    temperatures = torch.tensor([0.0, 0.5, 0.0, 1.0, 0.0, 2.0], device=DEVICE)
    greedy = temperatures == 0
    whole = triton_sampler.sample_plain(logits, temperatures, triton_sampler.make_rng_state(9, DEVICE), parts=1)
    assert torch.equal(whole[greedy], logits[greedy].argmax(dim=1))
    assert whole[0].item() == 3 and whole[2].item() == 0
    assert whole[3].item() == 0  # a sampled row of -inf: every score ties, and the first token wins
    for parts in (2, 3, 5):
        cut = triton_sampler.sample_plain(logits, temperatures, triton_sampler.make_rng_state(9, DEVICE),
                                          parts=parts)
        assert torch.equal(cut, whole), parts


@needs_triton
def test_more_parts_than_the_pick_kernel_reads_are_capped(small_tiles):
    """`parts` beyond MAX_PARTS (the pick kernel's width) cuts the row into MAX_PARTS parts: a row whose winner
    lies in its last group of tiles, past the 64th part, still draws it."""
    groups = triton_sampler.MAX_PARTS + 2
    vocab = groups * 4 * triton_sampler.BLOCK
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, -5] = 1.0  # greedy: the last group's token
    logits[1, -3] = 50.0  # sampled at T=1: it wins (the noise, from 24 random bits, stays below 18)
    temperatures = torch.tensor([0.0, 1.0], device=DEVICE)
    draws = triton_sampler.sample_plain(logits, temperatures, triton_sampler.make_rng_state(1, DEVICE),
                                        parts=groups)
    assert draws.tolist() == [vocab - 5, vocab - 3]


def test_parts_fill_the_gpu_twice():
    """Rows x parts reach PROGRAMS_PER_SM programs per SM (but for the MAX_PARTS cap) without going past them
    (but for one part a row), for any count of rows and SMs."""
    for sms in (132, 78, 16):
        for rows in (1, 2, 3, 5, 7, 16, 40, 100, 2 * sms - 1, 2 * sms, 2 * sms + 1, 1024):
            parts = triton_sampler.sampler_parts(rows, sms)
            target = triton_sampler.PROGRAMS_PER_SM * sms
            assert 1 <= parts <= triton_sampler.MAX_PARTS, (rows, sms)
            assert parts == triton_sampler.MAX_PARTS or rows * (parts + 1) > target, (rows, sms, parts)
            assert parts == 1 or rows * parts <= target, (rows, sms, parts)


@needs_triton
def test_kernel_compiles_for_sm90():
    """The interpreter runs the kernel without type-checking it as the compiler does (tests/test_triton_rope_store.py
    had a kernel that passed it and failed to compile on the H200). As the engine launches it: bf16 logits of
    Qwen3's vocabulary (151936, the row stride: an int32), float32 temperatures, the int64 counter and tokens,
    whole and in parts, and the pick among parts."""
    signature = dict(logits_ptr="*bf16", row_stride="i32", temperatures_ptr="*fp32", rng_state_ptr="*i64",
                     out_ptr="*i64", score_ptr="*i64", vocab_size="i32", part_size="i32")
    compile_for_sm90([
        ("nanovllm.layers.triton_sampler", "_sample_plain_kernel", signature,
         dict(BLOCK=triton_sampler.BLOCK, SPLIT=False, FAST_LOG=True), dict(num_warps=8)),
        ("nanovllm.layers.triton_sampler", "_sample_plain_kernel", signature | dict(score_ptr="*fp32"),
         dict(BLOCK=triton_sampler.BLOCK, SPLIT=True, FAST_LOG=True), dict(num_warps=8)),
        ("nanovllm.layers.triton_sampler", "_pick_kernel", dict(score_ptr="*fp32", index_ptr="*i64", out_ptr="*i64",
                                                                 parts="i32"), dict(PARTS_PAD=64), dict(num_warps=1)),
        ("nanovllm.layers.triton_sampler", "_pending_ids_kernel", dict(tokens_ptr="*i64", pending_rows_ptr="*i64",
                                                                        input_ids_ptr="*i64", out_ptr="*i64",
                                                                        rows="i32"), dict(BLOCK=1024))])


# ---- a captured step's input ids ------------------------------------------------------------------
@needs_triton
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_read_pending_takes_the_last_samples_of_pending_rows(data):
    """A pending row (>= 0) reads that row of the last step's samples, any other keeps its id (1,030 rows: two
    programs)."""
    rows = data.draw(st.sampled_from([1, 3, 64, 1030]))
    last = data.draw(st.integers(1, 600))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    tokens = torch.randint(0, 10 ** 6, (last,), generator=gen).to(DEVICE)
    pending = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.randint(0, last, (rows,), generator=gen),
                          -1).to(DEVICE)
    ids = torch.randint(0, 10 ** 6, (rows + 1,), generator=gen).to(DEVICE)
    out = triton_sampler.read_pending(tokens, pending, ids[:rows])
    assert torch.equal(out, torch.where(pending >= 0, tokens[pending.clamp(min=0)], ids[:rows]))
    assert out.dtype == ids.dtype and out.data_ptr() != ids.data_ptr()
