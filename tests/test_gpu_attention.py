"""The flash-attn and Triton backends and the Triton KV store in bf16 against `TorchBackend` on float32 copies, on
random paged inputs (GPU); a test skips when its kernel family does not import."""
import math
from itertools import accumulate

import pytest
import torch

from nanovllm.layers.attention import AttentionMetadata, TorchBackend
from nanovllm.layers.flash_attention import FlashAttnBackend

ATOL = 2e-2
# (query_lens, context_lens) per sequence; a query is the last tokens of its context
CASES = {
    "prefill": ([1, 17, 64, 200, 129], [1, 17, 64, 200, 129]),
    "prefix": ([13, 1, 77, 256], [100, 300, 513, 700]),
    "decode": ([1] * 8, [1, 15, 16, 17, 255, 256, 257, 1000]),
    "mixed": ([1, 50, 1, 128, 3], [300, 50, 17, 400, 64]),
}
FAMILY_BLOCK_SIZES = ([("fa4", b) for b in (16, 64, 128, 256)] + [("fa2", 256)]
                      + [("triton", b) for b in (16, 48, 128, 256)] + [("triton-decode", 128)])


def make_backend(family: str, **kw):
    """A flash-attn family ("fa4", "fa2"), the Triton backend ("triton") or FA4 with Triton decode (and `kw`)."""
    try:
        if family == "triton":
            from nanovllm.layers.triton_attention import TritonBackend
            return TritonBackend()
        if family == "triton-decode":
            return FlashAttnBackend("fa4", triton_decode=True, **kw)
        return FlashAttnBackend(family)
    except ValueError as e:  # the family does not import here, or the GPU is too old for it
        pytest.skip(str(e))


def make_meta(query_lens, context_lens, block_tables, block_size, device) -> AttentionMetadata:
    slots = [int(block_tables[i, p // block_size]) * block_size + p % block_size  # a query: its context's last tokens
             for i, (q, c) in enumerate(zip(query_lens, context_lens)) for p in range(c - q, c)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32, device=device),
        max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens),
        query_lens_host=list(query_lens), context_lens_host=list(context_lens))


def random_block_tables(context_lens, block_size, num_blocks, generator, width=None) -> torch.Tensor:
    """Shuffled, non-contiguous block ids; rows padded with -1."""
    counts = [math.ceil(c / block_size) for c in context_lens]
    ids = torch.randperm(num_blocks, generator=generator)[:sum(counts)].to(torch.int32)
    table = torch.full((len(context_lens), width or max(counts)), -1, dtype=torch.int32)
    for i, row in enumerate(ids.split(counts)):
        table[i, :len(row)] = row
    return table


def split_kv(qkv, num_heads, num_kv_heads, head_dim):
    """k and v as non-contiguous slices of one fused qkv projection, as the layers produce them."""
    return qkv[:, num_heads * head_dim:].unflatten(1, (2, num_kv_heads, head_dim)).unbind(1)


def run_both(backend, query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0, num_decodes=0):
    """Store this step's k/v and attend, with `backend` in bf16 and with TorchBackend in float32."""
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(c / block_size) for c in context_lens) + 5  # some blocks no sequence uses
    block_tables = random_block_tables(context_lens, block_size, num_blocks, gen)
    meta = make_meta(query_lens, context_lens, block_tables, block_size, device)
    meta.num_decodes = num_decodes
    num_tokens = sum(query_lens)
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(2)]
    unused = torch.ones(num_blocks, dtype=torch.bool)
    unused[block_tables[block_tables >= 0].long()] = False
    for cache in caches:
        cache[unused] = float("nan")  # blocks outside every table must never be read
    bf = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(**bf)
    k, v = split_kv(torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(**bf),
                    num_heads, num_kv_heads, head_dim)
    caches = [c.to(**bf) for c in caches]
    ref_caches = [c.float() for c in caches]  # the reference sees exactly the bf16 inputs, widened
    q_ref, k_ref, v_ref = q.float(), k.float(), v.float()
    scale = head_dim ** -0.5

    torch_backend = TorchBackend()
    torch_backend.store_kvcache(k_ref, v_ref, *ref_caches, meta.slot_mapping)
    expected = torch_backend.forward(q_ref, k_ref, v_ref, *ref_caches, meta, scale)
    backend.store_kvcache(k, v, *caches, meta.slot_mapping)
    out = backend.forward(q, k, v, *caches, meta, scale)
    torch.cuda.synchronize()
    return out, expected


def assert_close(out, expected):
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    err = (out.float() - expected).abs().max().item()
    assert err < ATOL, f"max abs error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family,block_size", FAMILY_BLOCK_SIZES)
def test_forward_matches_torch(family, block_size, case):
    assert_close(*run_both(make_backend(family), *CASES[case], 16, 8, 128, block_size))


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 64), (8, 1, 128), (8, 1, 64)])
@pytest.mark.parametrize("case", ["mixed", "decode"])
@pytest.mark.parametrize("family,block_size", [("fa4", 64), ("fa4", 128), ("fa2", 256), ("triton", 64)])
def test_forward_gqa_and_head_dims(family, block_size, case, num_heads, num_kv_heads, head_dim):
    assert_close(*run_both(make_backend(family), *CASES[case], num_heads, num_kv_heads, head_dim, block_size))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["prefill", "mixed"])
