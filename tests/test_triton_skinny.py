"""`triton_skinny` (fused norm, gate, residual) against the unfused layers in float64: rows 1-32, K in parts or not,
ragged N and K; float32 in the interpreter, bf16 on a GPU. Then the layers and models whose decode steps use it."""
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from nanovllm import LLM
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import assert_greedy_matches_hf, compile_for_sm90, greedy
from tests.test_models import FAMILIES, check_against_hf, family_checkpoint, hf_model

triton_skinny = pytest.importorskip("nanovllm.layers.triton_skinny")
if triton_skinny.triton is None:
    pytest.skip("Triton does not import here", allow_module_level=True)

from nanovllm.layers import linear  # noqa: E402
from nanovllm.layers.activation import GeluAndMul, SiluAndMul  # noqa: E402
from nanovllm.layers.attention import FP8_DTYPE, VALUE_CHUNK, TorchBackend  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.triton_rope_store import rope_store  # noqa: E402
from tests.test_triton_attention import CPU_ONLY, DEVICE  # noqa: E402
from tests.test_triton_rope_store import assert_caches, case, rope_table, unfused  # noqa: E402

EPS = 1e-6


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def normed(x, norm_weight=None):
    x = x.double()
    return x if norm_weight is None else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()


def reference(x, w, b=None, norm_weight=None, gated=False, residual=None):
    y = normed(x, norm_weight) @ w.double().T + (b.double() if b is not None else 0)
    if gated:
        gate, up = y.chunk(2, -1)
        y = F.silu(gate) * up
    return y if residual is None else y + residual.double()


def rel_error(out, expected):
    return ((out.double().cpu() - expected).norm() / expected.norm()).item()


def float32_bound(x, w, b, norm_weight, gated, expected, tolerance=1e-5, c=4.0):
    """`tolerance`, or `c` float32 eps of each sum of |terms| times the output's derivative in it, relative to the
    output: met however it cancels (the example's gate: -0.0054 from terms of ~10.5)."""
    x, bias = normed(x, norm_weight), b.double() if b is not None else 0
    terms = x.abs() @ w.double().abs().T + abs(bias)
    if gated:
        (gate, up), (gate_terms, up_terms) = (x @ w.double().T + bias).chunk(2, -1), terms.chunk(2, -1)
        sig = torch.sigmoid(gate)
        terms = (up * sig * (1 + gate * (1 - sig))).abs() * gate_terms + (gate * sig).abs() * up_terms
    return max(tolerance, c * torch.finfo(torch.float32).eps * (terms.norm() / expected.norm()).item())


def fused(x, w, b=None, norm_weight=None, gated=False, residual=None, config=None, **kw):
    to = (lambda t: None if t is None else t.to(DEVICE))
    return triton_skinny.skinny_linear(to(x), to(w), to(b), norm=None if norm_weight is None else
                                       (to(norm_weight), EPS), gated=gated, residual=to(residual), config=config, **kw)


def random_layer(gen, m, n, k, bias, norm):
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
    return x, w, torch.randn(n, generator=gen) if bias else None, torch.rand(k, generator=gen) + 0.5 if norm else None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, through the interpreter: every draw would compile a "
                    "variant on a GPU (there: test_parts_race_free_on_gpu)")
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 32), n=st.integers(1, 80), k=st.integers(1, 700), block_k=st.sampled_from([64, 128, 1024]),
       bias=st.booleans(), norm=st.booleans(), gated=st.booleans(), residual=st.booleans(), seed=st.integers(0, 99))
