"""Mixture of experts: routing equals transformers' (ties included), the torch experts equal transformers' block,
the engine equals HF with tied router probabilities and at TP=2, and the fused Triton kernels equal the torch
path (on CPU under TRITON_INTERPRET=1, in float32; on CUDA in bfloat16 and inside a CUDA graph)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from nanovllm import LLM, SamplingParams
from nanovllm.layers.moe import SparseMoeBlock, experts_torch, route
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import assert_greedy_matches_hf, built_on_ranks, compile_for_sm90
from tests.test_models import PROMPTS, check_against_hf, hf_model

REPO = Path(__file__).resolve().parents[1]


def hf_router(num_experts: int, top_k: int, renormalize: bool, weight: torch.Tensor) -> Qwen3MoeTopKRouter:
    config = Qwen3MoeConfig(hidden_size=weight.size(1), num_experts=num_experts, num_experts_per_tok=top_k,
                            norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    router.weight.data.copy_(weight)
    return router


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("ties", ["none", "all equal", "duplicate experts"])
def test_routing_equals_transformers(renormalize, ties):
    gen = torch.Generator().manual_seed(0)
    num_experts, top_k, hidden = 16, 4, 32
    weight = torch.randn(num_experts, hidden, generator=gen)
    if ties == "all equal":
        weight.zero_()  # every probability is 1 / num_experts: torch.topk alone decides
    elif ties == "duplicate experts":
        weight[5] *= 3  # five experts with bit-equal probabilities, often in the top 4
        weight[[3, 7, 8, 12]] = weight[5].clone()
    x = torch.randn(64, hidden, generator=gen)
    _, hf_weights, hf_ids = hf_router(num_experts, top_k, renormalize, weight)(x)
    weights, ids = route(torch.nn.functional.linear(x, weight), top_k, renormalize)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    if ties == "all equal":  # not simply the lowest indices: matching means using the same topk
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
    for e in range(8):  # per-expert tensors, as a checkpoint stores them
        gate, up = hf.experts.gate_up_proj[e].chunk(2)
        ours.experts.weight_loader(ours.experts.gate_up_proj, gate, (e, "gate"))
        ours.experts.weight_loader(ours.experts.gate_up_proj, up, (e, "up"))
        ours.experts.weight_loader(ours.experts.down_proj, hf.experts.down_proj[e], (e, "down"))
    x = torch.randn(1, 40, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], atol=1e-5, rtol=1e-5)


def moe_checkpoint_with_ties(path: Path, **overrides) -> Path:
    """tiny-qwen3-moe with every router probability equal in layer 0 and bit-equal experts 1, 4, 6 in layer 1."""
    path = make_random_checkpoint(path, "tiny-qwen3-moe", **overrides)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.gate.weight"].zero_()
    router = tensors["model.layers.1.mlp.gate.weight"]
    router[[1, 4, 6]] = router[1] * 2  # likely among the top 2 of a token, so which one wins matters
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_engine_routes_ties_as_transformers(tmp_path):
    check_against_hf(moe_checkpoint_with_ties(tmp_path / "ties"))


def test_tensor_parallel_moe_and_biases(tmp_path):
    # TP=2 shards each expert's intermediate dim (and a dense layer's); biases of q/k/v and gate/up (column
    # parallel) are sharded, those of o and down (row parallel) added once; the router is replicated
    moe = moe_checkpoint_with_ties(tmp_path / "moe", num_hidden_layers=3, mlp_only_layers=[2])
    check_against_hf(moe, tensor_parallel_size=2)
    llama = make_random_checkpoint(tmp_path / "llama", "tiny-llama", attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=False)
    check_against_hf(llama, tensor_parallel_size=2)


def test_stacked_expert_tensors_shard_as_per_expert_ones(monkeypatch):
    """Stacked expert tensors (gate_up_proj [experts, 2 * intermediate, hidden]: gates, then ups; down_proj
    [experts, hidden, intermediate]) give each of 2 ranks the share that the per-expert tensors give it (those
    equal HF at TP=2 end to end): half of every gate and of every up, half of down's columns."""
    from nanovllm.layers import moe
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tp = 3, 8, 6, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)

    def both_loaded():
        stacked, per_expert = moe.StackedExperts(experts, hidden, inter), moe.StackedExperts(experts, hidden, inter)
        stacked.weight_loader(stacked.gate_up_proj, gate_up)
        stacked.weight_loader(stacked.down_proj, down)
        for e in range(experts):
            gate, up = gate_up[e].chunk(2)
            per_expert.weight_loader(per_expert.gate_up_proj, gate, (e, "gate"))
            per_expert.weight_loader(per_expert.gate_up_proj, up, (e, "up"))
            per_expert.weight_loader(per_expert.down_proj, down[e], (e, "down"))
        return stacked, per_expert

    for stacked, per_expert in built_on_ranks(monkeypatch, moe, tp, both_loaded):
        assert torch.equal(stacked.gate_up_proj, per_expert.gate_up_proj)
        assert torch.equal(stacked.down_proj, per_expert.down_proj)


def test_num_experts_per_tok_past_num_experts_is_an_error(tmp_path):
    """More experts per token than there are is refused before anything is built, with both numbers."""
    path = make_random_checkpoint(tmp_path / "moe", "tiny-qwen3-moe", num_experts=4, num_experts_per_tok=5,
                                  with_weights=False)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
        LLM(str(path), load_format="dummy")