@pytest.mark.parametrize("below", [-1, 0, 1])
def test_triton_decode_sends_small_varlen_steps_to_triton(case, below, monkeypatch):
    """A prefill or mixed step of at most triton_varlen_tokens tokens runs Triton's varlen kernel, a larger one
    flash-attn-4; both agree with torch."""
    from nanovllm.layers import triton_attention
    query_lens, context_lens = CASES[case]
    tokens = sum(query_lens)
    backend = make_backend("triton-decode", triton_varlen_tokens=tokens + below)
    calls, varlen = [], triton_attention.varlen_attention
    monkeypatch.setattr(triton_attention, "varlen_attention",
                        lambda *args, **kw: calls.append(args[0].size(0)) or varlen(*args, **kw))
    assert_close(*run_both(backend, query_lens, context_lens, 16, 8, 128, 128))
    assert calls == ([] if below < 0 else [tokens])


@pytest.mark.gpu
@pytest.mark.parametrize("varlen_tokens", [276, 277])
def test_triton_decode_splits_a_mixed_step_that_leads_with_decodes(varlen_tokens, monkeypatch):
    """40 decodes then two prompts of 277 tokens: within triton_varlen_tokens the decodes go to the decode kernel,
    the prompts to Triton's varlen; beyond it flash-attn-4 takes the whole step."""
    from nanovllm.layers import triton_attention
    backend = make_backend("triton-decode", triton_varlen_tokens=varlen_tokens)
    monkeypatch.setattr(triton_attention, "SPLIT_DECODES", 32)
    rows, decode = [], triton_attention.decode_attention
    monkeypatch.setattr(triton_attention, "decode_attention",
                        lambda q, *args, **kw: rows.append(q.size(0)) or decode(q, *args, **kw))
    query_lens, context_lens = [1] * 40 + [77, 200], [17 * i + 1 for i in range(40)] + [300, 200]
    assert_close(*run_both(backend, query_lens, context_lens, 16, 8, 128, 128, num_decodes=40))
    assert rows == ([40] if varlen_tokens == 277 else [])


@pytest.mark.gpu
def test_fa2_rejects_small_blocks():
    backend = make_backend("fa2")
    backend.check(256, 128)
    with pytest.raises(ValueError, match=r"kvcache_block_size=128.*FA2.*256"):
        backend.check(128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (1, 64), (3, 80)])  # (3, 80) exercises the masks
def test_triton_store_matches_torch(num_kv_heads, head_dim, slot_dtype):
    pytest.importorskip("triton")
    from nanovllm.layers.triton_kvstore import store_kvcache
    gen, bf = torch.Generator(device="cuda").manual_seed(0), dict(device="cuda", dtype=torch.bfloat16)
    num_tokens, num_heads, num_blocks, block_size = 37, 2 * num_kv_heads, 9, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, **bf)
    k, v = split_kv(qkv, num_heads, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::5] = -1  # padding: writes nothing
    slots = slots.to(slot_dtype)
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, **bf) for _ in range(2)]
    expected = [c.clone() for c in caches]
    TorchBackend().store_kvcache(k, v, *expected, slots)
    store_kvcache(k, v, *caches, slots)
    assert all(map(torch.equal, caches, expected))


@pytest.mark.gpu
@pytest.mark.parametrize("family,block_size", [("fa4", 64), ("fa4", 128), ("fa2", 256), ("triton", 64),
                                               ("triton", 256), ("triton-decode", 128)])
def test_decode_in_cuda_graph(family, block_size):
    """Captured once, store + decode replay right after the inputs change: longer contexts, padding too."""
    backend = make_backend(family)
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(1)
    bf = dict(device=device, dtype=torch.bfloat16)
    batch, num_heads, num_kv_heads, head_dim, width = 8, 16, 8, 128, 8  # tables hold 8 blocks per sequence
    num_blocks, scale = batch * width + 4, head_dim ** -0.5
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(**bf) for _ in range(2)]

    def inputs(context_lens):
        """Fresh contents for the static buffers; a context of 0 is a padding sequence (no blocks, slot -1)."""
        at_least_1 = [max(c, 1) for c in context_lens]
        tables = random_block_tables(at_least_1, block_size, num_blocks, gen, width)
        meta = make_meta([1] * batch, at_least_1, tables, block_size, device)
        padding = torch.tensor([c == 0 for c in context_lens], device=device)
        meta.block_tables[padding] = -1
        meta.context_lens[padding] = 0
        meta.slot_mapping[padding] = -1
        q = torch.randn(batch, num_heads, head_dim, generator=gen).to(**bf)
        kv = torch.randn(2, batch, num_kv_heads, head_dim, generator=gen).to(**bf)
        return q, kv, meta

    q, kv, meta = inputs([5, 17, 64, 100, 2, 9, 33, 70])  # static buffers: the graph reads these tensors

    def step():
        backend.store_kvcache(*kv, *caches, meta.slot_mapping)
        return backend.forward(q, *kv, *caches, meta, scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: FA4 compiles on its first call, which a capture cannot hold
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    # longer contexts than at capture (up to the table width) and two padding sequences
    new_q, new_kv, new_meta = inputs([width * block_size, 1, 3 * block_size + 7, 0, 250, 0, block_size, 129])
    q.copy_(new_q)
    kv.copy_(new_kv)
    for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
        getattr(meta, name).copy_(getattr(new_meta, name))
    meta.context_lens_host = new_meta.context_lens_host  # not read by the graph; keeps `meta` truthful
    graph.replay()
    replayed = out.clone()
    eager = step()  # same buffers: rewrites the same slots with the same values, then attends
    ref_caches = [c.float() for c in caches]
    expected = TorchBackend().forward(q.float(), *kv.float(), *ref_caches, new_meta, scale)
    real = torch.tensor([i for i in range(batch) if new_meta.context_lens[i] > 0], device=device)
    assert torch.equal(replayed[real], eager[real])
    assert_close(replayed[real], expected[real])
