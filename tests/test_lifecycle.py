"""No call waits forever: failures reach every waiting request, close() ends what runs, bad input is named,
and nano-vllm's own add_request/step loop runs with nobody stepping beside it."""
import asyncio
import gc
import os
import signal
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.request import EngineLoop, RequestHandle
from nanovllm.engine.step_output import StepOutput
from tests.conftest import in_background, within

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)  # runs for over 10 s on the tiny model
ABORTED_WITHIN = 5  # seconds: an aborted LONG request is gone well before it could have finished
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16) as engine:
        yield engine


def wait_until(condition, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def assert_idle_and_clean(llm: LLM, seconds: float = 30):
    wait_until(llm.is_finished, seconds)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def raising(error: BaseException):
    """A stand-in for any function or method: it raises `error`."""
    def fn(*args, **kwargs):
        raise error
    return fn


def running(llm: LLM):
    """A LONG request on PROMPT that has made its first increment."""
    handle = llm.submit(PROMPT, LONG)
    within(30, next, iter(handle))
    return handle


def assert_serves_on(llm: LLM, expected: list[int]):
    """After a fault: nothing left running or holding blocks, and PROMPT's greedy tokens are still `expected`."""
    assert_idle_and_clean(llm)
    assert within(30, llm.generate, [PROMPT], GREEDY)[0]["token_ids"] == expected


def script_tokens(monkeypatch, llm: LLM, script: list[int]):
    """The model "samples" script[i] as the i-th completion token of every sequence."""
    def run(seqs):
        return StepOutput(torch.tensor([script[seq.num_completion_tokens] for seq in seqs if seq.samples_this_step],
                                       dtype=torch.int64))
    monkeypatch.setattr(llm.model_runner, "run", run)


# ---- listeners, streams and handles -------------------------------------------------------------------
def test_leaving_an_async_stream_early_aborts_it(llm):
    async def first_increment():
        async for increment in llm.stream(PROMPT, LONG):
            return increment  # the generator is closed when asyncio.run shuts down

    for _ in range(3):
        assert asyncio.run(first_increment())["finished"] is False
    assert_idle_and_clean(llm, ABORTED_WITHIN)  # the abandoned requests were aborted
    out = within(30, llm.generate, [PROMPT], GREEDY)
    assert len(out[0]["token_ids"]) == 8


def test_a_listener_whose_event_loop_closed_is_dropped(llm):
    loop = asyncio.new_event_loop()
    stream = llm.stream(PROMPT, LONG)
    assert loop.run_until_complete(stream.__anext__())["finished"] is False
    loop.close()  # the generator is never finalized: its listener stays registered with a closed loop
    beside = llm.submit([8, 9], LONG)
    increments = iter(beside)
    for _ in range(20):  # the engine keeps producing increments for both
        assert within(10, next, increments)["finished"] is False
    assert llm.stats()["num_running"] == 2  # the request whose listener died runs on
    beside.abort()
    assert within(10, beside.result)["finish_reason"] == "abort"  # not failed by the dead listener
    out = within(30, llm.generate, [PROMPT], GREEDY)
    assert len(out[0]["token_ids"]) == 8
    del stream
    # nobody ends the request of the dead listener: left to run its 3000 tokens, it would slow the tests after it
    for handle in list(llm._loop.handles.values()):
        handle.abort()
    assert_idle_and_clean(llm, ABORTED_WITHIN)


def test_a_handle_can_be_iterated_again(llm):
    streamed = llm.submit(PROMPT, GREEDY)
    first = within(30, list, streamed)
    assert within(5, list, streamed) == first and first[-1]["finished"]
    assert sum((i["token_ids"] for i in first), []) == streamed.result()["token_ids"]
    assert "".join(i["text"] for i in first) == llm.generate([PROMPT], GREEDY)[0]["text"]


@pytest.mark.parametrize("wait", ["iterate", "result"])
def test_waiting_on_an_added_request_steps_it(tiny_model, wait):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        handle = llm.add_request(PROMPT, GREEDY)  # nobody steps it: waiting on it makes the engine do so
        if wait == "iterate":
            (only,) = within(30, list, handle)  # a handle that was not streamed yields its whole completion
            assert within(5, list, handle) == [only]
        out = within(30, handle.result)
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 8
        if wait == "iterate":
            assert only["token_ids"] == out["token_ids"] and only["text"] == out["text"]


def test_result_timeout_leaves_the_request_running(llm):
    handle = llm.submit(PROMPT, LONG)
    with pytest.raises(TimeoutError, match="still running"):
        handle.result(timeout=0.05)
    assert not handle.finished
    handle.abort()
    assert within(10, handle.result)["finish_reason"] == "abort"


# ---- close() -----------------------------------------------------------------------------------------
def test_close_ends_every_waiting_call(tiny_model):
    llm = LLM(tiny_model, kvcache_block_size=16)
    streamed = llm.submit(PROMPT, LONG)
    increments = []

    def consume():
        for increment in streamed:
            increments.append(increment)

    async def consume_async():
        return [increment async for increment in llm.stream([8, 9], LONG)]

    outcomes = {}
    threads = [threading.Thread(target=consume, daemon=True),  # daemons: a failure here must not hang pytest
               threading.Thread(target=lambda: outcomes.update(generate=llm.generate([[4, 5]] * 3, LONG)),
                                daemon=True),
               threading.Thread(target=lambda: outcomes.update(stream=asyncio.run(consume_async())), daemon=True)]
    for thread in threads:
        thread.start()
    wait_until(lambda: llm.stats()["num_running"] == 5)
    # running means scheduled: with overlap a sequence's first token may still be in flight. Two more
    # increments of the streamed request are two more steps of the whole batch, so every call has tokens.
    seen = len(increments)
    wait_until(lambda: len(increments) >= max(3, seen + 2))
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 15
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert increments[-1]["finished"] and increments[-1]["finish_reason"] == "abort"
    assert [o["finish_reason"] for o in outcomes["generate"]] == ["abort"] * 3
    assert all(0 < len(o["token_ids"]) < 3000 for o in outcomes["generate"])
    assert outcomes["stream"][-1]["finish_reason"] == "abort"
    assert streamed.result(timeout=0)["finish_reason"] == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPT], GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        llm.add_request(PROMPT, GREEDY)


