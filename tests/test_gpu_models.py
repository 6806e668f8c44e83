"""Each family on CUDA in bf16, real widths with 2 layers and a 32k vocabulary (the MoE with 64 of 128 experts):
greedy tokens teacher-forced against HF at bf16 tolerance; the MoE's CUDA-graph decode equals its eager decode bit
for bit. load_format="dummy" on CUDA is what `bench.py --shape qwen3-30b-a3b` runs."""
import random

import pytest
import torch

from nanovllm import LLM
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import OnCuda, assert_greedy_matches_hf, greedy

pytestmark = pytest.mark.gpu

SHAPES = {
    "llama-3.2-1b": {},
    "qwen2.5-0.5b": {},
    "mistral-7b": {},
    "qwen3-30b-a3b": dict(num_experts=64),
}
# a near-tie routed differently (bf16 router logits) moves logits more than bf16 rounding does
TOLERANCE = {"qwen3-30b-a3b": 0.3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {shape: str(make_random_checkpoint(tmp_path_factory.mktemp(shape), shape, num_hidden_layers=2,
                                              vocab_size=32768, **overrides))
            for shape, overrides in SHAPES.items()}


def prompts(n: int, seed: int = 0, lo: int = 20, hi: int = 600) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("shape", SHAPES)
def test_family_matches_hf_bf16(checkpoints, shape):
    from transformers import AutoModelForCausalLM
    path = checkpoints[shape]
    batch = prompts(8, seed=1)
    moe = shape == "qwen3-30b-a3b"  # with CUDA graphs: the fused experts replayed from a graph
    with LLM(path, max_model_len=2048, enforce_eager=not moe, max_num_seqs=16) as llm:
        assert llm.config.dtype == "bfloat16"
        outputs = llm.generate(batch, greedy(16), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    for prompt, out in zip(batch, outputs):
        assert_greedy_matches_hf(OnCuda(hf), prompt, out["token_ids"], atol=TOLERANCE.get(shape, 0.15))
    del hf
    torch.cuda.empty_cache()


def test_moe_cuda_graph_decode_equals_eager(checkpoints):
    # as test_gpu_engine's: every decode batch is a captured size
    batch = prompts(16, seed=2)
    path = checkpoints["qwen3-30b-a3b"]
    with LLM(path, enforce_eager=True, max_model_len=2048) as eager:
        expected = [o["token_ids"] for o in eager.generate(batch, greedy(32), use_tqdm=False)]
    with LLM(path, max_model_len=2048, max_num_seqs=16) as graphs:
        assert graphs.model_runner.graphs, "no CUDA graphs were captured"
        got = [o["token_ids"] for o in graphs.generate(batch, greedy(32), use_tqdm=False)]
    assert got == expected

