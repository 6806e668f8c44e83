"""No call waits forever: failures reach every waiter, close() ends what runs, bad input is named, step() runs alone."""
import asyncio
import functools
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.request import EngineLoop, RequestHandle
from nanovllm.engine.sequence import PENDING
from nanovllm.engine.step_output import StepOutput
from tests.conftest import (ROOT, assert_idle_and_clean, greedy as greedy_params, in_background, raising, wait_until,
                            within)

GREEDY = greedy_params(8)
LONG = greedy_params(3000)  # runs for over 10 s on the tiny model
ABORTED_WITHIN = 5  # s: an aborted LONG request is gone well before it could finish
PROMPT = [5, 6, 7]
W, A, B = 89, 67, 68  # "w", "a", "b" in the tiny tokenizer


# (a capped cache: on a GPU, one sized from memory leaves the next engine none)
engine = functools.partial(LLM, kvcache_block_size=16, num_kvcache_blocks=4096)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with engine(tiny_model) as llm:
        yield llm


@pytest.fixture
def own_llm(tiny_model):
    """An engine no earlier test's loop thread steps: the test's step() takes its inbox."""
    with engine(tiny_model) as llm:
        yield llm


def greedy(llm: LLM, prompt=PROMPT) -> list[int]:
    return llm.generate([prompt], GREEDY)[0]["token_ids"]


def assert_serves_on(llm: LLM, expected: list[int] | None = None, seconds: float = 30):
    """After a fault: idle, every block free, and PROMPT's greedy tokens are `expected` (or 8 of them)."""
    assert_idle_and_clean(llm, seconds)
    tokens = within(30, greedy, llm)
    assert tokens == expected if expected is not None else len(tokens) == 8