def test_close_ends_a_request_the_loop_thread_is_taking_in(tiny_model, monkeypatch):
    llm = LLM(tiny_model, kvcache_block_size=16)
    loop = llm._loop
    take_inbox, finish_all = loop.take_inbox, loop.finish_all
    taking, finished_all = threading.Event(), threading.Event()

    def slow_take_inbox():
        inbox = take_inbox()
        if inbox and threading.current_thread() is loop.thread:  # close() runs right after the thread took it
            taking.set()
            finished_all.wait(10)
        return inbox

    def finish_all_then_tell(error=None):
        finish_all(error)
        finished_all.set()

    monkeypatch.setattr(loop, "take_inbox", slow_take_inbox)
    monkeypatch.setattr(loop, "finish_all", finish_all_then_tell)
    handle = llm.submit(PROMPT, LONG)
    assert taking.wait(30)
    within(30, llm.close)
    assert within(10, handle.result)["finish_reason"] == "abort"


def test_close_ends_a_request_nobody_took_in(tiny_model):
    """A request added (nano-vllm's add_request) and never stepped is still in the inbox when close() comes: it
    ends aborted, with no token and no prompt token from the cache (it was never admitted)."""
    llm = LLM(tiny_model, kvcache_block_size=16)
    handle = llm.add_request(PROMPT, GREEDY)
    within(30, llm.close)
    out = within(10, handle.result)
    assert (out["finish_reason"], out["token_ids"], out["num_cached_tokens"]) == ("abort", [], 0)


@pytest.fixture
def own_llm(tiny_model):
    """An engine of the test's own, stepped by hand: no loop thread (which an earlier test's `submit` or `result()`
    starts, and `add_request` then wakes) takes its inbox before the test's step() does."""
    with LLM(tiny_model, kvcache_block_size=16) as engine:
        yield engine


