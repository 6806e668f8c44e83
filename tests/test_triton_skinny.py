"""The skinny matmul (few rows, `triton_skinny`) against float64 torch: rows 1-32, K in one part or several (whose
last program adds the partial sums and leaves its counter at zero), with and without bias, ragged N and K; on CPU
through Triton's interpreter in float32, and on a GPU in bf16."""
import pytest
import torch

from tests.conftest import compile_for_sm90

triton_skinny = pytest.importorskip("nanovllm.layers.triton_skinny")
if triton_skinny.triton is None:
    pytest.skip("Triton does not import here", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TILE = (16, 128, 4, 2)  # small tiles: several blocks of columns and of K even at these sizes


def reference(x, w, b):
    return x.double() @ w.double().T + (b.double() if b is not None else 0)


def rel_error(out, expected):
    return ((out.double().cpu() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("m,n,k,parts,bias", [
    (1, 40, 300, 1, False), (3, 64, 512, 2, True), (16, 33, 700, 3, False), (17, 96, 256, 1, True),
    (32, 50, 1000, 4, True), (5, 70, 1000, None, False)])
def test_skinny_matches_torch(m, n, k, parts, bias):
    gen = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    expected = reference(x, w, b)
    for _ in range(2):  # the second launch finds the counters the first one left
        out = triton_skinny.skinny_linear(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if bias else None, parts=parts,
                                          config=TILE)
        assert out.shape == (m, n) and out.dtype == torch.float32
        assert ((out.double().cpu() - expected).norm() / expected.norm()).item() < 1e-5
    if parts != 1:
        assert not triton_skinny._counters[out.device].any()


def test_parts_fill_the_gpu():
    assert triton_skinny.skinny_parts(6144, 1024, 32, 256, 132) == 1  # 192 blocks of 32 columns fill 132 SMs
    assert triton_skinny.skinny_parts(1024, 3072, 32, 256, 132) == 5  # 32 blocks: five parts, 160 programs
    assert triton_skinny.skinny_parts(1024, 256, 32, 256, 132) == 1  # K too short to cut
    assert triton_skinny.skinny_parts(1024, 200, 32, 256, 132) == 1  # K shorter than one block_k: one part, not 0


@pytest.fixture
def skinny_calls(monkeypatch):
    """The skinny path on, on this device, with the shapes of x that reach skinny_linear."""
    monkeypatch.setattr(triton_skinny, "ENABLED", True)
    monkeypatch.setattr(triton_skinny, "DEVICE_TYPE", DEVICE.type)
    calls = []
    skinny = triton_skinny.skinny_linear
    monkeypatch.setattr(triton_skinny, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape) or skinny(*a, **kw))
    return calls


def test_linear_layers_take_it(skinny_calls):
    from nanovllm.layers import linear
    x, w = torch.randn(4, 300, device=DEVICE), torch.randn(40, 300, device=DEVICE)
    assert torch.allclose(linear.linear(x, w, None), x @ w.T, atol=1e-4)
    linear.linear(torch.randn(triton_skinny.MAX_ROWS + 1, 300, device=DEVICE), w, None)  # more rows: F.linear
    linear.linear(x, torch.randn(300, 300, device=DEVICE), None)  # as many outputs as inputs (qkv, gate/up)
    assert skinny_calls == [(4, 300)]


def test_linear_takes_it_up_to_max_rows_with_the_bias(skinny_calls):
    """A decode step of MAX_ROWS rows is still skinny, and the bias is added there as on F.linear's path; x whose
    columns are not contiguous (the kernel reads them as if they were) stays on F.linear, and is right."""
    from nanovllm.layers import linear
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 300, generator=gen), torch.randn(40, generator=gen)
    x = torch.randn(triton_skinny.MAX_ROWS, 300, generator=gen)
    assert rel_error(linear.linear(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)), reference(x, w, b)) < 1e-5
    columns = torch.randn(300, 4, generator=gen).t()  # [4, 300] with a column stride of 4
    assert rel_error(linear.linear(columns.to(DEVICE), w.to(DEVICE), None), reference(columns, w, None)) < 1e-5
    assert skinny_calls == [(triton_skinny.MAX_ROWS, 300)]


def test_row_parallel_layers_take_it(skinny_calls):
    """o_proj and down are RowParallelLinear: their forward goes through `linear`, so a decode step's few rows
    take the skinny matmul, bias included."""
    from nanovllm.layers.linear import RowParallelLinear
    gen = torch.Generator().manual_seed(5)
    layer = RowParallelLinear(300, 40, bias=True)
    layer.weight.data.copy_(torch.randn(40, 300, generator=gen))
    layer.bias.data.copy_(torch.randn(40, generator=gen))
    x = torch.randn(3, 300, generator=gen)
    expected = reference(x, layer.weight.data, layer.bias.data)
    assert rel_error(layer.to(DEVICE)(x.to(DEVICE)), expected) < 1e-5
    assert skinny_calls == [(3, 300)]


def test_skinny_reads_rows_at_their_strides():
    """x and w may be views whose rows lie further apart than K (a slice of a wider tensor; `fits` asks only that
    their columns be contiguous): each row is read at its own stride, in one part of K and in several."""
    gen = torch.Generator().manual_seed(3)
    m, n, k = 5, 40, 300
    x = torch.randn(m, k + 17, generator=gen)[:, 9:9 + k]
    w = torch.randn(n, k + 44, generator=gen)[:, 30:30 + k]
    expected = reference(x, w, None)
    for parts in (1, 3):
        out = triton_skinny.skinny_linear(x.to(DEVICE), w.to(DEVICE), parts=parts, config=TILE)
        assert rel_error(out, expected) < 1e-5, parts


def test_counters_grow_with_the_blocks():
    """A launch with more blocks of columns than the counters held so far gets as many zeroed counters as it has
    blocks: a smaller one would let its last programs count in memory that is not theirs."""
    blocks = triton_skinny._counter(DEVICE, 8).numel() + 100
    counter = triton_skinny._counter(DEVICE, blocks)
    assert counter.numel() >= blocks and not counter.any()
    assert triton_skinny._counter(DEVICE, 8) is counter  # kept for the next launches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_parts_race_free_on_gpu():
    """Many launches with K in parts, in bf16 against float64: a partial sum read before its program stored it,
    or a counter left non-zero, shows up as a wrong block of columns in some launch."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        m, n, k = int(torch.randint(1, 33, (1,), generator=gen)), 1024, 3072
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, torch.bfloat16)
        expected = reference(x.cpu().float(), w.cpu().float(), None)
        out = triton_skinny.skinny_linear(x, w, parts=1 + trial % 8).double().cpu()
        assert ((out - expected).norm() / expected.norm()).item() < 1e-2, (trial, m)
    assert not triton_skinny._counters[x.device].any()


def test_kernels_compile_for_sm90():
    signature = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32",
                     counter_ptr="*i32", M="i32", N="i32", K="i32", x_stride="i32", w_stride="i32", part_k="i32",
                     parts="i32")
    cases = []
    for block_m, bias, split in [(16, False, True), (32, True, True), (16, True, False)]:
        cases.append(("nanovllm.layers.triton_skinny", "_skinny_kernel", signature,
                      dict(BLOCK_M=block_m, BLOCK_N=triton_skinny.CONFIG[0], BLOCK_K=triton_skinny.CONFIG[1],
                           HAS_BIAS=bias, SPLIT=split, DOT_PRECISION="tf32"),
                      dict(num_warps=triton_skinny.CONFIG[2], num_stages=triton_skinny.CONFIG[3])))
    compile_for_sm90(cases)
