"""silu(gate) * up as one Triton kernel (`triton_activation`) against float64: ragged rows and columns, rows of a
wider tensor, leading dims; on CPU through the interpreter, on a GPU in bf16 against torch, and in the engine."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tests.conftest import compile_for_sm90, greedy

triton_activation = pytest.importorskip("nanovllm.layers.triton_activation")
if triton_activation.triton is None:
    pytest.skip("Triton does not import here", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, -1)
    return F.silu(gate) * up


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), n=st.sampled_from([1, 3, 64, 1000, 1024, 1500, 2049]), pad=st.sampled_from([0, 5]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_matches_float64(rows, n, pad, dtype, seed):
    """Every row and column (past a tile's 4 rows and 1,024 columns too), read from rows `pad` wider than 2n."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, 2 * n + pad, generator=g, dtype=torch.float32) * 4
    x = wide[:, :2 * n].to(dtype)
    out = triton_activation.silu_and_mul(x.to(DEVICE)).cpu()
    assert out.shape == (rows, n) and out.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: rounded once, to within 2**-8 of the value
    torch.testing.assert_close(out.double(), reference(x), rtol=tolerance, atol=tolerance)


def test_leading_dims_and_no_rows():
    x = torch.randn(2, 3, 10)
    torch.testing.assert_close(triton_activation.silu_and_mul(x.to(DEVICE)).cpu().double(), reference(x))
    assert triton_activation.silu_and_mul(torch.empty(0, 10, device=DEVICE)).shape == (0, 5)


def test_kernel_compiles_for_sm90():
    signature = dict(x_ptr="*bf16", out_ptr="*bf16", num_rows="i32", n="i32", x_stride="i32", out_stride="i32")
    compile_for_sm90([("nanovllm.layers.triton_activation", "_silu_and_mul_kernel", signature,
                       dict(BLOCK_ROWS=triton_activation.BLOCK_ROWS, BLOCK_COLS=triton_activation.BLOCK_COLS))])


@pytest.mark.gpu
def test_bf16_at_real_shapes_against_torch():
    """Qwen3-0.6B's 3,072 columns at a prefill's and a decode batch's rows: within torch's own bf16 rounding of
    its two products (eager torch rounds silu(gate) before the product, the kernel once)."""
    for rows in (33, 256, 1024, 16384):
        x = torch.randn(rows, 6144, device="cuda", dtype=torch.bfloat16) * 3
        gate, up = x.chunk(2, -1)
        torch.testing.assert_close(triton_activation.silu_and_mul(x), F.silu(gate) * up, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
def test_engine_gated_layers_run_the_kernel(tiny_model, monkeypatch):
    """On CUDA the model runner gives every SiluAndMul the kernel, and NANOVLLM_TRITON_SILU=0 torch.compile's."""
    from nanovllm import LLM
    from nanovllm.layers.activation import SiluAndMul
    params = greedy(4)
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("NANOVLLM_TRITON_SILU", switch)
        with LLM(tiny_model, enforce_eager=True) as llm:
            acts = [m for m in llm.model_runner.model.modules() if type(m) is SiluAndMul]
            assert acts and all((m.forward is triton_activation.silu_and_mul) == (switch == "1") for m in acts)
            outputs.append(llm.generate([list(range(3, 60))], params, use_tqdm=False)[0]["token_ids"])
    assert outputs[0] == outputs[1]