def test_an_interrupt_while_a_step_takes_requests_in_orphans_none(own_llm, monkeypatch):
    """A ^C in a caller's step() while it takes in new requests fails the one it was taking in (its waiters get
    the interrupt) and leaves the later ones at the front of the inbox, ahead of requests added meanwhile, for the
    next step: no request is left in the table unscheduled, for result() to wait on for good and is_finished() to
    overlook."""
    llm, later = own_llm, []
    add = llm.scheduler.add

    def interrupted_once(seq):
        monkeypatch.setattr(llm.scheduler, "add", add)
        later.append(llm.add_request([10, 11], GREEDY))  # another thread's request, meanwhile
        raise KeyboardInterrupt
    monkeypatch.setattr(llm.scheduler, "add", interrupted_once)
    first, second = llm.add_request(PROMPT, GREEDY), llm.add_request([8, 9], GREEDY)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    assert first.finished and first.request_id not in llm._loop.handles
    with pytest.raises(KeyboardInterrupt):
        first.result(timeout=0)
    assert [handle for _, handle in llm._loop.inbox] == [second, *later]  # first come, first served
    while not llm.is_finished():
        llm.step()
    assert len(within(10, second.result)["token_ids"]) == len(within(10, later[0].result)["token_ids"]) == 8
    assert_idle_and_clean(llm)
    assert llm._loop.handles == {}


def test_an_interrupt_right_after_a_request_is_scheduled_unschedules_it(own_llm, monkeypatch):
    """A ^C that lands after the scheduler took the request in fails it and takes it out again: no sequence runs
    without a handle."""
    llm = own_llm
    add = llm.scheduler.add

    def added_then_interrupted(seq):
        monkeypatch.setattr(llm.scheduler, "add", add)
        add(seq)
        raise KeyboardInterrupt
    monkeypatch.setattr(llm.scheduler, "add", added_then_interrupted)
    first = llm.add_request(PROMPT, GREEDY)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    assert first.finished and first.seq not in (*llm.scheduler.waiting, *llm.scheduler.running)
    assert llm.is_finished() and llm._loop.handles == {}
    assert_idle_and_clean(llm)


def test_a_step_that_gets_the_lock_after_close_says_closed(tiny_model, monkeypatch):
    """A step() that passed its first checks just before close() began raises "the engine is closed" once it has
    the lock (close waits for it, then lets it go), instead of stepping a closed engine or waiting for good."""
    llm = LLM(tiny_model, kvcache_block_size=16)
    llm.close()
    monkeypatch.setattr(llm, "check_workers", lambda: None)  # as if close() ran right after this check
    with pytest.raises(RuntimeError, match="the engine is closed"):
        within(10, llm.step)


@pytest.mark.parametrize("callback", ["_on_token", "_on_finish"])
def test_a_request_whose_own_bookkeeping_fails_fails_alone(llm, own_llm, callback):
    """An error in one request's bookkeeping (detokenizing its token, its stop strings, its output) fails that
    request alone and frees its blocks: the requests beside it in the same steps finish as if it were not there.
    Before, the step failed, and with it every request in flight (a poisoned line of a batch file failed the
    lines beside it, on every resume)."""
    expected = llm.generate([[8, 9]], GREEDY)[0]["token_ids"]
    bad = own_llm.add_request(PROMPT, LONG if callback == "_on_token" else GREEDY)
    good = own_llm.add_request([8, 9], GREEDY)
    setattr(bad, callback, raising(ValueError("cannot decode this token")))
    while not bad.finished:
        own_llm.step()
    assert bad.seq not in (*own_llm.scheduler.running, *own_llm.scheduler.waiting)  # not left running unseen
    while not own_llm.is_finished():
        own_llm.step()
    with pytest.raises(ValueError, match="cannot decode this token"):
        bad.result(timeout=0)
    assert good.result(timeout=0)["token_ids"] == expected
    assert_idle_and_clean(own_llm)
    assert own_llm._loop.handles == {}


def test_every_later_call_names_the_first_failure():
    """A second failure (another worker, a later step) does not hide the first, which caused it."""
    class Engine:
        pass

    engine = Engine()
    loop = EngineLoop(engine)
    loop.fail(RuntimeError("the first failure"))
    loop.fail(RuntimeError("the second failure"))
    with pytest.raises(RuntimeError, match="the first failure"):
        loop.check()


