"""The Triton paged-attention kernels and the Triton KV store against the torch reference.

The reference is `TorchBackend` in float64 on the very cache the kernel reads (an FP8 cache dequantized exactly),
so the only error left is the kernel's arithmetic. Without CUDA the kernels run on CPU tensors through Triton's
interpreter (tests/conftest.py turns it on): float32 there, since the interpreter computes a bf16 `tl.dot`
wrongly, and small shapes, since it is slow. With CUDA the same cases run in bf16 and float32.

Case shapes are drawn from a seeded generator: every GQA ratio 1-8, head dims 64/128/256 (and 80, not a power
of two), block sizes 16-256 (48: a multiple of 16, not a power of two), ragged contexts that end inside and on
block edges, one split and several, model dtype and FP8 with scales that are not 1.
"""
import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from nanovllm.layers.attention import (FP8_DTYPE, VALUE_CHUNK, TorchBackend, quantize_kv, value_chunk,
                                      value_slots, values_as_cache)
from tests.conftest import compile_for_sm90
from tests.test_gpu_attention import CASES, make_meta, random_block_tables

triton_attention = pytest.importorskip("nanovllm.layers.triton_attention")
if triton_attention.triton is None:
    pytest.skip("Triton does not import here", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # float32 lands near 1e-7; bf16 operands near 5e-3
K_SCALE, V_SCALE = 0.0625, 3.0  # FP8 scales of the tests: a kernel that forgets one is off by 16x or 3x


def make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, kv_fp8, seed,
              q_gain=1.0):
    """Random q, this step's k/v, a paged cache holding the contexts (unused blocks poisoned) and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(c / block_size) for c in context_lens) + 3
    block_tables = random_block_tables(context_lens, block_size, num_blocks, gen)
    meta = make_meta(query_lens, context_lens, block_tables, block_size, DEVICE)
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(2)]
    used = torch.zeros(num_blocks, dtype=torch.bool)
    used[block_tables[block_tables >= 0].long()] = True
    for cache in caches:
        cache[~used] = float("nan")  # a block outside every table must never be read
    for table, context in zip(block_tables, context_lens):  # keys past a context, in its last block, are read
        last = table[(context - 1) // block_size].long()  # (a tile in one block) but must weigh nothing
        caches[0][last, (context - 1) % block_size + 1:] = float("nan")
    if kv_fp8:  # the values laid out as the engine's cache holds them (chunked where `value_chunk` says)
        caches = [quantize_kv(c, s, FP8_DTYPE) for c, s in zip(caches, (K_SCALE, V_SCALE))]
        caches[1] = values_as_cache(caches[1])
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen) * q_gain
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v, caches, meta


def reference(q, k, v, caches, meta, kv_fp8, paged=True):
    """TorchBackend in float64 on CPU, on exactly the values the kernel sees."""
    scales = (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)
    in_order = (caches[0], value_slots(caches[1]).flatten(1, 2)) if paged else ()  # the values in token order
    ref_caches = [c.double() * s for c, s in zip(in_order, scales)] if paged else [torch.empty(0)] * 2
    cpu_meta = dataclasses.replace(meta, block_tables=meta.block_tables.cpu())
    scale = q.size(-1) ** -0.5
    return TorchBackend().forward(q.double(), k.double(), v.double(), *ref_caches, cpu_meta, scale)


def assert_close(out, expected, dtype):
    assert out.dtype == dtype and out.shape == expected.shape
    out = out.double().cpu()
    assert not out.isnan().any()
    err = ((out - expected).norm() / expected.norm()).item()
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


def to_device(q, k, v, caches, dtype):
    return (q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype),
            [c.to(DEVICE) if c.dtype == FP8_DTYPE else c.to(DEVICE, dtype) for c in caches])


def decode_cases():
    """(name, shape) pairs: each GQA ratio 1-8 once, with the other dimensions drawn from a seeded generator."""
    rng = random.Random(11)
    head_dims = [64, 128, 256, 64, 80, 128, 64, 256]
    block_sizes = [16, 48, 32, 256, 16, 128, 64, 16]
    cases = []
    for i, group in enumerate(range(1, 9)):
        num_kv_heads = rng.choice([1, 2, 3]) if head_dims[i] < 256 else 1
        block_size = block_sizes[i]
        contexts = [1, block_size, block_size + 1] + [rng.randint(2, 4 * block_size) for _ in range(2)]
        splits = [1, 2, 3, 1, 5, 4, 1, 2][i]
        case = dict(group=group, num_kv_heads=num_kv_heads, head_dim=head_dims[i], block_size=block_size,
                    contexts=contexts, splits=splits, kv_fp8=i % 2 == 1, q_gain=30.0 if i in (1, 5) else 1.0,
                    tile_merge=i in (2, 4, 5))  # merged by a tile across the threads (as more splits are)
        cases.append(pytest.param(case, id=f"g{group}-d{head_dims[i]}-b{block_size}-s{splits}"
                                           f"{'-fp8' if case['kv_fp8'] else ''}{'-peaky' if i in (1, 5) else ''}"
                                           f"{'-tile' if case['tile_merge'] else ''}"))
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", decode_cases())
def test_decode_matches_reference(case, dtype, monkeypatch):
    """Ragged contexts, splits of 16 tokens so even short contexts split, large logits in the peaky cases (an
    unscaled merge of splits overflows there); both ways of merging the splits."""
    monkeypatch.setattr(triton_attention, "PER_THREAD_SPLITS", 0 if case["tile_merge"] else 32)
    contexts = case["contexts"]
    q, k, v, caches, meta = make_case([1] * len(contexts), contexts, case["group"] * case["num_kv_heads"],
                                      case["num_kv_heads"], case["head_dim"], case["block_size"], case["kv_fp8"],
                                      seed=len(contexts) + case["group"], q_gain=case["q_gain"])
    expected = reference(q, k, v, caches, meta, case["kv_fp8"])
    q, k, v, caches = to_device(q, k, v, caches, dtype)
    scales = (K_SCALE, V_SCALE) if case["kv_fp8"] else (1.0, 1.0)
    out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, q.size(-1) ** -0.5,
                                            *scales, num_splits=case["splits"], min_split_tokens=16)
    assert_close(out, expected, dtype)


def test_decode_splits_reach_the_last_key_of_every_context():
    """Contexts a few keys past splits x kv_tile (4 splits of 32-key tiles: 129, 130 keys), where a chunk of
    floor(context / splits) keys would stop short of the last ones: the splits still cover every key."""
    contexts = [129, 130, 159, 40]
    q, k, v, caches, meta = make_case([1] * 4, contexts, 4, 2, 64, 16, False, seed=12)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    assert triton_attention.decode_tile(64, 4)[0] == 32  # (the tile the contexts are chosen for)
    out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125, num_splits=4,
                                            min_split_tokens=16)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_decode_in_one_wave_tiles(block_size):
    """`decode_tile`'s one_wave tile (128 keys) across blocks of 16 and 48, ending inside a tile and on its edge."""
    contexts = [1, 127, 128, 129, 300, 2 * block_size + 5]
    q, k, v, caches, meta = make_case([1] * len(contexts), contexts, 4, 2, 128, block_size, False, seed=14)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    tile, warps, stages = triton_attention.decode_tile(128, 2, False, block_size, 0, True)
    assert tile > triton_attention.decode_tile(128, 2)[0]
    out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 128 ** -0.5,
                                            num_splits=1, kv_tile=tile, num_warps=warps, num_stages=stages)
    assert_close(out, expected, torch.float32)


