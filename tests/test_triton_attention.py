"""The Triton paged-attention kernels and KV store against `TorchBackend` in float64 on the cache they read (FP8
dequantized exactly); without CUDA through the interpreter in float32 (its bf16 `tl.dot` is wrong), small shapes.
GQA 1-8, head dims 64-256 and 80, blocks 16-256 and 48, ragged contexts, one split or several, FP8 scales not 1."""
import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from nanovllm import LLM
from nanovllm.layers.attention import (FP8_DTYPE, VALUE_CHUNK, TorchBackend, quantize_kv, value_chunk,
                                      value_slots, values_as_cache)
from tests.conftest import assert_greedy_matches_hf, compile_for_sm90, greedy
from tests.test_gpu_attention import CASES, make_meta, random_block_tables, split_kv

triton_attention = pytest.importorskip("nanovllm.layers.triton_attention")
if triton_attention.triton is None:
    pytest.skip("Triton does not import here", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # float32 lands near 1e-7; bf16 operands near 5e-3
K_SCALE, V_SCALE = 0.0625, 3.0  # FP8 scales: a kernel that forgets one is off by 16x or 3x
SMS = 132  # an H200's
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="CPU, through the interpreter (GPU: test_gpu_engine.py)")


def make_case(query_lens, context_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, kv_fp8=False,
              seed=0, q_gain=1.0):
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
    for table, context in zip(block_tables, context_lens):  # keys past a context in its last block: read, but
        last = table[(context - 1) // block_size].long()  # must weigh nothing
        caches[0][last, (context - 1) % block_size + 1:] = float("nan")
    if kv_fp8:  # values as the engine's cache holds them (chunked where `value_chunk` says)
        caches = [quantize_kv(c, s, FP8_DTYPE) for c, s in zip(caches, (K_SCALE, V_SCALE))]
        caches[1] = values_as_cache(caches[1])
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen) * q_gain
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    k, v = split_kv(qkv, num_heads, num_kv_heads, head_dim)
    return q, k, v, caches, meta


def scales_of(kv_fp8):
    return (K_SCALE, V_SCALE) if kv_fp8 else (1.0, 1.0)


def reference(q, k, v, caches, meta, kv_fp8, paged=True):
    """TorchBackend in float64 on CPU, on exactly the values the kernel sees."""
    in_order = (caches[0], value_slots(caches[1]).flatten(1, 2)) if paged else ()  # the values in token order
    ref_caches = [c.double() * s for c, s in zip(in_order, scales_of(kv_fp8))] if paged else [torch.empty(0)] * 2
    cpu_meta = dataclasses.replace(meta, block_tables=meta.block_tables.cpu())
    scale = q.size(-1) ** -0.5
    return TorchBackend().forward(q.double(), k.double(), v.double(), *ref_caches, cpu_meta, scale)


def assert_close(out, expected, dtype=torch.float32):
    assert out.dtype == dtype and out.shape == expected.shape
    out = out.double().cpu()
    assert not out.isnan().any()
    err = ((out - expected).norm() / expected.norm()).item()
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


def device_case(query_lens, contexts, seed, *shape, dtype=torch.float32, **kw):
    """`make_case` on DEVICE in `dtype` (FP8 caches as they are), and its reference: q, k, v, caches, meta, expected."""
    q, k, v, caches, meta = make_case(query_lens, contexts, *shape, seed=seed, **kw)
    on_device = [c.to(DEVICE) if c.dtype == FP8_DTYPE else c.to(DEVICE, dtype) for c in caches]
    fp8 = caches[0].dtype == FP8_DTYPE
    return *(t.to(DEVICE, dtype) for t in (q, k, v)), on_device, meta, reference(q, k, v, caches, meta, fp8)


def decode_case(contexts, *args, **kw):
    return device_case([1] * len(contexts), contexts, *args, **kw)


def decode(q, caches, meta, scale=0.125, *scales, **kw):
    return triton_attention.decode_attention(q, *caches, meta.block_tables, meta.context_lens, scale, *scales, **kw)


def patch(monkeypatch, **values):
    for name, value in values.items():
        monkeypatch.setattr(triton_attention, name, value)


def spy(monkeypatch, name, record=lambda ret, *a, **kw: ret, calls=None):
    """The calls of triton_attention's `name` (which still runs), each as `record(output, *args, **kwargs)`."""
    calls, fn = [] if calls is None else calls, getattr(triton_attention, name)

    def wrapper(*a, **kw):
        out = fn(*a, **kw)
        calls.append(record(out, *a, **kw))
        return out
    monkeypatch.setattr(triton_attention, name, wrapper)
    return calls


def decode_cases():
    rng = random.Random(11)
    cases = []
    for i, (head_dim, block_size, splits) in enumerate([(64, 16, 1), (128, 48, 2), (256, 32, 3), (64, 256, 1),
                                                        (80, 16, 5), (128, 128, 4), (64, 64, 1), (256, 16, 2)]):
        kv_heads = rng.choice([1, 2, 3]) if head_dim < 256 else 1
        contexts = [1, block_size, block_size + 1] + [rng.randint(2, 4 * block_size) for _ in range(2)]
        fp8, peaky, tile = i % 2 == 1, i in (1, 5), i in (2, 4, 5)
        cases.append(pytest.param(i + 1, kv_heads, head_dim, block_size, contexts, splits, fp8, peaky, tile,
                                  id=f"g{i + 1}-d{head_dim}-b{block_size}-s{splits}{'-fp8' * fp8}{'-peaky' * peaky}"
                                     f"{'-tile' * tile}"))
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,kv_heads,head_dim,block_size,contexts,splits,fp8,peaky,tile_merge", decode_cases())
def test_decode_matches_reference(group, kv_heads, head_dim, block_size, contexts, splits, fp8, peaky, tile_merge,
                                  dtype, monkeypatch):
    """16-token splits; large logits where peaky (an unscaled merge overflows); both merges."""
    patch(monkeypatch, PER_THREAD_SPLITS=0 if tile_merge else 32)
    q, k, v, caches, meta, expected = decode_case(contexts, len(contexts) + group, group * kv_heads, kv_heads,
                                                  head_dim, block_size, fp8, dtype=dtype, q_gain=30.0 if peaky else 1.0)
    out = decode(q, caches, meta, head_dim ** -0.5, *scales_of(fp8), num_splits=splits, min_split_tokens=16)
    assert_close(out, expected, dtype)