class Fake:
    """An engine or a handle as an EngineLoop holds it (weakly), with the given attributes."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def running(llm: LLM):
    """A LONG request on PROMPT that has made its first increment."""
    handle = llm.submit(PROMPT, LONG)
    within(30, next, iter(handle))
    return handle


def assert_aborted(handle: RequestHandle):
    assert within(10, handle.result)["finish_reason"] == "abort"


def ids(script: str) -> list[int]:
    return [{"w": W, "a": A, "b": B}[c] for c in script]


def script_tokens(monkeypatch, llm: LLM, script: str):
    """The model "samples" the i-th letter of `script` as the i-th completion token of every sequence."""
    tokens = ids(script)

    def run(seqs):
        return StepOutput(torch.tensor([tokens[seq.num_completion_tokens] for seq in seqs if seq.samples_this_step],
                                       dtype=torch.int64))
    monkeypatch.setattr(llm.model_runner, "run", run)


def steps(llm: LLM) -> list[tuple]:
    """What each step() returned until the engine finished."""
    returned = []
    while not llm.is_finished():
        returned.append(llm.step())
    return returned


def fail_finish(monkeypatch, which) -> list:
    """Finishing a handle which(handle) picks raises, as a tokenizer that cannot decode it would; returns those."""
    finish, failed = RequestHandle._on_finish, []

    def failing_finish(handle):
        if which(handle):
            failed.append(handle)
            raise RuntimeError("injected finish fault")
        return finish(handle)

    monkeypatch.setattr(RequestHandle, "_on_finish", failing_finish)
    return failed


# ---- listeners, streams and handles
def test_leaving_an_async_stream_early_aborts_it(llm):
    async def first_increment():
        async for increment in llm.stream(PROMPT, LONG):
            return increment  # the generator is closed when asyncio.run shuts down

    for _ in range(3):
        assert asyncio.run(first_increment())["finished"] is False
    assert_serves_on(llm, seconds=ABORTED_WITHIN)  # the requests were aborted


def test_a_listener_whose_event_loop_closed_is_dropped(llm):
    loop = asyncio.new_event_loop()
    stream = llm.stream(PROMPT, LONG)
    assert loop.run_until_complete(stream.__anext__())["finished"] is False
    loop.close()  # the generator is never finalized: its listener stays, with a closed loop
    beside = llm.submit([8, 9], LONG)
    increments = iter(beside)
    for _ in range(20):
        assert within(10, next, increments)["finished"] is False
    assert llm.stats()["num_running"] == 2  # the request whose listener died runs on
    beside.abort()
    assert_aborted(beside)  # not failed by the dead listener
    assert len(within(30, greedy, llm)) == 8
    del stream
    for handle in list(llm._loop.handles.values()):  # else its 3000 tokens slow the tests after it
        handle.abort()
    assert_idle_and_clean(llm, ABORTED_WITHIN)


def test_a_handle_can_be_iterated_again(llm):
    streamed = llm.submit(PROMPT, GREEDY)
    first = within(30, list, streamed)
    assert within(5, list, streamed) == first and first[-1]["finished"]
    assert sum((i["token_ids"] for i in first), []) == streamed.result()["token_ids"]
    assert "".join(i["text"] for i in first) == llm.generate([PROMPT], GREEDY)[0]["text"]


@pytest.mark.parametrize("wait", ["iterate", "result"])
def test_waiting_on_an_added_request_steps_it(own_llm, wait):
    handle = own_llm.add_request(PROMPT, GREEDY)  # nobody steps it but the waiting
    if wait == "iterate":
        (only,) = within(30, list, handle)  # not streamed: the whole completion at once
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
    assert_aborted(handle)


# ---- close()
def test_close_ends_every_waiting_call(tiny_model):
    llm = engine(tiny_model)
    streamed = llm.submit(PROMPT, LONG)
    increments = []

    def consume():
        for increment in streamed:
            increments.append(increment)

    async def consume_async():
        return [increment async for increment in llm.stream([8, 9], LONG)]

    consuming, _ = in_background(consume)  # daemons: a failure hangs nothing
    generating, generated = in_background(llm.generate, [[4, 5]] * 3, LONG)
    streaming, stream = in_background(asyncio.run, consume_async())
    wait_until(lambda: llm.stats()["num_running"] == 5)
    # running is scheduled, not sampled: two more steps give every call tokens
    seen = len(increments)
    wait_until(lambda: len(increments) >= max(3, seen + 2))
    within(15, llm.close)
    for thread in (consuming, generating, streaming):
        thread.join(10)
        assert not thread.is_alive()
    assert increments[-1]["finished"] and increments[-1]["finish_reason"] == "abort"
    assert [o["finish_reason"] for o in generated["value"]] == ["abort"] * 3
    assert all(0 < len(o["token_ids"]) < 3000 for o in generated["value"])
    assert stream["value"][-1]["finish_reason"] == "abort"
    assert streamed.result(timeout=0)["finish_reason"] == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPT], GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        llm.add_request(PROMPT, GREEDY)


def test_close_ends_a_request_the_loop_thread_is_taking_in(tiny_model, monkeypatch):
    llm = engine(tiny_model)
    loop = llm._loop
    take_inbox, finish_all = loop.take_inbox, loop.finish_all
    taking, finished_all = threading.Event(), threading.Event()

    def slow_take_inbox():
        inbox = take_inbox()
        if inbox and threading.current_thread() is loop.thread:  # close() comes right after
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
    assert_aborted(handle)


def test_close_ends_a_request_nobody_took_in(tiny_model):
    llm = engine(tiny_model)
    handle = llm.add_request(PROMPT, GREEDY)
    within(30, llm.close)
    out = within(10, handle.result)
    assert (out["finish_reason"], out["token_ids"], out["num_cached_tokens"]) == ("abort", [], 0)


def test_close_ends_as_aborted_the_requests_of_a_step_that_completes_after_it_began(tiny_model, monkeypatch):
    # close() stalls in its first abort while a launching step (tokens pending) completes and raises "closed"
    llm = engine(tiny_model)
    handles = [llm.submit([5 + i, 6, 7], greedy_params(3000, logprobs=1) if i == 0 else LONG) for i in range(4)]
    for handle in handles:
        within(30, next, iter(handle))
    run, make_output, loop = llm.model_runner.run, RequestHandle._make_output, llm._loop
    held, closing = threading.Event(), threading.Event()

    def held_run(seqs):
        if not held.is_set():
            held.set()
            closing.wait(10)
        return run(seqs)

    def stalled_once(handle):
        if threading.current_thread() is not loop.thread and not closing.is_set():
            closing.set()
            time.sleep(0.3)  # the held step completes meanwhile
        return make_output(handle)

    monkeypatch.setattr(llm.model_runner, "run", held_run)
    monkeypatch.setattr(RequestHandle, "_make_output", stalled_once)
    assert held.wait(30)
    within(30, llm.close)
    outputs = [within(10, handle.result) for handle in handles]
    assert [out["finish_reason"] for out in outputs] == ["abort"] * 4
    for out in outputs:
        assert out["token_ids"] and PENDING not in out["token_ids"]
    assert len(outputs[0]["logprobs"]) == len(outputs[0]["token_ids"])


@pytest.mark.parametrize("switch", ["as-the-step-tells-the-finishing-token", "after-the-output-is-made"])
def test_a_stream_that_close_ends_adds_up_to_its_output(tiny_model, monkeypatch, switch):
    # close() runs while the step still feeds the handles (a forced switch): each stream adds up to its output
    llm = engine(tiny_model)
    closing = []

    def close_now(seconds: float):
        closing.append(threading.Thread(target=llm.close))  # (known before it runs: it may end the request at once)
        closing[0].start()
        time.sleep(seconds)  # close() runs meanwhile

    if switch == "as-the-step-tells-the-finishing-token":
        on_token = RequestHandle._on_token

        def switched_on_token(handle, token_id):
            if handle.seq.is_finished and not closing:
                close_now(0.3)
            return on_token(handle, token_id)

        monkeypatch.setattr(RequestHandle, "_on_token", switched_on_token)
        handles = [llm.submit(PROMPT, greedy_params(3))]
    else:
        handles = [llm.submit([5 + i, 6, 7], LONG) for i in range(2)]
        for handle in handles:
            within(30, next, iter(handle))
            in_background(list, handle)  # a reader that takes each token as it comes
        complete, finish = llm.scheduler.complete, RequestHandle._finish

        def complete_after_close_began(*args):  # the step passed its closed check before close() began
            if not closing:
                close_now(0.1)  # close() begins and makes its first output
            return complete(*args)

        def switched_finish(handle, *args):  # close() is switched out once, its first output made
            if closing and threading.current_thread() is closing[0] and not getattr(switched_finish, "done", 0):
                switched_finish.done = True
                time.sleep(0.3)  # the step completes meanwhile
            return finish(handle, *args)

        monkeypatch.setattr(llm.scheduler, "complete", complete_after_close_began)
        monkeypatch.setattr(RequestHandle, "_finish", switched_finish)
    for handle in handles:
        within(10, handle.result)
    closing[0].join(15)
    for handle in handles:
        out, increments = handle.result(timeout=0), list(handle)
        assert sum((i["token_ids"] for i in increments), []) == out["token_ids"]
        assert "".join(i["text"] for i in increments) == out["text"]


def test_close_ends_a_request_it_takes_in_while_a_failed_step_fails_the_others(tiny_model, monkeypatch):
    # close() moves the inbox's request into the table while a failed step fails the others: it is not lost
    llm = engine(tiny_model)
    first = running(llm)
    loop = llm._loop
    entered, failing, failing_them = threading.Event(), threading.Event(), threading.Event()

    def failing_run(seqs):
        entered.set()
        failing.wait(10)
        raise RuntimeError("injected model error")

    on_error, take_inbox = RequestHandle._on_error, loop.take_inbox

    def slow_on_error(handle, error):
        if threading.current_thread() is loop.thread:
            failing_them.set()
            time.sleep(0.5)
        on_error(handle, error)

    def stalled_take_inbox():
        inbox = take_inbox()
        if threading.current_thread() is not loop.thread:  # close()'s
            time.sleep(1.0)
        return inbox

    monkeypatch.setattr(llm.model_runner, "run", failing_run)
    assert entered.wait(30)
    late = llm.submit([8, 9], GREEDY)  # in the inbox: a step is running
    monkeypatch.setattr(RequestHandle, "_on_error", slow_on_error)
    monkeypatch.setattr(loop, "take_inbox", stalled_take_inbox)
    failing.set()
    assert failing_them.wait(30)
    within(30, llm.close)
    with pytest.raises(RuntimeError, match="injected model error"):
        first.result(timeout=10)
    assert_aborted(late)


@pytest.mark.parametrize("added", [False, True], ids=["as-it-is-taken-in", "once-it-is-scheduled"])
def test_an_interrupt_while_a_step_takes_requests_in_orphans_none(own_llm, monkeypatch, added):
    """A ^C as step() takes a request in fails it, scheduled or not; the rest stay first in the inbox."""
    llm, later = own_llm, []
    add = llm.scheduler.add

    def interrupted_once(seq):
        monkeypatch.setattr(llm.scheduler, "add", add)
        if added:
            add(seq)
        later.append(llm.add_request([10, 11], GREEDY))  # another thread's request, meanwhile
        raise KeyboardInterrupt
    monkeypatch.setattr(llm.scheduler, "add", interrupted_once)
    first, second = llm.add_request(PROMPT, GREEDY), llm.add_request([8, 9], GREEDY)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    assert first.finished and first.request_id not in llm._loop.handles
    assert llm.scheduler.is_finished() and llm._in_flight is None  # no sequence runs without a handle
    with pytest.raises(KeyboardInterrupt):
        first.result(timeout=0)
    assert [handle for _, handle in llm._loop.inbox] == [second, *later]  # first come, first served
    steps(llm)
    assert len(within(10, second.result)["token_ids"]) == len(within(10, later[0].result)["token_ids"]) == 8
    assert_idle_and_clean(llm)
    assert llm._loop.handles == {}


def test_an_aborted_request_leaves_the_table_of_requests(own_llm):
    # a server keeps no aborted handle for good
    running, queued = own_llm.add_request(PROMPT, LONG), own_llm.add_request([8, 9], LONG)
    own_llm.step()
    running.abort()
    queued.abort()
    steps(own_llm)
    assert running.result(timeout=0)["finish_reason"] == queued.result(timeout=0)["finish_reason"] == "abort"
    assert own_llm._loop.handles == {}
    assert_idle_and_clean(own_llm)


def test_a_request_that_close_ended_on_its_way_in_is_not_scheduled(own_llm, monkeypatch):
    # no reader: it would hold blocks
    loop, take = own_llm._loop, own_llm._loop.take_inbox

    def take_then_close():
        inbox = take()
        for request_id, handle in list(loop.handles.items()):  # as close()'s finish_all, meanwhile
            handle._end_aborted()
            loop.handles.pop(request_id)
        return inbox
    monkeypatch.setattr(loop, "take_inbox", take_then_close)
    handle = own_llm.add_request(PROMPT, GREEDY)
    own_llm.step()
    assert handle.result(timeout=0)["finish_reason"] == "abort"
    assert own_llm.scheduler.is_finished() and own_llm._in_flight is None
    assert own_llm.stats()["num_free_blocks"] == own_llm.stats()["num_total_blocks"]


@pytest.mark.parametrize("call, match", [(lambda llm: llm.step(), "the engine is closed"),
                                         (lambda llm: llm.submit(PROMPT, GREEDY), "closed")], ids=["step", "submit"])
def test_a_call_racing_close_says_closed(tiny_model, monkeypatch, call, match):
    # it passed its checks just before close() began: refused, not run, lost or left waiting
    llm = engine(tiny_model)
    monkeypatch.setattr(llm, "check_workers", lambda: None)  # as if close() ran right after this check
    llm.close()
    with pytest.raises(RuntimeError, match=match):
        within(10, call, llm)


@pytest.mark.parametrize("callback", ["_on_token", "_on_finish"])
def test_a_request_whose_own_bookkeeping_fails_fails_alone(llm, own_llm, callback):
    expected = greedy(llm, [8, 9])
    bad = own_llm.add_request(PROMPT, LONG if callback == "_on_token" else GREEDY)
    good = own_llm.add_request([8, 9], GREEDY)
    setattr(bad, callback, raising(ValueError("cannot decode this token")))
    while not bad.finished:
        own_llm.step()
    assert bad.seq not in (*own_llm.scheduler.running, *own_llm.scheduler.waiting)
    steps(own_llm)
    with pytest.raises(ValueError, match="cannot decode this token"):
        bad.result(timeout=0)
    assert good.result(timeout=0)["token_ids"] == expected
    assert_idle_and_clean(own_llm)
    assert own_llm._loop.handles == {}


def test_stop_on_the_loop_thread_itself_returns_instead_of_failing():
    # finalized on its own loop thread, stop() cannot wait for that thread
    outcome, fake = {}, Fake()
    fake._run_once = lambda: outcome.update(stopped=loop.stop(timeout=5))  # (None: idle)
    loop = EngineLoop(fake)
    loop.start()
    loop.thread.join(10)
    assert not loop.thread.is_alive()
    assert outcome == {"stopped": True} and loop.error is None


AT_EXIT = """
import sys, threading, time
import torch
from nanovllm import LLM
from nanovllm.engine.model_runner import ModelRunner