def test_moe_intermediate_size_must_divide_by_tp(tmp_path):
    path = make_random_checkpoint(tmp_path / "moe", "tiny-qwen3-moe", moe_intermediate_size=33)
    with pytest.raises(ValueError, match="moe_intermediate_size=33 does not divide by tensor_parallel_size=2"):
        LLM(str(path), tensor_parallel_size=2)


def test_routing_spreads_over_experts(tmp_path):
    """The random MoE is a real test of routing: tokens go to every expert, not to a favourite few."""
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
        out = llm.generate(PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    assert_greedy_matches_hf(hf, PROMPTS[2], out["token_ids"])


# ---- the fused Triton kernels ----------------------------------------------------------------------------

# (tokens, experts, top_k, hidden, intermediate, block config or None for the engine's choice, expert loads)
KERNEL_CASES = [
    (1, 8, 2, 32, 48, None, "random"),
    (7, 16, 4, 64, 32, None, "random"),
    (40, 8, 2, 48, 40, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16), "random"),
    (33, 6, 3, 40, 24, dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32), "half the experts idle"),
    (50, 12, 1, 32, 16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16), "one expert takes nearly all"),
    (20, 5, 5, 16, 16, dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=16), "random"),
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


def interpreted_kernel_checks():  # run by test_fused_kernels_interpreted in a TRITON_INTERPRET=1 process
    from nanovllm.layers import triton_moe
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case in KERNEL_CASES:
        x, gate_up, down, weights, ids = kernel_inputs(case)
        config = case[5] and dict(case[5], num_warps=4, num_stages=2)
        got = triton_moe.fused_experts(x, gate_up, down, weights, ids, config)
        torch.testing.assert_close(got, experts_torch(x, gate_up, down, weights, ids), atol=1e-5, rtol=1e-5)
        block_m = (config or triton_moe.block_config(ids.numel(), gate_up.size(0)))["BLOCK_M"]
        check_alignment(ids, gate_up.size(0), block_m, *triton_moe.align(ids, gate_up.size(0), block_m))
    print("interpreted kernel checks passed")


def test_fused_kernels_interpreted():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":  # on CPU conftest turned it on before any kernel was defined
        return interpreted_kernel_checks()
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", "from tests.test_moe import interpreted_kernel_checks as c; c()"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "checks passed" in result.stdout, result.stdout + result.stderr


def test_fused_kernels_compile_for_sm90():
    """The interpreted checks do not type-check the kernels as the compiler does (tests/test_triton_rope_store.py
    had a kernel that passed them and failed to compile on the H200). Qwen3-30B-A3B's experts in bf16 (128 of
    them, top 8, hidden 2048, intermediate 768): the alignment; the gate and up GEMM in a decode step's tiles and
    the down GEMM in a prefill's."""
    pytest.importorskip("triton")
    from nanovllm.layers import triton_moe
    experts, top_k = 128, 8
    decode, prefill = triton_moe.block_config(top_k, experts), triton_moe.block_config(8192 * top_k, experts)
    ints = dict(sorted_pairs_ptr="*i32", block_experts_ptr="*i32", num_pairs="i32")
    cases = [("nanovllm.layers.triton_moe", "_align_kernel", dict(ints, expert_ids_ptr="*i64", num_blocks="i32"),
              dict(NUM_EXPERTS=experts, EXPERTS_POW2=experts, BLOCK_M=decode["BLOCK_M"], CHUNK=8192 // experts))]
    gemm = dict(ints, a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", route_weights_ptr="*bf16", N="i32", K="i32",
                stride_a="i32", stride_we="i32", stride_wn="i32", stride_out="i32")  # an expert's weights < 2**31
    for config, gated in ((decode, True), (prefill, False)):
        tiles = {name: config[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        cases.append(("nanovllm.layers.triton_moe", "_grouped_gemm_kernel", gemm, dict(
            tiles, PAIRS_PER_A_ROW=top_k if gated else 1, GATED=gated, ROUTE_WEIGHTED=not gated,
            NUM_EXPERTS=experts, DOT_PRECISION="tf32"), dict(num_warps=config["num_warps"],
                                                            num_stages=config["num_stages"])))
    compile_for_sm90(cases)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES[1::2] + [(256, 128, 8, 2048, 768, None, "random"),
                                                 (1, 128, 8, 2048, 768, None, "random"),
                                                 (3000, 128, 8, 2048, 768, None, "half the experts idle")])
def test_fused_kernels_cuda_bf16(case):
    from nanovllm.layers import triton_moe
    x, gate_up, down, weights, ids = kernel_inputs(case, torch.bfloat16, "cuda")
    config = case[5] and dict(case[5], num_warps=4, num_stages=2)
    got = triton_moe.fused_experts(x, gate_up, down, weights, ids, config).float()
    expected = experts_torch(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
    block_m = (config or triton_moe.block_config(ids.numel(), gate_up.size(0)))["BLOCK_M"]
    check_alignment(ids.cpu(), gate_up.size(0), block_m,
                    *(t.cpu() for t in triton_moe.align(ids, gate_up.size(0), block_m)))


@pytest.mark.gpu
def test_fused_kernels_in_a_cuda_graph():
    """Captured once, replayed with other routings (other experts idle): no host value is baked in."""
    from nanovllm.layers import triton_moe
    case = (64, 128, 8, 2048, 768, None, "random")
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