def test_decode_takes_one_wave_tiles_while_the_gpu_holds_every_program(monkeypatch):
    """One_wave tiles exactly when the batch is unsplit and has at most ONE_WAVE_PROGRAMS_PER_SM programs an SM."""
    asked = []
    tile = triton_attention.decode_tile
    monkeypatch.setattr(triton_attention, "decode_tile", lambda *a: asked.append(a[5]) or tile(*a))
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 1)
    per_sm = triton_attention.ONE_WAVE_PROGRAMS_PER_SM
    for batch, splits in ((per_sm // 2, 1), (per_sm // 2 + 1, 1), (1, 2)):  # 2 KV heads each
        q, k, v, caches, meta = make_case([1] * batch, [40] * batch, 4, 2, 64, 16, False, seed=15)
        q, k, v, caches = to_device(q, k, v, caches, torch.float32)
        triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125,
                                          num_splits=splits)
    assert asked == [True, False, False]


@pytest.mark.parametrize("kv_fp8,block_size", [(False, 128), (True, 128), (False, 48)])
def test_decode_carries_block_ids_across_tiles(kv_fp8, block_size):
    """Tiles that each lie in one block take their block ids a tile ahead (`ONE_BLOCK`): contexts of many tiles
    over shuffled blocks, ending inside a tile, on a tile's edge and on a block's, in the two-in-flight tiles that
    `decode_tile` gives a deep unsplit batch (over FP8: 64 keys, chunked values). In blocks of 128 the last row, the
    longest, fills its blocks, so its last tile takes the table's last id. Blocks of 48 hold no whole number of
    32-key tiles: their keys take their own ids."""
    head_dim = 128
    contexts = [1, 64, 65, 128, 129, 383, 700, 6 * block_size]
    q, k, v, caches, meta = make_case([1] * len(contexts), contexts, 4, 2, head_dim, block_size, kv_fp8, seed=16)
    expected = reference(q, k, v, caches, meta, kv_fp8)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    tile, warps, stages = triton_attention.decode_tile(head_dim, caches[0].element_size(), False, block_size,
                                                       value_chunk(caches[1]), False, 1e3)
    assert max(contexts) > 4 * tile and stages == 3 and (block_size % tile == 0) == (block_size == 128)
    # a split batch keeps one tile in flight: 2 stages where the ids are carried, 3 where keys read their own
    split_tile = triton_attention.decode_tile(head_dim, caches[0].element_size(), True, block_size,
                                              value_chunk(caches[1]))
    assert split_tile[2] == (2 if block_size % split_tile[0] == 0 else 3)
    assert not kv_fp8 or (value_chunk(caches[1]) and tile == 64)
    scales = (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)
    out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, head_dim ** -0.5,
                                            *scales, num_splits=1, kv_tile=tile, num_warps=warps, num_stages=stages)
    assert_close(out, expected, torch.float32)


def test_fp8_decode_takes_deep_tiles_from_its_programs_per_sm(monkeypatch):
    """Over chunked FP8 values an unsplit batch of FP8_DEEP_PROGRAMS_PER_SM programs an SM or more takes 64-key
    tiles with two in flight, a smaller one 128-key tiles with one (a split one: 64 keys, one)."""
    asked = []
    decode_tile = triton_attention.decode_tile
    monkeypatch.setattr(triton_attention, "decode_tile", lambda *a: asked.append(decode_tile(*a)) or asked[-1])
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 1)
    deep = triton_attention.FP8_DEEP_PROGRAMS_PER_SM
    for batch, splits in ((deep // 2, 1), (deep // 2 - 1, 1), (1, 2)):  # 2 KV heads each
        q, k, v, caches, meta = make_case([1] * batch, [40] * batch, 4, 2, 64, 128, True, seed=17)
        q, k, v, caches = to_device(q, k, v, caches, torch.float32)
        triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125, num_splits=splits)
    assert asked == [(64, 2, 3), (128, 4, 2), (64, 2, 2)]


def test_decode_keeps_one_tile_in_flight_where_contexts_are_bounded_to_two_tiles(monkeypatch):
    """A deep unsplit batch keeps two tiles in flight (3 stages), but where the host bounds its contexts to at most
    two tiles, one (2 stages: no third buffer to fill); in bf16 and over FP8's chunked values. decode_attention
    hands its max_context to decode_tile, and the output stays right."""
    for itemsize, v_chunk, tile, warps in ((2, 0, 64, 4), (1, 64, 64, 2)):
        for bound, stages in ((0, 3), (1, 2), (2 * tile, 2), (2 * tile + 1, 3), (4096, 3)):
            assert triton_attention.decode_tile(128, itemsize, False, 256, v_chunk, False, 31.0, bound) == \
                (tile, warps, stages)
    tile = triton_attention.decode_tile(64, 4)[0]  # float32 (the interpreter's): 32 keys
    asked = []
    decode_tile = triton_attention.decode_tile
    monkeypatch.setattr(triton_attention, "decode_tile", lambda *a: asked.append(decode_tile(*a)) or asked[-1])
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 1)  # 6 x 2 programs: unsplit, past one wave
    q, k, v, caches, meta = make_case([1] * 6, [9, 64, 30, 1, 64, 50], 4, 2, 64, 128, False, seed=18)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    for bound in (2 * tile, 2 * tile + 1, 0):
        out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125,
                                                max_context=bound)
        assert_close(out, expected, torch.float32)
    assert [stages for *_, stages in asked] == [2, 3, 3]


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_of_an_empty_context_writes_zeros(splits, monkeypatch):
    """A row of context 0 (a decode graph's padding row) gets zeros, written by its first split, and the other rows
    their attention, with every buffer the kernels allocate filled with NaN first: nothing is read that the
    decode kernel did not write."""
    class NaNTorch:  # torch, whose `empty` is NaN-filled
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.empty(*args, **kwargs).fill_(float("nan"))
    monkeypatch.setattr(triton_attention, "torch", NaNTorch())
    q, k, v, caches, meta = make_case([1] * 4, [37, 5, 90, 20], 4, 2, 64, 16, False, seed=13)
    expected = reference(q, k, v, caches, meta, False)[:3]
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    context_lens = meta.context_lens.clone()
    context_lens[3] = 0
    out = triton_attention.decode_attention(q, *caches, meta.block_tables, context_lens, 0.125, num_splits=splits,
                                            min_split_tokens=16)
    assert_close(out[:3], expected, torch.float32)
    assert (out[3] == 0).all()


