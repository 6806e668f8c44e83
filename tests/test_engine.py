"""End to end on CPU: greedy tokens equal Hugging Face's (teacher-forced) in every scheduling regime."""
import json
import random
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanovllm import LLM, SamplingParams
from tests.conftest import assert_greedy_matches_hf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def mixed_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 16, 17, 31, 48, 70, 100][:n]
    return [[rng.randrange(3, 500) for _ in range(length)] for length in lengths]


def check_all(hf_model, prompts, outputs):
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])


@pytest.mark.parametrize("block_size", [16, 256])
def test_greedy_matches_hf_mixed_lengths(tiny_model, hf_model, block_size):
    llm = LLM(tiny_model, kvcache_block_size=block_size)
    prompts = mixed_prompts()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(hf_model, prompts, outputs)
    for out in outputs:
        assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_text_prompts_and_per_prompt_params(tiny_model, hf_model):
    llm = LLM(tiny_model, kvcache_block_size=16)
    prompts = ["hello world, this is a test of the engine", "the quick brown fox jumps"]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [5, 9]
    check_all(hf_model, [llm.tokenizer.encode(p) for p in prompts], outputs)


def test_a_cached_block_is_reused_only_after_the_same_prefix(tiny_model, hf_model):
    llm = LLM(tiny_model, kvcache_block_size=16)
    rng = random.Random(3)
    w, x, y, z = ([rng.randrange(3, 500) for _ in range(16)] for _ in range(4))
    llm.generate([w + y + [7], x + z + [7]], GREEDY, use_tqdm=False)  # y's KV is cached after w
    out = llm.generate([x + y + [7]], GREEDY, use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 16  # x's block only
    assert_greedy_matches_hf(hf_model, x + y + [7], out["token_ids"])


def test_prefix_cache_hits_keep_tokens(tiny_model, hf_model):
    llm = LLM(tiny_model, kvcache_block_size=16)
    shared = mixed_prompts()[-1][:64]
    prompts = [shared + [7, 8, 9], shared + [10] * 20, shared[:40]]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    # the second run finds every full block of each prompt cached (but the one holding the last token)
    assert [o["num_cached_tokens"] for o in second] == [64, 80, 32]
    check_all(hf_model, prompts, second)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill(tiny_model, hf_model):
    llm = LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=24)
    step_sizes = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        seqs = schedule()
        step_sizes.append(sum(seq.num_scheduled_tokens for seq in seqs))
        return seqs

    llm.scheduler.schedule = recording_schedule
    prompts = mixed_prompts()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(hf_model, prompts, outputs)
    assert max(step_sizes) == 24  # 100-token prompts went through in chunks of the budget


def test_preemption_under_a_tiny_cache(tiny_model, hf_model):
    llm = LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8)
    assert llm.config.max_model_len == 128  # lowered to what the cache holds
    prompts = mixed_prompts(6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    check_all(hf_model, prompts, outputs)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_cpu_cache_holds_max_num_seqs_contexts_in_whole_blocks(tiny_model):
    """Sized on CPU (no num_kvcache_blocks): the cache holds max_num_seqs sequences of max_model_len, rounded up
    to whole blocks (3 x 100 tokens: 19 blocks of 16), and the size of a block it was sized by is that of one
    block of the cache, keys and values of every layer."""
    from nanovllm.engine.kv_cache import block_bytes
    with LLM(tiny_model, kvcache_block_size=16, max_num_seqs=3, max_model_len=100) as llm:
        runner, cache = llm.model_runner, llm.model_runner.kv_cache
        assert llm.config.num_kvcache_blocks == cache.size(2) == 19 and llm.config.max_model_len == 100
        assert block_bytes(runner.attn_layers, 16, cache.dtype) == cache[:, :, 0].nbytes


def test_a_cache_one_token_short_of_max_model_len_lowers_it(tiny_model):
    """4 blocks of 16 hold 64 tokens: max_model_len 65 is lowered to 64, and a prompt of 65 tokens is refused."""
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=4, max_model_len=65) as llm:
        assert llm.config.max_model_len == 64
        with pytest.raises(ValueError, match="more than max_model_len=64"):
            llm.generate([list(range(3, 68))], use_tqdm=False)