llm = LLM(sys.argv[1], device="cpu")  # (on CUDA beside pytest's engines: out of memory)
run_once, runner_exit, tearing_down = LLM._run_once, ModelRunner.exit, threading.Event()
llm.generate([[5, 6, 7]])  # its loop thread runs

def slow_exit(runner, *args):  # a second in torch's C++ code, the GIL released
    tearing_down.set()
    x, start = torch.randn(500, 500), time.monotonic()
    while time.monotonic() - start < 1:
        x @ x
    runner_exit(runner, *args)
    print("torn down on", threading.current_thread().name, flush=True)

def dropped(engine):  # the loop thread's reference is the last: it closes the engine
    global llm
    del llm
    return run_once(engine)

ModelRunner.exit = slow_exit
if sys.argv[2] == "dropped":
    LLM._run_once = dropped
    llm._loop.start()
    tearing_down.wait()
print(time.time(), flush=True)
"""


@pytest.mark.parametrize("how, thread", [("dropped", "nanovllm-engine-loop"), ("left-open", "MainThread")])
def test_an_engine_not_closed_is_torn_down_before_the_interpreter_exits(tiny_model, how, thread):
    # the interpreter finalized under a loop thread that let go of its engine last (and so closed it): SIGABRT
    done = subprocess.run([sys.executable, "-c", AT_EXIT, tiny_model, how], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    ended, *lines = done.stdout.splitlines() or [""]
    assert (done.returncode, lines) == (0, [f"torn down on {thread}"]), done.stderr[-3000:]
    assert time.time() - float(ended) < 10  # an open engine is closed at once, not waited for


def test_a_failed_loop_fails_each_request_once_and_lets_go_of_it():
    # taken in or in the inbox
    failures, fake, error = [], Fake(), RuntimeError("a worker died")

    def handle(request_id):
        return Fake(request_id=request_id, _on_error=lambda error: failures.append((request_id, error)))

    loop = EngineLoop(fake)
    loop.post("add", handle(1))
    loop.take_inbox()
    loop.post("add", handle(2))
    loop.fail(error)
    assert sorted(failures, key=lambda f: f[0]) == [(1, error), (2, error)]
    assert loop.handles == {} and loop.inbox == []
    loop.fail(RuntimeError("a second failure"))  # another worker's does not hide the first
    with pytest.raises(RuntimeError, match="a worker died"):
        loop.check()


@pytest.mark.parametrize("end", ["fail", "stop"])
def test_an_ended_loop_queues_no_abort_and_later_calls_name_the_first_cause(end):
    # an abort is moot, and the inbox would hold it for good
    fake = Fake()
    loop, bug = EngineLoop(fake), ValueError("a bug in a step")
    if end == "fail":
        failure = RuntimeError("the engine's loop thread stopped")
        failure.__cause__ = bug
        loop.fail(failure)
    else:
        assert loop.stop(timeout=5)
    handle = Fake()
    gone = weakref.ref(handle)
    loop.post("abort", handle)
    del handle
    gc.collect()
    assert loop.inbox == [] and gone() is None
    with pytest.raises(RuntimeError, match="loop thread stopped" if end == "fail" else "closed") as raised:
        loop.check()
    assert raised.value.__cause__ is (bug if end == "fail" else None)


def test_a_step_racing_close_returns_what_it_finished(tiny_model, monkeypatch):
    llm = engine(tiny_model)
    handle = llm.add_request(PROMPT, GREEDY)
    finish = RequestHandle._on_finish

    def finish_then_close(h):
        finish(h)
        within(30, llm.close)  # another thread's, as this step tidies up

    monkeypatch.setattr(RequestHandle, "_on_finish", finish_then_close)
    finished = []
    while not handle.finished:
        finished += within(30, llm.step)[0]
    assert finished == [(handle.request_id, handle.result(timeout=0)["token_ids"])]
    assert handle.result(timeout=0)["finish_reason"] == "length"


# ---- failures
@pytest.mark.parametrize("fault", ["step", "output"])
def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_serves_on(monkeypatch, own_llm, fault):
    """A step that raises, or whose output does when read (then dropped, not read again), fails its requests."""
    llm = own_llm
    expected, real_run, faults = greedy(llm), llm.model_runner.run, []

    def failing_run(seqs):
        if len(seqs) != 3 or faults:  # all three requests below in flight
            return real_run(seqs)
        faults.append(seqs)
        if fault == "step":
            raise RuntimeError("injected step fault")
        output = real_run(seqs)
        output.result = raising(RuntimeError("injected output fault"))  # whenever it is read
        return output

    monkeypatch.setattr(llm.model_runner, "run", failing_run)
    streamed = llm.submit(PROMPT, LONG)
    for call in (lambda: within(30, llm.generate, [[4, 5], [6]], LONG), lambda: within(5, list, streamed),
                 lambda: streamed.result(timeout=5)):
        with pytest.raises(RuntimeError, match=f"injected {fault} fault"):
            call()
    assert len(faults) == 1
    assert_serves_on(llm, expected)


def test_a_failing_step_fails_its_requests_even_when_emptying_the_scheduler_fails(monkeypatch, own_llm):
    # a scheduler that raised mid-step may not abort its sequences either
    handle = running(own_llm)
    monkeypatch.setattr(own_llm.scheduler, "schedule", raising(RuntimeError("injected scheduler fault")))
    monkeypatch.setattr(own_llm.scheduler, "abort", raising(AssertionError("injected abort fault")))
    with pytest.raises(RuntimeError, match="injected scheduler fault"):
        within(10, handle.result)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "synchronous"])
def test_a_request_whose_finish_fails_fails_its_waiters_and_the_engine_serves_on(
        tiny_model, monkeypatch, async_scheduling):
    with engine(tiny_model, async_scheduling=async_scheduling) as llm:
        expected = greedy(llm)
        faults = fail_finish(monkeypatch, lambda handle: not faults)  # the first request to finish
        with pytest.raises(RuntimeError, match="injected finish fault"):
            within(30, llm.generate, [PROMPT, [4, 5]], GREEDY)
        with pytest.raises(RuntimeError, match="injected finish fault"):
            faults[0].result(timeout=5)
        assert_serves_on(llm, expected)


def test_close_ends_every_waiting_call_when_finishing_one_fails(tiny_model, monkeypatch):
    llm = engine(tiny_model)
    handles = [llm.submit(PROMPT, LONG), llm.submit([4, 5], LONG)]
    within(30, next, iter(handles[1]))
    fail_finish(monkeypatch, lambda handle: handle is handles[0])
    within(30, llm.close)
    with pytest.raises(RuntimeError, match="injected finish fault"):
        handles[0].result(timeout=5)
    assert handles[1].result(timeout=5)["finish_reason"] == "abort"


def test_a_stream_whose_text_fails_ends_with_the_error_alone(monkeypatch, own_llm):
    # an asyncio listener's text is made by whoever steps, where a tokenizer may raise
    llm = own_llm
    expected = greedy(llm)
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
    assert_aborted(beside)
    assert_serves_on(llm, expected)


def test_an_abort_whose_finish_fails_fails_that_request_alone(monkeypatch, own_llm):
    llm = own_llm
    expected = greedy(llm)
    aborted = running(llm)
    fail_finish(monkeypatch, lambda handle: handle is aborted)
    with llm._loop.step_lock:  # both reach the engine in one take of its inbox
        aborted.abort()
        beside = llm.submit([8, 9], GREEDY)
    assert len(within(15, beside.result)["token_ids"]) == 8
    with pytest.raises(RuntimeError, match="injected finish fault"):
        aborted.result(timeout=5)
    assert_serves_on(llm, expected)


def test_a_stop_string_search_that_fails_fails_the_requests_in_flight(monkeypatch, own_llm):
    # stop strings need the text at once: the step detokenizes, and may raise
    expected = greedy(own_llm)
    monkeypatch.setattr(IncrementalDetokenizer, "find_stop", raising(ValueError("injected stop-string fault")))
    with pytest.raises(ValueError, match="injected stop-string fault"):
        within(30, own_llm.generate, [PROMPT, [4, 5]], SamplingParams(max_tokens=8, stop=["zz"]))
    assert_serves_on(own_llm, expected)


def test_a_dead_loop_thread_fails_its_requests_and_names_why(monkeypatch, own_llm):
    llm = own_llm
    handle = running(llm)
    monkeypatch.setattr(llm, "_take_inbox", raising(ValueError("a bug outside any step")))
    for seconds, call in ((10, handle.result), (5, lambda: greedy(llm)), (5, lambda: llm.submit(PROMPT)),
                          (5, llm.step)):
        with pytest.raises(RuntimeError, match="loop thread stopped .*a bug outside any step"):
            within(seconds, call)


def test_what_an_engine_builds_is_frozen_out_of_garbage_collections_until_close(tiny_model):
    """A full collection can stall a step; garbage from before is collected, not frozen."""
    cycle = Fake()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle
    gc.unfreeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with LLM(tiny_model) as llm:
            assert gone() is None
            model = llm.model_runner.model
            assert not any(obj is model for obj in gc.get_objects())  # in the permanent generation
            assert greedy(llm)
    finally:
        if enabled:
            gc.enable()
    assert gc.get_freeze_count() == 0  # close() thaws it


def test_keyboard_interrupt_inside_generate_leaves_the_engine_usable(llm):
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT, [8, 9]], LONG)
    finally:
        timer.join()
    assert time.monotonic() - started < 10
    assert_serves_on(llm, seconds=ABORTED_WITHIN)  # the requests were aborted


@pytest.mark.parametrize("method", ["post", "start"])
def test_keyboard_interrupt_as_generate_submits_leaves_the_engine_usable(llm, monkeypatch, method):
    # ^C once the requests are posted: as they reach the inbox, or as generate() wakes the loop thread
    real = getattr(llm._loop, method)

    def interrupted(*args):
        real(*args)
        if args[:1] in [(), ("add",)]:
            raise KeyboardInterrupt

    monkeypatch.setattr(llm._loop, method, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, [8, 9]], LONG)
    monkeypatch.undo()
    assert len(within(30, greedy, llm)) == 8  # (which wakes the loop thread: "post" never did)
    assert_idle_and_clean(llm, ABORTED_WITHIN)  # the requests were aborted


# ---- user mistakes
@pytest.mark.parametrize("prompts, params, error, match", [
    (["a"], {"max_tokens": 3}, TypeError, r"sampling_params must be a SamplingParams or a list .* not dict"),
    (["a"], 3, TypeError, "sampling_params must be .* not int"),
    (None, None, TypeError, "prompts must be .* not NoneType"),
    ((p for p in ["a"]), None, TypeError, r"prompts must be .* not generator \(pass list"),
    (5, None, TypeError, "prompts must be .* not int"),
    ([[1, 2], 5], None, TypeError, "a prompt must be a str or a list of token ids, not int"),
    ([[1, 2.5]], None, TypeError, "a token-id prompt must be a list of ints"),
    ([[True, 2]], None, TypeError, "a token-id prompt must be a list of ints"),
    ([[]], GREEDY, ValueError, "the prompt is empty"),
    ([PROMPT, [8, 9], [10, 11]], [GREEDY] * 2, ValueError, "2 sampling params were given for 3 prompts"),
])
def test_bad_calls_name_what_was_given(llm, prompts, params, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, params)
    assert llm.is_finished()
    assert len(greedy(llm)) == 8


def test_an_empty_list_of_prompts_generates_nothing(llm):
    # as in vLLM, not one empty prompt (a bad call)
    assert llm.generate([], GREEDY) == [] and llm.generate((), GREEDY) == []
    assert len(llm.generate([PROMPT, [8, 9]], [GREEDY] * 2)) == 2


def test_numpy_integers_are_token_ids(llm):
    expected = greedy(llm)
    for prompt in (np.array(PROMPT), np.array(PROMPT, dtype=np.int32), [np.int64(t) for t in PROMPT]):
        assert greedy(llm, prompt) == expected
        assert llm.submit(prompt, GREEDY).result(timeout=30)["token_ids"] == expected
    assert [o["token_ids"] for o in llm.generate(np.array([PROMPT, PROMPT]), GREEDY)] == [expected] * 2
    assert [o["token_ids"] for o in llm.generate(PROMPT, GREEDY)] == [expected]  # one prompt, as in vLLM
    stop_at = expected.index(expected[3]) + 1
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=np.array([expected[3]]),
                            min_tokens=np.int64(0))
    out = llm.generate([PROMPT], params)[0]
    assert out["token_ids"] == expected[:stop_at] and out["stop_reason"] == expected[3]
    assert isinstance(out["stop_reason"], int)


# ---- nano-vllm's loop
def test_nano_vllm_add_request_step_loop(tiny_model):
    prompts = [[3 + i, 40 + i, 7] * (i + 1) for i in range(16)]
    with engine(tiny_model, max_num_batched_tokens=64) as llm:
        request_ids = [llm.add_request(prompt, GREEDY).request_id for prompt in prompts]
        returned = steps(llm)
        outputs = dict(output for finished, _ in returned for output in finished)
        assert llm._loop.thread is None  # the caller alone stepped
        assert {n > 0 for _, n in returned} == {True, False}  # prefill steps count tokens, decode steps minus sequences
        expected = llm.generate(prompts, GREEDY)
    assert [outputs[i] for i in request_ids] == [o["token_ids"] for o in expected]


def test_a_step_loop_gets_its_requests_when_the_loop_thread_steps_them_too(own_llm):
    # step() returns each once, finished by the thread before the loop began (first round) or while it runs (second)
    prompts = [[3 + i, 40 + i, 7] for i in range(8)]
    params = [greedy_params(2 + 3 * i) for i in range(8)]
    expected = [out["token_ids"] for out in own_llm.generate(prompts, params)]
    for thread_first in (True, False):
        handles = [own_llm.add_request(prompt, sp) for prompt, sp in zip(prompts, params)]
        if thread_first:
            wait_until(lambda: all(handle.finished for handle in handles))
        reported = [output for finished, _ in within(60, steps, own_llm) for output in finished]
        assert sorted(request_id for request_id, _ in reported) == [handle.request_id for handle in handles]
        assert [dict(reported)[handle.request_id] for handle in handles] == expected


def test_a_request_on_its_way_into_the_scheduler_is_not_finished(own_llm, monkeypatch):
    add, seen = own_llm.scheduler.add, []
    monkeypatch.setattr(own_llm.scheduler, "add", lambda seq: (seen.append(own_llm.is_finished()), add(seq)))
    own_llm.add_request(PROMPT, GREEDY)
    own_llm.step()
    assert seen == [False]


@pytest.mark.parametrize("finished_first", [True, False])
def test_a_request_waited_on_is_not_left_for_step(own_llm, finished_first):
    # read through its handle (which starts the loop thread), it is the reader's: is_finished() does not wait for it
    own_llm.generate([PROMPT], GREEDY)
    handle = own_llm.add_request(PROMPT, GREEDY)
    if finished_first:
        wait_until(lambda: handle.finished)
    within(10, handle.result)
    wait_until(own_llm.is_finished)
    assert own_llm.step()[0] == []


@pytest.mark.parametrize("async_scheduling, counts", [(True, [3, -1, -1, 0]), (False, [3, -1])])
def test_step_counts_prefill_tokens_then_minus_decodes_until_the_token_in_flight_is_dropped(
        tiny_model, monkeypatch, async_scheduling, counts):
    """With overlap, the step sampling a stop token launched the next: a last step drops that one's token."""
    with engine(tiny_model, async_scheduling=async_scheduling) as llm:
        script_tokens(monkeypatch, llm, "awbbbb")
        request_id = llm.add_request(PROMPT, SamplingParams(max_tokens=6, stop_token_ids=[W])).request_id
        returned = steps(llm)
        assert [num_tokens for _, num_tokens in returned] == counts
        assert [finished for finished, _ in returned if finished] == [[(request_id, [A, W])]]
        assert not llm._loop.handles and not llm.scheduler.running and llm._in_flight is None


