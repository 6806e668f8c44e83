"""The input side of a batch run: each input line becomes a request to serve, an error line to write, or a
skip (an earlier run wrote its result), in input order and without holding the file in memory (only the
custom_ids seen so far are kept, to catch duplicates).

A custom_id is served once: its first line wins, and a later line with the same custom_id gets an error line
with custom_id null (so the output still has exactly one line per custom_id) whose message names both lines.
"""
import queue
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from nanovllm.batch.protocol import LineError, error_line, parse_request, read_line, request_key
from nanovllm.batch.results import signals_held

EOF = object()


@dataclass
class Stats:
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0  # lines an earlier run wrote
    skipped_failed: int = 0  # ... of which errors
    interrupted: int = 0  # requests stopped before they finished (a resumed run serves them)
    completion_tokens: int = 0
    errors: Counter = field(default_factory=Counter)  # error code -> lines, this run

    @property
    def lines(self) -> int:
        return self.succeeded + self.failed + self.skipped

    @property
    def any_failed(self) -> bool:
        return self.failed + self.skipped_failed > 0


def intake(lines: Iterable[bytes], done: dict[tuple, bool]) -> Iterator[tuple]:
    """Yields ("skip", failed_before), ("error", error_line) or ("request", BatchRequest, text) per non-blank
    line; `done` maps the keys of lines already written to whether they were errors."""
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            try:  # a byte-order mark, as some editors write, is no part of the first request
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise LineError("invalid_json", f"line {number} is not UTF-8 text: {e}") from None
            obj, custom_id = read_line(text, number)
            if custom_id in first_line:
                raise LineError("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} was already used "
                                f"on line {first_line[custom_id]}; each request needs its own")
        except LineError as e:  # reported by line number, with custom_id null
            key = request_key(None, number)
            yield ("skip", done[key]) if key in done else ("error", error_line(None, number, e.code, e.message))
            continue
        first_line[custom_id] = number
        key = request_key(custom_id, number)
        if key in done:
            yield ("skip", done[key])
            continue
        try:
            yield ("request", parse_request(obj, custom_id, number), text)
        except LineError as e:
            yield ("error", error_line(custom_id, number, e.code, e.message))


def record(results, stats: Stats, item: tuple):
    """Write an error line or count a skip."""
    if item[0] == "skip":
        stats.skipped += 1
        stats.skipped_failed += item[1]
    else:
        with signals_held():  # written and counted at once
            results.write(item[1])
            stats.failed += 1
            stats.errors[item[1]["error"]["code"]] += 1


class Reader:
    """Runs `intake` on its own thread into a bounded queue: a slow input (a pipe) never delays the writing of
    finished results, and at most `maxsize` lines wait in memory. The queue ends with EOF, or an exception."""

    def __init__(self, items: Iterator[tuple], maxsize: int):
        self.queue: queue.Queue = queue.Queue(maxsize)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(items,), daemon=True, name="run_batch-reader")
        self._thread.start()

    def _run(self, items: Iterator[tuple]):
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(EOF)
        except BaseException as e:  # an unreadable input ends the run with this error
            self._put(e)

    def _put(self, item) -> bool:
        while not self._stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def stop(self):
        """Let the thread end (it may still be blocked reading its input: it is a daemon)."""
        self._stopped.set()
