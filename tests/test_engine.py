"""End to end on CPU: greedy tokens equal Hugging Face's (teacher-forced) in every scheduling regime."""
import functools
import json
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.engine import kv_cache
from nanovllm.engine.llm_engine import eos_token_ids, sampling_defaults
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.warmup import kernel_warmup_steps, sizing_prefill
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import assert_greedy_matches_hf, greedy

LLM16 = functools.partial(LLM, kvcache_block_size=16)


GREEDY = greedy(12)


def mixed_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 16, 17, 31, 48, 70, 100][:n]
    return [[rng.randrange(3, 500) for _ in range(length)] for length in lengths]


def generate(llm, prompts, params=GREEDY) -> list[dict]:
    return llm.generate(prompts, params, use_tqdm=False)


def check_all(hf_model, prompts, outputs):
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])


def assert_every_block_free(llm):
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("block_size", [16, 256])
def test_greedy_matches_hf_mixed_lengths(tiny_model, hf_model, block_size):
    llm = LLM(tiny_model, kvcache_block_size=block_size)
    prompts = mixed_prompts()
    outputs = generate(llm, prompts)
    check_all(hf_model, prompts, outputs)
    for out in outputs:
        assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_text_prompts_and_per_prompt_params(tiny_model, hf_model):
    llm = LLM16(tiny_model)
    prompts = ["hello world, this is a test of the engine", "the quick brown fox jumps"]
    outputs = generate(llm, prompts, [greedy(5), greedy(9)])
    assert [len(o["token_ids"]) for o in outputs] == [5, 9]
    check_all(hf_model, [llm.tokenizer.encode(p) for p in prompts], outputs)


def test_a_cached_block_is_reused_only_after_the_same_prefix(tiny_model, hf_model):
    llm = LLM16(tiny_model)
    rng = random.Random(3)
    w, x, y, z = ([rng.randrange(3, 500) for _ in range(16)] for _ in range(4))
    generate(llm, [w + y + [7], x + z + [7]])  # y's KV is cached after w
    out = generate(llm, [x + y + [7]])[0]
    assert out["num_cached_tokens"] == 16  # x's block only
    assert_greedy_matches_hf(hf_model, x + y + [7], out["token_ids"])


def test_prefix_cache_hits_keep_tokens(tiny_model, hf_model):
    llm = LLM16(tiny_model)
    shared = mixed_prompts()[-1][:64]
    prompts = [shared + [7, 8, 9], shared + [10] * 20, shared[:40]]
    first, second = generate(llm, prompts), generate(llm, prompts)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    # every full block but the one holding the last token
    assert [o["num_cached_tokens"] for o in second] == [64, 80, 32]
    check_all(hf_model, prompts, second)
    assert_every_block_free(llm)


def test_chunked_prefill(tiny_model, hf_model):
    llm = LLM16(tiny_model, max_num_batched_tokens=24)
    step_sizes, schedule = [], llm.scheduler.schedule

    def recording_schedule():
        seqs = schedule()
        step_sizes.append(sum(seq.num_scheduled_tokens for seq in seqs))
        return seqs

    llm.scheduler.schedule = recording_schedule
    prompts = mixed_prompts()
    check_all(hf_model, prompts, generate(llm, prompts))
    assert max(step_sizes) == 24  # 100-token prompts in chunks


def test_preemption_under_a_tiny_cache(tiny_model, hf_model):
    llm = LLM16(tiny_model, num_kvcache_blocks=8)
    assert llm.config.max_model_len == 128  # lowered to what the cache holds
    prompts = mixed_prompts(6)
    outputs = generate(llm, prompts, greedy(40))
    assert llm.scheduler.num_preemptions > 0
    check_all(hf_model, prompts, outputs)
    assert_every_block_free(llm)


def test_a_cpu_cache_holds_max_num_seqs_contexts_in_whole_blocks(tiny_model):
    # 3 x 100 tokens: 19 blocks of 16, each of the size it was sized by
    with LLM16(tiny_model, max_num_seqs=3, max_model_len=100) as llm:
        runner, cache = llm.model_runner, llm.model_runner.kv_cache
        assert llm.config.num_kvcache_blocks == cache.size(2) == 19 and llm.config.max_model_len == 100
        assert kv_cache.block_bytes(runner.attn_layers, 16, cache.dtype) == cache[:, :, 0].nbytes


def test_a_cache_one_token_short_of_max_model_len_lowers_it(tiny_model):
    with LLM16(tiny_model, num_kvcache_blocks=4, max_model_len=65) as llm:
        assert llm.config.max_model_len == 64  # 4 blocks of 16
        with pytest.raises(ValueError, match="more than max_model_len=64"):
            llm.generate([list(range(3, 68))], use_tqdm=False)