def test_decode_splits_reach_the_last_key_of_every_context():
    """Contexts just past 4 splits x 32-key tiles, where floor(context / splits)-key chunks would miss the last keys."""
    q, k, v, caches, meta, expected = decode_case([129, 130, 159, 40], 12)
    assert triton_attention.decode_tile(64, 4)[0] == 32  # (the tile the contexts are chosen for)
    assert_close(decode(q, caches, meta, num_splits=4, min_split_tokens=16), expected)


@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_decode_in_one_wave_tiles(block_size):
    """`decode_tile`'s one_wave tile (128 keys) across blocks, ending inside a tile and on its edge."""
    contexts = [1, 127, 128, 129, 300, 2 * block_size + 5]
    q, k, v, caches, meta, expected = decode_case(contexts, 14, 4, 2, 128, block_size)
    tile, warps, stages = triton_attention.decode_tile(128, 2, False, block_size, 0, True)
    assert tile > triton_attention.decode_tile(128, 2)[0]
    out = decode(q, caches, meta, 128 ** -0.5, num_splits=1, kv_tile=tile, num_warps=warps, num_stages=stages)
    assert_close(out, expected)


def tiles_asked(monkeypatch, record, batches, block_size, kv_fp8, seed):
    """decode_tile's calls, `record`ed, on 1 SM for batches of (sequences of 40 keys over 2 KV heads, splits)."""
    asked = spy(monkeypatch, "decode_tile", record)
    patch(monkeypatch, _num_sms=lambda device: 1)
    for batch, splits in batches:
        q, k, v, caches, meta, _ = decode_case([40] * batch, seed, 4, 2, 64, block_size, kv_fp8)
        decode(q, caches, meta, num_splits=splits)
    return asked