def test_a_prompts_last_token_alone_is_a_prefill_step(own_llm):
    # a one-token prompt, and a 17-token one whose first 16 tokens are cached the second time
    for prompt, prefill in (([5], 1), (list(range(400, 417)), 17), (list(range(400, 417)), 1)):
        own_llm.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        assert [num_tokens for _, num_tokens in steps(own_llm)][:2] == [prefill, -1]


def test_a_steps_throughput_counts_from_its_launch_after_a_pause(tiny_model, monkeypatch):
    """Not counting idle time; on a fake clock, where reading a step's tokens takes 1 s."""
    clock = [0.0]
    monkeypatch.setattr(llm_engine, "perf_counter", lambda: clock[0])
    result = StepOutput.result

    def one_second(output):
        clock[0] += 1
        return result(output)

    monkeypatch.setattr(StepOutput, "result", one_second)
    with engine(tiny_model) as llm:
        for pause in (0, 100):
            clock[0] += pause
            llm.add_request([5, 6, 7, 8], GREEDY)
            llm.step()  # the prefill's launch
            llm.step()  # a decode's launch, then the prefill's tokens: 4 tokens in 1 s
            assert llm._throughput["Prefill"] == "4tok/s"
            steps(llm)
            assert llm._throughput["Decode"] == "1tok/s"