def test_a_cuda_cache_short_of_max_model_len_is_an_error_only_when_sized_from_memory():
    """On CUDA, a cache sized from memory (num_kvcache_blocks=-1) that holds fewer tokens than max_model_len is an
    error naming what to change; a cap the user set (num_kvcache_blocks > 0) lowers max_model_len instead, as on
    CPU. Either way a cache that holds max_model_len leaves it as it is."""
    from types import SimpleNamespace
    from nanovllm.engine.kv_cache import fit_to_blocks
    sized = SimpleNamespace(device="cuda", num_kvcache_blocks=-1, max_model_len=100)
    with pytest.raises(ValueError, match="fits 64 tokens .4 blocks of 16., fewer than max_model_len=100"):
        fit_to_blocks(sized, 4, 16)
    capped = SimpleNamespace(device="cuda", num_kvcache_blocks=4, max_model_len=100)
    fit_to_blocks(capped, 4, 16)
    assert capped.max_model_len == 64 and capped.num_kvcache_blocks == 4
    roomy = SimpleNamespace(device="cuda", num_kvcache_blocks=-1, max_model_len=100)
    fit_to_blocks(roomy, 7, 16)
    assert roomy.max_model_len == 100 and roomy.num_kvcache_blocks == 7


def test_a_cpu_cache_is_capped_by_its_share_of_free_ram(monkeypatch):
    """Sized on CPU with little free RAM, the cache gets as many whole blocks as CPU_KV_CACHE_SHARE of it holds
    (not that many bytes), and at least one."""
    from types import SimpleNamespace
    from nanovllm.engine import kv_cache
    config = SimpleNamespace(max_num_seqs=512, max_model_len=4096)  # 131072 blocks of 16 would be enough
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(kv_cache.os, "sysconf", lambda name: pages[name])
    assert kv_cache.cpu_blocks(config, 16, 1000) == int(1000 * 4096 * kv_cache.CPU_KV_CACHE_SHARE) // 1000
    assert kv_cache.cpu_blocks(config, 16, 1 << 30) == 1
    pages["SC_AVPHYS_PAGES"] = 1 << 40  # RAM enough: max_num_seqs contexts of max_model_len, in whole blocks
    assert kv_cache.cpu_blocks(SimpleNamespace(max_num_seqs=3, max_model_len=100), 16, 1000) == 19


def test_auto_dtype_on_cuda_is_the_checkpoints(tmp_path, monkeypatch):
    """dtype="auto" runs the model on CUDA in the dtype its checkpoint is stored in (on CPU: float32). The Config
    alone, with CUDA faked: it allocates nothing."""
    from nanovllm.config import Config
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for dtype in ("float16", "float32", "bfloat16"):
        path = make_random_checkpoint(tmp_path / dtype, dtype=dtype, with_weights=False)
        assert Config(str(path)).dtype == dtype


def test_stops_at_max_model_len(tiny_model):
    llm = LLM(tiny_model, kvcache_block_size=16, max_model_len=30)
    out = llm.generate([list(range(3, 28))], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5


def test_stops_on_generation_config_eos(tiny_model, tmp_path):
    prompt = mixed_prompts()[4]
    free_run = LLM(tiny_model).generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
    stop_at = next(i for i, t in enumerate(free_run) if t not in free_run[:i] and i >= 2)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    gen_config = json.loads((model / "generation_config.json").read_text())
    gen_config["eos_token_id"] = [free_run[stop_at]]
    (model / "generation_config.json").write_text(json.dumps(gen_config))

    llm = LLM(str(model))
    params = SamplingParams(temperature=0, max_tokens=12)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == free_run[:stop_at + 1]
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert ignored[0]["token_ids"] == free_run


def test_every_eos_id_of_generation_config_counts(tmp_path):
    from types import SimpleNamespace
    from nanovllm.engine.llm_engine import eos_token_ids
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 3]}')
    assert eos_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=5)) == (3, 5, 7)


def test_sampling_is_seeded_and_in_vocab(tiny_model):
    prompts = mixed_prompts(4)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = LLM(tiny_model, seed=1).generate(prompts, params, use_tqdm=False)
    b = LLM(tiny_model, seed=1).generate(prompts, params, use_tqdm=False)
    c = LLM(tiny_model, seed=2).generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    assert [o["token_ids"] for o in a] != [o["token_ids"] for o in c]
    assert all(0 <= t < 512 for o in a for t in o["token_ids"])


