"""The results file: JSON lines appended one whole line per write, so a kill loses at most the requests in
flight, and a resumed run knows what is done.

`ResultsFile.open(path)` takes an exclusive lock (two runs appending to one file would both serve the same
requests), reads what an earlier run wrote and cuts off a torn last line (a write the kill interrupted: that
request is then served again). Each `write` reaches the operating system at once; the file is fsynced about
once a second and on close, so a crash of the machine loses at most the last second. A line in the middle
that is not JSON means someone else wrote the file: that is an error, never repaired silently.
Writing to stdout (`-`) resumes nothing: what went out cannot be read back (so signals wait: `signals_held`).
"""
import fcntl
import json
import os
import signal
import threading
import time
from contextlib import contextmanager

from nanovllm.batch.protocol import output_key

FSYNC_INTERVAL = 1.0  # seconds


@contextmanager
def signals_held():
    """SIGINT and SIGTERM wait until the block ends, then reach their own handlers (raised again): for what a
    signal must not cut in two, a result line or a run's clean-up. Only the main thread runs signal handlers, so
    elsewhere it holds nothing (nor where a handler was set outside Python). A write that blocks on a reader that
    never reads holds them for good."""
    signums = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, signums):
        yield
        return
    held = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


class ResultsFile:

    def __init__(self, fd: int, name: str, seekable: bool):
        self.fd, self.name, self.seekable = fd, name, seekable
        self.done: dict[tuple, bool] = {}  # key of each line already written -> whether it is an error
        self._last_sync = time.monotonic()

    @classmethod
    def open(cls, path: str) -> "ResultsFile":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another process is writing {path} (it holds its lock); wait for it to end, "
                               "or write to another file") from None
        results = cls(fd, path, seekable=True)
        try:
            results._read_back()
        except BaseException:
            os.close(fd)
            raise
        return results

    @classmethod
    def stdout(cls, fd: int) -> "ResultsFile":
        return cls(fd, "<stdout>", seekable=False)

    def _read_back(self):
        end = 0  # where the last whole line ends
        with open(self.fd, "rb", closefd=False) as f:
            f.seek(0)
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    break  # the torn last line
                end += len(raw)
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = None
                if not isinstance(obj, dict) or (key := output_key(obj)) is None:
                    raise ValueError(f"{self.name} line {number} is not a result line of run_batch; "
                                     "move the file aside or fix that line")
                self.done[key] = obj.get("error") is not None
        if os.fstat(self.fd).st_size > end:
            os.ftruncate(self.fd, end)

    def write(self, obj: dict):
        self.write_text(json.dumps(obj, ensure_ascii=False))

    def write_text(self, line: str):
        data = (line + "\n").encode()
        while data:  # os.write may write part of it (a pipe, a signal: `signals_held`)
            data = data[os.write(self.fd, data):]
        if self.seekable and time.monotonic() - self._last_sync > FSYNC_INTERVAL:
            os.fsync(self.fd)
            self._last_sync = time.monotonic()

    def close(self):
        if self.fd >= 0:
            if self.seekable:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
