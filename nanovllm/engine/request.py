"""The online API: the engine's loop thread, request handles, and incremental detokenization for streams
and stop strings.

A handle is filled by the engine's loop thread and read by any thread (iteration, `result()`) or by asyncio
(`LLM.stream`). The loop never waits for a reader: each handle has its own unbounded queue, so a slow consumer
of one stream does not stall the others.
"""
import asyncio
import queue
import threading
import weakref

from nanovllm.engine.sequence import Sequence


class IncrementalDetokenizer:
    """The text of a growing list of token ids, a piece at a time: never half of a multi-byte character, and
    the pieces concatenate to `tokenizer.decode(token_ids)`.

    Each new piece is the difference between decoding the tokens since `prefix_offset` with and without the
    newest ones, so a tokenizer that treats the first token of a decode specially sees the same context twice.
    A piece that ends in U+FFFD (an incomplete UTF-8 sequence) is held back until more tokens complete it.
    """

    def __init__(self, tokenizer, lock: threading.Lock, skip_special_tokens: bool = False):
        self.tokenizer, self.lock, self.skip_special_tokens = tokenizer, lock, skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""  # the pieces so far
        self.searched = 0  # stop strings have been looked for in text[:searched]

    def _decode(self, token_ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        piece = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += piece
        return piece

    def find_stop(self, stops: list[str]) -> tuple[str, int] | None:
        """The earliest stop string that ends in the text added since the last call, and where it starts."""
        start = max(self.searched - max(map(len, stops)) + 1, 0)
        self.searched = len(self.text)
        hits = [(index, stop) for stop in stops if (index := self.text.find(stop, start)) >= 0]
        return min(hits)[::-1] if hits else None


class RequestHandle:
    """One submitted request: iterate it for increments, `result()` for the final output, `abort()` to end it.

    Each increment is a dict with `token_ids` (new ids), `text` (new text) and `finished`; the last one also
    has `finish_reason` and `stop_reason`. The handle also finds stop strings, which need the text.
    """

    def __init__(self, engine, seq: Sequence, stream: bool):
        self._engine = engine
        self.seq = seq
        params = seq.params
        self._stream = stream  # False: nobody reads increments, so none are made
        self._detokenizer = (IncrementalDetokenizer(engine.tokenizer, engine._tokenizer_lock,
                                                    params.skip_special_tokens) if stream or params.stop else None)
        self._streamed = 0  # characters of text sent in increments
        # a stream holds back what may yet turn out to be the start of a stop string
        self._holdback = max(map(len, params.stop), default=1) - 1
        self._increments: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._done = threading.Event()
        self._output: dict | None = None
        self._error: BaseException | None = None

    @property
    def request_id(self) -> int:
        return self.seq.seq_id

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def abort(self):
        """End the request now and free its KV blocks; it finishes with finish_reason "abort"."""
        self._engine._abort(self)

    def result(self, timeout: float | None = None) -> dict:
        """The same dict that `generate()` returns for this prompt."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._output

    def __iter__(self):
        while True:
            item = self._increments.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item["finished"]:
                return

    # ---- called by the engine's loop thread ---------------------------------------------------------
    def _put(self, item):
        self._increments.put(item)
        for loop, async_queue in self._listeners:
            loop.call_soon_threadsafe(async_queue.put_nowait, item)

    def _on_token(self, token_id: int) -> bool:
        """Take a sampled token; True when it completed a stop string (the text is then cut before it)."""
        seq, detokenizer = self.seq, self._detokenizer
        if detokenizer is None or seq.finish_reason == "stop":  # a stop token's text is not part of the output
            return False
        detokenizer.push([token_id])
        if seq.params.stop:
            hit = detokenizer.find_stop(seq.params.stop)
            if hit is not None and seq.num_completion_tokens >= seq.params.min_tokens:
                seq.stop_reason, end = hit
                detokenizer.text = detokenizer.text[:end]
                return True
        if self._stream and not seq.is_finished:
            end = max(len(detokenizer.text) - self._holdback, self._streamed)
            text, self._streamed = detokenizer.text[self._streamed:end], end
            self._put({"token_ids": [token_id], "text": text, "finished": False})
        return False

    def _on_finish(self, last_token_ids: list[int]):
        self._output = output = self._make_output()
        if self._stream:
            self._put({"token_ids": last_token_ids, "text": output["text"][self._streamed:], "finished": True,
                       "finish_reason": output["finish_reason"], "stop_reason": output["stop_reason"]})
        self._done.set()

    def _make_output(self) -> dict:
        seq = self.seq
        token_ids = seq.completion_token_ids
        if isinstance(seq.stop_reason, str):
            text = self._detokenizer.text  # cut before the stop string
        else:  # nor is the text of an EOS or stop token part of it
            text = self._engine.decode(token_ids[:-1] if seq.finish_reason == "stop" else token_ids,
                                       seq.params.skip_special_tokens)
        return {
            "text": text,
            "token_ids": token_ids,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "num_cached_tokens": max(seq.num_cached_tokens, 0),
            "logprobs": seq.logprobs,
        }

    def _on_error(self, error: BaseException):
        self._error = error
        self._put(error)
        self._done.set()


class EngineLoop:
    """The background thread that runs steps while there is work and sleeps when there is none.

    It holds the engine only weakly between iterations, so a dropped engine can still be collected.
    """

    def __init__(self):
        self.cond = threading.Condition()
        self.inbox: list[tuple[str, RequestHandle]] = []
        self.thread: threading.Thread | None = None
        self.stopping = False

    def start(self, engine):
        if self.thread is None:  # called under self.cond
            self.thread = threading.Thread(target=self._run, args=(weakref.ref(engine),), daemon=True,
                                           name="nanovllm-engine-loop")
            self.thread.start()

    def _run(self, engine_ref):
        while True:
            engine = engine_ref()
            if engine is None or self.stopping:
                return
            busy = engine._run_once()
            del engine
            if not busy:
                with self.cond:
                    if not self.inbox and not self.stopping:
                        self.cond.wait(timeout=1.0)

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
