"""The engine on CUDA: graph decode equals eager, the sampler in the graphs equals it run after them, greedy
tokens match HF at bf16 tolerance, the sampling controls run beside the fast path."""
from functools import partial

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests import test_overlap
from tests.conftest import OnCuda, assert_greedy_matches_hf, greedy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory) -> str:
    return str(make_random_checkpoint(tmp_path_factory.mktemp("qwen3-0.6b"), "qwen3-0.6b"))


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory) -> str:
    """Qwen3-0.6B's widths with 4 layers: bf16 error stays small enough for a teacher-forced check."""
    return str(make_random_checkpoint(tmp_path_factory.mktemp("qwen3-4l"), "qwen3-0.6b", num_hidden_layers=4))


prompts = partial(test_overlap.prompts, lo=20, hi=600, vocab=10000)


def generated(llm, batch, params) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]


def hf_bf16(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()


def assert_matches_hf_bf16(hf, batch, outputs, atol=0.15):
    for prompt, out in zip(batch, outputs):
        assert_greedy_matches_hf(OnCuda(hf), prompt, out["token_ids"], atol=atol)


def test_auto_backend_is_flash_attn_when_it_imports(qwen3_small):
    pytest.importorskip("flash_attn")
    from nanovllm.layers.flash_attention import triton_decode_measured_faster
    with LLM(qwen3_small, enforce_eager=True, max_model_len=1024) as llm:  # Triton decode where it measured faster
        assert llm.model_runner.backend.name == ("triton-decode" if triton_decode_measured_faster() else "flash-attn")
        assert llm.config.dtype == "bfloat16"


def test_cuda_graph_decode_equals_eager(qwen3_06b):
    # 16 sequences finish together, so every decode batch is exactly a captured size: same kernels, same bits
    batch = prompts(16)
    with LLM(qwen3_06b, enforce_eager=True, max_model_len=2048) as eager:
        expected = generated(eager, batch, greedy(48))
    with LLM(qwen3_06b, max_model_len=2048, max_num_seqs=20) as graphs:
        assert graphs.model_runner.graphs is not None, "no CUDA graphs were captured"
        assert graphs.model_runner.graphs.batch_sizes == [1, 2, 4, 8, 16, 20]
        if graphs.model_runner.backend.name in ("triton", "triton-decode"):  # short contexts' graphs: fewer splits
            assert graphs.model_runner.graphs.bounds[1] == [128, 256, 512, 1024, 2048]
        # a long batch first leaves long block tables behind; the next replay must not read them
        graphs.generate(prompts(20, seed=1, lo=1500, hi=2000), greedy(8), use_tqdm=False)
        got = generated(graphs, batch, greedy(48))
    assert got == expected


def test_overlap_equals_synchronous_on_cuda(qwen3_small):
    # requests that end at max_tokens: both engines run the same batches, so the same kernels give the same bits
    batch = prompts(24, seed=6, lo=20, hi=400)
    params = [greedy(40 + i) if i % 3 == 0 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=30 + i, ignore_eos=True, logprobs=2) if i % 3 == 1
              else SamplingParams(temperature=0, max_tokens=1) for i in range(len(batch))]
    outputs = []
    for async_scheduling in (True, False):
        with LLM(qwen3_small, max_model_len=1024, async_scheduling=async_scheduling) as llm:
            outputs.append(llm.generate(batch, params, use_tqdm=False))
            stats = llm.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
    on, off = outputs
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    assert [len(o["token_ids"]) for o in on] == [p.max_tokens for p in params]


@pytest.mark.parametrize("block_size", [16, 256])
def test_engine_matches_hf_bf16(qwen3_small, block_size):
    hf = hf_bf16(qwen3_small)
    batch = prompts(12, seed=2)
    shared = prompts(1, seed=3, lo=300, hi=300)[0]
    batch += [shared + [5, 6, 7], shared + [8] * 40]  # prefix-cache hits on the second call, at any block size
    with LLM(qwen3_small, kvcache_block_size=block_size, max_model_len=2048) as llm:
        runner = llm.model_runner  # the defaults: piecewise graphs and the fused rope+store
        assert runner.piecewise is not None and all(layer.fuse_rope_store for layer in runner.attn_layers)
        llm.generate(batch, greedy(4), use_tqdm=False)
        outputs = llm.generate(batch, greedy(24), use_tqdm=False)
    assert outputs[-1]["num_cached_tokens"] > 0
    assert_matches_hf_bf16(hf, batch, outputs)


