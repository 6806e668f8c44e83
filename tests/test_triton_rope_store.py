"""The fused q/k norm, rope and KV store (`triton_rope_store`) against the unfused layers it replaces."""
import random

import pytest
import torch

from nanovllm import LLM
from nanovllm.layers.attention import FP8_DTYPE, VALUE_CHUNK, Attention, TorchBackend
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from tests.conftest import compile_for_sm90
from tests.test_triton_attention import DEVICE, DTYPES, assert_stored_as  # (skips this module without Triton)
from nanovllm.layers import triton_kvstore, triton_rope_store


def unfused(q, k, v, positions, rope, norms, caches, slots, *scales):
    if norms[0] is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = rope(positions, q, k)
    TorchBackend().store_kvcache(k, v, *caches, slots, *scales)
    return q


def fused(q, k, v, positions, rope, norms, caches, slots, *scales):
    weights = [norm and norm.weight for norm in norms]
    return triton_rope_store.rope_store(q, k, v, positions, rope.cos_sin_cache, *weights, 1e-6, *caches, slots, *scales)


def rope_table(head_dim):
    return RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 4096).to(DEVICE)


def assert_caches(caches, expected_caches, fp8, atol, rtol):
    for cache, want in zip(caches, expected_caches):  # including the slots left alone (-1, and the rest)
        if fp8 and DEVICE.type == "cpu":
            assert_stored_as(cache, want)
        else:  # a 1e-7 difference may tip an FP8 value one step (1/8) away
            torch.testing.assert_close(cache.float(), want.float(), atol=atol, rtol=0.13 if fp8 else rtol)


def case(seed, dtype, num_heads, num_kv_heads, head_dim, qk_norm, fp8, num_tokens=7, block_size=16, num_blocks=6):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width + 8, generator=gen) * 2).to(dtype).to(DEVICE)[:, 4:4 + width]  # strided
    q, k, v = qkv.unflatten(-1, (-1, head_dim)).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    rope = rope_table(head_dim)
    norms = [None, None]
    if qk_norm:
        norms = [RMSNorm(head_dim, eps=1e-6).to(DEVICE, dtype) for _ in range(2)]
        for norm in norms:
            norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    positions = torch.tensor([rng.randrange(4096) for _ in range(num_tokens)], device=DEVICE)
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    slots[rng.randrange(num_tokens)] = -1  # the padding of a captured graph: stores nothing
    cache_dtype = FP8_DTYPE if fp8 else dtype
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, cache_dtype)
              for _ in range(2)]
    scales = (0.0625, 3.0) if fp8 else (1.0, 1.0)  # a kernel that forgets one is off by 16x or 3x
    return q, k, v, positions, rope, norms, caches, torch.tensor(slots, device=DEVICE), scales


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16] * (DEVICE.type == "cpu"))  # bf16's stand-in on CPU
def test_fused_equals_unfused(seed, dtype):
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 3, 4])  # 3: KV heads that are not a power of two
    num_heads = num_kv_heads * rng.choice([1, 2, 3, 8])  # 3: a head count that is not a power of two
    head_dim = rng.choice([64, 80, 128])  # 80: a half that is not a power of two
    qk_norm, fp8 = seed % 2 == 0, seed % 4 == 3 and dtype != torch.float16  # (interpreted: FP8 ties round up)
    if fp8 and DEVICE.type == "cpu" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 here")
    q, k, v, positions, rope, norms, caches, slots, scales = case(
        seed, dtype, num_heads, num_kv_heads, head_dim, qk_norm, fp8, block_size=VALUE_CHUNK if seed == 7 else 16)
    v = v.contiguous() if seed % 3 == 1 else v  # a token stride of its own
    expected_caches = [c.clone() for c in caches]
    expected = unfused(q, k, v, positions, rope, norms, expected_caches, slots, *scales)
    got = fused(q, k, v, positions, rope, norms, caches, slots, *scales)
    # float32: the unfused layers' sums run in another order; 16 bits: where that tips a rounding, one step
    tol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    atol = 1e-5 if dtype == torch.float32 else 1e-6
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=tol)
    assert_caches(caches, expected_caches, fp8, atol, tol)