def test_stop_on_the_loop_thread_itself_returns_instead_of_failing():
    """An engine dropped while its loop thread holds the last reference is finalized on that thread: stop()
    cannot wait for the thread it runs on, and returns True (no step runs beside it) instead of raising."""
    outcome = {}

    class Engine:
        def _run_once(self):
            outcome["stopped"] = loop.stop(timeout=5)
            return False

    engine = Engine()
    loop = EngineLoop(engine)
    loop.start()
    loop.thread.join(10)
    assert not loop.thread.is_alive()
    assert outcome == {"stopped": True} and loop.error is None


def test_a_failed_loop_fails_each_request_once_and_lets_go_of_it():
    """fail() finishes every request in flight (taken in or still in the inbox) with the error, and the table
    lets go of them: a dead engine that its caller keeps does not keep their sequences and outputs."""
    failures = []

    class Handle:
        def __init__(self, request_id):
            self.request_id = request_id

        def _on_error(self, error):
            failures.append((self.request_id, error))

    class Engine:
        pass

    engine, error = Engine(), RuntimeError("a worker died")
    loop = EngineLoop(engine)
    loop.post("add", Handle(1))
    loop.take_inbox()
    loop.post("add", Handle(2))
    loop.fail(error)
    assert sorted(failures, key=lambda f: f[0]) == [(1, error), (2, error)]
    assert loop.handles == {} and loop.inbox == []


def test_a_step_racing_close_returns_what_it_finished(tiny_model, monkeypatch):
    llm = LLM(tiny_model, kvcache_block_size=16)
    handle = llm.add_request(PROMPT, GREEDY)
    finish = RequestHandle._on_finish

    def finish_then_close(h, last_token_ids):
        finish(h, last_token_ids)
        within(30, llm.close)  # another thread's close(), while this step tidies up after the request it finished

    monkeypatch.setattr(RequestHandle, "_on_finish", finish_then_close)
    finished = []
    while not handle.finished:
        finished += within(30, llm.step)[0]
    assert finished == [(handle.request_id, handle.result(timeout=0)["token_ids"])]
    assert handle.result(timeout=0)["finish_reason"] == "length"


def test_a_request_racing_close_is_refused_not_lost(tiny_model, monkeypatch):
    llm = LLM(tiny_model, kvcache_block_size=16)
    monkeypatch.setattr(llm, "check_workers", lambda: None)  # as if close() ran right after this check
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.submit(PROMPT, GREEDY)


# ---- failures ----------------------------------------------------------------------------------------
def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_serves_on(tiny_model, monkeypatch):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        expected = llm.generate([PROMPT], GREEDY)[0]["token_ids"]
        real_run, faults = llm.model_runner.run, []

        def failing_run(seqs):
            if len(seqs) == 3 and not faults:  # once all three requests below are in flight
                faults.append(seqs)
                raise RuntimeError("injected fault")
            return real_run(seqs)

        monkeypatch.setattr(llm.model_runner, "run", failing_run)
        streamed = llm.submit(PROMPT, LONG)
        with pytest.raises(RuntimeError, match="injected fault"):
            within(30, llm.generate, [[4, 5], [6]], LONG)
        with pytest.raises(RuntimeError, match="injected fault"):
            within(5, list, streamed)
        with pytest.raises(RuntimeError, match="injected fault"):
            streamed.result(timeout=5)
        assert_serves_on(llm, expected)


def test_a_step_whose_tokens_fail_to_arrive_is_dropped_with_its_requests(tiny_model, monkeypatch):
    """A launched step whose output raises when read (its copy to the host failed) fails the requests in flight
    and is dropped with them: the engine's next step does not read it again, and the engine serves on."""
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        expected = llm.generate([PROMPT], GREEDY)[0]["token_ids"]
        real_run, faults = llm.model_runner.run, []

        def run_with_a_broken_output(seqs):
            output = real_run(seqs)
            if len(seqs) == 2 and not faults:  # both requests below in flight
                faults.append(output)
                output.result = raising(RuntimeError("injected output fault"))  # whenever it is read
            return output

        monkeypatch.setattr(llm.model_runner, "run", run_with_a_broken_output)
        with pytest.raises(RuntimeError, match="injected output fault"):
            within(30, llm.generate, [[4, 5], [6]], LONG)
        assert len(faults) == 1
        assert_serves_on(llm, expected)


