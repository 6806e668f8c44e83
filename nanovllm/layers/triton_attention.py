"""Paged attention in Triton: a split-KV decode kernel, the varlen (prefill and mixed) path, and their backend.

Contract: `nanovllm.layers.attention`'s, the caches contiguous; block tables are int32 rows padded with anything
(only entries below `ceil(context_len / block_size)` are read); any block size that is a multiple of 16, any
head_dim up to 256, any number of query heads per KV head.

One kernel serves every step. A program takes one KV head of one sequence and the query heads that share it
(GQA packing: each KV byte is read once per sequence, and the query rows are padded to 16 for `tl.dot`), a tile
of that sequence's queries (one token in decode), and a chunk of its keys; it walks the keys `kv_tile` at a
time with an online softmax in float32 (exp2, the scale folded into one multiplier). The products run in the
model's dtype, in float16 over an FP8 cache (every e4m3 value is exact in float16, and converting to it is one
instruction on sm89+ where bf16 takes several), in float32 (IEEE) for a float32 model.

Decode splits the keys when `batch x num_kv_heads` programs would leave streaming multiprocessors idle: the
split count comes from the batch size and a bound on its contexts that the host gives (`max_context`: fewer
splits where contexts are short; the decode graphs capture one graph per bound), each split's chunk from the
sequence's context length on the device (`max(min_split_tokens, ceil(context / splits))`, whole tiles), so a
short context uses fewer splits and a longer one after capture still reads every key. Splits write their
normalised output and log-sum-exp in float32; a second kernel merges them. A split past the context ends before
its dependent-launch wait and writes nothing (the merge counts the filled splits from the context too); the
others ask L2 for their first keys before it (`KV_PREFETCH_TILES`). No host value changes per step.

The varlen path is the same kernel with tiles of queries; in a CUDA graph (a tile map), a decode among them also
has programs of splits of its keys, merged by the second kernel. Before the cache exists (a warm-up run) it reads
this step's own keys and values instead of the cache. A mixed step that leads with many decodes
(`split_decodes`) gives them to the decode kernel, which reads their keys at copy bandwidth where the varlen
path, built for tiles of queries, does not; its prompts take the varlen path.
"""
import functools
import os

import numpy as np
import torch

from nanovllm.layers import triton_kvstore
from nanovllm.layers.attention import FP8_DTYPE, AttentionBackend, AttentionMetadata, value_chunk

from nanovllm.layers.triton_guard import TRITON_ERROR as _TRITON_ERROR, num_sms as _num_sms, pdl_args, require_triton
from nanovllm.layers.triton_guard import tl, triton, triton_available

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
# The choices below were measured on an H200 (figures: `git show 06056d3:nanovllm/layers/triton_attention.py` and
# benchmarks/decode_attention_notes.md). Split decode when batch x kv_heads programs are fewer than this many an
# SM, by the cache's bytes an element (FP8's SM holds 6 programs where bf16's holds 4; bf16's 32 sequences of 8 KV
# heads ran faster unsplit, 24 split)
SPLIT_BELOW_PROGRAMS_PER_SM = {2: 1.8, 1: 3}
# and then make about this many, 2 splits at least (more loses to the tail); over FP8 6, an SM's worth of its
# programs (steps of 8-32 sequences faster, 4 slower; bf16's lost with 6)
SPLIT_TARGET_PROGRAMS_PER_SM = {2: 4, 1: 6}
MAX_SPLITS = 64
# an unsplit batch of at most this many programs an SM (the 64-key bf16 kernel's occupancy) takes 128-key tiles: its
# longest program sets its time (decode notes, run 12)
ONE_WAVE_PROGRAMS_PER_SM = 4
# an unsplit batch over FP8 of at least this many programs an SM takes 64-key tiles on 2 warps, two in flight
# (decode notes, run 13)
FP8_DEEP_PROGRAMS_PER_SM = 10
MIN_SPLIT_TOKENS = 128  # a split shorter than this costs more in its start than it saves
# where the host bounds a batch's contexts (`decode_splits`' max_context), no more splits than the power of two >=
# bound / MIN_SPLIT_TOKENS, when that is at most this many: no program of an empty split starts, and contexts of up
# to MIN_SPLIT_TOKENS need no merge (past 16 it lost: decode notes, run 17). NANOVLLM_SHORT_CONTEXT_SPLITS=0
# turns it off, for comparison
SHORT_CONTEXT_SPLITS = int(os.environ.get("NANOVLLM_SHORT_CONTEXT_SPLITS", 16))
# and this one where the merge takes the splits as a tile across its threads (more than PER_THREAD_SPLITS of them:
# batch 1-2 on an H200), which weighs 16 filled splits as fast as 8. NANOVLLM_MIN_SPLIT_TILE overrides it
MIN_SPLIT_TOKENS_TILE_MERGE = int(os.environ.get("NANOVLLM_MIN_SPLIT_TILE", 64))
# the merge of at most this many splits keeps each dim in one thread (`_merge_splits_kernel`): faster at 2-8 splits
# than a tile across the threads, about even at 64
PER_THREAD_SPLITS = 32
# split decode: tiles of keys (and values) a program asks L2 for before its dependent-launch wait, while the
# previous kernel ends (CUDA only): 2 helped small batches, 8 were slower than none, and unsplit steps keep their
# bandwidth for the previous kernel. NANOVLLM_KV_PREFETCH overrides it
KV_PREFETCH_TILES = int(os.environ.get("NANOVLLM_KV_PREFETCH", 2))
# varlen: query rows (tokens x heads of one KV head) a program, keys an iteration (halved past head_dim 128), warps and
# pipeline stages (3: two tiles in flight, as the carried block id allows), the fastest in sweeps
# (benchmarks/HISTORY.md). NANOVLLM_VARLEN_TILE="rows,keys,warps,stages" overrides them, for comparison
QUERY_ROWS, VARLEN_KV_TILE, VARLEN_WARPS, VARLEN_STAGES = map(int, os.environ.get("NANOVLLM_VARLEN_TILE",
                                                                                   "64,64,4,3").split(","))
