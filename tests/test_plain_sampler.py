"""The plain sampler, argmax(logits / T - log E), E ~ Exp(1), in torch and Triton: softmax draws, exact argmax."""
from functools import partial

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanovllm.layers import triton_sampler
from nanovllm.layers.sampler import Sampler
from nanovllm.layers.triton_sampler import sample_plain
from tests.conftest import compile_for_sm90

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU_RUN = DEVICE.type == "cpu"
KERNEL_DRAWS = 500 if CPU_RUN else 20000  # the interpreter runs ~100 programs a second
CHI2_LIMIT = {4: 25.0, 7: 30.0}  # by degrees of freedom: P(chi2 > limit) < 1e-4

needs_triton = pytest.mark.skipif(triton_sampler.triton is None, reason="Triton does not import here")


def rng(seed):
    return triton_sampler.make_rng_state(seed, DEVICE)


def chi_square(draws, logits, temperature):
    expected = torch.softmax(logits.double() / temperature, dim=0) * len(draws)
    observed = torch.bincount(draws.cpu(), minlength=len(logits)).double()
    return ((observed - expected) ** 2 / expected).sum().item()


def tied_logits(rows, vocab, seed):
    """Logits on a coarse grid: rows hold ties, some between tiles of the kernel."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (rows, vocab), generator=gen).float()
    logits[0, [3, vocab - 2]] = 9.0  # a tie of the first and last tile: the first wins
    return logits


# ---- the torch path
def test_torch_path_draws_follow_softmax():
    logits, temperature = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -0.8, -1.5]), 0.7
    draws = Sampler()(logits.expand(40000, -1), torch.full((40000,), temperature), torch.Generator().manual_seed(0))
    assert chi_square(draws, logits, temperature) < CHI2_LIMIT[7]


def test_torch_path_greedy_rows_are_exact_argmax():
    logits = tied_logits(6, 50, seed=1)
    temperatures = torch.tensor([0.0, 0.9, 0.0, 1.3, 0.0, 0.0])
    draws = Sampler()(logits, temperatures, torch.Generator().manual_seed(1))
    greedy = temperatures == 0
    assert torch.equal(draws[greedy], logits[greedy].argmax(dim=1))
    assert draws[0].item() == 3


def test_torch_path_keeps_the_random_stream():
    # the softmax sampler this one replaced, with the same generator's noise
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


# ---- the Triton kernel
@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 tokens: a small vocabulary spans several groups of four tiles, the last one ragged."""
    if CPU_RUN:
        monkeypatch.setattr(triton_sampler, "BLOCK", 16)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32] + ([] if CPU_RUN else [torch.bfloat16]))
def test_kernel_greedy_rows_are_exact_argmax(small_tiles, dtype):
    vocab = 150 if CPU_RUN else 151936
    wide = tied_logits(6, vocab + 8, seed=4).to(DEVICE, dtype)
    wide[2, [7, 7 + 2 * triton_sampler.BLOCK]] = 9.0  # a tie two tiles apart: in one lane
    logits = wide[:, :vocab]  # a row stride wider than the vocabulary (TP)
    temperatures = torch.tensor([0.0, 0.8, 0.0, 1.5, 0.0, 0.0], device=DEVICE)
    rng_state = rng(5)
    draws = sample_plain(logits, temperatures, rng_state)
    greedy = temperatures == 0
    assert torch.equal(draws[greedy], logits[greedy].float().argmax(dim=1))
    assert draws[0].item() == 3 and draws[2].item() == 7
    assert ((draws >= 0) & (draws < vocab)).all()
    assert rng_state.tolist() == [5, 1]  # the step advanced on the device


@needs_triton
def test_kernel_draws_follow_softmax(small_tiles):
    logits = torch.tensor([1.2, 0.9, 0.4, 0.0, -0.6])
    temperature = 0.5  # far enough from 1 that 500 draws tell them apart
    rng_state = rng(6)
    rows = KERNEL_DRAWS // 2
    # two steps: the second draws afresh
    first, second = (sample_plain(logits.to(DEVICE).expand(rows, -1), torch.full((rows,), temperature, device=DEVICE),
                                  rng_state) for _ in range(2))
    assert chi_square(torch.cat([first, second]), logits, temperature) < CHI2_LIMIT[4]
    assert (first != second).float().mean() > 0.4  # independent draws agree with p = sum(p_i^2) ~ 0.4


