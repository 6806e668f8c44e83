"""Overlap scheduling (step N+1 launched before step N's tokens are known) gives the synchronous engine's outputs."""
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanovllm import LLM, SamplingParams
from nanovllm.engine import step_output
from tests.conftest import assert_greedy_matches_hf, assert_idle_and_clean, greedy


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def mixed_params() -> list[SamplingParams]:
    return [
        greedy(12),
        SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=["e", "ab"]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=list(range(3, 512, 7))),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=list(range(3, 512, 5)), min_tokens=6),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, logprobs=3, ignore_eos=True),
        greedy(40, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0),  # counting the token in flight
    ]


def run(tiny_model, batch, params, async_scheduling, **engine_args):
    with LLM(tiny_model, async_scheduling=async_scheduling, **{"kvcache_block_size": 16, **engine_args}) as llm:
        first = llm.generate(batch, params)
        second = llm.generate(batch, params)  # prefix-cache hits
        stats = llm.stats()
        assert not llm.model_runner.penalty_slots.slot_of  # every ended request gave its slot back
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return first, second, stats


def same_outputs(a: list[dict], b: list[dict]):
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in x if k != "logprobs"} == {k: y[k] for k in y if k != "logprobs"}
        assert (x["logprobs"] is None) == (y["logprobs"] is None)
        for p, q in zip(x["logprobs"] or [], y["logprobs"] or [], strict=True):
            assert p.keys() == q.keys() and all(abs(p[t] - q[t]) < 1e-5 for t in p)


def on_and_off(tiny_model, batch, params, tensor_parallel_size=1, **engine_args):
    """Overlap on (at tensor_parallel_size) and off: the same outputs, the first time and from the prefix cache."""
    on = run(tiny_model, batch, params, True, tensor_parallel_size=tensor_parallel_size, **engine_args)
    off = run(tiny_model, batch, params, False, **engine_args)
    same_outputs(on[0], off[0])
    same_outputs(on[1], off[1])
    return on, off


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(max_num_batched_tokens=40),  # chunked prompts beside decodes
    dict(num_kvcache_blocks=12, max_num_batched_tokens=64),  # preemption
    dict(kvcache_block_size=32, prefill_first=True),
    dict(max_model_len=48),  # requests that end at max_model_len
], ids=["plain", "chunked", "preempting", "prefill-first", "max-model-len"])
def test_overlap_equals_synchronous(tiny_model, hf_model, engine_args):
    batch = prompts(16, seed=1, hi=40) + [list(range(3, 43))]
    params = [mixed_params()[i % 8] for i in range(16)] + [greedy(30)]
    on, off = on_and_off(tiny_model, batch, params, **engine_args)
    assert [o["num_cached_tokens"] for o in on[1]] == [o["num_cached_tokens"] for o in off[1]]
    assert on[2]["num_preemptions"] == off[2]["num_preemptions"]
    if "num_kvcache_blocks" in engine_args:
        assert on[2]["num_preemptions"] > 0
    if "max_model_len" in engine_args:  # the last request: 40 prompt tokens, 8 generated
        assert len(on[0][-1]["token_ids"]) == 8 and on[0][-1]["finish_reason"] == "length"
    for prompt, p, out in zip(batch, params, on[1]):
        if p.temperature == 0 and p.is_plain and out["token_ids"]:  # greedy, with no ban or penalty
            assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])
    assert {o["finish_reason"] for o in on[0]} == {"stop", "length"}


def test_penalties_count_the_tokens_in_flight(tiny_model):
    # strong penalties change the next token if the last one is not counted
    batch = prompts(8, seed=7, hi=30)
    strong = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0)
    params = [greedy(40, **(strong if i % 2 else {})) for i in range(8)]
    on, _ = on_and_off(tiny_model, batch, params)
    for out in on[0][1::2]:  # the penalized ones never repeat a token right away
        assert all(a != b for a, b in zip(out["token_ids"], out["token_ids"][1:]))