@pytest.mark.parametrize("fused", ["0", "1"])
def test_piecewise_graphs_match_hf_bf16(qwen3_small, monkeypatch, fused):
    """Prefill chunks of up to 300 tokens beside decodes: every step not decode-only replays the pieces; with the
    fused q/k norm, rope and KV store in the pieces and the decode graphs, or not."""
    monkeypatch.setenv("NANOVLLM_PIECEWISE_GRAPHS", "1")
    monkeypatch.setenv("NANOVLLM_VARLEN_GRAPHS", "0")  # which would take these steps
    monkeypatch.setenv("NANOVLLM_FUSED_ROPE_STORE", fused)
    hf = hf_bf16(qwen3_small)
    batch = prompts(12, seed=4, lo=20, hi=700)
    with LLM(qwen3_small, max_model_len=1024, max_num_batched_tokens=300, max_num_seqs=8) as llm:
        piecewise = llm.model_runner.piecewise
        assert piecewise is not None and piecewise.sizes[-1] == 300
        assert all(layer.fused_store == (fused == "1") for layer in llm.model_runner.attn_layers)
        steps, run = [], piecewise.run
        piecewise.run = lambda input_ids, *args: steps.append(len(input_ids)) or run(input_ids, *args)
        outputs = llm.generate(batch, greedy(24), use_tqdm=False)
    assert steps and any(n not in piecewise.sizes for n in steps)  # padded steps among them
    assert_matches_hf_bf16(hf, batch, outputs)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_varlen_graphs_match_hf_bf16(qwen3_small, backend):
    """Prompts of 20-700 tokens, 8 at a time: prefills, chunks and mixed steps of up to 300 tokens each replay one
    whole graph (Triton varlen through a tile map), padded to their size."""
    hf = hf_bf16(qwen3_small)
    batch = prompts(12, seed=5, lo=20, hi=700)
    with LLM(qwen3_small, max_model_len=1024, max_num_batched_tokens=300, max_num_seqs=8,
             attention_backend=backend) as llm:
        graphs = llm.model_runner.varlen_graphs
        assert graphs is not None and graphs.sizes[-1] == 300
        steps, run = [], graphs.run
        graphs.run = lambda inputs, *args: steps.append((len(inputs.input_ids), inputs.num_seqs)) or run(inputs, *args)
        outputs = llm.generate(batch, greedy(24), use_tqdm=False)
    assert any(n not in graphs.sizes for n, _ in steps)  # padded steps
    assert any(seqs > 1 and n < 300 for n, seqs in steps)  # and mixed ones
    assert_matches_hf_bf16(hf, batch, outputs)


def test_kv_cache_too_small_is_a_clear_error(qwen3_small):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(qwen3_small, gpu_memory_utilization=0.0015, max_model_len=40960)


def test_sampling_controls_on_cuda(qwen3_small):
    # the eager sampler beside the compiled one, CUDA graphs on; one-block prompts: no prefix hits, same bits
    batch = prompts(6, seed=4, lo=20, hi=200)
    with LLM(qwen3_small, max_model_len=1024) as llm:
        top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True, logprobs=1)
        for out in llm.generate(batch, top1, use_tqdm=False):
            for token_id, entry in zip(out["token_ids"], out["logprobs"], strict=True):
                assert entry[token_id] == max(entry.values())  # the sampled token is a likeliest one (ties in bf16)
        seeded = [SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, max_tokens=16, ignore_eos=True, seed=s,
                                 logprobs=3, repetition_penalty=1.2) for s in range(len(batch))]
        first, second = (llm.generate(batch, seeded, use_tqdm=False) for _ in range(2))
        assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
        for out in first:
            for token_id, entry in zip(out["token_ids"], out["logprobs"], strict=True):
                assert next(iter(entry)) == token_id and len(entry) in (3, 4)
                assert all(-1e4 < value <= 0 for value in entry.values())
        free = generated(llm, batch[:1], greedy(16))[0]
        index = max(i for i in range(15) if free[i] not in free[:i])  # a new token, not the last allowed (length)
        stopped = greedy(16, stop_token_ids=[free[index]])
        out = llm.generate(batch[:1], stopped, use_tqdm=False)[0]
    assert out["token_ids"] == free[:index + 1] and out["stop_reason"] == free[index]


def counting_graph_draws(llm) -> list[bool]:
    """Per decode replay from now on: did the graph's own sampler give the step's tokens?"""
    graphs, drawn = llm.model_runner.graphs, []
    replay = graphs.replay

    def counted(*args):
        logits, sampled = replay(*args)
        drawn.append(sampled is not None)
        return logits, sampled
    graphs.replay = counted
    return drawn


def test_graph_sampler_equals_eager_sampler(qwen3_small, monkeypatch):
    # plain rows: in the graph or after it, the sampler draws from one device counter, and 16 sequences finishing
    # together replay one graph, so even the temperature rows agree token for token
    batch = prompts(16, seed=7, lo=20, hi=300)
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, max_tokens=40, ignore_eos=True) for i in range(16)]
    outputs = []
    for sample_in_graph in ("1", "0"):
        monkeypatch.setenv("NANOVLLM_GRAPH_SAMPLER", sample_in_graph)
        with LLM(qwen3_small, max_model_len=1024, max_num_seqs=16) as llm:
            drawn = counting_graph_draws(llm)
            outputs.append(generated(llm, batch, params))
        assert len(drawn) >= 38 and all(drawn) == (sample_in_graph == "1") and any(drawn) == all(drawn)
    in_graph, after_graph = outputs
    assert in_graph == after_graph
    assert len({tuple(tokens) for tokens in in_graph[::2]}) > 1  # the temperature rows did sample


def test_seeded_engines_sample_the_same_tokens(qwen3_small):
    # plain temperature rows draw from the engine's seed: two engines of one config agree, another seed does not
    batch = prompts(12, seed=8, lo=20, hi=300)
    params = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.6, max_tokens=20, ignore_eos=True)] * 6
    runs = []
    for seed in (3, 3, 4):
        with LLM(qwen3_small, max_model_len=1024, max_num_seqs=16, seed=seed) as llm:
            drawn = counting_graph_draws(llm)
            runs.append(generated(llm, batch, params))
            assert any(drawn)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_float32_engine_on_cuda_matches_hf(tiny_model, hf_model):
    """The tiny float32 checkpoint on CUDA: Triton attention (flash-attn takes no float32), split decode, graphs and
    overlap; its 4,096 positions are under the 16,384-token budget: the warm-up must stay within the rope table."""
    batch = prompts(10, seed=7, lo=2, hi=300, vocab=500)
    with LLM(tiny_model, kvcache_block_size=16, max_model_len=1024) as llm:
        assert llm.model_runner.graphs is not None and llm.config.dtype == "float32"
        outputs = llm.generate(batch, greedy(20), use_tqdm=False)
    for prompt, out in zip(batch, outputs):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"], atol=1e-3)
