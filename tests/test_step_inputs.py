"""A step's inputs in one host-to-device copy, and the decode graphs' replay, checked on CPU.

`Staging(pack=True)` runs the CUDA path's packing in plain host memory. `EagerGraphs` is `DecodeGraphs` with
each captured graph replaced by an eager call of what it would record: the static buffers, their one-copy
refill (padding rows included), the pending tokens read from the last samples, the sampler recorded in the
graph (the Triton kernel, through Triton's interpreter here) and its device counter all run as on CUDA. The
engine must give token for token what it gives without them. The engines run on CPU wherever the tests run;
the ones that need the interpreter skip on a CUDA machine, where test_gpu_engine.py runs the real graphs.
"""
import dataclasses
import os
import random
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.engine.staging import Staging
from nanovllm.engine.step_inputs import step_inputs
from nanovllm.layers.attention import TorchBackend
from nanovllm.layers.triton_sampler import make_rng_state, triton
from tests.test_overlap import mixed_params, same_outputs

CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the Triton sampler runs on CPU tensors through Triton's interpreter")


def prompts(n: int, seed: int = 0, lo: int = 4, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_staging_packs_arrays_into_one_buffer():
    staging = Staging(CPU, pack=True)
    rng = np.random.default_rng(0)
    for step in range(5):  # the buffers take turns and grow
        arrays = [rng.integers(-5, 10 ** 9, size=3 + 40 * step), rng.integers(0, 99, (step + 1, 7)).astype(np.int32),
                  np.empty(0, np.int64), rng.random(5).astype(np.float32), rng.random(step + 2) > 0.5,
                  rng.integers(0, 9, (2, 0)).astype(np.int32)]
        tensors = staging.to_device(*arrays)
        assert staging.turn == (step + 1) % 2
        for a, t in zip(arrays, tensors, strict=True):
            assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
            assert np.array_equal(t.numpy(), a)
        tensors[0].fill_(-1)  # views of one packed copy: no piece overlaps another
        assert np.array_equal(tensors[1].numpy(), arrays[1])


def test_staging_waits_for_a_buffers_last_copy_before_refilling():
    class FakeEvent:  # CPU has no events: stand-ins that record which buffer's copy a refill waited for
        def __init__(self, i):
            self.i = i

        def synchronize(self):
            waited.append(self.i)

    waited = []
    staging = Staging(CPU, pack=True)
    staging.events = [FakeEvent(0), FakeEvent(1)]
    for step in range(4):
        staging.to_device(np.arange(4 + step))
        assert waited == [0, 1, 0, 1][:step + 1]  # each refill waits for that buffer's own last copy


def test_step_inputs_of_a_mixed_batch():
    """Blocks of 4: a prompt chunk that crosses a block edge and samples nothing, a decode whose token is
    pending (row 1 of the last step's samples), and a prompt's last chunk."""
    chunk = Sequence(list(range(10, 20)))
    chunk.block_table, chunk.num_computed_tokens, chunk.num_scheduled_tokens = [7, 2, 5], 3, 5
    decode = Sequence([1, 2, 3, 4, 5])
    decode.append_pending(1)
    decode.block_table, decode.num_computed_tokens, decode.num_scheduled_tokens = [0, 9], 5, 1
    last = Sequence(list(range(30, 36)))
    last.block_table, last.num_computed_tokens, last.num_scheduled_tokens = [3, 6], 4, 2
    inputs = step_inputs([chunk, decode, last], block_size=4)
    expected = dict(input_ids=[13, 14, 15, 16, 17, PENDING, 34, 35], positions=[3, 4, 5, 6, 7, 5, 4, 5],
                    slot_mapping=[31, 8, 9, 10, 11, 37, 24, 25], block_tables=[[7, 2, 5], [0, 9, 0], [3, 6, 0]],
                    context_lens=[8, 6, 6], query_lens=[5, 1, 2], cu_seqlens_q=[0, 5, 6, 8], logits_indices=[5, 7],
                    pending_rows=[-1, 1, -1])
    assert {name: getattr(inputs, name).tolist() for name in expected} == expected
    assert not inputs.is_decode and inputs.num_seqs == 3
    assert inputs.num_leading_decodes == 0  # the chunk comes first
    assert step_inputs([decode, last, decode], block_size=4).num_leading_decodes == 1
    assert step_inputs([decode, decode, chunk], block_size=4).num_leading_decodes == 2
    assert step_inputs([decode], block_size=4).is_decode
    assert step_inputs([decode, decode], block_size=4).num_leading_decodes == 2


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=40, num_kvcache_blocks=14)],
                         ids=["plain", "chunked-preempting"])