def test_decode_takes_one_wave_tiles_while_the_gpu_holds_every_program(monkeypatch):
    """Exactly when the batch is unsplit, with at most ONE_WAVE_PROGRAMS_PER_SM programs an SM."""
    per_sm = triton_attention.ONE_WAVE_PROGRAMS_PER_SM
    batches = ((per_sm // 2, 1), (per_sm // 2 + 1, 1), (1, 2))
    assert tiles_asked(monkeypatch, lambda ret, *a: a[5], batches, 16, False, 15) == [True, False, False]


@pytest.mark.parametrize("kv_fp8,block_size", [(False, 128), (True, 128), (False, 48)])
def test_decode_carries_block_ids_across_tiles(kv_fp8, block_size):
    """Tiles in one block take their block ids a tile ahead (`ONE_BLOCK`); blocks of 48 (no whole tiles): their own."""
    contexts = [1, 64, 65, 128, 129, 383, 700, 6 * block_size]
    q, k, v, caches, meta, expected = decode_case(contexts, 16, 4, 2, 128, block_size, kv_fp8)
    itemsize, v_chunk = caches[0].element_size(), value_chunk(caches[1])
    tile, warps, stages = triton_attention.decode_tile(128, itemsize, False, block_size, v_chunk, False, 1e3)
    assert max(contexts) > 4 * tile and stages == 3 and (block_size % tile == 0) == (block_size == 128)
    # a split batch keeps one tile in flight: 2 stages where the ids are carried, 3 where keys read their own
    split_tile = triton_attention.decode_tile(128, itemsize, True, block_size, v_chunk)
    assert split_tile[2] == (2 if block_size % split_tile[0] == 0 else 3)
    assert not kv_fp8 or (v_chunk and tile == 64)
    out = decode(q, caches, meta, 128 ** -0.5, *scales_of(kv_fp8), num_splits=1, kv_tile=tile, num_warps=warps,
                 num_stages=stages)
    assert_close(out, expected)


def test_fp8_decode_takes_deep_tiles_from_its_programs_per_sm(monkeypatch):
    """FP8, unsplit: 64-key tiles, two in flight, from FP8_DEEP_PROGRAMS_PER_SM programs an SM; else 128 keys, one."""
    deep = triton_attention.FP8_DEEP_PROGRAMS_PER_SM
    asked = tiles_asked(monkeypatch, lambda ret, *a: ret, ((deep // 2, 1), (deep // 2 - 1, 1), (1, 2)), 128, True, 17)
    assert asked == [(64, 2, 3), (128, 4, 2), (64, 2, 2)]


def test_decode_keeps_one_tile_in_flight_where_contexts_are_bounded_to_two_tiles(monkeypatch):
    """Two tiles in flight (3 stages) in a deep unsplit batch, one (2) where max_context bounds it to two tiles."""
    for itemsize, v_chunk, tile, warps in ((2, 0, 64, 4), (1, 64, 64, 2)):
        for bound, stages in ((0, 3), (1, 2), (2 * tile, 2), (2 * tile + 1, 3), (4096, 3)):
            assert triton_attention.decode_tile(128, itemsize, False, 256, v_chunk, False, 31.0, bound) == \
                (tile, warps, stages)
    tile = triton_attention.decode_tile(64, 4)[0]  # float32 (the interpreter's): 32 keys
    asked = spy(monkeypatch, "decode_tile")
    patch(monkeypatch, _num_sms=lambda device: 1)  # 6 x 2 programs: unsplit, past one wave
    q, k, v, caches, meta, expected = decode_case([9, 64, 30, 1, 64, 50], 18, block_size=128)
    for bound in (2 * tile, 2 * tile + 1, 0):
        assert_close(decode(q, caches, meta, max_context=bound), expected)
    assert [stages for *_, stages in asked] == [2, 3, 3]


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_of_an_empty_context_writes_zeros(splits, monkeypatch):
    """Context 0: a graph's padding row; NaN-filled buffers show any read of an unwritten one."""
    class NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.empty(*args, **kwargs).fill_(float("nan"))
    patch(monkeypatch, torch=NaNTorch())
    q, k, v, caches, meta, expected = decode_case([37, 5, 90, 20], 13)
    meta.context_lens[3] = 0
    out = decode(q, caches, meta, num_splits=splits, min_split_tokens=16)
    assert_close(out[:3], expected[:3])
    assert (out[3] == 0).all()


def merged(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The splits [tokens, heads, splits, head_dim] weighted by exp2(lse) in float64 (all splits -inf: 0)."""
    weight = torch.exp2(lse.double() - lse.double().amax(-1, keepdim=True).clamp(min=0))
    return (weight[..., None] * partial.double()).sum(2) / weight.sum(-1).clamp(min=1e-300)[..., None]


@pytest.fixture
def merge_launches(monkeypatch) -> list[tuple[int, int, int]]:
    """(num_splits, min_split_tokens, SPLITS: 0 for the tile) of each launch of the merge kernel."""
    kernel, launches = triton_attention._merge_splits_kernel, []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((args[5], args[6], kw["SPLITS"])) or kernel[grid](*args, **kw)
    patch(monkeypatch, _merge_splits_kernel=Spy())
    return launches


@pytest.mark.parametrize("per_thread", [True, False])
def test_merge_weighs_splits_by_their_lse_without_overflow(per_thread, monkeypatch, merge_launches):
    """lse hundreds apart (exp2 overflows float32), empty (-inf) and all-empty (0) splits, both merges."""
    patch(monkeypatch, PER_THREAD_SPLITS=32 if per_thread else 0)
    gen = torch.Generator().manual_seed(5)
    partial = torch.randn(3, 2, 5, 64, generator=gen)
    lse = torch.tensor([[0.0, 300.0, -200.0, float("-inf"), -100.0], [5.0, float("-inf"), 4.0, 3.0, -400.0]])
    lse = torch.stack([lse, lse.flip(-1), torch.randn(2, 5, generator=gen)])
    lse[2, 0] = float("-inf")
    expected = merged(partial, lse)
    out = torch.empty(3, 2, 64, device=DEVICE)
    triton_attention.merge_splits(partial.to(DEVICE), lse.to(DEVICE), out)
    assert_close(out, expected)
    assert [ways for *_, ways in merge_launches] == [5 if per_thread else 0]


def check_merge_of_filled_splits(contexts, filled, num_splits, seed, empty):
    """merge_splits of 16-key splits, NaN past each context's `filled` ones (never to be read), -inf lse at `empty`."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(contexts)
    partial = torch.randn(rows, 2, num_splits, 64, generator=gen)
    lse = torch.randn(rows, 2, num_splits, generator=gen) * 4
    for row, n in enumerate(filled):
        partial[row, :, n:], lse[row, :, n:] = float("nan"), float("nan")
    lse[empty] = float("-inf")
    expected = merged(partial.nan_to_num(), lse.nan_to_num(nan=float("-inf")))  # the unwritten splits left out
    out = torch.empty(rows, 2, 64, device=DEVICE)
    written = (torch.tensor(contexts, dtype=torch.int32, device=DEVICE), 16, 16)
    triton_attention.merge_splits(partial.to(DEVICE), lse.to(DEVICE), out, written)
    assert_close(out, expected)


@pytest.mark.parametrize("per_thread", [True, False])
def test_merge_reads_only_the_splits_that_the_context_fills(per_thread, monkeypatch):
    """Both merges; a context of 0 has one empty split."""
    patch(monkeypatch, PER_THREAD_SPLITS=32 if per_thread else 0)
    check_merge_of_filled_splits([1, 40, 128, 300, 0], [1, 3, 8, 7, 1], 8, 6, empty=(4,))


def test_merge_takes_a_tile_of_any_number_of_splits():
    """40 splits (batch 1, 13 KV heads, an H200): a tile padded to a power of two."""
    assert 40 > triton_attention.PER_THREAD_SPLITS
    check_merge_of_filled_splits([600, 17, 640], [38, 2, 40], 40, 9, empty=(0, 1, 5))


def test_decode_default_split_size():
    q, k, v, caches, meta, expected = decode_case([700, 1, 257], 3, 4, 1, 64, 64)
    assert_close(decode(q, caches, meta), expected)


def test_decode_splits_are_shorter_where_the_merge_takes_a_tile(merge_launches):
    """To MIN_SPLIT_TOKENS_TILE_MERGE (64 splits)."""
    for contexts, kv_heads in (([300], 1), ([300, 1, 70, 129, 64, 200, 2, 90], 4)):
        q, k, v, caches, meta, expected = decode_case(contexts, len(contexts), 2 * kv_heads, kv_heads)
        assert_close(decode(q, caches, meta), expected)
    assert merge_launches == [(64, triton_attention.MIN_SPLIT_TOKENS_TILE_MERGE, 0),
                              (16, triton_attention.MIN_SPLIT_TOKENS, 16)]
    assert triton_attention.MIN_SPLIT_TOKENS_TILE_MERGE < triton_attention.MIN_SPLIT_TOKENS  # (else nothing shown)


def test_decode_merges_one_dim_a_thread_up_to_per_thread_splits(merge_launches):
    """A tile past them."""
    q, k, v, caches, meta, expected = decode_case([300, 7], 14, 2, 1)
    per_thread = triton_attention.PER_THREAD_SPLITS
    for splits in (per_thread, per_thread + 1):
        assert_close(decode(q, caches, meta, num_splits=splits), expected)
    assert merge_launches == [(per_thread, triton_attention.MIN_SPLIT_TOKENS, per_thread),
                              (per_thread + 1, triton_attention.MIN_SPLIT_TOKENS_TILE_MERGE, 0)]


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_in_any_order_writes_each_row_its_own(splits):
    """`order` (a graph's, longest first) only reorders the programs: bit for bit as in batch order."""
    q, k, v, caches, meta, expected = decode_case([9, 70, 33, 1, 50], 21)
    order = torch.tensor([1, 4, 2, 0, 3], dtype=torch.int32, device=DEVICE)
    in_order = decode(q, caches, meta, num_splits=splits, min_split_tokens=16)
    out = decode(q, caches, meta, num_splits=splits, min_split_tokens=16, order=order)
    assert torch.equal(out, in_order)
    assert_close(out, expected)


VARLEN_ARGS = "name,num_heads,num_kv_heads,head_dim,block_size,kv_fp8"
VARLEN_CASES = [
    ("prefill", 4, 2, 64, 16, False),
    ("prefix", 4, 1, 64, 48, True),
    ("mixed", 6, 2, 80, 32, False),
    ("mixed", 3, 3, 64, 256, True),
    ("decode", 16, 2, 64, 16, False),
    ("prefill", 2, 1, 256, 64, True),  # tiles of 32 keys over chunked values: every second one starts mid-chunk
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(VARLEN_ARGS, VARLEN_CASES)
def test_varlen_matches_reference(name, num_heads, num_kv_heads, head_dim, block_size, kv_fp8, dtype):
    q, k, v, caches, meta, expected = device_case(*CASES[name], num_heads, num_heads, num_kv_heads, head_dim,
                                                  block_size, kv_fp8, dtype=dtype)
    out = triton_attention.varlen_attention(q, k, v, *caches, meta, head_dim ** -0.5, *scales_of(kv_fp8))
    assert_close(out, expected, dtype)


def with_tile_map(meta, query_lens, contexts, group, splits, pad_tokens=0, pad_seqs=0, **changes):
    """`meta` as a CUDA graph replays it: a tile map with `splits` splits a decode, max_seqlen_q of another step."""
    query_tile = triton_attention.varlen_query_tile(group)
    rows = triton_attention.max_varlen_tiles(sum(query_lens) + pad_tokens, len(query_lens) + pad_seqs, query_tile,
                                             splits)
    tile_map = triton_attention.varlen_tile_map(np.array(query_lens), query_tile, rows, splits, np.array(contexts))
    return dataclasses.replace(meta, max_seqlen_q=0, tile_map=torch.from_numpy(tile_map).to(DEVICE),
                               tile_map_splits=splits, **changes)


@pytest.mark.parametrize("splits,split_seqs", [(1, 16), (3, 16), (3, 2)])
@pytest.mark.parametrize(VARLEN_ARGS, VARLEN_CASES[:3] + VARLEN_CASES[4:])
def test_varlen_through_a_tile_map_matches_reference(name, num_heads, num_kv_heads, head_dim, block_size, kv_fp8,
                                                     splits, split_seqs, merge_launches, monkeypatch):
    """As a CUDA graph replays it (`varlen_graphs.py`): split decodes, padding rows left unwritten."""
    patch(monkeypatch, VARLEN_SPLIT_SEQS=split_seqs)
    dtype = DTYPES[-1]
    query_lens, contexts = CASES[name]
    q, k, v, caches, meta, expected = device_case(query_lens, contexts, num_heads + 1, num_heads, num_kv_heads,
                                                  head_dim, block_size, kv_fp8, dtype=dtype)
    n = q.size(0)
    q = torch.cat([q, torch.randn(5, *q.shape[1:], dtype=dtype, device=DEVICE)])  # padding tokens
    meta = with_tile_map(meta, query_lens, contexts, num_heads // num_kv_heads, splits, 5, 2,
                         cu_seqlens_q=torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(2)]),  # padding
                         block_tables=torch.cat([meta.block_tables, meta.block_tables[:2]]),  # sequences
                         context_lens=torch.cat([meta.context_lens, meta.context_lens[:2]]))
    out = torch.full_like(q, 7.0)
    triton_attention.varlen_attention(q, k, v, *caches, meta, head_dim ** -0.5, *scales_of(kv_fp8), out=out)
    assert_close(out[:n], expected, dtype)
    assert (out[n:] == 7.0).all()
    assert merge_launches == ([(splits, triton_attention.MIN_SPLIT_TOKENS, splits)] if splits > 1 else [])


@pytest.mark.parametrize("variant", [(32, 32, 4, 3), (128, 16, 8, 2)])
def test_varlen_tiles_of_other_sizes_match_reference(variant, merge_launches, monkeypatch):
    """NANOVLLM_VARLEN_TILE's other tiles through a tile map with split decodes."""
    patch(monkeypatch, **dict(zip(("QUERY_ROWS", "VARLEN_KV_TILE", "VARLEN_WARPS", "VARLEN_STAGES"), variant)))
    query_lens, contexts = [1, 70, 1], [560, 70, 1000]
    q, k, v, caches, meta, expected = device_case(query_lens, contexts, 3, dtype=DTYPES[-1])
    out = triton_attention.varlen_attention(q, k, v, *caches, with_tile_map(meta, query_lens, contexts, 2, 4),
                                            64 ** -0.5)
    assert_close(out, expected, DTYPES[-1])
    assert merge_launches == [(4, triton_attention.MIN_SPLIT_TOKENS, 4)]


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("split_from", [3, 4, 5])
def test_mixed_step_gives_its_leading_decodes_to_the_decode_kernel(split_from, kv_fp8, monkeypatch):
    """SPLIT_DECODES of them or more; the rest to varlen; fewer: varlen takes all."""
    query_lens, contexts = [1, 1, 1, 1, 13, 30, 1], [5, 40, 17, 64, 13, 70, 9]  # 4 leading decodes
    q, k, v, caches, meta, expected = device_case(query_lens, contexts, 5, kv_fp8=kv_fp8)
    meta = dataclasses.replace(meta, num_decodes=4)
    patch(monkeypatch, SPLIT_DECODES=split_from, _num_sms=lambda device: 8)  # 4 splits, not 64 (the interpreter)
    calls = []
    for name in ("decode_attention", "varlen_attention"):
        spy(monkeypatch, name, lambda ret, *a, _n=name, **kw:
            (_n, a[0].size(0), a[-1 if _n == "decode_attention" else 5]), calls)
    backend = object.__new__(triton_attention.TritonBackend)  # its __init__ insists on CUDA
    out = backend.forward(q, k, v, *caches, meta, q.size(-1) ** -0.5, *scales_of(kv_fp8))
    assert_close(out, expected)
    kernels = [(name, rows) for name, rows, _ in calls]
    if split_from <= 4:
        assert kernels == [("decode_attention", 4), ("varlen_attention", 48)]
        assert calls[1][2].cu_seqlens_q.tolist() == [4, 17, 47, 48]  # the prompts' rows of q, and the last decode
    else:
        assert kernels == [("varlen_attention", 48)]


def test_split_decodes_needs_one_prompt_beside_the_decodes(monkeypatch):
    patch(monkeypatch, SPLIT_DECODES=3)
    q, k, v, caches, meta, expected = device_case([1, 1, 1, 13], [5, 40, 17, 30], 6)
    meta = dataclasses.replace(meta, num_decodes=3)
    out, rest = triton_attention.split_decodes(q, *caches, meta, 0.125)
    assert out is not None and rest.cu_seqlens_q.tolist() == [3, 16] and rest.context_lens.tolist() == [30]
    assert_close(triton_attention.varlen_attention(q, k, v, *caches, rest, 0.125, out=out), expected)
    decodes = dataclasses.replace(meta, cu_seqlens_q=meta.cu_seqlens_q[:4], context_lens=meta.context_lens[:3],
                                  block_tables=meta.block_tables[:3], max_seqlen_q=1)
    out, rest = triton_attention.split_decodes(q[:3], *caches, decodes, 0.125)
    assert out is None and rest is decodes


def assert_same_meta(got, want):
    for f in filter(lambda f: f.compare, dataclasses.fields(want)):  # not the derived parts' cache
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, f.name


def test_split_decodes_builds_a_steps_parts_once(monkeypatch):
    """By its first layer, reused by the others; new or `replace`d metadata gets its own."""
    decode_args = []
    patch(monkeypatch, SPLIT_DECODES=1, decode_attention=lambda q, kc, vc, tables, lens, *a, **kw:
          decode_args.append((tables, lens)))
    cache = torch.zeros(8, 16, 2, 64, device=DEVICE)
    for query_lens, contexts, n in [([1, 1, 1, 13], [5, 40, 17, 30], 3), ([1, 1, 9, 4], [33, 8, 20, 4], 2)]:
        meta = dataclasses.replace(make_case(query_lens, contexts, seed=n)[4], num_decodes=n)
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
        rest = triton_attention.split_decodes(q, cache, cache, dataclasses.replace(meta, num_decodes=n - 1), 0.125)[1]
        assert rest.cu_seqlens_q.tolist() == meta.cu_seqlens_q[n - 1:].tolist()


def test_split_metadata_without_host_lists():
    """The kernels never read them: it splits the same; its rest has none."""
    meta = make_case([1, 1, 9, 4], [33, 8, 20, 4], seed=8)[4]
    meta = dataclasses.replace(meta, num_decodes=2, query_lens_host=None, context_lens_host=None)
    tables, lens, rest = meta.decodes_and_rest()
    assert torch.equal(tables, meta.block_tables[:2]) and lens.tolist() == [33, 8]
    assert rest.cu_seqlens_q.tolist() == [2, 11, 15] and rest.context_lens.tolist() == [20, 4]
    assert rest.query_lens_host is None and rest.context_lens_host is None


def test_layers_share_the_kernel_arguments():
    q, k, v, caches, meta, _ = device_case([1, 6], [5, 6], 7)
    triton_attention._common_args.cache_clear()
    for _ in range(3):  # 3 layers
        triton_attention.paged_attention(q, k, v, *caches, meta, 0.125)
    assert triton_attention._common_args.cache_info().misses == 1
    triton_attention.paged_attention(q, k, v, *caches, meta, 0.125, K_SCALE, V_SCALE)
    assert triton_attention._common_args.cache_info().misses == 2


def no_cache_case(query_lens, seed, **changes):
    """A step before the cache exists (a warm-up), each sequence over its own keys: q, k, v, meta, expected, empty."""
    q, k, v, _, meta = make_case(query_lens, query_lens, seed=seed)
    meta = dataclasses.replace(meta, block_tables=meta.block_tables[:, :0], **changes)
    return q, k, v, meta, reference(q, k, v, None, meta, False, paged=False), torch.empty(0, device=DEVICE)


@pytest.mark.parametrize("k_layout", ["slice", "contiguous"])
def test_varlen_without_cache_reads_this_steps_keys(k_layout):
    """A warm-up's: strided slices, or a contiguous k (Qwen3's)."""
    q, k, v, meta, expected, empty = no_cache_case([1, 17, 40, 5], 5)
    fused = torch.cat([k.flatten(1), v.flatten(1)], dim=1).to(DEVICE)
    k, v = fused[:, :k[0].numel()].view(k.shape), fused[:, k[0].numel():].view(v.shape)
    if k_layout == "contiguous":
        k = k.contiguous()
    assert not v.is_contiguous()
    assert_close(triton_attention.varlen_attention(q.to(DEVICE), k, v, empty, empty, meta, 0.125), expected)


def test_step_without_cache_keeps_its_leading_decodes_on_the_varlen_path(monkeypatch):
    """(The decode kernel reads only the cache.)"""
    patch(monkeypatch, SPLIT_DECODES=3)
    q, k, v, meta, expected, empty = no_cache_case([1, 1, 1, 13], 15, num_decodes=3)
    out = triton_attention.paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), empty, empty, meta, 0.125)
    assert_close(out, expected)


def assert_stored_as(got: torch.Tensor, want: torch.Tensor):
    """Bit for bit; FP8 under Triton 3.9's interpreter rounds towards zero, carries wrongly (31.6 -> 16)."""
    want = want.to(got.device)
    if got.device.type == "cuda" or got.dtype != FP8_DTYPE:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        got, want = got.float().abs(), want.float().abs()
        assert torch.all((got <= want) & (got >= want / 2 - 2 ** -9))
        assert (got == want).float().mean() > 0.95  # 99.6% when written


@pytest.mark.parametrize("kv_fp8, block_size", [(False, 16), (True, 16), (True, VALUE_CHUNK * 2)])
def test_triton_store_matches_torch(kv_fp8, block_size):
    """FP8 values laid out as the keys, or in chunks where blocks hold whole chunks; saturating, padding slots."""
    from nanovllm.layers.triton_kvstore import store_kvcache
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, num_blocks = 21, 3, 80, 5
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, generator=gen) * 4
    k = qkv.view(num_tokens, 4, num_kv_heads, head_dim)[:, 0]  # slices of a qkv projection, v's heads 4 apart
    v = qkv.view(num_tokens, num_kv_heads, 4, head_dim)[:, :, 3]
    qkv[:3, -1] = torch.tensor([1e4, -1e4, 30.0])  # beyond FP8's range once divided by the scale: saturates
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding: writes nothing
    cache_dtype = FP8_DTYPE if kv_fp8 else torch.float32
    expected = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    TorchBackend().store_kvcache(k, v, *expected, slots, *scales_of(kv_fp8))
    caches = [torch.zeros_like(c, device=DEVICE) for c in expected]
    store_kvcache(k.to(DEVICE), v.to(DEVICE), *caches, slots.to(DEVICE), *scales_of(kv_fp8))
    for got, want in zip(caches, expected):
        assert_stored_as(got, want)


def h200_splits(batch, heads=8, *args, **kw):
    return triton_attention.decode_splits(batch, heads, SMS, *args, **kw)


def test_decode_splits_fill_the_gpu():
    assert h200_splits(256) == 1  # 2048 programs: plenty
    assert h200_splits(1) == triton_attention.MAX_SPLITS
    for batch in (1, 2, 8, 16, 32):
        n = h200_splits(batch)
        assert SMS <= batch * 8 * n <= 4 * SMS and n <= triton_attention.MAX_SPLITS


def test_decode_splits_of_short_contexts():
    """At most the power of two >= max_context / MIN_SPLIT_TOKENS splits, up to SHORT_CONTEXT_SPLITS."""
    assert (triton_attention.MIN_SPLIT_TOKENS, triton_attention.SHORT_CONTEXT_SPLITS) == (128, 16)
    assert h200_splits(8) == 8
    assert [h200_splits(8, max_context=c) for c in (1, 128, 129, 256, 300, 512, 513, 1024, 4096, 0)] == \
        [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]
    assert h200_splits(1) == 64
    assert [h200_splits(1, max_context=c) for c in (2048, 2049, 8192)] == [16, 64, 64]
    assert h200_splits(16, 8, 1, max_context=300) == 4 < h200_splits(16, 8, 1) == 6  # (FP8: 6 splits)
    assert h200_splits(256, max_context=100) == 1


def test_decode_context_bounds_are_where_the_splits_fall():
    """A graph's bounds: MIN_SPLIT_TOKENS x powers of two below the batch's splits."""
    def bounds(batch, *args):
        return triton_attention.decode_context_bounds(batch, 8, SMS, *args)
    assert bounds(1) == [128, 256, 512, 1024, 2048]
    assert bounds(8) == [128, 256, 512]
    assert bounds(24) == [128] and bounds(32, 1) == [128, 256]  # (2 splits; FP8 at 32: 3)
    assert bounds(32) == bounds(256) == []
    for batch in (1, 2, 4, 8, 16, 32):
        counts = [h200_splits(batch, max_context=b) for b in (*bounds(batch), 1 << 20)]
        assert counts == sorted(set(counts)) and counts[-1] == h200_splits(batch)


def test_decode_of_short_contexts_needs_no_merge(merge_launches):
    """max_context 128: unsplit, no merge; 300: 4 splits; none: the batch's own."""
    q, k, v, caches, meta, expected = decode_case([100, 37, 128], 15)
    for max_context in (128, 300, 0):
        assert_close(decode(q, caches, meta, max_context=max_context), expected)
    sms = triton_attention._num_sms(DEVICE)
    assert [n for n, *_ in merge_launches] == [4, triton_attention.decode_splits(3, 2, sms)]


def test_steps_tell_the_decode_kernel_their_longest_context(monkeypatch):
    seen = []
    patch(monkeypatch, SPLIT_DECODES=2, decode_attention=lambda q, *a, **kw: seen.append(kw["max_context"]) or
          torch.zeros_like(q))
    cache = torch.zeros(8, 16, 2, 64, device=DEVICE)
    q, k, v, _, meta = make_case([1, 1], [40, 17], seed=16)
    triton_attention.paged_attention(q, k, v, cache, cache, meta, 0.125)
    q, k, v, _, meta = make_case([1, 1, 9], [5, 40, 30], seed=17)
    triton_attention.split_decodes(q, cache, cache, dataclasses.replace(meta, num_decodes=2, max_seqlen_k=77), 0.125)
    assert seen == [40, 77]


@pytest.mark.parametrize("itemsize", [2, 1])
def test_decode_splits_only_below_their_programs_per_sm(itemsize):
    """SPLIT_BELOW_PROGRAMS_PER_SM programs an SM, rounded up, fill the GPU; one program fewer splits, in 2 at least."""
    full = math.ceil(triton_attention.SPLIT_BELOW_PROGRAMS_PER_SM[itemsize] * SMS)
    assert h200_splits(-(-full // 4), 4, itemsize) == h200_splits(full, 1, itemsize) == 1
    assert h200_splits(full - 1, 1, itemsize) >= 2
    if itemsize == 2:
        assert h200_splits(32) == 1 < h200_splits(29)


def test_fp8_decode_splits_fill_an_sm_of_its_programs():
    """Over FP8 a split batch aims at 6 programs an SM, over bf16 or float32 at 4."""
    batches = ((48, 1), (48, 2), (48, 4), (24, 1), (32, 1), (32, 2), (32, 4))  # (batch, itemsize)
    assert [h200_splits(batch, 8, itemsize) for batch, itemsize in batches] == [2, 1, 1, 4, 3, 1, 1]
    for batch in (2, 8, 16, 24, 32, 40):
        n = h200_splits(batch, 8, 1)
        assert 4 * SMS < batch * 8 * n <= 6 * SMS and n <= triton_attention.MAX_SPLITS


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_decode_splits_by_the_caches_bytes(kv_fp8, monkeypatch, merge_launches):
    """8 programs on 4 SMs fill them over float32, split in 3 over FP8."""
    patch(monkeypatch, _num_sms=lambda device: 4)
    q, k, v, caches, meta, expected = decode_case([300, 1, 70, 129, 64, 200, 2, 90], 30, 2, 1, kv_fp8=kv_fp8)
    assert_close(decode(q, caches, meta, 0.125, *scales_of(kv_fp8)), expected)
    assert merge_launches == ([(3, triton_attention.MIN_SPLIT_TOKENS, 3)] if kv_fp8 else [])


@pytest.mark.parametrize("split_decodes", [0, 1])
def test_engine_on_triton_kernels_matches_hf(tiny_model, hf_model, monkeypatch, split_decodes):
    """Swapped onto it: prefill chunks, mixed steps, prefix hits, split decodes."""
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA the engine picks its backend itself (tests/test_kv_cache_dtype.py)")
    # small: the interpreter copies every tensor argument (the caches too) to the host and back each launch
    llm = LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=32, num_kvcache_blocks=24)
    backend = object.__new__(triton_attention.TritonBackend)  # its __init__ insists on CUDA
    llm.model_runner.backend = backend
    for layer in llm.model_runner.attn_layers:
        layer.backend = backend
    # 4 "SMs": a batch of 1-3 sequences x 2 KV heads splits its keys in 8, 4 or 2
    patch(monkeypatch, _num_sms=lambda device: 4, SPLIT_DECODES=split_decodes)
    splits = spy(monkeypatch, "split_decodes", lambda ret, *a: ret[0] is not None)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 20, 40, 17)]
    prompts.append(prompts[2][:32] + [9])  # a prefix hit on two full blocks once prompts[2] is cached
    params = [greedy(n) for n in (3, 12, 4, 8, 6)]
    llm.generate(prompts[2:3], params[2], use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[-1]["num_cached_tokens"] == 32
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])
    assert splits and any(splits) == (split_decodes == 1)  # mixed steps with decodes ran, split or not