def test_a_failing_step_fails_its_requests_even_when_emptying_the_scheduler_fails(tiny_model, monkeypatch):
    # a scheduler that raised mid-step may be in no state to abort its sequences either
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        handle = running(llm)

        monkeypatch.setattr(llm.scheduler, "schedule", raising(RuntimeError("injected scheduler fault")))
        monkeypatch.setattr(llm.scheduler, "abort", raising(AssertionError("injected abort fault")))
        with pytest.raises(RuntimeError, match="injected scheduler fault"):
            within(10, handle.result)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "synchronous"])
def test_a_request_whose_finish_fails_fails_its_waiters_and_the_engine_serves_on(tiny_model, monkeypatch,
                                                                                 async_scheduling):
    # (finishing detokenizes: a tokenizer that cannot decode a sampled id raises there)
    with LLM(tiny_model, kvcache_block_size=16, async_scheduling=async_scheduling) as llm:
        expected = llm.generate([PROMPT], GREEDY)[0]["token_ids"]
        finish, faults = RequestHandle._on_finish, []

        def failing_finish(handle, last_token_ids):
            if not faults:
                faults.append(handle)
                raise RuntimeError("injected finish fault")
            return finish(handle, last_token_ids)

        monkeypatch.setattr(RequestHandle, "_on_finish", failing_finish)
        with pytest.raises(RuntimeError, match="injected finish fault"):
            within(30, llm.generate, [PROMPT, [4, 5]], GREEDY)
        with pytest.raises(RuntimeError, match="injected finish fault"):
            faults[0].result(timeout=5)
        assert_serves_on(llm, expected)


def test_close_ends_every_waiting_call_when_finishing_one_fails(tiny_model, monkeypatch):
    llm = LLM(tiny_model, kvcache_block_size=16)
    handles = [llm.submit(PROMPT, LONG), llm.submit([4, 5], LONG)]
    within(30, next, iter(handles[1]))
    finish = RequestHandle._on_finish

    def failing_finish(handle, last_token_ids):
        if handle is handles[0]:
            raise RuntimeError("injected finish fault")
        return finish(handle, last_token_ids)

    monkeypatch.setattr(RequestHandle, "_on_finish", failing_finish)
    within(30, llm.close)
    with pytest.raises(RuntimeError, match="injected finish fault"):
        handles[0].result(timeout=5)
    assert handles[1].result(timeout=5)["finish_reason"] == "abort"


def test_a_stream_whose_text_fails_ends_with_the_error_alone(tiny_model, monkeypatch):
    # an asyncio listener's text is made by whoever steps; a tokenizer that cannot decode a sampled id raises there:
    # the stream ends with the error, and the request beside it (whose text nobody makes) runs on
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        expected = llm.generate([PROMPT], GREEDY)[0]["token_ids"]
        push, undecodable = IncrementalDetokenizer.push, threading.Event()

        def failing_push(detokenizer, token_ids):
            if undecodable.is_set():
                raise ValueError("injected undecodable token")
            return push(detokenizer, token_ids)

        monkeypatch.setattr(IncrementalDetokenizer, "push", failing_push)
        increments = []

        async def consume():
            async for increment in llm.stream(PROMPT, LONG):
                increments.append(increment)

        streaming, outcome = in_background(asyncio.run, consume())
        wait_until(lambda: increments)
        beside = llm.submit([8, 9], LONG)  # nobody reads it: its text is never made
        wait_until(lambda: llm.stats()["num_running"] == 2)
        undecodable.set()
        streaming.join(10)
        assert not streaming.is_alive(), "the async stream still waits"
        assert isinstance(outcome.get("error"), ValueError)
        wait_until(lambda: llm.stats()["num_running"] == 1)
        assert not beside.finished
        beside.abort()
        assert beside.result(timeout=10)["finish_reason"] == "abort"
        assert_serves_on(llm, expected)


def test_an_abort_whose_finish_fails_fails_that_request_alone(tiny_model, monkeypatch):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        expected = llm.generate([PROMPT], GREEDY)[0]["token_ids"]
        aborted = running(llm)
        finish = RequestHandle._on_finish

        def failing_finish(handle, last_token_ids):
            if handle is aborted:
                raise RuntimeError("injected finish fault")
            return finish(handle, last_token_ids)

        monkeypatch.setattr(RequestHandle, "_on_finish", failing_finish)
        with llm._loop.step_lock:  # the abort and the next request reach the engine in one take of its inbox
            aborted.abort()
            beside = llm.submit([8, 9], GREEDY)
        assert len(within(15, beside.result)["token_ids"]) == 8
        with pytest.raises(RuntimeError, match="injected finish fault"):
            aborted.result(timeout=5)
        assert_serves_on(llm, expected)


