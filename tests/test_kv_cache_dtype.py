"""kv_cache_dtype="fp8" (it flips HF's near ties: tests bound how often and by how much), and backend choice."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanovllm import LLM
from nanovllm.layers.attention import (BACKEND_NAMES, FP8_DTYPE, VALUE_CHUNK, TorchBackend, quantize_kv,
                                       resolve_backend_name, value_chunk, value_slots, values_as_cache)
from tests import test_gpu_engine, test_overlap
from tests.conftest import greedy
from tests.test_gpu_attention import make_meta


def agreement(hf_model, batch, outputs, device="cpu"):
    """(share of tokens that are HF's argmax, largest gap below HF's best logprob, largest |logprob error|)."""
    agree = total = 0
    worst_gap = worst_logprob = 0.0
    for prompt, out in zip(batch, outputs):
        ids = out["token_ids"]
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1:-1]
        logprobs = logits.float().log_softmax(-1).cpu()
        chosen = logprobs.gather(1, torch.tensor(ids)[:, None])[:, 0]
        agree += (logprobs.argmax(-1) == torch.tensor(ids)).sum().item()
        total += len(ids)
        worst_gap = max(worst_gap, (logprobs.max(-1).values - chosen).max().item())
        engine = torch.tensor([entry[token] for entry, token in zip(out["logprobs"], ids)])
        worst_logprob = max(worst_logprob, (engine - chosen).abs().max().item())
    return agree / total, worst_gap, worst_logprob


@pytest.mark.parametrize("block_size", [16, VALUE_CHUNK])
def test_fp8_cache_stays_close_to_hf(tiny_model, hf_model, block_size):
    """Chunked prefill, prefix hits and mixed steps on the FP8 cache; values laid out as keys or in chunks."""
    llm = LLM(tiny_model, kv_cache_dtype="fp8", kvcache_block_size=block_size, max_num_batched_tokens=64)
    assert llm.model_runner.kv_cache.dtype == FP8_DTYPE
    batch = test_overlap.prompts(8, hi=100)
    shared = max(batch, key=len)
    batch.append(shared + [7, 8, 9])  # a prefix hit on the first call's blocks
    params = greedy(32, logprobs=0)
    llm.generate([shared], params, use_tqdm=False)
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert outputs[-1]["num_cached_tokens"] > 0
    share, gap, logprob_error = agreement(hf_model, batch, outputs)
    print(f"\nFP8 KV, tiny checkpoint: {share:.1%} of {len(batch) * 32} tokens HF's argmax; worst {gap:.3f} below "
          f"HF's best; largest logprob error {logprob_error:.3f}")
    assert share >= 0.85 and gap < 0.3 and logprob_error < 0.5  # measured 92.7%, 0.107, 0.301


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([16, 32, 48, 64, 80, 128, 192, 256]), num_kv_heads=st.integers(1, 3),
       head_dim=st.sampled_from([8, 16, 24]), fp8=st.booleans(), data=st.data())
def test_values_lie_where_value_chunk_says(block_size, num_kv_heads, head_dim, fp8, data):
    """FP8 values of chunked blocks at [block, head, key // 64, dim, key % 64], others at [block, key, head, dim]."""
    dtype, raw = (FP8_DTYPE, torch.uint8) if fp8 else (torch.float32, torch.float32)  # raw: compared bit for bit
    num_blocks = 3
    chunk = VALUE_CHUNK if fp8 and block_size % VALUE_CHUNK == 0 else 0
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    assert value_chunk(caches[1]) == chunk
    slots = torch.tensor(data.draw(st.lists(st.integers(0, num_blocks * block_size - 1), min_size=1, max_size=8,
                                            unique=True)))
    k, v = (torch.randn(len(slots), num_kv_heads, head_dim) * 4 for _ in range(2))
    TorchBackend().store_kvcache(k, v, *caches, slots)
    keys, values = (c.view(raw).flatten() for c in caches)
    for i, slot in enumerate(slots.tolist()):
        block, key = divmod(slot, block_size)
        for head in range(num_kv_heads):
            dims = torch.arange(head_dim)
            flat = (slot * num_kv_heads + head) * head_dim + dims
            where = ((block * num_kv_heads + head) * block_size + key // chunk * chunk) * head_dim + dims * chunk + \
                key % chunk if chunk else flat
            want_k, want_v = (quantize_kv(x[i, head], 1.0, dtype).view(raw) for x in (k, v))
            assert torch.equal(keys[flat], want_k)
            assert torch.equal(values[where], want_v)
    in_order = value_slots(caches[1]).flatten(1, 2)  # [block, key, kv head, dim]
    assert torch.equal(in_order.flatten(0, 1)[slots].float(), quantize_kv(v, 1.0, dtype).float())
    assert torch.equal(values_as_cache(in_order.contiguous()).view(raw), caches[1].view(raw))


def test_torch_backend_fp8_round_trip():
    """It stores clamp(x / scale) in FP8 and reads fp8 * scale: within e4m3's rounding of x."""
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 2, 16, generator=gen) * torch.tensor([0.05, 40.0])[:, None, None, None]
    k_scale, v_scale = 2.0 ** -6, 0.5  # |k| <= 0.17 and |v| <= 164 stay inside +-448 after the division
    caches = [torch.zeros(2, 16, 2, 16, dtype=FP8_DTYPE) for _ in range(2)]
    backend = TorchBackend()
    backend.store_kvcache(k, v, *caches, torch.arange(10), k_scale, v_scale)
    stored = [c.float().flatten(0, 1)[:10] for c in caches]
    for x, got, scale in ((k, stored[0], k_scale), (v, stored[1], v_scale)):
        # to nearest: half e4m3's step (1/8, or 2**-9 times the scale among subnormals)
        assert ((got * scale - x).abs() <= x.abs() / 16 + scale * 2 ** -10).all()
    out_of_range = torch.tensor([1e3, -1e9])[:, None, None].expand(2, 2, 16)  # two tokens
    saturated = [torch.zeros(2, 16, 2, 16, dtype=FP8_DTYPE) for _ in range(2)]
    backend.store_kvcache(out_of_range, out_of_range, *saturated, torch.tensor([0, 1]))
    assert saturated[0][0, :2, 0, 0].float().tolist() == [448.0, -448.0]  # saturated, not NaN
    q = torch.randn(1, 4, 16, generator=gen)
    meta = make_meta([1], [10], torch.tensor([[0]]), 16, "cpu")  # a query token over the 10 keys
    out = backend.forward(q, k[:1], v[:1], *caches, meta, 0.25, k_scale, v_scale)
    keys, values = (stored[0] * k_scale).repeat_interleave(2, 1), (stored[1] * v_scale).repeat_interleave(2, 1)
    weights = torch.einsum("hd,thd->ht", q[0], keys).mul(0.25).softmax(-1)
    assert torch.allclose(out[0], torch.einsum("ht,thd->hd", weights, values), atol=1e-5)


def test_fp8_cache_holds_twice_the_blocks(tiny_model):
    sizes = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        llm = LLM(tiny_model, kv_cache_dtype=kv_cache_dtype, kvcache_block_size=16, num_kvcache_blocks=10)
        sizes[kv_cache_dtype] = llm.model_runner.kv_cache.nbytes
    assert sizes["auto"] == 4 * sizes["fp8_e4m3"]  # float32 on CPU: 4 bytes a value against 1


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_dtype": "fp8_e5m2"}, r"kv_cache_dtype='fp8_e5m2' must be one of \['auto', 'fp8', 'fp8_e4m3'\]"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'"),
    ({"attention_backend": "flashinfer"}, r"attention_backend='flashinfer' is unknown; valid ones are .*'triton'"),
])
def test_bad_settings_name_the_value(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, **kwargs)