def test_a_prefill_runs_while_the_cache_is_sized(tiny_model, monkeypatch):
    """On CUDA, sizing the KV cache runs a warmup prefill first (`warmup_model`), before the cache, the graphs and
    the workers' channel exist. Here the CPU sizing runs it too, so a step that reads something set up later fails
    on CPU as well (one such attribute once broke every GPU start)."""
    from nanovllm.engine.model_runner import ModelRunner
    sized = ModelRunner._num_kv_blocks
    prefills = []

    def sized_after_a_prefill(runner, block_bytes):
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
        runner.warmup_model()
        prefills.append(runner.config.max_num_batched_tokens)
        return sized(runner, block_bytes)

    monkeypatch.setattr(ModelRunner, "_num_kv_blocks", sized_after_a_prefill)
    with LLM(tiny_model, max_model_len=64, max_num_batched_tokens=128) as llm:
        assert prefills == [128]
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 3


def test_kernel_warmup_runs_each_kind_of_step(tiny_model, hf_model, monkeypatch):
    """On CUDA the engine runs these steps at start, so that kernels compiled on first use (one flash-attn-4
    variant per kind) compile then, not while serving, for small steps and for steps of half the token budget:
    a chunk and a 2-token chunk each beside a decode, the widest steps (many decodes and a chunk, the first time
    also every power of two fewer decodes, so that each decode-kernel variant a mixed step may pick compiles; short
    chunks only), a prefill alone; then a decode alone. Here they run on CPU, and the engine serves exactly after
    them."""
    with LLM(tiny_model, max_num_seqs=8, kvcache_block_size=16, max_num_batched_tokens=256) as llm:
        runner, shapes = llm.model_runner, []
        run_step = runner.run_step
        monkeypatch.setattr(runner, "run_step", lambda inputs, sampling=(): shapes.append(
            (inputs.num_seqs, inputs.num_leading_decodes, int(inputs.query_lens.max()), len(inputs.input_ids)))
            or run_step(inputs, sampling))
        runner.warmup_kernels()
        prompts = [list(range(3, 40)), list(range(50, 70))]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
    # (sequences, leading decodes, longest chunk, tokens) for contexts of 32 tokens, then of the budget's 256
    assert shapes[:14] == [(2, 1, 16, 17), (2, 1, 2, 3), (2, 1, 16, 17), (3, 2, 16, 18), (5, 4, 16, 20),
                           (8, 7, 16, 23), (8, 0, 2, 16), (1, 0, 16, 16),
                           (2, 1, 128, 129), (2, 1, 2, 3), (8, 7, 128, 135), (8, 0, 16, 128), (1, 0, 128, 128),
                           (1, 1, 1, 1)]
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])


def warmup_steps(llm, monkeypatch) -> list[tuple]:
    """(sequences, leading decodes, longest chunk, longest context) of each step `warmup_kernels` runs."""
    runner, shapes = llm.model_runner, []
    run_step = runner.run_step
    monkeypatch.setattr(runner, "run_step", lambda inputs, sampling=(): shapes.append(
        (inputs.num_seqs, inputs.num_leading_decodes, int(inputs.query_lens.max()), int(inputs.context_lens.max())))
        or run_step(inputs, sampling))
    runner.warmup_kernels()
    return shapes


def test_kernel_warmup_chunks_stay_chunks_beside_many_sequences(tiny_model, monkeypatch):
    """With more sequences than half a small step's tokens (max_num_seqs 32 beside contexts of 32 tokens: the
    default 512 beside blocks of 256 is the same), the widest step of short chunks still holds chunks of 2 tokens,
    not decodes: every step before the last decode-only one has a chunk."""
    with LLM(tiny_model, max_num_seqs=32, kvcache_block_size=16, max_num_batched_tokens=256,
             max_model_len=256) as llm:
        shapes = warmup_steps(llm, monkeypatch)
    assert len(shapes) == 16 and shapes[-1] == (1, 1, 1, 256)  # contexts of 32, then of 256 tokens
    assert all(chunk >= 2 for _, _, chunk, _ in shapes[:-1]), shapes
    assert [(seqs, decodes, chunk) for seqs, decodes, chunk, _ in shapes if seqs == 32 and not decodes] == [
        (32, 0, 2), (32, 0, 4)]  # max(2, 32 // 2 // 32), then 256 // 2 // 32


