"""A step's inputs in one host-to-device copy, and decode graphs replayed eagerly on CPU: the same tokens."""
import dataclasses
import os
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
from tests import test_overlap
from tests.conftest import greedy
from tests.test_overlap import mixed_params, same_outputs

CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the Triton sampler runs on CPU tensors through Triton's interpreter")
prompts = partial(test_overlap.prompts, lo=4, hi=40)


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
            assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape and t.data_ptr() % 16 == 0
            assert np.array_equal(t.numpy(), a)
        tensors[0].fill_(-1)  # views of one packed copy: no piece overlaps another
        assert np.array_equal(tensors[1].numpy(), arrays[1])


def test_staging_waits_for_a_buffers_last_copy_before_refilling():
    waited = []
    staging = Staging(CPU, pack=True)  # CPU has no events
    staging.events = [SimpleNamespace(synchronize=partial(waited.append, i)) for i in range(2)]
    for step in range(4):
        staging.to_device(np.arange(4 + step))
        assert waited == [0, 1, 0, 1][:step + 1]  # each refill waits for that buffer's own last copy


def test_step_inputs_of_a_mixed_batch():
    """Blocks of 4: a chunk across a block edge sampling nothing, a decode pending on row 1, a prompt's last chunk."""
    chunk = Sequence(list(range(10, 20)))
    chunk.block_table, chunk.num_computed_tokens, chunk.num_scheduled_tokens = [7, 2, 5], 3, 5
    decode = Sequence([1, 2, 3, 4, 5])
    decode.append_pending(1)
    decode.block_table, decode.num_computed_tokens, decode.num_scheduled_tokens = [0, 9], 5, 1
    last = Sequence(list(range(30, 36)))
    last.block_table, last.num_computed_tokens, last.num_scheduled_tokens = [3, 6], 4, 2
    step = partial(step_inputs, block_size=4)
    inputs = step([chunk, decode, last])
    expected = dict(input_ids=[13, 14, 15, 16, 17, PENDING, 34, 35], positions=[3, 4, 5, 6, 7, 5, 4, 5],
                    slot_mapping=[31, 8, 9, 10, 11, 37, 24, 25], block_tables=[[7, 2, 5], [0, 9, 0], [3, 6, 0]],
                    context_lens=[8, 6, 6], query_lens=[5, 1, 2], cu_seqlens_q=[0, 5, 6, 8], logits_indices=[5, 7],
                    pending_rows=[-1, 1, -1])
    assert {name: getattr(inputs, name).tolist() for name in expected} == expected
    assert not inputs.is_decode and inputs.num_seqs == 3
    assert inputs.num_leading_decodes == 0  # the chunk comes first
    assert step([decode, last, decode]).num_leading_decodes == 1
    assert step([decode, decode, chunk]).num_leading_decodes == 2
    assert step([decode]).is_decode and step([decode, decode]).num_leading_decodes == 2


def test_a_step_before_the_cache_exists_writes_no_slot():
    """The sizing prefill runs before the KV cache exists: no blocks, every slot -1 (write nothing), never slot 0."""
    seqs = [Sequence(list(range(6))), Sequence([1, 2, 3])]
    for seq in seqs:
        seq.num_scheduled_tokens = seq.num_tokens
    inputs = step_inputs(seqs, block_size=4)
    assert inputs.slot_mapping.tolist() == [-1] * 9 and inputs.block_tables.shape == (2, 0)
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]


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
    def _capture(self, bs, bound, pool):
        return SimpleNamespace(replay=partial(self._forward, bs, bound), reset=lambda: None), pool


class GraphMetaBackend(TorchBackend):
    """The torch backend given the host lists that a graph's metadata lacks (one query token per row)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, *args):
        if meta.context_lens_host is None:
            meta = dataclasses.replace(meta, query_lens_host=[1] * len(meta.context_lens),
                                       context_lens_host=meta.context_lens.tolist())
        return super().forward(q, k, v, k_cache, v_cache, meta, *args)


def as_on_cuda(llm, graphs, sample_in_graph=True, graphs_up_to=None, context_bounds=None):
    """The runner as on CUDA: the sampler's device counter, packed inputs and, if `graphs`, eager decode graphs."""
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


def engine(tiny_model, **engine_args):
    return LLM(tiny_model, device="cpu", kvcache_block_size=16, max_num_seqs=8, **engine_args)


def eager(tiny_model, batch, params, **engine_args):
    with engine(tiny_model, **engine_args) as llm:
        return as_on_cuda(llm, graphs=False).generate(batch, params, use_tqdm=False)


