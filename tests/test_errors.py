"""Bad input gets a clear error before any work starts, and the engine serves the next call normally."""
import importlib
import re
import shutil

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers import triton_guard
from tests.conftest import greedy, refuses

GREEDY = greedy(4)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, kvcache_block_size=16, max_model_len=64)


def test_missing_model_folder_or_tokenizer(tiny_model, tmp_path):
    refuses(FileNotFoundError, "does-not-exist", tmp_path / "does-not-exist")
    shutil.copy(f"{tiny_model}/config.json", tmp_path)  # transformers makes an empty tokenizer
    refuses(ValueError, f"{tmp_path}' has no tokenizer", tmp_path, load_format="dummy")


def test_unknown_engine_argument_is_named(tiny_model):
    refuses(TypeError, "max_num_seq", tiny_model, max_num_seq=4)


@pytest.mark.parametrize("name, value", [("eos_token_ids", (5,)), ("hf_config", None)])
def test_fields_the_engine_sets_are_not_engine_arguments(tiny_model, name, value):
    refuses(TypeError, f"unknown engine argument\\(s\\) \\['{name}'\\]", tiny_model, **{name: value})


@pytest.mark.parametrize("kwargs, match", [
    ({"kvcache_block_size": 24}, "kvcache_block_size=24"), ({"max_num_seqs": 0}, "max_num_seqs=0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization=0 must be in \\(0, 1\\]"),
    ({"num_kvcache_blocks": 0}, "num_kvcache_blocks=0"),  # not a silent "size from memory" (that is -1)
    ({"seed": -1}, "seed=-1 must be in"), ({"seed": 2**63}, "seed=9223372036854775808 must be in"),
    ({"tensor_parallel_size": 16}, "tensor_parallel_size=16 must be in \\[1, 8\\]"),  # the limit, not a head count
    ({"device": "tpu"}, "device='tpu'"), ({"dtype": "float8"}, "dtype='float8'"),
    ({"attention_backend": "nope"}, "attention_backend='nope'"),
])
def test_bad_engine_settings(tiny_model, kwargs, match):
    refuses(ValueError, match, tiny_model, **kwargs)


def test_a_setting_of_the_wrong_type_is_named(tiny_model):  # a bool is no number; a list no name (unhashable)
    for name, value, kind in (("max_num_seqs", True, "an int"), ("gpu_memory_utilization", True, "a number"),
                              ("dtype", ["x"], "a str"), ("kv_cache_dtype", [], "a str")):
        refuses(TypeError, re.escape(f"{name}={value!r} must be {kind}"), tiny_model, **{name: value})


def test_flash_attn_without_cuda_is_a_clear_error(tiny_model):
    if torch.cuda.is_available():
        pytest.skip("this machine can run flash-attn")
    refuses(ValueError, "attention_backend='flash-attn' needs CUDA", tiny_model, attention_backend="flash-attn")


@pytest.mark.parametrize("kwargs, error", [
    ({"temperature": -0.5}, ValueError), ({"temperature": float("nan")}, ValueError), ({"max_tokens": 0}, ValueError),
    ({"max_tokens": 2.5}, TypeError), ({"ignore_eos": "yes"}, TypeError), ({"top_k": -2}, ValueError),
    ({"min_p": -0.1}, ValueError), ({"min_tokens": -1}, ValueError), ({"frequency_penalty": -2.5}, ValueError),
    ({"temperature": True}, TypeError), ({"top_k": np.bool_(True)}, TypeError),  # a bool is no number, nor an int
])
def test_bad_sampling_params(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_sampling_params_at_the_edges_of_their_ranges_are_taken():
    """vLLM's ranges, closed where theirs are."""
    for kwargs in ({"top_k": -1}, {"top_k": 0}, {"frequency_penalty": -2.0, "presence_penalty": -2.0},
                   {"frequency_penalty": 2.0, "presence_penalty": 2.0}, {"top_p": 1.0, "min_p": 1.0},
                   {"min_tokens": 4, "max_tokens": 4}, {"logprobs": 0}, {"stop_token_ids": [0]}):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="min_tokens=-1"):
        SamplingParams(max_tokens=None, min_tokens=-1)


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([[5, 6, 7]], greedy(None, min_tokens=100), use_tqdm=False)[0]
    assert (out["finish_reason"], len(out["token_ids"])) == ("length", 64 - 3)
    with pytest.raises(ValueError, match="stop token id -1 must be >= 0"):
        SamplingParams(stop_token_ids=[7, -1])


@pytest.mark.parametrize("prompts, params, error, match", [
    ([list(range(3, 70))], GREEDY, ValueError, "67 tokens, more than max_model_len=64"),
    ([""], GREEDY, ValueError, "empty"), ([[]], GREEDY, ValueError, "empty"),
    ([[5, 512]], GREEDY, ValueError, "token id 512 is outside the vocabulary \\[0, 512\\)"),
    ([[5, -1]], GREEDY, ValueError, "token id -1"), ([[5, 6.0]], GREEDY, TypeError, "list of ints"),
    ([3.5], GREEDY, TypeError, "str or a list of token ids"),
    (["a", "b"], [GREEDY] * 3, ValueError, "4 sampling params were given for 3 prompts"),
    (["a"], [{"temperature": 0}], TypeError, "must be SamplingParams, not dict"),
])
def test_bad_requests_leave_engine_usable(llm, prompts, params, error, match):
    with pytest.raises(error, match=match):
        llm.generate(["fine prompt"] + prompts, params if not isinstance(params, list) else params[:1] + params,
                     use_tqdm=False)
    assert llm.is_finished()  # nothing of the rejected call was queued
    out = llm.generate(["fine prompt", [5, 6, 7]], GREEDY, use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [4, 4]
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_of_exactly_max_model_len_is_served(llm):
    out = llm.generate([list(range(3, 67))], SamplingParams(max_tokens=10), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 1


@pytest.mark.parametrize("module, call, name", [
    ("triton_activation", lambda m: m.silu_and_mul(None), "silu"),
    ("triton_attention", lambda m: m.decode_attention(*[None] * 5, scale=1.0), "attention"),
    ("triton_attention", lambda m: m.varlen_attention(*[None] * 6, scale=1.0), "attention"),
    ("triton_kvstore", lambda m: m.store_kvcache(*[None] * 5), "KV-cache store"),
    ("triton_moe", lambda m: m.fused_experts(*[None] * 5), "MoE"),
    ("triton_rope_store", lambda m: m.rope_store(*[None] * 11), "rope"),
    ("triton_sampler", lambda m: m.sample_plain(*[None] * 3), "sampler"),
    ("triton_skinny", lambda m: m.skinny_linear(None, None), "skinny"),
])
def test_a_kernel_without_triton_names_itself_and_why(monkeypatch, module, call, name):
    monkeypatch.setattr(triton_guard, "triton", None)
    monkeypatch.setattr(triton_guard, "TRITON_ERROR", ImportError("no triton on this test's machine"))
    with pytest.raises(RuntimeError, match=f"(?s){name}.*no triton on this test's machine"):
        call(importlib.import_module(f"nanovllm.layers.{module}"))