def merged(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The splits' outputs [tokens, heads, splits, head_dim] weighted by exp2 of their lse, in float64 (a row
    whose splits are all empty, -inf: 0)."""
    weight = torch.exp2(lse.double() - lse.double().amax(-1, keepdim=True).clamp(min=0))
    return (weight[..., None] * partial.double()).sum(2) / weight.sum(-1).clamp(min=1e-300)[..., None]


@pytest.fixture
def merge_launches(monkeypatch) -> list[tuple[int, int, int]]:
    """(num_splits, min_split_tokens, SPLITS) of each launch of the merge kernel while the test runs (SPLITS: one
    dim a thread; 0: the tile)."""
    kernel, launches = triton_attention._merge_splits_kernel, []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((args[5], args[6], kw["SPLITS"])) or kernel[grid](*args, **kw)
    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", Spy())
    return launches


@pytest.mark.parametrize("per_thread", [True, False])
def test_merge_weighs_splits_by_their_lse_without_overflow(per_thread, monkeypatch, merge_launches):
    """Splits whose log-sum-exps lie hundreds apart (exp2 of their differences overflows float32), empty ones
    (-inf), all empty (0 out): the merge is the float64 weighted mean, each way of merging."""
    monkeypatch.setattr(triton_attention, "PER_THREAD_SPLITS", 32 if per_thread else 0)
    gen = torch.Generator().manual_seed(5)
    partial = torch.randn(3, 2, 5, 64, generator=gen)
    lse = torch.tensor([[0.0, 300.0, -200.0, float("-inf"), -100.0], [5.0, float("-inf"), 4.0, 3.0, -400.0]])
    lse = torch.stack([lse, lse.flip(-1), torch.randn(2, 5, generator=gen)])
    lse[2, 0] = float("-inf")
    expected = merged(partial, lse)
    out = torch.empty(3, 2, 64, device=DEVICE)
    triton_attention.merge_splits(partial.to(DEVICE), lse.to(DEVICE), out)
    assert_close(out, expected, torch.float32)
    assert [ways for *_, ways in merge_launches] == [5 if per_thread else 0]


@pytest.mark.parametrize("per_thread", [True, False])
def test_merge_reads_only_the_splits_that_the_context_fills(per_thread, monkeypatch):
    """The decode kernel's splits past a sequence's keys write nothing (they end before the dependent-launch
    wait): the merge of its output counts the filled splits as the kernel does and never reads the others (NaN
    here), each way of merging."""
    monkeypatch.setattr(triton_attention, "PER_THREAD_SPLITS", 32 if per_thread else 0)
    contexts = torch.tensor([1, 40, 128, 300, 0], dtype=torch.int32)  # 16-token tiles, 8 splits: 1, 3, 8, 7, 1 filled
    filled = [1, 3, 8, 7, 1]
    gen = torch.Generator().manual_seed(6)
    partial, lse = torch.randn(5, 2, 8, 64, generator=gen), torch.randn(5, 2, 8, generator=gen) * 4
    for row, n in enumerate(filled):
        partial[row, :, n:], lse[row, :, n:] = float("nan"), float("nan")
    lse[4] = float("-inf")  # a context of 0 (a graph's padding row): its first split is written, empty
    expected = merged(partial.nan_to_num(), lse.nan_to_num(nan=float("-inf")))  # the unwritten splits left out
    out = torch.empty(5, 2, 64, device=DEVICE)
    triton_attention.merge_splits(partial.to(DEVICE), lse.to(DEVICE), out, (contexts.to(DEVICE), 16, 16))
    assert_close(out, expected, torch.float32)


def test_merge_takes_a_tile_of_any_number_of_splits():
    """More splits than PER_THREAD_SPLITS and not a power of two (40: batch 1 over 13 KV heads on an H200 has as
    many), merged as a tile across the threads: padded to a power of two (`tl.arange`'s), only the splits each
    context fills read (NaN beyond them)."""
    assert 40 > triton_attention.PER_THREAD_SPLITS
    contexts = torch.tensor([600, 17, 640], dtype=torch.int32)  # 16-key splits: 38, 2, 40 filled
    filled = [38, 2, 40]
    gen = torch.Generator().manual_seed(9)
    partial, lse = torch.randn(3, 2, 40, 64, generator=gen), torch.randn(3, 2, 40, generator=gen) * 4
    lse[0, 1, 5] = float("-inf")
    for row, n in enumerate(filled):
        partial[row, :, n:], lse[row, :, n:] = float("nan"), float("nan")
    expected = merged(partial.nan_to_num(), lse.nan_to_num(nan=float("-inf")))
    out = torch.empty(3, 2, 64, device=DEVICE)
    triton_attention.merge_splits(partial.to(DEVICE), lse.to(DEVICE), out, (contexts.to(DEVICE), 16, 16))
    assert_close(out, expected, torch.float32)


def test_decode_default_split_size():
    """The engine's own split choice and minimum split length on contexts of up to 700 tokens."""
    contexts = [700, 1, 257]
    q, k, v, caches, meta = make_case([1] * 3, contexts, 4, 1, 64, 64, False, seed=3)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125)
    assert_close(out, expected, torch.float32)


def test_decode_splits_are_shorter_where_the_merge_takes_a_tile(merge_launches):
    """The default minimum split: MIN_SPLIT_TOKENS_TILE_MERGE where there are more splits than the merge takes one
    dim a thread (batch 1: 64 splits), MIN_SPLIT_TOKENS where there are not (32 programs: 16 splits); the kernel
    and its merge count the same filled splits, so the output is right either way."""
    for contexts, kv_heads in (([300], 1), ([300, 1, 70, 129, 64, 200, 2, 90], 4)):
        q, k, v, caches, meta = make_case([1] * len(contexts), contexts, 2 * kv_heads, kv_heads, 64, 16, False,
                                          seed=len(contexts))
        expected = reference(q, k, v, caches, meta, False)
        q, k, v, caches = to_device(q, k, v, caches, torch.float32)
        out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125)
        assert_close(out, expected, torch.float32)
    assert merge_launches == [(64, triton_attention.MIN_SPLIT_TOKENS_TILE_MERGE, 0),
                              (16, triton_attention.MIN_SPLIT_TOKENS, 16)]
    assert triton_attention.MIN_SPLIT_TOKENS_TILE_MERGE < triton_attention.MIN_SPLIT_TOKENS  # (else nothing shown)


def test_decode_merges_one_dim_a_thread_up_to_per_thread_splits(merge_launches):
    """The boundary of the two merges: at exactly PER_THREAD_SPLITS splits the merge keeps one dim a thread and the
    default minimum split is MIN_SPLIT_TOKENS; one split more, the merge takes a tile and the minimum is
    MIN_SPLIT_TOKENS_TILE_MERGE. The output is right both times."""
    q, k, v, caches, meta = make_case([1, 1], [300, 7], 2, 1, 64, 16, False, seed=14)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    per_thread = triton_attention.PER_THREAD_SPLITS
    for splits in (per_thread, per_thread + 1):
        out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125,
                                                num_splits=splits)
        assert_close(out, expected, torch.float32)
    assert merge_launches == [(per_thread, triton_attention.MIN_SPLIT_TOKENS, per_thread),
                              (per_thread + 1, triton_attention.MIN_SPLIT_TOKENS_TILE_MERGE, 0)]


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_in_any_order_writes_each_row_its_own(splits):
    """The decode step's `order` (longest context first, as a CUDA graph's replay fills it) only changes when each
    sequence's programs go out: every row gets its own attention, bit for bit the same as in batch order."""
    contexts = [9, 70, 33, 1, 50]
    q, k, v, caches, meta = make_case([1] * 5, contexts, 4, 2, 64, 16, False, seed=21)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    order = torch.tensor([1, 4, 2, 0, 3], dtype=torch.int32, device=DEVICE)
    args = (q, *caches, meta.block_tables, meta.context_lens, 0.125)
    in_order = triton_attention.decode_attention(*args, num_splits=splits, min_split_tokens=16)
    out = triton_attention.decode_attention(*args, num_splits=splits, min_split_tokens=16, order=order)
    assert torch.equal(out, in_order)
    assert_close(out, expected, torch.float32)


