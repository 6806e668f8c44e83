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


def test_linear_layers_take_it(monkeypatch):
    from nanovllm.layers import linear
    monkeypatch.setattr(triton_skinny, "ENABLED", True)
    monkeypatch.setattr(triton_skinny, "DEVICE_TYPE", DEVICE.type)
    calls = []
    skinny = triton_skinny.skinny_linear
    monkeypatch.setattr(triton_skinny, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape) or skinny(*a, **kw))
    x, w = torch.randn(4, 300, device=DEVICE), torch.randn(40, 300, device=DEVICE)
    assert torch.allclose(linear.linear(x, w, None), x @ w.T, atol=1e-4)
    linear.linear(torch.randn(triton_skinny.MAX_ROWS + 1, 300, device=DEVICE), w, None)  # more rows: F.linear
    linear.linear(x, torch.randn(300, 300, device=DEVICE), None)  # as many outputs as inputs (qkv, gate/up)
    assert calls == [(4, 300)]


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