def same_as_eager(tiny_model, batch, params, sample_in_graph=True, graphs_up_to=8, **engine_args):
    with engine(tiny_model, **engine_args) as llm:
        outputs = as_on_cuda(llm, True, sample_in_graph, graphs_up_to).generate(batch, params, use_tqdm=False)
        assert llm.model_runner.graphs.batch_sizes == [1, 2, 4, 8][:graphs_up_to.bit_length()]
    same_outputs(outputs, eager(tiny_model, batch, params, **engine_args))
    return outputs


def record_replays(llm, record):
    class Recording(GraphMetaBackend):
        def forward(self, q, k, v, k_cache, v_cache, meta, *args):
            if meta.decode_order is not None:
                record(meta)
            return super().forward(q, k, v, k_cache, v_cache, meta, *args)
    for layer in llm.model_runner.attn_layers:
        layer.backend = Recording()


@needs_interpreter
@pytest.mark.parametrize("sample_in_graph", [True, False], ids=["graph-samples", "graph-ends-at-logits"])
def test_graph_replays_equal_eager_steps(tiny_model, sample_in_graph):
    # plain rows draw once a step from the device counter, graph or not: even temperature rows agree
    batch = prompts(7, seed=1)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(batch))]
    same_as_eager(tiny_model, batch, params, sample_in_graph)


@needs_interpreter
def test_graph_replays_send_the_decode_kernel_longest_contexts_first(tiny_model):
    """Each replay's `decode_order` (the decode kernel's program order): its rows, longest context first."""
    orders = []
    with engine(tiny_model) as llm:
        as_on_cuda(llm, graphs=True, sample_in_graph=False)
        record_replays(llm, lambda meta: orders.append((meta.decode_order.tolist(), meta.context_lens.tolist())))
        llm.generate(prompts(7, seed=4), greedy(5), use_tqdm=False)
    assert orders and any(order != sorted(order) for order, _ in orders)
    for order, lens in orders:
        assert sorted(order) == list(range(len(lens)))
        assert [lens[i] for i in order] == sorted(lens, reverse=True)


@needs_interpreter
def test_graph_replays_take_the_graph_of_the_smallest_bound_on_their_contexts(tiny_model):
    """A graph per context bound and size; a replay runs the smallest bound that holds its longest context."""
    seen = []  # (max_seqlen_k, longest context, batch size)
    batch, params = [[5, 6, 7, 8, 9], [3] * 9], greedy(50)
    with engine(tiny_model) as llm:
        longest = llm.config.max_model_len  # (a bound of it or past it holds any context)
        as_on_cuda(llm, graphs=True, sample_in_graph=False,
                   context_bounds=lambda bs: [24, 48, longest, 2 * longest] if bs <= 2 else [])
        assert llm.model_runner.graphs.bounds == {1: [24, 48, longest], 2: [24, 48, longest], 4: [longest],
                                                  8: [longest]}
        record_replays(llm, lambda meta: seen.append((meta.max_seqlen_k, max(meta.context_lens.tolist()),
                                                     len(meta.context_lens))))
        outputs = llm.generate(batch, params, use_tqdm=False)
    same_outputs(outputs, eager(tiny_model, batch, params))
    assert {bound for bound, *_ in seen} == {24, 48, longest}
    for bound, context, bs in seen:
        assert bound == next(b for b in (24, 48, longest) if b >= context) and bs <= 2


@needs_interpreter
def test_decode_batches_wider_than_every_graph_run_eagerly(tiny_model):
    # graphs for up to 4 sequences under max_num_seqs=8: decode steps of 5-7 run eagerly
    same_as_eager(tiny_model, prompts(7, seed=2), greedy(8), graphs_up_to=4)


@needs_interpreter
def test_graph_replays_beside_full_sampler_rows(tiny_model):
    # full-sampler rows beside chunked prompts; the first request holds block 0, where a padding row would write
    batch = prompts(7, seed=3)
    params = [greedy(14, logprobs=2), SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True),
              greedy(12), SamplingParams(temperature=0.7, seed=1, top_k=5, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1), greedy(15),
              greedy(30, repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.4)]
    # a padding row writing into a cache would move the logprobs; penalties forbid greedy's repeats in 30 tokens
    penalized = same_as_eager(tiny_model, batch, params, max_num_batched_tokens=48)[-1]["token_ids"]
    assert len(set(penalized)) == len(penalized) == 30
