"""The online API: the engine's loop thread and request handles (their increments, and stop strings).

A handle is filled by whoever steps the engine (its loop thread, or a caller of `step()`) and read by any
thread (iteration, `result()`) or by asyncio (`LLM.stream`). Nobody waits on a reader: each handle keeps its
own increments, so a slow consumer of one stream does not stall the others.

Lifecycle guarantees: every handle finishes exactly once, with an output or an error. A step that raises fails
the requests in flight, and the engine serves the next ones; a loop thread that stops on an unexpected error fails
every pending request, and later calls raise, naming it; `close()`, or the interpreter's exit (`close_at_exit`),
ends the requests in flight with `finish_reason="abort"`.
"""
import asyncio
import atexit
import threading
import time
import weakref

from nanovllm.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, completion_text
from nanovllm.engine.sequence import PENDING, Sequence


class RequestHandle:
    """One submitted request: iterate it for increments, `result()` for the final output, `abort()` to end it.

    Each increment is a dict with `token_ids` (new ids), `text` (new text) and `finished`; the last one also
    has `finish_reason` and `stop_reason`. A handle that was not submitted for streaming (`generate`,
    `add_request`) yields a single increment, the whole completion, when it finishes. Every iteration replays
    the increments from the first, so a handle can be iterated again, or by two threads. The handle also finds
    stop strings, which need the text.

    Increments are made by their reader (for an asyncio listener, which cannot ask, by whoever steps), so the loop
    thread detokenizes only for listeners and stop strings: a reader that keeps up gets one increment per token,
    one that comes late gets the tokens it missed in one.
    """

    def __init__(self, loop: "EngineLoop", tokenizer, tokenizer_lock: threading.Lock, seq: Sequence,
                 stream: bool, for_step: bool = False):
        self._loop = loop
        self._tokenizer, self._tokenizer_lock = tokenizer, tokenizer_lock
        self.seq = seq
        params = seq.params
        self._stream = stream  # False: nobody reads increments before the end, so none are made
        # (see completion_text)
        self._context = seq.token_ids[max(seq.num_prompt_tokens - CONTEXT_TOKENS, 0):seq.num_prompt_tokens]
        self._detokenizer = (IncrementalDetokenizer(tokenizer, tokenizer_lock, params.skip_special_tokens,
                                                    self._context) if stream or params.stop else None)
        self._streamed = 0  # characters of text sent in increments
        self._sent = 0  # token ids sent in increments
        # a stream holds back what may yet turn out to be the start of a stop string
        self._holdback = max(map(len, params.stop), default=1) - 1
        self._increments: list = []  # every increment made so far (and a final error, if any)
        self._unread: list[int] = []  # tokens sampled since the last increment was made
        self._last = None  # once finished: the output (or error) whose increment is not made yet
        self._changed = threading.Condition()  # guards the increments, what is not in them yet, and the finish
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._done = threading.Event()
        self._output: dict | None = None
        self._error: BaseException | None = None
        self.for_step = for_step  # `add_request`'s: `step()` returns it finished, unless a reader waited on it
        # failed with an error of its own (`LLMEngine._fail_request`: its bookkeeping raised), the engine and the
        # requests beside it going on; False for a step's error, which every request in flight shares
        self.failed_alone = False

    @property
    def request_id(self) -> int:
        return self.seq.seq_id

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def abort(self):
        """End the request soon and free its KV blocks; it finishes with finish_reason "abort"."""
        self._loop.post("abort", self)

    def result(self, timeout: float | None = None) -> dict:
        """The same dict that `generate()` returns for this prompt. A timeout leaves the request running:
        call `abort()` to end it."""
        self._loop.need_progress(self)
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s (it is still "
                               "running: abort() ends it)")
        if self._error is not None:
            raise self._error
        return self._output

    def __iter__(self):
        self._loop.need_progress(self)
        index = 0
        while True:
            with self._changed:
                while index == len(self._increments):
                    if not self._make_increments():
                        self._changed.wait()
                item = self._increments[index]
            index += 1
            if isinstance(item, BaseException):
                raise item
            yield item
            if item["finished"]:
                return

    def _add_listener(self, listener: tuple[asyncio.AbstractEventLoop, asyncio.Queue]):
        with self._changed:
            self._make_increments()
            self._listeners.append(listener)
            for item in self._increments:  # whatever came before the listener
                listener[0].call_soon_threadsafe(listener[1].put_nowait, item)

    def _remove_listener(self, listener):
        with self._changed:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _make_increments(self) -> bool:
        """Turn the tokens sampled since the last increment into one, or, once finished, into the last one
        (whose text is the rest of the output's); True when it made any. Called under `_changed`, by a reader
        or, for listeners, by whoever steps."""
        last, self._last = self._last, None
        finished = last is not None and not isinstance(last, BaseException)
        made = last is not None
        if self._unread and not finished:
            detokenizer = self._detokenizer
            try:
                if not self.seq.params.stop:  # else the text is there already: stop strings needed it at once
                    detokenizer.push(self._unread)
            except Exception:
                if last is None:
                    raise  # the reader's (or the step's) error; the tokens stay unread
                # finishing with an error: that error still ends the stream, without these tokens (whose text
                # could not be made); raising here would lose it and leave readers and listeners waiting
                self._unread = []
            else:
                end = max(len(detokenizer.text) - self._holdback, self._streamed)
                self._record({"token_ids": self._unread, "text": detokenizer.text[self._streamed:end],
                              "finished": False})
                self._sent += len(self._unread)
                self._unread, self._streamed, made = [], end, True
        if finished:  # the rest of the output (the tokens that ended it were never unread)
            self._record({"token_ids": last["token_ids"][self._sent:], "text": last["text"][self._streamed:],
                          "finished": True, "finish_reason": last["finish_reason"],
                          "stop_reason": last["stop_reason"]})
            self._unread = []
        elif last is not None:
            self._record(last)
        if made:
            self._changed.notify_all()
        return made

    def _record(self, item):
        self._increments.append(item)
        for listener in list(self._listeners):
            loop, queue = listener
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # its event loop has closed: nobody can read it any more
                self._listeners.remove(listener)

    def _finish(self, last: dict | BaseException):
        """Finish with `last`, the output or an error; nothing changes once the handle has finished."""
        with self._changed:
            if self._done.is_set():
                return
            self._error = last if isinstance(last, BaseException) else None
            self._output = None if self._error else last
            self._last = last
            self._done.set()
            if self._listeners:
                self._make_increments()
            self._changed.notify_all()

    # ---- called by whoever steps the engine ----
    def _on_token(self, token_id: int) -> bool:
        """Take a sampled token; True when it completed a stop string (the text is then cut before it)."""
        seq, detokenizer = self.seq, self._detokenizer
        stop_token = seq.finish_reason == "stop"  # a stop token's text is not part of the output
        if detokenizer is None or stop_token and not seq.params.stop:
            return False
        with self._changed:  # a reader never sees text that a stop string will cut
            if seq.params.stop:
                # the last token: text held back as half a character is final, and a stop string in it counts
                detokenizer.push([] if stop_token else [token_id], final=seq.is_finished)
                hit = detokenizer.find_stop(seq.params.stop)
                if hit is not None and seq.num_completion_tokens > seq.params.min_tokens:  # as vLLM v1
                    seq.stop_reason, end = hit
                    detokenizer.text = detokenizer.text[:end]
                    return True
            if stop_token:
                return False
            if self._stream and not seq.is_finished and not self._done.is_set():
                self._unread.append(token_id)
                if self._listeners:
                    self._make_increments()
                else:
                    self._changed.notify_all()
        return False

    def _on_finish(self):
        """Finish with the output that the sequence holds now. The output is made under `_changed`, so no token
        reaches the stream that it lacks, nor the reverse: close() ends handles while a step may still feed them."""
        with self._changed:
            if not self.finished:
                self._finish(self._make_output())

    def _end_aborted(self):
        """Finish as aborted with the tokens it has (not one still on the device), or with the error if that
        fails (detokenizing). It changes only the sequence's finish reason: close() calls it while a step may
        still use the sequence."""
        seq = self.seq
        seq.finish_reason = seq.finish_reason or "abort"
        try:
            self._on_finish()
        except Exception as e:
            self._on_error(e)

    def _make_output(self) -> dict:
        seq = self.seq
        # read in the reverse of the order a step writes them (token, stop reason, finish reason): an abort by
        # close() while a step ends the sequence then reads a finish that its tokens agree with
        finish_reason, stop_reason = seq.finish_reason, seq.stop_reason
        token_ids = seq.completion_token_ids  # (a copy: a step in flight may still append to the sequence)
        if token_ids and token_ids[-1] == PENDING:  # sampled by a step in flight: not a token of the output
            token_ids.pop()
        if isinstance(stop_reason, str):
            text = self._detokenizer.text  # cut before the stop string
        else:  # nor is the text of an EOS or stop token part of it
            with self._tokenizer_lock:
                text = completion_text(lambda ids, skip: self._tokenizer.decode(ids, skip_special_tokens=skip),
                                       self._context,
                                       token_ids[:-1] if finish_reason == "stop" else token_ids,
                                       seq.params.skip_special_tokens)
        return {
            "text": text,
            "token_ids": token_ids,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "num_cached_tokens": max(seq.num_cached_tokens, 0),
            "logprobs": None if seq.logprobs is None else seq.logprobs[:len(token_ids)],
        }

    def _on_error(self, error: BaseException):
        self._finish(error)