def test_kernel_warmup_stays_within_the_models_positions(tmp_path, monkeypatch):
    """A model of 128 positions (max_model_len follows) beside a token budget of 512: the warm-up's steps of half
    the budget are chunks of several 128-token contexts, not one 512-token context whose positions would read past
    the rope's table (on CUDA, past its allocation: session 23's illegal address, with the tiny model's 4,096
    positions and the default budget of 16,384). On CPU the torch rope raises on such a position."""
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    path = make_random_checkpoint(tmp_path / "short", "tiny", max_position_embeddings=128)
    with LLM(str(path), max_num_seqs=4, kvcache_block_size=16, max_num_batched_tokens=512) as llm:
        assert llm.config.max_model_len == 128
        shapes = warmup_steps(llm, monkeypatch)
    assert max(context for *_, context in shapes) == 128
    # half the budget (256 tokens) as chunks of 64 beside a decode; the widest steps hold max_num_seqs sequences
    assert [shape for shape in shapes if shape[-1] == 128][:5] == [
        (4, 1, 64, 128), (2, 1, 2, 128), (4, 1, 64, 128), (4, 0, 64, 128), (3, 0, 64, 128)]


@settings(max_examples=300, deadline=None)
@given(max_len=st.integers(1, 600), budget=st.integers(1, 2000), num_seqs=st.integers(1, 40),
       block=st.sampled_from([16, 32, 256]))
def test_kernel_warmup_steps_stay_within_the_configs_bounds(max_len, budget, num_seqs, block):
    """Whatever the config: no position reaches max_model_len, every block a sequence uses is in its table, a
    step holds at most max_num_seqs sequences (two where that is one: a decode beside a chunk), and the large
    round has a prefill step of half the budget, as far as max_num_seqs - 1 half-contexts hold it."""
    from types import SimpleNamespace
    from nanovllm.engine.warmup import kernel_warmup_steps
    config = SimpleNamespace(max_model_len=max_len, max_num_seqs=num_seqs, max_num_batched_tokens=budget)
    steps = list(kernel_warmup_steps(config, block))
    for seqs in steps:
        assert 1 <= len(seqs) <= max(num_seqs, 2)
        for seq in seqs:
            assert 0 <= seq.num_computed_tokens < seq.num_tokens <= max_len
            assert seq.num_scheduled_tokens == seq.num_tokens - seq.num_computed_tokens
            assert len(seq.block_table) * block >= seq.num_tokens
    prefills = [sum(seq.num_scheduled_tokens for seq in seqs) for seqs in steps
                if all(seq.num_computed_tokens < seq.num_tokens - 1 for seq in seqs)]
    assert max(prefills, default=0) >= min(budget // 2, max(num_seqs - 1, 1) * (min(budget, max_len) // 2))


@settings(max_examples=200, deadline=None)
@given(max_len=st.integers(1, 600), budget=st.integers(1, 2000), num_seqs=st.integers(1, 40))
def test_the_sizing_prefill_is_the_largest_step_the_scheduler_makes(max_len, budget, num_seqs):
    """The prefill that sizes the KV cache on CUDA (its peak activation memory is what the cache must leave free)
    is the largest the scheduler can make: as many whole contexts of max_model_len as the token budget and
    max_num_seqs allow, or one context cut to the budget; each computes all its tokens and samples."""
    from types import SimpleNamespace
    from nanovllm.engine.warmup import sizing_prefill
    config = SimpleNamespace(max_model_len=max_len, max_num_seqs=num_seqs, max_num_batched_tokens=budget)
    seqs = sizing_prefill(config)
    assert len(seqs) == max(min(budget // max_len, num_seqs), 1)
    for seq in seqs:
        assert seq.num_tokens == min(max_len, budget) and seq.num_computed_tokens == 0
        assert seq.num_scheduled_tokens == seq.num_tokens and seq.samples_this_step
    assert sum(seq.num_scheduled_tokens for seq in seqs) <= budget


def test_kernel_warmup_fits_a_cache_smaller_than_the_token_budget(tiny_model, monkeypatch):
    """A KV cache of fewer tokens (4 blocks of 16) than the token budget (256): the warm-up's large steps have
    contexts of the cache's 64 tokens, whose blocks exist, and run."""
    with LLM(tiny_model, max_num_seqs=4, kvcache_block_size=16, max_num_batched_tokens=256,
             num_kvcache_blocks=4) as llm:
        shapes = warmup_steps(llm, monkeypatch)
    assert sorted({context for *_, context in shapes}) == [32, 64]
