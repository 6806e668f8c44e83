"""Each family on CUDA in bf16, real widths with 2 layers and a 32k vocabulary (the MoE with 64 of 128 experts):
greedy tokens teacher-forced against HF at bf16 tolerance; the MoE's CUDA-graph decode equals its eager decode bit
for bit. (Dummy weights on CUDA: `bench.py --shape qwen3-30b-a3b`.)"""
import pytest
import torch

from nanovllm import LLM
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import greedy
from tests.test_gpu_engine import assert_matches_hf_bf16, generated, hf_bf16, prompts

pytestmark = pytest.mark.gpu

SHAPES = {"llama-3.2-1b": {}, "qwen2.5-0.5b": {}, "mistral-7b": {}, "qwen3-30b-a3b": dict(num_experts=64)}
# a near-tie routed differently (bf16 router logits) moves logits more than bf16 rounding does
TOLERANCE = {"qwen3-30b-a3b": 0.3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {shape: str(make_random_checkpoint(tmp_path_factory.mktemp(shape), shape, num_hidden_layers=2,
                                              vocab_size=32768, **overrides))
            for shape, overrides in SHAPES.items()}


@pytest.mark.parametrize("shape", SHAPES)
def test_family_matches_hf_bf16(checkpoints, shape):
    path = checkpoints[shape]
    batch = prompts(8, seed=1)
    moe = shape == "qwen3-30b-a3b"  # with CUDA graphs: the fused experts replayed from a graph
    with LLM(path, max_model_len=2048, enforce_eager=not moe, max_num_seqs=16) as llm:
        assert llm.config.dtype == "bfloat16"
        outputs = llm.generate(batch, greedy(16), use_tqdm=False)
    assert_matches_hf_bf16(hf_bf16(path), batch, outputs, atol=TOLERANCE.get(shape, 0.15))
    torch.cuda.empty_cache()  # the HF model's, before the next shape


def test_moe_cuda_graph_decode_equals_eager(checkpoints):
    # as test_gpu_engine's: every decode batch is a captured size
    batch = prompts(16, seed=2)
    path = checkpoints["qwen3-30b-a3b"]
    with LLM(path, enforce_eager=True, max_model_len=2048) as eager:
        expected = generated(eager, batch, greedy(32))
    with LLM(path, max_model_len=2048, max_num_seqs=16) as graphs:
        assert graphs.model_runner.graphs, "no CUDA graphs were captured"
        got = generated(graphs, batch, greedy(32))
    assert got == expected