def test_packed_inputs_give_the_same_outputs(tiny_model, engine_args):
    batch = prompts(12, seed=4)
    params = [mixed_params()[i % 8] for i in range(len(batch))]
    outputs = []
    for pack in (False, True):
        with LLM(tiny_model, device="cpu", kvcache_block_size=16, **engine_args) as llm:
            llm.model_runner.staging = Staging(CPU, pack=pack)
            outputs.append(llm.generate(batch, params, use_tqdm=False))
            if engine_args:
                assert llm.scheduler.num_preemptions > 0
    same_outputs(*outputs)


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose graphs run `_forward` eagerly at replay."""

    def _capture(self, bs, bound, pool):
        return SimpleNamespace(replay=partial(self._forward, bs, bound), reset=lambda: None), pool


class GraphMetaBackend(TorchBackend):
    """The torch backend given the host lists that a graph's metadata lacks (one query token per row)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, *args):
        if meta.context_lens_host is None:
            meta = dataclasses.replace(meta, query_lens_host=[1] * len(meta.context_lens),
                                       context_lens_host=meta.context_lens.tolist())
        return super().forward(q, k, v, k_cache, v_cache, meta, *args)


def as_on_cuda(llm: LLM, graphs: bool, sample_in_graph: bool = True, graphs_up_to: int | None = None,
               context_bounds=None):
    """Give the engine's runner what it has on CUDA: the Triton sampler's device counter, packed inputs and,
    when `graphs`, decode graphs (eager ones), for batches up to `graphs_up_to` (max_num_seqs), with graphs for
    the `context_bounds` of each size."""
    runner, config = llm.model_runner, llm.config
    runner.sampler.rng_state = make_rng_state(config.seed, CPU)
    runner.staging = Staging(CPU, pack=True)
    backend = GraphMetaBackend()
    for layer in runner.attn_layers:
        layer.backend = backend
    if graphs:
        runner.graphs = EagerGraphs(runner.model, graphs_up_to or config.max_num_seqs, config.max_model_len,
                                    runner.block_size, CPU, runner.sampler.rng_state if sample_in_graph else None,
                                    context_bounds)
    return llm


def generate(tiny_model, batch, params, graphs: bool, sample_in_graph: bool = True, graphs_up_to: int = 8,
             **engine_args):
    with LLM(tiny_model, device="cpu", kvcache_block_size=16, max_num_seqs=8, **engine_args) as llm:
        as_on_cuda(llm, graphs, sample_in_graph, graphs_up_to)
        outputs = [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]
        if graphs:
            assert llm.model_runner.graphs.batch_sizes == [1, 2, 4, 8][:graphs_up_to.bit_length()]
    return outputs


@needs_interpreter
@pytest.mark.parametrize("sample_in_graph", [True, False], ids=["graph-samples", "graph-ends-at-logits"])
def test_graph_replays_equal_eager_steps(tiny_model, sample_in_graph):
    # plain rows only (greedy and temperature): every sampling step draws once from the device counter, in a
    # graph or not, so even the temperature rows must agree; ragged lengths pad most decode batches
    batch = prompts(7, seed=1)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(batch))]
    expected = generate(tiny_model, batch, params, graphs=False)
    assert generate(tiny_model, batch, params, graphs=True, sample_in_graph=sample_in_graph) == expected