@example(m=1, n=1, k=323, block_k=64, bias=False, norm=False, gated=True, residual=False, seed=42)  # gate cancels
def test_skinny_matches_the_unfused_layers(m, n, k, block_k, bias, norm, gated, residual, seed):
    """Any mix of norm, gate, bias, residual, K in one part or many; a second launch finds the counters at zero."""
    gen = seeded(seed)
    x, w, b, norm_weight = random_layer(gen, m, 2 * n if gated else n, k, bias, norm)
    res = torch.randn(m, n, generator=gen) if residual else None
    expected = reference(x, w, b, norm_weight, gated, res)
    bound = float32_bound(x, w, b, norm_weight, gated, expected)
    for _ in range(2):
        out = fused(x, w, b, norm_weight, gated, res, config=(16, block_k, 4))
        assert out.shape == (m, n) and out.dtype == torch.float32
        assert rel_error(out, expected) < bound
    if block_k < k:
        assert not triton_skinny._counters[out.device].any()


def test_plan_covers_every_k():
    """Powers of two that `tl.dot` takes (timings: `git show 34b7da6:benchmarks/skinny_gemm.py`)."""
    for block_m, k, gated in [(16, 1024, False), (32, 3072, False), (16, 3072, False), (16, 1024, True), (32, 64, True),
                              (16, 17, False)]:
        block_n, block_k, warps = triton_skinny.plan(block_m, k, gated)
        assert block_n >= 16 and block_k >= 16 and block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0
        assert warps in (4, 8)


@pytest.mark.parametrize("m", [1, 16, 17])
def test_the_plans_tiles_match_the_unfused_layers(m):
    """Qwen3-0.6B's down projection (1024 x 3072) and residual on the plan's tiles, up to 16 rows and past them."""
    gen = seeded(m)
    x, w, res = torch.randn(m, 3072, generator=gen), torch.randn(1024, 3072, generator=gen) * 0.02, \
        torch.randn(m, 1024, generator=gen)
    out = fused(x, w, residual=res)
    assert rel_error(out, reference(x, w, residual=res)) < 1e-4
    assert not triton_skinny._counters[out.device].any()