VARLEN_CASES = [  # (case, num_heads, num_kv_heads, head_dim, block_size, kv_fp8)
    ("prefill", 4, 2, 64, 16, False),
    ("prefix", 4, 1, 64, 48, True),
    ("mixed", 6, 2, 80, 32, False),
    ("mixed", 3, 3, 64, 256, True),
    ("decode", 16, 2, 64, 16, False),
    ("prefill", 2, 1, 256, 64, True),  # tiles of 32 keys over chunked values: every second one starts mid-chunk
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,num_heads,num_kv_heads,head_dim,block_size,kv_fp8", VARLEN_CASES)
def test_varlen_matches_reference(name, num_heads, num_kv_heads, head_dim, block_size, kv_fp8, dtype):
    query_lens, contexts = CASES[name]
    q, k, v, caches, meta = make_case(query_lens, contexts, num_heads, num_kv_heads, head_dim, block_size, kv_fp8,
                                      seed=num_heads)
    expected = reference(q, k, v, caches, meta, kv_fp8)
    q, k, v, caches = to_device(q, k, v, caches, dtype)
    scales = (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)
    out = triton_attention.varlen_attention(q, k, v, *caches, meta, q.size(-1) ** -0.5, *scales)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("splits,split_seqs", [(1, 16), (3, 16), (3, 2)])
@pytest.mark.parametrize("name,num_heads,num_kv_heads,head_dim,block_size,kv_fp8", VARLEN_CASES[:3] + VARLEN_CASES[4:])
def test_varlen_through_a_tile_map_matches_reference(name, num_heads, num_kv_heads, head_dim, block_size, kv_fp8,
                                                     splits, split_seqs, merge_launches, monkeypatch):
    """As a CUDA graph replays it (`varlen_graphs.py`): a grid of tile-map rows, the step's (sequence, query tile)
    pairs and the `splits` splits of each decode among its first `split_seqs` sequences first and empty rows after,
    host integers of another step (max_seqlen_q), padding token rows past the step's and padding sequences of no
    tokens; the real rows match the reference and no other row is written. Decodes of 300 and 1,000 keys fill
    several splits, of 1-17 keys one; with 2 sequences split, the decode case's other 6 take one program each."""
    monkeypatch.setattr(triton_attention, "VARLEN_SPLIT_SEQS", split_seqs)
    dtype = DTYPES[-1]
    query_lens, contexts = CASES[name]
    q, k, v, caches, meta = make_case(query_lens, contexts, num_heads, num_kv_heads, head_dim, block_size, kv_fp8,
                                      seed=num_heads + 1)
    expected = reference(q, k, v, caches, meta, kv_fp8)
    q, k, v, caches = to_device(q, k, v, caches, dtype)
    n = q.size(0)
    q = torch.cat([q, torch.randn(5, *q.shape[1:], dtype=dtype, device=DEVICE)])  # padding tokens
    cu = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(2)])  # padding sequences
    query_tile = triton_attention.varlen_query_tile(num_heads // num_kv_heads)
    rows = triton_attention.max_varlen_tiles(n + 5, len(query_lens) + 2, query_tile, splits)
    tile_map = torch.from_numpy(triton_attention.varlen_tile_map(np.array(query_lens), query_tile, rows, splits,
                                                                 np.array(contexts)))  # longest first
    meta = dataclasses.replace(meta, cu_seqlens_q=cu, max_seqlen_q=0, tile_map=tile_map.to(DEVICE),
                               tile_map_splits=splits,
                               block_tables=torch.cat([meta.block_tables, meta.block_tables[:2]]),
                               context_lens=torch.cat([meta.context_lens, meta.context_lens[:2]]))
    out = torch.full_like(q, 7.0)
    scales = (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)
    triton_attention.varlen_attention(q, k, v, *caches, meta, head_dim ** -0.5, *scales, out=out)
    assert_close(out[:n], expected, dtype)
    assert (out[n:] == 7.0).all()
    assert merge_launches == ([(splits, triton_attention.MIN_SPLIT_TOKENS, splits)] if splits > 1 else [])


@pytest.mark.parametrize("variant", [(32, 32, 4, 3), (128, 16, 8, 2)])
def test_varlen_tiles_of_other_sizes_match_reference(variant, merge_launches, monkeypatch):
    """NANOVLLM_VARLEN_TILE's other tiles (query rows, keys, warps, stages), through a tile map with split decodes:
    the map's query tiles follow the rows, and the merge finds the splits that keys of that size make (a decode of
    560 keys fills 4 splits of 160 or 144 keys in tiles of 32 or 16, 3 of 192 in tiles of 64)."""
    for name, value in zip(("QUERY_ROWS", "VARLEN_KV_TILE", "VARLEN_WARPS", "VARLEN_STAGES"), variant):
        monkeypatch.setattr(triton_attention, name, value)
    query_lens, contexts = [1, 70, 1], [560, 70, 1000]
    q, k, v, caches, meta = make_case(query_lens, contexts, 4, 2, 64, 16, False, seed=3)
    expected = reference(q, k, v, caches, meta, False)
    dtype = DTYPES[-1]
    q, k, v, caches = to_device(q, k, v, caches, dtype)
    query_tile = triton_attention.varlen_query_tile(2)
    rows = triton_attention.max_varlen_tiles(q.size(0), len(query_lens), query_tile, 4)
    tile_map = triton_attention.varlen_tile_map(np.array(query_lens), query_tile, rows, 4, np.array(contexts))
    meta = dataclasses.replace(meta, max_seqlen_q=0, tile_map=torch.from_numpy(tile_map).to(DEVICE), tile_map_splits=4)
    out = triton_attention.varlen_attention(q, k, v, *caches, meta, 64 ** -0.5)
    assert_close(out, expected, dtype)
    assert merge_launches == [(4, triton_attention.MIN_SPLIT_TOKENS, 4)]


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("split_from", [3, 4, 5])
def test_mixed_step_gives_its_leading_decodes_to_the_decode_kernel(split_from, kv_fp8, monkeypatch):
    """A mixed step that leads with at least SPLIT_DECODES decodes attends them with the decode kernel and its
    prompts with the varlen kernel, into one output; with fewer, the varlen kernel takes the whole step."""
    query_lens, contexts = [1, 1, 1, 1, 13, 30, 1], [5, 40, 17, 64, 13, 70, 9]  # 4 leading decodes
    q, k, v, caches, meta = make_case(query_lens, contexts, 4, 2, 64, 16, kv_fp8, seed=5)
    meta = dataclasses.replace(meta, num_decodes=4)
    expected = reference(q, k, v, caches, meta, kv_fp8)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    monkeypatch.setattr(triton_attention, "SPLIT_DECODES", split_from)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 8)  # 4 splits, not 64: the interpreter is slow
    calls = []
    for name in ("decode_attention", "varlen_attention"):
        kernel = getattr(triton_attention, name)
        monkeypatch.setattr(triton_attention, name, lambda *a, _k=kernel, _n=name, **kw:
                            calls.append((_n, a[0].size(0), a[-1 if _n == "decode_attention" else 5]))
                            or _k(*a, **kw))
    backend = object.__new__(triton_attention.TritonBackend)  # its __init__ insists on CUDA
    scales = (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)
    out = backend.forward(q, k, v, *caches, meta, q.size(-1) ** -0.5, *scales)
    assert_close(out, expected, torch.float32)
    if split_from <= 4:
        assert [(name, rows) for name, rows, _ in calls] == [("decode_attention", 4), ("varlen_attention", 48)]
        assert calls[1][2].cu_seqlens_q.tolist() == [4, 17, 47, 48]  # the prompts' rows of q, and the last decode
    else:
        assert [(name, rows) for name, rows, _ in calls] == [("varlen_attention", 48)]