# a varlen step of up to VARLEN_SPLIT_TOKENS tokens in a CUDA graph (`varlen_graphs.py`) splits the keys of each
# decode among its first VARLEN_SPLIT_SEQS sequences into this many chunks (of MIN_SPLIT_TOKENS at least), merged
# by a second kernel: unsplit, a decode of ~600 keys is one program's chain of ten tiles, the longest of the step.
# The grid has room for every split of every sequence that may take them, and a program of an empty row still
# costs its start. 2,048 covers every graph (piecewise_graphs.MAX_TOKENS): split in all graphs, not only up to
# 384 tokens, mixed steps' device work matched prefill-first's.
# NANOVLLM_VARLEN_SPLITS and NANOVLLM_VARLEN_SPLIT_TOKENS override them (splits 1: unsplit)
VARLEN_DECODE_SPLITS = int(os.environ.get("NANOVLLM_VARLEN_SPLITS", 4))
VARLEN_SPLIT_SEQS = 16
VARLEN_SPLIT_TOKENS = int(os.environ.get("NANOVLLM_VARLEN_SPLIT_TOKENS", 2048))
# a mixed step with at least this many leading decodes attends them with the decode kernel (0: never);
# NANOVLLM_SPLIT_DECODES overrides it, for comparison
SPLIT_DECODES = int(os.environ.get("NANOVLLM_SPLIT_DECODES", 32))