# ---- stop strings
@pytest.mark.parametrize("script, min_tokens, text, reason", [
    ("awbbbbbbbb", 6, "awbbbbbbbb", "length"),  # a "w" before min_tokens is never found again
    ("awbbbbwbbb", 6, "awbbbb", "stop"),  # the next one, after min_tokens, ends it
    ("abbbbwbbbb", 6, "abbbbwbbbb", "length"),  # nor the 6th: min_tokens tokens come first (vLLM v1)
    ("abbbwbbbbb", 6, "abbbwbbbbb", "length"),  # nor when the 6th token comes right after it
    ("awbbbbbbbb", 0, "a", "stop"),
    ("abbbbbbbbw", 6, "abbbbbbbb", "stop"),  # the last token (max_tokens) may end it too
])
def test_each_stop_string_is_found_once_after_min_tokens(monkeypatch, own_llm, script, min_tokens, text, reason):
    script_tokens(monkeypatch, own_llm, script)
    params = SamplingParams(max_tokens=10, min_tokens=min_tokens, stop=["w", "q" * 30])
    out = own_llm.generate([PROMPT], params)[0]
    pieces = [increment["text"] for increment in within(30, list, own_llm.submit(PROMPT, params))]
    assert out["text"] == text and out["finish_reason"] == reason
    assert out["stop_reason"] == ("w" if reason == "stop" else None)
    assert out["token_ids"] == ids(script)[:len(out["token_ids"])]
    assert "".join(pieces) == text


def test_a_stop_token_or_the_earliest_stop_string_ends_it(monkeypatch, own_llm):
    script_tokens(monkeypatch, own_llm, "awbbbbbbbb")
    # of two stop strings completed by one token, the one that starts first
    out = own_llm.generate([PROMPT], SamplingParams(max_tokens=10, stop=["b", "wb"]))[0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == ("a", "stop", "wb")
    # a stop token ends it without its text, also where stop strings are looked for
    for stop in (["q" * 30], ["w"]):
        out = own_llm.generate([PROMPT], SamplingParams(max_tokens=10, stop=stop, stop_token_ids=[W]))[0]
        assert out["token_ids"] == [A, W] and out["text"] == "a"
        assert out["finish_reason"] == "stop" and out["stop_reason"] == W
