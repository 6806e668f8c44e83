"""The skinny matmul with its fused norm, gate and residual (`triton_skinny`) against the unfused layers in float64:
rows 1-32, K in one part or several (whose last program adds the partial sums, applies the rest and leaves its
counter at zero), with and without bias, ragged N and K; on CPU through Triton's interpreter in float32, and on
a GPU in bf16. Then the layers that route to it, and a model whose decode steps run through it."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from tests.conftest import assert_greedy_matches_hf, compile_for_sm90

triton_skinny = pytest.importorskip("nanovllm.layers.triton_skinny")
if triton_skinny.triton is None:
    pytest.skip("Triton does not import here", allow_module_level=True)

from nanovllm.layers.activation import GeluAndMul, SiluAndMul  # noqa: E402
from nanovllm.layers.attention import VALUE_CHUNK  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def normed(x, norm_weight=None):
    """x in float64, through RMSNorm if it has a weight."""
    x = x.double()
    return x if norm_weight is None else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()


def reference(x, w, b=None, norm_weight=None, gated=False, residual=None):
    """The unfused layers in float64: RMSNorm, the product and bias, silu(gate) * up, the residual."""
    y = normed(x, norm_weight) @ w.double().T + (b.double() if b is not None else 0)
    if gated:
        gate, up = y.chunk(2, -1)
        y = F.silu(gate) * up
    return y if residual is None else y + residual.double()


def rel_error(out, expected):
    return ((out.double().cpu() - expected).norm() / expected.norm()).item()


def float32_bound(x, w, b, norm_weight, gated, expected, tolerance=1e-5, c=4.0):
    """A bound for `rel_error` that float32 sums meet however the output cancels: `tolerance`, or `c` float32 eps of
    each product's sum of absolute terms (|norm(x)| @ |w|.T + |b|), times the output's derivative in that product
    (silu(gate) * up's in gate and in up), relative to the output: the example's gate, -0.0054 from terms of
    ~10.5, puts torch's own float32 layers 4.5e-5 off."""
    x, bias = normed(x, norm_weight), b.double() if b is not None else 0
    terms = x.abs() @ w.double().abs().T + abs(bias)
    if gated:
        (gate, up), (gate_terms, up_terms) = (x @ w.double().T + bias).chunk(2, -1), terms.chunk(2, -1)
        sig = torch.sigmoid(gate)
        terms = (up * sig * (1 + gate * (1 - sig))).abs() * gate_terms + (gate * sig).abs() * up_terms
    return max(tolerance, c * torch.finfo(torch.float32).eps * (terms.norm() / expected.norm()).item())


def fused(x, w, b=None, norm_weight=None, gated=False, residual=None, config=None):
    """skinny_linear on DEVICE of CPU tensors."""
    to = (lambda t: None if t is None else t.to(DEVICE))
    return triton_skinny.skinny_linear(to(x), to(w), to(b), norm=None if norm_weight is None else
                                       (to(norm_weight), EPS), gated=gated, residual=to(residual), config=config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, through the interpreter: every draw would compile a "
                    "variant on a GPU (there: test_parts_race_free_on_gpu)")
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 32), n=st.integers(1, 80), k=st.integers(1, 700), block_k=st.sampled_from([64, 128, 1024]),
       bias=st.booleans(), norm=st.booleans(), gated=st.booleans(), residual=st.booleans(), seed=st.integers(0, 99))