if triton is not None:
    @triton.jit
    def _split_chunk(key_len, num_splits, min_split_tokens, KV_TILE: tl.constexpr):
        """Keys per split of a sequence's key_len keys: whole tiles, at least min_split_tokens (splits past the
        keys are empty)."""
        return tl.cdiv(tl.maximum(tl.cdiv(key_len, num_splits), min_split_tokens), KV_TILE) * KV_TILE

    @triton.jit
    def _prefetch_l2(pointers):
        """Asks L2 for the 128-byte lines at these addresses (nothing comes back: no registers held)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [pointers], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _chunk_start(block, key, kv_head, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
        """The offset of `key`'s first dim in a chunked value cache (`triton_kvstore.cache_offsets`); `key` is a
        multiple of 16, the start of a tile that lies in `block` (int64)."""
        key = key % BLOCK_SIZE
        return tl.multiple_of(((block * NUM_KV_HEADS + kv_head) * BLOCK_SIZE + key // CHUNK * CHUNK) * HEAD_DIM +
                              key % CHUNK, 16)

    # Nothing that changes from step to step picks a variant (which would compile mid-serving): not the block
    # table's width, nor the alignment of the metadata, which a mixed step's decodes are sliced off
    # (`split_decodes`; its loads of them are scalar), and which stands in for the unused map and order
    @triton.jit(do_not_specialize=["block_table_stride"],
                do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr",
                                                "tile_map_ptr", "order_ptr"])
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, partial_ptr, lse_ptr, block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,
        tile_map_ptr, order_ptr,
        q_token_stride, q_head_stride, kv_token_stride, kv_head_stride, block_table_stride,
        qk_scale, v_scale, num_splits, min_split_tokens,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERY_TILE: tl.constexpr,
        ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, KV_TILE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, DECODE: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
        TILE_MAP: tl.constexpr, SPLIT_SEQS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr, ORDER: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr,
        LINE_ELEMENTS: tl.constexpr, V_CHUNK: tl.constexpr,
    ):
        # (`triton_skinny`): the step's metadata is the host's, which no kernel writes: read it while the previous
        # kernel ends; q and this step's keys are the previous kernels', read after the wait
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        work, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if DECODE:  # grid (splits, kv heads, batch): the programs of a sequence go out together, in `order`'s
            seq, kv_head = tl.program_id(2), tl.program_id(1)  # order (longest first) where there is one
            if ORDER:
                seq = tl.load(order_ptr + seq)
        if TILE_MAP:  # varlen in a CUDA graph: program `work` takes the (sequence, tile x splits + split) of its row
            seq = tl.load(tile_map_ptr + 2 * work)
            if seq < 0:
                return  # a row past the step's programs (the step's own programs wait for the kernel before)
            work = tl.load(tile_map_ptr + 2 * work + 1)
        q_tile, split = work // num_splits, work % num_splits
        if DECODE:
            q_begin, query_len = seq, 1
        else:
            q_begin = tl.load(cu_seqlens_q_ptr + seq)
            query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
        if PAGED:
            context_len = tl.load(context_lens_ptr + seq)
        else:  # the keys are this step's own tokens
            context_len = query_len
        # keys up to this tile's last query, cut into num_splits chunks of whole tiles (varlen: a decode's only)
        key_end = tl.minimum(context_len, context_len - query_len + (q_tile + 1) * QUERY_TILE)
        partial_out = SPLIT  # its split's output and log-sum-exp, for the merge: decode's, and a varlen step's decodes
        seq_splits = num_splits
        if SPLIT:
            if not DECODE:
                partial_out = (query_len == 1) & (seq < SPLIT_SEQS)
                seq_splits = tl.where(partial_out, num_splits, 1)
        chunk = _split_chunk(key_end, seq_splits, min_split_tokens, KV_TILE)
        key_begin = split * chunk
        key_end = tl.minimum(key_end, key_begin + chunk)
        if SPLIT:
            if (split > 0) & (key_begin >= key_end):
                return  # an empty split writes nothing (the merge counts the splits alike), so it need not wait
        block_row = block_tables_ptr + seq * block_table_stride
        if PREFETCH:  # the chunk's first keys and values into L2 while the previous kernel ends (`_prefetch_l2`)
            for start in tl.static_range(0, PREFETCH * KV_TILE, KV_TILE):
                key_pos = key_begin + start + tl.arange(0, KV_TILE)
                blocks = tl.load(block_row + key_pos // BLOCK_SIZE, mask=key_pos < key_end, other=0).to(tl.int64)
                lines = (blocks * BLOCK_SIZE + key_pos % BLOCK_SIZE)[:, None] * kv_token_stride + \
                    kv_head * kv_head_stride + tl.arange(0, LINES)[None, :] * LINE_ELEMENTS
                _prefetch_l2(k_ptr + lines)
                if V_CHUNK:  # a tile of whole chunks: its values are one run of KV_TILE x HEAD_DIM elements
                    tile_block = tl.load(block_row + (key_begin + start) // BLOCK_SIZE,
                                         mask=key_begin + start < key_end, other=0).to(tl.int64)
                    lines = _chunk_start(tile_block, key_begin + start, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                         V_CHUNK) + tl.minimum(tl.arange(0, KV_TILE * DIM_PAD // LINE_ELEMENTS) *
                                                               LINE_ELEMENTS, KV_TILE * HEAD_DIM - 1)
                _prefetch_l2(v_ptr + lines)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if q_tile * QUERY_TILE >= query_len:
            return

        # row r holds query token q_tile * QUERY_TILE + r // GROUP_PAD, head kv_head * GROUP + r % GROUP_PAD
        rows = tl.arange(0, ROWS)
        token = q_tile * QUERY_TILE + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_valid = (rows // GROUP_PAD < QUERY_TILE) & (rows % GROUP_PAD < GROUP) & (token < query_len)
        q_pos = tl.where(row_valid, context_len - query_len + token, -1)  # a padding row sees no key
        dims = tl.arange(0, DIM_PAD)
        dim_valid = dims < HEAD_DIM
        q_row = (q_begin + token).to(tl.int64) * q_token_stride + head * q_head_stride
        q = tl.load(q_ptr + q_row[:, None] + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :],
                    other=0.0).to(COMPUTE_DTYPE)

        m = tl.full([ROWS], -1e30, tl.float32)  # finite: a row that sees no key keeps alpha = 1, p = 0
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
        # A tile that lies in one block takes its id from the loop before: a block id read in the same iteration
        # as the keys it addresses makes Triton's pipeliner keep one tile in flight whatever num_stages says,
        # where a carried one lets it keep num_stages - 1 (two at 3)
        ONE_BLOCK: tl.constexpr = PAGED and BLOCK_SIZE % KV_TILE == 0
        if ONE_BLOCK:
            next_block = tl.load(block_row + key_begin // BLOCK_SIZE, mask=key_begin < key_end, other=0).to(tl.int64)
            # (a paged cache's strides, known at compile time: the keys of a tile at constant offsets from one base)
            tile_offsets = tl.arange(0, KV_TILE)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + dims[None, :]
        for start in range(key_begin, key_end, KV_TILE):
            key_pos = start + tl.arange(0, KV_TILE)
            key_valid = key_pos < key_end
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            if ONE_BLOCK:  # the tile's keys are consecutive rows of its block; those past the context are its
                # other keys, loaded unmasked (their scores are masked below)
                block = next_block
                next_block = tl.load(block_row + (start + KV_TILE) // BLOCK_SIZE, mask=start + KV_TILE < key_end,
                                     other=0).to(tl.int64)
                kv_base = ((block * BLOCK_SIZE + start % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
                k = tl.load(k_ptr + kv_base + tile_offsets, mask=dim_valid[None, :], other=0.0).to(COMPUTE_DTYPE)
                v_tile = v_ptr + kv_base + tile_offsets
            else:
                if PAGED:
                    block = tl.load(block_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
                    kv_row = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
                else:
                    kv_row = (q_begin + key_pos).to(tl.int64)
                offsets = kv_row[:, None] * kv_token_stride + kv_head * kv_head_stride + dims[None, :]
                k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
                v_tile = v_ptr + offsets
            if V_CHUNK:  # [chunk, dim, key of the chunk] (`value_chunk`), the tile inside one block: rows of V_CHUNK
                # keys, which load as the keys' rows of dims do. Past the context they read the block's other keys,
                # finite (the cache starts zeroed, the store saturates), which p weighs 0
                in_block = tl.arange(0, KV_TILE) % V_CHUNK + (tl.arange(0, KV_TILE) // V_CHUNK) * (V_CHUNK * HEAD_DIM)
                v_offsets = _chunk_start(block, start, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, V_CHUNK) + \
                    in_block[:, None] + dims[None, :] * V_CHUNK
                v = tl.load(v_ptr + v_offsets).to(COMPUTE_DTYPE)
            else:
                v = tl.load(v_tile, mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        seen = l > 0
        out = acc * (v_scale / tl.where(seen, l, 1.0))[:, None]
        out_row = (q_begin + token).to(tl.int64) * (NUM_KV_HEADS * GROUP) + head
        out_mask = row_valid[:, None] & dim_valid[None, :]
        if partial_out:  # rows of (sequence, head, split)
            split_row = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * num_splits + split
            tl.store(partial_ptr + split_row[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
            lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))  # -inf: an empty split
            tl.store(lse_ptr + split_row, lse, mask=row_valid)
        else:
            tl.store(out_ptr + out_row[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=out_mask)

    @triton.jit
    def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, context_lens_ptr, cu_seqlens_q_ptr, num_splits,
                             min_split_tokens, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                             SPLITS_PAD: tl.constexpr, SPLITS: tl.constexpr, KV_TILE: tl.constexpr,
                             VARLEN: tl.constexpr, PDL: tl.constexpr):
        """One (token, head) a program; VARLEN: one (sequence, head) of a varlen step, which merges only a
        sequence of one query token (the attention kernel split only those) into that token's row. SPLITS
        (num_splits, up to PER_THREAD_SPLITS; else 0): one dim a thread, each thread reads every split's lse (one
        address across the warp) and its dim of every split's output, all at once (the splits unrolled), and weighs
        them itself, so no value crosses threads. Else a tile of the splits across the threads, reduced across them
        (fewer instructions a thread). KV_TILE (the decode kernel's): only the splits that the token's context
        fills were written (`_split_chunk`); else all."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # token * num_heads + head
        out_row = row
        if KV_TILE:  # the context is the host's: loaded before the wait, used after it (not to hold the wait up)
            context_len = tl.load(context_lens_ptr + tl.program_id(0))
        if VARLEN:
            q_begin = tl.load(cu_seqlens_q_ptr + tl.program_id(0))
            query_len = tl.load(cu_seqlens_q_ptr + tl.program_id(0) + 1) - q_begin
            out_row = q_begin.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        if PDL:  # every program waits, so that the kernel ends after the attention (whose prompt rows come next)
            tl.extra.cuda.gdc_wait()
        if VARLEN:
            if query_len != 1:
                return
        used = num_splits
        if KV_TILE:
            used = tl.maximum(tl.cdiv(context_len, _split_chunk(context_len, num_splits, min_split_tokens, KV_TILE)),
                              1)
        dims = tl.arange(0, DIM_PAD)
        if SPLITS:  # every split's loads at once, none of them waiting for `used`: it only picks what is summed
            top = tl.load(lse_ptr + row * SPLITS)  # (split 0 is always written)
            for s in tl.static_range(1, SPLITS):
                top = tl.maximum(top, tl.where(s < used, tl.load(lse_ptr + row * SPLITS + s), float("-inf")))
            top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: each weighs 0 below
            total = 0.0
            out = tl.zeros([DIM_PAD], tl.float32)
            for s in tl.static_range(SPLITS):  # an empty split (lse -inf) weighs 0, an unwritten one is left out
                weight = tl.exp2(tl.where(s < used, tl.load(lse_ptr + row * SPLITS + s), float("-inf")) - top)
                partial = tl.load(partial_ptr + (row * SPLITS + s) * HEAD_DIM + dims, mask=dims < HEAD_DIM, other=0.0)
                out += tl.where(s < used, weight * partial, 0.0)
                total += weight
        else:
            splits = tl.arange(0, SPLITS_PAD)
            lse = tl.load(lse_ptr + row * num_splits + splits, mask=splits < used, other=float("-inf"))
            top = tl.max(lse, 0)
            weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # an empty split weighs 0
            mask = (splits < used)[:, None] & (dims < HEAD_DIM)[None, :]
            partial = tl.load(partial_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                              mask=mask, other=0.0)
            total = tl.sum(weight, 0)
            out = tl.sum(weight[:, None] * partial, 0)
        out = out / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + out_row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_splits(batch: int, num_kv_heads: int, num_sms: int, kv_itemsize: int = 2, max_context: int = 0) -> int:
    """How many chunks decode cuts each sequence's keys into: 1 when the programs fill the GPU; with `max_context`
    (the batch's longest context, 0: unknown), no more than SHORT_CONTEXT_SPLITS says."""
    programs, itemsize = batch * num_kv_heads, min(kv_itemsize, 2)  # (float32 splits as bf16 does)
    if programs >= SPLIT_BELOW_PROGRAMS_PER_SM[itemsize] * num_sms:
        return 1
    splits = max(2, min(MAX_SPLITS, SPLIT_TARGET_PROGRAMS_PER_SM[itemsize] * num_sms // programs))
    needed = -(-max_context // MIN_SPLIT_TOKENS)
    if 0 < needed <= SHORT_CONTEXT_SPLITS:
        splits = min(splits, 1 << (needed - 1).bit_length())
    return splits


def decode_context_bounds(batch: int, num_kv_heads: int, num_sms: int, kv_itemsize: int = 2) -> list[int]:
    """The longest contexts, shortest first, up to which a batch takes fewer splits than `decode_splits` gives it at
    any length: a CUDA graph captured with each as its bound serves the batches whose contexts it bounds."""
    splits = decode_splits(batch, num_kv_heads, num_sms, kv_itemsize)
    return [MIN_SPLIT_TOKENS * (1 << k) for k in range(SHORT_CONTEXT_SPLITS.bit_length()) if 1 << k < splits]


def decode_tile(head_dim: int, kv_itemsize: int, split: bool = False, block_size: int = 0,
                v_chunk: int = 0, one_wave: bool = False, programs_per_sm: float = 0.0,
                max_context: int = 0) -> tuple[int, int, int]:
    """(keys per iteration, warps, pipeline stages) of the decode kernel, tuned on an H200 at head_dim 128: 16 KB
    of keys an iteration, 4 warps. Over FP8 64 keys and 2 warps (8-30% faster than 128 keys and 4 warps, with
    values laid out as keys); with chunked values (`value_chunk`) an unsplit batch takes 128 keys and 4 warps where
    a block holds whole tiles of them, a split one still 64 and 2 (decode notes, run 11).
    `one_wave` (ONE_WAVE_PROGRAMS_PER_SM): over a 16-bit cache 128 keys an iteration (run 12).
    Two tiles in flight (3 stages where a block holds whole tiles: the kernel carries their block ids) pay for an
    unsplit batch past one wave (over FP8 from FP8_DEEP_PROGRAMS_PER_SM programs an SM on, 64-key tiles on 2 warps);
    elsewhere one (2 stages; run 13), and where the host bounds the contexts (`max_context`, 0: no bound) to at most
    two tiles, which fill no third buffer (3-7% faster at 128 keys).
    Where tiles cross blocks, one tile is in flight whatever the stages (3)."""
    deep = not split and not one_wave
    if kv_itemsize == 1:
        if v_chunk and head_dim <= 128 and not split and block_size % 128 == 0:
            deep = programs_per_sm >= FP8_DEEP_PROGRAMS_PER_SM
            tile, warps = (64, 2) if deep else (128, 4)
        else:
            tile, warps, deep = 64, 2 if head_dim <= 128 else 4, False
    elif one_wave and kv_itemsize == 2 and head_dim <= 128:
        tile, warps = 128, 4
    else:
        tile, warps = 64 * 2 // kv_itemsize // (1 if head_dim <= 128 else 2), 4
    deep = deep and not 0 < max_context <= 2 * tile
    return tile, warps, 3 if deep or not block_size or block_size % tile else 2


def _compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the products: see the module docstring."""
    if q_dtype == torch.float32 or kv_dtype != FP8_DTYPE:
        return q_dtype
    return torch.float16


def _dim_pad(head_dim: int) -> int:
    """The kernels' head_dim, padded to a power of two that `tl.dot` takes."""
    return max(16, triton.next_power_of_2(head_dim))


@functools.cache
def _common_args(group, kv_heads, head_dim, scale, k_scale, v_scale, compute_dtype) -> dict:
    """The kernel arguments that both paths share, built once per shape and dtype (a few microseconds each time,
    in every layer's attention) and shared by every call: read, never written."""
    dim_pad = _dim_pad(head_dim)
    return dict(qk_scale=scale * k_scale * LOG2E, v_scale=v_scale, NUM_KV_HEADS=kv_heads, GROUP=group,
                GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
                COMPUTE_DTYPE=getattr(tl, str(compute_dtype).removeprefix("torch.")),  # tl.float16, ...
                DOT_PRECISION="ieee" if compute_dtype == torch.float32 else "tf32")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0, *,
                     num_splits: int | None = None, min_split_tokens: int | None = None,
                     kv_tile: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     compute_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                     order: torch.Tensor | None = None, max_context: int = 0) -> torch.Tensor:
    """One query token per sequence: q [batch, num_heads, head_dim] -> out [batch, num_heads, head_dim] (written
    into `out` when given). `order`: [batch] int32, a permutation of the rows, the order in which their programs
    go out (longest context first: on bench.py's ragged contexts 9-17% faster than batch order; None: batch
    order). `max_context`: a bound on the contexts, which fewer splits then serve (`decode_splits`; 0: none). The
    other keyword-only arguments override the tuned choices (benchmarks and tests)."""
    require_triton("the Triton attention kernels")
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.shape == k_cache.shape and v_cache.is_contiguous()
    assert q.stride(-1) == 1 and block_tables.stride(-1) == 1 and num_heads % kv_heads == 0
    sms, itemsize = _num_sms(q.device), k_cache.element_size()
    if num_splits is None:
        num_splits = decode_splits(batch, kv_heads, sms, itemsize, max_context)
    if min_split_tokens is None:
        min_split_tokens = MIN_SPLIT_TOKENS if num_splits <= PER_THREAD_SPLITS else MIN_SPLIT_TOKENS_TILE_MERGE
    v_chunk = value_chunk(v_cache)
    one_wave = num_splits == 1 and batch * kv_heads <= ONE_WAVE_PROGRAMS_PER_SM * sms
    tile, warps, stages = decode_tile(head_dim, itemsize, num_splits > 1, block_size, v_chunk, one_wave,
                                      batch * kv_heads / sms, max_context)
    tile, warps, stages = kv_tile or tile, num_warps or warps, num_stages or stages
    assert not v_chunk or block_size % tile == 0, "a tile of a chunked value cache lies in one block"
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.is_contiguous()
    if batch == 0:
        return out
    args = _common_args(num_heads // kv_heads, kv_heads, head_dim, scale, k_scale, v_scale,
                        compute_dtype or _compute_dtype(q.dtype, k_cache.dtype))
    rows = max(16, args["GROUP_PAD"])
    split = num_splits > 1
    partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device) \
        if split else out
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device) if split else out
    pdl = pdl_args(q.device)
    line = 128 // itemsize  # elements of a 128-byte line
    prefetch = KV_PREFETCH_TILES if pdl["PDL"] and split else 0  # (the interpreter runs no PTX)
    _attention_kernel[(num_splits, kv_heads, batch)](
        q, k_cache, v_cache, out, partial, lse, block_tables, context_lens, context_lens, context_lens,
        order if order is not None else context_lens,
        q.stride(0), q.stride(1), kv_heads * head_dim, head_dim, block_tables.stride(0),
        num_splits=num_splits, min_split_tokens=min_split_tokens, QUERY_TILE=1, ROWS=rows, KV_TILE=tile,
        BLOCK_SIZE=block_size, DECODE=True, PAGED=True, SPLIT=split, TILE_MAP=False, SPLIT_SEQS=0,
        ORDER=order is not None, PREFETCH=prefetch, LINES=max(1, args["DIM_PAD"] // line), LINE_ELEMENTS=line,
        V_CHUNK=v_chunk, num_warps=warps, num_stages=stages, **args, **pdl)
    if split:
        merge_splits(partial, lse, out, (context_lens, min_split_tokens, tile))
    return out


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                 written: tuple[torch.Tensor, int, int] | None = None, cu_seqlens_q: torch.Tensor | None = None):
    """out [tokens, heads, head_dim] = the splits' outputs (partial [tokens, heads, splits, head_dim] float32, each
    normalised over its keys) weighted by exp2(lse [tokens, heads, splits]), over the sum of the weights.
    `written`: (context_lens, min_split_tokens, kv_tile) of the decode kernel that wrote them, which leaves the
    splits past each token's context unwritten; None: every split was written. `cu_seqlens_q`: partial's rows are
    a varlen step's sequences, of which only those of one query token are merged, into out's row of that token."""
    tokens, heads, splits, head_dim = partial.shape
    dim_pad = _dim_pad(head_dim)
    per_thread = splits <= PER_THREAD_SPLITS
    context_lens, min_split_tokens, kv_tile = written or (lse, 0, 0)
    _merge_splits_kernel[(tokens, heads)](
        partial, lse, out, context_lens, cu_seqlens_q if cu_seqlens_q is not None else lse, splits,
        min_split_tokens, HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS_PAD=max(16, triton.next_power_of_2(splits)),
        SPLITS=splits if per_thread else 0, KV_TILE=kv_tile, VARLEN=cu_seqlens_q is not None,
        num_warps=max(1, min(8, dim_pad // 32)) if per_thread else 4, **pdl_args(partial.device))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Any batch (prefill, prefix, decode, mixed): q [num_tokens, num_heads, head_dim]; causal, aligned to the end
    of each context. With an empty cache (warm-up) it attends over this step's k and v instead. Writes only the
    rows of the sequences in `meta` (whose cu_seqlens_q index q's rows), into `out` when given. Through a tile map
    of `meta.tile_map_splits` programs a decode, the decodes' splits are merged by a second kernel."""
    require_triton("the Triton attention kernels")
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.size(1)
    paged = k_cache.numel() > 0
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.is_contiguous()
    if num_tokens == 0:
        return out
    if paged:
        keys, values, block_size = k_cache, v_cache, k_cache.size(1)
        token_stride, head_stride = kv_heads * head_dim, head_dim
    else:  # a warm-up run: this step's own keys and values, which the kernel reads with one set of strides
        keys, values, block_size, k_scale, v_scale = k, v, 16, 1.0, 1.0
        if k.stride() != v.stride() or k.stride(-1) != 1:  # k is normed (contiguous), v a slice of the qkv output
            keys, values = k.contiguous(), v.contiguous()
        token_stride, head_stride = keys.stride(0), keys.stride(1)
    args = _common_args(num_heads // kv_heads, kv_heads, head_dim, scale, k_scale, v_scale,
                        _compute_dtype(q.dtype, keys.dtype))
    query_tile = varlen_query_tile(num_heads // kv_heads)
    rows = query_tile * args["GROUP_PAD"]
    tile = VARLEN_KV_TILE if head_dim <= 128 else VARLEN_KV_TILE // 2
    v_chunk = value_chunk(values) if paged else 0
    assert not v_chunk or block_size % tile == 0, "a tile of chunked values lies in a block"
    tile_map, splits = meta.tile_map, meta.tile_map_splits if paged else 1
    if tile_map is None:
        grid = (triton.cdiv(meta.max_seqlen_q, query_tile), meta.cu_seqlens_q.numel() - 1, kv_heads)
        assert splits == 1
    else:
        assert tile_map.is_contiguous() and tile_map.shape[1] == 2
        grid = (tile_map.size(0), 1, kv_heads)
    partial = lse = out
    if splits > 1:  # a decode's splits, by sequence (padding sequences included: they write nothing)
        seqs = min(meta.cu_seqlens_q.numel() - 1, VARLEN_SPLIT_SEQS)
        partial = torch.empty(seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    _attention_kernel[grid](
        q, keys, values, out, partial, lse, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
        meta.cu_seqlens_q if tile_map is None else tile_map, meta.cu_seqlens_q,  # (the order: unused)
        q.stride(0), q.stride(1), token_stride, head_stride, meta.block_tables.stride(0),
        num_splits=splits, min_split_tokens=MIN_SPLIT_TOKENS, QUERY_TILE=query_tile, ROWS=rows, KV_TILE=tile,
        BLOCK_SIZE=block_size, DECODE=False, PAGED=paged, SPLIT=splits > 1, TILE_MAP=tile_map is not None,
        SPLIT_SEQS=VARLEN_SPLIT_SEQS, ORDER=False, PREFETCH=0, LINES=1, LINE_ELEMENTS=1,
        V_CHUNK=v_chunk, num_warps=VARLEN_WARPS, num_stages=VARLEN_STAGES, **args, **pdl_args(q.device))
    if splits > 1:
        merge_splits(partial, lse, out, (meta.context_lens, MIN_SPLIT_TOKENS, tile), cu_seqlens_q=meta.cu_seqlens_q)
    return out


def varlen_query_tile(group: int) -> int:
    """Query tokens per program of the varlen path, for `group` query heads per KV head (padded to a power of 2)."""
    group_pad = 1 << (group - 1).bit_length()
    return max(QUERY_ROWS, group_pad) // group_pad


def varlen_tile_map(query_lens: np.ndarray, query_tile: int, rows: int, splits: int = 1,
                    context_lens: np.ndarray | None = None) -> np.ndarray:
    """int32 [rows, 2]: the (sequence, query tile x splits + split) that each program of a graph-captured varlen
    step takes, the step's first and (-1, -1) after them; `rows` is at least `max_varlen_tiles` of the step's
    shape. A decode (one query token) among the first VARLEN_SPLIT_SEQS sequences has `splits` programs, one a
    split of its keys; any other sequence one a query tile (split 0). With `context_lens`, the programs that read
    the most keys come first (when they outnumber what the GPU runs at once, the short ones wait, not the long
    ones); else in sequence order."""
    decode = (query_lens == 1) & (np.arange(len(query_lens)) < VARLEN_SPLIT_SEQS)
    tiles = np.where(decode, splits, -(-query_lens // query_tile))
    seq = np.repeat(np.arange(len(query_lens), dtype=np.int32), tiles)
    assert len(seq) <= rows, (len(seq), rows)
    index = np.arange(len(seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)  # of the sequence's programs
    split = np.repeat(decode, tiles)
    work = np.where(split, index, index * splits)
    if context_lens is not None:  # keys read: up to the tile's last query, a split's share of a decode's
        context, query_len = context_lens[seq], query_lens[seq]
        keys = np.where(split, -(-context // splits),
                        context - query_len + np.minimum(query_len, (index + 1) * query_tile))
        order = np.argsort(-keys, kind="stable")
        seq, work = seq[order], work[order]
    out = np.full((rows, 2), -1, dtype=np.int32)
    out[:len(seq), 0] = seq
    out[:len(seq), 1] = work
    return out


def max_varlen_tiles(num_tokens: int, num_seqs: int, query_tile: int, splits: int = 1) -> int:
    """The most programs that `varlen_tile_map` gives num_seqs sequences of num_tokens tokens in all: each
    sequence's last tile may be partial, and a decode among the first VARLEN_SPLIT_SEQS has `splits`."""
    seqs = min(num_seqs, num_tokens)
    return num_tokens // query_tile + seqs + min(seqs, VARLEN_SPLIT_SEQS) * (splits - 1)


def splits_decodes(num_decodes: int, num_seqs: int) -> bool:
    """Whether a step of num_seqs sequences that leads with num_decodes decodes attends them with the decode kernel
    (`split_decodes`): when they are many, and a prompt is beside them."""
    return bool(SPLIT_DECODES) and SPLIT_DECODES <= num_decodes < num_seqs


def split_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, k_scale: float = 1.0, v_scale: float = 1.0
                  ) -> tuple[torch.Tensor | None, AttentionMetadata]:
    """A mixed step's output with its `meta.num_decodes` leading decodes attended by the decode kernel, and the
    metadata of its other sequences (their cu_seqlens_q still index q's rows), when there are at least
    SPLIT_DECODES of them and a prompt beside them; else (None, meta)."""
    n = meta.num_decodes
    if not splits_decodes(n, meta.cu_seqlens_q.numel() - 1) or not k_cache.numel():
        return None, meta
    block_tables, context_lens, rest = meta.decodes_and_rest()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode_attention(q[:n], k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, out=out[:n],
                     max_context=meta.max_seqlen_k)
    return out, rest


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Any step on the Triton kernels: a decode-only step on the decode kernel, any other on the varlen path, its
    leading decodes split off to the decode kernel when it has many (`split_decodes`)."""
    if k_cache.numel() and meta.max_seqlen_q == 1:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, k_scale, v_scale,
                                order=meta.decode_order, max_context=meta.max_seqlen_k)
    out, meta = split_decodes(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
    return varlen_attention(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, out=out)


class TritonBackend(AttentionBackend):
    """Triton for every step: the split-KV decode kernel for decode-only steps, the varlen path otherwise.
    Reads model-dtype and FP8 caches; runs on any CUDA GPU that Triton supports."""
    name = "triton"
    supports_cuda_graphs = True  # decode reads only device tensors and integers fixed per graph
    supports_fp8_kv = True
    fuses_rope_store = True
    varlen_graph_tokens = 1 << 30

    def __init__(self):
        if not triton_available():
            reason = "CUDA is not available" if triton is not None else repr(_TRITON_ERROR)
            raise ValueError(f"attention_backend='triton' needs CUDA and a working Triton: {reason}")

    def check(self, block_size: int, head_dim: int, kv_cache_dtype: torch.dtype):
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"the triton backend supports head_dim up to {MAX_HEAD_DIM}; the model has {head_dim}")

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        triton_kvstore.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def decode_context_bounds(self, batch, num_kv_heads, kv_itemsize, device):
        return decode_context_bounds(batch, num_kv_heads, _num_sms(device), kv_itemsize)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale)