def test_split_decodes_needs_one_prompt_beside_the_decodes(monkeypatch):
    """SPLIT_DECODES decodes and a single prompt split (the usual mixed step: decodes beside one prefill chunk),
    and the two kernels' output agrees with torch; a step of decodes alone, with no prompt, does not split."""
    monkeypatch.setattr(triton_attention, "SPLIT_DECODES", 3)
    query_lens, contexts = [1, 1, 1, 13], [5, 40, 17, 30]
    q, k, v, caches, meta = make_case(query_lens, contexts, 4, 2, 64, 16, False, seed=6)
    meta = dataclasses.replace(meta, num_decodes=3)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    scale = q.size(-1) ** -0.5
    out, rest = triton_attention.split_decodes(q, *caches, meta, scale)
    assert out is not None and rest.cu_seqlens_q.tolist() == [3, 16] and rest.context_lens.tolist() == [30]
    assert_close(triton_attention.varlen_attention(q, k, v, *caches, rest, scale, out=out), expected, torch.float32)
    decodes = dataclasses.replace(meta, cu_seqlens_q=meta.cu_seqlens_q[:4], context_lens=meta.context_lens[:3],
                                  block_tables=meta.block_tables[:3], max_seqlen_q=1)
    out, rest = triton_attention.split_decodes(q[:3], *caches, decodes, scale)
    assert out is None and rest is decodes


def assert_same_meta(got, want):
    for f in filter(lambda f: f.compare, dataclasses.fields(want)):  # not the cache of derived parts
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, f.name


def test_split_decodes_builds_a_steps_parts_once(monkeypatch):
    """Every layer of a step passes the same metadata: the first that splits builds the decodes' block tables and
    context lengths and the other sequences' metadata, the others reuse them. The next step's metadata, a new
    object, gets parts of its own, each equal to the slices built afresh; so does a `replace` of a metadata."""
    monkeypatch.setattr(triton_attention, "SPLIT_DECODES", 1)
    decode_args = []
    monkeypatch.setattr(triton_attention, "decode_attention", lambda q, kc, vc, tables, lens, *a, **kw:
                        decode_args.append((tables, lens)))
    cache = torch.zeros(8, 16, 2, 64, device=DEVICE)
    for query_lens, contexts, n in [([1, 1, 1, 13], [5, 40, 17, 30], 3), ([1, 1, 9, 4], [33, 8, 20, 4], 2)]:
        _, _, _, _, meta = make_case(query_lens, contexts, 4, 2, 64, 16, False, seed=n)
        meta = dataclasses.replace(meta, num_decodes=n)
        q = torch.zeros(sum(query_lens), 4, 64, device=DEVICE)
        decode_args.clear()
        rests = [triton_attention.split_decodes(q, cache, cache, meta, 0.125)[1] for _ in range(3)]  # 3 layers
        assert rests[0] is rests[1] is rests[2]
        assert all(a is b for args in decode_args[1:] for a, b in zip(args, decode_args[0]))
        tables, lens = decode_args[0]
        assert torch.equal(tables, meta.block_tables[:n]) and torch.equal(lens, meta.context_lens[:n])
        assert_same_meta(rests[0], dataclasses.replace(
            meta, block_tables=meta.block_tables[n:], context_lens=meta.context_lens[n:],
            cu_seqlens_q=meta.cu_seqlens_q[n:], num_decodes=0, query_lens_host=query_lens[n:],
            context_lens_host=contexts[n:]))
        fewer = dataclasses.replace(meta, num_decodes=n - 1)
        rest = triton_attention.split_decodes(q, cache, cache, fewer, 0.125)[1]
        assert rest.cu_seqlens_q.tolist() == meta.cu_seqlens_q[n - 1:].tolist()


def test_split_metadata_without_host_lists():
    """The host copies of query and context lengths are for backends that loop over sequences, and the Triton
    kernels never read them: metadata built without them splits all the same, and its rest has none either."""
    _, _, _, _, meta = make_case([1, 1, 9, 4], [33, 8, 20, 4], 4, 2, 64, 16, False, seed=8)
    meta = dataclasses.replace(meta, num_decodes=2, query_lens_host=None, context_lens_host=None)
    tables, lens, rest = meta.decodes_and_rest()
    assert torch.equal(tables, meta.block_tables[:2]) and lens.tolist() == [33, 8]
    assert rest.cu_seqlens_q.tolist() == [2, 11, 15] and rest.context_lens.tolist() == [20, 4]
    assert rest.query_lens_host is None and rest.context_lens_host is None


def test_layers_share_the_kernel_arguments():
    """The arguments both paths share are built once per shape, dtype and scales, not in every layer's attention;
    other scales (an FP8 cache's) get their own."""
    q, k, v, caches, meta = make_case([1, 6], [5, 6], 4, 2, 64, 16, False, seed=7)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    triton_attention._common_args.cache_clear()
    for _ in range(3):  # 3 layers
        triton_attention.paged_attention(q, k, v, *caches, meta, 0.125)
    assert triton_attention._common_args.cache_info().misses == 1
    triton_attention.paged_attention(q, k, v, *caches, meta, 0.125, K_SCALE, V_SCALE)
    assert triton_attention._common_args.cache_info().misses == 2


@pytest.mark.parametrize("k_layout", ["slice", "contiguous"])
def test_varlen_without_cache_reads_this_steps_keys(k_layout):
    """The warm-up before the cache exists: each sequence attends over its own k and v. v is a strided slice of
    the fused projection; k too, or (as in Qwen3, after its norm) a contiguous tensor with other strides."""
    query_lens = [1, 17, 40, 5]
    q, k, v, _, meta = make_case(query_lens, query_lens, 4, 2, 64, 16, False, seed=5)
    meta.block_tables = meta.block_tables[:, :0]
    expected = reference(q, k, v, None, meta, False, paged=False)
    q = q.to(DEVICE)
    fused = torch.cat([k.flatten(1), v.flatten(1)], dim=1).to(DEVICE)
    k, v = fused[:, :k[0].numel()].view(k.shape), fused[:, k[0].numel():].view(v.shape)
    if k_layout == "contiguous":
        k = k.contiguous()
    assert not v.is_contiguous()
    empty = torch.empty(0, device=DEVICE)
    assert_close(triton_attention.varlen_attention(q, k, v, empty, empty, meta, 0.125), expected, torch.float32)