def test_a_stop_string_search_that_fails_fails_the_requests_in_flight(tiny_model, monkeypatch):
    # (stop strings need the text at once: the step detokenizes each token, and a tokenizer may raise there)
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        expected = llm.generate([PROMPT], GREEDY)[0]["token_ids"]
        monkeypatch.setattr(IncrementalDetokenizer, "find_stop", raising(ValueError("injected stop-string fault")))
        with pytest.raises(ValueError, match="injected stop-string fault"):
            within(30, llm.generate, [PROMPT, [4, 5]], SamplingParams(max_tokens=8, stop=["zz"]))
        assert_serves_on(llm, expected)


def test_a_dead_loop_thread_fails_its_requests_and_names_why(tiny_model, monkeypatch):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        handle = running(llm)

        monkeypatch.setattr(llm, "_take_inbox", raising(ValueError("a bug outside any step")))
        with pytest.raises(RuntimeError, match="loop thread stopped .*a bug outside any step"):
            within(10, handle.result)
        for call in (lambda: llm.generate([PROMPT], GREEDY), lambda: llm.submit(PROMPT), llm.step):
            with pytest.raises(RuntimeError, match="loop thread stopped .*a bug outside any step"):
                within(5, call)


def test_what_an_engine_builds_is_frozen_out_of_garbage_collections_until_close(tiny_model):
    """A full collection over an engine's weights, graphs and compiled code took 0.12 s here and 364 ms on the
    H200, where it stalled a decode step of latency.py: the engine freezes what exists once it is built, and
    close() thaws it, so that a closed engine's reference cycles can be collected."""
    gc.unfreeze()
    with LLM(tiny_model) as engine:
        model = engine.model_runner.model
        assert not any(obj is model for obj in gc.get_objects())  # in the permanent generation
        assert engine.generate([PROMPT], GREEDY)[0]["token_ids"]
    assert gc.get_freeze_count() == 0


def test_an_engine_collects_before_it_freezes(tiny_model):
    """What is garbage when the engine freezes (cycles left by loading, or by whatever ran before it) is collected
    first, not frozen with the engine and kept for its whole life: with automatic collections off, so that a cycle
    dropped just before the engine is built is still waiting for a collection, it is gone once the engine is built."""
    class Cycle:
        pass
    cycle = Cycle()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle
    gc.unfreeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with LLM(tiny_model):
            assert gone() is None
    finally:
        if enabled:
            gc.enable()


def test_keyboard_interrupt_inside_generate_leaves_the_engine_usable(llm):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # also where pytest started ignoring it
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT, [8, 9]], LONG)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 10
    assert_idle_and_clean(llm, ABORTED_WITHIN)  # the interrupted requests were aborted
    assert len(within(30, llm.generate, [PROMPT], GREEDY)[0]["token_ids"]) == 8


def test_keyboard_interrupt_as_generate_submits_leaves_the_engine_usable(llm, monkeypatch):
    # ^C once the requests are posted, before generate() waits on them (here: as it wakes the loop thread)
    start = llm._loop.start

    def interrupted_start():
        start()
        raise KeyboardInterrupt

    monkeypatch.setattr(llm._loop, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, [8, 9]], LONG)
    monkeypatch.undo()
    assert_idle_and_clean(llm, ABORTED_WITHIN)  # the interrupted requests were aborted
    assert len(within(30, llm.generate, [PROMPT], GREEDY)[0]["token_ids"]) == 8


# ---- user mistakes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, params, match", [
    (["a"], {"max_tokens": 3}, r"sampling_params must be a SamplingParams or a list .* not dict"),
    (["a"], 3, "sampling_params must be .* not int"),
    (None, None, "prompts must be .* not NoneType"),
    ((p for p in ["a"]), None, r"prompts must be .* not generator \(pass list"),
    (5, None, "prompts must be .* not int"),
    ([[1, 2], 5], None, "a prompt must be a str or a list of token ids, not int"),
    ([[1, 2.5]], None, "a token-id prompt must be a list of ints"),
    ([[True, 2]], None, "a token-id prompt must be a list of ints"),
])
def test_bad_calls_name_what_was_given(llm, prompts, params, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompts, params)
    assert llm.is_finished()
    assert len(llm.generate([PROMPT], GREEDY)[0]["token_ids"]) == 8