def test_a_cuda_cache_short_of_max_model_len_is_an_error_only_when_sized_from_memory():
    # a user's cap (num_kvcache_blocks > 0) lowers max_model_len instead, as on CPU

    def config(blocks):
        return SimpleNamespace(device="cuda", num_kvcache_blocks=blocks, max_model_len=100)

    with pytest.raises(ValueError, match="fits 64 tokens .4 blocks of 16., fewer than max_model_len=100"):
        kv_cache.fit_to_blocks(config(-1), 4, 16)
    kv_cache.fit_to_blocks(capped := config(4), 4, 16)
    assert capped.max_model_len == 64 and capped.num_kvcache_blocks == 4
    kv_cache.fit_to_blocks(roomy := config(-1), 7, 16)
    assert roomy.max_model_len == 100 and roomy.num_kvcache_blocks == 7


def test_a_cpu_cache_is_capped_by_its_share_of_free_ram(monkeypatch):
    # whole blocks in CPU_KV_CACHE_SHARE of the free RAM, at least one
    config = SimpleNamespace(max_num_seqs=512, max_model_len=4096)  # 131072 blocks of 16 would be enough
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(kv_cache.os, "sysconf", lambda name: pages[name])
    assert kv_cache.cpu_blocks(config, 16, 1000) == int(1000 * 4096 * kv_cache.CPU_KV_CACHE_SHARE) // 1000
    assert kv_cache.cpu_blocks(config, 16, 1 << 30) == 1
    pages["SC_AVPHYS_PAGES"] = 1 << 40  # RAM enough: max_num_seqs contexts
    assert kv_cache.cpu_blocks(SimpleNamespace(max_num_seqs=3, max_model_len=100), 16, 1000) == 19


def test_auto_dtype_on_cuda_is_the_checkpoints(tmp_path, monkeypatch):
    # the Config alone, with CUDA faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for dtype in ("float16", "float32", "bfloat16"):
        path = make_random_checkpoint(tmp_path / dtype, dtype=dtype, with_weights=False)
        assert Config(str(path)).dtype == dtype


def test_stops_at_max_model_len(tiny_model):
    llm = LLM16(tiny_model, max_model_len=30)
    out = generate(llm, [list(range(3, 28))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5


def with_gen_config(tiny_model, tmp_path, **fields) -> str:
    path = shutil.copytree(tiny_model, tmp_path / "model") / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return str(path.parent)


def test_stops_on_generation_config_eos(tiny_model, tmp_path):
    prompt = mixed_prompts()[4]
    free_run = generate(LLM(tiny_model), [prompt])[0]["token_ids"]
    stop_at = next(i for i, t in enumerate(free_run) if t not in free_run[:i] and i >= 2)
    llm = LLM(with_gen_config(tiny_model, tmp_path, eos_token_id=[free_run[stop_at]]))
    out = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == free_run[:stop_at + 1]
    assert generate(llm, [prompt])[0]["token_ids"] == free_run  # GREEDY ignores EOS


def test_every_eos_id_of_generation_config_counts(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 3]}')
    assert eos_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=5)) == (3, 5, 7)


@pytest.mark.parametrize("text, match", [("{bad", " is not valid JSON"), ("[7]", " holds a list"), (
    '{"eos_token_id": [7, null]}', r": eos_token_id=\[7, None\]"), ('{"top_k": -5}', ": top_k=-5")])
def test_a_broken_generation_config_is_named(tmp_path, text, match):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=f"generation_config.json{match}"):
        eos_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=5)), sampling_defaults(str(tmp_path))


def test_requests_without_params_take_generation_configs_sampling_fields(tiny_model, tmp_path):
    # top_p null: not given
    llm = LLM(with_gen_config(tiny_model, tmp_path, temperature=0.0, top_k=3, top_p=None, repetition_penalty=1.5))
    assert llm.sampling_defaults == {"temperature": 0.0, "top_k": 3, "repetition_penalty": 1.5}
    prompt, as_given = mixed_prompts()[4], SamplingParams(**llm.sampling_defaults)
    outputs = [llm.generate([prompt], p, use_tqdm=False)[0]["token_ids"] for p in (None, as_given, greedy(64))]
    assert outputs[0] == outputs[1] != outputs[2]


def test_sampling_is_seeded_and_in_vocab(tiny_model):
    prompts, params = mixed_prompts(4), SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b, c = ([o["token_ids"] for o in generate(LLM(tiny_model, seed=s), prompts, params)] for s in (1, 1, 2))
    assert a == b and a != c
    assert all(0 <= t < 512 for o in a for t in o)