def test_step_without_cache_keeps_its_leading_decodes_on_the_varlen_path(monkeypatch):
    """A step before the cache exists (a warm-up) that leads with SPLIT_DECODES one-token sequences beside a prompt:
    the decode kernel, which reads only the cache, does not take them; every sequence attends over its own keys."""
    monkeypatch.setattr(triton_attention, "SPLIT_DECODES", 3)
    query_lens = [1, 1, 1, 13]
    q, k, v, _, meta = make_case(query_lens, query_lens, 4, 2, 64, 16, False, seed=15)
    meta = dataclasses.replace(meta, num_decodes=3, block_tables=meta.block_tables[:, :0])
    expected = reference(q, k, v, None, meta, False, paged=False)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    empty = torch.empty(0, device=DEVICE)
    assert_close(triton_attention.paged_attention(q, k, v, empty, empty, meta, 0.125), expected, torch.float32)


def assert_stored_as(got: torch.Tensor, want: torch.Tensor):
    """A cache a Triton kernel wrote equals the torch reference's, bit for bit. Except FP8 under Triton's
    interpreter (3.9), which rounds float32 -> FP8 towards zero and mishandles rounding that carries into the
    exponent (31.6 -> 16, not 32): then nearly all values equal, the rest at most a factor 2 smaller; a
    forgotten scale (16x, 3x) still fails it."""
    want = want.to(got.device)
    if got.device.type == "cuda" or got.dtype != FP8_DTYPE:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        got, want = got.float().abs(), want.float().abs()
        assert torch.all((got <= want) & (got >= want / 2 - 2 ** -9))
        assert (got == want).float().mean() > 0.95  # 99.6% when written


@pytest.mark.parametrize("kv_fp8, block_size", [(False, 16), (True, 16), (True, VALUE_CHUNK * 2)])
def test_triton_store_matches_torch(kv_fp8, block_size):
    """Bit for bit on CUDA (on CPU, FP8 as `assert_stored_as` says); FP8 values laid out as the keys, or in
    chunks where blocks hold whole chunks."""
    from nanovllm.layers.triton_kvstore import store_kvcache
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, num_blocks = 21, 3, 80, 5
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, generator=gen) * 4
    k = qkv[:, 2 * num_kv_heads * head_dim:3 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 3 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    qkv[:3, -1] = torch.tensor([1e4, -1e4, 30.0])  # beyond FP8's range once divided by the scale: saturates
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding: writes nothing
    cache_dtype = FP8_DTYPE if kv_fp8 else torch.float32
    scales = (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)
    expected = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    TorchBackend().store_kvcache(k, v, *expected, slots, *scales)
    caches = [torch.zeros_like(c, device=DEVICE) for c in expected]
    store_kvcache(k.to(DEVICE), v.to(DEVICE), *caches, slots.to(DEVICE), *scales)
    for got, want in zip(caches, expected):
        assert_stored_as(got, want)


def test_decode_splits_fill_the_gpu():
    sms = 132
    assert triton_attention.decode_splits(256, 8, sms) == 1  # 2048 programs: plenty
    assert triton_attention.decode_splits(1, 8, sms) == triton_attention.MAX_SPLITS
    for batch in (1, 2, 8, 16, 32):
        splits = triton_attention.decode_splits(batch, 8, sms)
        assert sms <= batch * 8 * splits <= 4 * sms and splits <= triton_attention.MAX_SPLITS


def test_decode_splits_of_short_contexts():
    """Given the batch's longest context, a batch takes no more splits than the power of two >= context /
    MIN_SPLIT_TOKENS (1 up to 128 keys: no merge), while that is at most SHORT_CONTEXT_SPLITS; past it, or unknown
    (0), the batch's own."""
    sms, splits = 132, triton_attention.decode_splits
    assert (triton_attention.MIN_SPLIT_TOKENS, triton_attention.SHORT_CONTEXT_SPLITS) == (128, 16)
    assert splits(8, 8, sms) == 8
    assert [splits(8, 8, sms, max_context=c) for c in (1, 128, 129, 256, 300, 512, 513, 1024, 4096, 0)] == \
        [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]
    assert splits(1, 8, sms) == 64
    assert [splits(1, 8, sms, max_context=c) for c in (2048, 2049, 8192)] == [16, 64, 64]
    assert splits(16, 8, sms, 1, max_context=300) == 4 < splits(16, 8, sms, 1) == 6  # (FP8: 6 splits)
    assert splits(256, 8, sms, max_context=100) == 1


def test_decode_context_bounds_are_where_the_splits_fall():
    """The bounds a decode graph is captured at for each batch size: MIN_SPLIT_TOKENS x each power of two below
    the batch's splits, up to SHORT_CONTEXT_SPLITS; each bound's batch takes fewer splits than the next."""
    sms, bounds = 132, triton_attention.decode_context_bounds
    assert bounds(1, 8, sms) == [128, 256, 512, 1024, 2048]
    assert bounds(8, 8, sms) == [128, 256, 512]
    assert bounds(24, 8, sms) == [128] and bounds(32, 8, sms, 1) == [128, 256]  # (2 splits; FP8 at 32: 3)
    assert bounds(32, 8, sms) == bounds(256, 8, sms) == []
    for batch in (1, 2, 4, 8, 16, 32):
        counts = [triton_attention.decode_splits(batch, 8, sms, max_context=b)
                  for b in (*bounds(batch, 8, sms), 1 << 20)]
        assert counts == sorted(set(counts)) and counts[-1] == triton_attention.decode_splits(batch, 8, sms)


def test_decode_of_short_contexts_needs_no_merge(merge_launches):
    """A batch whose contexts fit one split, told so (`max_context`), runs unsplit: no merge launches; told a
    bound of 300 it takes 4 splits, told none its own; the output is right each time."""
    contexts = [100, 37, 128]
    q, k, v, caches, meta = make_case([1] * 3, contexts, 4, 2, 64, 16, False, seed=15)
    expected = reference(q, k, v, caches, meta, False)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    for max_context in (128, 300, 0):
        out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125,
                                                max_context=max_context)
        assert_close(out, expected, torch.float32)
    sms = triton_attention._num_sms(DEVICE)
    assert [n for n, *_ in merge_launches] == [4, triton_attention.decode_splits(3, 2, sms)]


def test_steps_tell_the_decode_kernel_their_longest_context(monkeypatch):
    """A decode-only step and a mixed step's leading decodes pass the metadata's max_seqlen_k (the host's longest
    context, or a graph's bound) to the decode kernel as its max_context."""
    monkeypatch.setattr(triton_attention, "SPLIT_DECODES", 2)
    seen = []
    monkeypatch.setattr(triton_attention, "decode_attention",
                        lambda q, *a, **kw: seen.append(kw["max_context"]) or torch.zeros_like(q))
    cache = torch.zeros(8, 16, 2, 64, device=DEVICE)
    q, k, v, _, meta = make_case([1, 1], [40, 17], 4, 2, 64, 16, False, seed=16)
    triton_attention.paged_attention(q, k, v, cache, cache, meta, 0.125)
    q, k, v, _, meta = make_case([1, 1, 9], [5, 40, 30], 4, 2, 64, 16, False, seed=17)
    triton_attention.split_decodes(q, cache, cache, dataclasses.replace(meta, num_decodes=2, max_seqlen_k=77), 0.125)
    assert seen == [40, 77]


