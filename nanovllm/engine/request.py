"""The online API: the engine's loop thread, request handles, and incremental detokenization for streams.

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
    """Text pieces of a growing list of token ids: never half of a multi-byte character, and the pieces
    concatenate to `tokenizer.decode(token_ids)`.

    Each new piece is the difference between decoding the tokens since `prefix_offset` with and without the
    newest ones, so a tokenizer that treats the first token of a decode specially sees the same context twice.
    A piece that ends in U+FFFD (an incomplete UTF-8 sequence) is held back until more tokens complete it.
    """

    def __init__(self, tokenizer, lock: threading.Lock):
        self.tokenizer, self.lock = tokenizer, lock
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""  # what has been emitted

    def _decode(self, token_ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(token_ids)

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

    def finish(self, final_text: str) -> str:
        """Whatever of the final text is still held back."""
        piece = final_text[len(self.text):] if final_text.startswith(self.text) else ""
        self.text += piece
        return piece


class RequestHandle:
    """One submitted request: iterate it for increments, `result()` for the final output, `abort()` to end it.

    Each increment is a dict with `token_ids` (new ids), `text` (new text) and `finished`; the last one also
    has `finish_reason`.
    """

    def __init__(self, engine, seq: Sequence, detokenizer: IncrementalDetokenizer | None):
        self._engine = engine
        self.seq = seq
        self._detokenizer = detokenizer  # None: nobody streams this request, so no pieces are made
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

    def _on_token(self, token_id: int):
        if self._detokenizer is not None and not self.seq.is_finished:
            self._put({"token_ids": [token_id], "text": self._detokenizer.push([token_id]), "finished": False})

    def _on_finish(self, output: dict, last_token_ids: list[int]):
        self._output = output
        if self._detokenizer is not None:
            text = self._detokenizer.push(last_token_ids) + self._detokenizer.finish(output["text"])
            self._put({"token_ids": last_token_ids, "text": text, "finished": True,
                       "finish_reason": output["finish_reason"]})
        self._done.set()

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