@pytest.mark.parametrize("params", [
    greedy(8),
    greedy(8, repetition_penalty=1.5, presence_penalty=0.5),
], ids=["plain", "penalized"])
def test_steps_overlap_only_when_asked(tiny_model, monkeypatch, params):
    events, result = [], step_output.StepOutput.result
    monkeypatch.setattr(step_output.StepOutput, "result", lambda self: events.append("result") or result(self))
    for async_scheduling in (True, False):
        with LLM(tiny_model, kvcache_block_size=16, async_scheduling=async_scheduling) as llm:
            run_step = llm.model_runner.run
            monkeypatch.setattr(llm.model_runner, "run", lambda seqs: events.append("run") or run_step(seqs))
            events.clear()
            llm.generate(prompts(4, seed=2), params)
        in_flight, ahead = 0, 0  # steps in flight; launches while one was
        for event in events:
            in_flight += 1 if event == "run" else -1
            ahead += in_flight == 2
        assert in_flight == 0 and events.count("run") > 4
        # with overlap each step but the first launches before the last completes
        assert ahead == (events.count("run") - 1 if async_scheduling else 0)


def test_the_extra_token_of_an_ended_request_is_dropped(tiny_model):
    batch = prompts(6, seed=3)
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        full = llm.generate(batch, greedy(20))
        stops = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[o["token_ids"][4]]) for o in full]
        handles = [llm.submit(p, stop) for p, stop in zip(batch, stops)]
        for handle in handles:
            handle.result(timeout=30)
        assert_idle_and_clean(llm, 10)  # the step in flight completes too, and every block is free
        for a, handle in zip(full, handles):
            b, seq = handle.result(timeout=30), handle.seq
            end = a["token_ids"].index(a["token_ids"][4]) + 1
            assert b["token_ids"] == a["token_ids"][:end] and b["finish_reason"] == "stop"
            assert seq.token_ids == seq.token_ids[:seq.num_prompt_tokens] + b["token_ids"]  # nothing after it
        bm = llm.scheduler.block_manager
        assert all(-1 not in bm.blocks[b].token_ids for b in bm.hash_to_block_id.values())


def test_aborted_mid_run_keeps_only_known_tokens(tiny_model):
    batch, long = prompts(3, seed=4), greedy(300)
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        expected = llm.generate(batch, long)
        handles = [llm.submit(p, long) for p in batch]
        increments = [iter(h) for h in handles]
        for _ in range(5):
            for it in increments:
                next(it)
        for h in handles:
            h.abort()
        for h, e in zip(handles, expected):
            out = h.result(timeout=30)
            assert out["finish_reason"] == "abort" and -1 not in out["token_ids"]
            assert 5 <= len(out["token_ids"]) < 300 and out["token_ids"] == e["token_ids"][:len(out["token_ids"])]


def test_tensor_parallel_overlap_equals_synchronous(tiny_model):
    batch = prompts(8, seed=5, hi=40)
    params = [mixed_params()[i % 8] for i in range(len(batch))]  # the workers read pending tokens too
    on_and_off(tiny_model, batch, params, 2)


@pytest.fixture(scope="module")
def engine_pair(tiny_model):
    """Overlap on and off, with chunked prompts beside decodes and a cache small enough to preempt."""
    args = dict(kvcache_block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=48, max_num_seqs=6)
    with LLM(tiny_model, async_scheduling=True, **args) as on, LLM(tiny_model, async_scheduling=False, **args) as off:
        yield on, off


@st.composite
def requests(draw):
    def params():
        max_tokens = draw(st.integers(1, 24))
        return SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.9])), seed=draw(st.integers(0, 9)), max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)), ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(3, 511), max_size=40)),
            stop=draw(st.lists(st.text("abcde ", min_size=1, max_size=2), max_size=2)),
            repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.8])))
    n = draw(st.integers(2, 7))
    batch = [draw(st.lists(st.integers(3, 511), min_size=8, max_size=80)) for _ in range(n)]
    return batch, [params() for _ in range(n)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests())
def test_overlap_equals_synchronous_for_any_requests(engine_pair, batch_and_params):
    """The same outputs but for prefix hits (with overlap blocks are freed a step later, so eviction differs)."""
    outputs = [llm.generate(*batch_and_params, use_tqdm=False) for llm in engine_pair]
    for x, y in zip(*outputs, strict=True):
        assert {k: x[k] for k in x if k != "num_cached_tokens"} == {k: y[k] for k in y if k != "num_cached_tokens"}
    for llm in engine_pair:
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and llm.is_finished()