@pytest.mark.parametrize("itemsize", [2, 1])
def test_decode_splits_only_below_their_programs_per_sm(itemsize):
    """The boundary of the split heuristic: batch x kv_heads programs of SPLIT_BELOW_PROGRAMS_PER_SM per SM (1.8
    over bf16, 3 over FP8), rounded up, fill the GPU (1 split); one program fewer splits, in 2 at least. On an
    H200's 132 SMs, 32 sequences of 8 KV heads run unsplit over bf16, 29 split."""
    sms = 132
    full = math.ceil(triton_attention.SPLIT_BELOW_PROGRAMS_PER_SM[itemsize] * sms)
    assert triton_attention.decode_splits(-(-full // 4), 4, sms, itemsize) == 1
    assert triton_attention.decode_splits(full, 1, sms, itemsize) == 1
    assert triton_attention.decode_splits(full - 1, 1, sms, itemsize) >= 2
    if itemsize == 2:
        assert triton_attention.decode_splits(32, 8, sms) == 1 < triton_attention.decode_splits(29, 8, sms)


def test_fp8_decode_splits_fill_an_sm_of_its_programs():
    """Over FP8 (sessions 30 and 34, on an H200) 48 sequences of 8 KV heads split in 2, as over bf16 they do not,
    and a split batch aims at 6 programs an SM where bf16's aims at 4 (24 sequences: 4 splits, not 2; 32: 3); a
    float32 cache splits as bf16 does (32 sequences: unsplit)."""
    sms = 132
    assert triton_attention.decode_splits(48, 8, sms, 1) == 2
    assert triton_attention.decode_splits(48, 8, sms, 2) == 1
    assert triton_attention.decode_splits(48, 8, sms, 4) == 1
    assert triton_attention.decode_splits(24, 8, sms, 1) == 4
    assert triton_attention.decode_splits(32, 8, sms, 1) == 3
    assert triton_attention.decode_splits(32, 8, sms, 2) == triton_attention.decode_splits(32, 8, sms, 4) == 1
    for batch in (2, 8, 16, 24, 32, 40):
        splits = triton_attention.decode_splits(batch, 8, sms, 1)
        assert 4 * sms < batch * 8 * splits <= 6 * sms and splits <= triton_attention.MAX_SPLITS


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_decode_splits_by_the_caches_bytes(kv_fp8, monkeypatch, merge_launches):
    """decode_attention picks its splits by the cache's dtype: on 4 SMs, 8 programs (8 sequences, 1 KV head) fill
    the GPU over a float32 cache (no merge) and split in 3 over FP8 (24 programs: 6 an SM); the output is right
    both ways."""
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 4)
    q, k, v, caches, meta = make_case([1] * 8, [300, 1, 70, 129, 64, 200, 2, 90], 2, 1, 64, 16, kv_fp8, seed=30)
    expected = reference(q, k, v, caches, meta, kv_fp8)
    q, k, v, caches = to_device(q, k, v, caches, torch.float32)
    scales = (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)
    out = triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, 0.125, *scales)
    assert_close(out, expected, torch.float32)
    assert merge_launches == ([(3, triton_attention.MIN_SPLIT_TOKENS, 3)] if kv_fp8 else [])


@pytest.mark.parametrize("split_decodes", [0, 1])
def test_engine_on_triton_kernels_matches_hf(tiny_model, hf_model, monkeypatch, split_decodes):
    """The whole engine on the Triton backend: chunked prefill, mixed and decode steps, prefix hits, a shrinking
    batch whose decode splits (CPU only: the interpreter stands in for a GPU; CUDA runs the GPU engine tests);
    with split_decodes=1 every mixed step gives its decodes to the decode kernel."""
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA the engine picks its backend itself (tests/test_kv_cache_dtype.py)")
    from nanovllm import LLM, SamplingParams
    from tests.conftest import assert_greedy_matches_hf
    llm = LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=32, num_kvcache_blocks=24)  # the
    # interpreter copies every tensor argument (the caches too) to the host and back at each launch: keep it small
    backend = object.__new__(triton_attention.TritonBackend)  # its __init__ insists on CUDA
    llm.model_runner.backend = backend
    for layer in llm.model_runner.attn_layers:
        layer.backend = backend
    # 4 "SMs": a batch of 1-3 sequences x 2 KV heads splits its keys in 8, 4 or 2
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 4)
    monkeypatch.setattr(triton_attention, "SPLIT_DECODES", split_decodes)
    splits, split = [], triton_attention.split_decodes

    def counted_split(*args):
        out, meta = split(*args)
        splits.append(out is not None)
        return out, meta
    monkeypatch.setattr(triton_attention, "split_decodes", counted_split)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 20, 40, 17)]
    prompts.append(prompts[2][:32] + [9])  # a prefix hit on two full blocks once prompts[2] is cached
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 12, 4, 8, 6)]
    llm.generate(prompts[2:3], params[2], use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[-1]["num_cached_tokens"] == 32
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])
    assert splits and any(splits) == (split_decodes == 1)  # mixed steps with decodes ran, split or not


def attention_case(cache: str, decode: bool, paged: bool = True, split: bool = False, tile_map: bool = False,
                   programs_per_sm: float = 0.0) -> tuple:
    """`_attention_kernel` as `decode_attention` or `varlen_attention` launches it for Qwen3-0.6B in bf16 (16 query
    heads over 8 KV heads, head_dim 128, blocks of 256): a compile case for `compile_for_sm90`."""
    tl = triton_attention.tl
    signature = dict(q_ptr="*bf16", k_ptr=f"*{cache}", v_ptr=f"*{cache}", out_ptr="*bf16",
                     partial_ptr="*fp32" if split else "*bf16",  # unsplit, the output stands in for the unused
                     lse_ptr="*fp32" if split else "*bf16",  # partial and lse
                     block_tables_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_q_ptr="*i32",
                     tile_map_ptr="*i32", order_ptr="*i32", q_token_stride="i32",
                     q_head_stride="i32", kv_token_stride="i32", kv_head_stride="i32", block_table_stride="i32",
                     qk_scale="fp32", v_scale="fp32", min_split_tokens="i32")
    constexprs = dict(NUM_KV_HEADS=8, GROUP=2, GROUP_PAD=2, HEAD_DIM=128, DIM_PAD=128, DECODE=decode, PAGED=paged,
                      SPLIT=split, TILE_MAP=tile_map, SPLIT_SEQS=0 if decode else triton_attention.VARLEN_SPLIT_SEQS,
                      COMPUTE_DTYPE=tl.float16 if cache == "fp8e4nv" else tl.bfloat16,
                      DOT_PRECISION="tf32", PDL=decode or tile_map, ORDER=decode, PREFETCH=0, LINES=1,
                      LINE_ELEMENTS=1, V_CHUNK=VALUE_CHUNK if cache == "fp8e4nv" and paged else 0)  # as on an H200
    if split:
        signature["num_splits"] = "i32"
    else:
        constexprs["num_splits"] = 1  # Triton makes an int argument of 1 a constexpr
    if decode:
        tile, warps, stages = triton_attention.decode_tile(128, 1 if cache == "fp8e4nv" else 2, split, 256,
                                                           constexprs["V_CHUNK"], False, programs_per_sm)
        line = 128 if cache == "fp8e4nv" else 64
        constexprs.update(QUERY_TILE=1, ROWS=16, KV_TILE=tile, BLOCK_SIZE=256, LINES=128 // line, LINE_ELEMENTS=line,
                          PREFETCH=triton_attention.KV_PREFETCH_TILES if split else 0)
    else:  # 64 rows of 32 tokens x 2 heads; a warm-up run (not paged) reads its own keys with a block size of 16
        warps, stages = triton_attention.VARLEN_WARPS, triton_attention.VARLEN_STAGES
        constexprs.update(QUERY_TILE=32, ROWS=64, KV_TILE=64, BLOCK_SIZE=256 if paged else 16)
    return ("nanovllm.layers.triton_attention", "_attention_kernel", signature, constexprs,
            dict(num_warps=warps, num_stages=stages))