@needs_triton
def test_kernel_groups_of_tiles_draw_fresh_bits(small_tiles):
    vocab, rows = 8 * triton_sampler.BLOCK, 100  # two groups of four tiles, one Philox call each
    draws = sample_plain(torch.zeros(rows, vocab, device=DEVICE), torch.ones(rows, device=DEVICE), rng(11))
    halves = torch.bincount(draws, minlength=vocab).view(2, -1).sum(1)
    # each group wins ~50 times (sd 5); bits reused across groups would make the first win
    assert halves.min().item() > 35, halves.tolist()


@needs_triton
def test_kernel_draws_come_from_seed_and_step(small_tiles):
    # uniform logits: each draw is the noise alone
    draw, state = partial(sample_plain, torch.zeros(8, 64, device=DEVICE), torch.ones(8, device=DEVICE)), rng(7)
    first = draw(state)
    assert not torch.equal(draw(state), first)
    state[1] = 0  # the same seed and step draw the same tokens
    assert torch.equal(draw(state), first)
    assert not torch.equal(draw(rng(8)), first)
    assert len(set(first.tolist())) > 4  # rows draw independently of each other
    state[1] = 2 ** 32  # step 0's low word: the high one draws afresh too
    assert not torch.equal(draw(state), first)


@needs_triton
def test_kernel_noise_of_zero_bits_is_finite():
    """Token 1,482 of row 0 draws all-zero bits at seed 1, step 874: its uniform stays above 0, so it still wins."""
    logits = torch.zeros(1, 4096, device=DEVICE)
    logits[0, 1482] = 30.0  # 43 in base 2: ahead of any other's noise (< 24) by more than its own (> -5)
    assert sample_plain(logits, torch.ones(1, device=DEVICE), torch.tensor([1, 874], device=DEVICE)).item() == 1482


@needs_triton
def test_sampler_uses_the_kernel_when_given_a_device_counter(small_tiles):
    logits = tied_logits(4, 40, seed=9).to(DEVICE)
    temperatures = torch.tensor([0.0, 1.0, 0.0, 0.5], device=DEVICE)
    expected = sample_plain(logits, temperatures, rng(3))
    assert torch.equal(Sampler(rng(3))(logits, temperatures), expected)


def drawn_in_parts(logits, temperatures, seed):
    """Cut into 2-5 parts (the last one short), each row draws the very token it draws in one piece."""
    whole = sample_plain(logits, temperatures, rng(seed), parts=1)
    for parts in (2, 3, 5):
        assert torch.equal(sample_plain(logits, temperatures, rng(seed), parts=parts), whole), parts
    return whole


@needs_triton
def test_parts_of_the_vocabulary_draw_what_one_program_draws(small_tiles):
    # of equal scores the first part's wins (row 0 ties its first and last token)
    logits = tied_logits(6, 300 if CPU_RUN else 151936, seed=12).to(DEVICE)
    temperatures = torch.tensor([0.0, 0.7, 1.0, 0.0, 2.0, 0.3], device=DEVICE)
    assert drawn_in_parts(logits, temperatures, 4)[0].item() == 3
    # by default: few rows cut, many not
    assert triton_sampler.sampler_parts(1, 132) == 64 and triton_sampler.sampler_parts(256, 132) == 1


@needs_triton
def test_parts_pick_right_when_every_score_is_below_zero(small_tiles):
    """Winning scores below zero or -inf (masked rows) take torch.argmax's token, never padding or past the vocab."""
    logits = tied_logits(6, 300 if CPU_RUN else 151936, seed=13).to(DEVICE) - 16.0  # -20..-12, row 0's tie at -7
    logits[2:4] = float("-inf")
    temperatures = torch.tensor([0.0, 0.5, 0.0, 1.0, 0.0, 2.0], device=DEVICE)
    greedy = temperatures == 0
    whole = drawn_in_parts(logits, temperatures, 9)
    assert torch.equal(whole[greedy], logits[greedy].argmax(dim=1))
    assert whole[0].item() == 3 and whole[2].item() == 0
    assert whole[3].item() == 0  # sampled, all -inf: the first token wins