@example(m=1, n=1, k=323, block_k=64, bias=False, norm=False, gated=True, residual=False, seed=42)  # gate cancels
def test_skinny_matches_the_unfused_layers(m, n, k, block_k, bias, norm, gated, residual, seed):
    """Any mix of norm, gate, bias and residual, K in one part (block_k 1024) or many: the unfused layers' result
    within what float32 sums allow (`float32_bound`); a second launch finds the counters the first one left at zero."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n
    x, w = torch.randn(m, k, generator=gen), torch.randn(rows, k, generator=gen) / k ** 0.5
    b = torch.randn(rows, generator=gen) if bias else None
    norm_weight = torch.rand(k, generator=gen) + 0.5 if norm else None
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
    """Whatever the shape, the plan's blocks tile K with power-of-two blocks that `tl.dot` takes (its choices
    are timings: `git show 34b7da6:benchmarks/skinny_gemm.py` --sweep)."""
    for block_m, k, gated in [(16, 1024, False), (32, 3072, False), (16, 3072, False), (16, 1024, True), (32, 64, True),
                              (16, 17, False)]:
        block_n, block_k, warps = triton_skinny.plan(block_m, k, gated)
        assert block_n >= 16 and block_k >= 16 and block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0
        assert warps in (4, 8)


@pytest.mark.parametrize("m", [1, 16, 17])
def test_the_plans_tiles_match_the_unfused_layers(m):
    """Qwen3-0.6B's down projection (1024 x 3072) with its residual on the plan's own tiles: up to 16 rows (the
    tile timed in the engine's steps) and past them."""
    gen = torch.Generator().manual_seed(m)
    x, w, res = torch.randn(m, 3072, generator=gen), torch.randn(1024, 3072, generator=gen) * 0.02, \
        torch.randn(m, 1024, generator=gen)
    out = fused(x, w, residual=res)
    assert rel_error(out, reference(x, w, residual=res)) < 1e-4
    assert not triton_skinny._counters[out.device].any()


@pytest.mark.parametrize("seed", range(6))
def test_qkv_with_rope_and_store_matches_the_unfused_layers(seed):
    """A qkv projection with its rope and KV store in the epilogue (`rope`): the q columns as the projection, the
    head norms and rope would give them, k and v as projected, and the cache as the unfused store leaves it
    (padding slots untouched); heads of 32 and 64, any GQA ratio, biases, the layer's norm, q/k norms, an FP8
    cache with scales (its values laid out as the keys, or in chunks: `value_chunk`), K in one part or several."""
    import random
    from tests.test_triton_attention import assert_stored_as
    from tests.test_triton_rope_store import case, unfused
    rng = random.Random(seed)
    num_kv_heads, head_dim = rng.choice([1, 2]), rng.choice([32, 64])
    num_heads = num_kv_heads * rng.choice([1, 2, 3])
    qk_norm, fp8, bias, norm = seed % 2 == 0, seed % 3 == 2, seed % 4 < 2, seed < 3
    if fp8 and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 here")
    m, k = rng.randint(2, 7) if seed % 2 else rng.randint(17, 24), rng.choice([48, 200])  # 16 and 32-row blocks
    _, _, _, positions, rope, q_norm, k_norm, caches, slots, (k_scale, v_scale) = case(  # seed 5: chunked values
        seed, torch.float32, num_heads, num_kv_heads, head_dim, qk_norm, fp8, num_tokens=m,
        block_size=VALUE_CHUNK if seed == 5 else 16)
    gen = torch.Generator().manual_seed(seed)
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    norm_weight = torch.rand(k, generator=gen) + 0.5 if norm else None
    qkv = reference(x, w, b, norm_weight).float().to(DEVICE)
    q, kk, v = (t.view(m, -1, head_dim) for t in qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                                                           num_kv_heads * head_dim], -1))
    expected_caches = [c.clone() for c in caches]
    expected_q = unfused(q, kk, v, positions, rope, q_norm, k_norm, *expected_caches, slots, k_scale, v_scale)
    args = triton_skinny.RopeStoreArgs(positions, rope.cos_sin_cache, q_norm.weight if qk_norm else None,
                                       k_norm.weight if qk_norm else None, 1e-6, *caches, slots, k_scale, v_scale)
    for block_k in (256, 32):
        out = triton_skinny.skinny_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE),
                                          norm=None if norm_weight is None else (norm_weight.to(DEVICE), EPS),
                                          rope=args, config=(head_dim // 2, block_k, 4))
        got_q = out[:, :num_heads * head_dim].reshape(m, num_heads, head_dim)
        torch.testing.assert_close(got_q, expected_q, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[:, num_heads * head_dim:], qkv[:, num_heads * head_dim:], atol=1e-4, rtol=1e-4)
        for cache, want in zip(caches, expected_caches):  # the padding slot (-1) stores nothing
            if fp8 and DEVICE.type == "cpu":
                assert_stored_as(cache, want)
            else:  # an FP8 value that a 1e-7 difference tips to its neighbour: one FP8 step (1/8) away
                torch.testing.assert_close(cache.float(), want.float(), atol=1e-4, rtol=0.13 if fp8 else 1e-4)
    assert not triton_skinny._counters[out.device].any()


def integer_qkv(m, num_heads, num_kv_heads, head_dim, bound, gen, k=64, dtype=torch.float16):
    """x and w of integers in [-bound, bound], so every float32 sum is exact, and the projection's output rounded
    once to `dtype`, split into q, k and v heads on DEVICE; with a rope table of 4,096 positions."""
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    x = torch.randint(-bound, bound + 1, (m, k), generator=gen).to(dtype)
    w = torch.randint(-bound, bound + 1, (q_size + 2 * kv_size, k), generator=gen).to(dtype)
    qkv = (x.double() @ w.double().T).to(dtype)
    heads = tuple(t.view(m, -1, head_dim).to(DEVICE) for t in qkv.split([q_size, kv_size, kv_size], -1))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return x, w, qkv, heads, RotaryEmbedding(inv_freq, 4096).cos_sin_cache.to(DEVICE)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("block_k", [64, 32])
def test_qkv_with_rope_rounds_the_projection_as_the_unfused_layers(qk_norm, block_k):
    """In a 16-bit dtype the epilogue rounds the projection's output before the norms and rope, as the projection
    followed by `rope_store` does: integer x and w make every float32 sum exact while most outputs need rounding
    to float16, so q, k, v and the cache must equal theirs bit for bit (float16: the interpreter's bf16 `tl.dot`
    is wrong)."""
    from nanovllm.layers.triton_rope_store import rope_store
    dtype, gen = torch.float16, torch.Generator().manual_seed(1)
    m, num_heads, num_kv_heads, head_dim = 5, 2, 1, 32
    q_size = num_heads * head_dim
    x, w, qkv, (q, kk, v), cos_sin = integer_qkv(m, num_heads, num_kv_heads, head_dim, 64, gen)
    assert (qkv.double() != x.double() @ w.double().T).float().mean() > 0.3
    positions = torch.tensor([3, 1000, 17, 4095, 250], device=DEVICE)
    slots = torch.tensor([4, 0, -1, 9, 2], device=DEVICE)
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if qk_norm \
        else [None, None]
    caches = [torch.zeros(2, 8, num_kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    want_q = rope_store(q, kk, v, positions, cos_sin, *weights, 1e-6, *want_caches, slots)
    args = triton_skinny.RopeStoreArgs(positions, cos_sin, *weights, 1e-6, *caches, slots, 1.0, 1.0)
    out = triton_skinny.skinny_linear(x.to(DEVICE), w.to(DEVICE), rope=args, config=(head_dim // 2, block_k, 4))
    assert torch.equal(out[:, :q_size].view(m, num_heads, head_dim), want_q)
    assert torch.equal(out[:, q_size:].cpu(), qkv[:, q_size:])
    for got, want in zip(caches, want_caches):
        assert torch.equal(got, want)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_with_rope_rounds_fp8_keys_as_the_fused_store(qk_norm):
    """Into an FP8 cache the epilogue rounds the rotated keys to the model's dtype before it quantizes them, as
    `rope_store` does (tests/test_triton_rope_store.py checks that against the unfused layers): with integer x and
    w the float32 sums are exact and the projections equal, so the caches must equal byte for byte; quantized
    unrounded, ~0.4% of float16 keys differ (here 32 rows x 2 heads x 64 dims: ~16 of them)."""
    from nanovllm.layers.attention import FP8_DTYPE
    from nanovllm.layers.triton_rope_store import rope_store
    dtype, gen = torch.float16, torch.Generator().manual_seed(2)
    m, num_heads, num_kv_heads, head_dim = 32, 2, 2, 64
    x, w, _, (q, kk, v), cos_sin = integer_qkv(m, num_heads, num_kv_heads, head_dim, 16, gen)
    positions = torch.randint(0, 4096, (m,), generator=gen).to(DEVICE)
    slots = torch.randperm(64, generator=gen)[:m].to(DEVICE)
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if qk_norm \
        else [None, None]
    caches = [torch.zeros(2, 32, num_kv_heads, head_dim, device=DEVICE).to(FP8_DTYPE) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    rope_store(q, kk, v, positions, cos_sin, *weights, 1e-6, *want_caches, slots, 4.0, 8.0)
    args = triton_skinny.RopeStoreArgs(positions, cos_sin, *weights, 1e-6, *caches, slots, 4.0, 8.0)
    triton_skinny.skinny_linear(x.to(DEVICE), w.to(DEVICE), rope=args, config=(head_dim // 2, 64, 4))
    for got, want in zip(caches, want_caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fuses_rope_only_where_tl_dot_takes_half_a_head(monkeypatch):
    """Half a head must be a power of two of 16 or more (`tl.dot`'s least N on a GPU, which the interpreter does not
    check): heads of 8 and 16 keep the separate kernel, as do 48 and 80."""
    for name, value in [("ENABLED", True), ("ROPE", True), ("DEVICE_TYPE", DEVICE.type),
                        ("pdl_launch", lambda device: True)]:
        monkeypatch.setattr(triton_skinny, name, value)
    x = torch.zeros(4, 256, device=DEVICE)
    fused = {dim: triton_skinny.fuses_rope(x, torch.zeros(4 * dim, 256, device=DEVICE), dim)
             for dim in (8, 16, 32, 48, 64, 80, 128)}
    assert fused == {8: False, 16: False, 32: True, 48: False, 64: True, 80: False, 128: True}
    monkeypatch.setattr(triton_skinny, "ROPE", False)  # NANOVLLM_SKINNY_ROPE=0
    assert not triton_skinny.fuses_rope(x, torch.zeros(512, 256, device=DEVICE), 128)


@pytest.fixture
def skinny_calls(monkeypatch):
    """The skinny path on, on this device, as on an H200 (dependent launches, so wide products too), with (shape of
    x, norm?, gated?, residual?) of each call."""
    monkeypatch.setattr(triton_skinny, "ENABLED", True)
    monkeypatch.setattr(triton_skinny, "DEVICE_TYPE", DEVICE.type)
    monkeypatch.setattr(triton_skinny, "pdl_launch", lambda device: True)
    calls = []
    skinny = triton_skinny.skinny_linear

    def spy(x, w, bias=None, **kw):
        calls.append((tuple(x.shape), kw.get("norm") is not None, kw.get("gated", False),
                      kw.get("residual") is not None))
        return skinny(x, w, bias, **kw)
    monkeypatch.setattr(triton_skinny, "skinny_linear", spy)
    return calls


def test_linear_fuses_norm_silu_and_residual(skinny_calls):
    """`linear` hands the norm, a silu gate and the residual to the kernel for a few rows, and gives the same as
    the layers one after the other; more rows, another activation, or x read across its columns, take F.linear
    and the layers, with the same result."""
    from nanovllm.layers import linear
    gen = torch.Generator().manual_seed(4)
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
    """Without PDL a product with at least as many outputs as inputs (qkv, gate/up) stays on cuBLAS, norm and
    all, where o_proj's and down's shape still takes the kernel."""
    from nanovllm.layers import linear
    gen = torch.Generator().manual_seed(6)
    x, wide, narrow = (torch.randn(*shape, generator=gen).to(DEVICE) for shape in ((4, 64), (128, 64), (32, 64)))
    norm = RMSNorm(64, eps=EPS).to(DEVICE)
    monkeypatch.setattr(triton_skinny, "pdl_launch", lambda device: False)
    assert rel_error(linear.linear(x, wide, None, norm), reference(x.cpu(), wide.cpu(), None, norm.weight.cpu())) < 1e-5
    linear.linear(x, narrow, None)
    monkeypatch.setattr(triton_skinny, "pdl_launch", lambda device: True)
    linear.linear(x, wide, None, norm)
    assert skinny_calls == [((4, 64), False, False, False), ((4, 64), True, False, False)]


def test_square_products_need_dependent_launches(monkeypatch):
    """`fits` takes fewer outputs than inputs without PDL, so a square product (Llama's o_proj) is not one of them;
    with PDL it is."""
    for name, value in [("ENABLED", True), ("DEVICE_TYPE", DEVICE.type), ("pdl_launch", lambda device: False)]:
        monkeypatch.setattr(triton_skinny, name, value)
    x = torch.zeros(4, 64, device=DEVICE)
    assert triton_skinny.fits(x, torch.zeros(63, 64, device=DEVICE))
    assert not triton_skinny.fits(x, torch.zeros(64, 64, device=DEVICE))
    monkeypatch.setattr(triton_skinny, "pdl_launch", lambda device: True)
    assert triton_skinny.fits(x, torch.zeros(64, 64, device=DEVICE))


def test_row_parallel_layers_add_the_residual_in_it(skinny_calls):
    """o_proj and down are RowParallelLinear: a decode step's few rows take the skinny matmul, bias and residual
    included."""
    from nanovllm.layers.linear import RowParallelLinear
    gen = torch.Generator().manual_seed(5)
    layer = RowParallelLinear(300, 40, bias=True)
    layer.weight.data.copy_(torch.randn(40, 300, generator=gen))
    layer.bias.data.copy_(torch.randn(40, generator=gen))
    x, res = torch.randn(3, 300, generator=gen), torch.randn(3, 40, generator=gen)
    expected = reference(x, layer.weight.data, layer.bias.data, residual=res)
    assert rel_error(layer.to(DEVICE)(x.to(DEVICE), residual=res.to(DEVICE)), expected) < 1e-5
    assert skinny_calls == [((3, 300), False, False, True)]


def test_row_parallel_ranks_add_the_residual_after_the_all_reduce(skinny_calls, monkeypatch):
    """With tensor parallelism each rank's skinny product is its partial sum: the bias (rank 0 only) goes in the
    kernel, the residual after the all-reduce, so it counts once whatever the ranks (all_reduce stands in here: rank
    1's share, a known tensor, added to rank 0's)."""
    from nanovllm.layers import linear
    gen = torch.Generator().manual_seed(7)
    layer = linear.RowParallelLinear(64, 24, bias=True).to(DEVICE)
    layer.weight.data.copy_(torch.randn(24, 64, generator=gen))
    layer.bias.data.copy_(torch.randn(24, generator=gen))
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
    """K in parts: up to 16 rows each program sums the squares of its rows whole, past them each part its own
    columns' and the last part scales the sums by rstd; either way the normed product of the unfused layers."""
    gen = torch.Generator().manual_seed(7)
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
    """x, w and the residual may be views whose rows lie further apart than their width (slices of wider
    tensors; `fits` asks only that columns be contiguous): each row is read at its own stride, with the norm's
    sum of squares over the whole row in one part of K and in several."""
    gen = torch.Generator().manual_seed(3)
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
    """In a 16-bit dtype (float16: the interpreter's bf16 `tl.dot` is wrong) the product is rounded to it before
    the residual is added (as `residual + o_proj(x)`), and gate and up before silu(gate) * up, which is rounded
    once. x is integer and w a multiple of 1/256, so every float32 sum is exact while most need rounding to
    float16; the gates are biased past 20, where float32's sigmoid is 1, so silu(gate) * up is exact in float32
    too: the output must equal the exactly computed one bit for bit."""
    dtype, gen = torch.float16, torch.Generator().manual_seed(2)
    m, n, k = 5, 24, 64
    x = torch.randint(-32, 33, (m, k), generator=gen).to(dtype)
    w = (torch.randint(-64, 65, (2 * n, k), generator=gen) / 256).to(dtype)
    exact = x.double() @ w.double().T  # the float32 sums, exactly
    assert (exact[:, :n].to(dtype).double() != exact[:, :n]).float().mean() > 0.5
    res = (torch.randn(m, n, generator=gen) * 4).to(dtype)
    want = (exact[:, :n].to(dtype).double() + res.double()).to(dtype)  # rounded, then the residual added
    assert not torch.equal(want, (exact[:, :n] + res.double()).to(dtype))  # (rounding once would differ)
    out = triton_skinny.skinny_linear(x.to(DEVICE), w[:n].to(DEVICE), residual=res.to(DEVICE),
                                      config=(16, block_k, 4))
    assert torch.equal(out.cpu(), want)
    bias = torch.cat([torch.full((n,), 96.0), torch.zeros(n)]).to(dtype)
    gate, up = (exact + bias.double()).to(dtype).double().chunk(2, -1)  # each rounded as the projection's output
    assert gate.min() > 20  # sigmoid(gate) == 1 in float32
    want = (gate * up).to(dtype)
    assert not torch.equal(want, ((exact[:, :n] + 96) * up).to(dtype))  # (an unrounded gate would differ)
    out = triton_skinny.skinny_linear(x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE), gated=True,
                                      config=(16, block_k, 4))
    assert torch.equal(out.cpu(), want)


def test_counters_grow_with_the_blocks():
    """A launch with more blocks of columns than the counters held so far gets as many zeroed counters as it has
    blocks: a smaller one would let its last programs count in memory that is not theirs."""
    blocks = triton_skinny._counter(DEVICE, 8).numel() + 100
    counter = triton_skinny._counter(DEVICE, blocks)
    assert counter.numel() >= blocks and not counter.any()
    assert triton_skinny._counter(DEVICE, 8) is counter  # kept for the next launches


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, through the interpreter (GPU: test_gpu_engine.py)")
def test_decode_steps_through_the_fused_kernels_match_hf(tiny_model, hf_model, skinny_calls):
    """The tiny Qwen3 with every projection of its decode steps on the skinny kernel (norm + qkv, o_proj +
    residual, norm + gate/up + silu, down + residual): greedy tokens as HF's, teacher-forced."""
    from nanovllm import LLM, SamplingParams
    prompts = [[5, 9, 200, 31], [7] * 11, [300, 2, 8]]
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=40) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])
    fused_kinds = {call[1:] for call in skinny_calls}
    assert fused_kinds == {(True, False, False), (False, False, True), (True, True, False)}, fused_kinds


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, through the interpreter (GPU: test_gpu_engine.py)")
@pytest.mark.parametrize("family", ["llama-linear-rope-biases", "qwen3-moe-sparse-step-and-dense-layers"])
def test_other_families_decode_through_it(tmp_path, skinny_calls, family):
    """Biases on every projection (Llama with attention_bias and mlp_bias), and mixture-of-experts layers beside
    dense ones (whose MLP the kernel does not take: its norm and residual stay with the torch layers): greedy
    tokens as HF's, with the projections of each decode step on the skinny kernel."""
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    from tests.test_models import FAMILIES, check_against_hf
    shape, overrides = FAMILIES[family]
    check_against_hf(make_random_checkpoint(tmp_path / family, shape, **overrides))
    assert {call[1:] for call in skinny_calls} >= {(True, False, False), (False, False, True)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, through the interpreter (GPU: test_gpu_engine.py)")
@pytest.mark.parametrize("family", ["tiny", "llama-linear-rope-biases"])
def test_decode_steps_with_rope_in_the_projection_match_hf(tmp_path, skinny_calls, monkeypatch, family):
    """The decoder's fused rope and KV store (as the Triton backends have it; here the torch backend reads the
    cache they fill) moved into the qkv projection for decode steps: q/k norms and the layer's norm (Qwen3), biases
    without q/k norms (Llama); heads of 32. Greedy tokens as HF's, teacher-forced, and every decode step's qkv
    took the fused epilogue."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.layers.attention import TorchBackend
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    from tests.test_models import FAMILIES, hf_model
    monkeypatch.setattr(TorchBackend, "fuses_rope_store", True)
    ropes = []
    skinny = triton_skinny.skinny_linear

    def spy(x, w, bias=None, **kw):
        ropes.append((x.size(0), kw.get("rope") is not None))
        return skinny(x, w, bias, **kw)
    monkeypatch.setattr(triton_skinny, "skinny_linear", spy)
    shape, overrides = FAMILIES.get(family, ("tiny", {}))
    path = make_random_checkpoint(tmp_path / family, shape, **dict(overrides, head_dim=32))
    prompts = [[5, 9, 200, 31], [7] * 40, list(range(3, 60))]
    with LLM(str(path), kvcache_block_size=16, num_kvcache_blocks=24) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])
    assert sum(rope for _, rope in ropes) >= 2 * 5  # two layers, five decode steps at least


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_parts_race_free_on_gpu():
    """Many launches with K in parts, norm and gate and residual, in bf16 against float64: a partial sum read
    before its program stored it, or a counter left non-zero, shows up as a wrong block of columns somewhere."""
    gen = torch.Generator().manual_seed(0)
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
    """Plain, split, gated and residual variants, and qkv with its rope and store (q/k norms into a bf16 cache
    in parts, at 16 and 32 rows: the norm's two ways; biases into an FP8 cache in one part, 14 heads over 2)."""
    signature = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", norm_ptr="*bf16", res_ptr="*bf16",
                     out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32", M="i32", N="i32", K="i32",
                     x_stride="i32", w_stride="i32", res_stride="i32", eps="fp32", parts="i32", qk_eps="fp32",
                     k_scale="fp32", v_scale="fp32")
    signature.update(dict.fromkeys(("positions_ptr", "cos_sin_ptr", "slot_ptr", "q_weight_ptr", "k_weight_ptr",
                                    "k_cache_ptr", "v_cache_ptr"), "*bf16"))  # x stands in where there's no rope
    rope_signature = dict(signature, positions_ptr="*i64", cos_sin_ptr="*fp32", slot_ptr="*i64")
    no_rope = dict(ROPE=False, NUM_HEADS=0, NUM_KV_HEADS=0, QK_NORM=False, QUANTIZE=False, BLOCK_SIZE=0, V_CHUNK=0)
    cases = []
    for block_m, block_n, block_k, flags, rope in [
            (16, 16, 1024, (False, True, False, True, False, True), no_rope),
            (32, 32, 512, (True, True, True, False, True, True), no_rope),
            (16, 16, 1024, (False, False, False, True, True, True), no_rope),
            (16, 32, 256, (True, False, False, False, False, False), no_rope),
            (16, 64, 256, (False, True, False, False, True, True),
             dict(ROPE=True, NUM_HEADS=16, NUM_KV_HEADS=8, QK_NORM=True, QUANTIZE=False, BLOCK_SIZE=256, V_CHUNK=0)),
            (32, 64, 256, (False, True, False, False, True, True),
             dict(ROPE=True, NUM_HEADS=16, NUM_KV_HEADS=8, QK_NORM=True, QUANTIZE=False, BLOCK_SIZE=256, V_CHUNK=0)),
            (32, 64, 1024, (True, False, False, False, False, False),
             dict(ROPE=True, NUM_HEADS=14, NUM_KV_HEADS=2, QK_NORM=False, QUANTIZE=True, BLOCK_SIZE=256,
                  V_CHUNK=VALUE_CHUNK))]:
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
