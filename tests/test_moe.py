"""Mixture of experts against transformers (ties, TP=2 included); the fused Triton kernels against the torch path."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from nanovllm import LLM
from nanovllm.layers.moe import SparseMoeBlock, experts_torch, route
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import assert_greedy_matches_hf, built_on_ranks, compile_for_sm90, greedy
from tests.test_models import PROMPTS, check_against_hf, hf_model

def load_per_expert(experts, gate_up, down):  # per-expert tensors, as a checkpoint stores them
    for e in range(gate_up.size(0)):
        gate, up = gate_up[e].chunk(2)
        experts.weight_loader(experts.gate_up_proj, gate, (e, "gate"))
        experts.weight_loader(experts.gate_up_proj, up, (e, "up"))
        experts.weight_loader(experts.down_proj, down[e], (e, "down"))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("ties", ["none", "all equal", "duplicate experts"])
def test_routing_equals_transformers(renormalize, ties):
    gen = torch.Generator().manual_seed(0)
    num_experts, top_k, hidden = 16, 4, 32
    weight = torch.randn(num_experts, hidden, generator=gen)
    if ties == "all equal":
        weight.zero_()  # all probabilities equal: torch.topk alone decides
    elif ties == "duplicate experts":
        weight[5] *= 3  # five bit-equal experts, often in the top 4
        weight[[3, 7, 8, 12]] = weight[5].clone()
    x = torch.randn(64, hidden, generator=gen)
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=hidden, num_experts=num_experts,
                                               num_experts_per_tok=top_k, norm_topk_prob=renormalize))
    router.weight.data.copy_(weight)
    _, hf_weights, hf_ids = router(x)
    weights, ids = route(torch.nn.functional.linear(x, weight), top_k, renormalize)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    if ties == "all equal":  # not the lowest indices: the same topk
        assert ids[0].tolist() != list(range(top_k))


def test_torch_experts_equal_transformers_block():
    config = Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True)
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config).eval()
    for param in hf.parameters():
        param.data.normal_(0, 0.3)
    ours = SparseMoeBlock(48, 24, 8, 2, renormalize=True)
    ours.gate.weight.data.copy_(hf.gate.weight)
    load_per_expert(ours.experts, hf.experts.gate_up_proj, hf.experts.down_proj)
    x = torch.randn(1, 40, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], atol=1e-5, rtol=1e-5)


def moe_checkpoint_with_ties(path: Path, **overrides) -> Path:
    """tiny-qwen3-moe with all router probabilities equal in layer 0, bit-equal experts 1, 4, 6 in layer 1."""
    path = make_random_checkpoint(path, "tiny-qwen3-moe", **overrides)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.gate.weight"].zero_()
    router = tensors["model.layers.1.mlp.gate.weight"]
    router[[1, 4, 6]] = router[1] * 2  # often in a token's top 2: which wins matters
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_engine_routes_ties_as_transformers(tmp_path):
    check_against_hf(moe_checkpoint_with_ties(tmp_path / "ties"))


def test_tensor_parallel_moe_and_biases(tmp_path):
    # TP=2 shards the intermediate dim; column-parallel biases sharded, row-parallel ones added once
    moe = moe_checkpoint_with_ties(tmp_path / "moe", num_hidden_layers=3, mlp_only_layers=[2])
    check_against_hf(moe, tensor_parallel_size=2)
    llama = make_random_checkpoint(tmp_path / "llama", "tiny-llama", attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=False)
    check_against_hf(llama, tensor_parallel_size=2)


def test_stacked_expert_tensors_shard_as_per_expert_ones(monkeypatch):
    """Stacked expert tensors give each of 2 ranks the share that per-expert ones (equal to HF at TP=2) give it."""
    from nanovllm.layers import moe
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tp = 3, 8, 6, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)

    def both_loaded():
        stacked, per_expert = moe.StackedExperts(experts, hidden, inter), moe.StackedExperts(experts, hidden, inter)
        stacked.weight_loader(stacked.gate_up_proj, gate_up)
        stacked.weight_loader(stacked.down_proj, down)
        load_per_expert(per_expert, gate_up, down)
        return stacked, per_expert

    for stacked, per_expert in built_on_ranks(monkeypatch, moe, tp, both_loaded):
        assert torch.equal(stacked.gate_up_proj, per_expert.gate_up_proj)
        assert torch.equal(stacked.down_proj, per_expert.down_proj)


def test_num_experts_per_tok_past_num_experts_is_an_error(tmp_path):
    path = make_random_checkpoint(tmp_path / "moe", "tiny-qwen3-moe", num_experts=4, num_experts_per_tok=5,
                                  with_weights=False)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
        LLM(str(path), load_format="dummy")


def test_moe_intermediate_size_must_divide_by_tp(tmp_path):
    path = make_random_checkpoint(tmp_path / "moe", "tiny-qwen3-moe", moe_intermediate_size=33)
    with pytest.raises(ValueError, match="moe_intermediate_size=33 does not divide by tensor_parallel_size=2"):
        LLM(str(path), tensor_parallel_size=2)


def test_routing_spreads_over_experts(tmp_path):
    """Tokens of the random MoE go to every expert, not a favourite few, so it tests routing."""
    path = make_random_checkpoint(tmp_path / "moe", "tiny-qwen3-moe")
    hf = hf_model(path)
    counts = torch.zeros(8)

    def count(module, inputs, outputs):
        counts.add_(torch.bincount(outputs[2].flatten(), minlength=8))

    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in hf.model.layers]
    with torch.no_grad():
        hf(torch.tensor([PROMPTS[2]]))
    for hook in hooks:
        hook.remove()
    assert counts.min() > 0.02 * counts.sum()  # uniform would be 1/8 each
    with LLM(str(path), kvcache_block_size=16) as llm:
        out = llm.generate(PROMPTS[2:3], greedy(8), use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS[2], out[0]["token_ids"])


# ---- the fused Triton kernels

QWEN3_30B = (128, 8, 2048, 768)  # experts, top_k, hidden, intermediate
# (tokens, experts, top_k, hidden, intermediate, block config (None: the engine's), expert loads)
KERNEL_CASES = [
    (1, 8, 2, 32, 48, None, "random"),
    (7, 16, 4, 64, 32, None, "random"),
    (40, 8, 2, 48, 40, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16), "random"),
    (33, 6, 3, 40, 24, dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32), "half the experts idle"),
    (50, 12, 1, 32, 16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16), "one expert takes nearly all"),
    (20, 5, 5, 16, 16, dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=16), "random"),
    (1, 16, 16, 16, 16, None, "random"),  # a block for each expert's one pair: the most padding there can be
    (40, 128, 4, 16, 16, None, "random"),  # 160 pairs: the alignment counts them in chunks of 64
]


def kernel_inputs(case, dtype=torch.float32, device="cpu", seed=0):
    tokens, experts, top_k, hidden, inter, _, load = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if load == "half the experts idle":
        logits[:, ::2] -= 100
    elif load == "one expert takes nearly all":
        logits[:, 3] += 100
        logits[0, 3] -= 200
    to = dict(dtype=dtype, device=device)
    weights, ids = route(logits.to(**to), top_k, renormalize=True)
    return x.to(**to), gate_up.to(**to), down.to(**to), weights, ids


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, sorted_pairs, block_experts):
    """Each expert's run: its pairs in order, padded with the sentinel to whole blocks; each block's expert."""
    num_pairs, flat = ids.numel(), ids.flatten().tolist()
    pairs, blocks = sorted_pairs.tolist(), block_experts.tolist()
    row = 0
    for e in range(num_experts):
        mine = [p for p in range(num_pairs) if flat[p] == e]
        padded = -(-len(mine) // block_m) * block_m
        assert pairs[row:row + len(mine)] == mine
        assert pairs[row + len(mine):row + padded] == [num_pairs] * (padded - len(mine))
        assert blocks[row // block_m:(row + padded) // block_m] == [e] * (padded // block_m)
        row += padded
    assert blocks[row // block_m:] == [num_experts] * (len(blocks) - row // block_m)


def check_kernels(case, dtype=torch.float32, device="cpu", tol=1e-5):
    from nanovllm.layers import triton_moe
    x, gate_up, down, weights, ids = kernel_inputs(case, dtype, device)
    config = case[5] and dict(case[5], num_warps=4, num_stages=2)
    got = triton_moe.fused_experts(x, gate_up, down, weights, ids, config).float()
    expected = experts_torch(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    block_m = (config or triton_moe.block_config(ids.numel(), gate_up.size(0)))["BLOCK_M"]
    check_alignment(ids.cpu(), gate_up.size(0), block_m,
                    *(t.cpu() for t in triton_moe.align(ids, gate_up.size(0), block_m)))


def interpreted_kernel_checks():  # under TRITON_INTERPRET=1
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case in KERNEL_CASES:
        check_kernels(case)
    print("interpreted kernel checks passed")


def test_fused_kernels_interpreted():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":  # set by conftest on CPU
        return interpreted_kernel_checks()
    result = subprocess.run([sys.executable, "-c", "from tests.test_moe import interpreted_kernel_checks as c; c()"],
                            cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, TRITON_INTERPRET="1"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "checks passed" in result.stdout, result.stdout + result.stderr


def test_fused_kernels_compile_for_sm90():
    """Qwen3-30B-A3B's alignment, gate/up GEMM (decode) and down GEMM (prefill)."""
    pytest.importorskip("triton")
    from nanovllm.layers import triton_moe
    experts, top_k, m = 128, 8, "nanovllm.layers.triton_moe"
    decode, prefill = triton_moe.block_config(top_k, experts), triton_moe.block_config(8192 * top_k, experts)
    ints = dict(sorted_pairs_ptr="*i32", block_experts_ptr="*i32", num_pairs="i32")
    cases = [(m, "_align_kernel", dict(ints, expert_ids_ptr="*i64", num_blocks="i32"),
              dict(NUM_EXPERTS=experts, EXPERTS_POW2=experts, BLOCK_M=decode["BLOCK_M"], CHUNK=8192 // experts))]
    gemm = dict(ints, a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", route_weights_ptr="*bf16", N="i32", K="i32",
                stride_a="i32", stride_we="i32", stride_wn="i32", stride_out="i32")  # an expert's weights < 2**31
    for config, gated in ((decode, True), (prefill, False)):
        tiles, launch = ({k: config[k] for k in keys} for keys in (("BLOCK_M", "BLOCK_N", "BLOCK_K"),
                                                                    ("num_warps", "num_stages")))
        cases.append((m, "_grouped_gemm_kernel", gemm, dict(tiles, PAIRS_PER_A_ROW=top_k if gated else 1, GATED=gated,
                      ROUTE_WEIGHTED=not gated, NUM_EXPERTS=experts, DOT_PRECISION="tf32"), launch))
    compile_for_sm90(cases)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES[1::2] + [(n, *QWEN3_30B, None, load) for n, load in (
    (256, "random"), (1, "random"), (3000, "half the experts idle"))])
def test_fused_kernels_cuda_bf16(case):
    check_kernels(case, torch.bfloat16, "cuda", 3e-2)


@pytest.mark.gpu
def test_fused_kernels_cuda_float32_take_no_tf32():  # tf32's 10-bit products would miss by ~1e-3
    check_kernels((64, 16, 4, 256, 128, None, "random"), device="cuda", tol=1e-4)


@pytest.mark.gpu
def test_fused_kernels_in_a_cuda_graph():
    """Captured once, replayed with other routings: no host value is baked in."""
    from nanovllm.layers import triton_moe
    case = (64, *QWEN3_30B, None, "random")
    x, gate_up, down, weights, ids = kernel_inputs(case, torch.bfloat16, "cuda")
    triton_moe.fused_experts(x, gate_up, down, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_experts(x, gate_up, down, weights, ids)
    for seed, load in ((1, "random"), (2, "half the experts idle"), (3, "one expert takes nearly all")):
        new = kernel_inputs(case[:6] + (load,), torch.bfloat16, "cuda", seed)
        for static, fresh in zip((x, weights, ids), (new[0], new[3], new[4])):
            static.copy_(fresh)
        graph.replay()
        expected = experts_torch(x.float(), gate_up.float(), down.float(), weights.float(), ids)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_a_config_of_no_experts_is_dense_as_in_transformers():
    from nanovllm.models.decoder import MLPOptions
    from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(num_experts=0, intermediate_size=48, moe_intermediate_size=16)
    assert Qwen3MoeForCausalLM.mlp_options(config, 0) == MLPOptions(48)
