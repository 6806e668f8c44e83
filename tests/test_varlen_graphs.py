"""Varlen whole-step graphs, rerun at replay on CPU (static buffers, tile map, padding, sizes, fallbacks)."""
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from nanovllm import LLM, SamplingParams
from nanovllm.engine import varlen_graphs as varlen_graphs_module
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.staging import Staging
from nanovllm.engine.step_inputs import step_inputs
from nanovllm.engine.piecewise_graphs import MAX_TOKENS
from nanovllm.engine.varlen_graphs import FINE_FROM, FINE_STEP, VarlenGraphs, graph_sizes
from nanovllm.layers import triton_attention
from nanovllm.layers.triton_attention import max_varlen_tiles, varlen_tile_map
from tests import test_overlap
from tests.conftest import assert_greedy_matches_hf, greedy
from tests.test_overlap import same_outputs
from tests.test_piecewise_graphs import Rerun


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.just(1), st.integers(1, 200)), st.integers(0, 3000)), min_size=1, max_size=40),
       st.sampled_from([1, 2, 4, 8, 16, 32, 64]), st.integers(0, 5), st.sampled_from([1, 3, 4]), st.booleans())
def test_tile_map_lists_each_tile_once_within_the_bound(seqs, query_tile, spare, splits, by_keys):
    """Each tile (a split decode's splits) once, in order or most keys first, then empty rows, within the bound."""
    query_lens = [n for n, _ in seqs]
    lens, contexts = np.array(query_lens), np.array([n + prefix for n, prefix in seqs])
    rows = max_varlen_tiles(int(lens.sum()), len(lens), query_tile, splits) + spare
    tile_map = varlen_tile_map(lens, query_tile, rows, splits, contexts if by_keys else None)
    split = [n == 1 and seq < triton_attention.VARLEN_SPLIT_SEQS for seq, n in enumerate(query_lens)]
    expected = [(seq, s) if split[seq] else (seq, tile * splits) for seq, n in enumerate(query_lens)
                for tile in range(-(-n // query_tile)) for s in range(splits if split[seq] else 1)]
    assert tile_map.shape == (rows, 2) and tile_map.dtype == np.int32
    listed = [tuple(row) for row in tile_map[:len(expected)].tolist()]
    if by_keys:
        def keys(seq, work):  # the keys a program reads (to a split's rounding)
            if split[seq]:
                return -(-contexts[seq] // splits)
            return contexts[seq] - query_lens[seq] + min(query_lens[seq], (work // splits + 1) * query_tile)
        assert sorted(listed) == sorted(expected)
        assert all(keys(*a) >= keys(*b) for a, b in zip(listed, listed[1:]))
    else:
        assert listed == expected
    assert (tile_map[len(expected):] == -1).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000))
def test_graph_sizes_cover_every_step_with_little_padding(max_tokens):
    sizes = graph_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    for n in range(1, max_tokens + 1, 7):
        padding = next(size for size in sizes if size >= n) - n
        assert padding < (FINE_STEP if n > FINE_FROM else max(8, n // 2 + 1)), (n, padding)


def test_every_graph_splits_its_decodes():
    """Every varlen graph, up to piecewise_graphs.MAX_TOKENS tokens, splits its decodes (VARLEN_SPLIT_TOKENS)."""
    sizes = graph_sizes(MAX_TOKENS)
    assert max(sizes) == MAX_TOKENS and triton_attention.VARLEN_DECODE_SPLITS > 1
    assert [VarlenGraphs.splits(size) for size in sizes] == [triton_attention.VARLEN_DECODE_SPLITS] * len(sizes)


def test_tile_map_refuses_too_few_rows():
    with pytest.raises(AssertionError):
        varlen_tile_map(np.array([5, 5]), 4, 3)  # 2 + 2 tiles


needs_interpreter = pytest.mark.skipif(torch.cuda.is_available() or triton_attention.triton is None,
                                       reason="CPU only, through Triton's interpreter (CUDA: test_gpu_engine.py)")
prompts = partial(test_overlap.prompts, hi=40)


def run_engine(tiny_model, batch, params, graphs: bool, max_tokens: int = 48, max_num_seqs: int = 3):
    """Outputs on the Triton backend, and [tokens, seqs, leading decodes, merges, graphed] of steps not decode-only."""
    steps, merges = [], []
    merge_splits = triton_attention.merge_splits

    def counted_merge(*args, cu_seqlens_q=None, **kwargs):
        if cu_seqlens_q is not None:  # a varlen step's
            merges.append(args[0].shape)
        return merge_splits(*args, cu_seqlens_q=cu_seqlens_q, **kwargs)
    # few sequences: prompts start beside decodes
    with pytest.MonkeyPatch.context() as patch, LLM(
            tiny_model, kvcache_block_size=16, max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
            num_kvcache_blocks=40) as llm:
        patch.setattr(triton_attention, "merge_splits", counted_merge)
        runner, config = llm.model_runner, llm.config
        runner.backend = backend = object.__new__(triton_attention.TritonBackend)  # its __init__ insists on CUDA
        for layer in runner.attn_layers:
            layer.backend = backend
        runner.staging = Staging(runner.device, pack=True)  # the CUDA path's single copy, in host memory
        if graphs:
            runner.varlen_graphs = VarlenGraphs(runner.model, max_tokens, config.max_num_seqs, config.max_model_len,
                                                runner.block_size, runner.device, capture=Rerun)
            run = runner.varlen_graphs.run

            def poisoned_run(inputs, *args):
                # unfilled bytes and rows hold garbage: no real row may read it
                staging = args[-1]
                for array in staging.arrays:
                    array[:] = np.random.randint(0, 256, len(array), dtype=np.uint8)
                runner.varlen_graphs.inputs.vars["block_tables"].random_(0, 40)
                runner.varlen_graphs.hidden_states.normal_(0, 3)
                steps[-1][-1] = True
                return run(inputs, *args)
            runner.varlen_graphs.run = poisoned_run
        run_step = runner.run_step

        def recorded_run_step(inputs, *args):
            steps.append([len(inputs.input_ids), inputs.num_seqs, inputs.num_leading_decodes, len(merges), False])
            result = run_step(inputs, *args)
            steps[-1][3] = len(merges) - steps[-1][3]
            return result
        runner.run_step = recorded_run_step
        outputs = llm.generate(batch, params, use_tqdm=False)
    return outputs, [step for step in steps if step[0] > step[1]]  # not decode-only


@needs_interpreter
def test_varlen_graph_steps_equal_eager_steps(tiny_model, hf_model, monkeypatch):
    """Prefills, chunks, prefix hits, mixed steps: eager steps' outputs; graphs of up to 8 tokens split decodes."""
    # 4 "SMs": decodes split in 2-8 (the interpreter is slow with more)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 4)
    monkeypatch.setattr(triton_attention, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(varlen_graphs_module, "VARLEN_SPLIT_TOKENS", 8)
    batch = [list(range(3, 70))] + prompts(4, seed=4)  # a first chunk larger than every graph
    batch.append(batch[0][:32] + [7, 8])  # a prefix hit of two blocks
    params = [greedy(3 + i, logprobs=1 if i == 2 else None) for i in range(len(batch))]
    params[3] = SamplingParams(temperature=0.8, seed=11, max_tokens=7, ignore_eos=True)
    expected, _ = run_engine(tiny_model, batch, params, graphs=False)
    got, steps = run_engine(tiny_model, batch, params, graphs=True)
    same_outputs(got, expected)
    assert any(o["num_cached_tokens"] > 0 for o in got)
    graphed = [(n, seqs, decodes, merges) for n, seqs, decodes, merges, graph in steps if graph]
    assert all(graph == (n <= 48) for n, *_, graph in steps), steps  # every step that fits, and only those
    assert any(n not in (8, 16, 24, 32, 48) for n, *_ in graphed)  # padded steps
    assert any(decodes > 0 and n <= 8 for n, _, decodes, _ in graphed)  # mixed steps among them, split
    assert any(decodes > 0 and 8 < n for n, _, decodes, _ in graphed)  # and not
    assert all((merges > 0) == (n <= 8) for n, _, decodes, merges in graphed if decodes), graphed
    assert any(n > 48 for n, *_ in steps)  # and steps larger than every graph
    for i in (0, 1, 2, 4, 5):
        assert_greedy_matches_hf(hf_model, batch[i], got[i]["token_ids"])


# what VarlenGraphs reads of a model before its first replay
MODEL = SimpleNamespace(model=SimpleNamespace(
    layers=[SimpleNamespace(self_attn=SimpleNamespace(attn=SimpleNamespace(num_heads=4, num_kv_heads=2)))],
    embed_tokens=SimpleNamespace(weight=torch.zeros(10, 8))))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=12), st.integers(0, 12), st.sampled_from([0, 2, 32]))
@example([30, 18], 12, 0)  # the largest size
@example([1, 1, 5], 12, 2)  # split decodes
def test_steps_the_graphs_do_not_take_run_eagerly(query_lens, max_seqs, split_decodes):
    """A graph takes a step that fits, of at most MAX_SEQS sequences, whose decodes eager would not split off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(varlen_graphs_module, "MAX_SEQS", max_seqs)
        patch.setattr(triton_attention, "SPLIT_DECODES", split_decodes)
        graphs = VarlenGraphs(MODEL, 48, 16, 250, 16, torch.device("cpu"), capture=Rerun)  # Rerun captures nothing
        assert graphs.inputs.vars["block_tables"].shape[1] == 16  # the blocks of max_model_len
        seqs = []
        for n in sorted(query_lens, key=lambda n: n > 1):  # decodes first, as the scheduler orders them
            seq = Sequence(list(range(3, 3 + n + 2)))
            seq.block_table = list(range(-(-seq.num_tokens // 16)))
            seq.num_computed_tokens, seq.num_scheduled_tokens = 2, n
            seqs.append(seq)
        decodes = step_inputs(seqs, 16).num_leading_decodes
        splits = split_decodes and split_decodes <= decodes < len(seqs)
        assert graphs.fits(step_inputs(seqs, 16)) == (sum(query_lens) <= 48 and len(seqs) <= max_seqs and not splits)