class EngineLoop:
    """The requests of one engine, and the background thread that runs steps while there is work.

    It owns the inbox (requests and aborts not yet taken in) and the handles in flight, so that `close()` and
    a dying thread can finish them without the engine. The thread holds the engine only weakly between
    iterations, so a dropped engine can still be collected; `step_lock` keeps a caller's `step()` and the
    thread from stepping at once.
    """

    def __init__(self, engine):
        self.engine_ref = weakref.ref(engine)
        self.cond = threading.Condition()
        self.inbox: list[tuple[str, RequestHandle]] = []
        self.handles: dict[int, RequestHandle] = {}  # taken into the scheduler, not yet finished
        # `add_request` requests finished, by whoever stepped them (this thread too), for `step()` to return
        self.unreported: dict[int, list[int]] = {}
        self.step_lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.error: RuntimeError | None = None  # why the engine can take no more work, when not closed

    def post(self, kind: str, *handles: RequestHandle):
        """Queue new requests ("add") or aborts for whoever steps next; a closed or dead engine takes no new
        request (checked under `cond`, which `finish_all` empties the inbox under: none is lost)."""
        with self.cond:
            if kind == "add":
                self.check()
            elif self.stopping or self.error is not None:
                return  # every request has been finished already
            self.inbox.extend((kind, h) for h in handles)
            self.cond.notify()

    def take_inbox(self) -> list[tuple[str, RequestHandle]]:
        """Empty the inbox; its new requests join the table here, under `cond` as in `finish_all`, so close() never
        misses a request between the two."""
        with self.cond:
            inbox, self.inbox = self.inbox, []
            for kind, handle in inbox:
                if kind == "add":
                    self.handles[handle.request_id] = handle
        return inbox

    def put_back(self, items: list[tuple[str, RequestHandle]]):
        """What `take_inbox` gave out and nobody took in, back at the front of the inbox (its new requests stay in
        the table, where close() finds them)."""
        with self.cond:
            self.inbox[:0] = items

    def need_progress(self, handle: RequestHandle):
        """A reader waits on `handle`: make sure someone steps (an `add_request` request is stepped by its caller
        until then); `step()` no longer returns it."""
        with self.cond:  # (as `keep_for_step` reads the mark)
            handle.for_step = False
            self.unreported.pop(handle.request_id, None)
        if self.thread is None and self.engine_ref() is not None and not self.stopping:
            self.start()

    def keep_for_step(self, handle: RequestHandle | None):
        """A request finished: keep an `add_request` one's tokens for `step()` to return, whoever stepped it."""
        if handle is None or not handle.for_step:  # the mark only ever goes off: no lock needed to see it off
            return
        with self.cond:
            if handle.for_step:
                self.unreported[handle.request_id] = handle.seq.completion_token_ids

    def check(self):
        """Raise when the engine can take no more work, naming why."""
        if self.stopping:
            raise RuntimeError("the engine is closed")
        if self.error is not None:
            raise RuntimeError(*self.error.args) from self.error.__cause__

    def start(self):
        """Start the thread once (it then sleeps whenever there is no work) and wake it."""
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name="nanovllm-engine-loop")
                self.thread.start()
                STARTED.add(self)
            self.cond.notify()

    def _run(self):
        try:
            while True:
                engine = self.engine_ref()
                if engine is None or self.stopping:
                    return
                busy = engine._run_once()
                del engine
                if not busy:
                    with self.cond:
                        if not self.inbox and not self.stopping:
                            self.cond.wait(timeout=1.0)
        except BaseException as error:  # a bug, not a failed step (those fail their requests): never silent
            failure = RuntimeError(f"the engine's loop thread stopped on an error: {error!r}; close this engine "
                                   "and start a new one")
            failure.__cause__ = error
            self.fail(failure)

    def fail(self, error: RuntimeError):
        """The engine cannot go on (its loop thread died, or a worker did): every request not yet finished
        fails with `error`, and so does every later call. Safe from any thread, during a step too."""
        with self.cond:
            self.error = self.error or error
            self.cond.notify()
        self.finish_all(error=error)

    def finish_all(self, error: BaseException | None = None):
        """End every request not yet finished: with `error`, or else as aborted."""
        self.take_inbox()  # its requests join the table; its aborts are moot
        for request_id, handle in list(self.handles.items()):
            if error is not None:
                handle._on_error(error)
            else:
                handle._end_aborted()
            self.handles.pop(request_id, None)

    def stop(self, timeout: float) -> bool:
        """Abort every request at once, then wait at most `timeout` s for the step in progress (the thread's, or a
        caller's `step()` in another thread); True when none runs any more, nor will (a `step()` that gets the lock
        after this raises "the engine is closed")."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.finish_all()
        if self.thread is threading.current_thread():
            return True  # (the engine finalized on its own thread, between steps)
        deadline = time.monotonic() + timeout
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                return False
        if not self.step_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        self.step_lock.release()
        return True


STARTED: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()  # loops whose thread has started


@atexit.register
def close_at_exit(timeout: float = 15.0):
    """Close every open engine and wait for its loop thread before the interpreter finalizes: else a loop thread
    that let go of its engine last closes it (the finalizer) meanwhile, and a daemon thread still in torch's C++
    code then aborts the process ("terminate called without an active exception")."""
    for loop in list(STARTED):
        engine = loop.engine_ref()
        if engine is not None:  # closed on this thread: its loop thread would run on, or could let go of it last
            engine.close()
        loop.thread.join(timeout)