def test_backend_resolution_on_cpu():
    f32 = torch.float32
    assert resolve_backend_name("auto", "cpu", f32, 16, FP8_DTYPE) == ("torch", None)
    assert resolve_backend_name("torch", "cpu", f32, 16, f32) == ("torch", None)
    for name in BACKEND_NAMES[1:]:
        with pytest.raises(ValueError, match=f"attention_backend='{name}' needs CUDA; device is 'cpu'"):
            resolve_backend_name(name, "cpu", f32, 16, f32)


qwen3_small = test_gpu_engine.qwen3_small  # the GPU tests' fixture


@pytest.mark.gpu
def test_auto_backends_on_cuda(qwen3_small):
    from nanovllm.layers.flash_attention import flash_attn_available, triton_decode_measured_faster
    with LLM(qwen3_small, kv_cache_dtype="fp8", enforce_eager=True, max_model_len=1024) as llm:
        assert llm.model_runner.backend.name == "triton"  # flash-attn cannot read FP8
    expected = "triton"
    if flash_attn_available() == "fa4":
        expected = "triton-decode" if triton_decode_measured_faster() else "flash-attn"
    with LLM(qwen3_small, enforce_eager=True, max_model_len=1024) as llm:
        assert llm.model_runner.backend.name == expected
    if flash_attn_available():
        with pytest.raises(ValueError, match="'flash-attn' cannot read an FP8 KV cache"):
            LLM(qwen3_small, kv_cache_dtype="fp8", attention_backend="flash-attn", enforce_eager=True)


@pytest.mark.gpu
def test_fp8_on_cuda_close_to_hf_and_twice_the_tokens(qwen3_small):
    hf = test_gpu_engine.hf_bf16(qwen3_small)
    batch = test_gpu_engine.prompts(16, seed=2)
    params = greedy(24, logprobs=0)
    results, blocks = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(qwen3_small, kv_cache_dtype=kv_cache_dtype, max_model_len=2048, max_num_seqs=16) as llm:
            blocks[kv_cache_dtype] = llm.config.num_kvcache_blocks
            results[kv_cache_dtype] = agreement(hf, batch, llm.generate(batch, params, use_tqdm=False), "cuda")
    print(f"\nbf16 model, 4 layers, {len(batch) * 24} tokens: (share that is HF's argmax, worst gap, largest "
          f"logprob error): bf16 KV {results['auto']}, FP8 KV {results['fp8']}; blocks {blocks}")
    # sized in bytes after warm-ups that differ a little
    assert 1.9 < blocks["fp8"] / blocks["auto"] < 2.1
    assert results["fp8"][0] >= 0.75 and results["fp8"][1] < 0.5


@pytest.mark.gpu
def test_fp8_cuda_graph_decode_equals_eager(qwen3_small):
    batch = test_gpu_engine.prompts(16, seed=4)  # all finish together: every batch is a graph size
    params = greedy(32)
    with LLM(qwen3_small, kv_cache_dtype="fp8", enforce_eager=True, max_model_len=2048) as eager:
        expected = test_gpu_engine.generated(eager, batch, params)
    with LLM(qwen3_small, kv_cache_dtype="fp8", max_model_len=2048, max_num_seqs=16) as graphs:
        assert graphs.model_runner.graphs
        got = test_gpu_engine.generated(graphs, batch, params)
    assert got == expected