def attention_case(cache: str, decode: bool, paged: bool = True, split: bool = False, tile_map: bool = False,
                   programs_per_sm: float = 0.0) -> tuple:
    """`_attention_kernel` as the wrappers launch it for Qwen3-0.6B in bf16 (16/8 heads of 128, blocks of 256)."""
    tl, fp8 = triton_attention.tl, cache == "fp8e4nv"
    acc = "*fp32" if split else "*bf16"  # unsplit, the output stands in for the unused partial and lse
    signature = dict(q_ptr="*bf16", k_ptr=f"*{cache}", v_ptr=f"*{cache}", out_ptr="*bf16", partial_ptr=acc,
                     lse_ptr=acc, block_tables_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_q_ptr="*i32",
                     tile_map_ptr="*i32", order_ptr="*i32", q_token_stride="i32", q_head_stride="i32",
                     kv_token_stride="i32", kv_head_stride="i32", block_table_stride="i32", qk_scale="fp32",
                     v_scale="fp32", min_split_tokens="i32")
    constexprs = dict(NUM_KV_HEADS=8, GROUP=2, GROUP_PAD=2, HEAD_DIM=128, DIM_PAD=128, DECODE=decode, PAGED=paged,
                      SPLIT=split, TILE_MAP=tile_map, SPLIT_SEQS=0 if decode else triton_attention.VARLEN_SPLIT_SEQS,
                      COMPUTE_DTYPE=tl.float16 if fp8 else tl.bfloat16,
                      DOT_PRECISION="tf32", PDL=decode or tile_map, ORDER=decode, PREFETCH=0, LINES=1,
                      LINE_ELEMENTS=1, V_CHUNK=VALUE_CHUNK if fp8 and paged else 0)  # as on an H200
    if split:
        signature["num_splits"] = "i32"
    else:
        constexprs["num_splits"] = 1  # Triton makes an int argument of 1 a constexpr
    if decode:
        tile, warps, stages = triton_attention.decode_tile(128, 1 if fp8 else 2, split, 256, constexprs["V_CHUNK"],
                                                           False, programs_per_sm)
        line = 128 if fp8 else 64
        constexprs.update(QUERY_TILE=1, ROWS=16, KV_TILE=tile, BLOCK_SIZE=256, LINES=128 // line, LINE_ELEMENTS=line,
                          PREFETCH=triton_attention.KV_PREFETCH_TILES if split else 0)
    else:  # 64 rows of 32 tokens x 2 heads; a warm-up run (not paged) reads its own keys with a block size of 16
        warps, stages = triton_attention.VARLEN_WARPS, triton_attention.VARLEN_STAGES
        constexprs.update(QUERY_TILE=32, ROWS=64, KV_TILE=64, BLOCK_SIZE=256 if paged else 16)
    return ("nanovllm.layers.triton_attention", "_attention_kernel", signature, constexprs,
            dict(num_warps=warps, num_stages=stages))