def test_a_prefill_runs_while_the_cache_is_sized(tiny_model, monkeypatch):
    # as on CUDA, before the cache, graphs and channel exist
    sized, prefills = ModelRunner._num_kv_blocks, []

    def sized_after_a_prefill(runner, block_bytes):
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
        runner.warmup_model()
        prefills.append(runner.config.max_num_batched_tokens)
        return sized(runner, block_bytes)

    monkeypatch.setattr(ModelRunner, "_num_kv_blocks", sized_after_a_prefill)
    with LLM(tiny_model, max_model_len=64, max_num_batched_tokens=128) as llm:
        assert prefills == [128]
        assert len(generate(llm, [[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]["token_ids"]) == 3


def warmup_steps(llm, monkeypatch, size=lambda inputs: int(inputs.context_lens.max())) -> list[tuple]:
    """(sequences, leading decodes, longest chunk, `size`) of each step of `llm` from `warmup_kernels` on."""
    runner, shapes = llm.model_runner, []
    run_step = runner.run_step
    monkeypatch.setattr(runner, "run_step", lambda inputs, sampling=(): shapes.append(
        (inputs.num_seqs, inputs.num_leading_decodes, int(inputs.query_lens.max()), size(inputs)))
        or run_step(inputs, sampling))
    runner.warmup_kernels()
    return shapes


def warmup_steps_of(model: str, monkeypatch, **config) -> list[tuple]:
    with LLM16(model, max_num_batched_tokens=256, **config) as llm:
        return warmup_steps(llm, monkeypatch)


def test_kernel_warmup_runs_each_kind_of_step(tiny_model, hf_model, monkeypatch):
    # on CUDA, so that kernels compile at start; the engine serves exactly after them
    with LLM16(tiny_model, max_num_seqs=8, max_num_batched_tokens=256) as llm:
        shapes = warmup_steps(llm, monkeypatch, size=lambda inputs: len(inputs.input_ids))
        prompts = [list(range(3, 40)), list(range(50, 70))]
        outputs = generate(llm, prompts, greedy(8))
    # (sequences, leading decodes, longest chunk, tokens) for contexts of 32, then 256 tokens
    assert shapes[:14] == [(2, 1, 16, 17), (2, 1, 2, 3), (2, 1, 16, 17), (3, 2, 16, 18), (5, 4, 16, 20),
                           (8, 7, 16, 23), (8, 0, 2, 16), (1, 0, 16, 16),
                           (2, 1, 128, 129), (2, 1, 2, 3), (8, 7, 128, 135), (8, 0, 16, 128), (1, 0, 128, 128),
                           (1, 1, 1, 1)]
    check_all(hf_model, prompts, outputs)


def test_kernel_warmup_chunks_stay_chunks_beside_many_sequences(tiny_model, monkeypatch):
    # more sequences than half a small step's tokens: the widest step still holds chunks
    shapes = warmup_steps_of(tiny_model, monkeypatch, max_num_seqs=32, max_model_len=256)
    assert len(shapes) == 16 and shapes[-1] == (1, 1, 1, 256)  # contexts of 32, then of 256 tokens
    assert all(chunk >= 2 for _, _, chunk, _ in shapes[:-1]), shapes
    assert [(seqs, decodes, chunk) for seqs, decodes, chunk, _ in shapes if seqs == 32 and not decodes] == [
        (32, 0, 2), (32, 0, 4)]  # max(2, 32 // 2 // 32), then 256 // 2 // 32


def test_kernel_warmup_stays_within_the_models_positions(tmp_path, monkeypatch):
    # half-budget steps are chunks of 128-token contexts, none past the rope's table
    path = make_random_checkpoint(tmp_path / "short", "tiny", max_position_embeddings=128)
    with LLM16(str(path), max_num_seqs=4, max_num_batched_tokens=512) as llm:
        assert llm.config.max_model_len == 128
        shapes = warmup_steps(llm, monkeypatch)
    assert max(context for *_, context in shapes) == 128
    # 256 tokens as chunks of 64 beside a decode; the widest steps of max_num_seqs
    assert [shape for shape in shapes if shape[-1] == 128][:5] == [
        (4, 1, 64, 128), (2, 1, 2, 128), (4, 1, 64, 128), (4, 0, 64, 128), (3, 0, 64, 128)]


@settings(max_examples=300, deadline=None)
@given(max_len=st.integers(1, 600), budget=st.integers(1, 2000), num_seqs=st.integers(1, 40),
       block=st.sampled_from([16, 32, 256]))
def test_kernel_warmup_steps_stay_within_the_configs_bounds(max_len, budget, num_seqs, block):
    """Within max_model_len, the block tables and max_num_seqs (or 2), with a prefill of up to half the budget."""
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
    """CUDA sizes the cache beside its activations: whole contexts as the limits allow, or one cut to the budget."""
    seqs = sizing_prefill(SimpleNamespace(max_model_len=max_len, max_num_seqs=num_seqs, max_num_batched_tokens=budget))
    assert len(seqs) == max(min(budget // max_len, num_seqs), 1)
    for seq in seqs:
        assert seq.num_tokens == min(max_len, budget) and seq.num_computed_tokens == 0
        assert seq.num_scheduled_tokens == seq.num_tokens and seq.samples_this_step
    assert sum(seq.num_scheduled_tokens for seq in seqs) <= budget


def test_kernel_warmup_fits_a_cache_smaller_than_the_token_budget(tiny_model, monkeypatch):
    # a cache of 64 tokens below the budget of 256: the large steps have contexts of 64
    shapes = warmup_steps_of(tiny_model, monkeypatch, max_num_seqs=4, num_kvcache_blocks=4)
    assert sorted({context for *_, context in shapes}) == [32, 64]