def test_an_empty_list_of_prompts_generates_nothing(llm):
    """generate([]) is a batch of no prompts (vLLM returns []), not one empty token-id prompt; an empty prompt
    inside a batch is still an error."""
    assert llm.generate([], GREEDY) == [] and llm.generate((), GREEDY) == []
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([[]], GREEDY)
    assert llm.is_finished()


def test_fewer_sampling_params_than_prompts_is_an_error(llm):
    """A list of sampling params must match the prompts one for one: fewer is an error like more, not a batch
    cut to the shorter list."""
    with pytest.raises(ValueError, match="2 sampling params were given for 3 prompts"):
        llm.generate([PROMPT, [8, 9], [10, 11]], [GREEDY] * 2)
    assert llm.is_finished()
    assert len(llm.generate([PROMPT, [8, 9]], [GREEDY] * 2)) == 2


def test_numpy_integers_are_token_ids(llm):
    expected = llm.generate([PROMPT], GREEDY)[0]["token_ids"]
    for prompt in (np.array(PROMPT), np.array(PROMPT, dtype=np.int32), [np.int64(t) for t in PROMPT]):
        assert llm.generate([prompt], GREEDY)[0]["token_ids"] == expected
        assert llm.submit(prompt, GREEDY).result(timeout=30)["token_ids"] == expected
    assert [o["token_ids"] for o in llm.generate(np.array([PROMPT, PROMPT]), GREEDY)] == [expected] * 2
    assert [o["token_ids"] for o in llm.generate(PROMPT, GREEDY)] == [expected]  # one prompt, as in vLLM
    stop_at = expected.index(expected[3]) + 1
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=np.array([expected[3]]),
                            min_tokens=np.int64(0))
    out = llm.generate([PROMPT], params)[0]
    assert out["token_ids"] == expected[:stop_at] and out["stop_reason"] == expected[3]
    assert isinstance(out["stop_reason"], int)


# ---- nano-vllm's loop ----------------------------------------------------------------------------------
def test_nano_vllm_add_request_step_loop(tiny_model):
    prompts = [[3 + i, 40 + i, 7] * (i + 1) for i in range(16)]
    with LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        request_ids = [llm.add_request(prompt, GREEDY).request_id for prompt in prompts]
        outputs, kinds = {}, set()
        while not llm.is_finished():
            finished, num_tokens = llm.step()
            kinds.add(num_tokens > 0)
            outputs.update(finished)
        assert llm._loop.thread is None  # the caller alone stepped
        assert kinds == {True, False}  # prefill steps count tokens, decode steps minus sequences
        expected = llm.generate(prompts, GREEDY)
    assert [outputs[i] for i in request_ids] == [o["token_ids"] for o in expected]


@pytest.mark.parametrize("async_scheduling, counts", [(True, [3, -1, -1, 0]), (False, [3, -1])])
def test_step_counts_prefill_tokens_then_minus_decodes_until_the_token_in_flight_is_dropped(
        tiny_model, monkeypatch, async_scheduling, counts):
    """step() returns a prefill step's tokens and minus a decode step's sequences. With overlap, the step that
    samples a stop token has already launched the next one: is_finished() stays False until a last step (which
    computes nothing) has taken that step in flight and dropped its token. Then the engine holds nothing of the
    request: not its sequence, nor its handle (a long-serving engine would otherwise keep every one)."""
    with LLM(tiny_model, kvcache_block_size=16, async_scheduling=async_scheduling) as llm:
        script_tokens(monkeypatch, llm, [A, W, B, B, B, B])
        request_id = llm.add_request(PROMPT, SamplingParams(max_tokens=6, stop_token_ids=[W])).request_id
        steps = []
        while not llm.is_finished():
            steps.append(llm.step())
        assert [num_tokens for _, num_tokens in steps] == counts
        assert [finished for finished, _ in steps if finished] == [[(request_id, [A, W])]]
        assert not llm._loop.handles and not llm.scheduler.running and llm._in_flight is None