def test_kernels_compile_for_sm90():
    """The CPU tests run the kernels through Triton's interpreter, which does not type-check them as the compiler
    does (tests/test_triton_rope_store.py had a kernel that passed them and failed to compile on the H200).
    Attention: decode split and unsplit over a bf16 cache, split and unsplit (both tiles) over an FP8 one (chunked
    values), prefill over an FP8 cache, a warm-up's over its own keys and a graph's through a tile map, its decodes
    split or not; the merges of a batch of one's 64 splits, of batch 8's 8 and of a graph's varlen step; the KV
    store into both caches."""
    deep = triton_attention.FP8_DEEP_PROGRAMS_PER_SM
    cases = [attention_case("bf16", decode=True, split=True), attention_case("bf16", decode=True),
             attention_case("fp8e4nv", decode=True), attention_case("fp8e4nv", decode=True, programs_per_sm=deep),
             attention_case("fp8e4nv", decode=True, split=True),
             attention_case("fp8e4nv", decode=False), attention_case("bf16", decode=False, paged=False),
             attention_case("bf16", decode=False, tile_map=True),
             attention_case("bf16", decode=False, tile_map=True, split=True)]
    splits = triton_attention.decode_splits(1, 8, 132)
    merge = dict(partial_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", context_lens_ptr="*i32",
                 cu_seqlens_q_ptr="*fp32", num_splits="i32", min_split_tokens="i32")  # (lse for the unused one)
    cases.append(("nanovllm.layers.triton_attention", "_merge_splits_kernel", merge,
                  dict(HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=splits, SPLITS=0, KV_TILE=64, VARLEN=False, PDL=True)))
    cases.append(("nanovllm.layers.triton_attention", "_merge_splits_kernel", merge,  # batch 8's, one dim a thread
                  dict(HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=16, SPLITS=8, KV_TILE=64, VARLEN=False, PDL=True),
                  dict(num_warps=4)))
    splits = triton_attention.VARLEN_DECODE_SPLITS
    cases.append(("nanovllm.layers.triton_attention", "_merge_splits_kernel", {**merge, "cu_seqlens_q_ptr": "*i32"},
                  dict(HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=16, SPLITS=splits, KV_TILE=64, VARLEN=True, PDL=True),
                  dict(num_warps=4)))
    for cache in ("bf16", "fp8e4nv"):  # k and v are slices of the qkv projection's [tokens, (16 + 2 * 8) * 128]
        cases.append(("nanovllm.layers.triton_kvstore", "_store_kvcache_kernel", dict(
            k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", slot_mapping_ptr="*i64",
            k_token_stride="i32", k_head_stride="i32", v_token_stride="i32", v_head_stride="i32", k_scale="fp32",
            v_scale="fp32"), dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_BLOCK=8, DIM_BLOCK=128, BLOCK_SIZE=256,
                                  V_CHUNK=VALUE_CHUNK if cache == "fp8e4nv" else 0, QUANTIZE=cache == "fp8e4nv")))
    compile_for_sm90(cases)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, through the interpreter (GPU: test_gpu_engine.py)")
def test_engine_built_on_the_triton_backend_matches_hf(tmp_path, monkeypatch):
    """The engine built on the Triton backend as on a GPU (test_engine_on_triton_kernels_matches_hf swaps it in
    afterwards, so its decoder never fuses the store), every kernel through the interpreter, which aborts on an
    access out of bounds: the q/k norms, rope and KV store fused into one kernel for every step (the backend's
    store is Triton's), prefills on the varlen path, split decode and its merge. Greedy tokens as HF's,
    teacher-forced. (CUDA's warm-up steps do not run on CPU; the rope in the qkv projection:
    tests/test_triton_skinny.py.)"""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine import model_runner
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    from tests.conftest import assert_greedy_matches_hf
    from tests.test_models import hf_model
    monkeypatch.setattr(model_runner.ModelRunner, "_backend_name", lambda self: "triton")
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 4)  # 2-8 splits, not 64: the interpreter is slow
    decodes = []
    decode = triton_attention.decode_attention
    monkeypatch.setattr(triton_attention, "decode_attention", lambda *a, **kw: decodes.append(1) or decode(*a, **kw))
    path = make_random_checkpoint(tmp_path / "tiny", "tiny")
    prompts = [[5, 9, 200, 31], [7] * 40, list(range(3, 60))]
    with LLM(str(path), kvcache_block_size=16, max_num_batched_tokens=64, num_kvcache_blocks=24) as llm:
        assert all(layer.fused_store for layer in llm.model_runner.attn_layers)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])
    assert decodes


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, through the interpreter (GPU: test_gpu_engine.py)")
def test_decode_graphs_on_the_triton_backend_send_their_order_and_match_hf(tmp_path, monkeypatch):
    """Decode steps through the decode graphs' replays (run eagerly, as tests/test_step_inputs.py does) on the Triton
    backend: the replay's order (longest context first) reaches the decode kernel, whose rows still get their own
    attention: greedy tokens as HF's, teacher-forced."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine import model_runner
    from nanovllm.engine.staging import Staging
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    from tests.conftest import assert_greedy_matches_hf
    from tests.test_models import hf_model
    from tests.test_step_inputs import EagerGraphs
    monkeypatch.setattr(model_runner.ModelRunner, "_backend_name", lambda self: "triton")
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 4)
    orders = []
    decode = triton_attention.decode_attention
    monkeypatch.setattr(triton_attention, "decode_attention", lambda *a, **kw: orders.append(
        None if kw.get("order") is None else kw["order"].tolist()) or decode(*a, **kw))
    path = make_random_checkpoint(tmp_path / "tiny", "tiny")
    prompts = [[5, 9, 200, 31], [7] * 40, list(range(3, 60))]
    with LLM(str(path), kvcache_block_size=16, max_num_batched_tokens=64, num_kvcache_blocks=24,
             max_num_seqs=4) as llm:
        runner, config = llm.model_runner, llm.config
        runner.staging = Staging(runner.device, pack=True)
        runner.graphs = EagerGraphs(runner.model, config.max_num_seqs, config.max_model_len, runner.block_size,
                                    runner.device)
        orders.clear()  # (the graphs' warm-up and capture)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])
    assert [2, 1, 0, 3] in orders  # the three contexts longest first, then the padding row