@needs_triton
def test_more_parts_than_the_pick_kernel_reads_are_capped(small_tiles):
    """`parts` beyond MAX_PARTS cuts a row into MAX_PARTS parts: a winner past the 64th part is still drawn."""
    groups = triton_sampler.MAX_PARTS + 2
    vocab = groups * 4 * triton_sampler.BLOCK
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, -5] = 1.0  # greedy: the last group's token
    logits[1, -3] = 50.0  # sampled: it wins (the noise stays below 18)
    temperatures = torch.tensor([0.0, 1.0], device=DEVICE)
    draws = sample_plain(logits, temperatures, rng(1), parts=groups)
    assert draws.tolist() == [vocab - 5, vocab - 3]


def test_parts_fill_the_gpu_twice():
    """Rows x parts reach PROGRAMS_PER_SM programs per SM (but for MAX_PARTS) without passing them (but for 1)."""
    for sms in (132, 78, 16):
        for rows in (1, 2, 3, 5, 7, 16, 40, 100, 2 * sms - 1, 2 * sms, 2 * sms + 1, 1024):
            parts = triton_sampler.sampler_parts(rows, sms)
            target = triton_sampler.PROGRAMS_PER_SM * sms
            assert 1 <= parts <= triton_sampler.MAX_PARTS, (rows, sms)
            assert parts == triton_sampler.MAX_PARTS or rows * (parts + 1) > target, (rows, sms, parts)
            assert parts == 1 or rows * parts <= target, (rows, sms, parts)


@needs_triton
def test_kernel_compiles_for_sm90():
    """The interpreter does not type-check: the kernels as the engine launches them on Qwen3's bf16 logits."""
    signature = dict(logits_ptr="*bf16", row_stride="i32", temperatures_ptr="*fp32", rng_state_ptr="*i64",
                     out_ptr="*i64", score_ptr="*i64", vocab_size="i32", part_size="i32")
    m, block = "nanovllm.layers.triton_sampler", triton_sampler.BLOCK
    compile_for_sm90([
        (m, "_sample_plain_kernel", signature, dict(BLOCK=block, SPLIT=False, FAST_LOG=True), dict(num_warps=8)),
        (m, "_sample_plain_kernel", signature | dict(score_ptr="*fp32"), dict(BLOCK=block, SPLIT=True, FAST_LOG=True),
         dict(num_warps=8)),
        (m, "_pick_kernel", dict(score_ptr="*fp32", index_ptr="*i64", out_ptr="*i64", parts="i32"),
         dict(PARTS_PAD=64), dict(num_warps=1)),
        (m, "_pending_ids_kernel", dict(tokens_ptr="*i64", pending_rows_ptr="*i64", input_ids_ptr="*i64",
                                        out_ptr="*i64", rows="i32"), dict(BLOCK=1024))])


# ---- a captured step's input ids
@needs_triton
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_read_pending_takes_the_last_samples_of_pending_rows(data):
    """A pending row (>= 0) reads that row of the last step's samples, any other keeps its id."""
    rows = data.draw(st.sampled_from([1, 3, 64, 1030]))  # 1030: two programs
    last = data.draw(st.integers(1, 600))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    tokens = torch.randint(0, 10 ** 6, (last,), generator=gen).to(DEVICE)
    pending = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.randint(0, last, (rows,), generator=gen),
                          -1).to(DEVICE)
    ids = torch.randint(0, 10 ** 6, (rows + 1,), generator=gen).to(DEVICE)
    out = triton_sampler.read_pending(tokens, pending, ids[:rows])
    assert torch.equal(out, torch.where(pending >= 0, tokens[pending.clamp(min=0)], ids[:rows]))
    assert out.dtype == ids.dtype and out.data_ptr() != ids.data_ptr()
