"""Piecewise graphs (prefills, chunks and mixed steps): the forward in pieces between attentions, each replayed
from static buffers. On CPU a "graph" reruns its piece, as a replay does if the piece touches only the static
buffers: these tests check the pieces, their buffers, padding and sizes; the GPU test checks the capture."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanovllm import LLM
from nanovllm.engine.piecewise_graphs import PiecewiseGraphs, token_counts
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import step_inputs
from tests.conftest import assert_greedy_matches_hf, greedy


class Rerun:
    """A stand-in for a CUDA graph on CPU: replay runs the captured function again."""

    def __init__(self, fn):
        self.replay = fn

    def reset(self):
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20000))
def test_token_counts_cover_every_step_with_little_padding(max_tokens):
    sizes = token_counts(max_tokens)
    assert sizes[-1] == max_tokens and sizes == sorted(set(sizes))
    for smaller, larger in zip(sizes, sizes[1:]):
        assert larger <= max(1.5 * smaller, 16)  # a step of smaller + 1 tokens is padded by under a third


def test_token_counts_are_powers_of_two_and_their_halfway_points():
    assert token_counts(2048) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_counts(100) == [8, 16, 24, 32, 48, 64, 96, 100]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 70))] for _ in range(n)]


def generate(llm, batch, params, piecewise: PiecewiseGraphs | None):
    llm.model_runner.piecewise = piecewise
    try:
        return llm.generate(batch, params)
    finally:
        llm.model_runner.piecewise = None


def fuse_rope_store(llm, fused: bool):
    """The fused q/k norm, rope and KV store (`triton_rope_store`, through Triton's interpreter on CPU) in every
    layer, or not: the model runner turns it on for CUDA backends only."""
    for layer in llm.model_runner.attn_layers:
        layer.fuse_rope_store = fused


@pytest.mark.parametrize("max_tokens, fused", [(48, False), (100, False), (48, True)])
def test_steps_through_the_pieces_equal_the_eager_forward(tiny_model, hf_model, max_tokens, fused):
    """Prefills, chunks, prefix hits and mixed steps of every size up to max_tokens (larger ones eager); with the
    fused KV store in the pieces, whose padding rows must store nothing."""
    if fused:
        pytest.importorskip("nanovllm.layers.triton_rope_store")
    # blocks of 16: prefix hits in the second run, and blocks that the runs share, where a stray store would land
    with LLM(tiny_model, max_num_batched_tokens=100, max_num_seqs=8, kvcache_block_size=16) as llm:
        runner = llm.model_runner
        fuse_rope_store(llm, fused)
        piecewise = PiecewiseGraphs(runner.model, max_tokens, runner.device, capture=Rerun)
        steps = []
        run = piecewise.run

        def counting_run(input_ids, positions, meta):
            steps.append(len(input_ids))
            # garbage in the rows the step leaves (as in a graph): no real row reads it, no padding row stores it
            for buffer in (piecewise.q, piecewise.k, piecewise.v, piecewise.residual, piecewise.attn_out):
                buffer.normal_(0, 3)
            piecewise.input_ids.random_(0, 500)
            piecewise.positions.random_(0, 100)
            return run(input_ids, positions, meta)

        piecewise.run = counting_run
        # chunks fill the budget; fewer prompts and tokens with the (interpreted) fused store, still every step kind
        batch = prompts(4 if fused else 12, seed=max_tokens) + [list(range(3, 130 if fused else 250))]
        params = greedy(4 if fused else 10)
        got = generate(llm, batch, params, piecewise)  # first: an empty cache, so whole prompts
        again = generate(llm, batch, params, piecewise)  # prefix-cache hits leave short prefills
        fuse_rope_store(llm, False)
        expected = generate(llm, batch, params, None)
    tokens = [[out["token_ids"] for out in outputs] for outputs in (expected, got, again)]
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert any(out["num_cached_tokens"] > 0 for out in again)
    assert steps and max(steps) <= max_tokens
    if max_tokens == 100:  # the token budget: full steps are the largest size, and run through the pieces
        assert 100 in steps
    assert any(n not in piecewise.sizes for n in steps)  # some steps were padded
    for prompt, output in zip(batch, tokens[1]):
        assert_greedy_matches_hf(hf_model, prompt, output)


def test_padding_rows_reach_no_cache_slot_and_real_rows_come_back(tiny_model):
    """A step of 5 tokens replays the pieces of 8 after a step of 8 whose slots stay in the static buffer: with
    the fused store (in the pieces) or not, only the step's own 5 slots change, and `run` returns 5 rows."""
    pytest.importorskip("nanovllm.layers.triton_rope_store")
    # 4 blocks (the interpreter copies the caches each launch): 0 and 1 the steps', 2 and 3 show a stray store
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=4) as llm, torch.inference_mode():
        runner = llm.model_runner
        piecewise = PiecewiseGraphs(runner.model, 16, runner.device, capture=Rerun)
        for fused in (False, True):
            fuse_rope_store(llm, fused)
            seqs = [Sequence(list(range(3, 11)))]
            seqs[0].block_table, seqs[0].num_scheduled_tokens = [0], 8
            inputs = step_inputs(seqs, 16)
            input_ids, positions, meta, *_ = runner.prepare(inputs, None)
            piecewise.run(input_ids, positions, meta)  # slots 0-7 in the static buffer
            runner.kv_cache.fill_(7.0)
            seqs = [Sequence(list(range(3, 8)))]
            seqs[0].block_table, seqs[0].num_scheduled_tokens = [1], 5
            input_ids, positions, meta, *_ = runner.prepare(step_inputs(seqs, 16), None)
            out = piecewise.run(input_ids, positions, meta)
            assert out.shape[0] == 5 and not piecewise.hidden_states[8:].any()  # the pieces of 8, not 16
            changed = (runner.kv_cache != 7.0).flatten(4).any(-1)  # [2, layers, blocks, block_size]
            expected = torch.zeros_like(changed)
            expected[:, :, 1, :5] = True
            assert torch.equal(changed, expected), fused


def test_describe_and_close_report_and_release_the_piecewise_graphs(tiny_model):
    resets = []

    class Recorded(Rerun):
        def reset(self):
            resets.append(self)

    llm = LLM(tiny_model, max_num_batched_tokens=32)
    runner = llm.model_runner
    assert runner.describe()[0]["piecewise_graphs"] == []
    runner.piecewise = piecewise = PiecewiseGraphs(runner.model, 32, runner.device, capture=Recorded)
    assert runner.describe()[0]["piecewise_graphs"] == [8, 16, 24, 32]
    llm.close()
    assert len(resets) == len(piecewise.sizes) * (len(runner.model.model.layers) + 1) and runner.piecewise is None
