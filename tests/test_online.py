"""Continuous batching: mixed steps, requests submitted from threads while others stream, abort, asyncio."""
import asyncio
import gc
import random
import threading
import time
import weakref

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine import detokenizer as detokenizer_module
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import assert_greedy_matches_hf, assert_idle_and_clean, greedy, wait_until

GREEDY = greedy(12)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 90))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16) as engine:
        yield engine


def test_mixed_steps_equal_prefill_first_and_hf(tiny_model, hf_model):
    batch = prompts(10)
    with LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=40, prefill_first=True) as first:
        expected = first.generate(batch, GREEDY, use_tqdm=False)
    with LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=40) as mixed:
        step_kinds = []
        schedule = mixed.scheduler.schedule

        def recording_schedule():
            seqs = schedule()
            step_kinds.append({seq.num_scheduled_tokens == 1 for seq in seqs})
            return seqs

        mixed.scheduler.schedule = recording_schedule
        got = mixed.generate(batch, GREEDY, use_tqdm=False)
    assert {True, False} in step_kinds  # some steps decoded and prefilled at once
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]
    for prompt, out in zip(batch, got):
        assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])


def test_threads_submit_while_others_stream(llm):
    batch = prompts(12, seed=1)
    expected = [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    results = [None] * len(batch)

    def worker(i: int):
        time.sleep(0.01 * i)  # arrive while earlier requests are running
        handle = llm.submit(batch[i], GREEDY)
        streamed = []
        for increment in handle:
            streamed += increment["token_ids"]
        assert increment["finished"] and increment["finish_reason"] == "length"
        assert streamed == handle.result()["token_ids"]
        results[i] = streamed

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == expected


def test_abort_frees_every_block(llm):
    handle = llm.submit(prompts(1, seed=2)[0] * 3, SamplingParams(max_tokens=3000, ignore_eos=True))
    increments = iter(handle)
    next(increments)
    next(increments)
    handle.abort()
    out = handle.result(timeout=30)
    assert out["finish_reason"] == "abort" and 2 <= len(out["token_ids"]) < 3000
    assert list(increments)[-1]["finish_reason"] == "abort"
    assert_idle_and_clean(llm, 10)  # nothing waits or runs, every block is free


def test_a_request_keeps_the_params_it_was_submitted_with(llm):
    # as in vLLM, which clones them
    params = greedy(40)
    first = llm.submit([5, 6, 7], params)
    params.max_tokens = 4
    assert len(llm.submit([8, 9], params).result(timeout=30)["token_ids"]) == 4
    assert len(first.result(timeout=30)["token_ids"]) == 40


def test_slow_consumer_does_not_stall_others(llm):
    slow = llm.submit(prompts(1, seed=3)[0], SamplingParams(max_tokens=200, ignore_eos=True))
    fast = llm.submit(prompts(1, seed=4)[0], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(fast.result(timeout=30)["token_ids"]) == 5  # nobody has read a single increment of `slow`
    # read late, the tokens it missed may come in fewer increments
    assert len(sum((i["token_ids"] for i in slow), [])) == 200 and slow.result()["finish_reason"] == "length"


def test_streamed_pieces_concatenate_to_the_text(llm):
    # random sampling from a byte-level vocabulary produces split multi-byte characters and invalid bytes
    params = SamplingParams(temperature=1.5, max_tokens=150, ignore_eos=True)
    for prompt in prompts(4, seed=5):
        handle = llm.submit(prompt, params)
        pieces = [increment["text"] for increment in handle]
        assert "".join(pieces) == handle.result()["text"]


def test_only_a_reader_makes_text(llm, monkeypatch):
    """A request read through result() decodes only for its output; a streamed one at each increment too (through
    the detokenizer's text decoder)."""
    decodes, decode, make_decoder = [], llm.tokenizer.decode, detokenizer_module.text_decoder
    monkeypatch.setattr(llm.tokenizer, "decode", lambda *args, **kw: decodes.append("output") or decode(*args, **kw))

    def counting_decoder(tokenizer):
        inner = make_decoder(tokenizer)
        return lambda token_ids, skip: decodes.append("increment") or inner(token_ids, skip)
    monkeypatch.setattr(detokenizer_module, "text_decoder", counting_decoder)
    params = greedy(40)
    out = llm.submit(prompts(1, seed=8)[0], params).result(timeout=30)
    assert len(out["token_ids"]) == 40 and decodes == ["output"] * 2  # (context, and with it)
    decodes.clear()
    pieces = [increment["text"] for increment in llm.submit(prompts(1, seed=8)[0], params)]
    assert "".join(pieces) == out["text"] and decodes.count("increment") > 2


def test_detokenizer_never_splits_a_character(llm):
    text = "héllo wörld 你好 🚀 ok"
    token_ids = llm.tokenizer.encode(text)
    assert len(token_ids) > len(text) // 2  # the tiny vocabulary splits the multi-byte characters into bytes
    detokenizer = IncrementalDetokenizer(llm.tokenizer, threading.Lock())
    pieces = [detokenizer.push([t]) for t in token_ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == detokenizer.text == text


def test_async_streams(llm):
    async def collect(prompt):
        return [increment async for increment in llm.stream(prompt, GREEDY)]

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts(3, seed=6)))

    expected = llm.generate(prompts(3, seed=6), GREEDY, use_tqdm=False)
    for increments, out in zip(asyncio.run(main()), expected):
        assert sum((i["token_ids"] for i in increments), []) == out["token_ids"]
        assert "".join(i["text"] for i in increments) == out["text"]
        assert increments[-1]["finished"] and increments[-1]["finish_reason"] == "length"


def test_close_stops_the_loop(tiny_model):
    llm = LLM(tiny_model, kvcache_block_size=16)
    llm.generate(["hello"], GREEDY, use_tqdm=False)
    thread = llm._loop.thread
    assert thread.is_alive()
    llm.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        llm.submit("hello")


def test_dropped_engine_frees_its_cache_and_thread(tiny_model):
    llm = LLM(tiny_model, kvcache_block_size=16)
    llm.generate(["hello"], GREEDY, use_tqdm=False)
    runner, thread, engine = llm.model_runner, llm._loop.thread, weakref.ref(llm)
    del llm
    wait_until(lambda: gc.collect() >= 0 and engine() is None and not thread.is_alive(), 5)
    assert runner.kv_cache is None  # the finalizer ran: a dropped engine gives its memory back