@pytest.mark.parametrize("dtype", [torch.float16] + DTYPES[1:])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fp8_keys_are_rounded_to_the_model_dtype_before_they_are_quantized(dtype, qk_norm):
    """The FP8 cache equals, byte for byte, the kernel's keys stored in the model's dtype, then quantized."""
    q, k, v, positions, rope, norms, caches, slots, scales = case(
        3, dtype, 8, 4, 128, qk_norm, True, num_tokens=64, num_blocks=8)

    def fp8_caches(q, k, v):
        out = [c.clone() for c in caches]
        fused(q, k, v, positions, rope, norms, out, slots, *scales)
        return out

    wide = [torch.zeros_like(c, dtype=dtype) for c in caches]
    fused(q, k, v, positions, rope, norms, wide, slots)
    rounded_k = wide[0].flatten(0, 1)[slots.clamp(min=0)]  # (the padding slot's row: stored nowhere)
    want = [c.clone() for c in caches]
    triton_kvstore.store_kvcache(rounded_k, v, *want, slots, *scales)
    for got, expected in zip(fp8_caches(q, k, v), want):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    if not qk_norm:  # the test's reach: keys quantized from float32 differ (~0.4% of fp16's, ~3% of bf16's)
        unrounded = fp8_caches(q.float(), k.float(), v.float())[0]
        assert (unrounded.view(torch.uint8) != want[0].view(torch.uint8)).float().mean() > 1e-3


def test_the_decoder_passes_its_norms_and_slots_to_the_kernel(tiny_model):
    """`DecoderAttention.project` fused equals unfused, at hidden states so small that the norms' eps shows."""
    # 2 blocks: on CPU the interpreter copies the caches at each launch
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=2) as llm, torch.inference_mode():
        layer = llm.model_runner.model.model.layers[1].self_attn
        assert layer.qk_norm
        attn = layer.attn
        weight, gen = layer.qkv_proj.weight, torch.Generator().manual_seed(0)
        device = weight.device  # CUDA where there is one: the engine picks it
        hidden = (torch.randn(5, weight.size(1), generator=gen) * 1e-4).to(device)
        positions, slots = (torch.tensor(x, device=device) for x in ([0, 9, 3, 17, 40], [16, 17, 18, 19, 20]))
        attn.fuse_rope_store = False
        q, k, v = layer.project(positions, hidden, slots)
        attn.fuse_rope_store = True
        attn.k_cache.zero_(), attn.v_cache.zero_()
        fused_q, _, _ = layer.project(positions, hidden, slots)
        stored_k, stored_v = (cache.flatten(0, 1)[slots] for cache in (attn.k_cache, attn.v_cache))
        attn.fuse_rope_store = False
    assert k.abs().max() > 0.1  # normed up from ~1e-5: eps is what keeps it finite and sets its size
    for got, want in ((fused_q, q), (stored_k, k), (stored_v, v)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_the_fused_store_waits_for_a_cache_and_a_backend_that_can(tiny_model, monkeypatch):
    attn = Attention(4, 64, 0.125, 2)
    attn.fuse_rope_store = True
    assert not attn.fused_store  # no cache yet (the memory-profiling run): the attention stores, not the decoder
    attn.k_cache = attn.v_cache = torch.zeros(3, 16, 2, 64)
    assert attn.fused_store
    monkeypatch.setenv("NANOVLLM_FUSED_ROPE_STORE", "1")
    with LLM(tiny_model, device="cpu") as llm:  # the torch backend on CPU: its store is not Triton's
        assert not llm.model_runner.backend.fuses_rope_store
        assert not any(layer.fuse_rope_store for layer in llm.model_runner.attn_layers)


def test_compiles_for_sm90():
    """Qwen3-0.6B's heads with norms; 14 over 2 heads into an FP8 cache."""
    cases = []
    for qk_norm, fp8, num_heads, num_kv_heads in [(True, False, 16, 8), (False, True, 14, 2)]:
        cache, weights = "fp8e4nv" if fp8 else "bf16", "bf16" if qk_norm else "fp32"  # else cos_sin stands in
        signature = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "q_out_ptr"), "*bf16")
        signature.update(q_weight_ptr=f"*{weights}", k_weight_ptr=f"*{weights}", k_cache_ptr=f"*{cache}",
                         v_cache_ptr=f"*{cache}", positions_ptr="*i64", slot_mapping_ptr="*i64", cos_sin_ptr="*fp32",
                         q_token_stride="i32", k_token_stride="i32", v_token_stride="i32",  # Python ints < 2**31
                         eps="fp32", k_scale="fp32", v_scale="fp32")
        cases.append(("nanovllm.layers.triton_rope_store", "_rope_store_kernel", signature, dict(
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=128, HEADS_BLOCK=16,
            KV_HEADS_BLOCK=num_kv_heads, HALF_BLOCK=64, QK_NORM=qk_norm, QUANTIZE=fp8, PDL=qk_norm, BLOCK_SIZE=256,
            V_CHUNK=VALUE_CHUNK if fp8 else 0)))
    compile_for_sm90(cases)