def test_kernels_compile_for_sm90():
    """Attention, merges and KV store."""
    deep = triton_attention.FP8_DEEP_PROGRAMS_PER_SM
    cases = [attention_case("bf16", decode=True, split=True), attention_case("bf16", decode=True),
             attention_case("fp8e4nv", decode=True), attention_case("fp8e4nv", decode=True, programs_per_sm=deep),
             attention_case("fp8e4nv", decode=True, split=True),
             attention_case("fp8e4nv", decode=False), attention_case("bf16", decode=False, paged=False),
             attention_case("bf16", decode=False, tile_map=True),
             attention_case("bf16", decode=False, tile_map=True, split=True)]
    merge = dict(partial_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", context_lens_ptr="*i32",
                 cu_seqlens_q_ptr="*fp32", num_splits="i32", min_split_tokens="i32")  # (lse for the unused one)
    for signature, splits_pad, splits, varlen, options in [  # batch 1's; batch 8's, one dim a thread; a graph's
            (merge, h200_splits(1), 0, False, ()),
            (merge, 16, 8, False, (dict(num_warps=4),)),
            ({**merge, "cu_seqlens_q_ptr": "*i32"}, 16, triton_attention.VARLEN_DECODE_SPLITS, True,
             (dict(num_warps=4),))]:
        cases.append(("nanovllm.layers.triton_attention", "_merge_splits_kernel", signature,
                      dict(HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=splits_pad, SPLITS=splits, KV_TILE=64, VARLEN=varlen,
                           PDL=True), *options))
    for cache in ("bf16", "fp8e4nv"):  # k and v are slices of the qkv projection's [tokens, (16 + 2 * 8) * 128]
        cases.append(("nanovllm.layers.triton_kvstore", "_store_kvcache_kernel", dict(
            k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", slot_mapping_ptr="*i64",
            k_token_stride="i32", k_head_stride="i32", v_token_stride="i32", v_head_stride="i32", k_scale="fp32",
            v_scale="fp32"), dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_BLOCK=8, DIM_BLOCK=128, BLOCK_SIZE=256,
                                  V_CHUNK=VALUE_CHUNK if cache == "fp8e4nv" else 0, QUANTIZE=cache == "fp8e4nv")))
    compile_for_sm90(cases)