@needs_interpreter
def test_graph_replays_send_the_decode_kernel_longest_contexts_first(tiny_model):
    """Each replay fills `decode_order`: its rows, padding included, by context length, longest first (the Triton
    decode kernel's programs go out in that order, which evens out ragged contexts)."""
    orders = []

    class Recording(GraphMetaBackend):
        def forward(self, q, k, v, k_cache, v_cache, meta, *args):
            if meta.decode_order is not None:  # (a decode step's replay)
                orders.append((meta.decode_order.tolist(), meta.context_lens.tolist()))
            return super().forward(q, k, v, k_cache, v_cache, meta, *args)
    with LLM(tiny_model, device="cpu", kvcache_block_size=16, max_num_seqs=8) as llm:
        as_on_cuda(llm, graphs=True, sample_in_graph=False)
        for layer in llm.model_runner.attn_layers:
            layer.backend = Recording()
        llm.generate(prompts(7, seed=4), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                     use_tqdm=False)
    assert orders and any(order != sorted(order) for order, _ in orders)
    for order, lens in orders:
        assert sorted(order) == list(range(len(lens)))
        assert [lens[i] for i in order] == sorted(lens, reverse=True)


@needs_interpreter
def test_graph_replays_take_the_graph_of_the_smallest_bound_on_their_contexts(tiny_model):
    """A backend that plans short contexts apart (here bounds of 24 and 48 tokens at batch sizes up to 2) gets a
    graph per bound and size; each replay runs the one whose bound is the smallest that holds its longest context,
    as its metadata's max_seqlen_k tells the backend, and the tokens are those of eager steps."""
    seen = []  # (max_seqlen_k, longest context, graph's batch size) of each replay's attention

    class Recording(GraphMetaBackend):
        def forward(self, q, k, v, k_cache, v_cache, meta, *args):
            if meta.decode_order is not None:
                seen.append((meta.max_seqlen_k, max(meta.context_lens.tolist()), len(meta.context_lens)))
            return super().forward(q, k, v, k_cache, v_cache, meta, *args)
    batch, params = [[5, 6, 7, 8, 9], [3] * 9], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with LLM(tiny_model, device="cpu", kvcache_block_size=16, max_num_seqs=8) as llm:
        longest = llm.config.max_model_len  # (a bound of it or past it is the graph of any context)
        as_on_cuda(llm, graphs=True, sample_in_graph=False,
                   context_bounds=lambda bs: [24, 48, longest, 2 * longest] if bs <= 2 else [])
        assert llm.model_runner.graphs.bounds == {1: [24, 48, longest], 2: [24, 48, longest], 4: [longest],
                                                  8: [longest]}
        for layer in llm.model_runner.attn_layers:
            layer.backend = Recording()
        outputs = [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]
    assert outputs == generate(tiny_model, batch, params, graphs=False)
    assert {bound for bound, *_ in seen} == {24, 48, longest}
    for bound, context, bs in seen:
        assert bound == next(b for b in (24, 48, longest) if b >= context) and bs <= 2


@needs_interpreter
def test_decode_batches_wider_than_every_graph_run_eagerly(tiny_model):
    # graphs for up to 4 sequences (on CUDA: 512 at most) under max_num_seqs=8: decode steps of 5-7 run eagerly
    batch = prompts(7, seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert generate(tiny_model, batch, params, graphs=True, graphs_up_to=4) == generate(tiny_model, batch, params,
                                                                                         graphs=False)


@needs_interpreter
def test_graph_replays_beside_full_sampler_rows(tiny_model):
    # seeded, logprobs and penalized rows take the full sampler from the graph's logits (a penalized row's
    # history grows on the device from each step's samples); chunked prompts make steps of both kinds. The first
    # request holds block 0, where a padding row would write if its slot were not -1
    batch = prompts(7, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=1, top_k=5, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.8,
                             frequency_penalty=0.6, presence_penalty=0.4)]
    outputs = []
    for graphs in (False, True):
        with LLM(tiny_model, device="cpu", kvcache_block_size=16, max_num_seqs=8,
                 max_num_batched_tokens=48) as llm:
            as_on_cuda(llm, graphs)
            outputs.append(llm.generate(batch, params, use_tqdm=False))
    eager, graphs = outputs
    assert [o["token_ids"] for o in graphs] == [o["token_ids"] for o in eager]
    penalized = graphs[-1]["token_ids"]  # greedy on this model repeats within 30 tokens; its penalties forbid it
    assert len(set(penalized)) == len(penalized) == 30
    # the logits themselves: a padding row that wrote into a sequence's cache would move them
    for got, expected in zip(graphs[0]["logprobs"], eager[0]["logprobs"], strict=True):
        assert got.keys() == expected.keys() and all(abs(got[t] - expected[t]) < 1e-5 for t in got)