@pytest.mark.parametrize("seed", range(6))
def test_qkv_with_rope_and_store_matches_the_unfused_layers(seed):
    """Rope and KV store in the epilogue: GQA, biases, norms, FP8 caches (chunked too), K in parts or not."""
    rng = random.Random(seed)
    num_kv_heads, head_dim = rng.choice([1, 2]), rng.choice([32, 64])
    num_heads = num_kv_heads * rng.choice([1, 2, 3])
    qk_norm, fp8, bias, norm = seed % 2 == 0, seed % 3 == 2, seed % 4 < 2, seed < 3
    if fp8 and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 here")
    m, k = rng.randint(2, 7) if seed % 2 else rng.randint(17, 24), rng.choice([48, 200])  # 16 and 32-row blocks
    _, _, _, positions, rope, norms, caches, slots, scales = case(  # seed 5: chunked values
        seed, torch.float32, num_heads, num_kv_heads, head_dim, qk_norm, fp8, num_tokens=m,
        block_size=VALUE_CHUNK if seed == 5 else 16)
    x, w, b, norm_weight = random_layer(seeded(seed), m, (num_heads + 2 * num_kv_heads) * head_dim, k, bias, norm)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = reference(x, w, b, norm_weight).float().to(DEVICE)
    q, kk, v = (t.view(m, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], -1))
    expected_caches = [c.clone() for c in caches]
    expected_q = unfused(q, kk, v, positions, rope, norms, expected_caches, slots, *scales)
    args = triton_skinny.RopeStoreArgs(positions, rope.cos_sin_cache, *[n and n.weight for n in norms], 1e-6, *caches,
                                       slots, *scales)
    for block_k in (256, 32):
        out = fused(x, w, b, norm_weight, rope=args, config=(head_dim // 2, block_k, 4))
        torch.testing.assert_close(out[:, :q_size].reshape(m, num_heads, head_dim), expected_q, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[:, q_size:], qkv[:, q_size:], atol=1e-4, rtol=1e-4)
        assert_caches(caches, expected_caches, fp8, 1e-4, 1e-4)  # the padding slot (-1) stores nothing
    assert not triton_skinny._counters[out.device].any()


def integer_qkv(m, num_heads, num_kv_heads, head_dim, bound, gen, k=64, dtype=torch.float16):
    """Integer x, w in [-bound, bound] (exact float32 sums), rounded once to `dtype` as q, k, v; a rope table."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    x = torch.randint(-bound, bound + 1, (m, k), generator=gen).to(dtype)
    w = torch.randint(-bound, bound + 1, (q_size + 2 * kv_size, k), generator=gen).to(dtype)
    qkv = (x.double() @ w.double().T).to(dtype)
    heads = tuple(t.view(m, -1, head_dim).to(DEVICE) for t in qkv.split([q_size, kv_size, kv_size], -1))
    return x, w, qkv, heads, rope_table(head_dim).cos_sin_cache


def qk_weights(gen, head_dim, qk_norm, dtype=torch.float16):
    return [(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if qk_norm else [None] * 2


def rope_epilogue(x, w, heads, positions, cos_sin, weights, caches, slots, scales, block_k):
    """The skinny product with rope and store in its epilogue, and `rope_store`'s q and caches on the same heads."""
    want_caches = [c.clone() for c in caches]
    want_q = rope_store(*heads, positions, cos_sin, *weights, 1e-6, *want_caches, slots, *scales)
    args = triton_skinny.RopeStoreArgs(positions, cos_sin, *weights, 1e-6, *caches, slots, *scales)
    return fused(x, w, rope=args, config=(heads[0].size(-1) // 2, block_k, 4)), want_q, want_caches


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("block_k", [64, 32])
def test_qkv_with_rope_rounds_the_projection_as_the_unfused_layers(qk_norm, block_k):
    """In float16 the epilogue rounds the projection before norms and rope, as `rope_store`: bit for bit."""
    gen = seeded(1)
    m, num_heads, head_dim = 5, 2, 32
    x, w, qkv, heads, cos_sin = integer_qkv(m, num_heads, 1, head_dim, 64, gen)
    assert (qkv.double() != x.double() @ w.double().T).float().mean() > 0.3
    positions = torch.tensor([3, 1000, 17, 4095, 250], device=DEVICE)
    slots = torch.tensor([4, 0, -1, 9, 2], device=DEVICE)
    weights = qk_weights(gen, head_dim, qk_norm)
    caches = [torch.zeros(2, 8, 1, head_dim, dtype=torch.float16, device=DEVICE) for _ in range(2)]
    out, want_q, want_caches = rope_epilogue(x, w, heads, positions, cos_sin, weights, caches, slots, (1.0, 1.0),
                                             block_k)
    assert torch.equal(out[:, :num_heads * head_dim].view(m, num_heads, head_dim), want_q)
    assert torch.equal(out[:, num_heads * head_dim:].cpu(), qkv[:, num_heads * head_dim:])
    assert all(map(torch.equal, caches, want_caches))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_with_rope_rounds_fp8_keys_as_the_fused_store(qk_norm):
    """Rotated keys are rounded before quantizing, as `rope_store` (else ~0.4% of keys differ)."""
    gen = seeded(2)
    m, num_kv_heads, head_dim = 32, 2, 64
    x, w, _, heads, cos_sin = integer_qkv(m, 2, num_kv_heads, head_dim, 16, gen)
    positions = torch.randint(0, 4096, (m,), generator=gen).to(DEVICE)
    slots = torch.randperm(64, generator=gen)[:m].to(DEVICE)
    weights = qk_weights(gen, head_dim, qk_norm)
    caches = [torch.zeros(2, 32, num_kv_heads, head_dim, device=DEVICE).to(FP8_DTYPE) for _ in range(2)]
    _, _, want_caches = rope_epilogue(x, w, heads, positions, cos_sin, weights, caches, slots, (4.0, 8.0), 64)
    for got, want in zip(caches, want_caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def enable(monkeypatch, pdl, **values):
    values = dict(ENABLED=True, DEVICE_TYPE=DEVICE.type, pdl_launch=lambda device: pdl, **values)
    for name, value in values.items():
        monkeypatch.setattr(triton_skinny, name, value)


def test_fuses_rope_only_where_tl_dot_takes_half_a_head(monkeypatch):
    """Half a head must be a power of two >= 16 (`tl.dot`'s least N on a GPU; the interpreter does not check)."""
    enable(monkeypatch, True, ROPE=True)
    x = torch.zeros(4, 256, device=DEVICE)
    fused = {dim: triton_skinny.fuses_rope(x, torch.zeros(4 * dim, 256, device=DEVICE), dim)
             for dim in (8, 16, 32, 48, 64, 80, 128)}
    assert fused == {8: False, 16: False, 32: True, 48: False, 64: True, 80: False, 128: True}
    monkeypatch.setattr(triton_skinny, "ROPE", False)  # NANOVLLM_SKINNY_ROPE=0
    assert not triton_skinny.fuses_rope(x, torch.zeros(512, 256, device=DEVICE), 128)


def spy(monkeypatch, record) -> list:
    """`record(x, kwargs)` of each skinny_linear call (which still runs)."""
    calls, skinny = [], triton_skinny.skinny_linear

    def wrapper(x, w, bias=None, **kw):
        calls.append(record(x, kw))
        return skinny(x, w, bias, **kw)
    monkeypatch.setattr(triton_skinny, "skinny_linear", wrapper)
    return calls


@pytest.fixture
def skinny_calls(monkeypatch):
    """The skinny path on as on an H200 (PDL): (x's shape, norm?, gated?, residual?) of each call."""
    enable(monkeypatch, True)
    return spy(monkeypatch, lambda x, kw: (tuple(x.shape), kw.get("norm") is not None, kw.get("gated", False),
                                           kw.get("residual") is not None))


def test_linear_fuses_norm_silu_and_residual(skinny_calls):
    """Few rows fuse them; more rows, gelu or x by columns take the layers."""
    gen = seeded(4)
    norm = RMSNorm(300, eps=EPS)
    norm.weight.data.copy_(torch.rand(300, generator=gen) + 0.5)
    w, b = torch.randn(80, 300, generator=gen) / 300 ** 0.5, torch.randn(80, generator=gen)
    for m in (4, triton_skinny.MAX_ROWS, triton_skinny.MAX_ROWS + 1):
        x, res = torch.randn(m, 300, generator=gen), torch.randn(m, 40, generator=gen)
        expected = reference(x, w, b, norm.weight.data.cpu(), True, res)
        out = linear.linear(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), norm.to(DEVICE), SiluAndMul(), res.to(DEVICE))
        assert rel_error(out, expected) < 1e-5, m
    gelu = GeluAndMul()
    out = linear.linear(x[:4].to(DEVICE), w.to(DEVICE), None, act=gelu)
    assert torch.allclose(out.cpu(), gelu(x[:4] @ w.T), atol=1e-5)
    columns = torch.randn(300, 4, generator=gen).t()  # [4, 300] with a column stride of 4
    assert rel_error(linear.linear(columns.to(DEVICE), w.to(DEVICE), None), reference(columns, w)) < 1e-5
    assert skinny_calls == [((4, 300), True, True, True), ((triton_skinny.MAX_ROWS, 300), True, True, True)]


def test_wide_products_need_dependent_launches(skinny_calls, monkeypatch):
    """Without PDL, products at least as wide as deep (qkv, gate/up) stay on cuBLAS; o_proj and down do not."""
    gen = seeded(6)
    x, wide, narrow = (torch.randn(*shape, generator=gen).to(DEVICE) for shape in ((4, 64), (128, 64), (32, 64)))
    norm = RMSNorm(64, eps=EPS).to(DEVICE)
    enable(monkeypatch, False)
    assert rel_error(linear.linear(x, wide, None, norm), reference(x.cpu(), wide.cpu(), None, norm.weight.cpu())) < 1e-5
    linear.linear(x, narrow, None)
    enable(monkeypatch, True)
    linear.linear(x, wide, None, norm)
    assert skinny_calls == [((4, 64), False, False, False), ((4, 64), True, False, False)]


def test_square_products_need_dependent_launches(monkeypatch):
    """Without PDL `fits` takes fewer outputs than inputs, so no square product (Llama's o_proj); with PDL it does."""
    enable(monkeypatch, False)
    x = torch.zeros(4, 64, device=DEVICE)
    assert triton_skinny.fits(x, torch.zeros(63, 64, device=DEVICE))
    assert not triton_skinny.fits(x, torch.zeros(64, 64, device=DEVICE))
    enable(monkeypatch, True)
    assert triton_skinny.fits(x, torch.zeros(64, 64, device=DEVICE))


def row_parallel(gen, k, n):
    layer = linear.RowParallelLinear(k, n, bias=True)
    layer.weight.data.copy_(torch.randn(n, k, generator=gen))
    layer.bias.data.copy_(torch.randn(n, generator=gen))
    return layer


def test_row_parallel_layers_add_the_residual_in_it(skinny_calls):
    """o_proj and down: a decode step's few rows take the kernel, bias included."""
    gen = seeded(5)
    layer = row_parallel(gen, 300, 40)
    x, res = torch.randn(3, 300, generator=gen), torch.randn(3, 40, generator=gen)
    expected = reference(x, layer.weight.data, layer.bias.data, residual=res)
    assert rel_error(layer.to(DEVICE)(x.to(DEVICE), residual=res.to(DEVICE)), expected) < 1e-5
    assert skinny_calls == [((3, 300), False, False, True)]


def test_row_parallel_ranks_add_the_residual_after_the_all_reduce(skinny_calls, monkeypatch):
    """Rank 0's bias in the kernel."""
    gen = seeded(7)
    layer = row_parallel(gen, 64, 24).to(DEVICE)
    x = torch.randn(3, 64, generator=gen)
    res, other = torch.randn(3, 24, generator=gen), torch.randn(3, 24, generator=gen)
    monkeypatch.setattr(linear.dist, "all_reduce", lambda y: y.add_(other.to(y.device)))
    layer.tp_size = 2
    for rank in (0, 1):
        layer.tp_rank = rank
        out = layer(x.to(DEVICE), residual=res.to(DEVICE))
        bias = layer.bias.data.cpu() if rank == 0 else None
        expected = reference(x, layer.weight.data.cpu(), bias) + other.double() + res.double()
        assert rel_error(out, expected) < 1e-5, rank
    assert skinny_calls == [((3, 64), False, False, False)] * 2  # the kernel gets no residual


@pytest.mark.parametrize("gated", [False, True])
def test_normed_parts_sum_squares_whole_rows_or_their_own(gated):
    """K in parts: up to 16 rows sum whole rows' squares, past them each part its own."""
    gen = seeded(7)
    n, k = 40, 300
    w = torch.randn(2 * n if gated else n, k, generator=gen) / k ** 0.5
    norm_weight = torch.rand(k, generator=gen) + 0.5
    assert [triton_skinny.norm_parts(5, block_m) for block_m in (16, 32)] == [5, 0]
    assert triton_skinny.norm_parts(5, 32, normed=False) == 1
    for m in (16, 17, 32):
        x = torch.randn(m, k, generator=gen) * 3
        out = fused(x, w, norm_weight=norm_weight, gated=gated, config=(16, 64, 4))
        assert rel_error(out, reference(x, w, None, norm_weight, gated)) < 1e-5, m


def test_skinny_reads_rows_at_their_strides():
    gen = seeded(3)
    m, n, k = 5, 40, 300
    x = torch.randn(m, k + 17, generator=gen)[:, 9:9 + k]
    w = torch.randn(n, k + 44, generator=gen)[:, 30:30 + k]
    res = torch.randn(m, n + 8, generator=gen)[:, 3:3 + n]
    norm_weight = torch.rand(k, generator=gen) + 0.5
    expected = reference(x, w, None, norm_weight, residual=res)
    for block_k in (512, 64):
        out = fused(x, w, norm_weight=norm_weight, residual=res, config=(16, block_k, 4))
        assert rel_error(out, expected) < 1e-5, block_k


@pytest.mark.parametrize("block_k", [64, 32])
def test_epilogue_rounds_where_the_unfused_layers_do(block_k):
    """In float16, rounded before the residual and before silu(gate) * up; exact sums make it bit for bit."""
    dtype, gen = torch.float16, seeded(2)
    m, n, k = 5, 24, 64
    x = torch.randint(-32, 33, (m, k), generator=gen).to(dtype)
    w = (torch.randint(-64, 65, (2 * n, k), generator=gen) / 256).to(dtype)
    exact = x.double() @ w.double().T  # the float32 sums, exactly
    assert (exact[:, :n].to(dtype).double() != exact[:, :n]).float().mean() > 0.5
    res = (torch.randn(m, n, generator=gen) * 4).to(dtype)
    want = (exact[:, :n].to(dtype).double() + res.double()).to(dtype)  # rounded, then the residual added
    assert not torch.equal(want, (exact[:, :n] + res.double()).to(dtype))  # (rounding once would differ)
    assert torch.equal(fused(x, w[:n], residual=res, config=(16, block_k, 4)).cpu(), want)
    bias = torch.cat([torch.full((n,), 96.0), torch.zeros(n)]).to(dtype)
    gate, up = (exact + bias.double()).to(dtype).double().chunk(2, -1)  # each rounded as the projection's output
    assert gate.min() > 20  # sigmoid(gate) == 1 in float32
    want = (gate * up).to(dtype)
    assert not torch.equal(want, ((exact[:, :n] + 96) * up).to(dtype))  # (an unrounded gate would differ)
    assert torch.equal(fused(x, w, bias, gated=True, config=(16, block_k, 4)).cpu(), want)


def test_counters_grow_with_the_blocks():
    """More column blocks than counters so far: as many zeroed ones (fewer would count in another's memory)."""
    blocks = triton_skinny._counter(DEVICE, 8).numel() + 100
    counter = triton_skinny._counter(DEVICE, blocks)
    assert counter.numel() >= blocks and not counter.any()
    assert triton_skinny._counter(DEVICE, 8) is counter  # kept for the next launches


def generate_as_hf(model, hf, prompts, **llm_kw):
    with LLM(str(model), kvcache_block_size=16, **llm_kw) as llm:
        outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])


@CPU_ONLY
def test_decode_steps_through_the_fused_kernels_match_hf(tiny_model, hf_model, skinny_calls):
    generate_as_hf(tiny_model, hf_model, [[5, 9, 200, 31], [7] * 11, [300, 2, 8]], num_kvcache_blocks=40)
    fused_kinds = {call[1:] for call in skinny_calls}
    assert fused_kinds == {(True, False, False), (False, False, True), (True, True, False)}, fused_kinds


@CPU_ONLY
@pytest.mark.parametrize("family", ["llama-linear-rope-biases", "qwen3-moe-sparse-step-and-dense-layers"])
def test_other_families_decode_through_it(tmp_path, skinny_calls, family):
    """Biases everywhere (Llama), MoE beside dense layers (MLP left to torch)."""
    check_against_hf(family_checkpoint(tmp_path, family))
    assert {call[1:] for call in skinny_calls} >= {(True, False, False), (False, False, True)}


@CPU_ONLY
@pytest.mark.parametrize("family", ["tiny", "llama-linear-rope-biases"])
def test_decode_steps_with_rope_in_the_projection_match_hf(tmp_path, skinny_calls, monkeypatch, family):
    """In decode steps' qkv projection (heads of 32)."""
    monkeypatch.setattr(TorchBackend, "fuses_rope_store", True)
    ropes = spy(monkeypatch, lambda x, kw: kw.get("rope") is not None)
    shape, overrides = FAMILIES.get(family, ("tiny", {}))
    path = make_random_checkpoint(tmp_path / family, shape, **dict(overrides, head_dim=32))
    generate_as_hf(path, hf_model(path), [[5, 9, 200, 31], [7] * 40, list(range(3, 60))], num_kvcache_blocks=24)
    assert sum(ropes) >= 2 * 5  # two layers, five decode steps at least


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_parts_race_free_on_gpu():
    """Many bf16 launches, K in parts: a partial sum read early or a counter left non-zero shows."""
    gen = seeded(0)
    for trial in range(200):
        m, n, k = int(torch.randint(1, 33, (1,), generator=gen)), 512, 3072
        gated, norm = trial % 2 == 1, trial % 3 == 0
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = (torch.randn(2 * n if gated else n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
        res = torch.randn(m, n, generator=gen).to(torch.bfloat16)
        norm_weight = torch.ones(k, dtype=torch.bfloat16) if norm else None
        expected = reference(x.float(), w.float(), None, norm_weight, gated, res.float())
        out = fused(x, w, None, norm_weight, gated, res, config=(16, 256 << trial % 2, 4))
        assert rel_error(out, expected) < 1e-2, (trial, m)
    assert not triton_skinny._counters[out.device].any()  # (keyed by the tensors' device: cuda:0, not cuda)


def test_kernels_compile_for_sm90():
    """Plain, split, gated, residual, and rope-and-store variants (bf16 cache in parts; FP8 in one)."""
    signature = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", norm_ptr="*bf16", res_ptr="*bf16",
                     out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32", M="i32", N="i32", K="i32",
                     x_stride="i32", w_stride="i32", res_stride="i32", eps="fp32", parts="i32", qk_eps="fp32",
                     k_scale="fp32", v_scale="fp32")
    signature.update(dict.fromkeys(("positions_ptr", "cos_sin_ptr", "slot_ptr", "q_weight_ptr", "k_weight_ptr",
                                    "k_cache_ptr", "v_cache_ptr"), "*bf16"))  # x stands in where there's no rope
    rope_signature = dict(signature, positions_ptr="*i64", cos_sin_ptr="*fp32", slot_ptr="*i64")

    def rope_of(heads, kv_heads, qk_norm, quantize, on=True):
        return dict(ROPE=on, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, QK_NORM=qk_norm, QUANTIZE=quantize,
                    BLOCK_SIZE=256 if on else 0, V_CHUNK=VALUE_CHUNK if quantize else 0)
    no_rope, qwen = rope_of(0, 0, False, False, on=False), rope_of(16, 8, True, False)
    cases = []
    for block_m, block_n, block_k, flags, rope in [
            (16, 16, 1024, (False, True, False, True, False, True), no_rope),
            (32, 32, 512, (True, True, True, False, True, True), no_rope),
            (16, 16, 1024, (False, False, False, True, True, True), no_rope),
            (16, 32, 256, (True, False, False, False, False, False), no_rope),
            (16, 64, 256, (False, True, False, False, True, True), qwen),
            (32, 64, 256, (False, True, False, False, True, True), qwen),
            (32, 64, 1024, (True, False, False, False, False, False), rope_of(14, 2, False, True))]:
        bias, norm, gated, residual, split, pdl = flags
        sig = signature
        if rope["ROPE"]:
            cache, weights = "fp8e4nv" if rope["QUANTIZE"] else "bf16", "bf16" if rope["QK_NORM"] else "fp32"
            sig = dict(rope_signature, k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", q_weight_ptr=f"*{weights}",
                       k_weight_ptr=f"*{weights}")
        cases.append(("nanovllm.layers.triton_skinny", "_skinny_kernel", sig,
                      dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias, NORM=norm,
                           GATED=gated, RESIDUAL=residual, SPLIT=split,
                           NORM_PARTS=triton_skinny.norm_parts(4 if split else 1, block_m, norm), PDL=pdl,
                           DOT_PRECISION="tf32", **rope),
                      dict(num_warps=8 if rope["ROPE"] else 4, num_stages=1)))
    compile_for_sm90(cases)