def engine_on_triton_matches_hf(tmp_path, monkeypatch, record, prepare=lambda llm, calls: None, **llm_kw):
    """The engine built on the Triton backend, 4 "SMs": tokens as HF's; the decode calls `record`ed."""
    from nanovllm.engine import model_runner
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    from tests.test_models import hf_model
    monkeypatch.setattr(model_runner.ModelRunner, "_backend_name", lambda self: "triton")
    patch(monkeypatch, triton_available=lambda: True, _num_sms=lambda device: 4)
    calls = spy(monkeypatch, "decode_attention", record)
    path = make_random_checkpoint(tmp_path / "tiny", "tiny")
    prompts = [[5, 9, 200, 31], [7] * 40, list(range(3, 60))]
    with LLM(str(path), kvcache_block_size=16, max_num_batched_tokens=64, num_kvcache_blocks=24, **llm_kw) as llm:
        prepare(llm, calls)
        outputs = llm.generate(prompts, greedy(5), use_tqdm=False)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])
    return calls


@CPU_ONLY
def test_engine_built_on_the_triton_backend_matches_hf(tmp_path, monkeypatch):
    """Built on it (store fused with q/k norms and rope); the interpreter aborts on out-of-bounds access."""
    def fused_store(llm, calls):
        assert all(layer.fused_store for layer in llm.model_runner.attn_layers)
    assert engine_on_triton_matches_hf(tmp_path, monkeypatch, lambda ret, *a, **kw: 1, fused_store)


@CPU_ONLY
def test_decode_graphs_on_the_triton_backend_send_their_order_and_match_hf(tmp_path, monkeypatch):
    from nanovllm.engine.staging import Staging
    from tests.test_step_inputs import EagerGraphs

    def eager_graphs(llm, orders):
        runner, config = llm.model_runner, llm.config
        runner.staging = Staging(runner.device, pack=True)
        runner.graphs = EagerGraphs(runner.model, config.max_num_seqs, config.max_model_len, runner.block_size,
                                    runner.device)
        orders.clear()  # (the graphs' warm-up and capture)
    orders = engine_on_triton_matches_hf(tmp_path, monkeypatch, lambda ret, *a, **kw: None if kw.get("order") is None
                                         else kw["order"].tolist(), eager_graphs, max_num_seqs=4)
    assert [2, 1, 0, 3] in orders  # the three contexts longest first, then the padding row