def test_a_prompts_last_token_alone_is_a_prefill_step(tiny_model):
    # a one-token prompt, and a 17-token one whose first 16 tokens are cached the second time: prefill tokens
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        for prompt, prefill in (([5], 1), (list(range(400, 417)), 17), (list(range(400, 417)), 1)):
            llm.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            counts = []
            while not llm.is_finished():
                counts.append(llm.step()[1])
            assert counts[:2] == [prefill, -1]


def test_a_steps_throughput_counts_from_its_launch_after_a_pause(tiny_model, monkeypatch):
    """The progress bar's tokens a second: a step's time runs from when the step before it completed (steps
    overlap), but after a pause from the step's own launch, so the idle time is not counted. Here on a fake
    clock, where reading a step's tokens takes 1 s."""
    from nanovllm.engine import llm_engine
    clock = [0.0]
    monkeypatch.setattr(llm_engine, "perf_counter", lambda: clock[0])
    result = StepOutput.result

    def one_second(output):
        clock[0] += 1
        return result(output)

    monkeypatch.setattr(StepOutput, "result", one_second)
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        for pause in (0, 100):
            clock[0] += pause
            llm.add_request([5, 6, 7, 8], GREEDY)
            llm.step()  # the prefill's launch
            llm.step()  # a decode's launch, then the prefill's tokens: 4 tokens in 1 s
            assert llm._throughput["Prefill"] == "4tok/s"
            while not llm.is_finished():
                llm.step()
            assert llm._throughput["Decode"] == "1tok/s"


# ---- stop strings --------------------------------------------------------------------------------------
W, Q, A, B = 89, 83, 67, 68  # "w", "q", "a", "b" in the tiny tokenizer


@pytest.mark.parametrize("script, min_tokens, text, reason", [
    ([A, W, B, B, B, B, B, B, B, B], 6, "awbbbbbbbb", "length"),  # a "w" before min_tokens is never found again
    ([A, W, B, B, B, B, W, B, B, B], 6, "awbbbb", "stop"),  # the next one, after min_tokens, ends it
    ([A, B, B, B, B, W, B, B, B, B], 6, "abbbb", "stop"),  # the 6th token may end it
    ([A, B, B, B, W, B, B, B, B, B], 6, "abbbwbbbbb", "length"),  # nor when the 6th token comes right after it
    ([A, W, B, B, B, B, B, B, B, B], 0, "a", "stop"),
    ([A, B, B, B, B, B, B, B, B, W], 6, "abbbbbbbb", "stop"),  # the last token (max_tokens) may end it too
])
def test_each_stop_string_is_found_once_after_min_tokens(tiny_model, monkeypatch, script, min_tokens, text,
                                                         reason):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        script_tokens(monkeypatch, llm, script)
        params = SamplingParams(max_tokens=10, min_tokens=min_tokens, stop=["w", "q" * 30])
        out = llm.generate([PROMPT], params)[0]
        streamed = llm.submit(PROMPT, params)
        pieces = [increment["text"] for increment in within(30, list, streamed)]
    assert out["text"] == text and out["finish_reason"] == reason
    assert out["stop_reason"] == ("w" if reason == "stop" else None)
    assert out["token_ids"] == script[:len(out["token_ids"])]
    assert "".join(pieces) == text


def test_a_stop_token_or_the_earliest_stop_string_ends_it(tiny_model, monkeypatch):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        script_tokens(monkeypatch, llm, [A, W, B, B, B, B, B, B, B, B])
        # of two stop strings completed by one token, the one that starts first, whatever its place in the list
        out = llm.generate([PROMPT], SamplingParams(max_tokens=10, stop=["b", "wb"]))[0]
        assert (out["text"], out["finish_reason"], out["stop_reason"]) == ("a", "stop", "wb")
        # a stop token ends it without its text, its id the reason, also where stop strings are looked for (one
        # of them its text)
        for stop in (["q" * 30], ["w"]):
            out = llm.generate([PROMPT], SamplingParams(max_tokens=10, stop=stop, stop_token_ids=[W]))[0]
            assert out["token_ids"] == [A, W] and out["text"] == "a"
            assert out["finish_reason"] == "stop" and out["stop_reason"] == W
