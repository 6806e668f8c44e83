"""Piecewise graphs (prefills, chunks and mixed steps): the forward in pieces between attentions, each piece
replayed from static buffers. On CPU a "graph" here runs its piece again, which is what a CUDA graph's replay
does when the piece reads and writes only the static buffers: so these tests check the pieces, the buffers
they hand over, the padding and the choice of size; the GPU test checks the capture itself."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from nanovllm import LLM, SamplingParams
from nanovllm.engine.piecewise_graphs import PiecewiseGraphs, token_counts
from tests.conftest import assert_greedy_matches_hf


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


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 70))] for _ in range(n)]


def generate(llm, batch, params, piecewise: PiecewiseGraphs | None):
    llm.model_runner.piecewise = piecewise
    try:
        return [out["token_ids"] for out in llm.generate(batch, params)]
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
    with LLM(tiny_model, max_num_batched_tokens=100, max_num_seqs=8) as llm:
        runner = llm.model_runner
        fuse_rope_store(llm, fused)
        piecewise = PiecewiseGraphs(runner.model, max_tokens, runner.device, capture=Rerun)
        steps = []
        run = piecewise.run

        def counting_run(input_ids, positions, meta):
            steps.append(len(input_ids))
            # garbage in every row that the step does not fill (a graph's buffers hold whatever came before):
            # no real row may depend on it, and no padding row may store it in the cache
            for buffer in (piecewise.q, piecewise.k, piecewise.v, piecewise.residual, piecewise.attn_out):
                buffer.normal_(0, 3)
            piecewise.input_ids.random_(0, 500)
            piecewise.positions.random_(0, 100)
            return run(input_ids, positions, meta)

        piecewise.run = counting_run
        batch = prompts(12, seed=max_tokens)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        fuse_rope_store(llm, False)
        expected = generate(llm, batch, params, None)
        fuse_rope_store(llm, fused)
        got = generate(llm, batch, params, piecewise)
        again = generate(llm, batch, params, piecewise)  # prefix-cache hits leave short prefills
    assert got == expected and again == expected
    assert steps and max(steps) <= max_tokens
    assert any(n not in piecewise.sizes for n in steps)  # some steps were padded
    for prompt, output in zip(batch, got):
        assert_greedy_matches_hf(hf_model, prompt, output)
